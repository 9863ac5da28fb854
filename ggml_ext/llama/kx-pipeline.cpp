// The balancer's pipeline (kx-balance.h): one layer's decision within the decode, from the
// layer before's prediction of its list, made by the graph's own host nodes (kx-ffn.cpp) or
// the balancer's thread; and what of it the boundary between decodes still does.
#include "kx-balance.h"
#include "kx-pack.h"
#include "kx-reload-engine.h"
#include "kx-slots.h"
#include "kx-stats.h"

#include "llama-model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <stdexcept>

// counters (kx_pipe_stats): steps, then ns by phase
enum { KX_PIPE_STEPS, KX_PIPE_LIST_NS, KX_PIPE_BEGIN_NS, KX_PIPE_SCAN_NS, KX_PIPE_END_NS, KX_PIPE_QUEUE_NS,
       KX_PIPE_PUBLISH_NS, KX_PIPE_N_STATS };
static std::atomic<int64_t> kx_pipe_stat[KX_PIPE_N_STATS];

void kx_pipe_stats(int64_t * out, bool reset) {
    kx_stats_read(kx_pipe_stat, out, reset);
}

static void kx_pipe_stat_lap(int32_t i, std::chrono::steady_clock::time_point & t) {
    kx_pipe_stat[i].fetch_add(kx_lap_ns(t), std::memory_order_relaxed);
}

// s ← λ·s + (1 − λ)·predicted over the layer, rounded as kx_tam_score (and the reference):
// after the product and after the sum (this file is compiled with -ffp-contract=off, so the
// loop vectorizes without fusing them)
static void kx_pipe_scores(float * score, const uint8_t * mark, int64_t n, float lam) {
    const float a = 1.0f - lam;
    for (int64_t i = 0; i < n; ++i) {
        const float p = lam * score[i];
        score[i] = p + a * (float) mark[i]; // a·1 and a·0 are exact: the same sum, no branch
    }
}

// the layer's record for step `step` (a new one when its newest is older, or when a decision
// already filled it and another is made)
static kx_balance_record & kx_pipe_record(kx_balancer & b, kx_balance_layer & L, int64_t step, bool decision) {
    if (L.rec < 0 || b.trace[L.rec].step != step || (decision && b.trace[L.rec].decided)) {
        kx_balance_record r = {};
        r.step = (int32_t) step;
        r.layer = L.il;
        r.lam = L.st.lam;
        r.stall = KX_TAM_STALL_NONE;
        L.rec = (int64_t) b.trace.size();
        b.trace.push_back(r);
        if (b.params.record) {
            b.activity.resize(b.trace.size());
        }
    }
    kx_balance_record & r = b.trace[L.rec];
    r.decided |= decision ? 1 : 0;
    return r;
}

// what layer L ran with in this graph: its list (the graph's copy) against the slot map it used
static void kx_pipe_observe(kx_balancer & b, kx_balance_layer & L, int64_t step) {
    int32_t * seen = (int32_t *) b.slots->layers[L.il].seen->data;
    if (seen[0] < 0) {
        return;
    }
    L.snap.assign(seen + 1, seen + 1 + seen[0]);
    L.snap_fresh = true;
    seen[0] = -1;
    kx_balance_record & r = kx_pipe_record(b, L, step, false);
    r.n_active = (int32_t) L.snap.size();
    r.n_hit = kx_balance_layer_hits(L, L.snap.data(), (int32_t) L.snap.size());
}

static bool kx_pipe_landed(kx_balancer & b, kx_balance_layer & L) {
    if (L.fake_late > 0) {
        --L.fake_late;
        return false;
    }
    const int32_t q = L.hung ? 0 : b.io->tag_query(b.engine, L.tag);
    if (q < 0) {
        throw std::runtime_error("balancer: a slot reload failed");
    }
    // a batch still out after the wait limit will not land: the balancer stops rather than
    // keep the layer's decisions skipped (its slots taken) for the rest of the run
    if (q == 0 && kx_seconds_since(L.pend_t0) > kx_balance_wait_limit(b)) {
        throw std::runtime_error(kx_fmt("balancer: slot reloads did not finish within %.0f ms",
                                        kx_balance_wait_limit(b) * 1e3));
    }
    return q == 1;
}

