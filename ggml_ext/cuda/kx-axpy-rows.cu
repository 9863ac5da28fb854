// GGML_OP_KX_AXPY_ROWS on CUDA: y[:, t] = sum over listed neurons i of h[i, t] * wt[row(i)],
// the down projection as a sum of rows (wt = W_down transposed, one row per neuron).
//
// Grid: column tiles of KX_AXPY_COLS outputs × KX row groups. A block walks the listed
// neurons j ≡ blockIdx.y (mod row groups), each thread accumulating its column for all
// tokens in registers, then adds its partial sums to y with one atomicAdd per column and
// token. Rows are read coalesced (a tile is 512 contiguous bytes of an F16 row); neurons
// with h = 0 for every token are skipped without touching their row. Atomic order makes
// the last bits of y vary from run to run; the test tolerance covers it.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_AXPY_COLS 256

template <ggml_type type>
static __device__ __forceinline__ float kx_load_col(const char * __restrict__ row, int64_t c) {
    if constexpr (type == GGML_TYPE_F32) {
        return ((const float *) row)[c];
    } else if constexpr (type == GGML_TYPE_F16) {
        return __half2float(((const half *) row)[c]);
    } else { // Q8_0
        const block_q8_0 * b = (const block_q8_0 *) row + c/QK8_0;
        return __half2float(b->d)*(float) b->qs[c % QK8_0];
    }
}

template <ggml_type type>
static __global__ void kx_axpy_rows_kernel(const char * __restrict__ wt, int64_t wt_nb1,
                                           const float * __restrict__ h, int64_t sh,
                                           const int32_t * __restrict__ sel, const int32_t * __restrict__ rowmap,
                                           float * __restrict__ y, int64_t sy, int64_t m, int nt) {
    const int64_t c = (int64_t) blockIdx.x*KX_AXPY_COLS + threadIdx.x;
    const int32_t count = sel[0];
    float acc[KX_CUDA_MAX_TOKENS] = {0.0f};
    bool any = false;
    for (int64_t j = blockIdx.y; j < count; j += gridDim.y) {
        const int32_t i = sel[1 + j];
        const int32_t r = rowmap ? rowmap[i] : i;
        if (r < 0) {
            continue;
        }
        float hv[KX_CUDA_MAX_TOKENS];
        bool nz = false;
#pragma unroll
        for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
            hv[t] = t < nt ? h[i + t*sh] : 0.0f;
            nz |= hv[t] != 0.0f;
        }
        if (!nz || c >= m) {
            continue;
        }
        const float w = kx_load_col<type>(wt + r*wt_nb1, c);
#pragma unroll
        for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
            acc[t] += hv[t]*w;
        }
        any = true;
    }
    if (any) {
#pragma unroll
        for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
            if (t < nt) {
                atomicAdd(y + c + t*sy, acc[t]);
            }
        }
    }
}

void ggml_cuda_kx_axpy_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * wt     = dst->src[0];
    const ggml_tensor * h      = dst->src[1];
    const ggml_tensor * sel    = dst->src[2];
    const ggml_tensor * rowmap = dst->src[3];
    cudaStream_t stream = ctx.stream();

    const int64_t m  = wt->ne[0];
    const int     nt = (int) h->ne[1];
    GGML_ASSERT(nt <= KX_CUDA_MAX_TOKENS);

    CUDA_CHECK(cudaMemsetAsync(dst->data, 0, ggml_nbytes(dst), stream));

    // row groups: ~8 blocks per SM in all, so the densest list keeps HBM busy while a
    // short list still spreads over the SMs; fixed from shapes (graph capture)
    const int nsm = ggml_cuda_info().devices[ctx.device].nsm;
    const int64_t tiles  = (m + KX_AXPY_COLS - 1)/KX_AXPY_COLS;
    const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(h->ne[0], (int64_t) nsm*8/tiles));
    const dim3 grid((unsigned) tiles, (unsigned) std::min<int64_t>(groups, 65535));
    const int32_t * map = rowmap ? (const int32_t *) rowmap->data : nullptr;
    const int64_t sh = h->nb[1]/sizeof(float);
    const int64_t sy = dst->nb[1]/sizeof(float);
#define KX_AXPY_LAUNCH(T) kx_axpy_rows_kernel<T><<<grid, KX_AXPY_COLS, 0, stream>>>( \
        (const char *) wt->data, wt->nb[1], (const float *) h->data, sh, (const int32_t *) sel->data, map, \
        (float *) dst->data, sy, m, nt)
    switch (wt->type) {
        case GGML_TYPE_F32:  KX_AXPY_LAUNCH(GGML_TYPE_F32);  break;
        case GGML_TYPE_F16:  KX_AXPY_LAUNCH(GGML_TYPE_F16);  break;
        case GGML_TYPE_Q8_0: KX_AXPY_LAUNCH(GGML_TYPE_Q8_0); break;
        default: GGML_ABORT("kx_axpy_rows: unsupported type %s", ggml_type_name(wt->type));
    }
#undef KX_AXPY_LAUNCH
}
