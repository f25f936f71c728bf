"""The MoE family: routing and grouped expert matmuls against a naive loop, the load-balancing loss
by hand, FLOPs on active parameters, the model's loss and router figures, the recipes, bad input.

Tolerances: fp32, the grouped paths sum in a different order than the loop (outputs within 1e-5
relative to their scale, gradients likewise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import ConfigError, load_config
from accelrun.config.schema import ModelConfig
from accelrun.models import build_model
from accelrun.models.families.moe.experts import (
    expert_forward,
    grouped_mm_takes,
    grouped_swiglu,
    reference_moe,
    route,
)
from accelrun.models.families.moe.model import MoE, MoEArgs
from accelrun.models.families.moe.shape import active_param_count, flops_per_token, param_count
from accelrun.torch_private import grouped_mm
from tests.conftest import REPO, TINY

RECIPES = REPO / "recipes" / "model"
MOE_CONFIG = REPO / "configs" / "moe.yaml"


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("capacity", [None, 3, 1])
@pytest.mark.parametrize("impl", ["split_mm", "padded_bmm", "grouped_mm"])
def test_grouped_experts_equal_a_loop_over_experts(impl, capacity):
    torch.manual_seed(0)
    B, T, D, X, K, C = 3, 10, 8, 4, 2, 16
    x = torch.randn(B * T, D, requires_grad=True)
    logits = torch.randn(B * T, X)
    ws = [torch.randn(X, D, C, requires_grad=True), torch.randn(X, D, C, requires_grad=True),
          torch.randn(X, C, D, requires_grad=True)]
    routing = route(logits, B, T, K, capacity)
    x_AD = x[routing.token_A]
    out_AD = grouped_swiglu(x_AD, routing.counts_X, *ws, impl=impl)
    got = torch.zeros_like(x).index_add(0, routing.token_A, out_AD * routing.gate_A[:, None])
    want, keep = reference_moe(x, logits, B, T, K, capacity, *ws)
    assert _close(got, want)
    # Dropping: the same assignments, and the counts the metrics report.
    assert int(routing.dropped) == int((~keep).sum())
    assert (capacity is None) == (int(routing.dropped) == 0)
    if capacity is not None:  # no expert takes more than capacity of any sequence's assignments
        assert int(routing.counts_X.max()) <= capacity * B
    assert routing.tokens_per_expert.sum() == B * T * K
    g_got = torch.autograd.grad(got.square().sum(), [x, *ws])
    g_want = torch.autograd.grad(want.square().sum(), [x, *ws])
    for a, b in zip(g_got, g_want, strict=True):
        assert _close(a, b), (a - b).abs().max()


def test_the_cpu_default_gives_an_idle_expert_no_rows_and_dropped_rows_zeros():
    """split_mm, the CPU's default: an expert no token chose (a trained router leaves some idle), and
    rows past the kept ones (dropped by capacity), against padded_bmm, values and gradients."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(12, 8, requires_grad=True)  # 9 kept, 3 dropped
    ws = [torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True),
          torch.randn(4, 16, 8, requires_grad=True)]
    got, want = (grouped_swiglu(x, counts, *ws, impl=impl) for impl in ("split_mm", "padded_bmm"))
    assert got.shape == (12, 8) and (got[9:] == 0).all()
    assert _close(got, want)
    for a, b in zip(torch.autograd.grad(got.square().sum(), [x, *ws]),
                    torch.autograd.grad(want.square().sum(), [x, *ws]), strict=True):
        assert _close(a, b)


def test_torchs_grouped_kernel_only_where_it_takes_the_operands():
    """CUDA's default is torch._grouped_mm, which (kernel and meta function alike, torch 2.13) takes bf16
    rows of whole 16-byte steps; anything else runs split_mm (an fp32 MoE on a GPU failed in Dynamo's
    trace). The meta function's own refusals are checked, so a torch that lifts them fails here."""
    assert grouped_mm_takes("cuda", torch.bfloat16, 192, 256)
    assert not grouped_mm_takes("cuda", torch.float32, 192, 256)
    assert not grouped_mm_takes("cuda", torch.bfloat16, 192, 12)
    assert not grouped_mm_takes("cpu", torch.bfloat16, 192, 256)
    offs = torch.empty(4, device="meta", dtype=torch.int32)
    for dtype, ffn in ((torch.float32, 16), (torch.bfloat16, 12)):
        with pytest.raises(RuntimeError, match="BF16|multiple of 16 bytes"):
            grouped_mm(torch.empty(16, 8, device="meta", dtype=dtype),
                              torch.empty(4, 8, ffn, device="meta", dtype=dtype), offs=offs)
    y = grouped_mm(torch.empty(16, 8, device="meta", dtype=torch.bfloat16),
                          torch.empty(4, 8, 16, device="meta", dtype=torch.bfloat16), offs=offs)
    assert y.shape == (16, 16)


