// Stream priorities (kx_params.decode_priority): the CUDA backend's streams (the decode's
// kernels and its CPU<->GPU hand-off copies) at the device's greatest priority, so that the
// block scheduler dispatches them ahead of the slot reloads' gather kernels and the
// balancer's decision kernel, which run on the reload engine's stream at the least
// priority (kx-reload.cu). A priority ranks kernel blocks waiting for an SM; it does not
// order copy-engine transfers or PCIe traffic, which the gather's grid cap throttles
// (kx_balance_params.max_blocks).
//
// One choice per process: common.cuh (patches/0020) creates each backend context's streams
// on first use at ggml_cuda_kx_stream_priority(), so the choice made before a context runs
// its first graph (kx_model_params_apply) holds for that context.
#include "kx-ops-cuda.cuh"
#include "ggml-backend-impl.h"

#include <atomic>

static std::atomic<bool> kx_decode_high{false};

void ggml_cuda_kx_set_decode_priority(bool high) {
    kx_decode_high.store(high);
}

int ggml_cuda_kx_priority(bool greatest) {
    int lo = 0, hi = 0;
    if (cudaDeviceGetStreamPriorityRange(&lo, &hi) != cudaSuccess) {
        (void) cudaGetLastError();
        return 0;
    }
    return greatest ? hi : lo;
}

// the current device's greatest priority when asked for, else 0 (CUDA's default, which is
// also its least: a stream created without a priority)
int ggml_cuda_kx_stream_priority(void) {
    return kx_decode_high.load() ? ggml_cuda_kx_priority(true) : 0;
}

// tests ("kx_backend_stream_priority"): the priority of the backend's compute stream and the
// device's range (CUDA: least is the numerically larger). 0 ok
int32_t ggml_cuda_kx_backend_stream_priority(ggml_backend_t backend, int32_t * prio, int32_t * least,
                                             int32_t * greatest) {
    auto * ctx = (ggml_backend_cuda_context *) backend->context;
    ggml_cuda_set_device(ctx->device);
    int p = 0, lo = 0, hi = 0;
    if (cudaStreamGetPriority(ctx->stream(), &p) != cudaSuccess ||
        cudaDeviceGetStreamPriorityRange(&lo, &hi) != cudaSuccess) {
        (void) cudaGetLastError();
        return 1;
    }
    *prio = p;
    *least = lo;
    *greatest = hi;
    return 0;
}
