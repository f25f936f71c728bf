"""``accelrun generate``: text sampled from a run's newest complete checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from accelrun.cli.common import err, out


@click.command("generate")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Text to continue (in the run's data.tokenizer).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=200, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True,
              help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same text.")
@click.option("--through-end", is_flag=True, help="Go on past the end of a text (the tokenizer's end-of-text "
              "id) into the next one the model starts, instead of stopping there.")
def command(run: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
            through_end: bool) -> None:
    """Load RUN's newest complete checkpoint (a run folder, a folder of runs: the newest of its runs
    that saved one, or a checkpoint folder) into this process and print PROMPT followed by sampled text
    (on stderr first: the run, step and checkpoint used). Built-in model families decode with a KV cache.

    \b
    Examples:
      accelrun generate runs/llama-debug --prompt "The " --max-new-tokens 100 --seed 1
    """
    import time

    from accelrun.train.generate import generate_text

    t0 = time.perf_counter()
    g = generate_text(run, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                      stop_at_end=not through_end)
    # Which run and checkpoint spoke, on stderr: stdout stays the text alone (pipeable).
    ended = "; it ended the text there (--through-end goes on)" if g.ended else ""
    err.print(f"run {g.run}; step {g.step if g.step is not None else '?'}; checkpoint {g.checkpoint}; "
              f"{g.new_tokens} tokens{ended} in {time.perf_counter() - t0:.1f} s (checkpoint load included; "
              + ("KV cache)" if g.kv_cache is None else f"no KV cache: {g.kv_cache})"),
              markup=False, highlight=False)
    from accelrun.train.checkpoint_model import others_in_folder

    if (others := others_in_folder(run, Path(g.run))) is not None:
        err.print(f"note: {others}", markup=False, highlight=False)
    if g.beyond_training:
        err.print(f"warning: {g.beyond_training}", markup=False, highlight=False)
    out.print(g.text, markup=False, highlight=False, soft_wrap=True)
