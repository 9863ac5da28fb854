// One parameter set for the whole runtime (include/kairox.h: struct kx_params): the model
// parameters a hybrid placement needs, and everything set on a context after it is made
// (pack, slots under a VRAM budget or from a plan, sparse mode, mapped share, balancer,
// trace). The common tools and kairox.Llama both come here, so a choice means the same in
// every client.
#include "kairox.h"
#include "kx-context.h"
#include "kx-threads.h"
#include "kx-hybrid.h"
#include "kx-migrate.h"
#include "kx-pays.h"
#include "kx-placement.h"
#include "kx-stream.h"
#include "kx-trace.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

struct kx_params kx_params_default(void) {
    kx_params kp = {};
    kp.sparse = KX_SPARSE_AUTO;
    kp.gpu_slots = -1;
    kp.pinned = true;
    kp.warm = true;
    kp.stream = true;
    kp.migrate = false;
    kp.balancer = KX_BALANCER_OFF;
    // the balancer's defaults (python/kairox/balancer.py: BalancerConfig)
    kp.balance.tam = { 0.5f, 0.01f, 0.05f, 0.005f, 0.05f, 0.95f, 1, -1 };
    kp.balance.max_blocks = 32;
    // the back-off (python/kairox/backoff.py: BackoffConfig): on wherever a balancer runs
    kp.balance.backoff = { 16, 2, 0.0f, 4, 0.03f };
    kp.vram_free_at_load = -1;
    kp.error_budget = -1.0f; // load-aware thresholds off
    kp.fallback_dense = false; // what was asked runs, or the client stops
    kp.measure_gain = true;
    kp.whole_fits = false;
    // the decode threads (python/kairox/threads.py: ThreadsConfig), off until asked for
    kp.threads = { 0, 0.15, 256 };
    return kp;
}

bool kx_params_hybrid(const kx_params * kp) {
    return kp && (kp->vram_budget > 0 || kp->gpu_slots >= 0 || kp->n_gpu_slots_layers > 0 || (kp->plan && *kp->plan));
}

static int32_t kx_fail(char * err, size_t err_size, int32_t code, const std::string & msg) {
    kx_set_err(err, err_size, msg);
    return code;
}

int32_t kx_params_read_hw_profile(kx_params * kp, const char * path, char * err, size_t err_size) {
    if (!kp || !path || !*path) {
        return kx_fail(err, err_size, KX_ERR_PARAMS, "kx_params_read_hw_profile: kp and a path are required");
    }
    try {
        const kx_dense_rates r = kx_dense_rates_read(path);
        kp->balance.cpu_gbs = kp->balance.cpu_gbs > 0 ? kp->balance.cpu_gbs : r.cpu_gbs;
        kp->balance.gpu_gbs = kp->balance.gpu_gbs > 0 ? kp->balance.gpu_gbs : r.gpu_gbs;
    } catch (const std::exception & e) {
        return kx_fail(err, err_size, KX_ERR_PARAMS, e.what());
    }
    kp->hw_profile = path;
    return kx_fail(err, err_size, KX_OK, "");
}

static bool kx_slots_on_host(const kx_params * kp) {
    return kp->slots_device && strcasecmp(kp->slots_device, "CPU") == 0;
}

// the device the slots (and so the budget) live on; nullptr without one
static ggml_backend_dev_t kx_params_device(const kx_params * kp) {
    if (kp->slots_device && *kp->slots_device) {
        return ggml_backend_dev_by_name(kp->slots_device);
    }
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
}

// the GPU a VRAM budget is for; nullptr without one (this build or machine has none, or the
// slots were asked for on the CPU)
static ggml_backend_dev_t kx_budget_gpu(const kx_params * kp) {
    ggml_backend_dev_t dev = kx_slots_on_host(kp) ? nullptr : kx_params_device(kp);
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU ? dev : nullptr;
}

static int64_t kx_dev_free(ggml_backend_dev_t dev) {
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(dev, &free, &total);
    return (int64_t) free;
}

// ---------------------------------------------------------------- plan files
// What the runtime reads of a `kairox plan` file (python/kairox/plan.py: Plan)
struct kx_plan {
    std::string model;                  // the model file's name it was made for
    std::vector<int64_t> slot_neurons;  // per layer
    std::vector<std::string> dense_cpu; // dense tensors kept in host memory
};

static kx_plan kx_plan_read(const std::string & path) {
    std::ifstream f(path);
    if (!f) {
        throw std::runtime_error(kx_fmt("cannot read the plan %s: %s", path.c_str(), std::strerror(errno)));
    }
    kx_plan p;
    try {
        const nlohmann::json j = nlohmann::json::parse(f);
        p.model = j.at("model").get<std::string>();
        p.dense_cpu = j.at("dense_cpu").get<std::vector<std::string>>();
        p.slot_neurons = j.at("slot_neurons").get<std::vector<int64_t>>();
        if (p.slot_neurons.size() != j.at("slots").size()) {
            throw std::runtime_error("no per-layer slot counts");
        }
    } catch (const std::exception & e) {
        throw std::runtime_error(kx_fmt("%s is not a kairox plan file (%s); write one with `kairox plan`",
                                        path.c_str(), e.what()));
    }
    return p;
}

static std::string kx_basename(const std::string & path) {
    const size_t s = path.find_last_of('/');
    return s == std::string::npos ? path : path.substr(s + 1);
}

// ---------------------------------------------------------------- model parameters
// Patterns and override arrays handed to llama_model_params: they must outlive the load, and
// a process loads few models, so they live as long as the process.
static std::mutex kx_override_mu;
static std::deque<std::vector<std::string>> kx_override_patterns;
static std::deque<std::vector<llama_model_tensor_buft_override>> kx_override_arrays;

