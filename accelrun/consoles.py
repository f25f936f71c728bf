"""The two consoles every command prints through: results on stdout (pipeable), and progress,
warnings and errors on stderr. When a reader stops early (`accelrun ... | head`, `2>&1 | head`), the
rest of that stream goes nowhere and the command goes on to its end, with the exit code its work
earns: a training run trains on and writes its report. rich's own consoles exit 1 at once, which a
script reads as the command's failure and which leaves whatever it was writing half done."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from rich.console import Console


class ResultConsole(Console):
    """stdout's console."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # later prints are dropped
        quiet_stream(sys.stdout)


class DiagnosticConsole(Console):
    """stderr's console: progress, warnings, errors."""

    def __init__(self, **kwargs) -> None:
        super().__init__(stderr=True, **kwargs)

    def on_broken_pipe(self) -> None:
        # Not quiet: a rank's stderr also copies into its log (train.rank_log), which must go on.
        quiet_stream(sys.stderr)


def quiet_stream(stream: TextIO) -> None:
    """``stream``'s reader has gone: what is still written to it goes to /dev/null, so Python's own flush
    at exit (and any other writer of that descriptor: logging, warnings, a rank's process) succeeds
    instead of failing again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)
