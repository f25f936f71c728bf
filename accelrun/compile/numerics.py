"""Debug mode: run a graph before and after a pass on the same inputs and compare the outputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from accelrun.compile.fused.attention import DRAWS_DROPOUT as OWN_GENERATOR  # accelrun's generator draws
from accelrun.compile.record import NUMERICS_EQUAL


class PassNumericsError(RuntimeError):
    """A pass changed what a graph computes (beyond the stated tolerance)."""


# fp32 near 1e-5 relative; lower-precision dtypes near 1e-2 (the project's stated tolerances).
TOLERANCES = {torch.float64: (1e-7, 1e-9), torch.float32: (1e-5, 1e-6)}
LOW_PRECISION = (1e-2, 1e-2)


def sample_inputs(example_inputs: list[Any], seed: int = 0) -> list[Any]:
    """Real tensors shaped like ``example_inputs`` (which may be fake, and nested in lists: a joint graph's
    primals and tangents): floats random, integers 0."""
    gen = torch.Generator().manual_seed(seed)
    return _sampled(example_inputs, gen)


def _sampled(example_inputs: list[Any] | tuple[Any, ...], gen: torch.Generator) -> list[Any]:
    from accelrun.torch_private import optimization_hint

    def hint(s: Any) -> int:  # a symbolic size's example value; int() would guard it to that value
        return optimization_hint(s) if isinstance(s, torch.SymInt) else int(s)

    out = []
    for x in example_inputs:
        if isinstance(x, list | tuple):
            out.append(_sampled(x, gen))
            continue
        if not isinstance(x, torch.Tensor):
            out.append(hint(x) if isinstance(x, torch.SymInt) else x)
            continue
        shape, stride = tuple(hint(s) for s in x.shape), tuple(hint(s) for s in x.stride())
        base = torch.empty_strided(shape, stride, dtype=x.dtype, device="cpu")
        if x.dtype.is_floating_point:
            # Fill the whole underlying storage so strided views see initialised memory.
            flat = base.as_strided((base.untyped_storage().nbytes() // base.element_size(),), (1,))
            flat.copy_(torch.randn(flat.shape, generator=gen).to(x.dtype))
        else:
            base.zero_()  # integer inputs are usually indices: 0 is valid for any of them
        out.append(base.to(x.device) if x.device.type != "meta" else base)
    return out


def compare_outputs(before: Any, after: Any) -> str | None:
    """None if equal within tolerance, else what differs."""
    flat_b, flat_a = _flatten(before), _flatten(after)
    if len(flat_b) != len(flat_a):
        return f"{len(flat_b)} outputs before, {len(flat_a)} after"
    for i, (b, a) in enumerate(zip(flat_b, flat_a, strict=True)):
        if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
            if b != a and not (b is None or a is None):
                return f"output {i}: {b!r} before, {a!r} after"
            continue
        if b.shape != a.shape or b.dtype != a.dtype:
            return f"output {i}: {tuple(b.shape)} {b.dtype} before, {tuple(a.shape)} {a.dtype} after"
        if not b.dtype.is_floating_point:
            if not torch.equal(b, a):
                return f"output {i}: integer values differ"
            continue
        rtol, atol = TOLERANCES.get(b.dtype, LOW_PRECISION)
        a32, b32 = a.float(), b.float()
        if torch.allclose(a32, b32, rtol=rtol, atol=atol, equal_nan=True):
            continue
        # An element that is a sum of large terms cancelling to a small one carries the rounding of those
        # terms, whatever order sums them. So a tensor that fails element by element may still pass as a
        # whole: the norm of the difference within rtol of the reference's norm (a normwise relative
        # bound; widespread errors, or a NaN on one side only, still fail it).
        equal = (a32 == b32) | (a32.isnan() & b32.isnan())  # equal infinities and NaNs on both sides
        diff = (a32 - b32).masked_fill(equal, 0).double()
        err = diff.abs().max().item()
        ref_norm = b32.masked_fill(~b32.isfinite(), 0).double().norm().item()
        if not diff.norm().item() <= rtol * ref_norm + atol * b32.numel() ** 0.5:
            return f"output {i}: max abs difference {err:.3g} exceeds rtol {rtol:g} / atol {atol:g}"
    return None


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, list | tuple):
        return [y for item in x for y in _flatten(item)]
    return [x]


# What a pass's record says where its results could not be compared (the graphs draw other random numbers).
UNRUNNABLE = "not compared: the graph before it does not run on sample inputs ({why})"
UNCHECKED_RANDOM = "not compared: it changes which random numbers the graph draws ({before} before, {after} after)"


def check_pass(what: str, before: fx.GraphModule | ForwardThenBackward, after: fx.GraphModule | ForwardThenBackward,
               example_inputs: list[Any]) -> str:
    """``NUMERICS_EQUAL``, or why the results were not compared; PassNumericsError if the change ``what``
    names ("pass 'cse'", "the lowering of g0.forward") changed them."""
    from accelrun.torch_private import unset_fake_temporarily

    # The backend runs inside AOTAutograd's fake-tensor mode; this check needs real values.
    with unset_fake_temporarily(), torch.no_grad():
        return _check(what, before, after, example_inputs)


def _check(what: str, before: Any, after: Any, example_inputs: list[Any]) -> str:
    inputs = sample_inputs(example_inputs)
    # Each graph from the same seed: a dropout draws the same mask in both (unseeded, a pass that touched
    # nothing "changed the results" of every model with dropout, and the run stopped: a trial's).
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []  # (not every GPU's)
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        try:
            expected = before(*_cloned(inputs))  # a graph may write to its inputs (running statistics)
        except Exception as e:  # noqa: BLE001 (not the pass's doing: its input graph fails on sample values)
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            return UNRUNNABLE.format(why=f"{type(e).__name__}: {first}")
        torch.manual_seed(0)
        try:
            got = after(*inputs)
        except Exception as e:  # noqa: BLE001 (the change named is what broke it: said as its failure)
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            raise PassNumericsError(f"{what} left a graph that raises on the inputs the graph before it ran on: "
                                    f"{type(e).__name__}: {first}") from e
    problem = compare_outputs(expected, got)
    if problem is None:
        return NUMERICS_EQUAL
    drawn_before, drawn_after = _draws(before), _draws(after)
    # Only where accelrun's own generator draws on one side (cpu_dropout's masks, drawn in its kernels: other
    # numbers by design); a pass that dropped or doubled an ATen dropout is an error like any other.
    if drawn_before != drawn_after and any(d in OWN_GENERATOR for d in (*drawn_before, *drawn_after)):
        return UNCHECKED_RANDOM.format(before=", ".join(map(str, drawn_before)) or "none",
                                       after=", ".join(map(str, drawn_after)) or "none")
    raise PassNumericsError(f"{what} changed the graph's results: {problem}")


def _cloned(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return [_cloned(y) for y in x]
    return x.clone() if isinstance(x, torch.Tensor) else x


class ForwardThenBackward:
    """A partition stage's (forward, backward) pair run as the joint graph it was cut from: the forward on
    the primals, then the backward on what the forward saved and the tangents; returns the forward's own
    outputs and the gradients, which no pass at that stage may change (what is saved between them, it may).
    Inputs are matched by name: the cut keeps a node's name in both graphs."""

    def __init__(self, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, joint_names: list[str]) -> None:
        self.fw, self.bw, self.num_fwd_outputs, self.joint_names = fw, bw, num_fwd_outputs, joint_names

    def __call__(self, primals: list[Any], tangents: list[Any]) -> tuple[list[Any], list[Any]]:
        given = dict(zip(self.joint_names, [*primals, *tangents], strict=True))
        outs = list(self.fw(*[given[p.name] for p in self.fw.graph.find_nodes(op="placeholder")]))
        (returned,) = self.fw.graph.find_nodes(op="output")
        names = [getattr(n, "name", None) for n in returned.args[0]]
        saved = dict(zip(names[self.num_fwd_outputs:], outs[self.num_fwd_outputs:], strict=True))
        grads = self.bw(*[saved[p.name] if p.name in saved else given[p.name]
                          for p in self.bw.graph.find_nodes(op="placeholder")])
        return outs[:self.num_fwd_outputs], list(grads)

    def random_draws(self) -> list[object]:
        return random_draws(self.fw) + random_draws(self.bw)


def _draws(graph: Any) -> list[object]:
    return graph.random_draws() if isinstance(graph, ForwardThenBackward) else random_draws(graph)


def random_draws(gm: fx.GraphModule) -> list[object]:
    """The random ops ``gm`` (and the submodules it calls) run, in graph order: ops tagged as drawing from
    torch's generator, and accelrun's own that draw from theirs (``OWN_GENERATOR``)."""
    drawn = []
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and (
                    node.target in OWN_GENERATOR or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())):
                drawn.append(node.target)
    return drawn
