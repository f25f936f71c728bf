"""Live progress of a training run: a rich bar on a terminal, plain lines in logs and CI."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from accelrun.consoles import DiagnosticConsole


class TrainProgress:
    """Shows step, loss, tokens/s and ETA. ``mode``: auto | bar | lines | none.

    The bar redraws whenever the loop reads steps on the host (every step on a CPU, every
    ``report.read_every`` steps on a GPU); ``lines`` prints every ``every`` steps (``report.log_every``).
    """

    def __init__(self, total: int, start: int, mode: str, every: int, console: Console | None = None,
                 ranks: int = 1):
        self.console = console or DiagnosticConsole()
        # update() gets rank 0's tokens/s; every rank trains on as many tokens (global batch / ranks),
        # so the job's figure, which leads as in the report, is that times the ranks.
        self.ranks = ranks
        self._unit = "tok/s" if ranks == 1 else f"tok/s (job, {ranks} ranks)"
        if mode == "auto":
            mode = "bar" if self.console.is_terminal and sys.stderr.isatty() else "lines"
        self.mode, self.total, self.every, self.start = mode, total, every, start
        self.before_line: Callable[[], None] | None = None  # called before each update (CompileTicker.settle)
        self._first_done = time.perf_counter()  # reset when the first step ends (it compiles, warms caches)
        self._bar: Progress | None = None
        if mode == "bar":
            self._bar = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}"),
                TextColumn("{task.fields[tps]} " + self._unit),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-", tps="-")

    def update(self, step: int, loss: float, tokens_per_s: float, val_loss: float | None = None) -> None:
        """``tokens_per_s``: this rank's (rank 0's) figure; the job's is shown. ``val_loss``: the held-out
        loss, at a step that evaluated (eval.every): shown on a line of its own, in either mode (it had
        been in metrics.jsonl and the report only)."""
        tokens_per_s *= self.ranks
        if self.before_line is not None:
            self.before_line()
        if val_loss is not None and self.mode in ("bar", "lines"):
            self.console.print(f"step {step:>6}/{self.total}  eval loss {val_loss:8.4f} (held out)", highlight=False)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")
        elif self.mode == "lines" and (step % self.every == 0 or step == self.total or step == self.start + 1):
            now = time.perf_counter()
            if step == self.start + 1:  # the first step compiles: the pace is the steps after it
                self._first_done = now
            done, elapsed = step - self.start - 1, now - self._first_done
            eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
            self.console.print(
                f"step {step:>6}/{self.total}  loss {loss:8.4f}  {tokens_per_s:>10,.0f} {self._unit}  "
                f"eta {_fmt_seconds(eta)}",
                highlight=False,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _fmt_seconds(s: float) -> str:
    if s != s:  # NaN
        return "--:--"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"
