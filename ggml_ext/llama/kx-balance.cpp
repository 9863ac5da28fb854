// The live neuron balancer (kx-balance.h): its start, the boundary between decodes and the
// decision worker (the pipeline's decisions within a decode: kx-pipeline.cpp).
#include "kx-balance.h"
#include "kx-pack.h"
#include "kx-reload-engine.h"
#include "kx-slots.h"
#include "kx-stats.h"

#include "ggml-backend.h"
#include "llama-model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

// ---------------------------------------------------------------- counters
static std::atomic<int64_t> kx_balance_stat[KX_BAL_N_STATS];

void kx_balance_stat_add(int32_t i, int64_t v) {
    kx_balance_stat[i].fetch_add(v, std::memory_order_relaxed);
}

void kx_balance_stats(int64_t * out, bool reset) {
    kx_stats_read(kx_balance_stat, out, reset);
}

// ---------------------------------------------------------------- decision

// the ids of the set bytes of mask [0, n), ascending, appended to out; a word at a time (the
// host decision's masks; the device decision returns id lists, kx-tam.cu). Why: the
// between-decode rows spent ~2-2.5 ns more per neuron and decode outside the split loop than
// the static split (H200: KB-7B ~26 µs per layer step, KB-70B 57-78 µs of 82-101,
// bench/results/archive/balance-live/kb70b-warm/), and a scan of a byte at a time was one branch per
// neuron (KB-70B: 28672 a layer, ~32 set)
static void kx_mask_ids(const uint8_t * mask, int64_t n, std::vector<int32_t> & out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, mask + i, sizeof(w));
        for (int64_t k = 0; w != 0 && k < 8; ++k) { // rare: ~1 word in 100 has a set byte
            if (mask[i + k]) {
                out.push_back((int32_t) (i + k));
            }
        }
    }
    for (; i < n; ++i) {
        if (mask[i]) {
            out.push_back((int32_t) i);
        }
    }
}

// one TAM step of every layer from the snapshots; fills the layers' admit/evict lists and
// the step's trace records (rec .. rec + layers)
static void kx_balance_decide(kx_balancer & b, size_t rec) {
    for (size_t l = 0; l < b.layers.size(); ++l) {
        kx_balance_layer & L = b.layers[l];
        const auto t0 = std::chrono::steady_clock::now();
        const int32_t n = (int32_t) L.score.size();
        std::fill(L.tmp.active.begin(), L.tmp.active.end(), 0);
        for (int32_t i : L.snap) {
            L.tmp.active[i] = 1;
        }
        int32_t na = 0, ne = 0;
        kx_tam_step(&b.params.tam, &L.st, L.score.data(), L.decided.data(), n, L.cap, L.tmp.active.data(), L.stall,
                    L.tmp.admit_mask.data(), L.tmp.evict_mask.data(), &na, &ne);
        L.admit.clear();
        L.evict.clear();
        kx_mask_ids(L.tmp.admit_mask.data(), n, L.admit);
        kx_mask_ids(L.tmp.evict_mask.data(), n, L.evict);
        kx_balance_record & r = b.trace[rec + l];
        r.n_load = na;
        r.n_evict = ne;
        r.lam = L.st.lam;
        r.reload_bytes = (int64_t) na * L.row_bytes;
        r.decide_us = (float) (1e6 * kx_seconds_since(t0));
    }
}


// the balancer's thread: between decodes, every layer's TAM step from a boundary's snapshots;
// with the pipeline, one layer's prefetch per job (posted by a graph node, waited for by its
// publish). Nothing else touches what a job reads or writes until it is done (busy).
static void kx_balance_worker(kx_balancer * b) {
    std::unique_lock<std::mutex> lk(b->mu);
    for (;;) {
        b->cv.wait(lk, [b] { return b->job || b->quit; });
        if (b->quit) {
            return;
        }
        b->job = false;
        const size_t rec = b->job_rec;
        lk.unlock();
        if (b->params.pipeline) {
            kx_pipe_job(*b);
        } else {
            kx_balance_decide(*b, rec);
        }
        lk.lock();
        b->busy = false;
        b->cv.notify_all();
    }
}

