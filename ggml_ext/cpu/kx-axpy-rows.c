// GGML_OP_KX_AXPY_ROWS on the CPU: y[:, t] = sum_{i in sel} h[i, t] * wt[row(i), :].
//
// wt is the FFN down projection transposed when the pack was made, so each active
// neuron's contribution is one contiguous row. Threads split the OUTPUT columns (in
// blocks of 32 = one Q8_0 block) rather than the rows: every thread walks all active
// rows but touches only its slice, so there is no reduction, no barrier and no scratch.
// Zero activations are skipped per token (a batch's union lists neurons that are off
// for some tokens).
#include "kx-ops-cpu.h"
#include "kx-ops.h"

#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml-impl.h"
#include "simd-mappings.h"

#include <stdatomic.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KX_COL_BLOCK 32

static atomic_int_fast64_t kx_stat_nonzero;
static atomic_int_fast64_t kx_stat_rows;
static atomic_int_fast64_t kx_stat_elsewhere;

void kx_cpu_axpy_stats(int64_t * nonzero, int64_t * rows, int64_t * elsewhere, bool reset) {
    if (nonzero) {
        *nonzero = atomic_load(&kx_stat_nonzero);
    }
    if (rows) {
        *rows = atomic_load(&kx_stat_rows);
    }
    if (elsewhere) {
        *elsewhere = atomic_load(&kx_stat_elsewhere);
    }
    if (reset) {
        atomic_store(&kx_stat_nonzero, 0);
        atomic_store(&kx_stat_rows, 0);
        atomic_store(&kx_stat_elsewhere, 0);
    }
}

static void kx_axpy_f32(int64_t n, float * GGML_RESTRICT y, const float * GGML_RESTRICT x, float v, bool ref) {
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

static void kx_axpy_f16(int64_t n, float * GGML_RESTRICT y, const ggml_fp16_t * GGML_RESTRICT x, float v, bool ref) {
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
static void kx_axpy_q8_0(int64_t nb, float * GGML_RESTRICT y, const block_q8_0 * GGML_RESTRICT x, float v, bool ref) {
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

void ggml_compute_forward_kx_axpy_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * wt     = dst->src[0];
    const struct ggml_tensor * h      = dst->src[1];
    const struct ggml_tensor * sel    = dst->src[2];
    const struct ggml_tensor * rowmap = dst->src[3];

    const int ith = params->ith;
    const int nth = params->nth;
    const bool ref = params->use_ref;

    const int64_t m  = wt->ne[0];
    const int64_t nt = h->ne[1];

    const int64_t nblk = (m + KX_COL_BLOCK - 1)/KX_COL_BLOCK;
    const int64_t c0 = (nblk*ith/nth)*KX_COL_BLOCK;
    const int64_t c1 = MIN(m, (nblk*(ith + 1)/nth)*KX_COL_BLOCK);
    if (c0 >= c1) {
        return;
    }
    for (int64_t t = 0; t < nt; ++t) {
        memset((char *) dst->data + t*dst->nb[1] + c0*sizeof(float), 0, (size_t) (c1 - c0)*sizeof(float));
    }

    const int32_t * list  = (const int32_t *) sel->data;
    const int64_t   count = list[0];
    const int32_t * ids   = list + 1;
    const int32_t * map   = rowmap ? (const int32_t *) rowmap->data : NULL;

    int64_t nonzero = 0;   // counted by the thread owning column 0 only: all walk the same rows
    int64_t elsewhere = 0;
    for (int64_t j = 0; j < count; ++j) {
        const int64_t i = ids[j];
        const int64_t r = map ? map[i] : i;
        if (r < 0) {
            ++elsewhere; // not in this weight (the other side of a hybrid layer has it)
            continue;
        }
        const char * row = (const char *) wt->data + r*wt->nb[1];
        if (j + 1 < count) {
            const int64_t rn = map ? map[ids[j + 1]] : ids[j + 1];
            if (rn >= 0) {
                __builtin_prefetch((const char *) wt->data + rn*wt->nb[1] + ggml_row_size(wt->type, c0));
            }
        }
        for (int64_t t = 0; t < nt; ++t) {
            const float v = *(const float *) ((const char *) h->data + i*sizeof(float) + t*h->nb[1]);
            if (v == 0.0f) {
                continue;
            }
            ++nonzero;
            float * y = (float *) ((char *) dst->data + t*dst->nb[1]);
            switch (wt->type) {
                case GGML_TYPE_F32:
                    kx_axpy_f32(c1 - c0, y + c0, (const float *) row + c0, v, ref);
                    break;
                case GGML_TYPE_F16:
                    kx_axpy_f16(c1 - c0, y + c0, (const ggml_fp16_t *) row + c0, v, ref);
                    break;
                case GGML_TYPE_Q8_0:
                    // the constructor's callers guarantee m % 32 == 0 for Q8_0 (whole blocks)
                    kx_axpy_q8_0((c1 - c0)/QK8_0, y + c0, (const block_q8_0 *) row + c0/QK8_0, v, ref);
                    break;
                default:
                    GGML_ABORT("kx_axpy_rows: unsupported type %s", ggml_type_name(wt->type));
            }
        }
    }
    if (c0 == 0) {
        atomic_fetch_add(&kx_stat_nonzero, nonzero);
        atomic_fetch_add(&kx_stat_rows, count - elsewhere);
        atomic_fetch_add(&kx_stat_elsewhere, elsewhere);
    }
}
