// y += v * row over output columns [c0, c1) of one transposed-down row (F32, F16, Q8_0, Q4_K
// or Q6_K):
// the inner loop of GGML_OP_KX_AXPY_ROWS and GGML_OP_KX_FFN_ROWS. ref: scalar loops only
// (the reference path of test-backend-ops).
#pragma once

#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml-impl.h"
#include "simd-mappings.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline void kx_axpy_f32(int64_t n, float * GGML_RESTRICT y, const float * GGML_RESTRICT x, float v, bool ref) {
    int64_t i = 0;
    if (!ref) {
#if defined(__AVX512F__)
        const __m512 vv = _mm512_set1_ps(v);
        for (; i + 16 <= n; i += 16) {
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), vv, _mm512_loadu_ps(y + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 vv = _mm256_set1_ps(v);
        for (; i + 8 <= n; i += 8) {
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), vv, _mm256_loadu_ps(y + i)));
        }
#endif
    }
    for (; i < n; ++i) {
        y[i] += x[i]*v;
    }
}

static inline void kx_axpy_f16(int64_t n, float * GGML_RESTRICT y, const ggml_fp16_t * GGML_RESTRICT x, float v, bool ref) {
    int64_t i = 0;
    if (!ref) {
#if defined(__AVX512F__)
        const __m512 vv = _mm512_set1_ps(v);
        for (; i + 16 <= n; i += 16) {
            const __m512 xf = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (x + i)));
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(xf, vv, _mm512_loadu_ps(y + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        const __m256 vv = _mm256_set1_ps(v);
        for (; i + 8 <= n; i += 8) {
            const __m256 xf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i)));
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(xf, vv, _mm256_loadu_ps(y + i)));
        }
#endif
    }
    for (; i < n; ++i) {
        y[i] += GGML_CPU_FP16_TO_FP32(x[i])*v;
    }
}

// nb whole Q8_0 blocks: y[32b + j] += v * d_b * q_bj
static inline void kx_axpy_q8_0(int64_t nb, float * GGML_RESTRICT y, const block_q8_0 * GGML_RESTRICT x, float v, bool ref) {
    for (int64_t b = 0; b < nb; ++b) {
        const float s = v*GGML_CPU_FP16_TO_FP32(x[b].d);
        float * yb = y + b*QK8_0;
        const int8_t * q = x[b].qs;
        if (!ref) {
#if defined(__AVX512F__)
            const __m512 vs = _mm512_set1_ps(s);
            for (int j = 0; j < QK8_0; j += 16) {
                const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (q + j))));
                _mm512_storeu_ps(yb + j, _mm512_fmadd_ps(qf, vs, _mm512_loadu_ps(yb + j)));
            }
            continue;
#elif defined(__AVX2__) && defined(__FMA__)
            const __m256 vs = _mm256_set1_ps(s);
            for (int j = 0; j < QK8_0; j += 8) {
                const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (q + j))));
                _mm256_storeu_ps(yb + j, _mm256_fmadd_ps(qf, vs, _mm256_loadu_ps(yb + j)));
            }
            continue;
#endif
        }
        for (int j = 0; j < QK8_0; ++j) {
            yb[j] += s*(float) q[j];
        }
    }
}

// ggml's get_scale_min_k4 for the two 32-value sub-blocks of 64-value group g, scaled: the
// weights of sub-block 2g + h are dl[h] * q - ml[h]
static inline void kx_q4_K_group_scales(const block_q4_K * GGML_RESTRICT b, int g, float d, float min, float * dl,
                                        float * ml) {
    const uint8_t * sc = b->scales;
    for (int h = 0; h < 2; ++h) {
        const int k = 2*g + h;
        const uint8_t s6 = k < 4 ? (sc[k] & 63) : ((sc[k + 4] & 0xF) | ((sc[k - 4] >> 6) << 4));
        const uint8_t m6 = k < 4 ? (sc[k + 4] & 63) : ((sc[k + 4] >> 4) | ((sc[k] >> 6) << 4));
        dl[h] = d*s6;
        ml[h] = min*m6;
    }
}

