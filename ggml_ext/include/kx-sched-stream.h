// Streamed weights: host-resident weights a device multiplies from a scratch buffer that a
// copy engine fills ahead of their use (llama/kx-stream.cpp), so PCIe reads weights beside
// the CPU's own reads. The patched scheduler (patches/0018) calls these around its work and
// changes nothing else.
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kx_sched_stream {
    void * user;
    // before the scheduler splits `graph`: the streamed weights point at the scratch (the
    // device runs their ops) or at their host copy (the stock choice: the CPU, or the prompt
    // batches the device offloads by copying), as this graph is better served
    void (*graph)(void * user, struct ggml_cgraph * graph);
    // before a device backend queues g (a split or a view of one): its stream waits for the
    // copies of the streamed weights g reads; after it queued g: their slots are freed
    // behind g and the next copies queued
    void (*before)(void * user, ggml_backend_t backend, struct ggml_cgraph * g);
    void (*after)(void * user, ggml_backend_t backend, struct ggml_cgraph * g);
};

// s (NULL: none) must stay valid while sched computes
GGML_API void kx_sched_set_stream(ggml_backend_sched_t sched, const struct kx_sched_stream * s);

#ifdef __cplusplus
}
#endif
