// What kairox keeps per llama_context beside libllama's own state: the budget's readings and
// the balancer trace being written (kx-params.cpp sets them up, kx-boundary.cpp runs them).
// Kept in a table of ours, so llama_context's layout does not change.
#pragma once

#include "kairox.h"
#include "kx-eval-clock.h"

#include <cstdio>
#include <memory>
#include <string>

struct kx_stream;
struct kx_threads;

struct kx_ctx_state {
    bool           has_vram = false;
    kx_vram_report vram     = {};
    std::string    trace_path;
    FILE *         trace    = nullptr;
    size_t         written  = 0;     // balancer records written so far
    std::shared_ptr<kx_stream> stream; // streamed weights (kx-stream.h); null: none
    std::shared_ptr<kx_threads> threads; // load-aware decode threads (kx-threads.h); null: off
    kx_eval_clock  th_clock;           // the eval counters at the last boundary
};

// the context's state, made on first use
kx_ctx_state & kx_ctx_state_of(const llama_context * ctx);
// nullptr when the context has none
kx_ctx_state * kx_ctx_state_find(const llama_context * ctx);

// The runtime's boundary (patch 0013 calls these from llama_decode, llama_process and
// llama_free): after a successful decode, the balancer's step and the trace's new records;
// at free, the rest of the trace.
int32_t kx_context_after_decode(llama_context * ctx, int32_t ret);
void    kx_context_on_free(llama_context * ctx);
// writes the balancer records of ctx's model that are complete; all of them (waiting for a
// running decision) when `all`
void    kx_context_trace_flush(llama_context * ctx, bool all);
