"""Hugging Face round trip per layout: a transformers checkpoint → `accelrun train` (a few steps) → the
export `checkpoint.hf_on_finish` writes → transformers reads it back. Prints, per family and layout, the
largest |logit| difference between transformers' model and accelrun's own (from the run's final
checkpoint, built without the export code), and the largest relative loss difference from one process.

    python bench/hf_roundtrip.py                          # llama, qwen2 × one, fsdp2, tp2, pp2, fsdp2×tp2
    python bench/hf_roundtrip.py --kinds llama --layouts one tp2

Tiny random-weight models built locally by transformers (nothing downloads); each run goes through the
CLI, as a user's would.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "one": [],
    "fsdp2": ["parallel.nproc_per_node=2", "train.micro_batch=2"],
    "tp2": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2"],
    "pp2": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "fsdp2xtp2": ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch=2"],
}
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def save_model(kind: str, folder: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM"),
                             "gemma": ("GemmaConfig", "GemmaForCausalLM")}[kind]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPE))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms too, so a misplaced norm shows
    model.save_pretrained(folder)


def train(src: Path, runs: Path, name: str, layout: list[str]) -> Path | str:
    """The run directory, or the error line of a layout refused with exit 2."""
    cmd = [sys.executable, "-m", "accelrun.cli.main", "train", "configs/hf-llama.yaml", f"model.hf={src}",
           f"name={name}", f"report.runs_dir={runs}", "report.progress=none", "train.steps=3", "train.seq_len=32",
           "train.global_batch=4", "train.micro_batch=4", "train.device=cpu", "data.max_bytes=400000",
           "data.tokenizer=byte", *layout]  # a random model: its folder has no tokenizer
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode == 2:  # a layout the family does not support: the refusal is the row
        return next((line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")),
                    "exit 2")
    if done.returncode:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    (run_dir,) = list((runs / name).iterdir())
    return run_dir


def accelrun_logits(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """accelrun's own model from the run's final checkpoint (independent of the export code)."""
    from accelrun.train.generate import load_run_model

    with torch.no_grad():
        return load_run_model(run_dir)(tokens)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def main() -> None:
    import os
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import transformers

    transformers.logging.disable_progress_bar()

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["llama", "qwen2"])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    a = ap.parse_args()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    print(f"{'family':<8} {'layout':<10} {'max |Δlogit|':>13} {'max rel Δloss vs one':>21}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.kinds:
            src = Path(tmp) / kind
            save_model(kind, src)
            base = None
            for layout in ["one"] + [x for x in a.layouts if x != "one"]:
                run_dir = train(src, Path(tmp) / "runs", f"{kind}-{layout}", LAYOUTS[layout])
                if isinstance(run_dir, str):
                    print(f"{kind:<8} {layout:<10} refused: {run_dir[:120]}", flush=True)
                    continue
                back = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
                with torch.no_grad():
                    diff = (back(tokens).logits - accelrun_logits(run_dir, tokens)).abs().max().item()
                got = losses(run_dir)
                base = base or got
                rel = max(abs(x - y) / abs(y) for x, y in zip(got, base, strict=True))
                if layout in a.layouts:
                    print(f"{kind:<8} {layout:<10} {diff:>13.2e} {rel:>21.2e}", flush=True)


if __name__ == "__main__":
    main()
