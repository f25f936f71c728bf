"""``accelrun validate``: compose and check a recipe without training."""

from __future__ import annotations

import click
from rich.markup import escape

from accelrun.cli.common import config_argument, err, load, out, overrides_argument, print_warnings


@click.command("validate")
@config_argument
@overrides_argument
def command(config: str, overrides: tuple[str, ...]) -> None:
    """Check a recipe: YAML syntax, unknown keys, types, ranges and consistency, and what training
    checks before it starts: data.paths match files, model.hf holds readable weights, the processes
    fit this node's GPUs (an error) or cores (a warning).

    Exits 0 and prints a one-screen summary when valid; exits 2 with every problem
    (file:line, key, what was expected) when not.

    \b
    Examples:
      accelrun validate configs/llama.yaml
      accelrun validate configs/llama.yaml parallel.nproc_per_node=4 parallel.tp=2
    """
    resolved = load(config, overrides)
    c = resolved.config
    from accelrun.config import ConfigError
    from accelrun.config.preflight import Machine, custom_model_problems, preflight
    from accelrun.report.trackers import check_trackers

    # What `train` checks before the first tensor (data files, model.hf's weights, processes for the
    # node), with this node counted without torch: exit 2 where train would.
    print_warnings(preflight(c, resolved.sources, Machine.here()))
    unchecked: list[str] = []
    problems = custom_model_problems(c, resolved.sources, unchecked)  # imports the user's module: validate only
    if problems:
        raise ConfigError(problems)
    for line in unchecked:
        err.print(f"note: {escape(line)}", highlight=False)
    check_trackers(c.report.trackers)  # a named tracker's package missing: exit 2 naming the pip command
    deg = c.parallel.degrees()
    out.print(f"[green]valid[/]: {c.name}  (config hash {resolved.hash})")
    out.print(f"  files: {', '.join(str(f) for f in resolved.files)}", markup=False)
    if resolved.overrides:
        out.print(f"  overrides: {escape(' '.join(resolved.overrides))}")
    m = c.model
    ffn = (f"experts={m.n_experts} top-{m.experts_per_token} expert_ffn={m.moe_ffn_dim}"
           + (f" shared_ffn={m.shared_expert_ffn_dim}" if m.shared_expert_ffn_dim else "")
           if m.arch == "moe" else f"ffn={m.ffn_dim}")
    model = m.custom or (
        f"{m.arch} dim={m.dim} layers={m.n_layers} heads={m.n_heads}/{m.kv_heads} {ffn} vocab={m.vocab_size}"
    )
    out.print(f"  model: {model}", markup=False)
    out.print(f"  data: {_data_summary(c.data)}", markup=False)
    reads_records = any(e.source == "documents" for e in c.data.mix) if c.data.mix else c.data.source == "documents"
    if reads_records:
        # Reading every record is the run's first minutes; validate reads the first of each file only.
        out.print("  records: the first of each file checked (its fields, text, JSON); the others are "
                  "checked when training reads them", markup=False)
    out.print(
        f"  batch: global {c.train.global_batch} = micro {c.train.micro_batch} × accumulation "
        f"{c.grad_accum} × data-parallel {c.parallel.dp}; seq_len {c.train.seq_len}; "
        f"{c.train.steps} steps; {c.train.precision}"
    )
    out.print(
        f"  parallel: world {c.parallel.world_size} = "
        + " × ".join(f"{k} {v}" for k, v in deg.items())
        + f"; compile: {c.compile.backend}"
    )


def _data_summary(data) -> str:
    """``text (2 globs); tokenizer /m/tokenizer.json: 32,000 ids, '</s>' (id 2) after each document``."""
    from accelrun.config.data_checks import mix_shares, paths_said
    from accelrun.config.tokenizer_file import BYTE, BYTE_VOCAB, read_tokenizer_info

    if data.mix:  # each source and its share: the weights are normalised
        return f"mix of {len(data.mix)} sources: {mix_shares(data.mix)}; tokenizer {data.tokenizer}"
    where = data.builtin if data.source == "builtin" else paths_said(data.paths)
    head = data.source if data.source == "synthetic" else f"{data.source} ({where})"
    if data.source == "synthetic":
        return head
    if data.tokenizer == BYTE:
        return f"{head}; tokenizer byte: {BYTE_VOCAB} ids, EOS (id 257) after each document"
    info = read_tokenizer_info(data.tokenizer)  # validation has read it already
    sep = f"{info.eos_token!r} (id {info.eos_id}) after each document" if info.eos_id is not None else \
        "no separator between documents"
    if data.source == "documents" and data.format == "chat":  # the template writes the turns' own tokens
        sep = f"chats rendered with its chat template, the loss on {data.loss_on} tokens"
    return f"{head}; tokenizer {info.path}: {info.vocab_size:,} ids, {sep}"