// A regex per tensor kind (^blk\.(3|7)\.attn_q\.weight$), so llama.cpp's per-tensor matching stays short
static std::vector<std::string> kx_cpu_patterns(const std::vector<std::string> & names, bool ffn = true) {
    // hybrid layers compute their FFN on the CPU from host weights (and copy the hot rows to
    // the GPU slots): the FFN tensors stay in host memory whatever -ngl offloads
    std::vector<std::string> pats;
    if (ffn) {
        pats.push_back("blk\\.\\d+\\.ffn_(gate|up|down)\\.weight");
    }
    const kx_tensor_kinds g = kx_tensors_by_kind(names);
    for (const std::string & k : g.order) {
        std::string ids;
        for (int il : g.layers.at(k)) {
            ids += (ids.empty() ? "" : "|") + std::to_string(il);
        }
        pats.push_back("^blk\\.(" + ids + ")\\." + kx_regex_escape(k) + "$");
    }
    for (const std::string & n : g.other) {
        pats.push_back("^" + kx_regex_escape(n) + "$");
    }
    return pats;
}

static std::string kx_pack_path_for(const std::string & model_path);

// the pack kp names, else MODEL.kxpack.gguf next to the model ("" without either)
static std::string kx_params_pack_path(const kx_params * kp, const char * model_path) {
    return kp->sparse_pack && *kp->sparse_pack ? kp->sparse_pack : model_path ? kx_pack_path_for(model_path) : "";
}

// A budget alone: none of the options that only the hybrid's slots can serve
static bool kx_params_budget_only(const kx_params * kp) {
    return kp->vram_budget > 0 && kp->gpu_slots < 0 && kp->n_gpu_slots_layers <= 0 && !(kp->plan && *kp->plan) &&
           kp->balancer == KX_BALANCER_OFF && kp->mapped_share <= 0.0f && kp->error_budget < 0.0f;
}

// A VRAM budget with nothing to put in neuron slots: `--sparse dense`, or the automatic mode
// and no pack (a model never prepared, an MoE model, a dense one). The budget then places
// whole tensors, the FFN's included (ATSInfer's tensor-level placement), and nothing else of
// kairox runs; slot counts, a plan, the balancer, a mapped share and thresholds need a pack.
// The same when the whole model fits the budget dense (kx_params::whole_fits).
static bool kx_params_tensors_only(const kx_params * kp, const char * model_path) {
    if (!kx_params_budget_only(kp)) {
        return false;
    }
    if (kp->sparse == KX_SPARSE_DENSE || kp->whole_fits) {
        return true;
    }
    const std::string pack = kx_params_pack_path(kp, model_path);
    return kp->sparse == KX_SPARSE_AUTO && !(kp->sparse_pack && *kp->sparse_pack) && !pack.empty() &&
           !std::ifstream(pack).good();
}

// Tensors matching pats go to buft, ahead of the caller's own overrides (kept after ours)
static void kx_override(llama_model_params * mp, std::vector<std::string> pats, ggml_backend_buffer_type_t buft) {
    std::lock_guard<std::mutex> lk(kx_override_mu);
    const std::vector<std::string> & kept = kx_override_patterns.emplace_back(std::move(pats));
    std::vector<llama_model_tensor_buft_override> & arr = kx_override_arrays.emplace_back();
    for (const std::string & p : kept) {
        arr.push_back({ p.c_str(), buft });
    }
    for (const llama_model_tensor_buft_override * o = mp->tensor_buft_overrides; o && o->pattern; ++o) {
        arr.push_back(*o);
    }
    arr.push_back({ nullptr, nullptr });
    mp->tensor_buft_overrides = arr.data();
}

// The FFN tensors of the layers predicted and threshold mode run sparse (ids), in plain host memory
// (kairox's huge-page buffers: an override to the CPU backend's own type would still be
// repacked, llama.cpp counts its extra types as CPU); the others keep whatever buffer
// llama.cpp picks (repacked where the CPU backend repacks)
static void kx_plain_ffn(llama_model_params * mp, const std::vector<int> & ids) {
    std::string alt;
    for (int il : ids) {
        alt += (alt.empty() ? "" : "|") + std::to_string(il);
    }
    kx_override(mp, { "^blk\\.(" + alt + ")\\.ffn_(gate|up|down)\\.weight$" }, kx_host_buffer_type(false, 0));
}

// A sparse run without the hybrid: unrepacked FFN weights for the layers it runs sparse; all
// of them unless the pack measured its lists. Exact mode lists what fires: on a ReLU model
// every layer runs sparse, on a gated one (every neuron fires) none. With measured lists, a
// layer runs sparse where its sparse FFN timed faster than llama.cpp's dense one on this CPU
// with the context's threads (kx-pays.h); the others keep llama.cpp's (repacked) weights.
static void kx_sparse_model_params(const kx_params * kp, llama_model_params * mp, const char * model_path,
                                   int32_t n_threads) {
    const std::string pack = kx_params_pack_path(kp, model_path);
    const kx_pack_preview pv = pack.empty() ? kx_pack_preview() : kx_pack_preview_read(pack);
    if (kp->sparse == KX_SPARSE_EXACT && !pv.activation.empty() && pv.activation != "relu") {
        return; // llama.cpp's weights as it loads them: the FFN runs dense
    }
    const std::vector<float> listed = kp->sparse == KX_SPARSE_EXACT ? std::vector<float>() : pv.listed;
    if (listed.empty()) {
        mp->use_extra_bufts = false; // repacked rows are interleaved: row gathers cannot read them
        return;
    }
    // the mode kx_context_apply will pick (predicted where the pack has a predictor)
    const int32_t mode = kp->sparse == KX_SPARSE_THRESHOLD || !pv.predictor ? KX_SPARSE_THRESHOLD : KX_SPARSE_PREDICTED;
    std::vector<float> ratio;
    try {
        if (kp->measure_gain && model_path) {
            ratio = kx_pays_measure(model_path, pack, mode, n_threads);
        }
    } catch (const std::exception & e) {
        LLAMA_LOG_WARN("kairox: could not time the sparse FFN on this CPU (%s); layers listing under %.0f%% of "
                       "their neurons run sparse\n", e.what(), 100.0 * kx_max_density);
    }
    std::vector<bool> pays(listed.size());
    std::vector<int> ids;
    for (size_t il = 0; il < listed.size(); ++il) {
        pays[il] = kx_layer_pays(listed[il]) && (il >= ratio.size() || ratio[il] < kx_pays_max_ratio);
        if (pays[il]) {
            ids.push_back((int) il);
        }
    }
    if (model_path) {
        kx_pays_remember(model_path, pack, pays);
    }
    if (!ids.empty()) {
        kx_plain_ffn(mp, ids);
    }
}

