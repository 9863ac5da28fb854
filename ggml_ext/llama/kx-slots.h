// GPU neuron slots: per layer, a fixed buffer holding the gate/up/down rows of S neurons on
// a device, plus the maps that split one active list between the device and the host.
//
//   slotmap  (device, I32 [n_ff]): neuron -> its slot, -1 when not resident
//   coldmap  (host,   I32 [n_ff]): neuron -> its row in the model's gate/up, -1 when resident
//   colddown (host,   I32 [n_ff]): neuron -> its row in the pack's down_t, -1 when resident
//
// A share of the host side can be computed by the slots' device too, straight from the
// page-locked host rows over PCIe (mapped, zero-copy): while the CPU streams its neurons
// from host memory at ~70-80 GB/s the device would otherwise idle, and PCIe adds up to
// ~50 GB/s of reads of the same memory (kx_slots_set_mapped_share):
//
//   mapmap   (device, I32 [n_ff]): neuron -> its row in the model's gate/up, -1 unless mapped
//   mapdown  (device, I32 [n_ff]): neuron -> its row in the pack's down_t, -1 unless mapped
//
// A mapped neuron is -1 in coldmap/colddown: each listed neuron is computed exactly once.
//
// The slot buffers never move or change size, so graphs (and CUDA graphs) built on them stay
// valid while their contents are replaced. kx_slots_build fills them from the hottest neurons
// by the pack's measured activation frequency; the balancer (kx-balance.h) replaces them.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "kx-pack.h"
#include "kx-reload.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct llama_model;
struct llama_layer;
struct kx_pack;
struct kx_pack_layer;

struct kx_slot_layer {
    int64_t n_slots = 0;
    ggml_tensor * gate     = nullptr; // [n_embd, S], the model gate's type
    ggml_tensor * up       = nullptr; // [n_embd, S], the model up's type
    ggml_tensor * down     = nullptr; // [n_embd, S], the pack down_t's type (one row per slot)
    ggml_tensor * slotmap  = nullptr;
    ggml_tensor * coldmap  = nullptr;
    ggml_tensor * colddown = nullptr;
    kx_lowrank pred;                  // the pack's predictors, on the slots' device
    kx_lowrank pred_ahead;
    ggml_tensor * seen     = nullptr; // host, I32 [n_ff + 1]: the last decode's active list (the
                                      // graph copies it here; the balancer reads and clears it)
    std::vector<int32_t> resident;    // neuron ids, slot order; -1 for a slot given up and not refilled
    // the mapped share: the model's gate/up and the pack's down_t as tensors of the slots'
    // device whose data is the host rows' device address (no copy: the scheduler sees
    // device weights), and the maps above; n_mapped = 0: none, the graph has no such nodes
    ggml_tensor * map_gate = nullptr;
    ggml_tensor * map_up   = nullptr;
    ggml_tensor * map_down = nullptr;
    ggml_tensor * mapmap   = nullptr;
    ggml_tensor * mapdown  = nullptr;
    int64_t n_mapped = 0;
    std::vector<uint8_t> mapped;      // [n_ff] when a share was set: 1 for the neurons mapmap holds
    // page-locked, device-mapped I32 [n_ff + 2]: this layer's active list as predicted during
    // the layer before (flag, count, ids; ggml_kx_select_to_host), for the host-cache warm-up
    // (kx-warm.h) and the balancer's pipeline; plain host memory when the slots' device is the
    // CPU; nullptr where the device has no such memory
    int32_t * ahead = nullptr;
    // the load-aware thresholds' offsets (device, F32 [2]: resident, host side), read by the
    // predicted select when thresholds are on (kx-thresholds.h)
    ggml_tensor * thr_off = nullptr;
};

