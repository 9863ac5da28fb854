// Dots of up to four rows with one vector, the rows read interleaved (Q4_0 rows with a Q8_0
// vector, Q4_K, Q5_K and Q6_K rows with a Q8_K vector, F16 rows with an F16 vector): the
// inner loop of GGML_OP_KX_FFN_ROWS's gate and up rows for one token.
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
#include <string.h>

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

#if defined(KX_DOT_Q4_0_ROWS)
#define KX_DOT_K_ROWS 1

#if defined(__AVX512BW__)
#define KX_DOT_Q4_K_512 1
// a shuffle control picking 16-bit word a/2 in the low 256 bits and b/2 in the high ones
// (bytes a, a + 1 and b, b + 1 of each 128-bit lane)
static inline __m512i kx_dot_q4_K_pick(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short) ((a + 1) << 8 | a))),
                              _mm256_set1_epi16((short) ((b + 1) << 8 | b)), 1);
}

// 32 bytes at lo, then 32 at hi
static inline __m512i kx_dot_join(const int8_t * lo, const int8_t * hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) lo)),
                              _mm256_loadu_si256((const __m256i *) hi), 1);
}

// acc + the int16 pairs of a times b summed into int32 lanes (exact: no saturation)
static inline __m512i kx_dot_s16_acc(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif

// a Q4_K or Q5_K super-block's 12 bytes of 6-bit scales and mins as 16 int16 lanes, the 8
// scales then the 8 mins, unpacked as ggml's kmask steps do
static inline __m256i kx_dot_k_scales(const uint8_t * scales) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t utmp[4];
    memcpy(utmp, scales, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
    return _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
}

// ggml_vec_dot_q4_K_q8_K's AVX2 branch for nr rows at once: per super-block the same 8 int32
// lanes (scales applied by madd, integer sums exact), the same d and dmin products, the same
// FMAs into acc (8 lanes) and acc_m (4 lanes) and the same final sums. The row's 12 bytes of
// 6-bit scales and mins unpack as ggml's kmask steps do; a scale pair shuffle (bytes 2i, 2i+1
// repeated) is built from i instead of ggml's table. With AVX-512BW the integer lanes are
// summed two of ggml's steps at a time (the same integers, so the same bits), the vector's
// bytes arranged once per super-block for all rows: the dot is the host op's largest
// compute (perf, bench/host_op.c TYPES q4k: the gate rows alone over a third of its time).
static inline __attribute__((always_inline)) void kx_dot_q4_K_n(int64_t k, const int nr, const void * const * rows,
                                                               const void * vy, float * out) {
    const block_q4_K * w[4];
    for (int r = 0; r < nr; ++r) {
        w[r] = (const block_q4_K *) rows[r];
    }
    const block_q8_K * y = (const block_q8_K *) vy;
    __m256 acc[4]   = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    __m128 acc_m[4] = { _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps() };
    const int64_t nb = k / QK_K;
#if defined(KX_DOT_Q4_K_512)
    const __m512i m4_512 = _mm512_set1_epi8(0xF);
#else
    const __m256i m4 = _mm256_set1_epi8(0xF);
#endif
    for (int64_t i = 0; i < nb; ++i) {
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[i].bsums);
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
#if defined(KX_DOT_Q4_K_512)
        // the vector's halves for step jj, once for all rows: q8[64j, 64j + 32) with the low
        // nibbles and q8[64j + 32, 64j + 64) with the high ones, j = 2jj and 2jj + 1
        __m512i q8l[QK_K/128], q8h[QK_K/128];
        for (int jj = 0; jj < QK_K/128; ++jj) {
            const int8_t * q8 = y[i].qs + 128*jj;
            q8l[jj] = kx_dot_join(q8, q8 + 64);
            q8h[jj] = kx_dot_join(q8 + 32, q8 + 96);
        }
#endif
        for (int r = 0; r < nr; ++r) {
            const block_q4_K * x = w[r] + i;
            const float d    = y[i].d * GGML_CPU_FP16_TO_FP32(x->d);
            const float dmin = -y[i].d * GGML_CPU_FP16_TO_FP32(x->dmin);
            const __m256i mins_and_scales = kx_dot_k_scales(x->scales);
            const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s);
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
            const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
#if defined(KX_DOT_Q4_K_512)
            // two of ggml's steps j per 512-bit step: j = 2jj in the low half, 2jj + 1 in the
            // high one, each half the same 8 lanes; the halves added at the end (exact)
            const __m512i sc512 = _mm512_broadcast_i32x4(sc128);
            __m512i s512 = _mm512_setzero_si512();
            for (int jj = 0; jj < QK_K/128; ++jj) {
                const __m512i scale_l = _mm512_shuffle_epi8(sc512, kx_dot_q4_K_pick(8*jj, 8*jj + 4));
                const __m512i scale_h = _mm512_shuffle_epi8(sc512, kx_dot_q4_K_pick(8*jj + 2, 8*jj + 6));
                const __m512i q4bits = _mm512_loadu_si512((const void *) (x->qs + 64*jj));
                const __m512i q4l = _mm512_and_si512(q4bits, m4_512);
                const __m512i q4h = _mm512_and_si512(_mm512_srli_epi16(q4bits, 4), m4_512);
                s512 = kx_dot_s16_acc(s512, scale_l, _mm512_maddubs_epi16(q4l, q8l[jj]));
                s512 = kx_dot_s16_acc(s512, scale_h, _mm512_maddubs_epi16(q4h, q8h[jj]));
            }
            const __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(s512), _mm512_extracti64x4_epi64(s512, 1));
#else
            const __m256i scales = _mm256_set_m128i(sc128, sc128);
            const uint8_t * q4 = x->qs;
            const int8_t  * q8 = y[i].qs;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < QK_K/64; ++j) {
                const __m256i scale_l = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short) ((4*j + 1) << 8 | 4*j)));
                const __m256i scale_h = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short) ((4*j + 3) << 8 | (4*j + 2))));
                const __m256i q4bits = _mm256_loadu_si256((const __m256i *) q4); q4 += 32;
                const __m256i q4l = _mm256_and_si256(q4bits, m4);
                const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
                const __m256i q8l = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                const __m256i p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
                const __m256i q8h = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                const __m256i p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
            }
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < nr; ++r) {
        __m128 am = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
        am = _mm_add_ss(am, _mm_movehdup_ps(am));
        out[r] = kx_dot_hsum(acc[r]) + _mm_cvtss_f32(am);
    }
}

