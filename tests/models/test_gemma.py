"""The Gemma family: transformers' GemmaForCausalLM is the reference (same tiny random weights, fp32
logits within 1e-5, both ways: ``model.hf`` in, ``export_hf`` out), its shape counts (the Gemma report's
parameter counts), and the family seam (pipeline stages cut where the spec says, the planner's shape).
"""

from __future__ import annotations

import json

import pytest
import torch

from accelrun.config import load_config
from accelrun.config.errors import ConfigError
from accelrun.config.schema import ModelConfig
from accelrun.dist.pipeline import stage_module, union_of
from accelrun.models import build_model
from accelrun.models.families import get_family
from accelrun.models.families.gemma.model import Gemma
from accelrun.models.hf_io import export_hf, load_hf_for_config
from tests.models.hf_helpers import SHAPE, save_tiny_hf

TOL = 1e-5  # fp32, same weights, different kernels and op order
VOCAB = SHAPE["vocab_size"]


def _tokens(seed: int, t: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(seed))


def _load(folder) -> tuple[torch.nn.Module, ModelConfig]:
    cfg = ModelConfig(hf=str(folder))
    model = build_model(cfg, "cpu", seed=0)
    assert load_hf_for_config([model], cfg) > 0
    return model.eval(), cfg


@pytest.mark.parametrize("kind", ["gemma", "gemma-untied"])
def test_logits_equal_transformers(tmp_path, kind):
    hf = save_tiny_hf(tmp_path, kind)
    ours, cfg = _load(tmp_path)
    assert isinstance(ours, Gemma) and cfg.arch == "gemma"
    # 4 heads of 24 in a 64-wide model: the head dimension is read from config.json, not dim / heads.
    assert (cfg.head_dim, cfg.tie_embeddings) == (24, kind == "gemma")
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == (kind == "gemma")
    tokens = _tokens(1)
    with torch.no_grad():
        want = hf(tokens).logits
        diff = (ours(tokens) - want).abs().max().item()
    assert diff < TOL * want.abs().max().item(), f"{kind}: max |logit difference| {diff:.2e}"


def test_each_gemma_trait_matters(tmp_path):
    # The parity above proves something only if each of Gemma's differences from Llama changes the
    # logits at these shapes: undo one at a time and the logits move far past the tolerance.
    hf = save_tiny_hf(tmp_path, "gemma")
    tokens = _tokens(2)
    with torch.no_grad():
        want = hf(tokens).logits
        ours, _ = _load(tmp_path)
        ours.embed_scale.fill_(1.0)  # no sqrt(dim) on the embeddings
        assert (ours(tokens) - want).abs().max() > 1e-2
        ours, _ = _load(tmp_path)
        for block in ours.layers:  # SiLU instead of tanh-approximate GELU
            block.feed_forward.forward = lambda x, f=block.feed_forward: f.w2(torch.nn.functional.silu(f.w1(x)) * f.w3(x))
        assert (ours(tokens) - want).abs().max() > 1e-2
        ours, _ = _load(tmp_path)
        for p in ours.parameters():  # a norm scaled by w instead of 1 + w: shift each norm's weights by one
            if p.ndim == 1:
                p.add_(1.0)
        assert (ours(tokens) - want).abs().max() > 1e-2


def test_embedding_scale_is_rounded_to_the_activation_dtype(tmp_path):
    # In bf16 transformers multiplies by sqrt(64) = 8 cast to bf16 (exact here) after the bf16 lookup;
    # at dim 3072 sqrt(dim) = 55.43 becomes 55.5. The first block's input must equal transformers' bf16
    # embeddings bit for bit.
    hf = save_tiny_hf(tmp_path, "gemma").to(torch.bfloat16)
    ours, _ = _load(tmp_path)
    ours.to(torch.bfloat16)
    seen = {}
    ours.layers[0].register_forward_pre_hook(lambda _m, args: seen.update(h=args[0]))
    tokens = _tokens(3)
    with torch.no_grad():
        ours(tokens)
        want = hf.model.embed_tokens(tokens)
    assert seen["h"].dtype == torch.bfloat16 and torch.equal(seen["h"], want)
    wide = Gemma(get_family("gemma").args_from_config(ModelConfig(arch="gemma", dim=3072, n_heads=12, n_layers=1,
                                                                  vocab_size=8)))
    assert wide.embed_scale.to(torch.bfloat16).item() == 55.5