// the pending loads enter the slot map (their device stores wait for publish)
static void kx_pipe_commit(kx_balancer & b, kx_balance_layer & L) {
    kx_slot_layer & S = b.slots->layers[L.il];
    int32_t * slotmap = (int32_t *) S.slotmap->data; // device address on a GPU
    for (const auto & [i, s] : L.pend) {
        L.writes.push_back({ slotmap + i, s, 0 });
        ((int32_t *) S.coldmap->data)[i] = ((int32_t *) S.colddown->data)[i] = -1;
        kx_balance_layer_set_slot(L, i, s);
        S.resident[s] = i;
    }
    L.pend.clear();
}

// One step of layer L from its predicted list (kairox.balancer.PrefetchLayer.step), in three
// phases so the O(n_ff + slots) part runs on every compute thread of the CPU split (measured on
// the H200 machine: ~97 µs per KB-7B layer on one thread, which the 15 others spent waiting):
//   begin (one thread): landed loads enter, the step's stall, λ
//   scan  (thread ith of nth): the predicted marks, scores, candidate keys and the worst
//         victim keys of a slice of the neurons (and of the list's entries in it)
//   end   (one thread): the best candidates against the worst victims, evictions, copies
static void kx_pipe_begin(kx_balancer & b, kx_balance_layer & L, const int32_t * list, int32_t n, int64_t step) {
    L.tmp.t0 = std::chrono::steady_clock::now();
    kx_balance_record & r = kx_pipe_record(b, L, step, true);
    if (b.params.record) {
        b.activity[L.rec].assign(list, list + n);
    }
    const int32_t hits = kx_balance_layer_hits(L, list, n);
    L.tmp.skip = false;
    if (!L.pend.empty()) {
        if (kx_pipe_landed(b, L)) {
            kx_pipe_commit(b, L);
        } else {
            r.late |= 1; // still in flight: no decision (its slots are taken)
            L.tmp.skip = true;
        }
    }
    const double cpu_s = (double) (n - hits) * L.row_bytes / (b.params.cpu_gbs * 1e9);
    const double gpu_s = (double) hits * L.row_bytes / (b.params.gpu_gbs * 1e9);
    r.stall = L.tmp.skip || L.late_prev ? KX_TAM_STALL_IO : cpu_s > gpu_s ? KX_TAM_STALL_CPU : KX_TAM_STALL_NONE;
    L.late_prev = L.tmp.skip;
    r.lam = L.st.lam;
    if (L.tmp.skip) {
        r.decide_us = (float) (1e6 * kx_seconds_since(L.tmp.t0));
        return;
    }
    kx_tam_adapt(&b.params.tam, &L.st, r.stall);
    L.tmp.list = list;
    L.tmp.n_list = n;
    auto t = L.tmp.t0;
    kx_pipe_stat[KX_PIPE_STEPS] += 1;
    kx_pipe_stat_lap(KX_PIPE_BEGIN_NS, t);
}

// keeps in `keep` the m keys that come first by `before` among those offered (a heap whose
// front is the one to drop next)
template <typename Before>
static inline void kx_keep_best(std::vector<uint64_t> & keep, uint64_t key, int32_t m, Before before) {
    if ((int32_t) keep.size() < m) {
        keep.push_back(key);
        std::push_heap(keep.begin(), keep.end(), before);
    } else if (m > 0 && before(key, keep.front())) {
        std::pop_heap(keep.begin(), keep.end(), before);
        keep.back() = key;
        std::push_heap(keep.begin(), keep.end(), before);
    }
}

