// GGML_OP_KX_SELECT on CUDA: scores -> ascending list of active neuron ids, the CPU
// kernel's output exactly (same rule, same order, same density fallback).
//
// One block of 1024 threads, 32 warps. Warp w owns a contiguous range of 32-neuron chunks;
// a chunk is one coalesced 128-byte read per token, its active lanes one ballot. Pass 1
// counts each warp's active neurons (keeping the ballots in shared memory), one scan over
// the 32 warp counts gives each warp its output offset, pass 2 writes the ids in order.
// Why chunks: with one contiguous segment per thread (the first version) every load of a
// warp touched 32 cache lines. Measured (H200, bench/select_time.cu, scores not in L2):
// 28672 neurons 17.0 -> 14.6 µs, 131072 neurons 143 -> 44.6 µs; 11008 unchanged (9.2-9.4);
// under Nsight Compute in KB-70B's decode 13.4 -> 13.1 µs. Either way one block reads the
// scores at ~12 GB/s: the single SM is the bound, and the next step is a grid-wide version
// (ballots from every SM, then one block's scan and write).
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_SELECT_THREADS 1024
#define KX_SELECT_WARPS   (KX_SELECT_THREADS/WARP_SIZE)
#define KX_SELECT_BATCH   8    // chunks a lane has in flight per token
#define KX_SELECT_MASKS   4096 // ballots kept between the passes (n ≤ 131072); beyond, pass 2 recomputes

static __device__ __forceinline__ bool kx_on(float v, float thr, int32_t act) {
    return act == KX_SELECT_SCORE ? v > thr : fabsf(kx_act_value(v, act)) > thr;
}

// the ballots of chunks c0 .. c0 + KX_SELECT_BATCH - 1 (those below c1): a neuron is active
// when any token's score passes the rule
static __device__ __forceinline__ void kx_select_ballots(const float * s, int64_t n, int64_t nt, int64_t nb1,
                                                         float thr, int32_t act, int64_t c0, int64_t c1,
                                                         int lane, uint32_t * m) {
    bool on[KX_SELECT_BATCH] = {false};
    for (int64_t t = 0; t < nt; ++t) {
        const float * st = (const float *) ((const char *) s + t*nb1);
        float v[KX_SELECT_BATCH];
#pragma unroll
        for (int b = 0; b < KX_SELECT_BATCH; ++b) { // all loads first: one round trip per batch
            const int64_t i = (c0 + b)*WARP_SIZE + lane;
            v[b] = c0 + b < c1 && i < n ? st[i] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < KX_SELECT_BATCH; ++b) {
            const int64_t i = (c0 + b)*WARP_SIZE + lane;
            on[b] = on[b] || (c0 + b < c1 && i < n && kx_on(v[b], thr, act));
        }
    }
#pragma unroll
    for (int b = 0; b < KX_SELECT_BATCH; ++b) {
        m[b] = __ballot_sync(0xffffffff, on[b]);
    }
}

static __global__ void kx_select_kernel(const float * s, int32_t * out, int64_t n, int64_t nt, int64_t nb1,
                                        float thr, float max_density, int32_t act) {
    __shared__ int32_t  warp_off[KX_SELECT_WARPS];
    __shared__ int32_t  total;
    __shared__ uint32_t masks[KX_SELECT_MASKS];

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int64_t nc  = (n + WARP_SIZE - 1) / WARP_SIZE;           // chunks
    const int64_t per = (nc + KX_SELECT_WARPS - 1) / KX_SELECT_WARPS;
    const int64_t c0  = min(nc, warp*per);
    const int64_t c1  = min(nc, c0 + per);
    const bool keep = nc <= KX_SELECT_MASKS;

    int32_t mine = 0;
    for (int64_t c = c0; c < c1; c += KX_SELECT_BATCH) {
        uint32_t m[KX_SELECT_BATCH];
        kx_select_ballots(s, n, nt, nb1, thr, act, c, c1, lane, m);
#pragma unroll
        for (int b = 0; b < KX_SELECT_BATCH; ++b) {
            mine += __popc(m[b]);
            if (keep && lane == b && c + b < c1) {
                masks[c + b] = m[b];
            }
        }
    }
    if (lane == 0) {
        warp_off[warp] = mine;
    }
    __syncthreads();
    if (warp == 0) { // exclusive scan of the 32 warp counts
        const int32_t w = warp_off[lane];
        int32_t wi = w;
#pragma unroll
        for (int d = 1; d < WARP_SIZE; d *= 2) {
            const int32_t v = __shfl_up_sync(0xffffffff, wi, d);
            if (lane >= d) {
                wi += v;
            }
        }
        warp_off[lane] = wi - w;
        if (lane == WARP_SIZE - 1) {
            total = wi;
        }
    }
    __syncthreads();

    const int32_t count = total;
    int32_t * ids = out + 1;
    if ((double) count > (double) max_density * (double) n) {
        // too dense to gain from gathers: list every neuron (exact, costs what dense costs)
        for (int64_t i = threadIdx.x; i < n; i += KX_SELECT_THREADS) {
            ids[i] = (int32_t) i;
        }
        if (threadIdx.x == 0) {
            out[0] = (int32_t) n;
        }
        return;
    }
    const uint32_t below = (1u << lane) - 1; // lanes before this one
    int32_t pos = warp_off[warp];
    for (int64_t c = c0; c < c1; c += KX_SELECT_BATCH) {
        uint32_t m[KX_SELECT_BATCH];
        if (keep) {
#pragma unroll
            for (int b = 0; b < KX_SELECT_BATCH; ++b) {
                m[b] = c + b < c1 ? masks[c + b] : 0u;
            }
        } else {
            kx_select_ballots(s, n, nt, nb1, thr, act, c, c1, lane, m);
        }
#pragma unroll
        for (int b = 0; b < KX_SELECT_BATCH; ++b) {
            if (m[b] >> lane & 1u) {
                ids[pos + __popc(m[b] & below)] = (int32_t) ((c + b)*WARP_SIZE + lane);
            }
            pos += __popc(m[b]);
        }
    }
    if (threadIdx.x == 0) {
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
