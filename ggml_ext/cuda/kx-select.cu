// GGML_OP_KX_SELECT on CUDA: scores -> ascending list of active neuron ids, the CPU
// kernel's output exactly (same rule, same order, same density fallback).
//
// Up to KX_SELECT_ONE_MAX neurons one block does both steps (kx_select_one_kernel); larger
// layers take two launches. The ballot kernel spreads the scores over the whole GPU: each warp reads
// KX_SELECT_BATCH coalesced 32-neuron chunks (one 128-byte read each per token) and stores
// one ballot word per chunk. The write kernel, one block, turns the ballots into the list:
// each of its 32 warps counts a contiguous range of ballots, one scan over the 32 counts gives
// each warp its output offset, and the warp writes its ids in order (and, for
// ggml_kx_select_to_host, the same words into mapped host memory).
// Why two: a single block reading every score was bound by its one SM at ~12 GB/s (H200,
// bench/select_time.cu, scores not in L2: 28672 neurons 14.6 µs, 131072 44.6 µs; 13.1 µs in
// KB-70B's decode under Nsight Compute). The ballots are n/8 bytes, so the one-block part
// now reads 1/32 of what it did, from L2.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_SELECT_BATCH         8    // chunks a warp of the ballot kernel reads, all loads in flight
#define KX_SELECT_BALLOT_WARPS  4    // warps per block of the ballot kernel (small blocks: many SMs)
#define KX_SELECT_THREADS       1024 // the write kernel's one block
#define KX_SELECT_WARPS         (KX_SELECT_THREADS/WARP_SIZE)
#define KX_SELECT_ONE_MAX       16384 // neurons the one-block form takes (its ballots: 2 KiB of shared memory)

static __device__ __forceinline__ bool kx_on(float v, float thr, int32_t act) {
    return act == KX_SELECT_SCORE ? v > thr : fabsf(kx_act_value(v, act)) > thr;
}

// masks[c] = ballot of chunk c (neurons 32c .. 32c+31): bit l is set when any token's score of
// neuron 32c+l passes the rule; one warp, chunks c0 .. c0 + KX_SELECT_BATCH - 1
// (split: rowmap non-NULL, the threshold of a neuron is thr + off[0] where rowmap >= 0, thr + off[1] elsewhere)
static __device__ __forceinline__ void kx_select_ballot(const float * s, uint32_t * masks, int64_t n, int64_t nt,
                                                        int64_t nb1, float thr, int32_t act, const int32_t * rowmap,
                                                        const float * off, int64_t c0, int lane) {
    const int64_t nc = (n + WARP_SIZE - 1) / WARP_SIZE;
    bool on[KX_SELECT_BATCH] = {false};
    float th[KX_SELECT_BATCH];
#pragma unroll
    for (int b = 0; b < KX_SELECT_BATCH; ++b) {
        const int64_t i = (c0 + b)*WARP_SIZE + lane;
        th[b] = rowmap && i < n ? thr + (rowmap[i] >= 0 ? off[0] : off[1]) : thr;
    }
    for (int64_t t = 0; t < nt; ++t) {
        const float * st = (const float *) ((const char *) s + t*nb1);
        float v[KX_SELECT_BATCH];
#pragma unroll
        for (int b = 0; b < KX_SELECT_BATCH; ++b) { // all loads first: one round trip per token
            const int64_t i = (c0 + b)*WARP_SIZE + lane;
            v[b] = i < n ? st[i] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < KX_SELECT_BATCH; ++b) {
            const int64_t i = (c0 + b)*WARP_SIZE + lane;
            on[b] = on[b] || (i < n && kx_on(v[b], th[b], act));
        }
    }
    uint32_t mine = 0; // lane b keeps chunk c0 + b's ballot: one coalesced store
#pragma unroll
    for (int b = 0; b < KX_SELECT_BATCH; ++b) {
        const uint32_t m = __ballot_sync(0xffffffff, on[b]);
        mine = lane == b ? m : mine;
    }
    if (lane < KX_SELECT_BATCH && c0 + lane < nc) {
        masks[c0 + lane] = mine;
    }
}