// One K-quant super-block's 256 weights as floats, each computed as ggml's dequantize_row_*
// computes it (the same products in the same order, so the same bits): y += v * w then runs
// through kx_axpy_f32. Why dequantize first: a row of the pack's down weights is read once
// per token, so the unpacking is paid per byte either way, and a block of 256 floats (1 KiB)
// stays in L1 between the two loops.
static inline void kx_dequant_q4_K(const block_q4_K * GGML_RESTRICT b, float * GGML_RESTRICT w) {
    const float d   = GGML_CPU_FP16_TO_FP32(b->d);
    const float min = GGML_CPU_FP16_TO_FP32(b->dmin);
    const uint8_t * q = b->qs;
    for (int j = 0; j < QK_K; j += 64, q += 32) {
        float dl[2], ml[2];
        kx_q4_K_group_scales(b, j/64, d, min, dl, ml);
#if defined(__AVX2__)
        // 8 lanes at a time: dl*q is exact in float (11 + 6 + 4 bits), so the one rounding
        // of the subtraction gives the scalar loop's bits, fused or not
        for (int l = 0; l < 32; l += 8) {
            const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (q + l)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(qi, _mm256_set1_epi32(0xF)));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(qi, 4));
            _mm256_storeu_ps(w + j + l,      _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(dl[0]), lo), _mm256_set1_ps(ml[0])));
            _mm256_storeu_ps(w + j + 32 + l, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(dl[1]), hi), _mm256_set1_ps(ml[1])));
        }
#else
        for (int l = 0; l < 32; ++l) {
            w[j + l]      = dl[0]*(q[l] & 0xF) - ml[0];
            w[j + 32 + l] = dl[1]*(q[l] >> 4)  - ml[1];
        }
#endif
    }
}

static inline void kx_dequant_q6_K(const block_q6_K * GGML_RESTRICT b, float * GGML_RESTRICT w) {
    const float d = GGML_CPU_FP16_TO_FP32(b->d);
    const uint8_t * ql = b->ql;
    const uint8_t * qh = b->qh;
    const int8_t  * sc = b->scales;
    for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8) {
#if defined(__AVX2__)
        // 8 lanes at a time; the scale d*sc is exact in float (11 + 8 bits), so its product
        // with q rounds once, as in the scalar loop
        for (int l = 0; l < 32; l += 8) {
            const __m256i m4 = _mm256_set1_epi32(0xF);
            const __m256i m2 = _mm256_set1_epi32(3);
            const __m256i c32 = _mm256_set1_epi32(32);
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (ql + l)));
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (ql + l + 32)));
            const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qh + l)));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi32(_mm256_and_si256(h, m2), 4)),
                _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), m2), 4)),
                _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), m2), 4)),
                _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4)),
            };
            const int is = l/16;
            for (int k = 0; k < 4; ++k) {
                const __m256 qf = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[k], c32));
                _mm256_storeu_ps(w + n + l + 32*k, _mm256_mul_ps(_mm256_set1_ps(d*sc[is + 2*k]), qf));
            }
        }
        continue;