// ggml_vec_dot_q5_K_q8_K's AVX2 branch for nr rows at once: Q4_K's lanes with each weight's
// fifth bit (qh: bit 2j of byte l for sub-block 2j, bit 2j + 1 for 2j + 1) added at 16, and
// the mins summed as ggml does for this type: per super-block into one float per row
// (dmin times the int32 sum), added to the lanes' sum at the end
static inline __attribute__((always_inline)) void kx_dot_q5_K_n(int64_t k, const int nr, const void * const * rows,
                                                               const void * vy, float * out) {
    const block_q5_K * w[4];
    for (int r = 0; r < nr; ++r) {
        w[r] = (const block_q5_K *) rows[r];
    }
    const block_q8_K * y = (const block_q8_K *) vy;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[4]  = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    float  summs[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; ++i) {
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[i].bsums);
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
        for (int r = 0; r < nr; ++r) {
            const block_q5_K * x = w[r] + i;
            const float d    = y[i].d * GGML_CPU_FP16_TO_FP32(x->d);
            const float dmin = -y[i].d * GGML_CPU_FP16_TO_FP32(x->dmin);
            const __m256i mins_and_scales = kx_dot_k_scales(x->scales);
            const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s);
            const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, _mm_setzero_si128()), _mm_setzero_si128());
            summs[r] += dmin * _mm_extract_epi32(hsum, 0);
            const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
            const __m256i scales = _mm256_set_m128i(sc128, sc128);
            const __m256i hbits = _mm256_loadu_si256((const __m256i *) x->qh);
            const uint8_t * q5 = x->qs;
            const int8_t  * q8 = y[i].qs;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < QK_K/64; ++j) {
                const __m256i scale_0 = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short) ((4*j + 1) << 8 | 4*j)));
                const __m256i scale_1 = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short) ((4*j + 3) << 8 | (4*j + 2))));
                const __m256i q5bits = _mm256_loadu_si256((const __m256i *) q5); q5 += 32;
                // the fifth bits of sub-blocks 2j and 2j + 1, moved to bit 4 of each byte
                const __m256i h0 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, _mm256_set1_epi8((char) (1 << 2*j))), 2*j), 4);
                const __m256i h1 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, _mm256_set1_epi8((char) (2 << 2*j))), 2*j + 1), 4);
                const __m256i q5_0 = _mm256_add_epi8(_mm256_and_si256(q5bits, m4), h0);
                const __m256i q5_1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4), h1);
                const __m256i q8_0 = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                const __m256i q8_1 = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                const __m256i p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q5_0, q8_0));
                const __m256i p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q5_1, q8_1));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16_0, p16_1));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < nr; ++r) {
        out[r] = kx_dot_hsum(acc[r]) + summs[r];
    }
}