static __global__ void kx_select_ballot_kernel(const float * s, uint32_t * masks, int64_t n, int64_t nt,
                                               int64_t nb1, float thr, int32_t act, const int32_t * rowmap,
                                               const float * off) {
    const int64_t nc = (n + WARP_SIZE - 1) / WARP_SIZE;
    const int64_t c0 = ((int64_t) blockIdx.x*KX_SELECT_BALLOT_WARPS + threadIdx.x/WARP_SIZE)*KX_SELECT_BATCH;
    if (c0 < nc) { // whole warp: the ballots stay full-warp
        kx_select_ballot(s, masks, n, nt, nb1, thr, act, rowmap, off, c0, threadIdx.x % WARP_SIZE);
    }
}

// the list `out` (count, ids); with `host` (ggml_kx_select_to_host, mapped host memory) the same
// words at host + 1 and then the flag host[0]: each thread fences its own stores to the system
// before the block meets, so the flag's store, fenced again, is seen last. One launch: a
// kernel of its own re-read the list and cost the decode's serial part a launch per layer.
static __device__ __forceinline__ void kx_select_put(int32_t * out, int32_t * host, int64_t j, int32_t v) {
    out[j] = v;
    if (host) {
        host[1 + j] = v;
    }
}

static __device__ __forceinline__ void kx_select_flag(int32_t * host) {
    if (host) {
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            *(volatile int32_t *) host = 1;
        }
    }
}

