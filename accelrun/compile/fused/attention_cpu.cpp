// Scaled dot-product attention on CPUs, forward and backward, for accelrun's cpu_attention op.
//
// One task is one (batch, key/value head): it packs that head's K (transposed) and V once, in fp32,
// and runs every query head of its group (grouped-query attention without repeating K and V) over
// blocks of MR query rows. A block's scores against all its keys (up to the diagonal when causal,
// rounded up to a whole vector of columns) stay in an MR x S buffer, so the softmax is exact (no
// online rescaling) and the backward recomputes the probabilities from the saved log-sum-exp. The
// products are register-blocked: MR rows x 2 vectors of accumulators, written with GCC's vector
// extensions at the CPU's own width, so one source serves AVX-512, AVX2 and others. bf16 tensors are
// widened when packed and rounded when stored; all arithmetic is fp32.
//
// Layouts: q, k, v and the output gradient are [B, S, H, D] with any strides but a unit stride on D
// (the caller passes them in that order, whatever their logical order); o, dq, dk, dv are written
// contiguous [B, S, H, D]; lse is contiguous [B, Hq, S]. D is a multiple of 16.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include <omp.h>

// The vectors are the CPU's own width: g++ lowers wider GCC vectors element by element on a CPU
// without them (64-byte vectors on an AVX2 machine made this kernel 10x slower than ATen's). MR rows
// of 2 vectors of accumulators, plus 2 of B and 1 of A, fill the register file without spilling:
// 32 registers on AVX-512, 16 on AVX2.
#if defined(__AVX512F__)
enum { VL = 16, MR = 8 };
#define ACC_LANES 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#else
enum { VL = 8, MR = 6 };
#define ACC_LANES 0, 1, 2, 3, 4, 5, 6, 7
#endif
enum { MAX_HEAD_DIM = 256 };
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

static inline vf load(const float* p) { return *(const vfu*)p; }
static inline void store(float* p, vf v) { *(vfu*)p = v; }
// x - 0 rather than 0 + x: IEEE says 0 + -0 is +0, so g++ must keep that add (a scalar add and a register
// broadcast per splat, contending with the FMAs for the shuffle port); x - 0 is x for every x, and a splat
// of a value in memory becomes one broadcast load.
static inline vf splat(float x) { return x - vf{}; }
static inline vi splat_i(int32_t x) { return vi{} + x; }
static const vi LANES = {ACC_LANES};

// exp on VL lanes, 0 below the range: the code generator's polynomial (acc_exp_core, codegen/exp_poly.py,
// which attention.py puts before this source).
#ifndef ACC_EXP_LO
#error "put codegen/exp_poly.py's EXP_CORE before this source"
#endif
static inline vf vexp(vf x) {
    const vf lo = x < splat(ACC_EXP_LO) ? splat(ACC_EXP_LO) : x;
    const vf xc = lo > splat(ACC_EXP_HI) ? splat(ACC_EXP_HI) : lo;
    return x < splat(ACC_EXP_LO) ? splat(0.0f) : acc_exp_core<vf, vi>(xc);
}
static inline float hsum(vf v) { float s = 0; for (int i = 0; i < VL; ++i) s += v[i]; return s; }
static inline float hmax(vf v) { float s = v[0]; for (int i = 1; i < VL; ++i) s = v[i] > s ? v[i] : s; return s; }

// Element types: to_f32 / from_f32 come before this source (fused/element_types.h).
template <class T> static inline void widen(float* dst, const T* src, int n) { for (int i = 0; i < n; ++i) dst[i] = to_f32(src[i]); }
template <class T> static inline void narrow(T* dst, const float* src, int n) { for (int i = 0; i < n; ++i) from_f32(dst + i, src[i]); }

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Dropout on the probabilities: lane l's factor is `keep` (1 / (1 - p)) or 0 by the number drawn for
// element `first + l` of the [B, Hq, S, S] probabilities: compile/fused/dropout.py's generator (whose
// constants attention.py defines before this source), in vectors, the same numbers lane for lane.
static inline vu vmix32(vu x) {
    x ^= x >> ACC_MIX_S0; x *= ACC_MIX_M0; x ^= x >> ACC_MIX_S1; x *= ACC_MIX_M1; x ^= x >> ACC_MIX_S2;
    return x;
}
static inline vf keep_factor(int64_t seed, int64_t first, float p, float keep) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)((uint64_t)seed >> 32);
    const uint32_t lo0 = (uint32_t)first, hi0 = (uint32_t)((uint64_t)first >> 32);
    const vu lo = (vu)LANES + lo0;
    const vu hi = (vu){} + hi0 - (vu)(lo < (vu){} + lo0);  // a lane past 2^32 carries into the high half
    vu x = vmix32(lo ^ k0);
    x = vmix32(x ^ k1 ^ (hi * ACC_INDEX_HIGH));
    x = vmix32(x + k0);
    const vf u = __builtin_convertvector((vi)(x >> ACC_UNIFORM_SHIFT), vf) * ACC_UNIFORM_UNIT;
    return u >= p ? splat(keep) : splat(0);
}

