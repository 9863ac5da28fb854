// The VRAM budget's arithmetic (include/kairox.h: kx_budget_*). python/kairox/budget.py is
// the readable reference, with the same numbers and messages; tests compare the two.
//
// The runtime measures, it does not model: the base is what the device lost between the
// reading before the model loaded and the one after the context was made (dense tensors,
// KV cache, compute buffers), and the run is checked again after a warm-up batch
// (kx-params.cpp).
#include "kairox.h"
#include "kx-pack.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

static constexpr int64_t kx_mib = 1 << 20;

static std::string kx_mib_str(int64_t b) {
    return kx_fmt("%.0f MiB", (double) b / kx_mib);
}

// 3%, at least 256 MiB (python: budget.margin_for, which says what was measured): the hybrid
// graph's buffers and what the first kernels take outside llama.cpp's buffers
int64_t kx_budget_margin(int64_t budget) {
    return std::max<int64_t>(256 * kx_mib, budget * 3 / 100);
}

int64_t kx_budget_auto_slots(int64_t budget, int64_t base, int64_t per_neuron, int64_t pred, int64_t n_layer,
                             int64_t n_ff, char * err, size_t err_size) {
    const int64_t margin = kx_budget_margin(budget);
    if (budget < base + margin) {
        kx_set_err(err, err_size, kx_fmt(
            "a VRAM budget of %s is too small: the dense tensors, KV cache and compute buffers alone took %s on "
            "the GPU, with a margin of %s. Give at least %s, or lower n_ctx / n_ubatch", kx_mib_str(budget).c_str(),
            kx_mib_str(base).c_str(), kx_mib_str(margin).c_str(), kx_mib_str(base + margin).c_str()));
        return -1;
    }
    if (per_neuron <= 0 || n_layer <= 0) {
        kx_set_err(err, err_size, "kx_budget_auto_slots: per_neuron and n_layer must be positive");
        return -1;
    }
    // no room for the slots' predictors: no slots, every FFN runs on the CPU
    const int64_t left = budget - margin - base - pred;
    return left < 0 ? 0 : std::min(n_ff, left / (per_neuron * n_layer));
}

int32_t kx_budget_auto_counts(int64_t budget, int64_t base, int64_t per_neuron, int64_t pred, int32_t n_layer,
                              int64_t n_ff, const float * freq, double cpu_gbs, double gpu_gbs, int64_t * counts,
                              char * err, size_t err_size) {
    const int64_t s = kx_budget_auto_slots(budget, base, per_neuron, pred, n_layer, n_ff, err, err_size);
    if (s < 0) {
        return 1;
    }
    std::fill(counts, counts + n_layer, s);
    const int64_t n = (int64_t) n_layer * n_ff;
    // a pack without measured frequencies (all 1) says nothing about which layer's neurons
    // are worth more: every layer gets the same count
    if (!freq || std::all_of(freq, freq + n, [](float f) { return f == 1.0f; })) {
        return 0;
    }
    const int64_t left = budget - kx_budget_margin(budget) - base - pred;
    if (left <= 0) {
        return 0; // s is 0: the predictors alone do not fit
    }
    const std::vector<double>  f(freq, freq + n);
    const std::vector<int64_t> groups((size_t) n_layer, n_ff), bytes((size_t) n_layer, per_neuron), rows((size_t) n_layer, 1);
    const std::vector<double>  cpu((size_t) n_layer, (cpu_gbs > 0 ? cpu_gbs : 100.0) * 1e9);
    const std::vector<double>  gpu((size_t) n_layer, (gpu_gbs > 0 ? gpu_gbs : 2000.0) * 1e9);
    if (kx_plan_slots(f.data(), groups.data(), bytes.data(), rows.data(), cpu.data(), gpu.data(), n_layer, left,
                      counts) < 0) {
        kx_set_err(err, err_size, "kx_budget_auto_counts: the slot solve refused its arguments");
        return 1;
    }
    // The solve stops where a layer's GPU side would become its critical path, by the rates
    // alone; the bytes it leaves go to every layer with room, as evenly as they allow: a layer
    // whose neurons all live on the GPU has no host part to wait for at all, which the rates do
    // not see (and the budget's bytes are otherwise unused)
    int64_t spare = left / per_neuron;
    for (int32_t i = 0; i < n_layer; ++i) {
        spare -= counts[i];
    }
    while (spare > 0) {
        int64_t live = 0;
        for (int32_t i = 0; i < n_layer; ++i) {
            live += counts[i] < n_ff;
        }
        if (live == 0) {
            break;
        }
        const int64_t k = (spare + live - 1) / live;
        for (int32_t i = 0; i < n_layer && spare > 0; ++i) {
            const int64_t take = std::min({ k, n_ff - counts[i], spare });
            counts[i] += take;
            spare -= take;
        }
    }
    return 0;
}

int32_t kx_budget_check_slots(int64_t budget, int64_t base, int64_t per_neuron, int64_t pred, int64_t n_ff,
                              const int64_t * counts, int32_t n_layer, char * err, size_t err_size) {
    int64_t neurons = 0;
    for (int32_t i = 0; i < n_layer; ++i) {
        neurons += std::min(counts[i], n_ff);
    }
    const int64_t need   = neurons * per_neuron + pred;
    const int64_t margin = kx_budget_margin(budget);
    if (base + need + margin <= budget) {
        return 0;
    }
    kx_set_err(err, err_size, kx_fmt(
        "the neuron slots asked for need %s (with the GPU predictors) beside the %s the dense tensors, KV cache and "
        "compute buffers took: %s with a margin of %s, over the budget of %s. Use fewer slots, or re-plan with "
        "`kairox plan --reserve %lldMiB` (the measured base)", kx_mib_str(need).c_str(), kx_mib_str(base).c_str(),
        kx_mib_str(base + need).c_str(), kx_mib_str(margin).c_str(), kx_mib_str(budget).c_str(),
        (long long) ((base + margin) / kx_mib)));
    return 1;
}

void kx_budget_shrink(int64_t * counts, int32_t n_layer, int64_t over, int64_t per_neuron) {
    int64_t need = (over + per_neuron - 1) / per_neuron; // neurons
    while (need > 0) {
        int64_t live = 0;
        for (int32_t i = 0; i < n_layer; ++i) {
            live += counts[i] > 0;
        }
        if (live == 0) {
            return;
        }
        const int64_t k = (need + live - 1) / live;
        for (int32_t i = 0; i < n_layer; ++i) {
            if (counts[i] > 0) {
                const int64_t take = std::min({k, counts[i], need});
                counts[i] -= take;
                need -= take;
            }
        }
    }
}
