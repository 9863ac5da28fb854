// "kx_backend_hold": the scheduler's held hand-off (include/kx-trace.h, kx_sched_set_hold).
//
// The device split that reads a CPU split's results is queued before the CPU split runs,
// behind this wait: one thread polls a word of page-locked host memory until the host has
// stored the value of this hand-off, then the split's input copies and kernels follow on the
// same stream. So after its CPU part the host only stores a word, instead of issuing the copies
// and launching the split's graph there and then.
//
// Values grow by one per hand-off of a scheduler; the wait compares them as a signed difference,
// so the word may wrap. A poll is one read over PCIe (~1 µs); between polls the thread sleeps a
// little to keep that link free for the copies. The wait ends after timeout_ns in any case and
// then sets flag[1] (the scheduler fails the next graph): a host that never stores the value must
// not leave the device hung.
#include "kx-ops-cuda.cuh"
#include "ggml-backend-impl.h"

static __device__ __forceinline__ uint64_t kx_globaltimer_ns(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __global__ void kx_hold_kernel(const volatile uint32_t * flag, uint32_t value, uint64_t timeout_ns) {
    const uint64_t t0 = kx_globaltimer_ns();
    while ((int32_t) (flag[0] - value) < 0) {
        if (kx_globaltimer_ns() - t0 > timeout_ns) {
            ((volatile uint32_t *) flag)[1] = 1;
            __threadfence_system();
            return;
        }
        __nanosleep(256);
    }
}

void ggml_cuda_kx_hold(ggml_backend_t backend, const uint32_t * flag, uint32_t value, uint64_t timeout_ns) {
    auto * ctx = (ggml_backend_cuda_context *) backend->context;
    ggml_cuda_set_device(ctx->device);
    kx_hold_kernel<<<1, 1, 0, ctx->stream()>>>(flag, value, timeout_ns);
    CUDA_CHECK(cudaGetLastError());
}
