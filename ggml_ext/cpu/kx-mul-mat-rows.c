// GGML_OP_KX_MUL_MAT_ROWS on the CPU: w·x for the rows listed in sel only (through the
// row map when one is given: neurons it sends to -1 are not in w and stay 0); without
// sel, for every row (a plain matvec, the form the predictor's second half uses).
//
// The fast path is ggml's own matvec inner loop: x is converted once to the weight
// type's vec_dot_type (Q8_0/Q8_K for quantized weights, F16, BF16 or F32), then
// type_traits_cpu[w->type].vec_dot runs per active row, so every weight type ggml can
// multiply is supported with its tuned AVX2/AVX-512 kernels. The reference path
// (params->use_ref) dequantizes each active row to float and dots it with x in double.
//
// Threads split the active list into contiguous runs of equal length (every row costs
// the same), after one barrier that publishes the converted x and the zeroed output.
#include "kx-ops-cpu.h"
#include "kx-ops.h"

#include "ggml-impl.h"
#include "ggml-cpu.h"

#include <string.h>

#define KX_CACHE_LINE 64

static size_t kx_align_up(size_t n) {
    return (n + KX_CACHE_LINE - 1) / KX_CACHE_LINE * KX_CACHE_LINE;
}

// wdata layout: [converted x: n_tokens rows of vec_dot_type] [per thread: k floats]
size_t kx_mul_mat_rows_work_size(const struct ggml_tensor * node, int n_tasks) {
    const struct ggml_tensor * w = node->src[0];
    const struct ggml_tensor * x = node->src[1];
    const enum ggml_type vdt = ggml_get_type_traits_cpu(w->type)->vec_dot_type;
    const int64_t k = w->ne[0];
    size_t size = 0;
    if (x->type != vdt) {
        size += kx_align_up(ggml_row_size(vdt, k) * (size_t) x->ne[1]);
    }
    size += (size_t) n_tasks * kx_align_up(sizeof(float) * (size_t) k);
    return size;
}

void kx_x_convert(enum ggml_type vdt, const char * x, size_t x_nb1, int64_t k, int64_t nt, char * xq, size_t xq_row,
                  int ith, int nth) {
    const ggml_from_float_t from_float = ggml_get_type_traits_cpu(vdt)->from_float;
    const int64_t bs = ggml_blck_size(vdt);
    GGML_ASSERT(k % bs == 0);
    const int64_t nb = k/bs;
    const int64_t b0 = nb*ith/nth;
    const int64_t b1 = nb*(ith + 1)/nth;
    if (b0 == b1) {
        return;
    }
    const size_t at = ggml_row_size(vdt, b0*bs); // bytes of the blocks before this thread's
    for (int64_t t = 0; t < nt; ++t) {
        from_float((const float *) (x + t*x_nb1) + b0*bs, xq + t*xq_row + at, (b1 - b0)*bs);
    }
}

float kx_row_dot_ref(const struct ggml_tensor * w, const char * row, const float * x, float * scratch) {
    const int64_t k = w->ne[0];
    const float * wf = (const float *) row;
    if (w->type != GGML_TYPE_F32) {
        ggml_get_type_traits(w->type)->to_float(row, scratch, k);
        wf = scratch;
    }
    double acc = 0.0;
    for (int64_t c = 0; c < k; ++c) {
        acc += (double) wf[c] * (double) x[c];
    }
    return (float) acc;
}

// the gated op's gate value of neuron i, token t
static inline float kx_gate_at(const struct ggml_tensor * gate, int64_t i, int64_t t) {
    return *(const float *) ((const char *) gate->data + i*sizeof(float) + t*gate->nb[1]);
}

// gated op: neuron i's gate is <= 0 for every token (relu gives 0: its row is not needed)
static inline bool kx_gated_off(const struct ggml_tensor * gate, int64_t i, int64_t nt) {
    if (!gate) {
        return false;
    }
    for (int64_t t = 0; t < nt; ++t) {
        if (kx_gate_at(gate, i, t) > 0.0f) {
            return false;
        }
    }
    return true;
}

// gated op: the up value u of neuron i, token t becomes relu(g) * u, the GLU's output (as
// ggml's reglu: g > 0 ? g*u : 0), so no GLU op follows it
static inline void kx_gate_apply(const struct ggml_tensor * gate, int64_t i, int64_t t, float * d) {
    if (gate) {
        const float g = kx_gate_at(gate, i, t);
        *d = g > 0.0f ? g * *d : 0.0f;
    }
}

