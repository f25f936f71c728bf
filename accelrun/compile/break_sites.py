"""Where each graph break happened, and the change that avoids it where it is a known one.

Dynamo's counters (coverage.py) key a graph break by its reason, which names no place ("Unsupported
Tensor.item() call"), and torch's hint for it may not be the fix (tracing the host read, where the
model need not read the host at all). Dynamo also logs every break with the user's stack on its
``graph_breaks`` artifact logger, printed only under TORCH_LOGS. accelrun listens there, without
printing, from the first compile of a process on, and keeps one ``BreakSite`` per break.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import types
from dataclasses import dataclass
from pathlib import Path

from accelrun.compile.eager_rnns import REASON as EAGER_RNN_REASON

# Places inside torch.nn where a model written the usual way breaks the graph, with what avoids it:
# (file's tail, function) -> the change.
KNOWN_BREAKS: dict[tuple[str, str], str] = {
    ("modules/transformer.py", "_detect_is_causal_mask"): (
        "pass is_causal=True beside the causal mask (tgt_is_causal=True to a decoder; torch.nn's Transformer "
        "modules otherwise compare the mask with a causal one on the host, every call)"
    ),
}
# Breaks in the user's own code, by the start of Dynamo's reason, with what avoids them.
KNOWN_BREAK_REASONS: dict[str, str] = {
    "Data-dependent branching": (
        "make the branch a computation (torch.where, torch.clamp: they cost little when the condition is "
        "false), or move it out of the compiled forward"
    ),
    # torch's own hint (capture_scalar_outputs) traces the host read; a check that reads a value on the
    # host (a NaN or overflow test) need not be in the forward at all.
    "Unsupported Tensor.item() call": (
        "keep the value a tensor (torch.where, torch.clamp instead of an if on it), or read it outside the "
        "compiled forward (a check on the loss every few steps)"
    ),
    # torch.utils.checkpoint's region is traced as one operator, which may change no Python state: the
    # `kernels` package's layers (transformers' RMSNorm) set a global as they run, so a checkpointed
    # transformers decoder layer breaks there (a new user's Qwen2 under gradient_checkpointing_enable()).
    "HOP: Unsafe side effect": (
        "code inside activation checkpointing (torch.utils.checkpoint: transformers' "
        "gradient_checkpointing_enable(), or train.activation_checkpoint) changes Python state (a global or an "
        "attribute, at the line named), which a checkpointed region cannot trace, so the block runs eagerly; "
        "turn that checkpointing off (accelrun's rematerialisation, on by default, keeps less for the backward "
        "without it), or move the change out of the block"
    ),
}
# What Dynamo cannot trace, by the start of its reason, and what that means for the user's model.
KNOWN_UNTRACEABLE: dict[str, str] = {
    "Attempted to wrap RNN, GRU, or LSTM": (
        "torch.compile does not trace torch.nn's RNN, GRU and LSTM modules, so a forward that calls one runs "
        "eagerly; accelrun runs such a module at a graph break and compiles the code around it where the "
        "model's code only calls it (self.rnn(x)) and reads its settings (self.rnn.hidden_size), not where it "
        "reads a weight through it, tests its type, or keeps it in an nn.ModuleList "
        "(torch._dynamo.config.allow_rnn = True, torch's experimental switch, unrolls every time step into "
        "the graph)"
    ),
}
# Breaks that accelrun makes on purpose, by a text of theirs in Dynamo's message, with what they mean.
EXPLAINED_BREAKS: dict[str, str] = {
    EAGER_RNN_REASON: "an RNN, GRU or LSTM of torch.nn runs eagerly there (torch.compile does not trace them); "
                      "the code before and after it is compiled",
}
# Any other break accelrun makes on purpose says what it means in its ``torch.compiler.disable`` reason,
# after "accelrun: " (a mixture of experts' experts, expert parallelism's all-to-all).
_OWN_REASON = re.compile(r"\(reason: accelrun: (.+?)\)\s*$", re.MULTILINE)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_BREAK_PLACE = re.compile(r"in user code at (\S+:\d+)")
_ATTRIBUTED = re.compile(r'File "([^"]+)", line (\d+)\s*$', re.MULTILINE)  # a place with no function


@dataclass(frozen=True)
class BreakSite:
    """One graph break: the user's line that led to it, the function it happened in, and the change
    that avoids it where it is a known one."""

    user_line: str  # "mylm.py:14", the innermost frame outside torch
    inside: str  # "transformer.py:1245 in _detect_is_causal_mask", the innermost frame ("" if the user's)
    fix: str = ""
    meaning: str = ""  # for a break accelrun makes on purpose (EXPLAINED_BREAKS): nothing to fix

    def line(self) -> str:
        where = f"at {self.user_line}" + (f" (in torch's {self.inside})" if self.inside else "")
        return where + (f": {self.meaning}" if self.meaning else "") + (f"; to avoid it: {self.fix}" if self.fix else "")


def break_site(message: str, traced: tuple[str, str] | None = None) -> BreakSite | None:
    """The site of a break from Dynamo's graph-break log message. Its "User code traceback" can leave
    out the frame Dynamo began tracing in (the user's forward, when the break is in a module it
    calls), so that frame's line comes first, where known (``traced``: (file, line)); then the
    message's "source attribution"; then its innermost frame of the user's."""
    frames = [(path.replace("\\", "/"), line, fn) for path, line, fn in _FRAME.findall(message)]
    if not frames:
        return None
    attributed = [(p.replace("\\", "/"), line) for p, line in _ATTRIBUTED.findall(message)]
    user = [f[:2] for f in frames if not _machinery(f[0])]
    candidates = [*([traced] if traced else []), *reversed(attributed)]
    user_line = next((f for f in candidates if not _machinery(f[0])), user[-1] if user else frames[-1][:2])
    path, line, fn = frames[-1]
    inner = f"{path_tail(path)}:{line} in {fn}" if _machinery(path) else ""
    fix = next((why for (tail, name), why in KNOWN_BREAKS.items() if path.endswith(tail) and fn == name), "")
    if not fix:  # by the reason's title, which may follow a preamble ("Encountered graph break when ...")
        fix = known_fix(message.partition("Graph Break Reason:")[2].partition("User code traceback")[0]) or ""
    meaning = next((why for mark, why in EXPLAINED_BREAKS.items() if mark in message), "")
    if not meaning and (own := _OWN_REASON.search(message)):
        meaning = own.group(1)
    return BreakSite(f"{path_tail(user_line[0])}:{user_line[1]}", inner, fix, meaning)


def path_tail(path: str) -> str:
    """A path's last two parts ("modules/transformer.py"): enough to find it, short enough to read."""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def _folder(package: str) -> str:
    spec = importlib.util.find_spec(package)  # found, not imported: the compiler has no use for click
    return Path(spec.origin).parent.as_posix() + "/" if spec and spec.origin else f"/{package}/"