static void kx_pipe_scan(kx_balancer & b, kx_balance_layer & L, int ith, int nth) {
    if (L.tmp.skip || nth > (int) L.tmp.tcand.size()) {
        GGML_ASSERT(nth <= (int) L.tmp.tcand.size() && "balancer: more compute threads than GGML_MAX_N_THREADS");
        return;
    }
    if (ith == 0) {
        L.tmp.n_scan = nth;
    }
    struct lap { // thread 0's slice, timed
        bool on;
        std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
        ~lap() { if (on) kx_pipe_stat_lap(KX_PIPE_SCAN_NS, t); }
    } timed{ ith == 0 };
    const float lam = L.st.lam;
    const float tau = kx_tam_tau(&b.params.tam, lam);
    const int64_t n_ff = (int64_t) L.score.size();
    const int64_t f0 = n_ff * ith / nth, f1 = n_ff * (ith + 1) / nth;
    // the list is ascending: its entries in this thread's neurons are marked predicted here
    // and cleared at the end, so no other thread reads or writes them
    const int32_t * lo = std::lower_bound(L.tmp.list, L.tmp.list + L.tmp.n_list, (int32_t) f0);
    const int32_t * hi = std::lower_bound(lo, L.tmp.list + L.tmp.n_list, (int32_t) f1);
    for (const int32_t * p = lo; p < hi; ++p) {
        L.tmp.mark[*p] = 1;
    }
    kx_pipe_scores(L.score.data() + f0, L.tmp.mark.data() + f0, f1 - f0, lam);
    // No step uses more than max_admit candidates or victims: each slice keeps its best m
    // candidates and its worst m victims in a bounded heap as it goes (one comparison for
    // most keys) instead of collecting every resident's key and selecting afterwards.
    const int32_t m = b.params.tam.max_admit;
    // candidates from the list's own slice: each thread scores, then reads, the same neurons
    // (a list entry belongs to the thread whose score slice holds it), so no wait
    std::vector<uint64_t> & cand = L.tmp.tcand[ith];
    cand.clear();
    for (const int32_t * p = lo; p < hi; ++p) {
        if (!kx_balance_layer_hot(L, *p) && L.score[*p] > tau) {
            kx_keep_best(cand, kx_tam_key(L.score[*p], 0, *p), m, std::greater<uint64_t>());
        }
    }
    // victims: residents not predicted whose neuron is in this thread's score slice, found
    // through the residency bits in neuron order: reads in order of the score, not of the
    // slots (random ones into maps the CPU part has pushed out of the caches)
    std::vector<uint64_t> & vict = L.tmp.tvict[ith];
    vict.clear();
    // Downwards: among equal scores (residents not predicted decay through the same few
    // values) the key falls with the id, so going up nearly every key would displace the
    // heap's front, going down few do
    for (int64_t w = f1 > f0 ? (f1 - 1) >> 6 : -1; w >= 0 && w >= (f0 >> 6); --w) {
        for (uint64_t bits = L.hot_bits[w]; bits != 0; bits &= ~(1ull << (63 - __builtin_clzll(bits)))) {
            const int32_t i = (int32_t) (w * 64 + 63 - __builtin_clzll(bits));
            if (i >= f0 && i < f1 && !L.tmp.mark[i]) {
                kx_keep_best(vict, kx_tam_key(L.score[i], 1, i), m, std::less<uint64_t>());
            }
        }
    }
    for (const int32_t * p = lo; p < hi; ++p) {
        L.tmp.mark[*p] = 0;
    }
}

