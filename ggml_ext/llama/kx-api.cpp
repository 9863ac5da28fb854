// The kairox C API (include/kairox.h) on top of libllama's internals.
#include "kairox.h"
#include "kx-hybrid.h"
#include "kx-pays.h"
#include "kx-context.h"
#include "kx-stats.h"
#include "kx-stream.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

int32_t kx_model_load_pack(llama_model * model, const char * model_path, const char * pack_path,
                           char * err, size_t err_size) {
    if (!model || !model_path || !pack_path) {
        kx_set_err(err, err_size, "kx_model_load_pack: model, model_path and pack_path are required");
        return 1;
    }
    if (model->kx_hybrid_ptr) {
        // contexts may still point at it: keep it alive as long as the model
        model->kx_hybrid_retired.push_back(model->kx_hybrid_ptr);
        model->kx_hybrid_ptr.reset();
    }
    try {
        std::shared_ptr<kx_pack> pack = kx_pack_load(*model, model_path, pack_path);
        // the load's measured choice (kx-pays.h) when it made one for this model and pack: the
        // layers it chose hold their FFN weights unrepacked
        const std::vector<bool> chosen = kx_pays_recall(model_path, pack_path);
        for (size_t il = 0; chosen.size() == pack->layers.size() && il < chosen.size(); ++il) {
            pack->layers[il].pays = chosen[il];
        }
        model->kx_hybrid_ptr = std::make_shared<kx_hybrid>(std::move(pack));
    } catch (const std::exception & e) {
        kx_set_err(err, err_size, e.what()); // the caller reports it (once)
        return 1;
    }
    const kx_pack & pack = *model->kx_hybrid_ptr->pack;
    LLAMA_LOG_INFO("kairox: loaded sparse pack %s (%lld layers, %s, %s)\n", pack_path, (long long) pack.n_layer,
                   pack.activation.c_str(), pack.has_predictor ? "with predictor" : "no predictor");
    kx_set_err(err, err_size, "");
    return 0;
}

bool kx_model_has_pack(const llama_model * model) {
    return kx_model_pack(model) != nullptr;
}

bool kx_model_pack_has_predictor(const llama_model * model) {
    const kx_pack * pack = kx_model_pack(model);
    return pack && pack->has_predictor;
}

const char * kx_model_pack_activation(const llama_model * model) {
    const kx_pack * pack = kx_model_pack(model);
    return pack ? pack->activation.c_str() : nullptr;
}

int32_t kx_model_set_slots(llama_model * model, const int64_t * n_slots, int32_t n_layer, const char * device,
                           char * err, size_t err_size) {
    return kx_model_set_slots_faults(model, n_slots, n_layer, device, 0, err, err_size);
}

int32_t kx_model_set_slots_faults(llama_model * model, const int64_t * n_slots, int32_t n_layer, const char * device,
                                  int32_t faults, char * err, size_t err_size) {
    kx_hybrid * h = kx_model_hybrid(model);
    if (!h) {
        kx_set_err(err, err_size, "neuron slots need a sparse pack, and none is loaded for this model");
        return 1;
    }
    if (n_layer < 0 || (n_layer > 0 && !n_slots)) {
        kx_set_err(err, err_size, "kx_model_set_slots: n_slots must hold n_layer values");
        return 1;
    }
    try {
        kx_hybrid_set_slots(*h, *model, std::vector<int64_t>(n_slots, n_slots + n_layer), device, faults);
    } catch (const std::exception & e) {
        kx_set_err(err, err_size, e.what()); // the caller reports it (once)
        return 1;
    }
    if (h->slots) {
        int64_t total = 0;
        for (const auto & L : h->slots->layers) {
            total += L.n_slots;
        }
        LLAMA_LOG_INFO("kairox: %lld neuron slots on %s (%.1f MiB)\n", (long long) total,
                       h->slots->device.c_str(), h->slots->bytes_dev/1048576.0);
    }
    kx_set_err(err, err_size, "");
    return 0;
}

const char * kx_model_slots_device(const llama_model * model) {
    const kx_slots * slots = kx_model_slots(model);
    return slots ? slots->device.c_str() : nullptr;
}

