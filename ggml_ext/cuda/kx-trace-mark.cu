// Two small helpers the scheduler (patches 0008 and 0012) gets from the CUDA registry.
//
// The CUDA backend's stamp for the scheduler trace (include/kx-trace.h): a host function
// queued on the backend's stream writes the time when the stream reaches it, i.e. when
// the work queued before it has finished on the GPU. Returned by the CUDA registry as
// "kx_backend_trace_mark" (patches/0006); only called while the scheduler trace records (kx_trace_start).
#include "kx-ops-cuda.cuh"
#include "ggml-backend-impl.h"

static void CUDART_CB kx_trace_stamp(void * t_us) {
    *(int64_t *) t_us = ggml_time_us(); // no CUDA calls allowed here
}

cudaError_t ggml_cuda_kx_stamp(cudaStream_t stream, int64_t * t_us) {
    return cudaLaunchHostFunc(stream, kx_trace_stamp, t_us);
}

void ggml_cuda_kx_trace_mark(ggml_backend_t backend, int64_t * t_us) {
    auto * ctx = (ggml_backend_cuda_context *) backend->context;
    ggml_cuda_set_device(ctx->device);
    CUDA_CHECK(ggml_cuda_kx_stamp(ctx->stream(), t_us));
}

// "kx_event_busy": the deferred device wait (kx-trace.h) polls whether the read-backs a CPU
// split waits for have landed, so that the thread waiting can do something else meanwhile.
// cudaEventQuery does not block (~1 µs); cudaErrorNotReady is its "not yet", not an error.
bool ggml_cuda_kx_event_busy(ggml_backend_event_t event) {
    const cudaError_t err = cudaEventQuery((cudaEvent_t) event->context);
    if (err == cudaErrorNotReady) {
        (void) cudaGetLastError(); // clear it: the next CUDA_CHECK must not see it
        return true;
    }
    CUDA_CHECK(err);
    return false;
}
