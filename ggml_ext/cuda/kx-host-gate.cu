// The CUDA backend's host gate for the scheduler's run-ahead (include/kx-trace.h:
// kx_backend_host_gate_t; patch 0008): the stream waits until a word in page-locked host
// memory reaches a sequence number, so the scheduler can queue a device split that reads
// a CPU split's result (the copy up and the kernels after it) before that CPU split runs.
// The host stores the number when its result is written; the stream goes on by itself, with
// no launch or copy call left between the CPU part's end and the GPU's next kernels.
//
// One thread polls the word over PCIe (~1-2 µs a read). It runs after the work queued before
// it on the stream (a hybrid layer's GPU part), so it holds one SM only while the GPU would
// otherwise idle. Returned by the CUDA registry as "kx_backend_host_gate" (patches/0006).
#include "kx-ops-cuda.cuh"
#include "ggml-backend-impl.h"

// A gate still closed after this long means the host never released it (a scheduler bug):
// trap, so the next synchronization reports an error instead of hanging the process. A CPU
// split that is gated is one hybrid layer's host part (~0.1-2 ms).
#define KX_HOST_GATE_TIMEOUT_NS 60000000000ull

static __device__ __forceinline__ uint64_t kx_globaltimer_ns(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __global__ void kx_host_gate_kernel(const volatile uint32_t * word, uint32_t seq) {
    const uint64_t t0 = kx_globaltimer_ns();
    // wrap-safe: the host's counter only grows, seq is at most 2^31 ahead of the word
    while ((int32_t) (*word - seq) < 0) {
        __nanosleep(200);
        if (kx_globaltimer_ns() - t0 > KX_HOST_GATE_TIMEOUT_NS) {
            __trap();
        }
    }
    // the host wrote its result before the word (x86 stores are ordered): the copy engine
    // reads it after this kernel ends, in stream order
    __threadfence_system();
}

void ggml_cuda_kx_host_gate(ggml_backend_t backend, const volatile uint32_t * word, uint32_t seq) {
    auto * ctx = (ggml_backend_cuda_context *) backend->context;
    ggml_cuda_set_device(ctx->device);
    // word is page-locked (the device's host buffer type): mapped into the device's address space
    void * dword = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(&dword, (void *) word, 0));
    kx_host_gate_kernel<<<1, 1, 0, ctx->stream()>>>((const volatile uint32_t *) dword, seq);
    CUDA_CHECK(cudaGetLastError());
}
