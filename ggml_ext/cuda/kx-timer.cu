// The CUDA device timers (include/kx-timer.h). ggml's own events are made without timing
// (cheaper to record and wait on); these have it. cudaEventElapsedTime does not block: it
// answers cudaErrorNotReady until both events completed, which is the table's "not yet".
#include "kx-ops-cuda.cuh"
#include "kx-timer.h"
#include "ggml-backend-impl.h"

static void * kx_cuda_timer_make(ggml_backend_t backend) {
    auto * ctx = (ggml_backend_cuda_context *) backend->context;
    ggml_cuda_set_device(ctx->device);
    cudaEvent_t ev = nullptr;
    if (cudaEventCreate(&ev) != cudaSuccess) {
        (void) cudaGetLastError();
        return nullptr;
    }
    return ev;
}

static void kx_cuda_timer_free(void * ev) {
    if (ev) {
        CUDA_CHECK(cudaEventDestroy((cudaEvent_t) ev));
    }
}

static void kx_cuda_timer_record(void * ev, ggml_backend_t backend) {
    auto * ctx = (ggml_backend_cuda_context *) backend->context;
    ggml_cuda_set_device(ctx->device);
    CUDA_CHECK(cudaEventRecord((cudaEvent_t) ev, ctx->stream()));
}

static double kx_cuda_timer_elapsed(void * a, void * b) {
    float ms = 0.0f;
    const cudaError_t err = cudaEventElapsedTime(&ms, (cudaEvent_t) a, (cudaEvent_t) b);
    if (err == cudaErrorNotReady) {
        (void) cudaGetLastError(); // clear it: the next CUDA_CHECK must not see it
        return -1.0;
    }
    CUDA_CHECK(err);
    return ms * 1e-3;
}

static const kx_timer_iface kx_cuda_timer_iface_v = {
    kx_cuda_timer_make, kx_cuda_timer_free, kx_cuda_timer_record, kx_cuda_timer_elapsed,
};

const kx_timer_iface * ggml_cuda_kx_timer_iface(void) {
    return &kx_cuda_timer_iface_v;
}