// the list from the ballots (global or shared memory), by one block of KX_SELECT_THREADS
static __device__ __forceinline__ void kx_select_write(const uint32_t * masks, int32_t * out, int32_t * host, int64_t n,
                                                       float max_density) {
    __shared__ int32_t warp_off[KX_SELECT_WARPS];
    __shared__ int32_t total;

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int64_t nc  = (n + WARP_SIZE - 1) / WARP_SIZE;
    const int64_t per = (nc + KX_SELECT_WARPS - 1) / KX_SELECT_WARPS;
    const int64_t c0  = min(nc, warp*per);
    const int64_t c1  = min(nc, c0 + per);

    // the warp's count: lane l sums the ballots c0 + l, c0 + l + 32, ... (coalesced reads)
    int32_t mine = 0;
    for (int64_t c = c0 + lane; c < c1; c += WARP_SIZE) {
        mine += __popc(masks[c]);
    }
#pragma unroll
    for (int d = WARP_SIZE/2; d > 0; d /= 2) {
        mine += __shfl_xor_sync(0xffffffff, mine, d);
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
    if ((double) count > (double) max_density * (double) n) {
        // too dense to gain from gathers: list every neuron (exact, costs what dense costs)
        for (int64_t i = threadIdx.x; i < n; i += KX_SELECT_THREADS) {
            kx_select_put(out, host, 1 + i, (int32_t) i);
        }
        if (threadIdx.x == 0) {
            kx_select_put(out, host, 0, (int32_t) n);
        }
        kx_select_flag(host);
        return;
    }
    const uint32_t below = (1u << lane) - 1; // lanes before this one
    int32_t pos = warp_off[warp];
    for (int64_t g = c0; g < c1; g += WARP_SIZE) { // 32 ballots at a time, one per lane
        const uint32_t m = g + lane < c1 ? masks[g + lane] : 0u;
        const int32_t  k = __popc(m);
        int32_t ki = k; // inclusive scan: where each chunk's ids start
#pragma unroll
        for (int d = 1; d < WARP_SIZE; d *= 2) {
            const int32_t v = __shfl_up_sync(0xffffffff, ki, d);
            if (lane >= d) {
                ki += v;
            }
        }
        const int64_t nj = min((int64_t) WARP_SIZE, c1 - g);
        for (int64_t j = 0; j < nj; ++j) { // chunk g + j: its neuron 32(g+j) + lane
            const uint32_t mj = __shfl_sync(0xffffffff, m, (int) j);
            const int32_t  sj = __shfl_sync(0xffffffff, ki - k, (int) j);
            if (mj >> lane & 1u) {
                kx_select_put(out, host, 1 + pos + sj + __popc(mj & below), (int32_t) ((g + j)*WARP_SIZE + lane));
            }
        }
        pos += __shfl_sync(0xffffffff, ki, WARP_SIZE - 1);
    }
    if (threadIdx.x == 0) {
        kx_select_put(out, host, 0, count);
    }
    kx_select_flag(host);
}

static __global__ void __launch_bounds__(KX_SELECT_THREADS)
kx_select_write_kernel(const uint32_t * masks, int32_t * out, int32_t * host, int64_t n, float max_density) {
    kx_select_write(masks, out, host, n, max_density);
}

// Both steps in one block, the ballots in shared memory, for layers of up to KX_SELECT_ONE_MAX
// neurons: its 32 warps read the scores with KX_SELECT_BATCH chunks of loads in flight each
// (KB-7B's 11008 scores: two rounds; the earlier one-block kernel had one load in flight per
// thread). Why: the ballot kernel was a launch of its own on the decode's serial part. Alone
// (bench/select_time.cu, H100, scores not in L2): 11008 neurons 9.1 -> 8.1 µs, but 28672 10.8 ->
// 12.4, where the one SM's reads outweigh the launch (the two cross near 17k neurons).
static __global__ void __launch_bounds__(KX_SELECT_THREADS)
kx_select_one_kernel(const float * s, int32_t * out, int32_t * host, int64_t n, int64_t nt, int64_t nb1, float thr,
                     float max_density, int32_t act, const int32_t * rowmap, const float * off) {
    __shared__ uint32_t masks[KX_SELECT_ONE_MAX/WARP_SIZE];
    const int64_t nc = (n + WARP_SIZE - 1) / WARP_SIZE;
    for (int64_t c0 = (int64_t) (threadIdx.x/WARP_SIZE)*KX_SELECT_BATCH; c0 < nc; c0 += KX_SELECT_WARPS*KX_SELECT_BATCH) {
        kx_select_ballot(s, masks, n, nt, nb1, thr, act, rowmap, off, c0, threadIdx.x % WARP_SIZE);
    }
    __syncthreads();
    kx_select_write(masks, out, host, n, max_density);
}

// on `stream`: one launch up to KX_SELECT_ONE_MAX neurons, else the ballot and write kernels
// (masks: (n + 31)/32 words of scratch, which the one-block form does not use); host: NULL or
// the list's host copy (kx_select_host)
static void kx_select_launch(const float * s, int32_t * out, int32_t * host, uint32_t * masks, int64_t n, int64_t nt,
                             int64_t nb1, float thr, float max_density, int32_t act, const int32_t * rowmap,
                             const float * off, cudaStream_t stream) {
    if (n <= KX_SELECT_ONE_MAX) {
        kx_select_one_kernel<<<1, KX_SELECT_THREADS, 0, stream>>>(s, out, host, n, nt, nb1, thr, max_density, act,
                                                                 rowmap, off);
        return;
    }
    const int64_t nc     = (n + WARP_SIZE - 1) / WARP_SIZE;
    const int64_t warps  = (nc + KX_SELECT_BATCH - 1) / KX_SELECT_BATCH;
    const int64_t blocks = (warps + KX_SELECT_BALLOT_WARPS - 1) / KX_SELECT_BALLOT_WARPS;
    kx_select_ballot_kernel<<<(unsigned) blocks, KX_SELECT_BALLOT_WARPS*WARP_SIZE, 0, stream>>>(
        s, masks, n, nt, nb1, thr, act, rowmap, off);
    kx_select_write_kernel<<<1, KX_SELECT_THREADS, 0, stream>>>(masks, out, host, n, max_density);
}

void ggml_cuda_kx_select(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src = dst->src[0];
    GGML_ASSERT(src->type == GGML_TYPE_F32 && src->nb[0] == sizeof(float));
    const float   thr         = ggml_get_op_params_f32(dst, 0);
    const float   max_density = ggml_get_op_params_f32(dst, 1);
    const int32_t act         = ggml_get_op_params_i32(dst, 2);
    const int64_t n           = src->ne[0];
    ggml_cuda_pool_alloc<uint32_t> masks(ctx.pool());
    if (n > KX_SELECT_ONE_MAX) {
        masks.alloc((n + WARP_SIZE - 1) / WARP_SIZE);
    }
    kx_select_launch((const float *) src->data, (int32_t *) dst->data, kx_select_host(dst), masks.get(), n,
                     src->ne[1], src->nb[1], thr, max_density, act,
                     dst->src[1] ? (const int32_t *) dst->src[1]->data : nullptr,
                     dst->src[2] ? (const float *) dst->src[2]->data : nullptr, ctx.stream());
}