// GPU slots over row types the device cannot read, refused before the model loads (the slot
// build asks the same again, for callers that place slots later)
static void kx_check_slot_types(const kx_params * kp, const char * model_path) {
    if (!model_path) {
        return;
    }
    ggml_backend_dev_t dev = nullptr;
    try {
        dev = kx_slots_device(kp->slots_device && *kp->slots_device ? kp->slots_device : nullptr);
    } catch (const std::exception &) {
        return; // no such device: the context's apply says so
    }
    int64_t n_embd = 0, n_ff = 0;
    std::vector<int32_t> checked;
    for (const kx_slot_types & t : kx_slot_types_read(model_path, kx_params_pack_path(kp, model_path), &n_embd, &n_ff)) {
        const int32_t key = t.gate | t.up << 8 | t.down << 16;
        if (std::find(checked.begin(), checked.end(), key) == checked.end()) {
            kx_slots_check_types(dev, t.gate, t.up, t.down, n_embd, n_ff);
            checked.push_back(key);
        }
    }
}

int32_t kx_sparse_cost(const char * model_path, const char * pack_path, int32_t mode, int32_t n_threads,
                       float * ratio, int32_t n_layer, char * err, size_t err_size) {
    if (!model_path || !ratio || (mode != KX_SPARSE_PREDICTED && mode != KX_SPARSE_THRESHOLD)) {
        return kx_fail(err, err_size, KX_ERR_PARAMS, "kx_sparse_cost: a model, ratio[] and a predicted or threshold mode");
    }
    kx_params kp = kx_params_default();
    kp.sparse_pack = pack_path;
    const std::string pack = kx_params_pack_path(&kp, model_path);
    try {
        const std::vector<float> r = kx_pays_measure(model_path, pack, mode, n_threads);
        if ((int32_t) r.size() != n_layer) {
            return kx_fail(err, err_size, KX_ERR_PACK, kx_fmt("the pack %s lists %d layers, not %d (or no densities)",
                                                              pack.c_str(), (int) r.size(), n_layer));
        }
        std::copy(r.begin(), r.end(), ratio);
    } catch (const std::exception & e) {
        return kx_fail(err, err_size, KX_ERR_PACK, e.what());
    }
    return kx_fail(err, err_size, KX_OK, "");
}

int32_t kx_model_params_apply(kx_params * kp, llama_model_params * mp, char * err, size_t err_size) {
    return kx_model_params_apply_model(kp, mp, nullptr, err, err_size);
}

int32_t kx_model_params_apply_model(kx_params * kp, llama_model_params * mp, const char * model_path, char * err,
                                    size_t err_size) {
    return kx_model_params_apply_ctx(kp, mp, nullptr, model_path, err, err_size);
}

// what a placement's dry runs cost the load: each loads the model's metadata (the vocabulary
// among them: ~0.4 s for Gemma 3's 262k tokens on a CPU host) and sizes a context
struct kx_dry_tally {
    int32_t n = 0;
    double  s = 0.0;
};

// A dry run of the load (kx-placement.cpp) with these tensors, and the FFN when ffn_on_host, in
// host memory, then the caller's own overrides, as the real load will have them; counted in
// *tally when given
static kx_dry_run_fn kx_budget_dry(const llama_model_params & mp, const llama_context_params * cp,
                                   const char * model_path, ggml_backend_dev_t dev, bool ffn_on_host,
                                   kx_dry_tally * tally = nullptr) {
    const llama_context_params cparams = cp ? *cp : llama_context_default_params();
    return [=](const std::vector<std::string> & names) {
        const int64_t t0 = ggml_time_us();
        const std::vector<std::string> pats = kx_cpu_patterns(names, ffn_on_host);
        std::vector<llama_model_tensor_buft_override> ov;
        for (const std::string & p : pats) {
            ov.push_back({ p.c_str(), ggml_backend_cpu_buffer_type() });
        }
        for (const llama_model_tensor_buft_override * o = mp.tensor_buft_overrides; o && o->pattern; ++o) {
            ov.push_back(*o);
        }
        ov.push_back({ nullptr, nullptr });
        llama_model_params m = mp;
        m.tensor_buft_overrides = ov.data();
        m.use_extra_bufts = false;
        kx_dry_sizes d = kx_dry_run(m, cparams, model_path, dev);
        if (tally) {
            tally->n += 1;
            tally->s += (double) (ggml_time_us() - t0) * 1e-6;
        }
        return d;
    };
}

static kx_dense_rates kx_params_rates(const kx_params * kp) {
    kx_dense_rates rates = kp->hw_profile && *kp->hw_profile ? kx_dense_rates_read(kp->hw_profile) : kx_dense_rates();
    if (kp->balance.cpu_gbs > 0) {
        rates.cpu_gbs = kp->balance.cpu_gbs;
    }
    if (kp->balance.gpu_gbs > 0) {
        rates.gpu_gbs = kp->balance.gpu_gbs;
    }
    return rates;
}

// The dense tensors that must wait on the CPU for the budget (kx-placement.cpp)
static std::vector<std::string> kx_budget_dense_cpu(const kx_params * kp, const llama_model_params & mp,
                                                    const llama_context_params * cp, const char * model_path,
                                                    ggml_backend_dev_t dev, bool ffn_on_host) {
    return kx_place_dense(kx_budget_dry(mp, cp, model_path, dev, ffn_on_host), kp->vram_budget, kx_params_rates(kp));
}

// page-locked host weights are read, not mapped: llama.cpp keeps mapped weights in pageable
// CPU buffers whatever an override asks (no host buffer with mmap)
static void kx_read_not_map(llama_model_params * mp) {
    switch (mp->load_mode) {
        case LLAMA_LOAD_MODE_MMAP_MLOCK: mp->load_mode = LLAMA_LOAD_MODE_MLOCK; break;
        case LLAMA_LOAD_MODE_MLOCK:
        case LLAMA_LOAD_MODE_DIRECT_IO:  break;
        default:                         mp->load_mode = LLAMA_LOAD_MODE_NONE; break;
    }
}