double kx_balance_drain_decision(kx_balancer & b) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lk(b.mu);
    b.cv.wait(lk, [&b] { return !b.busy; });
    return kx_seconds_since(t0);
}

// seconds a reload batch may stay out before the balancer gives up on it
double kx_balance_wait_limit(const kx_balancer & b) {
    return (b.params.wait_limit_ms > 0 ? b.params.wait_limit_ms : 10000) * 1e-3;
}

// Waits for every queued reload, at most params.wait_limit_ms: a copy that never finishes
// (a failing device, an injected hang) stops the balancer instead of the decode. Polls the
// engine rather than blocking in it so that the wait can end; at a boundary the copies have
// almost always landed behind the decode, and the first query says so. Seconds waited:
// exactly 0 when nothing was running (the stall model's test for an I/O stall).
double kx_balance_wait(kx_balancer & b) {
    const auto t0 = std::chrono::steady_clock::now();
    const double limit = kx_balance_wait_limit(b);
    for (bool first = true;; first = false) {
        const int32_t q = b.hung ? 0 : b.io->query(b.engine);
        if (q < 0) {
            throw std::runtime_error("balancer: a slot reload failed");
        }
        if (q > 0) {
            return first ? 0.0 : kx_seconds_since(t0);
        }
        if (kx_seconds_since(t0) > limit) {
            throw std::runtime_error(kx_fmt("balancer: slot reloads did not finish within %.0f ms", limit * 1e3));
        }
        std::this_thread::yield();
    }
}

void kx_balance_settle(kx_balancer & b) {
    kx_balance_drain_decision(b); // the running decision fills the newest records
    if (b.tam_pending && !b.hung && b.io->wait(b.engine) >= 0) {
        kx_balance_fetch(b);     // so does the device's
    }
}

kx_balancer::~kx_balancer() {
    if (worker.joinable()) {
        {
            std::lock_guard<std::mutex> lk(mu);
            quit = true;
        }
        cv.notify_all();
        worker.join();
    }
    if (engine) {
        if (!hung) { // an injected hang queued nothing; a real one would block here, as the device's free would
            io->wait(engine); // rows may still land in slot buffers that are about to be freed
        }
        if (tam) {
            tam_io->destroy(tam);
        }
        io->destroy(engine);
    }
}

// ---------------------------------------------------------------- boundary

// the device decision's state, from every layer's decided residency (its scores and λ start
// afresh): a new table at the balancer's start; at the back-off's return the same table,
// reset in place on the engine's stream (a new one meant ~20 allocations, and freeing the
// old one's device memory synchronizes the whole device)
static void kx_balance_tam_new(kx_balancer & b) {
    std::vector<int32_t> n, cap;
    std::vector<uint8_t> initial; // every layer's residency, concatenated
    b.tam_off.clear();
    for (const kx_balance_layer & L : b.layers) {
        b.tam_off.push_back((int64_t) initial.size());
        n.push_back((int32_t) L.decided.size());
        cap.push_back(L.cap);
        initial.insert(initial.end(), L.decided.begin(), L.decided.end());
    }
    if (b.tam) {
        if (b.tam_io->reset(b.engine, b.tam, initial.data()) == 0) {
            return;
        }
        b.tam_io->destroy(b.tam);
        b.tam = nullptr;
    }
    b.tam = b.tam_io->create(b.engine, &b.params.tam, (int32_t) b.layers.size(), n.data(), cap.data(), initial.data());
    if (!b.tam) {
        throw std::runtime_error(kx_fmt("balancer: cannot set up the decision on %s", b.slots->device.c_str()));
    }
}

