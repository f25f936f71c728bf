"""A transformers checkpoint trained on 2 FSDP, 2 TP and 2 pipeline ranks: every rank loads its part of the HF weights
(the losses equal one process's), and the export transformers reads back gives accelrun's logits. Llama on every
layout; Gemma tied (as published) on FSDP and TP (the vocabulary-sharded embedding is the output layer's weight),
and untied on pipeline stages (which cannot share a tied embedding yet), whose cuts its family spec names (embed_tokens / norm / lm_head, not Llama's tok_embeddings / norm /
output)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.jobs import FSDP2, LOSS_RTOL, losses, train_job
from tests.models.hf_helpers import save_tiny_hf
from tests.train.test_hf_roundtrip import TOL, _accelrun_logits

STEPS = 2
LAYOUTS = {"one": [], "fsdp2": FSDP2, "tp2": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2"],
           "pp2": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe"]}
# Gemma as published (tied) under FSDP and TP: the embedding and the output layer are one sharded parameter.
CASES = [("llama", "fsdp2"), ("llama", "tp2"), ("llama", "pp2"), ("gemma", "fsdp2"), ("gemma", "tp2"),
         ("gemma-untied", "pp2")]


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory):
    """kind -> (its transformers folder, the run directory of one process training it), made on first use."""
    made: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in made:
            src = tmp_path_factory.mktemp("hf") / kind
            save_tiny_hf(src, kind)
            runs = tmp_path_factory.mktemp("runs")
            made[kind] = (src, train_job(runs, STEPS, f"model.hf={src}", "name=one").run_dir)
        return made[kind]

    return get


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_hf_checkpoint_on_two_ranks(kind, layout, hf_sources, tmp_path):
    import transformers

    hf_src, one_process = hf_sources(kind)
    run_dir = train_job(tmp_path, STEPS, f"model.hf={hf_src}", f"name={layout}", "checkpoint.hf_on_finish=true",
                        *LAYOUTS[layout]).run_dir
    got, want = losses(run_dir), losses(one_process)
    assert got == pytest.approx(want, rel=LOSS_RTOL), (got, want)
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    back = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    assert type(back).__name__ == ("GemmaForCausalLM" if kind.startswith("gemma") else "LlamaForCausalLM")
    with torch.no_grad():
        diff = (back(tokens).logits - _accelrun_logits(run_dir, tokens)).abs().max().item()
    assert diff < TOL, f"{kind} {layout}: max |logit difference| {diff:.2e}"