// A budget of whole tensors: the knapsack's host tensors, and with kp->stream the ones the GPU
// streams (kx-stream.h) in page-locked host memory, plain; the others as llama.cpp places
// them on the CPU (repacked as it would for -ot ...=CPU; page-locked with kp->pinned)
static void kx_budget_tensors(const kx_params * kp, llama_model_params * mp, const llama_context_params * cp,
                              const char * model_path, ggml_backend_dev_t dev) {
    kx_dry_tally tally;
    const kx_dry_run_fn dry = kx_budget_dry(*mp, cp, model_path, dev, false, &tally);
    const kx_dense_rates rates = kx_params_rates(kp);
    struct log_tally { // at every return below: what the placement cost the load
        const kx_dry_tally & t;
        ~log_tally() {
            if (t.n > 1) {
                LLAMA_LOG_INFO("kairox: the placement took %.2f s in %d dry runs of the load\n", t.s, t.n);
            }
        }
    } log_at_end{ tally };
    if (kp->pinned) {
        // read, not mapped: llama.cpp then keeps host tensors in the GPU's page-locked host
        // buffer type, which a prompt batch's offload copies at PCIe speed (KB-7B SiLU F16 at
        // 4-7 GiB: prefill 512 4.6-5.8x the mapped load), and streamed tensors need it
        kx_read_not_map(mp);
    }
    if (!kp->stream || !kp->pinned) {
        const std::vector<std::string> cpu = kx_place_dense(dry, kp->vram_budget, rates);
        if (!cpu.empty()) {
            kx_override(mp, kx_cpu_patterns(cpu, false), ggml_backend_cpu_buffer_type());
        }
        return;
    }
    const kx_stream_choice c = kx_stream_choose(dry, kp->vram_budget, rates);
    LLAMA_LOG_INFO("%s", c.placed.c_str());
    // with migration every tensor a slot holds may stream later: all of them plain and
    // page-locked; without, the others as llama.cpp places them (repacked where it does)
    const std::vector<std::string> & plain = kp->migrate ? c.slotted : c.streamed;
    std::vector<std::string> rest;
    for (const std::string & n : c.cpu) {
        if (std::find(plain.begin(), plain.end(), n) == plain.end()) {
            rest.push_back(n);
        }
    }
    if (!rest.empty()) {
        kx_override(mp, kx_cpu_patterns(rest, false), ggml_backend_cpu_buffer_type());
    }
    if (c.streamed.empty()) {
        return;
    }
    LLAMA_LOG_INFO("kairox: the GPU streams %zu of the %zu host tensors through a %s scratch (the budget above is "
                   "less it) beside the CPU's work, modelled %.2f ms per token against %.2f without: %s\n", c.streamed.size(), c.cpu.size(),
                   kx_mib(c.scratch).c_str(), c.step_s * 1e3, c.plain_s * 1e3, kx_names_text(c.streamed).c_str());
    kx_override(mp, kx_cpu_patterns(plain, false), kx_host_buffer_type(true, kp->faults));
}

int32_t kx_model_params_apply_ctx(kx_params * kp, llama_model_params * mp, const llama_context_params * cp,
                                  const char * model_path, char * err, size_t err_size) {
    if (!kp || !mp) {
        return kx_fail(err, err_size, KX_ERR_PARAMS, "kx_model_params_apply: kp and mp are required");
    }
    kp->vram_free_at_load = -1;
    kp->whole_fits = false;
    if (kp->sched_trace && *kp->sched_trace && kx_trace_start(kp->sched_trace, kp->sched_trace_max) != 0) {
        return kx_fail(err, err_size, KX_ERR_PARAMS, kx_fmt("cannot record the scheduler trace to %s (one file per "
                                                            "process, and its records must fit in memory)", kp->sched_trace));
    }
    if (kp->hw_profile && *kp->hw_profile) {
        try {
            kx_dense_rates_read(kp->hw_profile); // (read again where the rates are used: a small file)
        } catch (const std::exception & e) {
            return kx_fail(err, err_size, KX_ERR_PARAMS, e.what());
        }
    }
    if (!kx_params_hybrid(kp)) {
        if (kp->sparse > KX_SPARSE_DENSE || (kp->sparse == KX_SPARSE_AUTO && kp->sparse_pack && *kp->sparse_pack)) {
            kx_sparse_model_params(kp, mp, model_path, (cp ? *cp : llama_context_default_params()).n_threads);
        }
        return kx_fail(err, err_size, KX_OK, "");
    }
    if (kx_params_tensors_only(kp, model_path)) {
        // whole tensors under the budget, the FFN's among them: what does not fit loads on the
        // CPU side (llama.cpp repacks it there as it would for -ot ...=CPU)
        ggml_backend_dev_t dev = kx_budget_gpu(kp);
        if (!dev) {
            return kx_fail(err, err_size, KX_ERR_PARAMS, "a VRAM budget needs a GPU, and this build or machine has none");
        }
        kp->vram_free_at_load = kx_dev_free(dev);
        try {
            kx_budget_tensors(kp, mp, cp, model_path, dev);
        } catch (const std::exception & e) {
            return kx_fail(err, err_size, KX_ERR_BUDGET, e.what());
        }
        return kx_fail(err, err_size, KX_OK, "");
    }
    if (kp->sparse == KX_SPARSE_AUTO && kx_params_budget_only(kp) && model_path) {
        // the whole model dense under the budget: no split (kx_params::whole_fits)
        if (ggml_backend_dev_t dev = kx_budget_gpu(kp)) {
            const int64_t free0 = kx_dev_free(dev);
            try {
                const kx_dry_sizes d = kx_budget_dry(*mp, cp, model_path, dev, false)({});
                if (kx_place_fits(d, kp->vram_budget)) {
                    kp->whole_fits = true;
                    kp->vram_free_at_load = free0;
                    LLAMA_LOG_INFO("kairox: the whole model fits the VRAM budget dense (%s of %s with the margin): it runs "
                                   "on the GPU as llama.cpp does with every layer offloaded, not split (give --sparse "
                                   "predicted to split it anyway)\n",
                                   kx_mib(d.total() + kx_budget_margin(kp->vram_budget)).c_str(),
                                   kx_mib(kp->vram_budget).c_str());
                    return kx_fail(err, err_size, KX_OK, "");
                }
            } catch (const std::exception &) {
                // the split's own placement below says what does not fit
            }
        }
    }
    try {
        kx_check_slot_types(kp, model_path);
    } catch (const std::exception & e) {
        return kx_fail(err, err_size, KX_ERR_PARAMS, e.what());
    }
    std::vector<std::string> dense_cpu;
    if (kp->plan && *kp->plan) {
        try {
            dense_cpu = kx_plan_read(kp->plan).dense_cpu;
        } catch (const std::exception & e) {
            return kx_fail(err, err_size, KX_ERR_PARAMS, e.what());
        }
    }
    const bool pinned = kp->pinned && !kx_slots_on_host(kp);
    if (kp->vram_budget > 0) {
        ggml_backend_dev_t dev = kx_budget_gpu(kp);
        if (!dev) {
            return kx_fail(err, err_size, KX_ERR_PARAMS,
                           "a VRAM budget needs a GPU, and this build or machine has none; give a slot count "
                           "(--gpu-slots) with the slots on the CPU to run the split without one");
        }
        kp->vram_free_at_load = kx_dev_free(dev);
        if (dense_cpu.empty() && model_path) {
            try {
                dense_cpu = kx_budget_dense_cpu(kp, *mp, cp, model_path, dev, true);
            } catch (const std::exception & e) {
                return kx_fail(err, err_size, KX_ERR_BUDGET, e.what());
            }
        }
    }
    ggml_backend_buffer_type_t host = pinned ? kx_host_buffer_type(true, kp->faults)
        : ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
    // the caller's own overrides after ours: the FFN must be in host memory for the split
    kx_override(mp, kx_cpu_patterns(dense_cpu), host);
    mp->use_extra_bufts = false;
    if (pinned) {
        kx_read_not_map(mp);
    }
    return kx_fail(err, err_size, KX_OK, "");
}

