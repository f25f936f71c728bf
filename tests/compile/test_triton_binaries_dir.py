"""accelrun's Triton binaries are filed beside their generated modules, whatever TRITON_CACHE_DIR the
process has (Inductor sets it to its own cache when it compiles its first kernel): on an H100 a new
process otherwise looked elsewhere, found nothing and compiled every kernel again (a 7.7 s warm start).
Checked with a fake kernel (the warm-up's directory) and with Triton's real compiler, cross-compiling
for sm_90 here (that this Triton files its binaries where the variable says)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from types import SimpleNamespace

import pytest

from accelrun.compile.codegen import triton_aot
from accelrun.compile.codegen.triton import Launch


def test_warm_up_compiles_into_the_modules_bin_folder_and_restores_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductor-triton"))  # as Inductor leaves it
    seen = []

    class FakeKernel:
        def warmup(self, *dtypes, **meta):
            seen.append(os.environ["TRITON_CACHE_DIR"])
            return SimpleNamespace(n_regs=32, n_spills=0)

    module = SimpleNamespace(__file__=str(tmp_path / "accelrun_abc.py"), k0=FakeKernel())
    launch = Launch("k0", (1,), (), block_r=1, block_n=16, num_warps=4)
    monkeypatch.setattr(triton_aot, "launches", lambda program: [launch])
    monkeypatch.setattr(triton_aot, "buffer_dtypes", lambda program: {})
    assert triton_aot.warm_up(program=None, module=module) == ["k0: 32 registers, 0 spills, 4 warps"]
    assert seen == [str(tmp_path / "bin")]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "inductor-triton")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tritons_real_compiler_files_binaries_where_the_context_says(tmp_path, monkeypatch):
    import triton

    from accelrun.torch_private import ASTSource, GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    module = triton_aot.import_compilable(
        "import triton\nimport triton.language as tl\n\n@triton.jit\n"
        "def twice(x, y, BLOCK: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n    tl.store(y + i, 2 * tl.load(x + i))\n")
    src = ASTSource(fn=module.twice, signature={"x": "*fp32", "y": "*fp32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 64})  # fmt: skip
    generated = tmp_path / "accelrun_twice.py"
    with triton_aot.kernel_binaries_beside(generated):
        try:
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except Exception as e:  # noqa: BLE001  (a triton build without the NVIDIA backend)
            pytest.skip(f"this triton cannot cross-compile for sm_90: {type(e).__name__}")
    assert any((tmp_path / "bin").rglob("*.cubin")), sorted(p.name for p in tmp_path.rglob("*"))
    assert not (tmp_path / "elsewhere").exists()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "elsewhere")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_importing_a_compilable_module_leaves_no_folder_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp and TemporaryDirectory put theirs
    module = triton_aot.import_compilable(
        "import triton\nimport triton.language as tl\n\n@triton.jit\n"
        "def once(x, BLOCK: tl.constexpr):\n    tl.store(x + tl.arange(0, BLOCK), 1.0)\n")
    assert "tl.store" in module.once.src  # triton read the kernel's source while the file was there
    assert list(tmp_path.iterdir()) == []