int64_t kx_model_slots_bytes(const llama_model * model) {
    const kx_slots * slots = kx_model_slots(model);
    return slots ? (int64_t) slots->bytes_dev : 0;
}

int64_t kx_model_slots_resident(const llama_model * model, int32_t il, int32_t * dst, int64_t capacity) {
    if (!model || il < 0 || (int64_t) il >= (int64_t) model->hparams.n_layer()) {
        return -1;
    }
    const kx_slots * slots = kx_model_slots(model);
    if (!slots) {
        return 0;
    }
    int64_t n = 0; // slots given up and not refilled (-1) are not listed
    for (int32_t i : slots->layers[il].resident) {
        if (i >= 0) {
            if (dst && n < capacity) {
                dst[n] = i;
            }
            ++n;
        }
    }
    return n;
}

int32_t kx_model_slots_swap(llama_model * model, int32_t il, const int32_t * evict, int32_t n_evict,
                            const int32_t * admit, int32_t n_admit, char * err, size_t err_size) {
    kx_slots * slots = kx_model_slots(model);
    if (!slots) {
        kx_set_err(err, err_size, "this model has no neuron slots");
        return 1;
    }
    try {
        kx_slots_swap(*slots, *model, *kx_model_pack(model), il, evict, n_evict, admit, n_admit);
    } catch (const std::exception & e) {
        kx_set_err(err, err_size, e.what());
        return 1;
    }
    kx_set_err(err, err_size, "");
    return 0;
}

// runs f, turning an exception into err and a nonzero return (the C API's boundary)
template <typename F>
static int32_t kx_guard(char * err, size_t err_size, F && f) {
    try {
        f();
    } catch (const std::exception & e) {
        kx_set_err(err, err_size, e.what());
        return 1;
    }
    kx_set_err(err, err_size, "");
    return 0;
}

int32_t kx_model_balancer_start(llama_model * model, const kx_balance_params * params, char * err, size_t err_size) {
    kx_hybrid * h = kx_model_hybrid(model);
    if (!h || !h->slots) {
        kx_set_err(err, err_size, "the balancer needs neuron slots, and this model has none");
        return 1;
    }
    return kx_guard(err, err_size, [&] { kx_hybrid_set_balancer(*h, *model, params); });
}

int32_t kx_context_set_mapped_share(llama_context * ctx, float share, char * err, size_t err_size) {
    if (!ctx) {
        kx_set_err(err, err_size, "kx_context_set_mapped_share: no context");
        return 1;
    }
    const llama_model & model = ctx->get_model();
    kx_hybrid * h = kx_model_hybrid(&model);
    if (!h || !h->slots) {
        kx_set_err(err, err_size, "a mapped share needs neuron slots, and this model has none");
        return 1;
    }
    ctx->synchronize(); // no graph reads the maps while they change
    const int32_t rc = kx_guard(err, err_size, [&] { kx_hybrid_set_mapped_share(*h, model, share); });
    kx_context_refresh_sparse(ctx);
    return rc;
}

int64_t kx_model_slots_mapped(const llama_model * model, int32_t il) {
    if (!model || il < 0 || (int64_t) il >= (int64_t) model->hparams.n_layer()) {
        return -1;
    }
    const kx_slots * slots = kx_model_slots(model);
    return slots ? slots->layers[il].n_mapped : 0;
}

kx_balancer * kx_model_balancer(const llama_model * model) {
    const kx_hybrid * h = kx_model_hybrid(model);
    return h ? h->balancer.get() : nullptr;
}