// ---------------------------------------------------------------- the context
static std::string kx_pack_path_for(const std::string & model_path) {
    const size_t slash = model_path.find_last_of('/');
    const size_t start = slash == std::string::npos ? 0 : slash + 1;
    std::string stem = model_path;
    if (stem.size() - start > 5 && strcasecmp(stem.c_str() + stem.size() - 5, ".gguf") == 0) {
        stem.resize(stem.size() - 5);
    }
    return stem + ".kxpack.gguf";
}

// bytes one slot holds (gate + up + down rows) and the GPU predictors with their maps (python: plan.slot_costs)
struct kx_slot_costs {
    int64_t per_neuron = 0;
    int64_t pred = 0;
    int64_t n_ff = 0;
};

static kx_slot_costs kx_slot_costs_of(const llama_model & model, const kx_pack & pack) {
    kx_slot_costs c;
    const llama_layer & l0 = model.layers.at(0);
    if (!l0.ffn_gate || !l0.ffn_up || pack.layers.empty() || !pack.layers[0].down_t) {
        throw std::runtime_error("this model has no gated FFN with a pack down projection; it cannot have neuron slots");
    }
    c.n_ff = pack.n_ff;
    c.per_neuron = (int64_t) (l0.ffn_gate->nb[1] + l0.ffn_up->nb[1] + pack.layers[0].down_t->nb[1]);
    for (size_t il = 0; il < pack.layers.size(); ++il) {
        // layer 0's ahead predictor stays in the pack: no layer lists layer 0 (kx_slots_list_ahead)
        c.pred += pack.layers[il].pred.nbytes() + (il > 0 ? pack.layers[il].pred_ahead.nbytes() : 0);
    }
    c.pred += pack.n_layer * 4 * pack.n_ff;
    return c;
}

static std::string kx_vram_text(const kx_vram_report & v) {
    auto mib = [](int64_t b) { return kx_fmt("%.0f MiB", (double) b / (1 << 20)); };
    return kx_fmt("VRAM %s of %s: base %s (dense tensors, KV cache, compute buffers), slots %s (%lld neurons), "
                  "rest %s (%s)", mib(v.used).c_str(), mib(v.budget).c_str(),
                  mib(v.base).c_str(), mib(v.slots).c_str(), (long long) v.n_slots,
                  mib(v.used - v.base - v.slots).c_str(),
                  v.n_slots > 0 ? "predictors, maps, workspaces" : "workspaces and pools");
}

// llama.cpp's own buffers on dev: what the measured base and use hold beyond them is pools,
// workspaces and kairox's own (slots, predictors)
static std::string kx_dev_buffers_text(llama_context * ctx, ggml_backend_dev_t dev) {
    const kx_dev_bytes b = kx_dev_buffers(ctx, dev);
    auto mib = [](int64_t x) { return kx_fmt("%.0f MiB", (double) x / (1 << 20)); };
    return kx_fmt("model %s, KV cache %s, compute %s", mib(b.weights).c_str(), mib(b.kv).c_str(), mib(b.compute).c_str());
}

// device memory in use after one full batch (the largest graph) and one decode step; the
// context is left empty (memory cleared, timings reset)
static int64_t kx_warm_used(llama_context * ctx, ggml_backend_dev_t dev, int64_t free0) {
    const llama_vocab * vocab = llama_model_get_vocab(&ctx->get_model());
    llama_token tok = llama_vocab_bos(vocab);
    if (tok == LLAMA_TOKEN_NULL) {
        tok = 0;
    }
    // one sequence's context bounds the batch (a server's slots split the context between them)
    const int32_t n = std::max<int32_t>(1, std::min<int32_t>((int32_t) llama_n_ubatch(ctx), (int32_t) llama_n_ctx_seq(ctx) - 2));
    std::vector<llama_token> toks((size_t) n, tok);
    if (llama_decode(ctx, llama_batch_get_one(toks.data(), n)) != 0 || llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
        throw std::runtime_error("the warm-up batch of the VRAM budget failed to decode");
    }
    llama_synchronize(ctx);
    const int64_t used = free0 - kx_dev_free(dev);
    llama_memory_clear(llama_get_memory(ctx), true);
    llama_perf_context_reset(ctx);
    return used;
}

namespace {
// a failure with its kx_status
struct kx_apply_error : std::runtime_error {
    int32_t code;
    kx_apply_error(int32_t c, const std::string & m) : std::runtime_error(m), code(c) {}
};
}