@pytest.mark.parametrize("tie", [True, False])
def test_export_is_read_back_by_transformers(tmp_path, tie):
    import transformers

    cfg = ModelConfig(arch="gemma", dim=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=96,
                      vocab_size=VOCAB, max_seq_len=64, tie_embeddings=tie)
    model = build_model(cfg, "cpu", seed=5).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 0 too, so a missing (1 + w) would show
            p.add_(torch.randn_like(p) * 0.05)
    spec = get_family("gemma")
    written = export_hf(model.state_dict(), spec, spec.args_from_config(cfg), tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json") in written  # several shards
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in weight_map) == (not tie)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == "GemmaForCausalLM"
    tokens = _tokens(4)
    with torch.no_grad():
        want = model(tokens)
        diff = (back(tokens).logits - want).abs().max().item()
    assert diff < TOL * want.abs().max().item(), f"tie={tie}: max |logit difference| {diff:.2e}"
    again, _ = _load(tmp_path)  # and accelrun reads its own export back
    with torch.no_grad():
        assert torch.equal(again(tokens), want)


def test_pipeline_stages_are_cut_where_the_spec_says():
    # Gemma's ends are not Llama's (embed_tokens / norm / lm_head): two stages keep one end each, run
    # one after the other they give the whole model's logits, and their union has the whole model's names.
    cfg = load_config("configs/gemma.yaml", ["model.tie_embeddings=false", "model.n_layers=3", "model.dim=64",
                                             "model.head_dim=16", "model.ffn_dim=96"]).config.model
    spec = get_family("gemma")
    model = build_model(cfg, "cpu", seed=0).eval()
    first, last = (stage_module(model, s, 2, r) for s, r in enumerate([range(0, 2), range(2, 3)]))
    assert (first.embed_tokens, first.norm, first.lm_head) == (model.embed_tokens, None, None)
    assert (last.embed_tokens, last.norm, last.lm_head) == (None, model.norm, model.lm_head)
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2"]
    tokens = _tokens(5, 32)
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), model(tokens))
    union = union_of([first, last])
    assert set(dict(union.named_parameters())) == set(dict(model.named_parameters()))
    assert set(spec.ends) == {"embed_tokens", "norm", "lm_head"}


def test_two_rank_layouts_hold_the_whole_model_once():
    # Each rank's layout built for real (meta tensors, a fake process group: accelrun.dist.dry_run):
    # pipeline stages split the parameters between them, TP ranks hold half of each matrix.
    from accelrun.dist.dry_run import dry_run
    from tests.conftest import TINY

    base = [*TINY, "parallel.nproc_per_node=2", "parallel.dp_shard=1", "model.tie_embeddings=false",
            "model.head_dim=24"]
    whole = None
    for layout in (["parallel.pp=2", "parallel.pp_schedule=gpipe"], ["parallel.tp=2"]):
        resolved = load_config("configs/gemma.yaml", [*base, *layout])
        cfg = resolved.config.model
        whole = get_family("gemma").param_count(get_family("gemma").args_from_config(cfg))
        ranks = dry_run(resolved)
        if "parallel.pp=2" in layout:
            assert [r.stages for r in ranks] == [[0], [1]] and sum(r.params for r in ranks) == whole
        else:  # norms are replicated; every matrix is halved
            norms = (2 * cfg.n_layers + 1) * cfg.dim
            assert all(r.params == (whole - norms) // 2 + norms for r in ranks), [r.params for r in ranks]


RECIPE_COUNTS = {  # the Gemma report (Table 2): non-embedding parameters; totals with the 256,000 vocabulary
    "gemma-2b": (1_981_884_416, 2_506_172_416),
    "gemma-7b": (7_751_248_896, 8_537_680_896),
}


@pytest.mark.parametrize("name", sorted(RECIPE_COUNTS))
def test_published_parameter_counts(name):
    cfg = load_config(f"model/{name}").config.model
    spec = get_family("gemma")
    args = spec.args_from_config(cfg)
    assert (spec.param_count(args, embeddings=False), spec.param_count(args)) == RECIPE_COUNTS[name]


@pytest.mark.parametrize("name", ["gemma-debug", "gemma-7b"])
def test_counts_equal_the_built_model(name):
    cfg = load_config(f"model/{name}").config.model
    model = build_model(cfg)  # meta: no memory
    spec = get_family("gemma")
    args = spec.args_from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == spec.param_count(args)
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    assert non_embedding == spec.param_count(args, embeddings=False)
    # FLOPs: 6 per matmul weight per token (the tied output counted) + 12·L·T·(heads · head_dim).
    seq = 4096
    expected = 6 * (non_embedding + args.vocab_size * args.dim) + 12 * args.n_layers * seq * args.n_heads * args.head_dim
    assert spec.flops_per_token(args, seq) == expected


def test_sharded_initialisation_equals_one_process():
    # Built on meta and materialised: the same values as a model built on the CPU directly.
    cfg = load_config("configs/gemma.yaml", ["model.n_layers=2"]).config.model
    direct = build_model(cfg, "cpu", seed=7)
    from accelrun.models.build import materialize_local

    meta = build_model(cfg, "meta")
    materialize_local(meta, "cpu", seed=7)
    for (name, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert meta.lm_head.weight is meta.embed_tokens.weight  # tied again after to_empty
    assert torch.all(meta.norm.weight == 0) and meta.embed_scale.item() == pytest.approx(192**0.5)


def test_bad_gemma_inputs_name_the_key(tmp_path):
    save_tiny_hf(tmp_path, "gemma")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "silu"}))
    with pytest.raises(ConfigError, match=r"config.json: hidden_act = 'silu' is not supported "
                                          r"\(only gelu_pytorch_tanh or gelu\)"):
        ModelConfig(hf=str(tmp_path))
    # transformers 5 writes rope_parameters (no rope_scaling): the error names the key the file has
    llama3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": llama3}))
    with pytest.raises(ConfigError, match=r"config.json: rope_parameters = \{'rope_type': 'llama3'.* is not supported "
                                          r"\(only the default rotary embedding\)"):
        ModelConfig(hf=str(tmp_path))
    with pytest.raises(ConfigError, match=r"model.head_dim = 48 .* is only read by model.arch gemma"):
        load_config("configs/llama.yaml", ["model.head_dim=48"])
    with pytest.raises(ConfigError, match=r"model.head_dim = 15 .* must be even"):
        load_config("configs/gemma.yaml", ["model.head_dim=15"])
    # A folder's config.json is the whole shape: a Llama folder under a Gemma recipe is a Llama, with
    # the recipe's head_dim gone (not an error about a key the folder never set).
    save_tiny_hf(tmp_path / "llama", "llama")
    cfg = load_config("configs/gemma.yaml", [f"model.hf={tmp_path / 'llama'}", "train.seq_len=64"]).config.model
    assert (cfg.arch, cfg.head_dim, cfg.tie_embeddings) == ("llama", None, False)


