// The live neuron balancer: between decodes, it moves neurons between the two sides of every
// hybrid layer by the TAM policy (include/kx-tam.h), with the copies on a reload stream that
// runs behind the next decode.
//
// One boundary (kx_balance_step, after decode k):
//   1. snapshot decode k's active lists (the graph copies each layer's list into a host
//      tensor, kx_slot_layer::seen) and count the GPU hits of decode k
//   2. the reload stream's last work (copies, and the device decision made from decode k-1)
//      finished -> go on; still running -> wait, and decode k's step is an I/O stall (raise
//      λ). Host decisions: wait for the worker thread that ran it during decode k.
//   3. commit the reloads issued at the last boundary
//   4. commit: loaded neurons enter the slot map and leave the host maps; the decision's
//      evictions leave the slot map and return to the host maps (one batch of map stores)
//   5. queue the decision's loads (rows from the page-locked host weights into the freed
//      slots) on the reload stream; they become visible at the next boundary's commit
//   6. start the decision for decode k's activity (TAM step per layer): one kernel for every
//      layer on the reload stream (CUDA), or on the worker thread (host)
// A neuron is in the slot map only once its rows have landed, and the host maps always
// hold the complement, so every listed neuron is computed exactly once whatever the
// reloads do: outputs never wait on, or depend on, a reload.
//
// The pipeline (kx_balance_params::pipeline; the graph's nodes in kx-ffn.cpp) decides within a
// decode instead, one layer ahead, per hybrid layer L whose predecessor is hybrid:
//   prefetch (the first host nodes of layer L-1's CPU part: begin, a scan on every compute
//      thread, end; L's list predicted from L-1's x, the list the host-cache warm-up reads,
//      written by the device into host memory beside L-1's CPU part, so begin waits for it):
//      loads of an earlier step that landed enter the slot map (else this step is skipped);
//      TAM scores move with the predicted set; the best candidates (score > τ, not resident)
//      take free slots or those of the worst residents not predicted whose score is lower;
//      the victims go back to the host maps, their slots receive the candidates' rows
//   publish (last host node of that CPU part): candidates whose rows landed enter the slot
//      map; the device map stores of the step are queued on the device's stream, ahead of
//      layer L's split
//   With decide = worker the prefetch runs on the balancer's own thread instead: the first
//   host node posts the step and returns, the compute threads run the CPU part, the thread
//   waits for the list and decides, and publish waits for the decision
//   (kx_balance_record::hold_us) before it settles; the decision leaves the CPU part's path
//   where a core is free for the thread. Either way a list that has not come within 2 ms is
//   given up (late bit 4: no decision).
// Between prefetch and publish no queued work reads layer L's slots or maps: layer L-1's
// slot part runs, and the scheduler queues layer L's only after the CPU split returns.
// Layers without a hybrid predecessor are decided between decodes from their last list.
#pragma once

#include "kairox.h"
#include "kx-backoff.h"
#include "kx-eval-clock.h"
#include "kx-reload.h"
#include "kx-tam.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <deque>
#include <thread>
#include <vector>

struct llama_model;
struct kx_pack;
struct kx_slots;

// What one step of a layer's decision uses and throws away: rebuilt by every step, never read
// by the next one, so none of it is state (the boundary's host decision and the pipeline's
// three phases fill it; the balancer's thread owns it while it decides).
struct kx_balance_scratch {
    std::vector<uint8_t> active, admit_mask, evict_mask; // host decision: decode k's set, the moves
    std::vector<uint8_t> mark;                     // pipeline: predicted
    std::vector<uint64_t> cand, vict;              // pipeline: candidates' and victims' keys
    std::vector<std::vector<uint64_t>> tcand, tvict; // ... per scanning thread
    std::vector<kx_row_copy> copies;               // the step's row copies, queued at its end
    // the pipeline's step between its phases (kx-pipeline.cpp: begin, scan on every thread, end)
    std::chrono::steady_clock::time_point t0;
    bool skip = false;
    const int32_t * list = nullptr;
    int32_t n_list = 0;
    int32_t n_scan = 1;
    const int32_t * host = nullptr;  // balancer thread: the layer's host list it waits for and
                                     // decides from (kx_slot_layer::ahead: flag, count, ids)
};