std::unique_ptr<kx_balancer> kx_balancer_new(kx_slots & slots, const llama_model & model, const kx_pack & pack,
                                             const kx_balance_params & params) {
    const kx_tam_config & c = params.tam;
    if (!(0 < c.lam_min && c.lam_min <= c.lam && c.lam <= c.lam_max && c.lam_max < 1) || !(-1 <= c.eps && c.eps < 1) ||
        !(0 < c.alpha_min && c.alpha_min <= c.alpha)) {
        throw std::runtime_error("balancer: need 0 < lam_min <= lam <= lam_max < 1, -1 <= eps < 1 and "
                                 "0 < alpha_min <= alpha");
    }
    if (params.method < KX_RELOAD_GATHER || params.method > KX_RELOAD_BATCH || params.max_blocks <= 0) {
        throw std::runtime_error("balancer: unknown reload method or a block cap <= 0");
    }
    if (params.decide < KX_DECIDE_AUTO || params.decide > KX_DECIDE_INLINE) {
        throw std::runtime_error("balancer: unknown decision place (0 auto, 1 worker, 2 inline)");
    }
    if (params.pipeline && params.observe) {
        throw std::runtime_error("balancer: the pipeline decides within each decode (observe does not apply)");
    }
    if (params.pipeline && !pack.has_predictor) {
        throw std::runtime_error("balancer: the pipeline predicts the next layer with the pack's predictor, "
                                 "and " + pack.path + " has none");
    }
    const kx_backoff_config & bo = params.backoff;
    if (bo.window < 0 || bo.settle < 0 || bo.max_doubling < 0 || bo.max_doubling > 30 ||
        !(bo.margin >= 0.0f && bo.margin < 1.0f) || !(bo.drift >= 0.0f && bo.drift < 1.0f)) {
        throw std::runtime_error("balancer: the back-off needs window, settle >= 0, 0 <= max_doubling <= 30, "
                                 "margin and drift in [0, 1)");
    }
    if (params.late_every < 0 || params.fail_at < 0 || params.hang_at < 0) {
        throw std::runtime_error("balancer: late_every, fail_at and hang_at must be >= 0");
    }
    auto b = std::make_unique<kx_balancer>();
    b->params = params;
    if (params.pipeline && params.tam.max_admit < 0) {
        b->params.tam.max_admit = KX_PIPE_MAX_ADMIT;
    }
    b->backoff.cfg = params.backoff;
    // record mode indexes its active lists by record: it keeps every record
    // (at least 1024: a step's records, which the decision and the writer still fill, stay)
    b->trace.cap = params.record ? 0 : params.trace_keep > 0 ? std::max<size_t>(1024, (size_t) params.trace_keep)
                                                              : (size_t) 1 << 18;
    b->slots = &slots;
    b->model = &model;
    b->pack = &pack;
    b->index_of.assign(slots.layers.size(), -1);
    if (b->params.cpu_gbs <= 0) {
        b->params.cpu_gbs = 100.0;
    }
    if (b->params.gpu_gbs <= 0) {
        b->params.gpu_gbs = 2000.0;
    }
    int32_t index = 0;
    b->io = kx_reload_engine(slots.device, &index);
    b->engine = b->io->create(index, params.method, params.max_blocks);
    if (!b->engine) {
        throw std::runtime_error(kx_fmt("balancer: cannot start a reload engine on %s", slots.device.c_str()));
    }
    // the reload reads the host weights and the pack's down rows in place
    std::vector<ggml_backend_buffer_t> sources;
    for (int64_t il = 0; il < (int64_t) slots.layers.size(); ++il) {
        const kx_slot_layer & S = slots.layers[il];
        if (S.n_slots == 0) {
            continue;
        }
        const llama_layer & ml = model.layers[il];
        for (const ggml_tensor * w : { ml.ffn_gate, ml.ffn_up, pack.layers[il].down_t }) {
            if (std::find(sources.begin(), sources.end(), w->buffer) == sources.end()) {
                sources.push_back(w->buffer);
                if (b->io->host_register(b->engine, ggml_backend_buffer_get_base(w->buffer),
                                         ggml_backend_buffer_get_size(w->buffer))) {
                    throw std::runtime_error(kx_fmt(
                        "balancer: the host memory of %s cannot be read by %s reloads (load the model "
                        "with page-locked host weights)", w->name, slots.device.c_str()));
                }
            }
        }
        kx_balance_layer L;
        L.il = (int32_t) il;
        L.cap = (int32_t) S.n_slots;
        const int64_t n_ff = pack.n_ff;
        L.score.assign(n_ff, 0.0f);
        L.decided.assign(n_ff, 0);
        L.tmp.active.assign(n_ff, 0);
        L.tmp.admit_mask.assign(n_ff, 0);
        L.tmp.evict_mask.assign(n_ff, 0);
        L.slot_of.assign(n_ff, -1);
        L.hot_bits.assign((n_ff + 63) / 64, 0);
        for (int64_t s = 0; s < S.n_slots; ++s) {
            const int32_t i = S.resident[s];
            if (i >= 0) {
                kx_balance_layer_set_slot(L, i, (int32_t) s);
                L.decided[i] = 1;
                L.home.push_back(i);
            } else {
                L.free_slots.push_back((int32_t) s);
            }
        }
        kx_tam_state_init(&c, &L.st);
        L.row_bytes = (int64_t) (S.gate->nb[1] + S.up->nb[1] + S.down->nb[1]);
        L.tag = (int32_t) b->layers.size();
        L.ahead = kx_slots_list_ahead(slots, il); // as kx-ffn.cpp builds the nodes (the pipeline needs a predictor)
        L.tmp.mark.assign(params.pipeline ? n_ff : 0, 0);
        L.tmp.tcand.resize(params.pipeline ? GGML_MAX_N_THREADS : 1);
        L.tmp.tvict.resize(L.tmp.tcand.size());
        b->index_of[il] = L.tag;
        if (L.ahead && b->first_ahead < 0) {
            b->first_ahead = L.il;
        }
        ((int32_t *) S.seen->data)[0] = -1; // activity recorded before the start is not a step
        b->layers.push_back(std::move(L));
    }
    if (params.observe) {
        return b;
    }
    if (params.pipeline) {
        if (params.decide == KX_DECIDE_WORKER) {
            b->worker = std::thread(kx_balance_worker, b.get());
        }
        return b;
    }
    b->tam_io = kx_reload_decision(slots.device);
    if (params.decide == KX_DECIDE_AUTO && b->tam_io) {
        kx_balance_tam_new(*b);
        b->tam_ids.resize(b->layers.size());
        b->tam_n_ids.resize(b->layers.size());
        b->tam_stall.resize(b->layers.size());
        b->tam_counts.resize(2 * b->layers.size());
        b->tam_lam.resize(b->layers.size());
    } else if (params.decide != KX_DECIDE_INLINE) {
        b->worker = std::thread(kx_balance_worker, b.get());
    }
    return b;
}

