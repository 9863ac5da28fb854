// A model's sparse FFN at run time (kx-hybrid.h): its parts' changes and what each does to
// the others.
#include "kx-hybrid.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <stdexcept>

kx_hybrid::kx_hybrid(std::shared_ptr<kx_pack> p) : pack(std::move(p)) {
    for (int64_t il = 0; il < pack->n_layer; ++il) {
        hooks.push_back({ this, (int32_t) il, false });
    }
    warm.resize(hooks.size());
}

kx_hybrid * kx_model_hybrid(const llama_model * model) {
    return model ? model->kx_hybrid_ptr.get() : nullptr;
}

const kx_pack * kx_model_pack(const llama_model * model) {
    const kx_hybrid * h = kx_model_hybrid(model);
    return h ? h->pack.get() : nullptr;
}

kx_slots * kx_model_slots(const llama_model * model) {
    const kx_hybrid * h = kx_model_hybrid(model);
    return h ? h->slots.get() : nullptr;
}

void kx_hybrid_set_slots(kx_hybrid & h, const llama_model & model, const std::vector<int64_t> & n_slots,
                         const char * device, int32_t faults) {
    h.thr.reset();
    h.balancer.reset();
    h.slots.reset();
    ++h.graph_gen; // graphs built before name the old slots' tensors
    if (!n_slots.empty()) {
        h.slots = kx_slots_build(model, *h.pack, n_slots, device, faults);
    }
}

void kx_hybrid_set_balancer(kx_hybrid & h, const llama_model & model, const kx_balance_params * params) {
    if (!h.slots) {
        throw std::runtime_error("the balancer needs neuron slots, and this model has none");
    }
    // graphs built before change: the pipeline's nodes come or go, and a layer with every neuron
    // in slots is its device part alone only without a balancer (kx-ffn.cpp); contexts rebuild
    // at their next balance
    ++h.graph_gen;
    h.balancer.reset();
    if (params && !params->observe && h.slots->mapped_share > 0.0f) {
        // the balancer moves neurons between the slots and the host side only: the mapped
        // share goes back to the CPU (contexts rebuild at their next balance); an observing
        // balancer moves nothing and leaves it
        LLAMA_LOG_INFO("kairox: the balancer starts: the device's mapped share of the host side goes back to the CPU\n");
        kx_hybrid_set_mapped_share(h, model, 0.0f);
    }
    if (params) {
        h.balancer = kx_balancer_new(*h.slots, model, *h.pack, *params);
    }
}

void kx_hybrid_set_mapped_share(kx_hybrid & h, const llama_model & model, float share) {
    if (!h.slots) {
        throw std::runtime_error("a mapped share needs neuron slots, and this model has none");
    }
    if (h.balancer && !h.balancer->params.observe && share > 0.0f) {
        throw std::runtime_error("the balancer runs on these slots: stop it before mapping host rows");
    }
    ++h.graph_gen; // graphs built before carry the former share's nodes
    kx_slots_set_mapped_share(*h.slots, model, *h.pack, share);
}

void kx_hybrid_set_thresholds(kx_hybrid & h, double budget) {
    if (budget >= 0 && !h.slots) {
        throw std::runtime_error("load-aware thresholds split the hybrid FFN: give GPU slots, a VRAM budget or a plan");
    }
    if (!h.slots) {
        return;
    }
    ++h.graph_gen; // the predicted select changes form (kx-ffn.cpp)
    h.thr = kx_thresholds_new(*h.slots, *h.pack, budget, h.balancer ? h.balancer->params.gpu_gbs : 0.0);
}
