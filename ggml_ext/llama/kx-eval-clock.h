// The context's own clock for single-token decodes: llama_perf_context's eval counters (which
// llama_context::synchronize advances) time the decode that just finished, so a policy run at
// the boundary needs no timer of its own. Shared by the balancer's back-off and the decode
// threads.
#pragma once

#include "llama.h"

#include <cstdint>

struct kx_eval_clock {
    const llama_context * ctx = nullptr; // the context last read (one balancer serves every context of its model)
    int32_t n_eval = -1;
    double  t_ms   = 0.0;
};

// Reads ctx's counters (call after a synchronize). True, with *s the seconds, when exactly one
// more single-token decode finished since the last read of the same context; false after a
// prompt batch alone, a counter reset, or a read of another context.
static inline bool kx_eval_clock_tick(kx_eval_clock & c, const llama_context * ctx, double * s) {
    const llama_perf_context_data p = llama_perf_context(ctx);
    const bool one = c.ctx == ctx && p.n_eval == c.n_eval + 1 && p.t_eval_ms > c.t_ms;
    *s       = (p.t_eval_ms - c.t_ms) * 1e-3;
    c.ctx    = ctx;
    c.n_eval = p.n_eval;
    c.t_ms   = p.t_eval_ms;
    return one;
}