static void kx_pipe_end(kx_balancer & b, kx_balance_layer & L) {
    if (L.tmp.skip) {
        return;
    }
    auto t = std::chrono::steady_clock::now();
    kx_slot_layer & S = b.slots->layers[L.il];
    const kx_pack_layer & pl = b.pack->layers[L.il];
    const kx_tam_config & c = b.params.tam;
    kx_balance_record & r = b.trace[L.rec];
    std::vector<uint64_t> & cand = L.tmp.cand;
    std::vector<uint64_t> & vict = L.tmp.vict;
    cand.clear();
    vict.clear();
    for (int t = 0; t < L.tmp.n_scan; ++t) {
        cand.insert(cand.end(), L.tmp.tcand[t].begin(), L.tmp.tcand[t].end());
    }
    if (cand.size() > (size_t) c.max_admit) {
        // the best max_admit (keys are unique), then in order
        std::nth_element(cand.begin(), cand.begin() + c.max_admit, cand.end(), std::greater<uint64_t>());
        cand.resize(c.max_admit);
    }
    std::sort(cand.begin(), cand.end(), std::greater<uint64_t>());
    // victims, worst first (only when the free slots do not suffice)
    if (cand.size() > L.free_slots.size()) {
        for (int t = 0; t < L.tmp.n_scan; ++t) {
            vict.insert(vict.end(), L.tmp.tvict[t].begin(), L.tmp.tvict[t].end());
        }
        const size_t need = std::min(vict.size(), cand.size() - L.free_slots.size());
        if (need < vict.size()) {
            std::nth_element(vict.begin(), vict.begin() + need, vict.end());
            vict.resize(need);
        }
        std::sort(vict.begin(), vict.end());
    }
    int32_t * slotmap = (int32_t *) S.slotmap->data;
    const llama_layer & ml = b.model->layers[L.il];
    std::vector<kx_row_copy> & copies = L.tmp.copies;
    copies.clear();
    size_t nv = 0;
    int32_t ne = 0;
    for (uint64_t key : cand) {
        const int32_t i = 0x7FFFFFFF - (int32_t) (key & 0x7FFFFFFF);
        int32_t s;
        if (!L.free_slots.empty()) {
            s = L.free_slots.front(); // ascending: the reference takes the lowest free slot
            L.free_slots.erase(L.free_slots.begin());
        } else {
            // a candidate displaces a resident only with a higher score (a tie keeps the resident)
            if (nv >= vict.size() || key <= vict[nv]) {
                break;
            }
            const int32_t v = 0x7FFFFFFF - (int32_t) (vict[nv++] & 0x7FFFFFFF);
            s = L.slot_of[v];
            L.writes.push_back({ slotmap + v, -1, 0 });
            kx_slot_to_host(S, pl, v);
            kx_balance_layer_set_slot(L, v, -1);
            S.resident[s] = -1;
            ++ne;
        }
        copies.resize(copies.size() + 3);
        kx_slot_row_copies(S, ml, pl, i, s, copies.data() + copies.size() - 3);
        L.pend.push_back({ i, s });
    }
    kx_pipe_stat_lap(KX_PIPE_END_NS, t);
    if (!copies.empty()) {
        L.pend_t0 = std::chrono::steady_clock::now();
        if (++b.batches == b.params.hang_at) {
            L.hung = b.hung = true; // queued in name only: its rows never land
        } else if (b.batches == b.params.fail_at ||
                   kx_reload_queue(b.io, b.engine, L.tag, L.il, copies.data(), (int64_t) copies.size())) {
            throw std::runtime_error("balancer: queueing slot reloads failed");
        }
        ++L.batches;
        if (b.params.late_every > 0 && L.batches % b.params.late_every == 0) {
            L.fake_late = 2; // reported late at publish and at the next prefetch
        }
    }
    kx_pipe_stat_lap(KX_PIPE_QUEUE_NS, t);
    r.n_load = (int32_t) L.pend.size();
    r.n_evict = ne;
    r.lam = L.st.lam;
    r.reload_bytes = (int64_t) r.n_load * L.row_bytes;
    r.decide_us = (float) (1e6 * kx_seconds_since(L.tmp.t0));
}

// the three phases on the calling thread (between decodes)
static void kx_pipe_prefetch(kx_balancer & b, kx_balance_layer & L, const int32_t * list, int32_t n, int64_t step) {
    kx_pipe_begin(b, L, list, n, step);
    kx_pipe_scan(b, L, 0, 1);
    kx_pipe_end(b, L);
}

// the end of layer L's step `step`: landed loads enter the slot map (the others stay pending)
static void kx_pipe_settle(kx_balancer & b, kx_balance_layer & L, int64_t step) {
    if (!L.pend.empty()) {
        if (kx_pipe_landed(b, L)) {
            kx_pipe_commit(b, L);
        } else {
            kx_pipe_record(b, L, step, false).late |= 2;
            L.late_prev = L.ahead; // between decodes a layer's loads land during the next one: no stall
        }
    }
}