// The back-off (kx-backoff.h): the decode that just finished ran with the balancer held or not,
// and its time (the context's eval counters; plus the last boundary's own step when it ran)
// decides the next one. Holding puts the static split back (kx_balance_home): a balancer that
// lost would otherwise leave the held tokens the placement its last probe made, measured
// worse than the static one (docs/ARCHITECTURE.md); resuming starts from it. Either way the
// graphs change with the pipeline's nodes.
static void kx_balance_backoff(llama_context * ctx, kx_hybrid & h, kx_balancer & b, const llama_model & model) {
    if (b.params.backoff.window <= 0 || b.params.observe) {
        return;
    }
    double s = 0.0;
    const bool sample = kx_eval_clock_tick(b.bo_clock, ctx, &s);
    s += b.held ? 0.0 : b.bo_step_s;
    // held, the decode's lists tell how well the static split covers the text (the drift gate)
    const double hit = sample && b.held && kx_backoff_wants_hit(b.backoff) ? kx_balance_held_hits(b, *h.slots) : -1.0;
    if (!sample) {
        return;
    }
    const bool on = kx_backoff_step(b.backoff, s, hit);
    if (b.bo_trace.size() == 65536) {
        b.bo_trace.erase(b.bo_trace.begin(), b.bo_trace.begin() + 32768); // the newest half stays
    }
    b.bo_trace.push_back({ s, hit, (uint8_t) on });
    if (on == !b.held) {
        return;
    }
    if (!b.held) {
        kx_balance_home(b, *h.slots, model, *h.pack);
    } else {
        kx_balance_land(b, *h.slots, model, *h.pack, true); // the resumed balancer starts from the whole static split
    }
    b.held = !b.held;
    if (b.params.pipeline) {
        ++h.graph_gen;
    }
}

int32_t kx_context_balance(llama_context * ctx, char * err, size_t err_size) {
    if (!ctx) {
        kx_set_err(err, err_size, "kx_context_balance: no context");
        return 1;
    }
    const llama_model & model = ctx->get_model();
    kx_balancer * b = kx_model_balancer(&model);
    if (!b) {
        return 0;
    }
    auto lap = std::chrono::steady_clock::now();
    ctx->synchronize(); // the decode's graph has finished reading the maps and slots
    const int64_t sync_ns = kx_lap_ns(lap);
    kx_hybrid & h = *kx_model_hybrid(&model);
    int32_t rc = kx_guard(err, err_size, [&] { kx_balance_backoff(ctx, h, *b, model); });
    kx_context_refresh_sparse(ctx); // (after the back-off: a change of the pipeline's nodes)
    if (rc == 0 && !b->held) {
        auto t = std::chrono::steady_clock::now();
        rc = kx_guard(err, err_size, [&] { kx_balance_step(*b, *h.slots, model, *h.pack); });
        b->bo_step_s = 1e-9 * (double) kx_lap_ns(t);
    } else if (rc == 0) {
        rc = kx_guard(err, err_size, [&] { kx_balance_land(*b, *h.slots, model, *h.pack, false); });
        kx_balance_stat_add(KX_BAL_HELD, 1);
    }
    kx_balance_stat_add(KX_BAL_STEPS, 1);
    kx_balance_stat_add(KX_BAL_SYNC_NS, sync_ns);
    kx_balance_stat_add(KX_BAL_NS, sync_ns + kx_lap_ns(lap));
    return rc;
}

int32_t kx_model_balance_drain(llama_model * model, char * err, size_t err_size) {
    kx_balancer * b = kx_model_balancer(model);
    if (!b) {
        kx_set_err(err, err_size, "this model has no balancer");
        return 1;
    }
    const kx_hybrid & h = *kx_model_hybrid(model);
    return kx_guard(err, err_size, [&] { kx_balance_drain(*b, *h.slots, *model, *h.pack); });
}

int64_t kx_model_balance_trace(llama_model * model, kx_balance_record * dst, int64_t capacity) {
    kx_balancer * b = kx_model_balancer(model);
    if (!b) {
        return 0;
    }
    kx_balance_settle(*b);
    const int64_t n = (int64_t) b->trace.kept.size();
    if (dst) {
        std::copy(b->trace.kept.begin(), b->trace.kept.begin() + std::min(n, capacity), dst);
    }
    return n;
}

int64_t kx_model_backoff_trace(llama_model * model, double * seconds, double * hits, uint8_t * on, int64_t capacity) {
    const kx_balancer * b = kx_model_balancer(model);
    if (!b) {
        return 0;
    }
    const int64_t n = (int64_t) b->bo_trace.size();
    for (int64_t i = 0; i < std::min(n, capacity); ++i) {
        const kx_backoff_sample & x = b->bo_trace[(size_t) i];
        seconds[i] = x.seconds;
        hits[i]    = x.hit;
        on[i]      = x.on;
    }
    return n;
}

