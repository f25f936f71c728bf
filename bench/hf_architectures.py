"""transformers' causal LMs as a user brings them (``model.custom``): eager against accelrun, one step each.

Tiny configs built locally with random weights (2 layers, hidden 64, 4 heads, vocab 320; nothing is
downloaded), compiled as ``accelrun train`` compiles a user's model (``compile_model`` with the recipe's
``compile.scope: auto``: the repeated decoder layers), trained with ``training_loss_fn``'s loss on the
same batch. Steps are interleaved round by round in one process; the ratio is eager's median step over
accelrun's (> 1: accelrun faster), with a paired bootstrap 95% interval. Each model's losses over the
timed steps are compared too (no optimizer: every step sees the same weights); a model with dropout
(OPT's and GPT-2's default 0.1) draws other masks in each variant, so its losses differ by dropout's noise. The walk that found the masked attention and OPT's region (2026-12-05,
docs/compiler.md) ran these architectures through ``accelrun train``.

    python bench/hf_architectures.py                              # every architecture below
    python bench/hf_architectures.py --models falcon,opt --rounds 30
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelrun.compile.compile_model import compile_model  # noqa: E402
from accelrun.config.schema import CompileConfig  # noqa: E402
from accelrun.models import transformer_blocks  # noqa: E402
from accelrun.models.build import training_loss_fn  # noqa: E402
from accelrun.report.stats import bootstrap_ratio_of_medians  # noqa: E402

VOCAB = 320
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)  # fmt: skip
# name: (config class, model class, the config's own keys beside SMALL's)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=256, num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=256, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=256, num_key_value_heads=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=256, num_key_value_heads=2, pad_token_id=0,
                                                   eos_token_id=0, bos_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(intermediate_size=256, num_key_value_heads=2, head_dim=16,
                                                         sliding_window=64)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict()),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=256, word_embed_proj_dim=64)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(bos_token_id=0, eos_token_id=0)),  # its default dropout 0.1 on attention and residuals
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=256)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=128, num_key_value_heads=2,
                                                            num_local_experts=4, num_experts_per_tok=2)),
}


def build(name: str) -> torch.nn.Module:
    import transformers

    config_class, model_class, own = ARCHITECTURES[name]
    keys = {**SMALL, **own}
    if name == "bloom":  # Bloom names its sizes its own way
        keys = {"vocab_size": VOCAB, "hidden_size": 64, **own}
    torch.manual_seed(0)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**keys))


def measure(name: str, args: argparse.Namespace) -> None:
    # transformers' decoder layers share their wrapper's code: without a reset each model would be another
    # kind of input to one compiled frame, and the ninth would meet Dynamo's recompile limit.
    torch._dynamo.reset()
    eager = build(name)
    compiled = copy.deepcopy(eager)
    record = compile_model(compiled, transformer_blocks(compiled),
                           CompileConfig(backend="accelrun", scope="auto", graph_cache=False)).record  # fmt: skip
    ids = torch.randint(0, 258, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    variants = [(eager, training_loss_fn(eager)), (compiled, training_loss_fn(compiled))]
    times: list[list[float]] = [[], []]
    losses: list[list[float]] = [[], []]
    for r in range(args.warmup + args.rounds):
        for i, (model, loss_fn) in enumerate(variants):
            t0 = time.perf_counter()
            loss = loss_fn(inputs, targets)
            loss.backward()
            model.zero_grad(set_to_none=True)  # no optimizer: every step sees the same weights
            if r >= args.warmup:
                times[i].append(time.perf_counter() - t0)
                losses[i].append(float(loss.detach()))
    ci = bootstrap_ratio_of_medians([[t] for t in times[0]], [[t] for t in times[1]], paired=True)
    worst = max(abs(a - b) / abs(a) for a, b in zip(*losses, strict=True))
    print(f"| {name} | {statistics.median(times[0]) * 1e3:.1f} ms | {statistics.median(times[1]) * 1e3:.1f} ms | "
          f"{ci.ratio:.2f}× ({ci.low:.2f}–{ci.high:.2f}) | {worst:.1e} | {record.compiled_line()} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(ARCHITECTURES), help="comma-separated, from: " + ", ".join(ARCHITECTURES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.batch} x {args.seq} tokens, "
          f"{args.rounds} interleaved rounds after {args.warmup}\n")
    print("| model | eager step | accelrun step | eager / accelrun (95% interval) | losses' largest relative difference "
          "| compiled |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in args.models.split(","):
        measure(name.strip(), args)


if __name__ == "__main__":
    main()