def test_expert_forward_without_dispatcher_is_the_grouped_path():
    torch.manual_seed(1)
    x, logits = torch.randn(12, 8), torch.randn(12, 4)
    ws = [torch.randn(4, 8, 6), torch.randn(4, 8, 6), torch.randn(4, 6, 8)]
    got = expert_forward(x, route(logits, 2, 6, 2, None), *ws)
    assert _close(got, reference_moe(x, logits, 2, 6, 2, None, *ws)[0])


def test_aux_loss_by_hand():
    # One sequence of 4 tokens, 2 experts, top-1. Probabilities: token 0, 1, 2 prefer expert 0.
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    routing = route(probs.log(), 1, 4, 1, None)
    f = torch.tensor([3 / 4, 1 / 4])  # assignments per expert / assignments
    p = probs.mean(0)  # [0.6, 0.4]
    assert float(routing.aux_loss) == pytest.approx(float(2 * (f * p).sum()), rel=1e-6)  # = 1.1
    assert float(routing.aux_loss) == pytest.approx(1.1, rel=1e-6)
    # Per sequence, then averaged: a second, balanced sequence (aux = 1) halves the excess.
    balanced = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.9, 0.1], [0.1, 0.9]])
    two = route(torch.cat([probs, balanced]).log(), 2, 4, 1, None)
    assert float(two.aux_loss) == pytest.approx((1.1 + 1.0) / 2, rel=1e-5)


def test_capacity_drops_later_tokens_of_each_sequence():
    # Every token picks expert 0 (top-1); capacity 2 per sequence keeps tokens 0 and 1 of each.
    logits = torch.tensor([[5.0, 0.0]] * 6)
    routing = route(logits, 2, 3, 1, 2)
    kept_tokens = sorted(routing.token_A[routing.keep_A].tolist())
    assert kept_tokens == [0, 1, 3, 4] and int(routing.dropped) == 2
    assert routing.counts_X.tolist() == [4, 0] and routing.tokens_per_expert.tolist() == [6, 0]


def _tiny_args(**kw) -> MoEArgs:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, n_experts=4,
                experts_per_token=2, moe_ffn_dim=24, shared_expert_ffn_dim=16, aux_loss_coef=0.1)
    return MoEArgs(**{**base, **kw})