static void kx_check(int32_t rc, int32_t code, const char * what, const char * err) {
    if (rc != 0) {
        throw kx_apply_error(code, std::string(what) + err);
    }
}

static void kx_params_validate(const kx_params * kp, bool hybrid) {
    auto bad = [](const std::string & m) { throw kx_apply_error(KX_ERR_PARAMS, m); };
    if (kp->sparse < KX_SPARSE_AUTO || kp->sparse > KX_SPARSE_THRESHOLD) {
        bad(kx_fmt("unknown sparse mode %d (-1 auto, 0 dense, 1 exact, 2 predicted, 3 threshold)", kp->sparse));
    }
    if (kp->vram_budget < 0) {
        bad("the VRAM budget must be a size > 0");
    }
    if (!(kp->mapped_share >= 0.0f && kp->mapped_share < 1.0f)) {
        bad(kx_fmt("the mapped share must be in [0, 1), not %g", (double) kp->mapped_share));
    }
    if (kp->balancer < KX_BALANCER_OFF || kp->balancer > KX_BALANCER_ADAPTIVE) {
        bad(kx_fmt("unknown balancer mode %d (0 off, 1 fixed, 2 adaptive)", kp->balancer));
    }
    const kx_tam_config & t = kp->balance.tam;
    if (kp->balancer != KX_BALANCER_OFF && !(0 < t.lam_min && t.lam_min <= t.lam && t.lam <= t.lam_max && t.lam_max < 1)) {
        bad(kx_fmt("the balancer's lambda must lie in [%g, %g], not %g", (double) t.lam_min, (double) t.lam_max, (double) t.lam));
    }
    if (hybrid && kp->sparse == KX_SPARSE_DENSE) {
        bad("GPU slots, a VRAM budget and a plan place FFN neurons on the GPU: they need a sparse mode "
            "(exact or predicted), not dense");
    }
    if (kp->gpu_slots >= 0 && kp->n_gpu_slots_layers > 0) {
        bad("give one slot count for every layer or one per layer, not both");
    }
    if ((kp->gpu_slots >= 0 || kp->n_gpu_slots_layers > 0) && kp->plan && *kp->plan) {
        bad("give either GPU slot counts or a plan (the plan holds the slot counts), not both");
    }
    if (kp->balancer != KX_BALANCER_OFF && !hybrid) {
        bad("the balancer moves neurons between GPU slots and the CPU: give GPU slots, a VRAM budget or a plan");
    }
    if (kp->balance.pipeline && kp->balancer == KX_BALANCER_OFF) {
        bad("the balancer's pipeline is a mode of the live balancer: turn the balancer on too");
    }
    if (kp->mapped_share > 0.0f && !hybrid) {
        bad("a mapped share splits the host side of the hybrid FFN: give GPU slots, a VRAM budget or a plan");
    }
    if (kp->mapped_share > 0.0f && kp->balancer != KX_BALANCER_OFF) {
        bad("a mapped share and the balancer do not mix: the balancer moves neurons between the GPU slots and the CPU only");
    }
    if (kp->trace && *kp->trace && kp->balancer == KX_BALANCER_OFF) {
        bad("a balancer trace needs the balancer: turn it on (fixed or adaptive)");
    }
    if (!std::isfinite(kp->error_budget)) {
        bad(kx_fmt("the error budget must be a number (< 0: off), not %g", (double) kp->error_budget));
    }
    if (kp->error_budget >= 0.0f && !hybrid) {
        bad("load-aware thresholds split the hybrid FFN: give GPU slots, a VRAM budget or a plan");
    }
    if (kp->error_budget >= 0.0f && (kp->sparse == KX_SPARSE_EXACT || kp->sparse == KX_SPARSE_THRESHOLD)) {
        bad("load-aware thresholds move the predictor's thresholds: they need the predicted mode");
    }
}

// the load-aware thresholds, afresh (a warm-up's measurements are not the run's)
static void kx_start_thresholds(llama_context * ctx, const kx_params * kp) {
    if (kp->error_budget >= 0.0f) {
        char e[1024];
        kx_check(kx_context_set_error_budget(ctx, kp->error_budget, e, sizeof(e)), KX_ERR_PARAMS,
                 "load-aware thresholds: ", e);
    }
}

static void kx_start_balancer(llama_model * model, const kx_params * kp) {
    if (kp->balancer == KX_BALANCER_OFF) {
        return;
    }
    kx_balance_params bp = kp->balance;
    bp.tam.adaptive = kp->balancer == KX_BALANCER_ADAPTIVE;
    char e[1024];
    kx_check(kx_model_balancer_start(model, &bp, e, sizeof(e)), KX_ERR_PARAMS, "the balancer: ", e);
}

// slots, mode, share, balancer: the hybrid on these counts
static void kx_place(llama_context * ctx, llama_model * model, const kx_params * kp, const std::vector<int64_t> & counts,
                     int32_t mode, int32_t refuse) {
    char e[1024];
    kx_check(kx_model_set_slots_faults(model, counts.data(), (int32_t) counts.size(), kp->slots_device, kp->faults,
                                       e, sizeof(e)), refuse, "neuron slots: ", e);
    kx_model_hybrid(model)->warm_on = kp->warm; // (set: the call above succeeded)
    kx_check(kx_context_set_sparse(ctx, mode, e, sizeof(e)), refuse, "", e);
    if (kp->mapped_share > 0.0f) {
        kx_check(kx_context_set_mapped_share(ctx, kp->mapped_share, e, sizeof(e)), KX_ERR_PARAMS, "", e);
    }
    kx_start_balancer(model, kp);
    kx_start_thresholds(ctx, kp);
}

// the budget's readings kept with the context, then checked: over the budget after the
// warm-up refuses, naming llama.cpp's device buffers; else one log line (what: its opening)
static void kx_vram_keep(llama_context * ctx, ggml_backend_dev_t dev, const kx_vram_report & v, const char * what) {
    kx_ctx_state & st = kx_ctx_state_of(ctx);
    st.vram = v;
    st.has_vram = true;
    if (v.used > v.budget) {
        throw kx_apply_error(KX_ERR_BUDGET, "over the VRAM budget after a warm-up batch: " + kx_vram_text(v) +
                                            "; llama.cpp's buffers there now: " + kx_dev_buffers_text(ctx, dev));
    }
    LLAMA_LOG_INFO("kairox: %s%s; llama.cpp's buffers there: %s\n", what, kx_vram_text(v).c_str(),
                   kx_dev_buffers_text(ctx, dev).c_str());
}

