// Device timers: events with timing recorded on a backend's stream and read back once they
// completed, so the host learns how long a device spent on a span of its work (a streamed
// tensor's copy, a split) without waiting for it. Runtime migration's re-estimate of the
// PCIe and GPU rates reads them (llama/kx-stream.cpp). A device registry hands the table out
// as "kx_timer_iface" (CUDA: cuda/kx-timer.cu, patches/0006).
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kx_timer_iface {
    // a timed event on backend's device; NULL on failure
    void * (*make)(ggml_backend_t backend);
    void   (*free)(void * ev);
    // the event completes when backend's stream reaches it (behind the work queued before)
    void   (*record)(void * ev, ggml_backend_t backend);
    // seconds from a to b once both completed; < 0 while either has not (never blocks)
    double (*elapsed)(void * a, void * b);
};

#ifdef __cplusplus
}
#endif
