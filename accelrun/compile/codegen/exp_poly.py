"""exp's polynomial in C++, written once for the code generator's scalar ``acc_exp`` and the attention
kernel's vector ``vexp`` (``compile/fused/attention_cpu.cpp``, which gets this text put before it).

``acc_exp_core<T, B>`` takes x already clamped to [-87.33654, 88.72283] and returns exp(x) for T a float
or a GCC vector of floats (B: the int32 type of the same width); each caller keeps its own clamps and its
answer below the range (0) and above it. exp(x) = 2^n * exp(g), |g| <= ln2/2, exp(g) a degree-6
polynomial (Cephes' coefficients, ~1 ulp); no branches, so loops calling it vectorize. n is rounded by
adding 1.5 * 2^23 (its low mantissa bits are then n itself, which become the exponent bits of 2^n):
cheaper than floor and a conversion. A NaN passes through the clamps and the polynomial.
"""

EXP_CORE = r"""
#define ACC_EXP_LO (-87.33654f)
#define ACC_EXP_HI (88.72283f)
template <class T, class B>
static inline T acc_exp_core(T xc) {
    const T t = xc * 1.44269504088896341f + 12582912.0f;
    const T n = t - 12582912.0f;
    T g = xc - n * 0.693359375f;
    g = g - n * -2.12194440e-4f;
    T p = T{} + 1.9875691500e-4f;
    p = p * g + 1.3981999507e-3f;
    p = p * g + 8.3334519073e-3f;
    p = p * g + 4.1665795894e-2f;
    p = p * g + 1.6666665459e-1f;
    p = p * g + 5.0000001201e-1f;
    p = p * g * g + g + 1.0f;
    B t_bits;
    __builtin_memcpy(&t_bits, &t, sizeof t_bits);
    const B bits = (t_bits - 0x4B400000 + 127) << 23;
    T scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
"""
