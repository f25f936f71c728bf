"""accelrun's Triton kernels through Triton's real compiler, cross-compiled for H100 (sm_90a) and
B200 (sm_100a) on this CPU-only machine, with registers and spills read by the ptxas in Triton's wheel.

The interpreter (test_codegen_triton.py) checks numerics but accepts code the real compiler rejects
and ignores register limits; this checks the other half. Every kernel the generator emits for these
regions must compile, and none may spill (the bound: 0 bytes of spill stores and loads, at 255
registers a thread or fewer, which ptxas enforces). Kernels:

- row reductions at widths 4096 (a row in one tile), 32768 and 128256 (Llama 3's vocabulary: looped):
  softmax's backward, RMSNorm forward and backward (a column reduction too), cross-entropy, an exp
  kept for a later pass, in fp32 (and bf16 at 4096 and 128256);
- every region of the debug Llama's forward and backward graphs (fp32; bf16 autocast gives the same
  kernels with bf16 loads, checked by the widths above and not repeated for time);
- an 8B-shaped Llama block and loss head (dim 4096, GQA 32/8, ffn 14336, vocab 128256, 2048 tokens),
  traced on the meta device, for sm_90 and sm_100.

And one that must spill (a 32768-wide row held whole, as before rows were looped), so that the
spill check is known to see spills. Run with ``-s`` to see the table. Compiles go through Triton's cache (~/.triton/cache), so a second run
is faster than the first.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from accelrun.compile.codegen import triton as triton_codegen
from accelrun.compile.codegen.loop_ir import Unsupported, cached_program
from accelrun.compile.regions import Region
from tests.compile.traced_regions import regions_of


def _ptxas_present() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return shutil.which(get_ptxas(90).path) is not None
    except Exception:  # no NVIDIA backend in this triton build
        return False


pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is not None and not _ptxas_present(),
                       reason="this triton has no NVIDIA backend with its ptxas"),
]  # fmt: skip

WIDTHS = (4096, 32768, 128256)


@dataclass
class Compiled:
    case: str
    graph: str
    kernel: str
    arch: int
    grid: tuple[int, ...]
    tile: tuple[int, int]
    warps: int
    registers: int | None = None
    spill_bytes: int | None = None
    error: str | None = None  # why it did not compile
    looped: bool = False


_DONE: dict[tuple[str, int], list] = {}


def compile_regions(case: str, regions: list[Region], archs: tuple[int, ...]) -> tuple[list[Compiled], list[str]]:
    """Each region's kernels compiled for each arch; and the regions the generator declines (why)."""
    from accelrun.compile.codegen.triton_aot import cross_compile

    rows, declined = [], []
    for region in regions:
        try:
            program = cached_program(region)
            source = triton_codegen.triton_source(program)
        except Unsupported as e:
            declined.append(f"{case} {region.graph_kind} region {region.id}: {e}")
            continue
        looped = {triton_codegen.kernel_name(k) for k in program.kernels if triton_codegen.looped(k)}
        for arch in archs:
            try:
                if (source, arch) not in _DONE:  # equal regions (each layer's norm) compile once
                    _DONE[source, arch] = cross_compile(program, source, arch)
                done = _DONE[source, arch]
            except Exception as e:  # what the real compiler rejects: reported per kernel, asserted below
                first = str(e).strip().splitlines()[:3]
                for ln in triton_codegen.launches(program):
                    rows.append(Compiled(case, region.graph_kind, ln.kernel, arch, ln.grid, (ln.block_r, ln.block_n),
                                         ln.num_warps, error=f"{type(e).__name__}: {' '.join(first)}"))
                continue
            for k in done:
                ln = k.launch
                rows.append(Compiled(case, region.graph_kind, ln.kernel, arch, ln.grid, (ln.block_r, ln.block_n),
                                     ln.num_warps, k.registers, k.spill_bytes,
                                     looped=ln.kernel.removesuffix("_final") in looped))
    return rows, declined


def report(rows: list[Compiled], declined: list[str]) -> None:
    print()
    print(f"{'case':<28} {'graph':<8} {'kernel':<34} {'sm':>3} {'grid':>14} {'tile':>9} {'warps':>5} "
          f"{'regs':>4} {'spill':>5}")  # fmt: skip
    for r in rows:
        tile = f"{r.tile[0]}x{r.tile[1]}" + ("L" if r.looped else "")
        regs = "" if r.registers is None else str(r.registers)
        spill = "" if r.spill_bytes is None else str(r.spill_bytes)
        print(f"{r.case:<28} {r.graph:<8} {r.kernel:<34} {r.arch:>3} {str(list(r.grid)):>14} {tile:>9} {r.warps:>5} "
              f"{regs:>4} {spill:>5}" + (f"  FAILED {r.error}" if r.error else ""))  # fmt: skip
    for d in declined:
        print(f"declined: {d}")
    failed = sum(r.error is not None for r in rows)
    spilled = sum(bool(r.spill_bytes) for r in rows)
    print(f"triton cross-compile: {len(rows)} kernels, {failed} failed, {spilled} spilled")


