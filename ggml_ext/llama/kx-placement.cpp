// Tensor-level placement under a VRAM budget on the load path (include/kairox.h:
// kx_model_params_apply_ctx); its knapsack is kx_plan_dense (kx-plan.cpp).
//
// The hybrid keeps every dense tensor (attention, norms, output head) on the GPU and fills
// what the budget leaves with neuron slots. When the dense tensors do not fit beside the KV
// cache and compute buffers, the budget is not refused: a dry run of the load (llama.cpp's
// no_alloc: tensors and buffers sized, nothing allocated) measures the KV cache and compute
// buffers for the context's parameters, and the knapsack keeps on the GPU the dense tensors
// that save the most time per byte, counting the hand-off a device switch between two
// consecutive tensors costs. Decode is memory-bound: a tensor costs bytes / rate per token.
// The choice is dry-run again, since moving tensors changes the compute buffers.
#include "kairox.h"
#include "kx-pack.h"
#include "kx-placement.h"

#include "llama-ext.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

std::pair<int, std::string> kx_tensor_layer(const std::string & name) {
    // by hand: a name is split for every tensor at every load
    constexpr size_t pre = 4; // "blk."
    if (name.compare(0, pre, "blk.") == 0) {
        size_t i = pre;
        int il = 0;
        while (i < name.size() && name[i] >= '0' && name[i] <= '9' && il < 1000000) {
            il = il * 10 + (name[i++] - '0');
        }
        if (i > pre && i + 1 < name.size() && name[i] == '.') {
            return { il, name.substr(i + 1) };
        }
    }
    return { -1, name };
}

std::string kx_regex_escape(const std::string & s) {
    std::string out;
    for (char c : s) {
        if (c != 0 && std::strchr(".^$|()[]{}*+?\\", c)) {
            out += '\\';
        }
        out += c;
    }
    return out;
}

kx_tensor_kinds kx_tensors_by_kind(const std::vector<std::string> & names) {
    kx_tensor_kinds g;
    for (const std::string & n : names) {
        const auto [il, kind] = kx_tensor_layer(n);
        if (il < 0) {
            g.other.push_back(n);
            continue;
        }
        if (!g.layers.count(kind)) {
            g.order.push_back(kind);
        }
        g.layers[kind].push_back(il);
    }
    return g;
}

// "attn_q.weight 0-11,14; output.weight": what a placement put on the CPU, by kind
std::string kx_names_text(const std::vector<std::string> & names) {
    kx_tensor_kinds g = kx_tensors_by_kind(names);
    std::string out;
    for (const std::string & k : g.order) {
        std::vector<int> & ids = g.layers[k];
        std::sort(ids.begin(), ids.end());
        std::string r;
        for (size_t a = 0; a < ids.size();) {
            size_t b = a;
            while (b + 1 < ids.size() && ids[b + 1] == ids[b] + 1) {
                ++b;
            }
            r += (r.empty() ? "" : ",") + (a == b ? std::to_string(ids[a]) : kx_fmt("%d-%d", ids[a], ids[b]));
            a = b + 1;
        }
        out += (out.empty() ? "" : "; ") + k + " " + r;
    }
    for (const std::string & n : g.other) {
        out += (out.empty() ? "" : "; ") + n;
    }
    return out;
}

kx_dense_rates kx_dense_rates_read(const std::string & path) {
    std::ifstream f(path);
    if (!f) {
        throw std::runtime_error(kx_fmt("cannot read the hardware profile %s: %s", path.c_str(), std::strerror(errno)));
    }
    kx_dense_rates r;
    try {
        const nlohmann::json j = nlohmann::json::parse(f);
        r.cpu_gbs = j.at("cpu_gbs").get<double>();
        r.gpu_gbs = j.at("gpu_gbs").get<double>();
        r.handoff_us = j.value("handoff_us", r.handoff_us);
        r.pcie_gbs   = j.value("pcie_gbs", r.pcie_gbs);
        for (const char * key : { "cpu_type_gbs", "gpu_type_gbs" }) {
            auto & m = key[0] == 'c' ? r.cpu_type_gbs : r.gpu_type_gbs;
            for (const auto & [type, gbs] : j.value(key, std::map<std::string, double>())) {
                m[kx_type_key(type)] = gbs;
            }
        }
        bool ok = r.cpu_gbs > 0 && r.gpu_gbs > 0 && r.pcie_gbs > 0 && r.handoff_us >= 0;
        for (const auto * m : { &r.cpu_type_gbs, &r.gpu_type_gbs }) {
            for (const auto & [type, gbs] : *m) {
                ok = ok && gbs > 0;
            }
        }
        if (!ok) {
            throw std::runtime_error("a rate that is not positive");
        }
    } catch (const std::exception & e) {
        throw std::runtime_error(kx_fmt("%s is not a kairox hardware profile (%s); write one with `kairox profile-hw`",
                                        path.c_str(), e.what()));
    }
    return r;
}

