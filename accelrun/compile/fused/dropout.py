"""Dropout's random numbers as a pure function of (seed, element index), so that a fusion region can
draw them where it uses them instead of reading a mask ATen drew beforehand.

On a CPU, ATen's ``bernoulli_`` draws each element from a Mersenne Twister one at a time: about 3 ns an
element here, a third of a nanoGPT step's time at dropout 0.1. A counter-based generator needs no
state between elements, so a generated kernel computes them in its own loop, vectorized, fused with
the multiply and whatever surrounds it (``passes/cpu_dropout.py`` puts it in the graph).

The generator: three rounds of a 32-bit integer mixer (Chris Wellons' ``lowbias32``, a bijection)
over the element's index, keyed by the two halves of a 64-bit seed drawn from torch's generator, so
``torch.manual_seed`` decides the masks and a checkpoint's RNG state resumes them. The top 24 bits
become a float in [0, 1). ``dropout_uniform`` is the reference: integer tensor arithmetic giving the
generated C++'s numbers bit for bit (where a region runs as ATen calls, the masks are the same).
``cpp_source`` is the C++ of the same steps, written from the same constants.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from accelrun.op_source_lookup import known_to_inspect

known_to_inspect(__name__)  # before the ops below: torch.library looks up their source lines

MASK32 = 0xFFFFFFFF
MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)  # lowbias32's, between xor-shifts by 16, 15 and 16
MIX_SHIFTS = (16, 15, 16)
INDEX_HIGH_MULTIPLIER = 0x9E3779B9  # spreads the index's upper 32 bits (tensors past 2^32 elements)
UNIFORM_BITS = 24  # a float32 holds 24 bits exactly: u = (x >> 8) * 2^-24 in [0, 1)
SEED_HIGH = 1 << 62  # seeds are drawn in [0, 2^62): non-negative as an int64


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 in 16-bit halves of c: no product exceeds 2^48, so int64 never overflows.
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> MIX_SHIFTS[0])
    x = _mul32(x, MIX_MULTIPLIERS[0])
    x = x ^ (x >> MIX_SHIFTS[1])
    x = _mul32(x, MIX_MULTIPLIERS[1])
    return x ^ (x >> MIX_SHIFTS[2])


def uniform_at(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 numbers in [0, 1), one for each (non-negative int64) element index, from (seed, index) alone."""
    seed = seed.to(torch.int64)
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    x = _mix((index & MASK32) ^ k0)
    x = _mix(x ^ k1 ^ _mul32(index >> 32, INDEX_HIGH_MULTIPLIER))
    x = _mix((x + k0) & MASK32)
    return (x >> (32 - UNIFORM_BITS)).to(torch.float32) * 2.0**-UNIFORM_BITS


def uniform_reference(seed: torch.Tensor, size: list[int]) -> torch.Tensor:
    """float32 numbers in [0, 1) of shape ``size``, element i (row-major) from (seed, i) alone."""
    numel = 1
    for s in size:
        numel *= s
    return uniform_at(seed, torch.arange(numel, dtype=torch.int64, device=seed.device)).reshape(size)


@torch.library.custom_op("accelrun::dropout_uniform", mutates_args=())
def dropout_uniform(seed: torch.Tensor, size: list[int]) -> torch.Tensor:
    """Numbers in [0, 1) for a dropout mask (``uniform_reference``'s); a region's generated code draws
    the same ones inside its loop. Called as an op (a region run as ATen calls) on a CPU, a compiled
    loop of ``cpp_source`` fills them: the reference's integer tensor arithmetic took 20.8 ms for a
    [16, 256, 128] mask where ATen's own dropout takes 4.1."""
    filled = _filled(seed, size)
    return filled if filled is not None else uniform_reference(seed, size)


@functools.cache  # built once per process (and per machine, on disk); None: no compiler
def _fill_library() -> ctypes.CDLL | None:
    from accelrun.compile.codegen.cpp_build import build_and_load, find_compiler

    if find_compiler() is None:
        return None
    try:
        lib = build_and_load(FILL_SOURCE)
    except Exception:  # noqa: BLE001 (g++ refused it, ...): the reference draws the same numbers
        return None
    lib.acc_uniform_fill.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.acc_uniform_fill.restype = None
    return lib


def _filled(seed: torch.Tensor, size: list[int]) -> torch.Tensor | None:
    if seed.device.type != "cpu":
        return None
    lib = _fill_library()
    if lib is None:
        return None
    out = torch.empty(size, dtype=torch.float32)
    lib.acc_uniform_fill(int(seed), out.data_ptr(), out.numel(), torch.get_num_threads())
    return out


@dropout_uniform.register_fake
def _(seed, size):
    return seed.new_empty(size, dtype=torch.float32)


def cpp_defines() -> str:
    """The generator's constants as C macros, for a kernel that writes its own vector form of it
    (``attention_cpu.cpp``'s ``keep_factor``)."""
    (m0, m1), (s0, s1, s2) = MIX_MULTIPLIERS, MIX_SHIFTS
    return "".join(f"#define {name} {value}\n" for name, value in (
        ("ACC_MIX_M0", f"0x{m0:X}u"), ("ACC_MIX_M1", f"0x{m1:X}u"), ("ACC_MIX_S0", s0), ("ACC_MIX_S1", s1),
        ("ACC_MIX_S2", s2), ("ACC_INDEX_HIGH", f"0x{INDEX_HIGH_MULTIPLIER:X}u"),
        ("ACC_UNIFORM_SHIFT", 32 - UNIFORM_BITS), ("ACC_UNIFORM_UNIT", f"{2.0**-UNIFORM_BITS!r}f")))


def cpp_source() -> str:
    """``acc_uniform(seed, index)``: the reference's steps in C++ (uint32_t wraps as ``_mul32`` does)."""
    (m0, m1), (s0, s1, s2) = MIX_MULTIPLIERS, MIX_SHIFTS
    return f"""
static inline uint32_t acc_mix32(uint32_t x) {{
    x ^= x >> {s0}; x *= 0x{m0:X}u; x ^= x >> {s1}; x *= 0x{m1:X}u; x ^= x >> {s2};
    return x;
}}
// dropout's numbers in [0, 1) from (seed, element index) alone: compile/fused/dropout.py.
static inline float acc_uniform(int64_t seed, int64_t index) {{
    const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
    const uint32_t high = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
    uint32_t x = acc_mix32(static_cast<uint32_t>(index) ^ k0);
    x = acc_mix32(x ^ k1 ^ (high * 0x{INDEX_HIGH_MULTIPLIER:X}u));
    x = acc_mix32(x + k0);
    return static_cast<float>(static_cast<int32_t>(x >> {32 - UNIFORM_BITS})) * {2.0**-UNIFORM_BITS!r}f;
}}
"""


FILL_SOURCE = "#include <stdint.h>\n" + cpp_source() + """
extern "C" void acc_uniform_fill(int64_t seed, float* out, int64_t n, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = acc_uniform(seed, i);
}
"""
