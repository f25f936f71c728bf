// The kernels' element types, as fused/kernel_library.py puts them before a kernel's source: ELEM is
// the storage type of the library's dtype (float, or uint16_t for bf16). fp32 is used as is; bf16 is
// widened with a shift and rounded to nearest even when stored, a NaN kept a NaN.
#include <cstdint>

static inline float to_f32(float v) { return v; }
static inline float to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
static inline void from_f32(float* dst, float v) { *dst = v; }
static inline void from_f32(uint16_t* dst, float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    *dst = (uint16_t)(f != f ? 0x7fc0u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
