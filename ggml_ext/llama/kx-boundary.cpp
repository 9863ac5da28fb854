// The runtime's per-token boundary: libllama itself runs the balancer's step after every
// decode (patch 0013 calls kx_context_after_decode from llama_decode and llama_process), so
// every client of libllama (the common tools, llama-server, llama-cpp-python's own Llama) gets
// the live balancer without running code of its own between tokens. The trace of balancer
// records is appended here as the run goes, and finished when the context is freed.
#include "kx-context.h"
#include "kx-hybrid.h"
#include "kx-threads.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <mutex>
#include <unordered_map>

static std::mutex kx_ctx_mu;
static std::unordered_map<const llama_context *, kx_ctx_state> kx_ctx_table;

kx_ctx_state & kx_ctx_state_of(const llama_context * ctx) {
    std::lock_guard<std::mutex> lk(kx_ctx_mu);
    return kx_ctx_table[ctx]; // references stay valid: unordered_map never moves its nodes
}

kx_ctx_state * kx_ctx_state_find(const llama_context * ctx) {
    std::lock_guard<std::mutex> lk(kx_ctx_mu);
    auto it = kx_ctx_table.find(ctx);
    return it == kx_ctx_table.end() ? nullptr : &it->second;
}

static kx_balancer * kx_ctx_balancer(const llama_context * ctx) {
    return kx_model_balancer(&ctx->get_model());
}

static const char * kx_stall_name(int32_t s) {
    switch (s) {
        case KX_TAM_STALL_IO:  return "io";
        case KX_TAM_STALL_CPU: return "cpu";
        default:               return "none";
    }
}

// one record as `kairox report` reads it (python/kairox/report.py: the struct's fields, stall by name)
static void kx_trace_write(FILE * f, const kx_balance_record & r) {
    std::fprintf(f, "{\"step\": %d, \"layer\": %d, \"n_active\": %d, \"n_hit\": %d, \"n_load\": %d, \"n_evict\": %d, "
                 "\"stall\": \"%s\", \"lam\": %.9g, \"wait_us\": %.9g, \"decide_us\": %.9g, \"reload_bytes\": %lld, "
                 "\"late\": %d, \"decided\": %d, \"hold_us\": %.9g}\n",
                 r.step, r.layer, r.n_active, r.n_hit, r.n_load, r.n_evict, kx_stall_name(r.stall), (double) r.lam,
                 (double) r.wait_us, (double) r.decide_us, (long long) r.reload_bytes, r.late, r.decided,
                 (double) r.hold_us);
}

// records [written, upto) of b's trace to the context's file
static void kx_trace_write_upto(kx_ctx_state & st, const kx_balancer & b, size_t upto) {
    if (!st.trace) {
        return;
    }
    upto = std::min(upto, b.trace.size());
    st.written = std::max(st.written, b.trace.first()); // what the log let go before a file was set
    for (; st.written < upto; ++st.written) {
        kx_trace_write(st.trace, b.trace[st.written]);
    }
    std::fflush(st.trace); // a server stopped by a signal keeps what it wrote
}

void kx_context_trace_flush(llama_context * ctx, bool all) {
    kx_ctx_state * st = kx_ctx_state_find(ctx);
    kx_balancer * b = kx_ctx_balancer(ctx);
    if (!st || !st->trace || !b) {
        return;
    }
    if (all) {
        kx_balance_settle(*b);
    }
    kx_trace_write_upto(*st, *b, b->trace.size());
}

// the load-aware thresholds' turn (kx-thresholds.h): a solve every few decodes
static void kx_context_thresholds(llama_context * ctx) {
    kx_hybrid * h = kx_model_hybrid(&ctx->get_model());
    if (!h || !h->thr || ctx->kx_get_sparse() != KX_SPARSE_PREDICTED || !kx_thresholds_tick(*h->thr)) {
        return;
    }
    ctx->synchronize(); // no graph reads the offsets while they change
    kx_thresholds_solve_all(*h->thr, *h->slots, *h->pack, h->balancer != nullptr);
}

// the decode threads' turn (kx-threads.h): the decode that just finished, timed by the
// context's eval counters (single-token decodes only), sets the next one's thread count
static void kx_context_threads(llama_context * ctx) {
    kx_ctx_state * st = kx_ctx_state_find(ctx);
    if (!st || !st->threads) {
        return;
    }
    ctx->synchronize(); // a decode is counted once it has finished
    double s = 0.0;
    if (!kx_eval_clock_tick(st->th_clock, ctx, &s)) {
        return;
    }
    kx_threads & t = *st->threads;
    const int32_t cur = (int32_t) ctx->n_threads();
    if (cur != t.n && cur != t.n_max) {
        // the client set another count (llama-bench sets its row's before each run): the
        // most a probe tries from now on
        kx_threads_init(t, cur, t.cfg);
    }
    const int32_t n = kx_threads_step(t, s);
    if (n != cur) {
        ctx->set_n_threads(n, ctx->n_threads_batch()); // prompt batches keep theirs
    }
}

int32_t kx_context_after_decode(llama_context * ctx, int32_t ret) {
    if (ret != 0 || !ctx) {
        return ret;
    }
    kx_context_threads(ctx);
    kx_context_thresholds(ctx);
    kx_balancer * b = kx_ctx_balancer(ctx);
    if (!b) {
        return 0;
    }
    // records made before this boundary are complete once its step has waited for their
    // decision (kx_balance_step); the step's own fill in later
    const size_t done = b->trace.size();
    char err[512];
    if (kx_context_balance(ctx, err, sizeof(err)) != 0) {
        // the decode's outputs are right whatever the balancer did: a neuron enters the slot
        // map only after its rows landed. Its moves stop; the split stays as it is.
        LLAMA_LOG_ERROR("kairox: the balancer failed and stops (the FFN split stays as it is): %s\n", err);
        kx_context_trace_flush(ctx, false);
        kx_model_balancer_start(const_cast<llama_model *>(&ctx->get_model()), nullptr, err, sizeof(err));
        return 0;
    }
    if (kx_ctx_state * st = kx_ctx_state_find(ctx)) {
        kx_trace_write_upto(*st, *b, done);
    }
    return 0;
}

void kx_context_on_free(llama_context * ctx) {
    if (!kx_ctx_state_find(ctx)) {
        return;
    }
    kx_context_trace_flush(ctx, true);
    std::lock_guard<std::mutex> lk(kx_ctx_mu);
    auto it = kx_ctx_table.find(ctx);
    if (it->second.trace) {
        std::fclose(it->second.trace);
    }
    kx_ctx_table.erase(it);
}
