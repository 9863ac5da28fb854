// kairox scheduler trace: when each backend ran which part of a graph.
//
// kx_trace_start(FILE, MAX) turns it on (kx_params.sched_trace: --kx-sched-trace FILE in the
// tools, sched_trace= in kairox.Llama). Every split the scheduler computes becomes one interval, in
// ggml_time_us() (CLOCK_MONOTONIC, µs) on one clock for all backends:
//  - CPU splits: host time around the (synchronous) compute;
//  - GPU splits: stamps of the device's stream itself, when it reaches the start and the end
//    of the split's kernels (events recorded on the stream, their times resolved later on the
//    device's clock; "kx_backend_trace_mark" from the backend's registry), so a trace shows
//    when the GPU really worked, not when work was queued;
//  - input hand-offs: host time the scheduler spent copying a split's inputs (this includes
//    waiting for the producer);
//  - slot reloads: when the balancer's reload engine ran each batch (stamped by its stream),
//    so a hand-off or a split can be seen beside the reloads running at the same time.
// Records go to a fixed array (MAX, default 131072) and are written as JSON lines
// at exit or by kx_trace_dump(). Off by default: each GPU stamp costs the host ~1-2 µs.
#pragma once

#include "ggml-backend.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kx_trace_part {
    KX_TRACE_WHOLE = 'w', // a split computed in one piece
    KX_TRACE_HEAD  = 'h', // leading nodes queued early, beside the previous CPU split (0010)
    KX_TRACE_TAIL  = 't', // the rest of a split whose head ran early
    KX_TRACE_INPUT = 'i', // copying a split's inputs to its backend (host time)
    KX_TRACE_RELOAD = 'r', // a batch of slot reloads, as the reload engine ran it (backend "reload")
};

struct kx_trace_rec {
    int64_t t0, t1;      // µs, ggml_time_us(); 0 until stamped
    int32_t graph;       // graph computation number (one per llama_decode of one ubatch)
    int32_t split;       // split index in that graph
    int32_t n_nodes;
    char    part;        // enum kx_trace_part
    char    backend[11];
    char    first[GGML_MAX_NAME]; // name of the first and last node (layer ids are in the names)
    char    last[GGML_MAX_NAME];
    int64_t bytes;       // reloads: the bytes the batch moves (0 for splits)
};

// where a GPU backend stamps the time when its stream reaches this point
typedef void (*kx_backend_trace_mark_t)(ggml_backend_t backend, int64_t * t_us);

// Starts recording for the rest of the process, written to path at exit. max_records <= 0:
// 131072. 0 on success or when already recording to the same path; 1 when recording to
// another path already, or the array cannot be allocated.
GGML_API int32_t               kx_trace_start(const char * path, int64_t max_records);
GGML_API bool                  kx_trace_enabled(void);
// start the next graph's records (the scheduler calls it once per graph)
GGML_API void                  kx_trace_next_graph(void);
// a new record, or NULL when the trace is off or full (counted in the file's last line)
GGML_API struct kx_trace_rec * kx_trace_add(int32_t split, const char * backend, enum kx_trace_part part,
                                            const struct ggml_cgraph * g);
// a record of one batch of slot reloads (part 'r', backend "reload", split -1): n_nodes holds
// its copies, bytes their size; named "reload-IL" for model layer il, "reload" (il < 0) for a
// batch of several layers. The engine stamps t0 and t1 (kx_reload_iface.mark). NULL when off or full.
GGML_API struct kx_trace_rec * kx_trace_add_reload(int32_t il, int64_t n_copies, int64_t bytes);
// write all records so far as JSON lines (the stamps are resolved first: see below);
// returns the number written, -1 when the file cannot be written
GGML_API int64_t               kx_trace_dump(const char * path);
// what kx_trace_dump calls first: a device backend whose stamps are resolved after the fact
// (their events waited for) registers it at its first stamp; the last one registered wins
GGML_API void                  kx_trace_set_flush(void (*flush)(void));

// Scheduler counters (always on, host clock, ns summed since the last reset; not counted for
// splits a traced run records): where the host spends a graph's computation.
enum kx_sched_stat {
    KX_SCHED_GRAPHS,     // graph computations (ggml_backend_sched_graph_compute calls)
    KX_SCHED_SPLITS_NS,  // in the split loop, first split's inputs to last split queued
    KX_SCHED_CPU_SPLITS, // CPU split computations
    KX_SCHED_CPU_NS,     // computing them (synchronous: thread start and join included)
    KX_SCHED_LAUNCHES,   // device split (or head/tail view) computations queued
    KX_SCHED_LAUNCH_NS,  // queueing them (a device computes asynchronously)
    KX_SCHED_COPY_NS,    // issuing split input copies (stock copies wait inside)
    KX_SCHED_DRAIN_NS,   // CPU splits waiting for the device's read-backs: the device still
                         // computing what the CPU split needs (deferred waits included)
    KX_SCHED_DEFERRED,   // CPU splits whose first node waited instead (below)
    KX_SCHED_N_STATS,
};
// out: KX_SCHED_N_STATS values (may be NULL, to reset only)
GGML_API void                  kx_sched_stats(int64_t * out, bool reset);

// Deferred device wait. A CPU split that reads device results normally starts when they have
// landed. When its first node is a custom op named "kx_warm..." (kx-warm.cpp), the split
// starts at once and that node waits instead: its thread 0 calls kx_sched_drain_pending,
// and its other threads use the wait (warming the caches with rows the split will read) until
// kx_sched_drain_done. Nothing in such a node may read the split's inputs. Outside a deferred
// split all three report "nothing pending".
// the device is still computing what the split waits for (a cheap query; polled by thread 0)
GGML_API bool                  kx_sched_drain_busy(void);
// wait for it (thread 0 of the first node; idempotent)
GGML_API void                  kx_sched_drain_pending(void);
// the wait is over, or there is none (any thread)
GGML_API bool                  kx_sched_drain_done(void);
// what a device registry returns as "kx_event_busy": true while the event has not completed
typedef bool (*kx_event_busy_t)(ggml_backend_event_t event);

#ifdef __cplusplus
}
#endif
