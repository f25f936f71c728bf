"""Load time and peak memory of reading a ~1B Hugging Face checkpoint into accelrun, on 1 and 2 ranks.

    python bench/hf_load.py                      # Llama-3.2-1B's shape, random bf16 weights, in a temp folder
    python bench/hf_load.py --folder /shared/models/Llama-3.2-1B --ranks 1 2 4

Without ``--folder`` the checkpoint is written first: transformers' own ``LlamaConfig`` (Llama 3.2 1B's
published shape: 16 layers, dim 2048, 32/8 heads, ffn 8192, vocab 128256, tied embeddings) and random
bf16 tensors under transformers' names, in 2 GB shards with an index (what ``save_pretrained`` writes;
nothing downloads). Each layout then runs in fresh processes (gloo ranks for 2+): build on ``meta``,
apply FSDP over the ranks, materialise the local shard, read the weights (``accelrun.models.hf_io``).
Printed per layout: the load's wall time (slowest rank), the parameter bytes a rank holds, and the
rank's peak resident memory above what it held before loading (``ru_maxrss``, the whole process; the
pages of the memory-mapped files a rank touches count). The files are read once beforehand, so every
layout reads them from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import time
from pathlib import Path

LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_theta=500000.0, tie_word_embeddings=True)


def write_checkpoint(folder: Path, shard_bytes: int = 2 * 2**30) -> int:
    """A transformers folder of Llama 3.2 1B's shape with random bf16 weights; returns its parameter count."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**LLAMA_3_2_1B, torch_dtype="bfloat16")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.LlamaForCausalLM(config).state_dict().items()
                  if n != "lm_head.weight"}  # tied: the file has no separate output layer
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    shards, size = [{}], 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for f, shard in zip(files, shards, strict=True):
        save_file(shard, str(folder / f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, f))
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    return total // 2


def _rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from accelrun.config import load_config
    from accelrun.dist.context import ParallelContext
    from accelrun.dist.layout import apply_layout
    from accelrun.dist.mesh import build_mesh, dp_coordinates
    from accelrun.models import build_model
    from accelrun.models.build import materialize_local
    from accelrun.models.hf_io import load_hf_for_config

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = load_config("configs/hf-llama.yaml", [f"model.hf={folder}", f"parallel.nproc_per_node={world}",
                                                "train.seq_len=128", "data.tokenizer=byte"]).config  # no tokenizer here
    ctx = ParallelContext.single(torch.device("cpu"))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = build_mesh(cfg.parallel, "cpu", world)
        dp_rank, dp_size = dp_coordinates(mesh)
        ctx = ParallelContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), mesh=mesh,
                              dp_rank=dp_rank, dp_size=dp_size)
    model = build_model(cfg.model, torch.device("meta"))
    with tempfile.TemporaryDirectory() as dump:
        apply_layout(model, cfg, ctx, Path(dump))
    materialize_local(model, torch.device("cpu"), seed=0)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    tensors = load_hf_for_config([model], cfg.model)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"rank": rank, "seconds": seconds, "tensors": tensors, "held": held,
                                     "before": before, "peak": peak}))
    if world > 1:
        dist.destroy_process_group()


def run_layout(folder: Path, world: int, work: Path) -> list[dict]:
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = multiprocessing.get_context("spawn")
    outs = [work / f"rank{world}-{r}.json" for r in range(world)]
    procs = [mp.Process(target=_rank, args=(r, world, port, str(folder), str(outs[r]))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{world} ranks: a rank exited with {[p.exitcode for p in procs]}")
    return [json.loads(o.read_text()) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", type=Path, help="an existing transformers Llama folder (default: write one)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = a.folder
        if folder is None:
            folder = work / "llama-3.2-1b-shape"
            t0 = time.perf_counter()
            n = write_checkpoint(folder)
            print(f"wrote {n / 1e9:.2f} B parameters (bf16, {len(list(folder.glob('*.safetensors')))} shards) "
                  f"in {time.perf_counter() - t0:.0f} s")
        disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        for f in folder.glob("*.safetensors"):  # every layout then reads from the page cache alike
            with f.open("rb") as handle:
                while handle.read(64 * 2**20):
                    pass
        print(f"checkpoint: {folder} ({disk / 2**30:.2f} GiB of safetensors)")
        print(f"{'ranks':>5} {'load s':>7} {'tensors':>8} {'held GiB':>9} {'peak RSS GiB':>13} {'added GiB':>10}")
        for world in a.ranks:
            rows = run_layout(folder, world, work)
            slowest = max(r["seconds"] for r in rows)
            worst = max(rows, key=lambda r: r["peak"])
            print(f"{world:>5} {slowest:>7.1f} {rows[0]['tensors']:>8} {worst['held'] / 2**30:>9.2f} "
                  f"{worst['peak'] / 2**30:>13.2f} {(worst['peak'] - worst['before']) / 2**30:>10.2f}")
    print("held: fp32 parameters one rank holds; peak RSS: the rank's whole process at its highest; "
          "added: peak minus the high-water mark before the load began (what reading the files cost)")


if __name__ == "__main__":
    main()