std::string kx_mib(int64_t b) {
    return kx_fmt("%.0f MiB", (double) b / (1 << 20));
}

// a device's host buffer types (CUDA_Host) name the device too: what counts is device memory
bool kx_buft_on_dev(ggml_backend_buffer_type_t buft, ggml_backend_dev_t dev) {
    return !ggml_backend_buft_is_host(buft) && ggml_backend_buft_get_device(buft) == dev;
}

kx_dev_bytes kx_dev_buffers(llama_context * ctx, ggml_backend_dev_t dev) {
    kx_dev_bytes b;
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
        if (kx_buft_on_dev(buft, dev)) {
            b.weights += (int64_t) mb.model;
            b.kv      += (int64_t) mb.context;
            b.compute += (int64_t) mb.compute;
        }
    }
    return b;
}

kx_place_item kx_place_item_of(const llama_model & model, const std::string & name, const ggml_tensor * t) {
    const llama_hparams & hp = model.hparams;
    const int il = kx_tensor_layer(name).first;
    const bool expert = t->ne[2] > 1 && name.find("_exps") != std::string::npos && hp.n_expert > 0 && il >= 0;
    return { name, (int64_t) ggml_nbytes(t), expert ? (double) hp.n_expert_used((uint32_t) il) / hp.n_expert : 1.0,
             kx_type_key(ggml_type_name(t->type)) };
}

kx_dry_sizes kx_dry_run(const llama_model_params & mp_in, const llama_context_params & cp, const char * model_path,
                        ggml_backend_dev_t dev) {
    // the dry run, quiet: llama.cpp's load log would repeat the real load's
    ggml_log_callback cb0 = nullptr;
    void * ud0 = nullptr;
    llama_log_get(&cb0, &ud0);
    struct quiet { ggml_log_callback cb; void * ud; } q = { cb0, ud0 };
    llama_log_set([](ggml_log_level level, const char * text, void * ud) {
        const quiet * q = (const quiet *) ud;
        if (level == GGML_LOG_LEVEL_ERROR && q->cb) {
            q->cb(level, text, q->ud);
        }
    }, &q);
    llama_model_params mp = mp_in;
    mp.no_alloc  = true;
    mp.load_mode = LLAMA_LOAD_MODE_NONE;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    llama_context * ctx = model ? llama_init_from_model(model, cp) : nullptr;
    llama_log_set(cb0, ud0);
    if (!ctx) {
        if (model) {
            llama_model_free(model);
        }
        throw std::runtime_error(kx_fmt("the VRAM budget's dry run could not %s %s", model ? "make a context for" : "load",
                                        model_path));
    }
    kx_dry_sizes d;
    static_cast<kx_dev_bytes &>(d) = kx_dev_buffers(ctx, dev);
    // the matrices on the device are the items; vectors (norms) stay with the fixed part
    for (const auto & [name, t] : model->tensors_by_name) {
        if (!t->buffer || !kx_buft_on_dev(ggml_backend_buffer_get_type(t->buffer), dev) || t->ne[1] <= 1) {
            continue;
        }
        d.items.push_back(kx_place_item_of(*model, name, t));
        d.movable += (int64_t) ggml_nbytes(t);
    }
    llama_free(ctx);
    llama_model_free(model);
    return d;
}

// A layer's execution as the placement's chain (kairox.plan.exec_rank and EXEC_PINS, the
// reference): the attention norm (on the GPU: its weight stays there), the attention's input
// projections, attention over the KV cache (on the GPU), its output projection, the FFN norm
// (on the GPU), the MoE router, the FFN's up side (gate and up, or the experts), its down
// side, anything else. Tensors of one rank run side by side on the same input and are one
// item: split over both devices they would pay a hand-off more for nothing (a layer's MoE
// experts are one item, as ATSInfer places them).
int kx_exec_rank(const std::string & kind) {
    auto starts = [&](const char * p) { return kind.compare(0, std::strlen(p), p) == 0; };
    if (starts("attn_")) {
        return starts("attn_output") ? 3 : 1;
    }
    if (starts("ffn_gate_inp")) {
        return 5;
    }
    if (starts("ffn_gate") || starts("ffn_up") || kind.find("_exps") != std::string::npos) {
        return 6;
    }
    return starts("ffn_down") ? 7 : 8;
}

// the ranks pinned to the GPU: the attention norm, attention itself, the FFN norm
static constexpr int kx_exec_pins[] = { 0, 2, 4 };