// One hybrid layer's balancer: the committed residency, the decision in flight, the
// pipeline's pending loads, and the step's scratch apart.
struct kx_balance_layer {
    int32_t il = 0;
    int32_t cap = 0;                 // slots of the layer
    int64_t row_bytes = 0;           // gate + up + down bytes of one neuron
    kx_tam_state st = {};
    std::vector<float>   score;      // TAM score per neuron
    std::vector<uint8_t> decided;    // residency as decided (committed, in flight or pending)
    // committed: what the graph uses
    std::vector<int32_t> slot_of;    // neuron -> slot, -1
    std::vector<uint64_t> hot_bits;  // a bit per neuron (slot_of >= 0): the boundary counts a
                                     // decode's hits through it, since after a decode the maps
                                     // are cold and slot_of is 32x larger (KB-70B: 112 KiB a layer, 21.5
                                     // against 10 µs per layer on the H200 host, bench/snap_probe.cpp)
    std::vector<int32_t> free_slots;
    std::vector<int32_t> home;       // the residents the balancer started from (the static split)
    // between decodes: decode k's list, the decision waiting to be applied, the rows in flight
    int32_t stall = 0;               // enum kx_tam_stall of the step being decided
    std::vector<int32_t> snap;       // decode k's active ids
    bool snap_fresh = false;
    std::vector<int32_t> admit, evict;
    std::vector<std::pair<int32_t, int32_t>> inflight; // (neuron, slot) being copied
    // pipeline
    int32_t tag = 0;                 // the reload engine's batch tag (index among hybrid layers)
    bool    ahead = false;           // prefetched within the decode (layer il-1 is hybrid)
    bool    late_prev = false;       // the last step's loads were late (an I/O stall)
    int32_t fake_late = 0;           // late_every: checks still to report "not landed"
    int64_t batches = 0;
    bool    hung = false;            // fault injection: its pending batch was queued in name only
    std::chrono::steady_clock::time_point pend_t0; // when the pending batch was queued
    int64_t rec = -1;                // this layer's newest trace record
    std::vector<std::pair<int32_t, int32_t>> pend; // (neuron, slot): rows queued, not yet in the slot map
    std::vector<kx_i32_write> writes;              // device map stores of the step, made at publish

    kx_balance_scratch tmp;
};

// The balancer's records in memory (kx_model_balance_trace, the trace file's source): the
// newest ones only, so that a server decoding for days keeps a bounded log instead of one
// record per hybrid layer and step forever. Indices are logical, counted over every record
// ever made (size() is the next one's); when the log passes `cap` the oldest goes, down to
// half of it, so the erase runs once per cap/2 records. A writer or decision refers to
// records at most a step old, inside what is kept (cap >= 1024). cap 0: keep all (record
// mode, whose active lists are indexed by record).
struct kx_record_log {
    std::deque<kx_balance_record> kept;
    size_t base = 0;   // logical index of kept.front()
    size_t cap  = 1u << 18; // kx_balance_params.trace_keep

    size_t size() const { return base + kept.size(); }
    size_t first() const { return base; }
    kx_balance_record & operator[](size_t i) { return kept[i - base]; }
    const kx_balance_record & operator[](size_t i) const { return kept[i - base]; }
    void push_back(const kx_balance_record & r) {
        kept.push_back(r);
        if (cap > 0 && kept.size() > cap) {
            const size_t drop = kept.size() - cap / 2;
            kept.erase(kept.begin(), kept.begin() + (std::ptrdiff_t) drop);
            base += drop;
        }
    }
};