#endif
        for (int l = 0; l < 32; ++l) {
            const int is = l/16;
            const int8_t q1 = (int8_t) ((ql[l +  0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int8_t q2 = (int8_t) ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int8_t q3 = (int8_t) ((ql[l +  0] >> 4)  | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int8_t q4 = (int8_t) ((ql[l + 32] >> 4)  | (((qh[l] >> 6) & 3) << 4)) - 32;
            w[n + l +  0] = d*sc[is + 0]*q1;
            w[n + l + 32] = d*sc[is + 2]*q2;
            w[n + l + 64] = d*sc[is + 4]*q3;
            w[n + l + 96] = d*sc[is + 6]*q4;
        }
    }
}

// nb whole K-quant super-blocks (Q4_K or Q6_K): y[256b + j] += v * w_bj
static inline void kx_axpy_k(enum ggml_type type, int64_t nb, float * GGML_RESTRICT y, const void * GGML_RESTRICT x,
                             float v, bool ref) {
    float w[QK_K];
    for (int64_t b = 0; b < nb; ++b) {
        if (type == GGML_TYPE_Q4_K) {
            kx_dequant_q4_K((const block_q4_K *) x + b, w);
        } else {
            kx_dequant_q6_K((const block_q6_K *) x + b, w);
        }
        kx_axpy_f32(QK_K, y + b*QK_K, w, v, ref);
    }
}

// The rows-at-once kernels below on one float vector of KX_V lanes: 16 with AVX-512, 8 with
// AVX2, FMA and F16C (the row-by-row paths above use the same FMAs at each width, so the
// results are theirs bit for bit on either). Without them the callers go row by row.
#if defined(__AVX512F__)
#define KX_V 16
typedef __m512 kx_vf;
#define kx_vload(p)      _mm512_loadu_ps(p)
#define kx_vstore(p, a)  _mm512_storeu_ps(p, a)
#define kx_vset1(x)      _mm512_set1_ps(x)
#define kx_vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
// KX_V int8 values at p, as floats
#define kx_vi8(p)        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (p))))
// KX_V bytes at p, their low (h 0) or high (h 1) nibbles, as int32 lanes
#define kx_vu8(p)        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (p)))
#define kx_vnib(q, h)    _mm512_cvtepi32_ps((h) ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(0xF)))
#define kx_vmsub(a, b, c) _mm512_sub_ps(_mm512_mul_ps(a, b), c)
// KX_V F16 values at p, as floats
#define kx_vf16(p)       _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (p)))
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KX_V 8
typedef __m256 kx_vf;
#define kx_vload(p)      _mm256_loadu_ps(p)
#define kx_vstore(p, a)  _mm256_storeu_ps(p, a)
#define kx_vset1(x)      _mm256_set1_ps(x)
#define kx_vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define kx_vi8(p)        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (p))))
#define kx_vu8(p)        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (p)))
#define kx_vnib(q, h)    _mm256_cvtepi32_ps((h) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(0xF)))
#define kx_vmsub(a, b, c) _mm256_sub_ps(_mm256_mul_ps(a, b), c)
#define kx_vf16(p)       _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p)))
#endif

// nr (<= 4) whole Q8_0 rows at once, y += v[r] * row r in row order per element (the same
// FMAs as nr calls of kx_axpy_q8_0, bit for bit), y loaded and stored once per KX_V columns
// instead of once per row, and the rows read as nr interleaved streams (the gate and up
// rows' reason, kx-dot.h). False without KX_V (the caller goes row by row).
static inline bool kx_axpy_q8_0_rows(int64_t nb, int nr, float * GGML_RESTRICT y, const void * const * rows,
                                     const float * v) {
#if defined(KX_V)
    const block_q8_0 * x[4];
    for (int r = 0; r < nr; ++r) {
        x[r] = (const block_q8_0 *) rows[r];
    }
    for (int64_t b = 0; b < nb; ++b) {
        kx_vf s[4];
        for (int r = 0; r < nr; ++r) {
            s[r] = kx_vset1(v[r]*GGML_CPU_FP16_TO_FP32(x[r][b].d));
        }
        float * yb = y + b*QK8_0;
        for (int j = 0; j < QK8_0; j += KX_V) {
            kx_vf acc = kx_vload(yb + j);
            for (int r = 0; r < nr; ++r) {
                acc = kx_vfma(kx_vi8(x[r][b].qs + j), s[r], acc);
            }
            kx_vstore(yb + j, acc);
        }
    }
    return true;
#else
    (void) nb; (void) nr; (void) y; (void) rows; (void) v;
    return false;
#endif
}

// nr (<= 4) F16 rows of m columns at once, y += v[r] * row r in row order per element (the
// same FMAs as nr calls of kx_axpy_f16, bit for bit), as kx_axpy_q8_0_rows
static inline bool kx_axpy_f16_rows(int64_t m, int nr, float * GGML_RESTRICT y, const void * const * rows,
                                    const float * v) {
#if defined(KX_V)
    const ggml_fp16_t * x[4];
    kx_vf vv[4];
    for (int r = 0; r < nr; ++r) {
        x[r] = (const ggml_fp16_t *) rows[r];
        vv[r] = kx_vset1(v[r]);
    }
    int64_t i = 0;
    for (; i + KX_V <= m; i += KX_V) {
        kx_vf acc = kx_vload(y + i);
        for (int r = 0; r < nr; ++r) {
            acc = kx_vfma(kx_vf16(x[r] + i), vv[r], acc);
        }
        kx_vstore(y + i, acc);
    }
    for (; i < m; ++i) {
        for (int r = 0; r < nr; ++r) {
            y[i] += GGML_CPU_FP16_TO_FP32(x[r][i])*v[r];
        }
    }
    return true;
#else
    (void) m; (void) nr; (void) y; (void) rows; (void) v;
    return false;
#endif
}

#if defined(KX_V)
// nr (<= 4, a constant at each call) whole Q4_K rows of nb super-blocks: per KX_V columns
// each row's weights unpacked in registers as kx_dequant_q4_K computes them (dl*q - ml, the
// same bits), then y += v[r] * w_r in row order (the same FMAs as row by row)
static inline __attribute__((always_inline)) void kx_axpy_q4_K_n(int64_t nb, const int nr, float * GGML_RESTRICT y,
                                                                const void * const * rows, const float * v) {
    kx_vf vv[4];
    for (int r = 0; r < nr; ++r) {
        vv[r] = kx_vset1(v[r]);
    }
    for (int64_t b = 0; b < nb; ++b) {
        const block_q4_K * x[4];
        float d[4], mn[4];
        for (int r = 0; r < nr; ++r) {
            x[r]  = (const block_q4_K *) rows[r] + b;
            d[r]  = GGML_CPU_FP16_TO_FP32(x[r]->d);
            mn[r] = GGML_CPU_FP16_TO_FP32(x[r]->dmin);
        }
        for (int g = 0; g < QK_K/64; ++g) {
            kx_vf dl[4][2], ml[4][2];
            for (int r = 0; r < nr; ++r) {
                float a[2], c[2];
                kx_q4_K_group_scales(x[r], g, d[r], mn[r], a, c);
                for (int h = 0; h < 2; ++h) {
                    dl[r][h] = kx_vset1(a[h]);
                    ml[r][h] = kx_vset1(c[h]);
                }
            }
            float * yg = y + b*QK_K + 64*g;
            for (int c = 0; c < 64; c += KX_V) {
                const int h = c >= 32; // the high nibbles of the same 32 bytes
                kx_vf acc = kx_vload(yg + c);
                for (int r = 0; r < nr; ++r) {
                    const kx_vf w = kx_vmsub(dl[r][h], kx_vnib(kx_vu8(x[r]->qs + 32*g + (c & 31)), h), ml[r][h]);
                    acc = kx_vfma(w, vv[r], acc);
                }
                kx_vstore(yg + c, acc);
            }
        }
    }
}
#endif

// nr (<= 4) whole Q4_K or Q6_K rows of nb super-blocks at once, y += v[r] * row r in row
// order per element (the same FMAs as nr calls of kx_axpy_k, bit for bit), y loaded and
// stored once per KX_V columns instead of once per row: Q4_K unpacked in registers
// (kx_axpy_q4_K_n), Q6_K per super-block into a buffer (kx_dequant_q6_K). Why: row by row, a
// down row cost about twice a gate row's dot (perf on bench/host_op.c TYPES q4k), much of it
// y's and the buffer's loads and stores. False without KX_V (the caller goes row by row).
static inline bool kx_axpy_k_rows(enum ggml_type type, int64_t nb, int nr, float * GGML_RESTRICT y,
                                  const void * const * rows, const float * v) {
#if defined(KX_V)
    if (type == GGML_TYPE_Q4_K) {
        switch (nr) {
            case 4:  kx_axpy_q4_K_n(nb, 4, y, rows, v); break;
            case 3:  kx_axpy_q4_K_n(nb, 3, y, rows, v); break;
            case 2:  kx_axpy_q4_K_n(nb, 2, y, rows, v); break;
            default: kx_axpy_q4_K_n(nb, 1, y, rows, v); break;
        }
        return true;
    }
    float w[4][QK_K];
    kx_vf vv[4];
    for (int r = 0; r < nr; ++r) {
        vv[r] = kx_vset1(v[r]);
    }
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < nr; ++r) {
            kx_dequant_q6_K((const block_q6_K *) rows[r] + b, w[r]);
        }
        float * yb = y + b*QK_K;
        for (int j = 0; j < QK_K; j += KX_V) {
            kx_vf acc = kx_vload(yb + j);
            for (int r = 0; r < nr; ++r) {
                acc = kx_vfma(kx_vload(w[r] + j), vv[r], acc);
            }
            kx_vstore(yb + j, acc);
        }
    }
    return true;
#else
    (void) type; (void) nb; (void) nr; (void) y; (void) rows; (void) v;
    return false;
#endif
}