// a budget of whole tensors (kx_params_tensors_only): the placement was made before the load;
// here the same readings as the hybrid's, checked after a warm-up batch
static void kx_apply_tensors_only(llama_context * ctx, const kx_params * kp) {
    ggml_backend_dev_t dev = kx_params_device(kp);
    if (!dev || kp->vram_free_at_load < 0) {
        throw kx_apply_error(KX_ERR_PARAMS, "a VRAM budget is measured from before the model loads: load it with "
                                            "parameters from kx_model_params_apply");
    }
    kx_ctx_state & st = kx_ctx_state_of(ctx);
    st.stream.reset();
    try {
        const kx_stream_migrate mc = { kp->migrate, kx_params_rates(kp) };
        st.stream = kp->stream && kp->pinned ? kx_stream_start(ctx, dev, kx_host_buffer_type(true, kp->faults), mc) : nullptr;
    } catch (const std::exception & e) {
        throw kx_apply_error(KX_ERR_PARAMS, e.what());
    }
    kx_vram_report v = {};
    v.budget = kp->vram_budget;
    v.base   = kp->vram_free_at_load - kx_dev_free(dev);
    v.used   = kx_warm_used(ctx, dev, kp->vram_free_at_load);
    const std::string streamed = !st.stream ? "" : kx_fmt("%d streamed through a %s scratch%s; ", st.stream->n_on(),
        kx_mib(st.stream->slot_bytes * st.stream->n_slots).c_str(),
        st.stream->migrate ? kx_fmt(", %zu with migration", st.stream->items.size()).c_str() : "");
    kx_vram_keep(ctx, dev, v, ((kp->whole_fits ? "the whole model fits the VRAM budget dense; "
                                                : "no sparse pack: the VRAM budget places whole tensors, the FFN's among them; ") +
                               streamed).c_str());
}