// ggml_vec_dot_q6_K_q8_K's AVX2 branch for nr rows at once (the same lanes, the same
// subtraction of 32 · Σ scale·bsum, the same FMA and final sum); the 16-bit scale shuffle
// for index i (bytes 2i eight times, then 2i + 1) is built from i
static inline __attribute__((always_inline)) void kx_dot_q6_K_n(int64_t k, const int nr, const void * const * rows,
                                                               const void * vy, float * out) {
    const block_q6_K * w[4];
    for (int r = 0; r < nr; ++r) {
        w[r] = (const block_q6_K *) rows[r];
    }
    const block_q8_K * y = (const block_q8_K *) vy;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; ++i) {
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[i].bsums);
        for (int r = 0; r < nr; ++r) {
            const block_q6_K * x = w[r] + i;
            const float d = y[i].d * GGML_CPU_FP16_TO_FP32(x->d);
            const uint8_t * q4 = x->ql;
            const uint8_t * qh = x->qh;
            const int8_t  * q8 = y[i].qs;
            const __m128i scales = _mm_loadu_si128((const __m128i *) x->scales);
            const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < QK_K/128; ++j) {
                const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *) q4); q4 += 32;
                const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *) q4); q4 += 32;
                const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *) qh); qh += 32;
                const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
                const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
                const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
                const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
                const __m256i q4_0 = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
                const __m256i q4_1 = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
                const __m256i q4_2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
                const __m256i q4_3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
                const __m256i q8_0 = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                const __m256i q8_1 = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                const __m256i q8_2 = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                const __m256i q8_3 = _mm256_loadu_si256((const __m256i *) q8); q8 += 32;
                __m256i p16[4] = { _mm256_maddubs_epi16(q4_0, q8_0), _mm256_maddubs_epi16(q4_1, q8_1),
                                   _mm256_maddubs_epi16(q4_2, q8_2), _mm256_maddubs_epi16(q4_3, q8_3) };
                for (int u = 0; u < 4; ++u) {
                    const int is = 4*j + u;
                    const __m128i sh = _mm_set_epi64x((long long) (0x0101010101010101ULL * (uint64_t) (2*is + 1)),
                                                      (long long) (0x0101010101010101ULL * (uint64_t) (2*is)));
                    p16[u] = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, sh)), p16[u]);
                }
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16[0], p16[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16[2], p16[3]));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(sumi), acc[r]);
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
#if defined(KX_DOT_K_ROWS)
    if (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K) {
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
// 32 == 0, y Q8_0; Q4_K, Q5_K, Q6_K: k % 256 == 0, y Q8_K; F16: y F16). False where
// kx_dot_rows_ok(type) is false (the caller uses ggml's vec_dot per row).
static inline bool kx_dot_rows(enum ggml_type type, int64_t k, int nr, const void * const * rows, const void * vy,
                               float * out) {
#if defined(KX_DOT_Q4_0_ROWS)
    if (type == GGML_TYPE_Q4_0) {
        KX_DOT_ROWS_NR(kx_dot_q4_0_n, k, nr, rows, vy, out)
        return true;
    }
#endif
#if defined(KX_DOT_K_ROWS)
    if (type == GGML_TYPE_Q4_K) {
        KX_DOT_ROWS_NR(kx_dot_q4_K_n, k, nr, rows, vy, out)
        return true;
    }
    if (type == GGML_TYPE_Q5_K) {
        KX_DOT_ROWS_NR(kx_dot_q5_K_n, k, nr, rows, vy, out)
        return true;
    }
    if (type == GGML_TYPE_Q6_K) {
        KX_DOT_ROWS_NR(kx_dot_q6_K_n, k, nr, rows, vy, out)
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