// steps 3-5 of a boundary: finish (or wait for) the last reloads, commit them, apply the
// decision's evictions, queue its loads; timed by phase from *lap when given (a boundary's)
static void kx_balance_apply(kx_balancer & b, kx_slots & slots, const kx_pack & pack, const llama_model & model,
                             std::chrono::steady_clock::time_point * lap = nullptr) {
    auto phase = [lap](int32_t stat) {
        if (lap) {
            kx_balance_stat_add(stat, kx_lap_ns(*lap));
        }
    };
    kx_balance_wait(b);
    phase(KX_BAL_WAIT_NS);
    std::vector<kx_i32_write> writes;
    for (kx_balance_layer & L : b.layers) {
        kx_slot_layer & S = slots.layers[L.il];
        int32_t * slotmap = (int32_t *) S.slotmap->data; // device address on a GPU
        int32_t * coldmap = (int32_t *) S.coldmap->data;
        int32_t * colddown = (int32_t *) S.colddown->data;
        for (const auto & [i, s] : L.inflight) {
            writes.push_back({ slotmap + i, s, 0 });
            coldmap[i] = colddown[i] = -1;
            kx_balance_layer_set_slot(L, i, s);
            S.resident[s] = i;
        }
        L.inflight.clear();
        for (int32_t i : L.evict) {
            const int32_t s = L.slot_of[i];
            GGML_ASSERT(s >= 0 && "balancer: evicting a neuron that is not resident");
            writes.push_back({ slotmap + i, -1, 0 });
            kx_slot_to_host(S, pack.layers[L.il], i);
            kx_balance_layer_set_slot(L, i, -1);
            S.resident[s] = -1;
            L.free_slots.push_back(s);
        }
        L.evict.clear();
    }
    phase(KX_BAL_APPLY_NS);
    if (b.io->write_i32(b.engine, writes.data(), (int64_t) writes.size())) {
        throw std::runtime_error("balancer: slot map update failed");
    }
    phase(KX_BAL_STORE_NS);
    std::vector<kx_row_copy> copies;
    for (kx_balance_layer & L : b.layers) {
        kx_slot_layer & S = slots.layers[L.il];
        const llama_layer & ml = model.layers[L.il];
        const kx_pack_layer & pl = pack.layers[L.il];
        for (int32_t i : L.admit) {
            GGML_ASSERT(!L.free_slots.empty() && "balancer: no free slot for a load");
            const int32_t s = L.free_slots.back();
            L.free_slots.pop_back();
            copies.resize(copies.size() + 3);
            kx_slot_row_copies(S, ml, pl, i, s, copies.data() + copies.size() - 3);
            L.inflight.push_back({ i, s });
        }
        L.admit.clear();
    }
    phase(KX_BAL_APPLY_NS);
    // fault injection counts the batches that move rows
    const bool fault = !copies.empty() && ++b.batches > 0;
    if (fault && b.batches == b.params.hang_at) {
        b.hung = true; // queued in name only: its rows never land (its slots are not mapped yet)
    } else if ((fault && b.batches == b.params.fail_at) ||
               kx_reload_queue(b.io, b.engine, -1, -1, copies.data(), (int64_t) copies.size())) {
        throw std::runtime_error("balancer: queueing slot reloads failed");
    }
    phase(KX_BAL_QUEUE_NS);
}