struct kx_balancer {
    kx_balance_params params = {};
    // the back-off (params.backoff): held, the boundary takes no step and graphs carry no
    // pipeline nodes; the context's eval counters at the last boundary give the token times
    kx_backoff backoff;
    bool    held         = false;
    bool    home_pending = false; // a return's loads queued, not yet committed (kx_balance_land)
    kx_eval_clock bo_clock;
    double  bo_step_s    = 0.0; // the last boundary's own time, added to the next token's
    std::vector<kx_backoff_sample> bo_trace; // the measured tokens (kx_model_backoff_trace)
    const kx_reload_iface * io = nullptr;
    void * engine = nullptr;
    std::vector<kx_balance_layer> layers;   // hybrid layers only
    int64_t step = 0;                       // decision steps started
    kx_record_log trace;
    std::vector<std::vector<int32_t>> activity; // record mode: [step * layers + l] active ids
                                                // (pipeline: one per trace record, its predicted ids)
    // pipeline
    kx_slots * slots = nullptr;
    const llama_model * model = nullptr;
    const kx_pack * pack = nullptr;
    int64_t pstep = 0;                      // graphs run with the pipeline's nodes
    int32_t first_ahead = -1;               // the lowest layer prefetched within a graph (counts pstep)
    std::vector<int32_t> index_of;          // model layer -> index in layers, -1
    std::string error;                      // the first failure inside a graph (reported at the boundary)
    int64_t batches = 0;                    // reload batches queued, both paths (fault injection counts them)
    bool hung = false;                      // fault injection: a batch that never finishes was queued

    // the device's decision (tam_io, on the engine's stream): every layer in one launch
    const kx_tam_iface * tam_io = nullptr;
    void * tam = nullptr;
    bool tam_pending = false;
    size_t tam_rec = 0;                     // first trace record of the pending device decision
    std::vector<int64_t> tam_off;           // each layer's first group in the concatenated arrays
    std::vector<const int32_t *> tam_ids;   // each layer's active ids (its snapshot) for a launch
    std::vector<int32_t> tam_n_ids, tam_stall, tam_counts;
    std::vector<float> tam_lam;

    // the worker thread deciding while the next decode runs; with the pipeline (decide =
    // worker) it makes one layer's prefetch while the CPU part of the layer before computes
    std::thread worker;
    std::mutex mu;
    std::condition_variable cv;
    bool job = false, busy = false, quit = false;
    size_t job_rec = 0;                     // first trace record of the running decision
    kx_balance_layer * pipe_job = nullptr;  // the pipeline's layer being decided

    ~kx_balancer();
};

// The boundary's host time by phase, summed over boundaries (kx_balance_stats, kairox.h):
// boundaries, ns in kx_context_balance, of which synchronizing the context, taking decode k's
// lists and hits (step 1), waiting for the reload stream (2), reading the device decision,
// applying (3-5: the host's maps and the copy list), starting the next decision (6), and of
// applying's device calls apart: storing the slot-map entries, queueing the copies (the host
// loops alone are 1.5 of apply's 7-9 µs per KB-70B layer, bench/apply_probe.cpp); the
// back-off's held boundaries, and its returns to the static split (count, neurons loaded, ns;
// held boundaries at which their loads had not yet landed)
enum { KX_BAL_STEPS, KX_BAL_NS, KX_BAL_SYNC_NS, KX_BAL_SNAP_NS, KX_BAL_WAIT_NS, KX_BAL_FETCH_NS, KX_BAL_APPLY_NS,
       KX_BAL_LAUNCH_NS, KX_BAL_STORE_NS, KX_BAL_QUEUE_NS, KX_BAL_HELD, KX_BAL_HOMES, KX_BAL_HOME_LOADS, KX_BAL_HOME_NS,
       KX_BAL_HOME_LATE, KX_BAL_N_STATS };
void kx_balance_stat_add(int32_t i, int64_t v);


// Starts a balancer on the model's slots (replacing one that runs). Throws std::runtime_error.
std::unique_ptr<kx_balancer> kx_balancer_new(kx_slots & slots, const llama_model & model, const kx_pack & pack,
                                             const kx_balance_params & params);
