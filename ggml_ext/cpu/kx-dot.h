// Dots of up to four rows with one vector, the rows read interleaved (Q4_0 rows with a Q8_0
// vector, F16 rows with an F16 vector): the inner loop of GGML_OP_KX_FFN_ROWS's gate and up
// rows for one token.
//
// Why several rows at once: the host op reads rows scattered over a layer's matrices, one
// 4.5 KiB Q4_0 row per neuron, and a thread walking one row at a time keeps few reads in
// flight: on the H200 host the op scaled linearly with threads at 3.2 GB/s each, far under
// the 68-80 GB/s those reads reach without the arithmetic (bench/results/host-pages/). Four
// rows walked together are four streams for the prefetchers and four independent chains
// for the core: cold scattered rows on the development VM, one thread, 3.5 GB/s one row at
// a time, 5.5-5.9 two, 7.0-7.2 four.
//
// The results are bit for bit ggml's: Q4_0 its AVX2 ggml_vec_dot_q4_0_q8_0 (per block the
// same 8 int32 lane sums (4 bytes each; (q-8)·y = q·y - 8·Σy is exact in integers), the same
// scale product, the same FMA into 8 float lanes and the same horizontal sum); F16 its
// ggml_vec_dot_f16, written with the same simd-mappings.h macros (the same lanes, the same
// accumulators, the same reduction and double-precision tail on every CPU they cover).
#pragma once

#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml-impl.h"
#include "simd-mappings.h"
#include "vec.h" // ggml_float

#include <stdbool.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KX_DOT_Q4_0_ROWS 1

// 8 int32 lanes, each the sum of 4 adjacent byte products u8 * s8
static inline __m256i kx_dot_u8s8(__m256i u, __m256i s) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    // u <= 15 here: the 16-bit pair sums cannot saturate
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float kx_dot_hsum(__m256 x) { // ggml's hsum_float_8
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#endif

#if defined(KX_DOT_Q4_0_ROWS)
// nr is a constant at each call site below: the accumulators stay in registers
static inline __attribute__((always_inline)) void kx_dot_q4_0_n(int64_t k, const int nr, const void * const * rows,
                                                               const void * vy, float * out) {
    const block_q4_0 * w[4];
    for (int r = 0; r < nr; ++r) {
        w[r] = (const block_q4_0 *) rows[r];
    }
    const block_q8_0 * y = (const block_q8_0 *) vy;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi8(8);
    __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    const int64_t nb = k / QK4_0;
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i yv = _mm256_loadu_si256((const __m256i *) y[b].qs);
        const __m256i ys = kx_dot_u8s8(eight, yv); // 8·Σy per lane: the -8 offset of the nibbles
        const float dy = GGML_CPU_FP16_TO_FP32(y[b].d);
        for (int r = 0; r < nr; ++r) {
            const __m128i q = _mm_loadu_si128((const __m128i *) w[r][b].qs);
            // low nibbles are elements 0-15, high nibbles 16-31 (ggml's bytes_from_nibbles_32)
            const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
            const __m256i p = _mm256_sub_epi32(kx_dot_u8s8(u, yv), ys);
            const __m256 d = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(w[r][b].d) * dy);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < nr; ++r) {
        out[r] = kx_dot_hsum(acc[r]);
    }
}
#endif

// ggml_vec_dot_f16's generic SIMD branch (the one x86, NEON without SVE, POWER, WASM and
// LoongArch take) for nr rows at once
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
#define KX_DOT_F16_ROWS 1
static inline __attribute__((always_inline)) void kx_dot_f16_n(int64_t k, const int nr, const void * const * rows,
                                                              const void * vy, float * out) {
    const ggml_fp16_t * x[4];
    for (int r = 0; r < nr; ++r) {
        x[r] = (const ggml_fp16_t *) rows[r];
    }
    const ggml_fp16_t * y = (const ggml_fp16_t *) vy;
    const int n  = (int) k;
    const int np = n & ~(GGML_F16_DOT_STEP - 1);
    GGML_F16_DOT_VEC sum[4][GGML_F16_DOT_ARR];
    for (int r = 0; r < nr; ++r) {
        for (int j = 0; j < GGML_F16_DOT_ARR; ++j) {
            sum[r][j] = GGML_F16_DOT_VEC_ZERO;
        }
    }
    for (int i = 0; i < np; i += GGML_F16_DOT_STEP) {
        for (int j = 0; j < GGML_F16_DOT_ARR; ++j) {
            const GGML_F16_DOT_VEC ay = GGML_F16_DOT_VEC_LOAD(y + i + j*GGML_F16_DOT_EPR, j);
            for (int r = 0; r < nr; ++r) {
                const GGML_F16_DOT_VEC ax = GGML_F16_DOT_VEC_LOAD(x[r] + i + j*GGML_F16_DOT_EPR, j);
                sum[r][j] = GGML_F16_DOT_VEC_FMA(sum[r][j], ax, ay);
            }
        }
    }
    for (int r = 0; r < nr; ++r) {
        ggml_float sumf = 0.0;
        GGML_F16_DOT_VEC_REDUCE(sumf, sum[r]);
        for (int i = np; i < n; ++i) {
            sumf += (ggml_float) (GGML_CPU_FP16_TO_FP32(x[r][i])*GGML_CPU_FP16_TO_FP32(y[i]));
        }
        out[r] = (float) sumf;
    }
}
#endif

// whether kx_dot_rows has a path for rows of this type on this CPU
static inline bool kx_dot_rows_ok(enum ggml_type type) {
#if defined(KX_DOT_Q4_0_ROWS)
    if (type == GGML_TYPE_Q4_0) {
        return true;
    }
#endif
#if defined(KX_DOT_F16_ROWS)
    if (type == GGML_TYPE_F16) {
        return true;
    }
#endif
    (void) type;
    return false;
}

// the bodies with nr a constant, so the accumulators stay in registers
#define KX_DOT_ROWS_NR(fn, k, nr, rows, vy, out) \
    switch (nr) { \
        case 4:  fn(k, 4, rows, vy, out); break; \
        case 3:  fn(k, 3, rows, vy, out); break; \
        case 2:  fn(k, 2, rows, vy, out); break; \
        default: fn(k, 1, rows, vy, out); break; \
    }

// out[r] = row r · y over k elements, r < nr <= 4, y in the type's vec_dot type (Q4_0: k %
// 32 == 0, y Q8_0; F16: y F16). False where kx_dot_rows_ok(type) is false (the caller uses
// ggml's vec_dot per row).
static inline bool kx_dot_rows(enum ggml_type type, int64_t k, int nr, const void * const * rows, const void * vy,
                               float * out) {
#if defined(KX_DOT_Q4_0_ROWS)
    if (type == GGML_TYPE_Q4_0) {
        KX_DOT_ROWS_NR(kx_dot_q4_0_n, k, nr, rows, vy, out)
        return true;
    }
#endif
#if defined(KX_DOT_F16_ROWS)
    if (type == GGML_TYPE_F16) {
        KX_DOT_ROWS_NR(kx_dot_f16_n, k, nr, rows, vy, out)
        return true;
    }
#endif
    (void) type; (void) k; (void) nr; (void) rows; (void) vy; (void) out;
    return false;
}
