// GGML_OP_KX_SELECT on CUDA: scores -> ascending list of active neuron ids, the CPU
// kernel's output exactly (same rule, same order, same density fallback).
//
// One block of 1024 threads walks the scores in chunks of 1024 consecutive neurons
// (neuron c*1024 + tid is thread tid's bit c, ≤ 32 chunks: n ≤ 32768). Every thread first
// loads all its chunks at once (coalesced, independent loads), then a warp ballot per
// chunk gives each (chunk, warp) a 32-bit mask, one block-wide exclusive scan of the mask
// popcounts in (chunk, warp) order gives each its output offset, and a lane writes its id
// at offset + popcount of the lower lanes' bits. Why: the first kernel gave each thread
// a contiguous segment and walked it twice, one uncoalesced, dependent load after
// another: 6.7 µs per layer on the decode's critical path (H200, KB-7B, Nsight Compute).
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_SELECT_THREADS 1024
#define KX_SELECT_CHUNKS  32 // bits of a thread's mask: n ≤ KX_SELECT_THREADS*KX_SELECT_CHUNKS

static __device__ __forceinline__ bool kx_on(float v, float thr, int32_t act) {
    return act == KX_SELECT_SCORE ? v > thr : fabsf(kx_act_value(v, act)) > thr;
}

// launch bounds: 1024 threads may use at most 64 registers each (the unbounded build took
// 65 and failed to launch)
static __global__ void __launch_bounds__(KX_SELECT_THREADS) kx_select_kernel(const float * s, int32_t * out, int64_t n, int64_t nt, int64_t nb1,
                                        float thr, float max_density, int32_t act) {
    __shared__ uint32_t masks[KX_SELECT_CHUNKS*WARP_SIZE]; // [chunk][warp]
    __shared__ int32_t  offs[KX_SELECT_CHUNKS*WARP_SIZE];  // exclusive scan of their popcounts
    __shared__ int32_t  warp_sums[KX_SELECT_THREADS / WARP_SIZE];
    __shared__ int32_t  total;

    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE;
    const int warp = tid / WARP_SIZE;
    const int nchunks = (int) ((n + KX_SELECT_THREADS - 1) / KX_SELECT_THREADS);

    // bit c: neuron c*1024 + tid is active in at least one token
    uint32_t bits = 0;
    for (int64_t t = 0; t < nt; ++t) {
        const float * st = (const float *) ((const char *) s + t*nb1);
        float v[KX_SELECT_CHUNKS];
#pragma unroll
        for (int c = 0; c < KX_SELECT_CHUNKS; ++c) {
            const int64_t i = (int64_t) c*KX_SELECT_THREADS + tid;
            v[c] = i < n ? st[i] : 0.0f;
        }
#pragma unroll
        for (int c = 0; c < KX_SELECT_CHUNKS; ++c) {
            const int64_t i = (int64_t) c*KX_SELECT_THREADS + tid;
            if (i < n && kx_on(v[c], thr, act)) {
                bits |= 1u << c;
            }
        }
    }
    for (int c = 0; c < nchunks; ++c) {
        const uint32_t m = __ballot_sync(0xffffffff, (bits >> c) & 1u);
        if (lane == 0) {
            masks[c*WARP_SIZE + warp] = m;
        }
    }
    __syncthreads();

    // exclusive scan over the (chunk, warp) popcounts, one per thread: within warps by
    // shuffles, then over the warps' sums
    const int e = tid; // (chunk e/32, warp e%32); KX_SELECT_THREADS == KX_SELECT_CHUNKS*WARP_SIZE
    const int32_t mine = e < nchunks*WARP_SIZE ? __popc(masks[e]) : 0;
    int32_t incl = mine;
#pragma unroll
    for (int d = 1; d < WARP_SIZE; d *= 2) {
        const int32_t v = __shfl_up_sync(0xffffffff, incl, d);
        if (lane >= d) {
            incl += v;
        }
    }
    if (lane == WARP_SIZE - 1) {
        warp_sums[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        const int32_t w = warp_sums[lane];
        int32_t wi = w;
#pragma unroll
        for (int d = 1; d < WARP_SIZE; d *= 2) {
            const int32_t v = __shfl_up_sync(0xffffffff, wi, d);
            if (lane >= d) {
                wi += v;
            }
        }
        warp_sums[lane] = wi - w;
        if (lane == WARP_SIZE - 1) {
            total = wi;
        }
    }
    __syncthreads();
    offs[e] = warp_sums[warp] + incl - mine;
    __syncthreads();

    const int32_t count = total;
    int32_t * ids = out + 1;
    if ((double) count > (double) max_density * (double) n) {
        // too dense to gain from gathers: list every neuron (exact, costs what dense costs)
        for (int64_t i = tid; i < n; i += KX_SELECT_THREADS) {
            ids[i] = (int32_t) i;
        }
        if (tid == 0) {
            out[0] = (int32_t) n;
        }
        return;
    }
    const uint32_t below = (1u << lane) - 1u;
    for (int c = 0; c < nchunks; ++c) {
        if ((bits >> c) & 1u) {
            const int k = c*WARP_SIZE + warp;
            ids[offs[k] + __popc(masks[k] & below)] = (int32_t) ((int64_t) c*KX_SELECT_THREADS + tid);
        }
    }
    if (tid == 0) {
        out[0] = count;
    }
}

void ggml_cuda_kx_select(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src = dst->src[0];
    GGML_ASSERT(src->type == GGML_TYPE_F32 && src->nb[0] == sizeof(float));
    GGML_ASSERT(src->ne[0] <= (int64_t) KX_SELECT_THREADS*KX_SELECT_CHUNKS); // kx-supports.cu keeps wider layers on the CPU
    const float   thr         = ggml_get_op_params_f32(dst, 0);
    const float   max_density = ggml_get_op_params_f32(dst, 1);
    const int32_t act         = ggml_get_op_params_i32(dst, 2);
    kx_select_kernel<<<1, KX_SELECT_THREADS, 0, ctx.stream()>>>(
        (const float *) src->data, (int32_t *) dst->data, src->ne[0], src->ne[1], src->nb[1],
        thr, max_density, act);
}