int64_t kx_model_balance_activity(llama_model * model, int64_t step, int32_t il, int32_t * dst, int64_t capacity) {
    kx_balancer * b = kx_model_balancer(model);
    if (!b || step < 0 || !b->params.record) {
        return -1;
    }
    const std::vector<int32_t> * found = nullptr;
    if (b->params.pipeline) {
        // one list per record that decided: the newest of (step, il)
        for (size_t k = 0; k < b->activity.size(); ++k) {
            const kx_balance_record & r = b->trace[k];
            if (r.step == step && r.layer == il && r.decided) {
                found = &b->activity[k];
            }
        }
    } else if (step < b->step) {
        for (size_t l = 0; l < b->layers.size(); ++l) {
            if (b->layers[l].il == il) {
                found = &b->activity[(size_t) step * b->layers.size() + l];
            }
        }
    }
    if (!found) {
        return -1;
    }
    if (dst) {
        std::copy(found->begin(), found->begin() + std::min<int64_t>((int64_t) found->size(), capacity), dst);
    }
    return (int64_t) found->size();
}

// ---------------------------------------------------------------- load-aware thresholds (kx-thresholds.h)

int32_t kx_context_set_error_budget(llama_context * ctx, float budget, char * err, size_t err_size) {
    if (!ctx) {
        kx_set_err(err, err_size, "kx_context_set_error_budget: no context");
        return 1;
    }
    if (std::isnan(budget) || !std::isfinite(budget)) {
        kx_set_err(err, err_size, kx_fmt("the error budget must be a number (< 0: off), not %g", (double) budget));
        return 1;
    }
    if (budget < 0) {
        budget = -1.0f;
    }
    kx_hybrid * h = kx_model_hybrid(&ctx->get_model());
    const kx_slots * slots = h ? h->slots.get() : nullptr;
    if (budget >= 0 && !slots) {
        kx_set_err(err, err_size, "load-aware thresholds split the hybrid FFN: give GPU slots, a VRAM budget or a plan");
        return 1;
    }
    if (budget >= 0 && ctx->kx_get_sparse() != KX_SPARSE_PREDICTED) {
        kx_set_err(err, err_size, "load-aware thresholds move the predictor's thresholds: they need the predicted "
                                  "sparse mode (exact mode stays exact)");
        return 1;
    }
    if (!slots) {
        kx_set_err(err, err_size, "");
        return 0;
    }
    ctx->synchronize(); // no graph reads the offsets while they change
    const int32_t rc = kx_guard(err, err_size, [&] { kx_hybrid_set_thresholds(*h, budget); });
    kx_context_refresh_sparse(ctx);
    return rc;
}

int32_t kx_model_thresholds(const llama_model * model, int32_t il, kx_thr_info * out) {
    const kx_hybrid * h = kx_model_hybrid(model);
    if (!h || !h->thr || !out || il < 0 || il >= h->pack->n_layer || h->slots->layers[il].n_slots <= 0) {
        return 1;
    }
    const kx_pack * pack = h->pack.get();
    const kx_thresholds & t = *h->thr;
    const kx_thr_layer & T = t.layers[il];
    const kx_pack_layer & pl = pack->layers[il];
    const int K0 = KX_THR_K0;
    const double e0 = T.sums.e_gpu[K0] + T.sums.e_cpu[K0];
    out->theta_g = pl.thr_grid[T.kg];
    out->theta_c = pl.thr_grid[T.kc];
    out->kg = T.kg;
    out->kc = T.kc;
    out->err_added = pl.thr_norm > 0 ? (float) ((T.sums.e_gpu[T.kg] + T.sums.e_cpu[T.kc] - e0) / pl.thr_norm) : 0.0f;
    out->n_gpu = (float) T.sums.n_gpu[T.kg];
    out->n_cpu = (float) T.sums.n_cpu[T.kc];
    out->n_cpu_static = (float) T.sums.n_cpu[K0];
    out->t_cpu_ns = (float) t.t_cpu_ns;
    out->o_cpu_ns = (float) t.o_cpu_ns;
    out->solves = (int32_t) t.solves;
    return 0;
}