// Calls f(std::integral_constant<int, M>{}, r) on blocks of M rows from row r that cover m rows
// (1 <= m <= MR): one block of MR, or a tail cut into blocks of 4, 2 and 1. The products take the row
// count as a template argument, so their row loops unroll into broadcasts straight from memory with no
// per-row test (5% faster than testing i < m in the loop, on the machine that wrote this). Four row
// counts instead of one per m: g++ builds this file in 0.9 s instead of 1.2 (AVX2), time a cold first
// step waited for it. A cut tail sums in the same order; g++'s contractions into FMAs may still differ,
// by an ulp.
template <class F>
static inline void with_rows(int m, F&& f) {
    if (m == MR) {
        f(std::integral_constant<int, MR>{}, 0);
        return;
    }
    int r = 0;
    if (m - r >= 4) { f(std::integral_constant<int, 4>{}, r); r += 4; }
    if (m - r >= 2) { f(std::integral_constant<int, 2>{}, r); r += 2; }
    if (m - r >= 1) f(std::integral_constant<int, 1>{}, r);
}

// C[i][0:n] = alpha * sum_k A[i][k] B[k][0:n] for i < M (M <= MR, n % VL == 0); B row-major.
// NV vectors of columns per pass: 2 for the body, 1 for a one-vector tail.
template <int M, int NV>
static inline void gemm_nn_cols(int j, int kd, const float* A, int lda, const float* B, int ldb,
                                float* C, int ldc, float alpha) {
    vf acc[M][NV];
    for (int i = 0; i < M; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = splat(0);
    for (int k = 0; k < kd; ++k) {
        vf b[NV];
        for (int v = 0; v < NV; ++v) b[v] = load(B + (int64_t)k * ldb + j + v * VL);
        for (int i = 0; i < M; ++i) {
            const vf a = splat(A[i * lda + k]);
            for (int v = 0; v < NV; ++v) acc[i][v] += a * b[v];
        }
    }
    for (int i = 0; i < M; ++i)
        for (int v = 0; v < NV; ++v) store(C + i * ldc + j + v * VL, acc[i][v] * alpha);
}
template <int M>
static inline void gemm_nn_m(int n, int kd, const float* A, int lda, const float* B, int ldb, float* C, int ldc,
                             float alpha) {
    int j = 0;
    for (; j + 2 * VL <= n; j += 2 * VL) gemm_nn_cols<M, 2>(j, kd, A, lda, B, ldb, C, ldc, alpha);
    if (j < n) gemm_nn_cols<M, 1>(j, kd, A, lda, B, ldb, C, ldc, alpha);
}
static inline void gemm_nn(int m, int n, int kd, const float* A, int lda, const float* B, int ldb, float* C,
                           int ldc, float alpha) {
    with_rows(m, [&](auto M, int r) {
        gemm_nn_m<decltype(M)::value>(n, kd, A + r * lda, lda, B, ldb, C + r * ldc, ldc, alpha);
    });
}

// C[c][0:d] += alpha * sum_{i<M} P[i][c] X[i][0:d] for c < n: the transposed products (dV += P^T dO,
// dK += dS^T Q). X's block stays in registers while C's rows stream past.
template <int M, int NV>
static inline void gemm_tn_cols(int n, int j, const float* P, int ldp, const float* X, int ldx, float* C,
                                int ldc, float alpha) {
    vf x[M][NV];
    for (int i = 0; i < M; ++i)
        for (int v = 0; v < NV; ++v) x[i][v] = load(X + i * ldx + j + v * VL) * alpha;
    for (int c = 0; c < n; ++c) {
        vf acc[NV];
        for (int v = 0; v < NV; ++v) acc[v] = load(C + (int64_t)c * ldc + j + v * VL);
        for (int i = 0; i < M; ++i) {
            const vf p = splat(P[i * ldp + c]);
            for (int v = 0; v < NV; ++v) acc[v] += p * x[i][v];
        }
        for (int v = 0; v < NV; ++v) store(C + (int64_t)c * ldc + j + v * VL, acc[v]);
    }
}
template <int M>
static inline void gemm_tn_m(int n, int d, const float* P, int ldp, const float* X, int ldx, float* C, int ldc,
                             float alpha) {
    int j = 0;
    for (; j + 2 * VL <= d; j += 2 * VL) gemm_tn_cols<M, 2>(n, j, P, ldp, X, ldx, C, ldc, alpha);
    if (j < d) gemm_tn_cols<M, 1>(n, j, P, ldp, X, ldx, C, ldc, alpha);
}
static inline void gemm_tn_acc(int m, int n, int d, const float* P, int ldp, const float* X, int ldx, float* C,
                               int ldc, float alpha) {
    with_rows(m, [&](auto M, int r) {
        gemm_tn_m<decltype(M)::value>(n, d, P + r * ldp, ldp, X + r * ldx, ldx, C, ldc, alpha);
    });
}

struct Strides { int64_t b, s, h; };
struct Shape { int64_t B, S, Hq, Hkv, D; };

static float* scratch(int64_t floats) { return (float*)aligned_alloc(64, (size_t)((floats + 15) / 16 * 16) * sizeof(float)); }

// One (batch, kv head)'s K^T [D][Sp] and V [Sp][D] (or V^T, K rows for the backward), zero-padded to Sp.
// The transpose goes VL rows at a time, so each column of K^T is written as whole vectors.
template <class T>
static void pack_head(const T* x, Strides st, int64_t b, int64_t h, const Shape& sh, int Sp, float* rows,
                      float* cols) {
    const int D = (int)sh.D;
    for (int s0 = 0; s0 < Sp; s0 += VL) {  // Sp is a multiple of VL
        float block[VL][MAX_HEAD_DIM];
        for (int r = 0; r < VL; ++r) {
            const int s = s0 + r;
            if (s < sh.S) widen(block[r], x + b * st.b + s * st.s + h * st.h, D);
            else memset(block[r], 0, sizeof(float) * D);
            if (rows) memcpy(rows + (int64_t)s * D, block[r], sizeof(float) * D);
        }
        if (cols)
            for (int d = 0; d < D; ++d) {
                vf column;
                for (int r = 0; r < VL; ++r) column[r] = block[r][d];
                store(cols + (int64_t)d * Sp + s0, column);
            }
    }
}

template <class T>
static void forward(const T* q, const T* k, const T* v, T* o, float* lse, Shape sh, Strides sq, Strides sk,
                    Strides sv, float scale, int causal, int64_t seed, float drop, int nt) {
    const float keep = drop > 0 ? 1.0f / (1.0f - drop) : 1.0f;
    const int64_t G = sh.Hq / sh.Hkv;
    const int S = (int)sh.S, D = (int)sh.D, Sp = round_up(S, 2 * VL);
#pragma omp parallel num_threads(nt)
    {
        float* kt = scratch((int64_t)D * Sp);
        float* vp = scratch((int64_t)Sp * D);
        float* sc = scratch((int64_t)MR * Sp);
        float* qb = scratch((int64_t)MR * D);
        float* ob = scratch((int64_t)MR * D);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < sh.B; ++b)
            for (int64_t h = 0; h < sh.Hkv; ++h) {
                pack_head(k, sk, b, h, sh, Sp, nullptr, kt);
                pack_head(v, sv, b, h, sh, Sp, vp, nullptr);
                for (int64_t hq = h * G; hq < (h + 1) * G; ++hq)
                    for (int r0 = 0; r0 < S; r0 += MR) {
                        const int m = S - r0 < MR ? S - r0 : MR;
                        const int kp = round_up(causal ? r0 + m : S, VL);
                        float inv_sum[MR];
                        for (int i = 0; i < m; ++i) widen(qb + i * D, q + b * sq.b + (r0 + i) * sq.s + hq * sq.h, D);
                        gemm_nn(m, kp, D, qb, D, kt, Sp, sc, Sp, scale);
                        for (int i = 0; i < m; ++i) {
                            float* row = sc + i * Sp;
                            for (int c = causal ? r0 + i + 1 : S; c < kp; ++c) row[c] = -INFINITY;
                            vf mx = splat(-INFINITY);
                            for (int c = 0; c < kp; c += VL) { const vf x = load(row + c); mx = x > mx ? x : mx; }
                            const float rmax = hmax(mx);
                            vf sum = splat(0);
                            for (int c = 0; c < kp; c += VL) {
                                const vf e = vexp(load(row + c) - rmax);
                                store(row + c, e);
                                sum += e;
                            }
                            const float total = hsum(sum);
                            inv_sum[i] = 1.0f / total;  // applied to the output row, not to every probability
                            lse[(b * sh.Hq + hq) * S + r0 + i] = rmax + logf(total);
                            if (drop > 0) {  // after the sum: dropout scales probabilities, not the softmax
                                const int64_t first = ((b * sh.Hq + hq) * S + r0 + i) * (int64_t)S;
                                for (int c = 0; c < kp; c += VL)
                                    store(row + c, load(row + c) * keep_factor(seed, first + c, drop, keep));
                            }
                        }
                        gemm_nn(m, D, kp, sc, Sp, vp, D, ob, D, 1.0f);
                        for (int i = 0; i < m; ++i) {
                            for (int d = 0; d < D; ++d) ob[i * D + d] *= inv_sum[i];
                            narrow(o + ((b * S + r0 + i) * sh.Hq + hq) * D, ob + i * D, D);
                        }
                    }
            }
        free(kt); free(vp); free(sc); free(qb); free(ob);
    }
}

