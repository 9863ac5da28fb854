// Two small helpers the scheduler (patches 0008 and 0012) gets from the CUDA registry.
//
// The CUDA backend's stamp for the scheduler trace (include/kx-trace.h): the time when a
// stream reaches a point, i.e. when the work queued before it has finished on the GPU.
// Returned by the CUDA registry as "kx_backend_trace_mark" (patches/0006); only called while
// the scheduler trace records (kx_trace_start).
//
// A stamp is an event recorded on the stream; its host time is resolved later, from the
// device's own clock: each stamp's time is the one resolved before it plus the events'
// elapsed time (cudaEventElapsedTime, ~0.5 µs resolution), and the first stamp of a device is
// anchored to ggml_time_us() once. Why events: a host function queued on the stream
// (cudaLaunchHostFunc) stalls the stream until the host has run it, and a traced decode ran
// about twice as slowly as an untraced one (KB-7B Q4_K_M at 3 GiB, H100: ~300 against ~145 µs
// a layer), so the trace did not show the untraced run's critical path. An event costs the
// stream nothing; its record costs the host ~1-2 µs.
#include "kx-ops-cuda.cuh"
#include "kx-trace.h"
#include "ggml-backend-impl.h"

#include <cmath>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <vector>

namespace {

struct kx_stamp {
    cudaEvent_t ev;
    int64_t *   t_us;
};

// one device's stamps: recorded ones in record order (resolved from the front), and the
// reference (the last resolved stamp's event and host time)
struct kx_stamp_chain {
    std::deque<kx_stamp>     pending;
    std::vector<cudaEvent_t> spare;
    cudaEvent_t              ref     = nullptr;
    double                   ref_us  = 0.0;
    int64_t                  ref_win = 0; // the anchor's window (µs)
};

// pending stamps past this stop being recorded (their records stay unstamped, t = 0): the
// trace's own array holds 131072 records by default, two stamps each at most
constexpr size_t KX_STAMP_MAX_PENDING = 1 << 18;

std::mutex     kx_stamp_mu;
kx_stamp_chain kx_stamp_dev[GGML_CUDA_MAX_DEVICES];

cudaEvent_t kx_stamp_event(kx_stamp_chain & c) {
    if (!c.spare.empty()) {
        cudaEvent_t ev = c.spare.back();
        c.spare.pop_back();
        return ev;
    }
    cudaEvent_t ev = nullptr;
    return cudaEventCreate(&ev) == cudaSuccess ? ev : nullptr;
}

// the anchor of a device's first stamp: an event recorded on a drained stream, its host time the
// middle of record-and-wait, the narrowest of KX_STAMP_ANCHOR_TRIES (one constant offset between
// host and device records, at most half that window: a few µs)
constexpr int KX_STAMP_ANCHOR_TRIES = 3;

cudaError_t kx_stamp_anchor(kx_stamp_chain & c, cudaStream_t stream) {
    cudaError_t err = cudaStreamSynchronize(stream);
    for (int i = 0; i < KX_STAMP_ANCHOR_TRIES && err == cudaSuccess; ++i) {
        cudaEvent_t ev = kx_stamp_event(c);
        if (ev == nullptr) {
            return cudaErrorMemoryAllocation;
        }
        const int64_t t0 = ggml_time_us();
        err = cudaEventRecord(ev, stream);
        if (err == cudaSuccess) {
            err = cudaEventSynchronize(ev);
        }
        const int64_t t1 = ggml_time_us();
        if (err != cudaSuccess || (c.ref != nullptr && t1 - t0 >= c.ref_win)) {
            c.spare.push_back(ev);
            continue;
        }
        if (c.ref != nullptr) {
            c.spare.push_back(c.ref);
        }
        c.ref     = ev;
        c.ref_us  = 0.5 * (double) (t0 + t1);
        c.ref_win = t1 - t0;
    }
    return c.ref != nullptr ? cudaSuccess : err;
}

// resolves the completed stamps at the front (wait: every pending one, waiting for each)
void kx_stamp_resolve(kx_stamp_chain & c, bool wait) {
    while (!c.pending.empty()) {
        const kx_stamp s = c.pending.front();
        const cudaError_t q = wait ? cudaEventSynchronize(s.ev) : cudaEventQuery(s.ev);
        if (q == cudaErrorNotReady) {
            (void) cudaGetLastError(); // "not yet" is no error: the next CUDA_CHECK must not see it
            return;
        }
        float ms = 0.0f;
        if (q != cudaSuccess || cudaEventElapsedTime(&ms, c.ref, s.ev) != cudaSuccess) {
            (void) cudaGetLastError(); // left unstamped (0): the trace's readers skip it
            c.pending.pop_front();
            c.spare.push_back(s.ev);
            continue;
        }
        c.ref_us += 1e3 * (double) ms; // may be negative: another stream's stamp completed first
        *s.t_us = std::llround(c.ref_us);
        c.spare.push_back(c.ref);
        c.ref = s.ev;
        c.pending.pop_front();
    }
}

// kx_trace_dump's flush (kx_trace_set_flush): every stamp recorded so far resolved
void kx_stamp_flush() {
    std::lock_guard<std::mutex> lock(kx_stamp_mu);
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess) {
        (void) cudaGetLastError();
        return;
    }
    for (int d = 0; d < GGML_CUDA_MAX_DEVICES; ++d) {
        if (!kx_stamp_dev[d].pending.empty() && cudaSetDevice(d) == cudaSuccess) {
            kx_stamp_resolve(kx_stamp_dev[d], true);
        }
    }
    (void) cudaSetDevice(cur);
}

} // namespace

cudaError_t ggml_cuda_kx_stamp(cudaStream_t stream, int64_t * t_us) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) {
        return err;
    }
    std::lock_guard<std::mutex> lock(kx_stamp_mu);
    kx_stamp_chain & c = kx_stamp_dev[dev];
    if (c.ref == nullptr) {
        err = kx_stamp_anchor(c, stream);
        if (err != cudaSuccess) {
            return err;
        }
        // the trace is written at exit: resolve before then, while the CUDA runtime still runs
        // (exit handlers run in reverse order, so this one runs before the runtime's own
        // teardown, which was registered before this first stamp)
        kx_trace_set_flush(kx_stamp_flush);
        std::atexit(kx_stamp_flush);
    }
    kx_stamp_resolve(c, false);
    if (c.pending.size() >= KX_STAMP_MAX_PENDING) {
        return cudaSuccess; // unstamped: the trace's records past this many are incomplete
    }
    cudaEvent_t ev = kx_stamp_event(c);
    if (ev == nullptr) {
        return cudaErrorMemoryAllocation;
    }
    err = cudaEventRecord(ev, stream);
    if (err != cudaSuccess) {
        c.spare.push_back(ev);
        return err;
    }
    c.pending.push_back({ ev, t_us });
    return cudaSuccess;
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