// the step's device map stores: queued ahead of the next work of `reader` (publish: the
// device's backend, whose next split reads the map), else done when it returns
static void kx_pipe_flush(kx_balancer & b, kx_balance_layer & L, ggml_backend * reader = nullptr) {
    if (!L.writes.empty()) {
        if (b.io->queue_write(b.engine, reader, L.writes.data(), (int64_t) L.writes.size())) {
            throw std::runtime_error("balancer: slot map update failed");
        }
        L.writes.clear();
    }
}

// Layer L's predicted list in host memory (flag, count, ids): waits until the device has
// flagged it or `limit_s` passed; the list (count, ids) or nullptr. The device's head writes
// it beside the CPU part, within ~20 µs of the CPU split's start (on the CPU it is written
// before the prefetch); where the CPU part is shorter (small models) the prefetch, and with
// it publish, waits for it. A list that does not come means a graph whose nodes did not run
// in that order: the step is given up rather than the decode held.
static const int32_t * kx_pipe_list(const int32_t * host, double limit_s) {
    if (!host) {
        return nullptr;
    }
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t k = 0; __atomic_load_n(host, __ATOMIC_ACQUIRE) != 1; ++k) {
        if (k % 64 == 63 && kx_seconds_since(t0) > limit_s) {
            kx_pipe_stat_lap(KX_PIPE_LIST_NS, t0);
            return nullptr;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    kx_pipe_stat_lap(KX_PIPE_LIST_NS, t0);
    return host + 1;
}

// a step whose list did not come: recorded, nothing decided (the pending loads settle at publish)
static void kx_pipe_no_list(kx_balancer & b, kx_balance_layer & L, int64_t step) {
    kx_pipe_record(b, L, step, false).late |= 4;
    L.tmp.skip = true;
}

// a list is waited for at most this long (seconds)
static constexpr double kx_pipe_list_limit_s = 2e-3;

// decide = worker: one layer's prefetch on the balancer's thread (kx_balance_worker), posted
// by the first host node of the layer before; it waits for the list there
void kx_pipe_job(kx_balancer & b) {
    kx_balance_layer & L = *b.pipe_job;
    try {
        kx_pipe_observe(b, b.layers[b.index_of[L.il - 1]], b.pstep); // (ahead: il-1 is hybrid)
        const int32_t * list = kx_pipe_list(L.tmp.host, kx_pipe_list_limit_s);
        if (!list) {
            kx_pipe_no_list(b, L, b.pstep);
            return;
        }
        kx_pipe_prefetch(b, L, list + 1, std::max(list[0], 0), b.pstep);
    } catch (const std::exception & e) {
        b.error = e.what();
    }
}

// the balancer of layer il's pipeline hooks, nullptr when it has none; once it failed only
// for `failed_too` (publish still makes the map stores of evictions already handed to the host)
static kx_balancer * kx_pipe_balancer(kx_balancer * b, int32_t il, kx_balance_layer ** L, bool failed_too = false) {
    if (!b || !b->params.pipeline || (!failed_too && !b->error.empty()) || il < 0 || il >= (int32_t) b->index_of.size() ||
        b->index_of[il] < 0) {
        return nullptr;
    }
    *L = &b->layers[b->index_of[il]];
    return (*L)->ahead ? b : nullptr;
}

void kx_pipe_hook_prefetch(kx_balancer * balancer, int32_t il, int32_t phase, const int32_t * host, int ith,
                           int nth) noexcept {
    kx_balance_layer * L = nullptr;
    kx_balancer * b = kx_pipe_balancer(balancer, il, &L);
    if (!b) {
        return;
    }
    try {
        if (phase == 0 && il == b->first_ahead) {
            ++b->pstep; // the first prefetch of a graph
        }
        if (phase == 0 && b->params.decide == KX_DECIDE_WORKER) {
            {
                std::lock_guard<std::mutex> lk(b->mu);
                L->tmp.host = host;
                b->pipe_job = L;
                b->job = true;
                b->busy = true;
            }
            b->cv.notify_all();
        } else if (phase == 0) {
            kx_balance_layer & prev = b->layers[b->index_of[il - 1]];
            kx_pipe_observe(*b, prev, b->pstep); // its CPU split copied its list just before
            const int32_t * list = kx_pipe_list(host, kx_pipe_list_limit_s);
            if (list) {
                kx_pipe_begin(*b, *L, list + 1, std::max(list[0], 0), b->pstep);
            } else {
                kx_pipe_no_list(*b, *L, b->pstep);
            }
        } else if (phase == 1) {
            kx_pipe_scan(*b, *L, ith, nth);
        } else {
            kx_pipe_end(*b, *L);
        }
    } catch (const std::exception & e) {
        b->error = e.what(); // (only phases 0 and 2 can throw: one thread each)
    }
}

void kx_pipe_hook_publish(kx_balancer * balancer, int32_t il, int32_t * consume, ggml_backend * reader) noexcept {
    struct lap {
        std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
        ~lap() { kx_pipe_stat_lap(KX_PIPE_PUBLISH_NS, t); }
    } timed;
    kx_balancer * w = balancer && balancer->params.pipeline && balancer->params.decide == KX_DECIDE_WORKER
                    ? balancer : nullptr;
    const double hold = w ? kx_balance_drain_decision(*w) : 0.0; // (before anything reads what the thread writes)
    if (consume) {
        // used: the next decode's list sets the flag again (the warm-up does this where it runs)
        __atomic_store_n(consume, 0, __ATOMIC_RELEASE);
    }
    kx_balance_layer * L = nullptr;
    kx_balancer * b = kx_pipe_balancer(balancer, il, &L, true);
    if (!b) {
        return;
    }
    try {
        if (b->error.empty()) {
            if (w && L->rec >= 0) {
                b->trace[L->rec].hold_us = (float) (1e6 * hold);
            }
            kx_pipe_settle(*b, *L, b->pstep);
        }
    } catch (const std::exception & e) {
        b->error = e.what();
    }
    try {
        // an evicted neuron's host maps already say "host": the device map must stop saying
        // "slot" before the layer runs, or both sides would compute it (the stores go ahead
        // of the layer's split on the device's stream)
        kx_pipe_flush(*b, *L, reader);
    } catch (const std::exception & e) {
        if (b->error.empty()) {
            b->error = e.what();
        }
    }
}

// between decodes: the layers no graph node observes or prefetches
void kx_pipe_boundary(kx_balancer & b) {
    kx_balance_drain_decision(b); // (a graph that failed between a post and its publish)
    if (!b.error.empty()) {
        const std::string e = b.error;
        b.error.clear();
        throw std::runtime_error(e);
    }
    bool any_ahead = false;
    for (size_t l = 0; l < b.layers.size(); ++l) {
        any_ahead = any_ahead || b.layers[l].ahead;
        const bool next_ahead = l + 1 < b.layers.size() && b.layers[l + 1].ahead;
        if (!next_ahead) {
            kx_pipe_observe(b, b.layers[l], b.pstep);
        }
    }
    if (!any_ahead) {
        ++b.pstep; // no graph node counts the steps
    }
    const int64_t next = any_ahead ? b.pstep + 1 : b.pstep; // the step of the next graph
    for (kx_balance_layer & L : b.layers) {
        if (L.ahead) {
            L.snap_fresh = false;
            continue;
        }
        // decided here from its own last list: the last boundary's loads landed during the
        // decode (that step's end), this step's land during the next one; the evictions'
        // map stores are made before the next graph runs
        try {
            if (L.rec >= 0 && b.trace[L.rec].decided) {
                kx_pipe_settle(b, L, b.trace[L.rec].step);
            }
            if (L.snap_fresh) {
                kx_pipe_prefetch(b, L, L.snap.data(), (int32_t) L.snap.size(), next);
            }
        } catch (...) {
            kx_pipe_flush(b, L); // the evictions made before the failure (see kx_pipe_hook_publish)
            throw;
        }
        kx_pipe_flush(b, L);
        L.snap_fresh = false;
    }
}

void kx_pipe_drain(kx_balancer & b) {
    kx_balance_drain_decision(b);
    kx_balance_wait(b);
    for (kx_balance_layer & L : b.layers) {
        kx_pipe_commit(b, L);
        L.fake_late = 0;
        kx_pipe_flush(b, L);
    }
}