def test_flops_count_active_parameters():
    a = _tiny_args()
    d, L, V = a.dim, a.n_layers, a.vocab_size
    attention = d * d + 2 * d * (d // 2) + d * d  # q, k, v (2 of 4 kv heads), o
    active_block = attention + d * a.n_experts + 2 * 3 * d * a.moe_ffn_dim + 3 * d * 16 + 2 * d
    assert active_param_count(a, embeddings=False) == L * active_block + d
    T = 16
    assert flops_per_token(a, T) == 6 * (L * active_block + d + V * d) + 6 * 2 * L * T * d
    # More experts add parameters but not FLOPs; more experts per token add FLOPs.
    wide = _tiny_args(n_experts=16)
    assert param_count(wide) > param_count(a) and flops_per_token(wide, T) == flops_per_token(a, T) + \
        6 * L * d * (16 - 4)  # only the router grows
    assert flops_per_token(_tiny_args(experts_per_token=3), T) > flops_per_token(a, T)
    model = MoE(a)
    assert sum(p.numel() for p in model.parameters()) == param_count(a)


def test_mixtral_recipe_matches_published_counts():
    data = yaml.safe_load((RECIPES / "mixtral-8x7b.yaml").read_text())
    args = MoEArgs.from_config(ModelConfig(**data["model"]))
    assert round(param_count(args) / 1e8) / 10 == 46.7  # 46.7B in all
    assert round(active_param_count(args) / 1e8) / 10 == 12.9  # 12.9B active


def test_training_loss_adds_the_aux_loss_and_records_router_figures():
    torch.manual_seed(0)
    args = _tiny_args(capacity_factor=1.0)
    model = MoE(args)
    model.init_buffers()
    model.init_weights(seed=3)
    tokens = torch.randint(0, 64, (2, 16))
    model.train()
    loss = model(tokens, tokens)
    aux = torch.stack([m.stats["aux"] for m in model.moe_layers()]).mean()
    model.eval()
    with torch.no_grad():
        ce = model(tokens, tokens)
    assert float(loss.detach()) == pytest.approx(float(ce + 0.1 * aux.detach()), rel=1e-6)
    stats = model.pop_router_stats()
    assert stats["tokens_per_expert"].sum() == 2 * 16 * 2 * args.n_layers  # B·T·k per layer
    assert float(stats["dropped"]) > 0 and float(stats["forwards"]) == 1
    assert model.pop_router_stats() is None  # popped
    loss.backward()  # the router gets gradient (from the gates and the aux loss)
    assert all(float(m.router.weight.grad.abs().sum()) > 0 for m in model.moe_layers())


def test_meta_build_then_init_equals_a_direct_build():
    cfg = load_config(MOE_CONFIG, [*TINY, "model.arch=moe", "model.moe_ffn_dim=32"]).config.model
    a, b = build_model(cfg, "cpu", seed=5), build_model(cfg, "cpu", seed=5)
    assert isinstance(a, MoE)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    experts = a.layers[0].feed_forward.experts
    assert experts.w1.shape == (cfg.n_experts, cfg.dim, 32) and float(experts.w1.std()) > 0


BAD = {
    "ep does not divide the experts": (["parallel.nproc_per_node=2", "parallel.ep=2", "model.n_experts=3"],
                                       ["parallel.ep = 2", "model.n_experts = 3"]),
    "ep does not divide dp_shard": (["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.dp_replicate=2",
                                     "parallel.ep=2"], ["parallel.ep = 2", "dp_shard"]),
    "ep on a dense model": (["model.arch=llama", "parallel.nproc_per_node=2", "parallel.ep=2"],
                            ["parallel.ep = 2", "model.arch = llama"]),
    "more experts per token than experts": (["model.experts_per_token=9"],
                                            ["model.experts_per_token = 9", "model.n_experts = 8"]),
    "moe with tensor parallel": (["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2"],
                                 ["parallel.tp = 2", "moe"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_keys(case):
    overrides, names = BAD[case]
    with pytest.raises(ConfigError) as e:
        load_config(MOE_CONFIG, overrides)
    for name in names:
        assert name in str(e.value), str(e.value)


def test_cli_exits_2_when_ep_does_not_divide_the_experts(tmp_path: Path):
    r = CliRunner().invoke(cli, ["validate", str(MOE_CONFIG), "parallel.nproc_per_node=2", "parallel.ep=3"])
    assert r.exit_code == 2 and "parallel.ep = 3" in r.output, r.output


def test_validate_warns_about_keys_the_family_does_not_read():
    runner = CliRunner()
    r = runner.invoke(cli, ["validate", str(REPO / "configs" / "llama.yaml"), "model.n_experts=4"])
    assert r.exit_code == 0 and "model.n_experts is read only by model.arch = moe" in r.output, r.output
    r = runner.invoke(cli, ["validate", str(MOE_CONFIG), "model.ffn_dim=100"])
    assert r.exit_code == 0 and "model.ffn_dim has no effect with model.arch = moe" in r.output, r.output
    assert "model: moe dim=192 layers=4 heads=6/2 experts=8 top-2 expert_ffn=256" in r.output, r.output


def test_export_is_read_by_transformers_mixtral_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    from accelrun.models.families import get_family
    from accelrun.models.families.moe.hf import MixtralExportError
    from accelrun.models.hf_io import export_hf

    args = _tiny_args(shared_expert_ffn_dim=0)
    model = MoE(args)
    model.init_buffers()
    model.init_weights(seed=1)
    model.eval()
    export_hf(model.state_dict(), get_family("moe"), args, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        assert _close(theirs(tokens).logits, model(tokens), rel=1e-5)
    with pytest.raises(MixtralExportError, match="model.shared_expert_ffn_dim = 16"):
        export_hf(model.state_dict(), get_family("moe"), _tiny_args(), tmp_path / "shared")


def test_the_cuda_default_grouped_kernel_compiles_whole_with_accelrun():
    """torch._grouped_mm runs on the CPU too: the GPU's default expert path (bf16) traced whole by Dynamo
    and compiled by accelrun's backend, against eager (bf16: 1e-2 of the largest value), regions claimed."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions

    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 3])  # an idle expert, and 3 dropped rows past the 15 kept
    x = torch.randn(18, 16, dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(shape) * 0.2).bfloat16().requires_grad_() for shape in ((4, 16, 32), (4, 16, 32), (4, 32, 16))]

    def experts(x, counts, *ws):
        return grouped_swiglu(x, counts, *ws, impl="grouped_mm")

    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))
    torch._dynamo.reset()
    try:
        results = [f(x, counts, *ws) for f in (experts, torch.compile(experts, backend=backend, fullgraph=True))]
    finally:
        torch._dynamo.reset()
    grads = [torch.autograd.grad(y.float().square().sum(), [x, *ws]) for y in results]
    assert _close(results[1].float(), results[0].float(), rel=1e-2)
    for got, want in zip(grads[1], grads[0], strict=True):
        assert _close(got.float(), want.float(), rel=1e-2)
    assert backend.record.regions_per_executor().get("cpp", 0) > 0


@pytest.mark.parametrize("impl", ["split_mm", "padded_bmm"])
def test_bf16_mixed_experts_add_into_the_fp32_stream(impl):
    """bf16-mixed: the experts compute in bf16 under autocast, the tokens' stream stays fp32 (index_add_
    refused the mix: a bf16-mixed MoE failed at its first step). Against fp32 within bf16's 1e-2."""
    torch.manual_seed(0)
    B, T, D, X, K, C = 2, 8, 16, 4, 2, 32
    x = torch.randn(B * T, D)
    ws = [torch.randn(X, D, C) * 0.2, torch.randn(X, D, C) * 0.2, torch.randn(X, C, D) * 0.2]
    routing = route(torch.randn(B * T, X), B, T, K, None)

    def dispatch(x_AD, counts, w1, w3, w2):
        return grouped_swiglu(x_AD, counts, w1, w3, w2, impl=impl)

    want = expert_forward(x, routing, *ws, dispatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = expert_forward(x, routing, *ws, dispatch)
    assert got.dtype == torch.float32 and _close(got, want, rel=1e-2)


def test_a_transformers_mixture_that_returns_its_load_balancing_loss_trains_on_it_too():
    """transformers' Mixtral with config.output_router_logits adds router_aux_loss_coef × aux_loss to the
    loss it computes from labels; accelrun computes the cross-entropy itself and had dropped the term
    (a new user's Mixtral: 6.186 at step 1 where transformers' loss was 7.286), saying nothing."""
    import torch.nn.functional as F
    from transformers import MixtralConfig, MixtralForCausalLM

    from accelrun.models.build import LossSource, loss_source, training_loss_fn

    config = MixtralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    ids = torch.randint(0, 64, (2, 9))
    x, y = ids[:, :-1], ids[:, 1:]
    out = model(x, use_cache=False)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    expected = F.cross_entropy(out.logits.flatten(0, 1), y.flatten()) + 0.5 * out.aux_loss
    torch.testing.assert_close(training_loss_fn(model)(x, y), expected, rtol=1e-6, atol=0)
    assert loss_source(model) is LossSource.LOGITS_AUX and "router_aux_loss_coef" in LossSource.LOGITS_AUX.value
    config.output_router_logits = False  # asked for no router logits: cross-entropy alone, as transformers' own
    plain = MixtralForCausalLM(config)
    assert loss_source(plain) is LossSource.LOGITS
    torch.testing.assert_close(training_loss_fn(plain)(x, y),
                               F.cross_entropy(plain(x, use_cache=False).logits.flatten(0, 1), y.flatten()))