void kx_balance_fetch(kx_balancer & b) {
    if (!b.tam_pending) {
        return;
    }
    float kernel_us = 0.0f;
    const int32_t * ids = nullptr;
    if (b.tam_io->fetch(b.tam, &ids, b.tam_lam.data(), b.tam_counts.data(), &kernel_us)) {
        throw std::runtime_error("balancer: reading the device decision failed");
    }
    b.tam_pending = false;
    for (size_t l = 0; l < b.layers.size(); ++l) {
        kx_balance_layer & L = b.layers[l];
        const int64_t n = (int64_t) L.decided.size();
        const int32_t n_load = b.tam_counts[2 * l], n_evict = b.tam_counts[2 * l + 1];
        if (n_load < 0 || n_load > n || n_evict < 0 || n_evict > n) {
            throw std::runtime_error("balancer: the device decision's counts are out of range");
        }
        const int32_t * adm = ids + 2 * b.tam_off[l];
        L.admit.assign(adm, adm + n_load);
        L.evict.assign(adm + n, adm + n + n_evict);
        kx_balance_record & r = b.trace[b.tam_rec + l];
        r.n_load = n_load;
        r.n_evict = n_evict;
        r.lam = b.tam_lam[l];
        r.reload_bytes = (int64_t) r.n_load * L.row_bytes;
        r.decide_us = kernel_us / (float) b.layers.size(); // one launch for every layer: its share
    }
}