void ggml_compute_forward_kx_mul_mat_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * w   = dst->src[0];
    const struct ggml_tensor * x   = dst->src[1];
    const struct ggml_tensor * sel = dst->src[2];
    const int32_t * map = dst->src[3] ? (const int32_t *) dst->src[3]->data : NULL;
    const struct ggml_tensor * gate = dst->src[4]; // gated (ReLU up rows): skip rows whose gate is <= 0
    const float * bias = dst->src[5] ? (const float *) dst->src[5]->data : NULL; // + b[i] (no list, no map)

    const int ith = params->ith;
    const int nth = params->nth;

    const int64_t k  = w->ne[0];
    const int64_t n  = dst->ne[0];
    const int64_t nt = x->ne[1];

    const struct ggml_type_traits_cpu * tw = ggml_get_type_traits_cpu(w->type);
    const enum ggml_type vdt  = tw->vec_dot_type;
    const bool           conv = x->type != vdt;
    const size_t         xrow = conv ? ggml_row_size(vdt, k) : x->nb[1];

    char * wdata = (char *) params->wdata;
    char * xq    = conv ? wdata : (char *) x->data;
    float * scratch = (float *) (wdata + (conv ? kx_align_up(xrow * (size_t) nt) : 0)
                                       + (size_t) ith * kx_align_up(sizeof(float) * (size_t) k));

    // phase 1: convert x (each row's blocks split across threads), zero this thread's rows of dst
    if (conv && !params->use_ref) {
        kx_x_convert(vdt, (const char *) x->data, x->nb[1], k, nt, xq, xrow, ith, nth);
    }
    {
        const int64_t r0 = n*ith/nth;
        const int64_t r1 = n*(ith + 1)/nth;
        for (int64_t t = 0; t < nt; ++t) {
            memset((char *) dst->data + t*dst->nb[1] + r0*sizeof(float), 0, (size_t) (r1 - r0)*sizeof(float));
        }
    }
    ggml_barrier(params->threadpool);

    // phase 2: active rows (no list: every row, in order)
    const int32_t * list  = sel ? (const int32_t *) sel->data : NULL;
    const int64_t   count = list ? list[0] : n;
    const int32_t * ids   = list ? list + 1 : NULL;
    const int64_t   j0 = count*ith/nth;
    const int64_t   j1 = count*(ith + 1)/nth;

    if (params->use_ref) {
        for (int64_t j = j0; j < j1; ++j) {
            const int64_t i   = ids ? ids[j] : j;
            const int64_t r   = map ? map[i] : i;
            if (r < 0 || kx_gated_off(gate, i, nt)) {
                continue;
            }
            const char * row = (const char *) w->data + r*w->nb[1];
            for (int64_t t = 0; t < nt; ++t) {
                const float * xt = (const float *) ((const char *) x->data + t*x->nb[1]);
                float * d = (float *) ((char *) dst->data + i*sizeof(float) + t*dst->nb[1]);
                *d = kx_row_dot_ref(w, row, xt, scratch) + (bias ? bias[i] : 0.0f);
                kx_gate_apply(gate, i, t, d);
            }
        }
        return;
    }

    ggml_vec_dot_t const vec_dot = tw->vec_dot;
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t i   = ids ? ids[j] : j;
        const int64_t r   = map ? map[i] : i;
        if (r < 0 || kx_gated_off(gate, i, nt)) {
            continue;
        }
        const char *  row = (const char *) w->data + r*w->nb[1];
        if (j + 1 < j1) {
            // rows are scattered: start the next row's first lines early
            const int64_t in = ids ? ids[j + 1] : j + 1;
            const int64_t rn = map ? map[in] : in;
            if (rn >= 0) {
                const char * next = (const char *) w->data + rn*w->nb[1];
                __builtin_prefetch(next);
                __builtin_prefetch(next + 64);
            }
        }
        for (int64_t t = 0; t < nt; ++t) {
            float * d = (float *) ((char *) dst->data + i*sizeof(float) + t*dst->nb[1]);
            vec_dot((int) k, d, 0, row, 0, xq + t*xrow, 0, 1);
            if (bias) {
                *d += bias[i];
            }
            kx_gate_apply(gate, i, t, d);
        }
    }
}
