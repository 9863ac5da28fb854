// CUDA kernels of the kairox ops (compiled into ggml-cuda; dispatched from ggml-cuda.cu by
// patches/0006). One op per file: kx-select.cu, kx-mul-mat-rows.cu, kx-axpy-rows.cu.
//
// Every kernel runs on a fixed grid sized from tensor shapes only and reads the active
// count from the device-side list, so a graph is captured once (CUDA graphs) and replays
// for every token whatever its active set.
#pragma once

#include "ggml-cuda/common.cuh"

// tokens per call the sparse kernels keep in registers: decode batches (1-8 tokens);
// larger batches take llama.cpp's dense path (kx-ffn.cpp: kx_sparse_max_tokens)
#define KX_CUDA_MAX_TOKENS 8

// (d·scale, dmin·min) of sub-block j of a Q4_K/Q5_K super-block, whose 6-bit scales and mins
// are packed in 12 bytes (the layout of ggml's get_scale_min_k4); dm: the block's (d, dmin)
static __device__ __forceinline__ float2 kx_k4_scale_min(const uint8_t * q, int j, float2 dm) {
    const int sc = j < 4 ? (q[j] & 63)     : ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    const int m  = j < 4 ? (q[j + 4] & 63) : ((q[j + 4] >> 4)  | ((q[j] >> 6) << 4));
    return make_float2(dm.x*(float) sc, dm.y*(float) m);
}

// Blocks of `kernel` (`threads` a block) that device `device` runs at once, so that a grid of
// at most that many is one wave. Why: a gather's grid sized from the shapes alone ran in
// waves (KB-7B Q4_K_M's slot rows: 2112 blocks of a 110-register kernel that fits 4 blocks an
// SM, 4 waves whose later blocks found no list entries left; the down rows 1.33 waves), and
// every wave costs the gather's whole chain of dependent loads again (H100, Nsight Compute).
// Cached per kernel and device: the launch path runs for every graph that is not replayed.
static int kx_resident_blocks(const void * kernel, int threads, int device) {
    static std::mutex mu;
    static std::unordered_map<const void *, int> cache[GGML_CUDA_MAX_DEVICES];
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache[device].find(kernel);
    if (it != cache[device].end()) {
        return it->second;
    }
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    const int n = std::max(1, per_sm)*ggml_cuda_info().devices[device].nsm;
    cache[device].emplace(kernel, n);
    return n;
}

void ggml_cuda_kx_select      (ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_cuda_kx_mul_mat_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_cuda_kx_axpy_rows   (ggml_backend_cuda_context & ctx, ggml_tensor * dst);

bool ggml_cuda_kx_supports_op(const ggml_tensor * op);

// scheduler trace stamp (kx-trace-mark.cu; include/kx-trace.h: kx_backend_trace_mark_t)
void ggml_cuda_kx_trace_mark(ggml_backend_t backend, int64_t * t_us);
// ... and the stamp itself on any stream (the reload engine's too): *t_us when the stream reaches it
cudaError_t ggml_cuda_kx_stamp(cudaStream_t stream, int64_t * t_us);
// the scheduler's deferred wait polls it (kx-trace-mark.cu; kx-trace.h: kx_event_busy_t)
bool ggml_cuda_kx_event_busy(ggml_backend_event_t event);

// the reload engine of the live balancer (kx-reload.cu; include/kx-reload.h)
struct kx_reload_iface;
struct kx_tam_iface;
struct kx_pin_iface;
const kx_reload_iface * ggml_cuda_kx_reload_iface(void);
const kx_tam_iface *    ggml_cuda_kx_tam_iface(void);
const kx_pin_iface *    ggml_cuda_kx_pin_iface(void);
// timed events (kx-timer.cu; include/kx-timer.h)
struct kx_timer_iface;
const kx_timer_iface *  ggml_cuda_kx_timer_iface(void);

// every hybrid layer's TAM step in one launch (kx-tam.cu), driven by the reload engine
struct kx_tam_config;
void *  ggml_cuda_kx_tam_batch_new(const kx_tam_config * cfg, int32_t n_layers, const int32_t * n,
                                   const int32_t * capacity, const uint8_t * initial);
void    ggml_cuda_kx_tam_batch_free(void * t);
int32_t ggml_cuda_kx_tam_batch_launch(void * t, cudaStream_t stream, const int32_t * const * active,
                                      const int32_t * n_active, const int32_t * stalls);
int32_t ggml_cuda_kx_tam_batch_reset(void * t, cudaStream_t stream, const uint8_t * initial);
int32_t ggml_cuda_kx_tam_batch_fetch(void * t, const int32_t ** ids, float * lam, int32_t * counts, float * kernel_us);