template <class T>
static void backward(const T* dout, Strides sdo, const T* q, const T* k, const T* v, const T* o, const float* lse,
                     T* dq, T* dk, T* dv, Shape sh, Strides sq, Strides sk, Strides sv, float scale, int causal,
                     int64_t seed, float drop, int nt) {
    const float keep = drop > 0 ? 1.0f / (1.0f - drop) : 1.0f;
    const int64_t G = sh.Hq / sh.Hkv;
    const int S = (int)sh.S, D = (int)sh.D, Sp = round_up(S, 2 * VL);
#pragma omp parallel num_threads(nt)
    {
        float* kt = scratch((int64_t)D * Sp);
        float* kr = scratch((int64_t)Sp * D);
        float* vt = scratch((int64_t)D * Sp);
        float* dk_acc = scratch((int64_t)Sp * D);
        float* dv_acc = scratch((int64_t)Sp * D);
        float* pb = scratch((int64_t)MR * Sp);
        float* ds = scratch((int64_t)MR * Sp);
        float* qb = scratch((int64_t)MR * D);
        float* dob = scratch((int64_t)MR * D);
        float* ob = scratch((int64_t)MR * D);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < sh.B; ++b)
            for (int64_t h = 0; h < sh.Hkv; ++h) {
                pack_head(k, sk, b, h, sh, Sp, kr, kt);
                pack_head(v, sv, b, h, sh, Sp, nullptr, vt);
                memset(dk_acc, 0, sizeof(float) * Sp * D);
                memset(dv_acc, 0, sizeof(float) * Sp * D);
                for (int64_t hq = h * G; hq < (h + 1) * G; ++hq)
                    for (int r0 = 0; r0 < S; r0 += MR) {
                        const int m = S - r0 < MR ? S - r0 : MR;
                        const int kn = causal ? r0 + m : S, kp = round_up(kn, VL);
                        float delta[MR];  // rowsum(dO * O): the softmax's backward term
                        for (int i = 0; i < m; ++i) {
                            widen(qb + i * D, q + b * sq.b + (r0 + i) * sq.s + hq * sq.h, D);
                            widen(dob + i * D, dout + b * sdo.b + (r0 + i) * sdo.s + hq * sdo.h, D);
                            widen(ob + i * D, o + ((b * S + r0 + i) * sh.Hq + hq) * D, D);
                            vf acc = splat(0);  // in vectors: a scalar sum waits on each add in turn
                            for (int d = 0; d < D; d += VL) acc += load(dob + i * D + d) * load(ob + i * D + d);
                            delta[i] = hsum(acc);
                        }
                        gemm_nn(m, kp, D, qb, D, kt, Sp, pb, Sp, scale);  // scores, again
                        gemm_nn(m, kp, D, dob, D, vt, Sp, ds, Sp, 1.0f);  // dP = dO V^T
                        for (int i = 0; i < m; ++i) {
                            float* prow = pb + i * Sp;
                            float* dsrow = ds + i * Sp;
                            const int valid = causal ? r0 + i + 1 : S;
                            const float l = lse[(b * sh.Hq + hq) * S + r0 + i];
                            const int64_t first = ((b * sh.Hq + hq) * S + r0 + i) * (int64_t)S;
                            for (int c = 0; c < kp; c += VL) {
                                vf p = vexp(load(prow + c) - l);
                                if (c + VL > valid)  // the vector the diagonal (or the end) crosses
                                    p = LANES + splat_i(c) < splat_i(valid) ? p : splat(0);
                                if (drop > 0) {  // dV takes the dropped probabilities, dP the mask too
                                    const vf f = keep_factor(seed, first + c, drop, keep);
                                    store(prow + c, p * f);
                                    store(dsrow + c, p * (load(dsrow + c) * f - delta[i]));
                                } else {
                                    store(prow + c, p);
                                    store(dsrow + c, p * (load(dsrow + c) - delta[i]));  // dS = P (dP - delta)
                                }
                            }
                        }
                        gemm_tn_acc(m, kn, D, pb, Sp, dob, D, dv_acc, D, 1.0f);
                        gemm_tn_acc(m, kn, D, ds, Sp, qb, D, dk_acc, D, scale);
                        gemm_nn(m, D, kp, ds, Sp, kr, D, ob, D, scale);  // dQ = scale dS K
                        for (int i = 0; i < m; ++i) narrow(dq + ((b * S + r0 + i) * sh.Hq + hq) * D, ob + i * D, D);
                    }
                for (int s = 0; s < S; ++s) {
                    narrow(dk + ((b * S + s) * sh.Hkv + h) * D, dk_acc + (int64_t)s * D, D);
                    narrow(dv + ((b * S + s) * sh.Hkv + h) * D, dv_acc + (int64_t)s * D, D);
                }
            }
        free(kt); free(kr); free(vt); free(dk_acc); free(dv_acc); free(pb); free(ds); free(qb); free(dob); free(ob);
    }
}