std::vector<kx_place_group> kx_place_groups(const std::vector<kx_place_item> & items) {
    constexpr int out_layer = std::numeric_limits<int>::max(); // the output head runs last
    std::map<std::pair<int, int>, std::vector<const kx_place_item *>> ranked;
    for (const kx_place_item & it : items) {
        const auto [il, kind] = kx_tensor_layer(it.name);
        ranked[il >= 0 ? std::make_pair(il, kx_exec_rank(kind))
                       : std::make_pair(it.name == "output.weight" ? out_layer : -1, 0)].push_back(&it);
    }
    std::vector<int> layers;
    for (const auto & [key, v] : ranked) {
        if (key.first >= 0 && key.first != out_layer && (layers.empty() || layers.back() != key.first)) {
            layers.push_back(key.first);
        }
    }
    std::vector<kx_place_group> out;
    for (int il : layers) {
        for (int rank : kx_exec_pins) {
            ranked[{ il, rank }].clear(); // a pin: marked by no tensors
        }
    }
    for (auto & [key, v] : ranked) {
        std::sort(v.begin(), v.end(), [](const kx_place_item * a, const kx_place_item * b) { return a->name < b->name; });
        if (v.empty()) {
            out.push_back({ {}, 0, 0.0, true });
            continue;
        }
        const bool alone = key.first < 0 || key.first == out_layer; // outside the layers: one item each
        for (const kx_place_item * it : v) {
            if (alone || out.empty() || it == v.front()) {
                out.push_back({ { it->name }, it->bytes, (double) it->bytes * it->read, false });
            } else {
                out.back().names.push_back(it->name);
                out.back().bytes += it->bytes;
                out.back().read_bytes += (double) it->bytes * it->read;
            }
        }
    }
    return out;
}

int32_t kx_place_order(const char * const * names, int32_t n, int32_t * group) {
    if (n < 0 || (n > 0 && (!names || !group))) {
        return -1;
    }
    std::vector<kx_place_item> items;
    std::map<std::string, int32_t> index;
    int32_t k = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (!names[i] || !index.emplace(names[i], i).second) {
            return -1; // a missing or repeated name
        }
        items.push_back({ names[i], 0, 1.0 });
    }
    for (const kx_place_group & g : kx_place_groups(items)) {
        for (const std::string & name : g.names) {
            group[index[name]] = k;
        }
        ++k;
    }
    return k;
}

bool kx_place_fits(const kx_dry_sizes & d, int64_t budget) {
    return d.total() + kx_budget_margin(budget) + kx_place_alloc_slack <= budget;
}

