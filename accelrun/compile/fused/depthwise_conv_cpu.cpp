// Depthwise 1-d convolution (one filter per channel, stride 1, dilation 1, zero padding P on both sides)
// on contiguous (B, C, T) rows, forward and backward. Each output row depends on one input row and K
// taps, so a row is computed as K shifted multiply-adds over a buffer that stays in L1, each a plain
// vector loop: what oneDNN does in 3-10x the time (depthwise_conv.py has the figures).
// The element type is fixed per library (ELEM: float, or uint16_t for bf16; defined before this source
// with the conversions): bf16 rows are widened to fp32, computed and accumulated in fp32, rounded once
// when stored.
#include <cstdint>
#include <vector>
#include <omp.h>

#ifndef ELEM
#error "define ELEM (float, or uint16_t for bf16) before this source"
#endif

// to_f32 / from_f32 come before this source (fused/element_types.h).

// A row as fp32: the row itself for fp32, else widened into `buf`.
static inline const float* as_f32(const float* row, int64_t n, std::vector<float>&) { return row; }
static inline const float* as_f32(const uint16_t* row, int64_t n, std::vector<float>& buf) {
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = to_f32(row[i]);
    return buf.data();
}
// Where a row is computed: in place for fp32, else in `buf` and rounded by store_row.
static inline float* out_f32(float* row, int64_t n, std::vector<float>&) { return row; }
static inline float* out_f32(uint16_t*, int64_t n, std::vector<float>& buf) {
    buf.resize(n);
    return buf.data();
}
static inline void store_row(float*, const float*, int64_t) {}
static inline void store_row(uint16_t* row, const float* v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) from_f32(row + i, v[i]);
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// y[b, c, t] = bias[c] + sum_k w[c, k] * x[b, c, t + k - P], the x outside [0, T) being 0; t < To.
extern "C" void depthwise_forward(const ELEM* x, const ELEM* w, const ELEM* bias, ELEM* y, int64_t B,
                                  int64_t C, int64_t T, int64_t K, int64_t P, int threads) {
    const int64_t To = T + 2 * P - K + 1;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> xb, yb;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * C; ++r) {
            const int64_t c = r % C;
            const float* xr = as_f32(x + r * T, T, xb);
            float* yr = out_f32(y + r * To, To, yb);
            const float b0 = bias ? to_f32(bias[c]) : 0.f;
            for (int64_t t = 0; t < To; ++t) yr[t] = b0;
            for (int64_t k = 0; k < K; ++k) {
                const float wk = to_f32(w[c * K + k]);
                const int64_t lo = max64(0, P - k), hi = min64(To, T + P - k);  // where x is inside the row
#pragma omp simd
                for (int64_t t = lo; t < hi; ++t) yr[t] += wk * xr[t + k - P];
            }
            store_row(y + r * To, yr, To);
        }
    }
}

// From gy = dL/dy (B, C, To): gx[b, c, s] = sum_k w[c, k] * gy[b, c, s + P - k];
// gw[c, k] = sum_{b, t} gy[b, c, t] * x[b, c, t + k - P]; gb[c] = sum_{b, t} gy[b, c, t].
// One channel per thread at a time, all its batch rows: the channel's sums need no other thread's.
// A null gx, gw or gb is not computed.
extern "C" void depthwise_backward(const ELEM* gy, const ELEM* x, const ELEM* w, ELEM* gx, ELEM* gw, ELEM* gb,
                                   int64_t B, int64_t C, int64_t T, int64_t K, int64_t P, int threads) {
    const int64_t To = T + 2 * P - K + 1;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> gyb, xb, gxb, wsum(K);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < C; ++c) {
            for (int64_t k = 0; k < K; ++k) wsum[k] = 0.f;
            float bsum = 0.f;
            for (int64_t b = 0; b < B; ++b) {
                const int64_t r = b * C + c;
                const float* g = as_f32(gy + r * To, To, gyb);
                if (gx) {
                    float* gxr = out_f32(gx + r * T, T, gxb);
                    for (int64_t s = 0; s < T; ++s) gxr[s] = 0.f;
                    for (int64_t k = 0; k < K; ++k) {
                        const float wk = to_f32(w[c * K + k]);
                        const int64_t lo = max64(0, k - P), hi = min64(T, To + k - P);  // gy inside its row
#pragma omp simd
                        for (int64_t s = lo; s < hi; ++s) gxr[s] += wk * g[s + P - k];
                    }
                    store_row(gx + r * T, gxr, T);
                }
                if (gw) {
                    const float* xr = as_f32(x + r * T, T, xb);
                    for (int64_t k = 0; k < K; ++k) {
                        const int64_t lo = max64(0, P - k), hi = min64(To, T + P - k);
                        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                        for (int64_t t = lo; t < hi; ++t) acc += g[t] * xr[t + k - P];
                        wsum[k] += acc;
                    }
                }
                if (gb) {
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t t = 0; t < To; ++t) acc += g[t];
                    bsum += acc;
                }
            }
            if (gw)
                for (int64_t k = 0; k < K; ++k) from_f32(gw + c * K + k, wsum[k]);
            if (gb) from_f32(gb + c, bsum);
        }
    }
}
