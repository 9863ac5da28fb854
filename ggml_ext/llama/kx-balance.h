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
#pragma once

#include "kairox.h"
#include "kx-reload.h"
#include "kx-tam.h"

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct llama_model;
struct kx_pack;
struct kx_slots;

struct kx_balance_layer {
    int32_t il = 0;
    int32_t cap = 0;                 // slots of the layer
    int32_t stall = 0;               // enum kx_tam_stall of the step being decided
    kx_tam_state st = {};
    std::vector<float>   score;      // TAM score per neuron
    std::vector<uint8_t> decided;    // residency as decided (committed, in flight or pending)
    std::vector<uint8_t> active, admit_mask, evict_mask; // worker scratch
    std::vector<int32_t> slot_of;    // committed: neuron -> slot, -1 (what the graph uses)
    std::vector<int32_t> free_slots;
    std::vector<int32_t> snap;       // decode k's active ids
    std::vector<int32_t> admit, evict;           // the decision waiting to be applied
    std::vector<std::pair<int32_t, int32_t>> inflight; // (neuron, slot) being copied
    int64_t row_bytes = 0;           // gate + up + down bytes of one neuron
};

struct kx_balancer {
    kx_balance_params params = {};
    const kx_reload_iface * io = nullptr;
    void * engine = nullptr;
    std::vector<kx_balance_layer> layers;   // hybrid layers only
    int64_t step = 0;                       // decision steps started
    std::vector<kx_balance_record> trace;
    std::vector<std::vector<int32_t>> activity; // record mode: [step * layers + l] active ids

    // the device's decision (engine->tam_new): every layer in one launch on the reload stream
    void * tam = nullptr;
    bool tam_pending = false;
    size_t tam_rec = 0;                     // first trace record of the pending device decision
    std::vector<int64_t> tam_off;           // each layer's first group in the concatenated masks
    std::vector<uint8_t> tam_act, tam_adm, tam_ev;
    std::vector<int32_t> tam_stall, tam_counts;
    std::vector<float> tam_lam;

    // the worker thread deciding while the next decode runs
    std::thread worker;
    std::mutex mu;
    std::condition_variable cv;
    bool job = false, busy = false, quit = false;
    size_t job_rec = 0;                     // first trace record of the running decision

    ~kx_balancer();
};

// Starts a balancer on the model's slots (replacing one that runs). Throws std::runtime_error.
std::unique_ptr<kx_balancer> kx_balancer_new(kx_slots & slots, const llama_model & model, const kx_pack & pack,
                                             const kx_balance_params & params);
// One boundary (above); no graph may run meanwhile. Throws std::runtime_error.
void kx_balance_step(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack);
// Applies everything decided so far and waits for its copies: the slots then hold exactly
// the decided residents (tests compare them with the reference).
void kx_balance_drain(kx_balancer & b, kx_slots & slots, const llama_model & model, const kx_pack & pack);
// Waits for the decision the worker is making (its trace records are then complete).
void kx_balance_drain_decision(kx_balancer & b);
// Reads the device decision's results once its stream has finished (nothing if none is pending).
void kx_balance_fetch(kx_balancer & b);