void kx_balance_step(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack) {
    if (b.params.pipeline) {
        kx_pipe_boundary(b);
        return;
    }
    auto lap = std::chrono::steady_clock::now();
    // the worker's running decision reads the snapshots that step 1 overwrites (found with a
    // loaded machine: a slow worker decided from half of the next decode's list)
    kx_balance_drain_decision(b);
    kx_balance_stat_add(KX_BAL_WAIT_NS, kx_lap_ns(lap));
    // 1. decode k's activity (count -1: the last decode recorded none, e.g. a prompt batch)
    bool fresh = true;
    for (kx_balance_layer & L : b.layers) {
        int32_t * seen = (int32_t *) slots.layers[L.il].seen->data;
        fresh = fresh && seen[0] >= 0;
    }
    if (fresh) {
        for (kx_balance_layer & L : b.layers) {
            int32_t * seen = (int32_t *) slots.layers[L.il].seen->data;
            L.snap.assign(seen + 1, seen + 1 + seen[0]);
        }
    }
    for (kx_balance_layer & L : b.layers) {
        ((int32_t *) slots.layers[L.il].seen->data)[0] = -1;
    }
    std::vector<int32_t> hits(b.layers.size(), 0);
    for (size_t l = 0; fresh && l < b.layers.size(); ++l) {
        const kx_balance_layer & L = b.layers[l];
        hits[l] = kx_balance_layer_hits(L, L.snap.data(), (int32_t) L.snap.size()); // the maps decode k ran with
    }
    kx_balance_stat_add(KX_BAL_SNAP_NS, kx_lap_ns(lap));
    if (b.params.observe) {
        for (size_t l = 0; fresh && l < b.layers.size(); ++l) {
            kx_balance_record r = {};
            r.step = (int32_t) b.step;
            r.layer = b.layers[l].il;
            r.n_active = (int32_t) b.layers[l].snap.size();
            r.n_hit = hits[l];
            r.lam = b.params.tam.lam;
            b.trace.push_back(r);
        }
        b.step += fresh;
        return;
    }
    // 2-5 (the host decision was waited for above)
    const double waited = kx_balance_wait(b); // the last copies (and the device decision) may still run
    kx_balance_stat_add(KX_BAL_WAIT_NS, kx_lap_ns(lap));
    kx_balance_fetch(b);
    kx_balance_stat_add(KX_BAL_FETCH_NS, kx_lap_ns(lap));
    kx_balance_apply(b, slots, pack, model, &lap);
    if (!fresh) {
        return;
    }
    // 6. the next decision
    const size_t rec = b.trace.size();
    for (size_t l = 0; l < b.layers.size(); ++l) {
        kx_balance_layer & L = b.layers[l];
        const int32_t n_active = (int32_t) L.snap.size();
        const double cpu_s = (double) (n_active - hits[l]) * L.row_bytes / (b.params.cpu_gbs * 1e9);
        const double gpu_s = (double) hits[l] * L.row_bytes / (b.params.gpu_gbs * 1e9);
        L.stall = waited > 0.0 ? KX_TAM_STALL_IO : cpu_s > gpu_s ? KX_TAM_STALL_CPU : KX_TAM_STALL_NONE;
        kx_balance_record r = {};
        r.step = (int32_t) b.step;
        r.layer = L.il;
        r.n_active = n_active;
        r.n_hit = hits[l];
        r.stall = L.stall;
        r.wait_us = (float) (1e6 * waited);
        r.decided = 1;
        b.trace.push_back(r);
        if (b.params.record) {
            b.activity.push_back(L.snap);
        }
    }
    ++b.step;
    if (b.tam) {
        for (size_t l = 0; l < b.layers.size(); ++l) {
            b.tam_ids[l] = b.layers[l].snap.data();
            b.tam_n_ids[l] = (int32_t) b.layers[l].snap.size();
            b.tam_stall[l] = b.layers[l].stall;
        }
        if (b.tam_io->launch(b.engine, b.tam, b.tam_ids.data(), b.tam_n_ids.data(), b.tam_stall.data())) {
            throw std::runtime_error("balancer: launching the device decision failed");
        }
        b.tam_pending = true;
        b.tam_rec = rec;
    } else if (!b.worker.joinable()) {
        kx_balance_decide(b, rec);
    } else {
        {
            std::lock_guard<std::mutex> lk(b.mu);
            b.job_rec = rec;
            b.job = true;
            b.busy = true;
        }
        b.cv.notify_all();
    }
    kx_balance_stat_add(KX_BAL_LAUNCH_NS, kx_lap_ns(lap));
}