// y += v[r] * row r for nr (<= 4) whole rows of m columns of a type with a rows-at-once
// path above; false where there is none (the caller goes row by row)
static inline bool kx_axpy_rows(enum ggml_type type, int64_t m, int nr, float * GGML_RESTRICT y,
                                const void * const * rows, const float * v) {
    switch (type) {
        case GGML_TYPE_Q8_0: return kx_axpy_q8_0_rows(m/QK8_0, nr, y, rows, v);
        case GGML_TYPE_F16:  return kx_axpy_f16_rows(m, nr, y, rows, v);
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q6_K: return kx_axpy_k_rows(type, m/QK_K, nr, y, rows, v);
        default:             return false;
    }
}

// c0 and c1 are multiples of the type's block: 32 for Q8_0, 256 for Q4_K and Q6_K (whole
// blocks; the constructors check m)
static inline void kx_axpy_row(enum ggml_type type, int64_t c0, int64_t c1, float * GGML_RESTRICT y,
                               const void * GGML_RESTRICT row, float v, bool ref) {
    switch (type) {
        case GGML_TYPE_F32:
            kx_axpy_f32(c1 - c0, y + c0, (const float *) row + c0, v, ref);
            break;
        case GGML_TYPE_F16:
            kx_axpy_f16(c1 - c0, y + c0, (const ggml_fp16_t *) row + c0, v, ref);
            break;
        case GGML_TYPE_Q8_0:
            kx_axpy_q8_0((c1 - c0)/QK8_0, y + c0, (const block_q8_0 *) row + c0/QK8_0, v, ref);
            break;
        case GGML_TYPE_Q4_K:
            kx_axpy_k(type, (c1 - c0)/QK_K, y + c0, (const block_q4_K *) row + c0/QK_K, v, ref);
            break;
        case GGML_TYPE_Q6_K:
            kx_axpy_k(type, (c1 - c0)/QK_K, y + c0, (const block_q6_K *) row + c0/QK_K, v, ref);
            break;
        default:
            GGML_ABORT("kx axpy: unsupported type %s", ggml_type_name(type));
    }
}