// The C entry points, for one element type: attention.py puts `#define ELEM float` (or uint16_t, bf16's
// bits) before this source, so a library holds the one instantiation a run needs and g++ builds it in
// half the time of both (0.8 s against 1.7 on the machine that wrote this). Strides are in elements,
// [b, s, h] order.
#ifndef ELEM
#error "define ELEM (float, or uint16_t for bf16) before this source"
#endif
// Floats per vector the library was built with (16 on AVX-512, 8 otherwise): tests check it is the CPU's.
extern "C" int attention_vector_lanes() { return VL; }

// keep_factor's n factors (n a multiple of VL) from element `first` on, for tests against the reference
// generator (indices past 2^32 included, which no test's attention reaches).
extern "C" void attention_keep_factors(int64_t seed, int64_t first, int n, float p, float* out) {
    for (int c = 0; c < n; c += VL) store(out + c, keep_factor(seed, first + c, p, 1.0f / (1.0f - p)));
}

extern "C" void attention_forward(const void* q, const void* k, const void* v, void* o, float* lse,
                                  const int64_t* shape, const int64_t* strides, float scale, int causal,
                                  int64_t seed, float drop, int nt) {
    const Shape sh{shape[0], shape[1], shape[2], shape[3], shape[4]};
    const Strides sq{strides[0], strides[1], strides[2]}, sk{strides[3], strides[4], strides[5]},
        sv{strides[6], strides[7], strides[8]};
    forward((const ELEM*)q, (const ELEM*)k, (const ELEM*)v, (ELEM*)o, lse, sh, sq, sk, sv, scale, causal, seed, drop, nt);
}

extern "C" void attention_backward(const void* dout, const void* q, const void* k, const void* v,
                                   const void* o, const float* lse, void* dq, void* dk, void* dv,
                                   const int64_t* shape, const int64_t* strides, float scale, int causal,
                                   int64_t seed, float drop, int nt) {
    const Shape sh{shape[0], shape[1], shape[2], shape[3], shape[4]};
    const Strides sq{strides[0], strides[1], strides[2]}, sk{strides[3], strides[4], strides[5]},
        sv{strides[6], strides[7], strides[8]}, sdo{strides[9], strides[10], strides[11]};
    backward((const ELEM*)dout, sdo, (const ELEM*)q, (const ELEM*)k, (const ELEM*)v, (const ELEM*)o, lse,
             (ELEM*)dq, (ELEM*)dk, (ELEM*)dv, sh, sq, sk, sv, scale, causal, seed, drop, nt);
}
