// GGML_OP_KX_AXPY_ROWS on CUDA: y[:, t] = sum over listed neurons i of h[i, t] * wt[row(i)],
// the down projection as a sum of rows (wt = W_down transposed, one row per neuron).
//
// Grid: column tiles of KX_AXPY_COLS outputs × KX row groups. A block takes the listed
// neurons j ≡ blockIdx.y (mod row groups) in stages of KX_AXPY_COLS: first every thread
// looks up one of them (list entry, row map, h for each token) and the block compacts those
// with a row here and h != 0 into shared memory; then each thread streams its column of the
// staged rows, four rows per step, accumulating all tokens in registers, and finally adds its
// partial sums to y with one atomicAdd per column and token. Rows are read coalesced (a tile
// is 512 contiguous bytes of an F16 row). Why staged: looking an entry up takes three
// dependent loads (list, map, h) before its row can be requested; done one entry at a time
// per thread that chain made the kernel latency-bound (H200, KB-7B slots: ~34 µs per layer
// for ~2 MB of rows, Nsight Compute), while the staged form issues the lookups of a stage at
// once and keeps four independent row loads in flight per thread. Atomic order (and the
// order of a stage) makes the last bits of y vary from run to run; the test tolerance
// covers it.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_AXPY_COLS 256

template <ggml_type type>
static __device__ __forceinline__ float kx_load_col(const char * __restrict__ row, int64_t c) {
    if constexpr (type == GGML_TYPE_F32) {
        return ((const float *) row)[c];
    } else if constexpr (type == GGML_TYPE_F16) {
        return __half2float(((const half *) row)[c]);
    } else if constexpr (type == GGML_TYPE_Q8_0) {
        const block_q8_0 * b = (const block_q8_0 *) row + c/QK8_0;
        return __half2float(b->d)*(float) b->qs[c % QK8_0];
    } else if constexpr (type == GGML_TYPE_Q4_K) {
        // column j of a super-block: 64-wide chunk j/64 holds sub-blocks 2(j/64) (low nibbles)
        // and 2(j/64) + 1 (high nibbles) in the same 32 bytes (ggml's dequantize_row_q4_K)
        const block_q4_K * b = (const block_q4_K *) row + c/QK_K;
        const int j  = c % QK_K;
        const int hi = (j >> 5) & 1;
        const int k  = 2*(j >> 6) + hi;
        const uint8_t * sc = b->scales;
        const int s6 = k < 4 ? (sc[k] & 63) : ((sc[k + 4] & 0xF) | ((sc[k - 4] >> 6) << 4));
        const int m6 = k < 4 ? (sc[k + 4] & 63) : ((sc[k + 4] >> 4) | ((sc[k] >> 6) << 4));
        const uint8_t q = b->qs[32*(j >> 6) + (j & 31)];
        const float2 dm = __half22float2(b->dm);
        return dm.x*s6*(float) (hi ? q >> 4 : q & 0xF) - dm.y*m6;
    } else { // Q6_K: 128-wide halves of four 32-wide quarters (ggml's dequantize_row_q6_K)
        const block_q6_K * b = (const block_q6_K *) row + c/QK_K;
        const int j  = c % QK_K;
        const int n  = j >> 7;         // half
        const int qd = (j >> 5) & 3;   // quarter: ql low/high nibble at +0/+32, qh bits 2*qd
        const int l  = j & 31;
        const uint8_t ql = b->ql[64*n + l + 32*(qd & 1)];
        const uint8_t qh = b->qh[32*n + l];
        const int q = (((qd < 2 ? ql & 0xF : ql >> 4)) | (((qh >> (2*qd)) & 3) << 4)) - 32;
        return __half2float(b->d)*b->scales[8*n + l/16 + 2*qd]*(float) q;
    }
}

template <ggml_type type>
static __global__ void kx_axpy_rows_kernel(const char * __restrict__ wt, int64_t wt_nb1,
                                           const float * __restrict__ h, int64_t sh,
                                           const int32_t * __restrict__ sel, const int32_t * __restrict__ rowmap,
                                           float * __restrict__ y, int64_t sy, int64_t m, int nt) {
    __shared__ int32_t s_row[KX_AXPY_COLS];
    __shared__ float   s_h[KX_AXPY_COLS][KX_CUDA_MAX_TOKENS];
    __shared__ int     s_n;

    const int64_t c = (int64_t) blockIdx.x*KX_AXPY_COLS + threadIdx.x;
    const int64_t count = sel[0];
    // this block's list entries: j = blockIdx.y + q*gridDim.y for q in [0, nq)
    const int64_t nq = count > blockIdx.y ? (count - blockIdx.y + gridDim.y - 1)/gridDim.y : 0;
    float acc[KX_CUDA_MAX_TOKENS] = {0.0f};
    bool any = false;
    for (int64_t q0 = 0; q0 < nq; q0 += KX_AXPY_COLS) {
        if (threadIdx.x == 0) {
            s_n = 0;
        }
        __syncthreads();
        const int64_t q = q0 + threadIdx.x;
        if (q < nq) {
            const int32_t i = sel[1 + blockIdx.y + q*gridDim.y];
            const int32_t r = rowmap ? rowmap[i] : i;
            if (r >= 0) {
                float hv[KX_CUDA_MAX_TOKENS];
                bool nz = false;
#pragma unroll
                for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                    hv[t] = t < nt ? h[i + t*sh] : 0.0f;
                    nz |= hv[t] != 0.0f;
                }
                if (nz) {
                    const int e = atomicAdd(&s_n, 1);
                    s_row[e] = r;
#pragma unroll
                    for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                        s_h[e][t] = hv[t];
                    }
                }
            }
        }
        __syncthreads();
        const int n = s_n;
        any |= n > 0;
        if (c < m) {
            int e = 0;
            for (; e + 4 <= n; e += 4) {
                float w[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    w[u] = kx_load_col<type>(wt + (int64_t) s_row[e + u]*wt_nb1, c);
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
#pragma unroll
                    for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                        acc[t] += s_h[e + u][t]*w[u];
                    }
                }
            }
            for (; e < n; ++e) {
                const float w = kx_load_col<type>(wt + (int64_t) s_row[e]*wt_nb1, c);
#pragma unroll
                for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                    acc[t] += s_h[e][t]*w;
                }
            }
        }
        __syncthreads(); // the next stage overwrites s_row / s_h
    }
    if (any && c < m) {
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
        case GGML_TYPE_Q4_K: KX_AXPY_LAUNCH(GGML_TYPE_Q4_K); break;
        case GGML_TYPE_Q6_K: KX_AXPY_LAUNCH(GGML_TYPE_Q6_K); break;
        default: GGML_ABORT("kx_axpy_rows: unsupported type %s", ggml_type_name(wt->type));
    }
#undef KX_AXPY_LAUNCH
}