static void kx_apply(llama_context * ctx, const std::string & model_path, const kx_params * kp) {
    if (kx_params_tensors_only(kp, model_path.c_str())) {
        kx_apply_tensors_only(ctx, kp);
        return;
    }
    const bool hybrid = kx_params_hybrid(kp);
    kx_params_validate(kp, hybrid);
    const bool has_pack_name = kp->sparse_pack && *kp->sparse_pack;
    const bool wants_sparse = kp->sparse > KX_SPARSE_DENSE || (kp->sparse == KX_SPARSE_AUTO && (has_pack_name || hybrid));
    if (!wants_sparse) {
        return;
    }
    llama_model * model = const_cast<llama_model *>(&ctx->get_model());
    const bool budgeted = kp->vram_budget > 0;
    // without the hybrid, a budget would leave every layer on the GPU, dense
    const int32_t refuse = budgeted ? KX_ERR_BUDGET : KX_ERR_PACK;
    const char * why = budgeted ? "the VRAM budget needs kairox's hybrid FFN, which is unavailable: " : "";
    const std::string pack = kx_params_pack_path(kp, model_path.c_str());
    char e[1024];
    if (kx_model_slots(model)) {
        // a model applied to again (llama-bench reuses one across rows): its old slots go
        // first, so neither the budget's base nor the retired pack keeps their device memory
        kx_model_set_slots(model, nullptr, 0, nullptr, e, sizeof(e));
    }
    kx_check(kx_model_load_pack(model, model_path.c_str(), pack.c_str(), e, sizeof(e)), refuse, why, e);
    const bool gated = std::strcmp(kx_model_pack_activation(model), "relu") != 0;
    const int32_t mode = kp->sparse != KX_SPARSE_AUTO ? kp->sparse
                       : kx_model_pack_has_predictor(model) ? KX_SPARSE_PREDICTED
                       : gated ? KX_SPARSE_THRESHOLD : KX_SPARSE_EXACT;
    if (!hybrid) {
        if (mode != KX_SPARSE_EXACT && kx_model_sparse_layers(model) == 0) {
            const kx_pack & pk = *kx_model_pack(model);
            float lo = 1.0f, hi = 0.0f;
            for (const kx_pack_layer & L : pk.layers) {
                lo = std::min(lo, L.listed);
                hi = std::max(hi, L.listed);
            }
            LLAMA_LOG_WARN("kairox: the sparse FFN would not gain on this model here: its lists hold %.0f-%.0f%% "
                           "of each layer's neurons, and at that share it timed slower than the dense FFN on this "
                           "CPU (or the share is over %.0f%%); running dense, with llama.cpp's weights as it loads "
                           "them\n", 100.0 * lo, 100.0 * hi, 100.0 * kx_max_density);
            return;
        }
        kx_check(kx_context_set_sparse(ctx, mode, e, sizeof(e)), KX_ERR_PACK, "", e);
        return;
    }
    const int32_t n_layer = (int32_t) model->hparams.n_layer();
    std::vector<int64_t> counts;
    bool automatic = false;
    if (kp->n_gpu_slots_layers > 0) {
        if (!kp->gpu_slots_layers || kp->n_gpu_slots_layers != n_layer) {
            throw kx_apply_error(KX_ERR_PARAMS, kx_fmt("the GPU slot counts have %d values, the model has %d layers",
                                                       kp->n_gpu_slots_layers, n_layer));
        }
        counts.assign(kp->gpu_slots_layers, kp->gpu_slots_layers + n_layer);
        for (int64_t c : counts) {
            if (c < 0) {
                throw kx_apply_error(KX_ERR_PARAMS, "GPU slot counts must be >= 0");
            }
        }
    } else if (kp->gpu_slots >= 0) {
        counts.assign((size_t) n_layer, kp->gpu_slots);
    } else if (kp->plan && *kp->plan) {
        kx_plan plan;
        try {
            plan = kx_plan_read(kp->plan);
        } catch (const std::exception & ex) {
            throw kx_apply_error(KX_ERR_PARAMS, ex.what());
        }
        if (plan.model != kx_basename(model_path)) {
            throw kx_apply_error(KX_ERR_PARAMS, kx_fmt("the plan %s was made for %s, not %s", kp->plan,
                                                       plan.model.c_str(), kx_basename(model_path).c_str()));
        }
        if ((int32_t) plan.slot_neurons.size() != n_layer) {
            throw kx_apply_error(KX_ERR_PARAMS, kx_fmt("the plan %s has %zu layers, the model %d", kp->plan,
                                                       plan.slot_neurons.size(), n_layer));
        }
        counts = plan.slot_neurons;
    } else {
        automatic = true; // from the budget
    }
    kx_vram_report v = {};
    ggml_backend_dev_t dev = nullptr;
    kx_slot_costs costs;
    if (budgeted) {
        dev = kx_params_device(kp);
        if (!dev || kp->vram_free_at_load < 0) {
            throw kx_apply_error(KX_ERR_PARAMS, "a VRAM budget is measured from before the model loads: load it with "
                                                "parameters from kx_model_params_apply");
        }
        try {
            costs = kx_slot_costs_of(*model, *kx_model_pack(model));
        } catch (const std::exception & ex) {
            throw kx_apply_error(KX_ERR_BUDGET, std::string(why) + ex.what());
        }
        v.budget = kp->vram_budget;
        v.base = kp->vram_free_at_load - kx_dev_free(dev);
        if (automatic) {
            // each layer's count from the pack's measured frequencies: the budget's bytes go to
            // the neurons that save the most time per byte, whichever layer they are in
            const kx_pack & pk = *kx_model_pack(model);
            std::vector<float> freq;
            freq.reserve((size_t) n_layer * costs.n_ff);
            for (const kx_pack_layer & pl : pk.layers) {
                freq.insert(freq.end(), pl.freq.begin(), pl.freq.end());
            }
            counts.assign((size_t) n_layer, 0);
            if (kx_budget_auto_counts(v.budget, v.base, costs.per_neuron, costs.pred, n_layer, costs.n_ff, freq.data(),
                                      kp->balance.cpu_gbs, kp->balance.gpu_gbs, counts.data(), e, sizeof(e))) {
                throw kx_apply_error(KX_ERR_BUDGET, e);
            }
        } else if (kx_budget_check_slots(v.budget, v.base, costs.per_neuron, costs.pred, costs.n_ff, counts.data(),
                                         n_layer, e, sizeof(e))) {
            throw kx_apply_error(KX_ERR_BUDGET, e);
        }
    }
    kx_place(ctx, model, kp, counts, mode, refuse);
    if (budgeted) {
        v.used = kx_warm_used(ctx, dev, kp->vram_free_at_load);
        if (v.used > v.budget && automatic) {
            // the hybrid graph took more than the margin: give the overflow back once
            kx_budget_shrink(counts.data(), n_layer, v.used - v.budget + kx_budget_margin(v.budget), costs.per_neuron);
            kx_place(ctx, model, kp, counts, mode, refuse);
            v.used = kx_warm_used(ctx, dev, kp->vram_free_at_load);
        }
        v.slots = kx_model_slots_bytes(model);
        for (int64_t c : counts) {
            v.n_slots += std::min(c, costs.n_ff);
        }
        kx_vram_keep(ctx, dev, v, "");
        kx_start_balancer(model, kp); // afresh: the warm-up's steps are not the run's
        kx_start_thresholds(ctx, kp);
    }
    if (kp->trace && *kp->trace) {
        kx_ctx_state & st = kx_ctx_state_of(ctx);
        FILE * f = std::fopen(kp->trace, "w");
        if (!f) {
            throw kx_apply_error(KX_ERR_PARAMS, kx_fmt("cannot write the balancer trace %s: %s", kp->trace,
                                                       std::strerror(errno)));
        }
        if (st.trace) {
            std::fclose(st.trace);
        }
        st.trace = f;
        st.trace_path = kp->trace;
        st.written = 0;
    }
}

int32_t kx_context_apply(llama_context * ctx, const char * model_path, const kx_params * kp, char * err,
                         size_t err_size) {
    if (!ctx || !model_path || !kp) {
        return kx_fail(err, err_size, KX_ERR_PARAMS, "kx_context_apply: ctx, model_path and kp are required");
    }
    if (kp->threads.window > 0) {
        auto t = std::make_shared<kx_threads>();
        if (!kx_threads_init(*t, ctx->n_threads(), kp->threads)) {
            return kx_fail(err, err_size, KX_ERR_PARAMS, kx_fmt("the decode threads' window must be >= 1, their "
                "recheck >= the window and their drift in (0, 1), not %d, %d and %g", kp->threads.window,
                kp->threads.recheck, kp->threads.drift));
        }
        kx_ctx_state & st = kx_ctx_state_of(ctx);
        st.threads   = t;
        st.th_clock  = {};
    } else if (kx_ctx_state * st = kx_ctx_state_find(ctx)) {
        st->threads.reset();
    }
    try {
        kx_apply(ctx, model_path, kp);
    } catch (const kx_apply_error & e) {
        if (e.code == KX_ERR_PACK || e.code == KX_ERR_BUDGET) {
            // whatever was placed goes: the context runs dense, as llama.cpp would
            llama_model * model = const_cast<llama_model *>(&ctx->get_model());
            char e2[256];
            kx_context_set_sparse(ctx, KX_SPARSE_DENSE, e2, sizeof(e2));
            if (kx_model_pack(model)) {
                kx_model_set_slots(model, nullptr, 0, nullptr, e2, sizeof(e2));
            }
        }
        return kx_fail(err, err_size, e.code, e.what());
    } catch (const std::exception & e) {
        return kx_fail(err, err_size, KX_ERR_FAILED, e.what());
    }
    return kx_fail(err, err_size, KX_OK, "");
}

bool kx_context_vram(const llama_context * ctx, kx_vram_report * out) {
    const kx_ctx_state * st = ctx ? kx_ctx_state_find(ctx) : nullptr;
    if (!st || !st->has_vram) {
        return false;
    }
    if (out) {
        *out = st->vram;
    }
    return true;
}