def test_the_compiler_trains_gemma_as_eager_does(tmp_path):
    # accelrun's compiler on a family it was not written against: the blocks compile as one graph
    # (no breaks), its fusion passes fire and the C++ executor claims regions, and the losses of a few
    # steps equal eager's (fp32).
    from accelrun.report.metrics import read_metrics
    from accelrun.train.entry import train
    from tests.conftest import TINY

    losses, reports = {}, {}
    for backend in ("eager", "accelrun"):
        run = train(load_config("configs/gemma.yaml", [*TINY, "train.steps=3", "model.head_dim=24",
                                                       f"report.runs_dir={tmp_path / backend}",
                                                       f"compile.backend={backend}"]), command="test")
        losses[backend] = [m["loss"] for m in read_metrics(run.run_dir / "metrics.jsonl")]
        reports[backend] = json.loads((run.run_dir / "report.json").read_text())
    compiler = reports["accelrun"]["compiler"]
    assert reports["accelrun"]["compiled"] == ("2 transformer blocks with accelrun + the output head and loss as one "
                                               "graph (compile.scope = auto: loss, repeated blocks and a loss head)")
    assert compiler["dynamo_graphs"] >= 1 and compiler["graph_breaks"] == 0, compiler
    assert compiler["passes_fired"] and compiler["regions_per_executor"].get("cpp", 0) > 0, compiler
    assert losses["accelrun"] == pytest.approx(losses["eager"], rel=1e-5), losses


@pytest.mark.parametrize("layout", ["tp", "fsdp"])
def test_each_rank_initialises_its_shard_as_one_process_would(layout):
    # Built on meta, laid out (TP by the family's plan, or FSDP2), then only the local shards
    # allocated and initialised: each equals its slice of a one-process model. Both ranks run here,
    # one after the other, on a fake process group (initialisation needs no communication).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accelrun.dist.tp import apply_tp
    from accelrun.models.build import materialize_local, transformer_blocks

    cfg = load_config("configs/gemma.yaml", ["model.n_layers=2", "model.tie_embeddings=false",
                                             "model.vocab_size=4096"]).config.model  # several draws wide
    whole = build_model(cfg, "cpu", seed=7).state_dict()
    for rank in (0, 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(layout,))
            model = build_model(cfg, "meta")
            if layout == "tp":
                apply_tp(model, mesh, plan=get_family("gemma").tp_plan)
            else:
                for block in transformer_blocks(model):
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            materialize_local(model, "cpu", seed=7)
            sharded = 0
            for name, p in model.state_dict().items():
                want = whole[name]
                if isinstance(p, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    want = want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                    p, sharded = p.to_local(), sharded + 1
                    assert p.numel() < whole[name].numel() or whole[name].ndim == 1, name  # a real shard
                assert torch.equal(p, want), (layout, rank, name)
            assert sharded >= 7 * cfg.n_layers  # every block matrix at least
        finally:
            dist.destroy_process_group()