// One boundary (above); no graph may run meanwhile. Throws std::runtime_error.
void kx_balance_step(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack);
// Applies everything decided so far and waits for its copies: the slots then hold exactly
// the decided residents (tests compare them with the reference).
void kx_balance_drain(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack);
// The back-off's hold (kx-api.cpp): the loads in flight land (a decision not yet applied is
// dropped), then the slots go back to the residents the balancer started from
// (kx_balance_layer::home) and the policy's state (scores, λ, the device decision's
// residency) restarts there, so a held balancer runs the static split and a resumed one
// starts from it as a new one would. The return's evictions take effect at once; its loads
// are queued and enter when they have landed (kx_balance_land), so the decodes go on meanwhile
// (the neurons not yet back run on the CPU side) instead of waiting for the copies (a return
// on KB-7B moved ~600 MiB in 22-43 ms, two to four decodes).
void kx_balance_home(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack);
// The static split's hit rate on the decode just run, held (the back-off's drift gate): the
// share of its listed neurons the slots held, over every hybrid layer; < 0 where a layer
// recorded no list. Tens of µs on KB-7B, so counted only where the back-off asks for it.
double kx_balance_held_hits(const kx_balancer & b, const kx_slots & slots);
// Commits a return's loads once they have landed (wait: blocks for them, as the balancer's
// resume and a drain do); true when none is left pending.
bool kx_balance_land(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack, bool wait);
// Waits for the decision the worker is making (its trace records are then complete); the
// seconds waited.
double kx_balance_drain_decision(kx_balancer & b);
// Reads the device decision's results once its stream has finished (nothing if none is pending).
void kx_balance_fetch(kx_balancer & b);
// Waits for the running decision, on the host or the device, so every trace record is complete.
void kx_balance_settle(kx_balancer & b);

// The pipeline's graph nodes (kx-ffn.cpp): prefetch for hybrid layer il from its predicted
// list in host memory (kx_slot_layer::ahead: I32 [flag, count, ids...], the flag set once the
// list is there) in three phases (0 and 2 on one thread, 1 on thread ith of nth; with the
// balancer's thread, phase 0 posts the whole prefetch to it); publish what landed, and mark
// the list used (consume: its flag, nullptr when the warm-up still reads the list); the
// slot map's stores go ahead of the next work of `reader` (the slots' device backend).
// Failures are kept and reported by the next boundary (kx_balance_step throws them); nothing
// is done without a pipeline balancer (b nullptr or another kind).
void kx_pipe_hook_prefetch(kx_balancer * b, int32_t il, int32_t phase, const int32_t * host, int ith,
                           int nth) noexcept;
void kx_pipe_hook_publish(kx_balancer * b, int32_t il, int32_t * consume, ggml_backend * reader) noexcept;

// ---------------------------------------------------------------- shared by the two policies' files
// (the boundary: kx-balance.cpp; the pipeline: kx-pipeline.cpp)

// the committed residency: slot_of and its bit map change together
inline void kx_balance_layer_set_slot(kx_balance_layer & L, int32_t i, int32_t s) {
    L.slot_of[i] = s;
    const uint64_t bit = 1ull << (i & 63);
    L.hot_bits[i >> 6] = s >= 0 ? L.hot_bits[i >> 6] | bit : L.hot_bits[i >> 6] & ~bit;
}

inline bool kx_balance_layer_hot(const kx_balance_layer & L, int32_t i) {
    return (L.hot_bits[i >> 6] >> (i & 63)) & 1;
}

// how many of n listed neurons are resident
inline int32_t kx_balance_layer_hits(const kx_balance_layer & L, const int32_t * ids, int32_t n) {
    int32_t hits = 0;
    for (int32_t k = 0; k < n; ++k) {
        hits += (int32_t) kx_balance_layer_hot(L, ids[k]);
    }
    return hits;
}

inline double kx_seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// seconds a reload batch may stay out before the balancer gives up on it
double kx_balance_wait_limit(const kx_balancer & b);
// Waits for every queued reload (kx-balance.cpp); seconds waited, exactly 0 when nothing ran.
double kx_balance_wait(kx_balancer & b);
// the pipeline's parts of the balancer's thread and of a boundary (kx-pipeline.cpp): one
// posted prefetch; the layers no graph node decides, and failures kept from the graphs;
// everything applied and waited for
void kx_pipe_job(kx_balancer & b);
void kx_pipe_boundary(kx_balancer & b);
void kx_pipe_drain(kx_balancer & b);