// Between decodes, without the pipeline: the decision the balancer's thread may be making is
// waited for and the loads in flight land and enter; that decision is then applied (its loads
// queued: `keep`) or dropped.
static void kx_balance_quiesce(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack,
                               bool keep) {
    kx_balance_drain_decision(b);
    kx_balance_wait(b);
    kx_balance_fetch(b);
    if (!keep) {
        for (kx_balance_layer & L : b.layers) {
            L.admit.clear();
            L.evict.clear();
        }
    }
    kx_balance_apply(b, slots, pack, model);
}

void kx_balance_drain(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack) {
    if (b.params.observe) {
        return;
    }
    kx_balance_land(b, slots, model, pack, true);
    if (b.params.pipeline) {
        kx_pipe_drain(b);
        return;
    }
    kx_balance_quiesce(b, slots, model, pack, true);
    kx_balance_apply(b, slots, pack, model); // its loads, waited for and committed
}

double kx_balance_held_hits(const kx_balancer & b, const kx_slots & slots) {
    int64_t hit = 0, all = 0;
    for (const kx_balance_layer & L : b.layers) {
        const int32_t * seen = (const int32_t *) slots.layers[L.il].seen->data;
        if (seen[0] < 0) {
            return -1.0;
        }
        hit += kx_balance_layer_hits(L, seen + 1, seen[0]);
        all += seen[0];
    }
    return all > 0 ? (double) hit / (double) all : -1.0;
}

bool kx_balance_land(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack, bool wait) {
    if (!b.home_pending) {
        return true;
    }
    if (!wait) {
        const int32_t q = b.hung ? 0 : b.io->query(b.engine);
        if (q < 0) {
            throw std::runtime_error("balancer: a slot reload failed");
        }
        if (q == 0) {
            kx_balance_stat_add(KX_BAL_HOME_LATE, 1);
            return false;
        }
    }
    kx_balance_apply(b, slots, pack, model); // waited for (if need be) and committed; nothing else queued
    b.home_pending = false;
    return true;
}

void kx_balance_home(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack) {
    if (b.params.observe) {
        return;
    }
    auto t0 = std::chrono::steady_clock::now();
    if (b.params.pipeline) {
        kx_pipe_drain(b); // its decisions were applied within the decodes: the landed loads enter
    } else {
        // The decision still pending is dropped, not applied: its loads (fixed λ: hundreds of
        // MiB) would only be evicted again below. The loads already in flight land and enter.
        kx_balance_quiesce(b, slots, model, pack, false);
    }
    int64_t loads = 0;
    for (kx_balance_layer & L : b.layers) {
        std::vector<uint8_t> & home = L.tmp.active; // scratch: a byte per neuron
        std::fill(home.begin(), home.end(), 0);
        for (int32_t i : L.home) {
            home[i] = 1;
        }
        for (int32_t i : slots.layers[L.il].resident) {
            if (i >= 0 && !home[i]) {
                L.evict.push_back(i);
            }
        }
        for (int32_t i : L.home) {
            if (!kx_balance_layer_hot(L, i)) {
                L.admit.push_back(i);
            }
        }
        loads += (int64_t) L.admit.size();
    }
    kx_balance_apply(b, slots, pack, model); // evictions stored, loads queued
    b.home_pending = true; // committed by the held boundaries once landed (a host engine's have)
    // the policy's state restarts from the static split, as a new balancer's would
    for (kx_balance_layer & L : b.layers) {
        kx_tam_state_init(&b.params.tam, &L.st);
        std::fill(L.score.begin(), L.score.end(), 0.0f);
        std::fill(L.decided.begin(), L.decided.end(), 0);
        for (int32_t i : L.home) {
            L.decided[i] = 1;
        }
        L.late_prev = false;
        L.snap.clear();
        L.snap_fresh = false;
    }
    if (b.tam) {
        kx_balance_tam_new(b);
    }
    kx_balance_stat_add(KX_BAL_HOMES, 1);
    kx_balance_stat_add(KX_BAL_HOME_LOADS, loads);
    kx_balance_stat_add(KX_BAL_HOME_NS, kx_lap_ns(t0));
}