def assert_compiled_without_spills(rows: list[Compiled]) -> None:
    assert rows, "no kernels"
    failed = [f"{r.case} {r.kernel} sm_{r.arch}: {r.error}" for r in rows if r.error is not None]
    assert not failed, "\n".join(failed)
    spilled = [f"{r.case} {r.kernel} sm_{r.arch}: {r.spill_bytes} bytes, {r.registers} registers"
               for r in rows if r.spill_bytes]
    assert not spilled, "\n".join(spilled)
    assert all(r.registers is not None and 0 < r.registers <= 255 for r in rows)


# -- regions --------------------------------------------------------------------------------------
def rmsnorm(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w


def exp_normalised(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def width_regions(width: int, dtype: torch.dtype) -> dict[str, list[Region]]:
    def x():
        return torch.randn(4, width, dtype=dtype, requires_grad=True)

    return {
        "softmax": regions_of(lambda a: torch.softmax(a, -1) * 2, x()),
        "rmsnorm": regions_of(rmsnorm, torch.randn(2, 4, width, dtype=dtype, requires_grad=True),
                              torch.randn(width, dtype=dtype, requires_grad=True)),
        "cross_entropy": regions_of(lambda lg, t: F.cross_entropy(lg.float(), t), x(), torch.randint(0, width, (4,))),
        "exp_normalised": regions_of(exp_normalised, x()),
    }  # fmt: skip


def llama_regions(args, tokens: torch.Tensor, model_device: str, autocast: bool = False,
                  dtype: torch.dtype | None = None) -> list[Region]:  # fmt: skip
    """The fusion regions accelrun's backend cuts from a Llama's forward and backward graphs (the
    default passes; executors off, so that every region is offered here instead). ``autocast``: bf16
    autocast on the CPU; ``dtype``: the parameters in that dtype (what bf16 means on meta tensors,
    which autocast leaves alone)."""
    from accelrun.compile import backend as backend_module
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.models.families.llama.model import Llama

    found: list[Region] = []
    lower = backend_module.lower_regions

    def keep(*a, **k):
        gm, regions = lower(*a, **k)
        found.extend(regions)
        return gm, regions

    with torch.device(model_device):
        model = Llama(args)
    if model_device != "meta":
        model.init_weights(0)
    if dtype is not None:
        model.to(dtype)
    backend = AccelrunBackend(CompileOptions(executors=["aten"]))
    # A fresh Dynamo: after another Llama's shapes, it would recompile with symbolic sizes, whose
    # regions the generator declines ("input primals_1 is not a tensor").
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend_module, "lower_regions", keep)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.compile(model, backend=backend)(tokens, tokens)
        loss.backward()
    return found


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", WIDTHS)
def test_row_reductions_compile_for_sm90_without_spills(width):
    rows, declined = [], []
    # bf16 changes only the loads and stores: checked at one tile (4096) and at the vocabulary's width.
    for dtype in (torch.float32,) if width == 32768 else (torch.float32, torch.bfloat16):
        for name, regions in width_regions(width, dtype).items():
            r, d = compile_regions(f"{name}_{str(dtype)[6:]}_{width}", regions, (90,))
            rows += r
            declined += d
    report(rows, declined)
    assert not declined, declined  # a 128K row is Triton's too, not ATen's
    assert_compiled_without_spills(rows)
    wide = [r for r in rows if f"x{width}" in r.kernel and "_rows_" in r.kernel]
    assert wide and all(r.looped == (width > triton_codegen.MAX_ROW) for r in wide)


def test_debug_llama_regions_compile_for_sm90_without_spills():
    from accelrun.models.families.llama.model import LlamaArgs

    args = LlamaArgs(dim=192, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=512, vocab_size=512, max_seq_len=256)
    tokens = torch.randint(0, 512, (16, 256), generator=torch.Generator().manual_seed(0))
    rows, declined = compile_regions("debug_llama_fp32", llama_regions(args, tokens, "cpu"), (90,))
    report(rows, declined)
    assert_compiled_without_spills(rows)
    assert {r.graph for r in rows} == {"forward", "backward"}
    assert any("_cols_" in r.kernel for r in rows) and any("_rows_" in r.kernel for r in rows)


def test_8b_shaped_block_compiles_for_sm90_and_sm100_without_spills():
    """One block and the loss head at Llama 3 8B's shapes, traced with meta tensors (no memory)."""
    from accelrun.models.families.llama.model import LlamaArgs

    args = LlamaArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                     max_seq_len=2048)  # fmt: skip
    tokens = torch.zeros(1, 2048, dtype=torch.int64, device="meta")
    rows, declined = compile_regions("llama_8b_block", llama_regions(args, tokens, "meta"), (90, 100))
    report(rows, declined)
    assert_compiled_without_spills(rows)
    assert any(r.looped and "x128256" in r.kernel for r in rows), "the loss head's rows are looped"
    assert {r.arch for r in rows} == {90, 100}


def test_a_32k_row_held_whole_in_registers_spills(monkeypatch):
    """What the looped reduction avoids, and proof that the spill check sees spills: with rows held
    whole in one tile at any width (MAX_ROW lifted), a 32768-wide softmax spills on sm_90."""
    monkeypatch.setattr(triton_codegen, "MAX_ROW", 1 << 20)
    rows, declined = compile_regions("whole_row_32768", regions_of(exp_normalised, torch.randn(4, 32768,
                                                                                               requires_grad=True)),
                                     (90,))  # fmt: skip
    report(rows, declined)
    assert rows and not any(r.looped for r in rows)
    assert all(r.error is None for r in rows) and any(r.spill_bytes for r in rows)
