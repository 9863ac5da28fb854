// A model's sparse FFN at run time, the object llama_model::kx_hybrid_ptr holds: the owner of
// its parts, each in files of its own, none of which knows this owner or another part's owner:
//   pack     (kx-pack.h)        immutable once loaded: the sidecar's tensors and statistics
//   slots    (kx-slots.h)       the mechanism: rows on a device, and the maps that split each
//                               active list between the device and the host
//   balancer (kx-balance.h)     a policy: moves neurons between the slots and the host side,
//                               between decodes or one layer ahead within one (the pipeline)
//   thr      (kx-thresholds.h)  a policy: the predictor's threshold per side, from the load
// The policies are handed the slots and the pack; the slots know neither policy. Rules that
// span parts live here: what a change of one does to the others, and the graphs' generation.
#pragma once

#include "kairox.h"
#include "kx-balance.h"
#include "kx-pack.h"
#include "kx-slots.h"
#include "kx-thresholds.h"
#include "kx-warm.h"

#include <cstdint>
#include <memory>
#include <vector>

struct llama_model;
struct kx_hybrid;

// what a pipeline graph node (kx-ffn.cpp) is handed: layer il of this hybrid; the node reads
// the balancer when it runs (the graph is rebuilt whenever the balancer changes kind)
struct kx_pipe_hook {
    kx_hybrid * hybrid  = nullptr;
    int32_t     il      = 0;
    bool        consume = false; // set at graph build: no warm-up of layer il reads its list
                                 // after the prefetch, so publish marks it used
    ggml_backend_t reader = nullptr; // set at graph build: the scheduler's backend of the slots'
                                     // device, whose stream publish queues the map stores on
};

// Members are destroyed in reverse order: the policies first (their reloads write the slots
// and read the host rows), then the slots, then the pack whose buffer the slots' maps name.
struct kx_hybrid {
    std::shared_ptr<kx_pack>       pack;
    std::unique_ptr<kx_slots>      slots;    // null: every neuron on the host
    std::unique_ptr<kx_balancer>   balancer; // null: the split stays as the slots were filled
    std::unique_ptr<kx_thresholds> thr;      // null: the pack's static thresholds
    std::vector<kx_pipe_hook>      hooks;    // one per model layer
    // one per model layer (kx-warm.h), written at graph build through the context's const view
    mutable std::vector<kx_warm_hook> warm;
    bool warm_on = true; // hybrid layers warm the host caches with the next layer's rows
                         // (kx_params::warm), read at each graph build
    // changes whenever graphs built before would be wrong: slots replaced, the mapped share,
    // the pipeline's nodes, the select's form (graph reuse compares it, llama_cparams)
    uint32_t graph_gen = 0;

    explicit kx_hybrid(std::shared_ptr<kx_pack> p);
    // graphs carry the pipeline's one-layer-ahead nodes; with the balancer's thread deciding,
    // one node rather than three
    bool pipeline() const { return balancer && balancer->params.pipeline && !balancer->held; }
    bool pipe_worker() const { return pipeline() && balancer->params.decide == KX_DECIDE_WORKER; }
};

// the model's hybrid, its pack and its slots; nullptr where there is none
kx_hybrid * kx_model_hybrid(const llama_model * model);
const kx_pack * kx_model_pack(const llama_model * model);
kx_slots * kx_model_slots(const llama_model * model);

// Replaces the slots (n_slots per model layer; an empty vector drops them). The policies
// acting on the old slots stop first. Throws std::runtime_error with one sentence.
void kx_hybrid_set_slots(kx_hybrid & h, const llama_model & model, const std::vector<int64_t> & n_slots,
                         const char * device, int32_t faults);
// Starts a balancer (replacing one that runs) or stops it (params nullptr). A balancer that
// moves neurons gives the device's mapped share back to the CPU first. Throws.
void kx_hybrid_set_balancer(kx_hybrid & h, const llama_model & model, const kx_balance_params * params);
// The mapped share of the host side (kx_slots_set_mapped_share); not while the balancer moves
// neurons (it knows nothing of this third place). Throws.
void kx_hybrid_set_mapped_share(kx_hybrid & h, const llama_model & model, float share);
// Load-aware thresholds on (budget >= 0) or off (< 0). Throws.
void kx_hybrid_set_thresholds(kx_hybrid & h, double budget);
// the model's balancer; nullptr where none runs
kx_balancer * kx_model_balancer(const llama_model * model);
// the context's graphs see the hybrid's current graph_gen (after a change of its parts)
void kx_context_refresh_sparse(llama_context * ctx);
// kx_model_set_slots with kx_params.faults
int32_t kx_model_set_slots_faults(llama_model * model, const int64_t * n_slots, int32_t n_layer, const char * device,
                                  int32_t faults, char * err, size_t err_size);
