// GGML_OP_KX_SELECT on CUDA: scores -> ascending list of active neuron ids, the CPU
// kernel's output exactly (same rule, same order, same density fallback).
//
// One block of 1024 threads: each thread owns a contiguous segment of ceil(n / 1024)
// neurons (≤ 28 for a 28672-wide FFN), counts its active ones, one block-wide exclusive
// scan gives every segment its output offset, and a second pass writes the ids. Two
// passes over ≤ 112 KB of scores from L2 cost a few µs, far below the row gathers they
// steer; a multi-block version would need a cross-block scan for the same sorted list.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_SELECT_THREADS 1024

static __device__ __forceinline__ bool kx_active(const float * s, int64_t i, int64_t nt, int64_t nb1,
                                                  float thr, int32_t act) {
    for (int64_t t = 0; t < nt; ++t) {
        const float v = *(const float *) ((const char *) s + i*sizeof(float) + t*nb1);
        const bool on = act == KX_SELECT_SCORE ? v > thr : fabsf(kx_act_value(v, act)) > thr;
        if (on) {
            return true;
        }
    }
    return false;
}

static __global__ void kx_select_kernel(const float * s, int32_t * out, int64_t n, int64_t nt, int64_t nb1,
                                        float thr, float max_density, int32_t act) {
    __shared__ int32_t warp_sums[KX_SELECT_THREADS / WARP_SIZE];
    __shared__ int32_t total;

    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE;
    const int warp = tid / WARP_SIZE;
    const int64_t seg = (n + KX_SELECT_THREADS - 1) / KX_SELECT_THREADS;
    const int64_t i0  = min(n, tid*seg);
    const int64_t i1  = min(n, i0 + seg);

    int32_t mine = 0;
    for (int64_t i = i0; i < i1; ++i) {
        mine += kx_active(s, i, nt, nb1, thr, act);
    }

    // exclusive scan of the per-thread counts: within warps by shuffles, then over warps
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
    int32_t pos = warp_sums[warp] + incl - mine;
    for (int64_t i = i0; i < i1; ++i) {
        if (kx_active(s, i, nt, nb1, thr, act)) {
            ids[pos++] = (int32_t) i;
        }
    }
    if (tid == 0) {
        out[0] = count;
    }
}

void ggml_cuda_kx_select(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src = dst->src[0];
    GGML_ASSERT(src->type == GGML_TYPE_F32 && src->nb[0] == sizeof(float));
    const float   thr         = ggml_get_op_params_f32(dst, 0);
    const float   max_density = ggml_get_op_params_f32(dst, 1);
    const int32_t act         = ggml_get_op_params_i32(dst, 2);
    kx_select_kernel<<<1, KX_SELECT_THREADS, 0, ctx.stream()>>>(
        (const float *) src->data, (int32_t *) dst->data, src->ne[0], src->ne[1], src->nb[1],
        thr, max_density, act);
}