std::vector<std::string> kx_place_dense(const kx_dry_run_fn & dry, int64_t budget, const kx_dense_rates & rates,
                                        std::string * text) {
    const kx_dry_sizes d = dry({});
    const int64_t margin = kx_budget_margin(budget) + kx_place_alloc_slack;
    if (kx_place_fits(d, budget)) {
        return {}; // everything dense fits: the slots take what is left
    }
    const int64_t fixed = d.kv + d.compute + (d.weights - d.movable);
    if (fixed + margin > budget) {
        throw std::runtime_error(kx_fmt(
            "a VRAM budget of %s is too small: the KV cache (%s) and compute buffers (%s) alone take %s on the GPU "
            "with a margin of %s. Give at least %s, or lower n_ctx / n_ubatch", kx_mib(budget).c_str(),
            kx_mib(d.kv).c_str(), kx_mib(d.compute).c_str(), kx_mib(fixed).c_str(), kx_mib(margin).c_str(),
            kx_mib(fixed + margin).c_str()));
    }
    const std::vector<kx_place_group> items = kx_place_groups(d.items);
    const int32_t n = (int32_t) items.size();
    std::vector<int64_t> nb(n);
    std::vector<double> cpu(n), gpu(n);
    std::map<std::string, const kx_place_item *> by_name;
    for (const kx_place_item & it : d.items) {
        by_name[it.name] = &it;
    }
    for (int32_t i = 0; i < n; ++i) {
        nb[i]  = items[i].bytes;
        // summed tensor by tensor, as the reference does (equal tensors then tie the same way)
        cpu[i] = items[i].pinned ? std::numeric_limits<double>::infinity() : 0.0;
        gpu[i] = 0.0;
        for (const std::string & name : items[i].names) {
            const kx_place_item * it = by_name.at(name);
            cpu[i] += (double) it->bytes * it->read / (rates.cpu_of(it->type) * 1e9);
            gpu[i] += (double) it->bytes * it->read / (rates.gpu_of(it->type) * 1e9);
        }
    }
    // The compute buffers follow the choice: llama.cpp runs a batch of 32 tokens or more on
    // the GPU even when its weight is in host memory, copying the weight into the GPU's
    // compute buffer (op offload), so with host tensors the buffer holds a copy of the largest
    // (KB-7B SiLU F16 at 12 GiB on an H100: 6 MiB with everything on the GPU, 254 MiB with the
    // 250 MiB output head on the CPU). A dry run with the largest tensor alone on the CPU says
    // whether this context copies; then the choice is made once per tensor size as a cap on
    // what may leave the GPU (the items holding a larger tensor kept there, the cap's copy
    // charged), the fastest modelled one kept: a large tensor on the CPU saves its bytes once
    // and costs them again as the copy, so without the caps the head left the GPU and the
    // knapsack moved more beside it (1346 MiB, 0.76x llama.cpp's -ngl 31; 0.95x with them).
    // The winner is dry-run, and the room cut by what it was over (driver rounding, buffers
    // the model does not count), six rounds at most.
    std::vector<int64_t> caps;
    std::string largest;
    for (const kx_place_item & it : d.items) {
        caps.push_back(it.bytes);
        if (largest.empty() || it.bytes > by_name.at(largest)->bytes) {
            largest = it.name;
        }
    }
    std::sort(caps.rbegin(), caps.rend());
    caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
    // (with the FFN already on the host, as the hybrid's dry runs have it, the buffers hold its
    // copy before anything moves: a larger tensor's copy adds only what it is larger by)
    const int64_t grew   = dry({ largest }).compute - d.compute;
    const bool    copies = grew > kx_place_alloc_slack;
    const int64_t held   = copies ? std::max<int64_t>(0, by_name.at(largest)->bytes - grew) : 0;
    std::unique_ptr<bool[]> on_gpu(new bool[std::max(n, 1)]);
    std::vector<double> cpu_k(n);
    int64_t shave = 0;
    for (int round = 0; ; ++round) {
        double t_best = std::numeric_limits<double>::infinity();
        std::vector<std::string> cpu_names;
        int64_t cpu_bytes = 0;
        for (size_t k = 0; k < caps.size() && (k == 0 || copies); ++k) {
            for (int32_t i = 0; i < n; ++i) {
                cpu_k[i] = cpu[i];
                for (const std::string & name : items[i].names) {
                    if (by_name.at(name)->bytes > caps[k]) {
                        cpu_k[i] = std::numeric_limits<double>::infinity();
                    }
                }
            }
            const int64_t copy = copies ? std::max<int64_t>(0, caps[k] - held) : 0;
            const int64_t room = budget - margin - fixed - shave - copy;
            const double t = kx_plan_dense(nb.data(), cpu_k.data(), gpu.data(), n, room, kx_plan_dense_unit,
                                           rates.handoff_us * 1e-6 / 2, on_gpu.get());
            if (!(t < t_best)) {
                continue; // (or the items the cap keeps on the GPU do not fit: t is infinite)
            }
            t_best = t;
            cpu_names.clear();
            cpu_bytes = 0;
            for (int32_t i = 0; i < n; ++i) {
                if (!on_gpu[i]) {
                    cpu_names.insert(cpu_names.end(), items[i].names.begin(), items[i].names.end());
                    cpu_bytes += items[i].bytes;
                }
            }
        }
        const kx_dry_sizes got = dry(cpu_names);
        const int64_t over = got.total() + margin - budget;
        if (over <= 0 || round == 5 || cpu_bytes == d.movable) {
            if (over > 0) {
                throw std::runtime_error(kx_fmt(
                    "a VRAM budget of %s is too small: with %s of the dense tensors on the CPU, the rest (%s), the KV "
                    "cache (%s) and compute buffers (%s) take %s on the GPU with a margin of %s. Give at least %s, or "
                    "lower n_ctx / n_ubatch", kx_mib(budget).c_str(), kx_mib(cpu_bytes).c_str(),
                    kx_mib(got.weights).c_str(), kx_mib(got.kv).c_str(), kx_mib(got.compute).c_str(),
                    kx_mib(got.total()).c_str(), kx_mib(margin).c_str(), kx_mib(got.total() + margin).c_str()));
            }
            const std::string line = kx_fmt(
                "kairox: VRAM budget %s: the dense tensors (%s) do not fit beside the KV cache (%s) and compute buffers "
                "(%s, %s with these on the CPU); %zu of %d kept on the CPU (%s), modelled %.2f ms per token: %s\n",
                kx_mib(budget).c_str(), kx_mib(d.weights).c_str(), kx_mib(d.kv).c_str(), kx_mib(d.compute).c_str(),
                kx_mib(got.compute).c_str(), cpu_names.size(), (int) d.items.size(), kx_mib(cpu_bytes).c_str(),
                t_best * 1e3, kx_names_text(cpu_names).c_str());
            if (text) {
                *text = line;
            } else {
                LLAMA_LOG_INFO("%s", line.c_str());
            }
            return cpu_names;
        }
        // (a little more each round: a room cut by exactly the overshoot may land on another
        // choice just as far over)
        shave += over + (kx_plan_dense_unit << round);
    }
}