const char * kx_model_tensor_buffer_type(const llama_model * model, const char * name) {
    const ggml_tensor * t = model && name ? model->get_tensor(name) : nullptr;
    ggml_backend_buffer_t home = t ? kx_stream_home(t) : nullptr; // (a streamed one: its host copy)
    ggml_backend_buffer_t b = home ? home : t ? t->buffer : nullptr;
    return b ? ggml_backend_buft_name(ggml_backend_buffer_get_type(b)) : nullptr;
}

int32_t kx_context_stream_stats(const llama_context * ctx, int64_t * out) {
    const kx_ctx_state * st = ctx ? kx_ctx_state_find(ctx) : nullptr;
    if (!out) {
        return -1;
    }
    const kx_stream * s = st ? st->stream.get() : nullptr;
    out[0] = s ? s->n_on() : 0;
    out[1] = s ? s->slot_bytes * s->n_slots : 0;
    out[2] = s ? s->n_copies : 0;
    out[3] = s ? s->copy_bytes : 0;
    out[4] = s ? (int64_t) s->items.size() : 0;
    out[5] = s ? s->n_migrations : 0;
    out[6] = s ? s->n_steps : 0;
    out[7] = s ? s->mig.n_moved : 0;
    return s ? 1 : 0;
}

int32_t kx_sparse_mode_from_str(const char * s) {
    if (!s) {
        return -1;
    }
    if (!std::strcmp(s, "dense"))     { return KX_SPARSE_DENSE; }
    if (!std::strcmp(s, "exact"))     { return KX_SPARSE_EXACT; }
    if (!std::strcmp(s, "predicted")) { return KX_SPARSE_PREDICTED; }
    if (!std::strcmp(s, "threshold")) { return KX_SPARSE_THRESHOLD; }
    return -1;
}

int32_t kx_context_set_sparse(llama_context * ctx, int32_t mode, char * err, size_t err_size) {
    if (!ctx) {
        kx_set_err(err, err_size, "kx_context_set_sparse: no context");
        return 1;
    }
    const llama_model & model = ctx->get_model();
    if (mode < KX_SPARSE_DENSE || mode > KX_SPARSE_THRESHOLD) {
        kx_set_err(err, err_size, "unknown sparse mode (0 dense, 1 exact, 2 predicted, 3 threshold)");
        return 1;
    }
    const kx_pack * pack = kx_model_pack(&model);
    if (mode != KX_SPARSE_DENSE && !pack) {
        kx_set_err(err, err_size, "sparse mode needs a sparse pack, and none is loaded for this model");
        return 1;
    }
    if (mode == KX_SPARSE_PREDICTED && !pack->has_predictor) {
        kx_set_err(err, err_size, "the sparse pack " + pack->path +
                   " has no predictor (make one with `kairox pack`); use exact mode");
        return 1;
    }
    ctx->kx_set_sparse(mode, mode == KX_SPARSE_DENSE ? nullptr : kx_model_hybrid(&model));
    kx_set_err(err, err_size, "");
    return 0;
}

int32_t kx_context_get_sparse(const llama_context * ctx) {
    return ctx ? ctx->kx_get_sparse() : KX_SPARSE_DENSE;
}

void llama_context::kx_set_sparse(int32_t mode, const kx_hybrid * hybrid) {
    // graph reuse compares these fields (llm_graph_params::allow_reuse), so the next decode
    // rebuilds its graph for the new mode
    cparams.kx_sparse_mode   = mode;
    cparams.kx_sparse_hybrid = hybrid;
    cparams.kx_graph_gen     = hybrid ? hybrid->graph_gen : 0;
}

void kx_context_refresh_sparse(llama_context * ctx) {
    if (ctx->kx_get_sparse() != KX_SPARSE_DENSE) {
        ctx->kx_set_sparse(ctx->kx_get_sparse(), kx_model_hybrid(&ctx->get_model())); // the hybrid's graph_gen
    }
}

int32_t llama_context::kx_get_sparse() const {
    return cparams.kx_sparse_mode;
}

int32_t kx_model_sparse_layers(const llama_model * model) {
    const kx_pack * pack = model ? kx_model_pack(model) : nullptr;
    if (!pack) {
        return 0;
    }
    int32_t n = 0;
    for (const kx_pack_layer & L : pack->layers) {
        n += L.pays;
    }
    return n;
}
