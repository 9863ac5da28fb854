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
