// GGML_OP_KX_SELECT on the CPU: scores -> ascending list of active neuron ids.
//
// Single-threaded on purpose (n_tasks = 1): one pass over n_ff floats per token costs
// a few microseconds, far below the row gathers it steers, and a threaded version would
// need a prefix sum across threads to keep the list sorted.
#include "kx-ops-cpu.h"
#include "kx-ops.h"

#include "ggml-impl.h"

#include <math.h>
#include <stdatomic.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static atomic_int_fast64_t kx_stat_selected;
static atomic_int_fast64_t kx_stat_total;
static atomic_int_fast64_t kx_stat_calls;
static atomic_int_fast64_t kx_stat_fallbacks;

void kx_cpu_select_stats(int64_t * selected, int64_t * total, int64_t * calls, int64_t * fallbacks, bool reset) {
    if (selected)  { *selected  = atomic_load(&kx_stat_selected);  }
    if (total)     { *total     = atomic_load(&kx_stat_total);     }
    if (calls)     { *calls     = atomic_load(&kx_stat_calls);     }
    if (fallbacks) { *fallbacks = atomic_load(&kx_stat_fallbacks); }
    if (reset) {
        atomic_store(&kx_stat_selected, 0);
        atomic_store(&kx_stat_total, 0);
        atomic_store(&kx_stat_calls, 0);
        atomic_store(&kx_stat_fallbacks, 0);
    }
}

static inline bool kx_is_active(float v, float thr, int32_t act) {
    if (act == KX_SELECT_SCORE) {
        return v > thr;
    }
    return fabsf(kx_act_value(v, act)) > thr;
}

// one token, "v > thr" rule: vector compare + movemask, then walk the set bits. With a row map
// (ggml_kx_select_split) the threshold of neuron i is thr_in where rowmap[i] >= 0, thr_out
// elsewhere; without one it is thr_in.
static int64_t kx_select_gt(const float * s, const int32_t * rowmap, int64_t n, float thr_in, float thr_out,
                            int32_t * ids, bool use_ref) {
    int64_t count = 0;
    int64_t i = 0;
#if defined(__AVX2__)
    if (!use_ref) {
        const __m256  vin  = _mm256_set1_ps(thr_in);
        const __m256  vout = _mm256_set1_ps(thr_out);
        const __m256i neg  = _mm256_set1_epi32(-1);
        for (; i + 8 <= n; i += 8) {
            __m256 vt = vin;
            if (rowmap) {
                const __m256i r = _mm256_loadu_si256((const __m256i *) (rowmap + i));
                vt = _mm256_blendv_ps(vout, vin, _mm256_castsi256_ps(_mm256_cmpgt_epi32(r, neg)));
            }
            uint32_t m = (uint32_t) _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), vt, _CMP_GT_OQ));
            while (m) {
                ids[count++] = (int32_t) (i + __builtin_ctz(m));
                m &= m - 1;
            }
        }
    }
#endif
    for (; i < n; ++i) {
        if (s[i] > (rowmap && rowmap[i] < 0 ? thr_out : thr_in)) {
            ids[count++] = (int32_t) i;
        }
    }
    return count;
}

void ggml_compute_forward_kx_select(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    if (params->ith != 0) {
        return;
    }
    const struct ggml_tensor * src = dst->src[0];
    const int64_t n  = src->ne[0];
    const int64_t nt = src->ne[1];
    const float   thr         = ggml_get_op_params_f32(dst, 0);
    const float   max_density = ggml_get_op_params_f32(dst, 1);
    const int32_t act         = ggml_get_op_params_i32(dst, 2);

    int32_t * out = (int32_t *) dst->data;
    int32_t * ids = out + 1;
    int64_t count = 0;

    // ggml_kx_select_split: per-side offsets of the threshold
    const int32_t * rowmap = dst->src[1] ? (const int32_t *) dst->src[1]->data : NULL;
    const float   * off    = dst->src[2] ? (const float *) dst->src[2]->data : NULL;
    const float thr_in  = off ? thr + off[0] : thr;
    const float thr_out = off ? thr + off[1] : thr;

    const bool gt_rule = act == KX_SELECT_SCORE || (act == KX_SELECT_RELU && thr >= 0.0f);
    if (nt == 1 && gt_rule) {
        count = kx_select_gt((const float *) src->data, rowmap, n, thr_in, thr_out, ids, params->use_ref);
    } else {
        for (int64_t i = 0; i < n; ++i) {
            const float ti = rowmap && rowmap[i] < 0 ? thr_out : thr_in;
            for (int64_t t = 0; t < nt; ++t) {
                const float v = *(const float *) ((const char *) src->data + i*src->nb[0] + t*src->nb[1]);
                if (kx_is_active(v, ti, act)) {
                    ids[count++] = (int32_t) i;
                    break;
                }
            }
        }
    }

    bool fallback = false;
    if ((double) count > (double) max_density * (double) n) {
        for (int64_t i = 0; i < n; ++i) {
            ids[i] = (int32_t) i;
        }
        count = n;
        fallback = true;
    }
    out[0] = (int32_t) count;
    int32_t * host = kx_select_host(dst);
    if (host) { // the list, then the flag (kx-ops.h)
        memcpy(host + 1, out, sizeof(int32_t) * (size_t) (count + 1));
        atomic_store_explicit((_Atomic int32_t *) host, 1, memory_order_release);
    }

    atomic_fetch_add(&kx_stat_selected, count);
    atomic_fetch_add(&kx_stat_total, n);
    atomic_fetch_add(&kx_stat_calls, 1);
    atomic_fetch_add(&kx_stat_fallbacks, fallback ? 1 : 0);
}