struct kx_slots {
    std::string device;               // ggml device name (CUDA0, or CPU for tests)
    bool on_host = false;             // the device is the CPU: its "device" part runs in the CPU split
    std::vector<kx_slot_layer> layers;
    ggml_context *        ctx_dev  = nullptr;
    ggml_context *        ctx_host = nullptr;
    ggml_backend_buffer_t buf_dev  = nullptr;
    ggml_backend_buffer_t buf_host = nullptr;
    size_t bytes_dev = 0;             // device memory held (counts against the VRAM budget)
    float    mapped_share = 0.0f;     // kx_slots_set_mapped_share's last share
    const kx_reload_iface * map_io = nullptr; // the engine that page-locks and maps host rows
    void *                  map_engine = nullptr;
    ggml_context *          ctx_map = nullptr;     // the aliases of the host weights
    std::vector<ggml_backend_buffer_t> map_bufs;   // one per alias: its device address range
    ggml_backend_buffer_t buf_ahead = nullptr;     // the layers' `ahead` lists
    ~kx_slots();
};

// layer il's list can be predicted during layer il-1 into host memory (kx_slot_layer::ahead):
// both layers are hybrid, and the predictor runs where the list's select runs (a device copy
// of it, unless the slots' device is the CPU); the pack's predictor is checked by the caller
inline bool kx_slots_list_ahead(const kx_slots & slots, int64_t il) {
    if (il <= 0 || il >= (int64_t) slots.layers.size()) {
        return false;
    }
    const kx_slot_layer & L = slots.layers[il];
    return slots.layers[il - 1].n_slots > 0 && L.n_slots > 0 && L.ahead && (slots.on_host || L.pred);
}

// The device slots for `device` live on (nullptr: the first GPU); throws when there is none.
ggml_backend_dev_t kx_slots_device(const char * device);
// Throws std::runtime_error with one sentence naming the type when dev's kernels cannot read
// slots of these row types (enum ggml_type), asked with the ops as the graphs build them.
void kx_slots_check_types(ggml_backend_dev_t dev, int32_t gate, int32_t up, int32_t down, int64_t n_embd,
                          int64_t n_ff);

// Builds slots for every layer with n_slots[il] > 0 (clamped to n_ff) on device `device`
// (nullptr: the first GPU). Throws std::runtime_error with one sentence on failure.
// faults: kx_params.faults (KX_FAULT_SLOTS refuses the slots' buffer).
std::unique_ptr<kx_slots> kx_slots_build(const llama_model & model, const kx_pack & pack,
                                         const std::vector<int64_t> & n_slots, const char * device,
                                         int32_t faults = 0);

// Neuron i back on the host side of layer L: the host maps point at its rows again (the
// caller clears its slot map entry).
void kx_slot_to_host(kx_slot_layer & L, const kx_pack_layer & pl, int32_t i);
// The three row copies that fill slot s with neuron i: gate and up rows from the model's
// host weights, the down row from the pack (through its row map).
void kx_slot_row_copies(const kx_slot_layer & L, const llama_layer & ml, const kx_pack_layer & pl, int32_t i,
                        int32_t s, kx_row_copy out[3]);

// The slots' device also computes a share of every hybrid layer's host-side neurons from the
// host rows over PCIe: the coldest resident-less neurons are taken in order of the pack's
// activation frequency, hottest first, until their summed frequency reaches `share` of the
// host side's (0 <= share < 1; 0 gives every host-side neuron back to the CPU). Between
// decodes only (the owner's rules: kx_hybrid_set_mapped_share). Throws std::runtime_error
// with one sentence (weight types the device's row kernels lack, a host range it cannot map).
void kx_slots_set_mapped_share(kx_slots & slots, const llama_model & model, const kx_pack & pack, float share);

// Replaces residents of layer il while no graph runs: the neurons in `evict` leave their
// slots (back to the host side of the split), the neurons in `admit` take the freed or empty
// slots, rows copied from the host weights. Every argument is checked before anything
// changes; throws std::runtime_error with one sentence on a bad request. This is the
// synchronous form of the balancer's reloads (the maps and rows it must keep consistent);
// the stream-ordered one builds on it.
void kx_slots_swap(kx_slots & slots, const llama_model & model, const kx_pack & pack, int32_t il,
                   const int32_t * evict, int32_t n_evict, const int32_t * admit, int32_t n_admit);