# Folders whose frames are not the user's: torch's, and the command line's (click's, accelrun's entry).
_TORCH, _CLICK = _folder("torch"), _folder("click")
_ACCELRUN = Path(__file__).resolve().parents[1].as_posix() + "/"


def _machinery(path: str) -> bool:
    """torch's frames, and accelrun's own that call the model (not its built-in models' code)."""
    if path.startswith((_TORCH, _CLICK)) or path.endswith("/bin/accelrun"):
        return True
    return path.startswith(_ACCELRUN) and not path.startswith(_ACCELRUN + "models/families/")


class _BreakListener(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sites: list[BreakSite] = []
        # Dynamo logs a break it has logged before without its stack, by the place it broke at.
        self._by_place: dict[str, BreakSite] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            place = _BREAK_PLACE.search(message)
            site = break_site(message, _traced_frame()) or (self._by_place.get(place.group(1)) if place else None)
            if site is not None:
                self.sites.append(site)
                if place:
                    self._by_place[place.group(1)] = site
        except Exception:  # a message of another shape: the break still counts, without its place
            pass


def _traced_frame() -> tuple[str, str] | None:
    """(file, line) of the frame Dynamo is tracing now, at the instruction it breaks at."""
    from accelrun.torch_private import DynamoInstructionTranslator

    try:
        tx = DynamoInstructionTranslator.current_tx()
        return (tx.f_code.co_filename.replace("\\", "/"), str(tx.lineno))
    except Exception:  # none being traced (a break logged after the trace), or another torch's shape
        return None


def traced_function() -> str:
    """The function Dynamo is tracing now, as ``Block.forward (model.py:12)``; "" where none is: torch's
    precompile calls the backend after its trace has ended (the graph cache says what it traced)."""
    from accelrun.torch_private import DynamoInstructionTranslator

    try:
        return code_label(DynamoInstructionTranslator.current_tx().f_code)
    except Exception:
        return ""


def code_label(code: types.CodeType) -> str:
    """``Block.forward (model.py:12)``: the function's name and where it starts, its file shown from its
    package's folder on."""
    file = "/".join(code.co_filename.replace("\\", "/").split("/")[-2:])
    return f"{getattr(code, 'co_qualname', code.co_name)} ({file}:{code.co_firstlineno})"


class _NoItemHint(logging.Filter):
    """Dynamo's own warning for `Tensor.item()` (16 lines, and a hint to trace the host read rather than
    to avoid it): the report gives the break's place and, where known, the change instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).lstrip().startswith("Graph break from `Tensor.item()`")


_listener: _BreakListener | None = None


def listen() -> None:
    """From now on in this process, record where graph breaks happen (idempotent). TORCH_LOGS's own
    printing of them, where a user asked for it, stays as it was."""
    global _listener
    if _listener is not None:
        return
    from accelrun.torch_private import dynamo_frame_break_log, dynamo_graph_break_log, dynamo_tensor_log

    _listener = _BreakListener()
    for log in (dynamo_graph_break_log, dynamo_frame_break_log):
        if not log.isEnabledFor(logging.DEBUG):  # not asked for by TORCH_LOGS: keep it off the console
            log.setLevel(logging.DEBUG)
            log.propagate = False
        log.addHandler(_listener)
    dynamo_tensor_log.addFilter(_NoItemHint())


def logged() -> int:
    """How many break sites this process has logged (a mark for ``since`` and ``forget_after``)."""
    return len(_listener.sites) if _listener is not None else 0


def since(mark: int) -> list[BreakSite]:
    """Break sites logged after ``mark``, each once."""
    return list(dict.fromkeys(_listener.sites[mark:])) if _listener is not None else []


def forget_after(mark: int) -> None:
    """Drop the sites logged after ``mark`` (a trace that never ran, see coverage.forget_since)."""
    if _listener is not None:
        del _listener.sites[mark:]


def known_fix(reason: str) -> str | None:
    """The change that avoids a graph break, from Dynamo's reason, where it is a known one."""
    titles = [line.strip() for line in reason.splitlines()]
    return next((why for start, why in KNOWN_BREAK_REASONS.items() if any(t.startswith(start) for t in titles)), None)


def untraceable_advice(reason: str) -> str | None:
    """What a reason Dynamo gave for not tracing a frame means for the user's model, where known."""
    return next((why for start, why in KNOWN_UNTRACEABLE.items() if start in reason), None)
