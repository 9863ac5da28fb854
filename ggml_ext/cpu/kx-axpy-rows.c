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

#include "kx-axpy.h"

#include <stdatomic.h>
#include <string.h>

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

void kx_cpu_axpy_stats_add(int64_t nonzero, int64_t rows, int64_t elsewhere) {
    atomic_fetch_add(&kx_stat_nonzero, nonzero);
    atomic_fetch_add(&kx_stat_rows, rows);
    atomic_fetch_add(&kx_stat_elsewhere, elsewhere);
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

    // whole blocks of the row type per thread (a K-quant's super-block is 256 columns)
    const int64_t cb = MAX(KX_COL_BLOCK, ggml_blck_size(wt->type));
    const int64_t nblk = (m + cb - 1)/cb;
    const int64_t c0 = (nblk*ith/nth)*cb;
    const int64_t c1 = MIN(m, (nblk*(ith + 1)/nth)*cb);
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
            kx_axpy_row(wt->type, c0, c1, y, row, v, ref);
        }
    }
    if (c0 == 0) {
        kx_cpu_axpy_stats_add(nonzero, count - elsewhere, elsewhere);
    }
}
