// Whether sparsity pays, timed on the machine that runs (kx-pays.h).
//
// A fixed density line (kx_max_density) held on the H200 host for F16 rows but not on two
// cores with a K-quant model: there llama.cpp's repacked Q4_K matvec beat the unrepacked row
// kernels even at 11-18% density (bench/results/KB-350M-cpu/down-types/). So before the model
// loads, one layer of each weight layout runs both ways on the CPU backend:
//   dense:  y = W_down · glu(W_gate·x, W_up·x), weights as llama.cpp would load them
//   sparse: mode's predictor or gate and select, then ggml_kx_ffn_rows over a list of the
//           given density, weights as plain rows and the pack's down rows
// The model's own weights (read from its file) are timed, not random bytes: a K-quant's
// unpacking cost depends on its scales. Each run starts with the caches flushed, as in a
// decode the layer's weights come from DRAM (the rest of the model passed through since).
// The lists are drawn as the predictor's are: each neuron weighted by its profiled activation
// frequency (the pack's kx_freq), the down rows read through the pack's neuron order (kx_perm),
// the layer's own activation (ReLU skips the up row of a neuron whose gate is <= 0; with a
// random x that is about half of them, where a predictor's misses are 1 - its precision).
#include "kx-pays.h"
#include "kx-pack.h"

#include "kairox.h"
#include "kx-ops.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "gguf.h"
#include "llama-impl.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <sys/stat.h>
#include <unistd.h>

namespace {

// rounds of timed runs, the graphs interleaved in each, after one untimed round; each graph's
// fastest run is kept: on a shared or noisy machine the minimum is its cost without another
// process in the way (the development VM's medians of the same graph moved 1.6x between calls)
constexpr int kx_pays_rounds = 11;

struct gguf_file {
    gguf_context_ptr g;
    ggml_context *   meta = nullptr; // owned by ctx_meta
    ggml_context_ptr ctx_meta;
    std::string      path;

    explicit gguf_file(const std::string & p) : path(p) {
        gguf_init_params ip = { /*.no_alloc =*/ true, /*.ctx =*/ &meta };
        g.reset(gguf_init_from_file(p.c_str(), ip));
        if (!g) {
            throw kx_pack_error(kx_fmt("%s is not a readable GGUF file", p.c_str()));
        }
        ctx_meta.reset(meta);
    }
    const ggml_tensor * get(const std::string & name) const {
        return ggml_get_tensor(meta, name.c_str());
    }
    // the bytes of tensor name, as stored
    std::vector<uint8_t> read(const std::string & name) const {
        const int64_t id = gguf_find_tensor(g.get(), name.c_str());
        if (id < 0) {
            throw kx_pack_error(kx_fmt("%s has no tensor %s", path.c_str(), name.c_str()));
        }
        std::vector<uint8_t> out(gguf_get_tensor_size(g.get(), id));
        FILE * f = std::fopen(path.c_str(), "rb");
        const bool ok = f && fseeko(f, (off_t) (gguf_get_data_offset(g.get()) + gguf_get_tensor_offset(g.get(), id)),
                                    SEEK_SET) == 0 &&
                        std::fread(out.data(), 1, out.size(), f) == out.size();
        if (f) {
            std::fclose(f);
        }
        if (!ok) {
            throw kx_pack_error(kx_fmt("cannot read %s from %s", name.c_str(), path.c_str()));
        }
        return out;
    }
};

// a tensor like t (type, shape) in ctx
ggml_tensor * kx_like(ggml_context * ctx, const ggml_tensor * t) {
    return ggml_new_tensor(ctx, t->type, ggml_n_dims(t), t->ne);
}

// The buffer type llama.cpp's loader would give a CPU weight used by a matvec: the first of
// the CPU backend's extra types (repacking) that supports it, else the plain CPU type. The
// loader asks the device with the weight in an empty buffer of each type (llama-model-loader's
// weight_buft_supported); so does this.
ggml_backend_buffer_type_t kx_dense_buft(ggml_backend_dev_t cpu, ggml_tensor * w) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu);
    auto extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        reg, "ggml_backend_dev_get_extra_bufts");
    if (extra) {
        ggml_init_params ip = { ggml_tensor_overhead() * 4, nullptr, true };
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_tensor * b  = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, w->ne[0], 512);
        ggml_tensor * op = ggml_mul_mat(ctx.get(), w, b);
        for (ggml_backend_buffer_type_t * bt = extra(cpu); bt && *bt; ++bt) {
            w->buffer = ggml_backend_buft_alloc_buffer(*bt, 0);
            const bool ok = ggml_backend_dev_supports_op(cpu, op);
            ggml_backend_buffer_free(w->buffer);
            w->buffer = nullptr;
            if (ok) {
                return *bt;
            }
        }
    }
    return ggml_backend_dev_buffer_type(cpu);
}

struct kx_cpu_bench {
    ggml_backend_ptr        be;
    ggml_backend_dev_t      dev = nullptr;
    std::vector<uint8_t>    scratch;           // written before each run: evicts the last run's rows
    std::vector<ggml_backend_buffer_ptr> bufs; // weights

    explicit kx_cpu_bench(int32_t n_threads) {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (!dev) {
            throw kx_pack_error("no CPU backend");
        }
        be.reset(ggml_backend_dev_init(dev, nullptr));
        auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
        if (set_threads) {
            set_threads(be.get(), std::max(1, n_threads));
        }
        // twice the last-level cache, at least 32 MiB (a cache size the system does not report)
        long l3 = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
        l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
        scratch.resize((size_t) std::clamp<long>(2 * l3, 32l << 20, 512l << 20));
    }

    // w's bytes into a buffer of type bt of its own
    void place(ggml_tensor * w, ggml_backend_buffer_type_t bt, const std::vector<uint8_t> & data) {
        ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(bt, ggml_backend_buft_get_alloc_size(bt, w));
        if (!buf) {
            throw kx_pack_error("out of host memory for the sparse FFN's measurement");
        }
        bufs.emplace_back(buf);
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_alloc(buf, w, ggml_backend_buffer_get_base(buf));
        ggml_backend_tensor_set(w, data.data(), 0, data.size());
    }

    // refused before any run: a node the CPU backend cannot compute
    void check(ggml_cgraph * gf) {
        for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
            if (!ggml_backend_supports_op(be.get(), ggml_graph_node(gf, i))) {
                throw kx_pack_error(kx_fmt("the CPU backend cannot run %s on these types",
                                           ggml_op_desc(ggml_graph_node(gf, i))));
            }
        }
    }

    // µs of one compute of gf (inputs already set), the caches flushed first
    double run(ggml_cgraph * gf) {
        // read, not written: a decode's other tensors leave clean lines behind them, and
        // evicting dirty ones would cost both graphs write-backs a decode does not pay
        uint64_t sum = 0;
        const uint64_t * w = (const uint64_t *) scratch.data();
        for (size_t i = 0; i < scratch.size() / sizeof(uint64_t); i += 8) { // one load per 64-byte line
            sum += w[i];
        }
        sink += sum;
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_backend_graph_compute(be.get(), gf) != GGML_STATUS_SUCCESS) {
            throw kx_pack_error("the CPU backend failed to compute the sparse FFN's measurement");
        }
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    volatile uint64_t sink = 0;
};

// a list (I32 [n + 1]: count, then ascending ids) of round(d * n) ids drawn without
// replacement, each with weight freq[i] (+ a floor, so that a neuron never seen can be listed):
// the k largest log(u) / w (Efraimidis-Spirakis)
std::vector<int32_t> kx_weighted_list(const std::vector<float> & freq, float d, std::mt19937 & rng) {
    const int64_t n = (int64_t) freq.size();
    std::uniform_real_distribution<double> ud(1e-12, 1.0);
    std::vector<std::pair<double, int32_t>> keys(n);
    for (int64_t i = 0; i < n; ++i) {
        keys[i] = { std::log(ud(rng)) / (1e-3 + (double) freq[i]), (int32_t) i };
    }
    const int64_t k = std::clamp<int64_t>((int64_t) std::lround(d * n), 1, n);
    std::nth_element(keys.begin(), keys.begin() + k, keys.end(), std::greater<>());
    std::vector<int32_t> ids(1, (int32_t) k);
    for (int64_t i = 0; i < k; ++i) {
        ids.push_back(keys[i].second);
    }
    std::sort(ids.begin() + 1, ids.end());
    return ids;
}

struct kx_layer_cost {
    double dense_us = 0;
    float  d[2]     = { 0, 0 };
    double sparse_us[2] = { 0, 0 };
    double sparse_at(float x) const {
        if (d[1] <= d[0]) {
            return sparse_us[0];
        }
        return sparse_us[0] + (sparse_us[1] - sparse_us[0]) * (x - d[0]) / (d[1] - d[0]);
    }
};

// layer il's FFN both ways, the sparse one at densities d0 <= d1
kx_layer_cost kx_time_layer(const gguf_file & model, const gguf_file & pack, int64_t il, int32_t mode,
                            const std::string & activation, float d0, float d1, int32_t n_threads) {
    const std::string b = "blk." + std::to_string(il) + ".";
    const ggml_tensor * mg = model.get(b + "ffn_gate.weight");
    const ggml_tensor * mu = model.get(b + "ffn_up.weight");
    const ggml_tensor * md = model.get(b + "ffn_down.weight");
    const ggml_tensor * pd = pack.get(b + "kx_down_t");
    if (!mg || !mu || !md || !pd) {
        throw kx_pack_error(kx_fmt("layer %" PRId64 " has no gated FFN or no pack down rows", il));
    }
    // this runs before the pack is checked (kx_pack_load): the shapes the ops assert, checked
    // here, so that a bad pack is refused by its load, not by an abort in this measurement
    const int64_t n_embd = mg->ne[0], n_ff = mg->ne[1];
    auto is_2d = [](const ggml_tensor * t, int64_t ne0, int64_t ne1) {
        return ggml_n_dims(t) <= 2 && t->ne[0] == ne0 && t->ne[1] == ne1;
    };
    if (mu->type != mg->type || !is_2d(mu, n_embd, n_ff) || !is_2d(md, n_ff, n_embd) || !is_2d(pd, n_embd, n_ff) ||
        !kx_down_type_ok(pd->type, n_embd)) {
        throw kx_pack_error(kx_fmt("layer %" PRId64 "'s FFN tensors do not have the sparse FFN's shapes and types", il));
    }
    kx_cpu_bench bench(n_threads);
    std::mt19937 rng(1234 + (uint32_t) il);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(n_embd);
    for (float & v : x) {
        v = nd(rng);
    }
    kx_layer_cost cost;
    const size_t meta = ggml_tensor_overhead() * 32 + ggml_graph_overhead();
    // dense, in llama.cpp's layout (both layouts in memory at once: the runs interleave)
    ggml_init_params dp = { meta, nullptr, true };
    ggml_context_ptr dctx(ggml_init(dp));
    ggml_gallocr_ptr dga(ggml_gallocr_new(ggml_backend_get_default_buffer_type(bench.be.get())));
    ggml_cgraph * dense = nullptr;
    {
        ggml_context * ctx = dctx.get();
        ggml_tensor * wg = kx_like(ctx, mg);
        ggml_tensor * wu = kx_like(ctx, mu);
        ggml_tensor * wd = kx_like(ctx, md);
        const std::pair<ggml_tensor *, const char *> ws[3] = { { wg, "ffn_gate" }, { wu, "ffn_up" }, { wd, "ffn_down" } };
        for (const auto & [w, name] : ws) {
            bench.place(w, kx_dense_buft(bench.dev, w), model.read(b + name + ".weight"));
        }
        ggml_tensor * xt = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_embd);
        ggml_set_input(xt);
        ggml_tensor * g = ggml_mul_mat(ctx, wg, xt);
        ggml_tensor * u = ggml_mul_mat(ctx, wu, xt);
        ggml_tensor * h = activation == "relu" ? ggml_reglu_split(ctx, g, u)
                        : activation == "silu" ? ggml_swiglu_split(ctx, g, u)
                                               : ggml_geglu_split(ctx, g, u);
        dense = ggml_new_graph(ctx);
        ggml_build_forward_expand(dense, ggml_mul_mat(ctx, wd, h));
        if (!ggml_gallocr_alloc_graph(dga.get(), dense)) {
            throw kx_pack_error("out of host memory for the sparse FFN's measurement");
        }
        ggml_backend_tensor_set(xt, x.data(), 0, x.size() * sizeof(float));
        bench.check(dense);
    }
    ggml_init_params ip = { meta, nullptr, true };
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_tensor * wg = kx_like(ctx.get(), mg);
    ggml_tensor * wu = kx_like(ctx.get(), mu);
    ggml_tensor * dt = kx_like(ctx.get(), pd);
    ggml_backend_buffer_type_t plain = ggml_backend_dev_buffer_type(bench.dev);
    bench.place(wg, plain, model.read(b + "ffn_gate.weight"));
    bench.place(wu, plain, model.read(b + "ffn_up.weight"));
    bench.place(dt, plain, pack.read(b + "kx_down_t"));
    ggml_tensor * xt  = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_F32, n_embd);
    ggml_tensor * sel = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, n_ff + 1);
    ggml_tensor * dm  = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, n_ff); // neuron id -> down row
    ggml_set_input(xt);
    ggml_set_input(sel);
    ggml_set_input(dm);
    // the pack's neuron order and frequencies (checked: a bad pack is its load's to refuse)
    const ggml_tensor * pp = pack.get(b + "kx_perm");
    const ggml_tensor * pf = pack.get(b + "kx_freq");
    if (!pp || !pf || pp->type != GGML_TYPE_I32 || pf->type != GGML_TYPE_F32 || ggml_nelements(pp) != n_ff ||
        ggml_nelements(pf) != n_ff) {
        throw kx_pack_error(kx_fmt("pack %s: layer %" PRId64 " has no neuron order or frequencies", pack.path.c_str(), il));
    }
    std::vector<int32_t> downmap(n_ff, -1);
    {
        const std::vector<uint8_t> raw = pack.read(b + "kx_perm");
        const int32_t * perm = (const int32_t *) raw.data();
        for (int64_t p = 0; p < n_ff; ++p) {
            if (perm[p] < 0 || perm[p] >= n_ff || downmap[perm[p]] != -1) {
                throw kx_pack_error(kx_fmt("pack %s: layer %" PRId64 "'s neuron order is not a permutation",
                                           pack.path.c_str(), il));
            }
            downmap[perm[p]] = (int32_t) p;
        }
    }
    std::vector<float> freq(n_ff);
    {
        const std::vector<uint8_t> raw = pack.read(b + "kx_freq");
        std::memcpy(freq.data(), raw.data(), raw.size());
    }
    const enum kx_select_act act = activation == "relu" ? KX_SELECT_RELU
                                 : activation == "silu" ? KX_SELECT_SILU : KX_SELECT_GELU;
    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    ggml_tensor * gv = nullptr;
    if (mode == KX_SPARSE_PREDICTED) {
        ggml_tensor * p[3];
        const char * names[3] = { "kx_pred_a", "kx_pred_b", "kx_pred_c" };
        for (int i = 0; i < 3; ++i) {
            const ggml_tensor * t = pack.get(b + names[i]);
            if (!t) {
                throw kx_pack_error(kx_fmt("pack %s has no predictor for layer %" PRId64, pack.path.c_str(), il));
            }
            p[i] = kx_like(ctx.get(), t);
        }
        if (!is_2d(p[0], n_embd, p[0]->ne[1]) || !is_2d(p[1], p[0]->ne[1], n_ff) || p[2]->type != GGML_TYPE_F32 ||
            ggml_nelements(p[2]) != n_ff) {
            throw kx_pack_error(kx_fmt("pack %s: layer %" PRId64 "'s predictor has the wrong shape", pack.path.c_str(), il));
        }
        for (int i = 0; i < 3; ++i) {
            bench.place(p[i], plain, pack.read(b + names[i]));
        }
        ggml_tensor * s = ggml_add(ctx.get(), ggml_mul_mat(ctx.get(), p[1], ggml_mul_mat(ctx.get(), p[0], xt)), p[2]);
        // its list is computed and not used: the timed list has the density asked for
        ggml_build_forward_expand(gf, ggml_kx_select(ctx.get(), s, 0.0f, kx_max_density, KX_SELECT_SCORE));
    } else {
        gv = ggml_mul_mat(ctx.get(), wg, xt);
        ggml_build_forward_expand(gf, ggml_kx_select(ctx.get(), gv, 0.0f, kx_max_density, act));
    }
    ggml_build_forward_expand(gf, ggml_kx_ffn_rows(ctx.get(), wg, wu, dt, xt, sel, nullptr, dm, gv, act));
    ggml_gallocr_ptr ga(ggml_gallocr_new(ggml_backend_get_default_buffer_type(bench.be.get())));
    if (!ggml_gallocr_alloc_graph(ga.get(), gf)) {
        throw kx_pack_error("out of host memory for the sparse FFN's measurement");
    }
    ggml_backend_tensor_set(xt, x.data(), 0, x.size() * sizeof(float));
    ggml_backend_tensor_set(dm, downmap.data(), 0, downmap.size() * sizeof(int32_t));
    bench.check(gf);
    cost.d[0] = d0;
    cost.d[1] = d1;
    const int n_d = d1 > d0 ? 2 : 1;
    const std::vector<int32_t> lists[2] = { kx_weighted_list(freq, d0, rng), kx_weighted_list(freq, d1, rng) };
    double best[3] = { INFINITY, INFINITY, INFINITY }; // dense, sparse at d0, at d1
    for (int r = 0; r <= kx_pays_rounds; ++r) {
        const double t = bench.run(dense);
        best[0] = r > 0 ? std::min(best[0], t) : best[0];
        for (int k = 0; k < n_d; ++k) {
            ggml_backend_tensor_set(sel, lists[k].data(), 0, lists[k].size() * sizeof(int32_t));
            const double ts = bench.run(gf);
            best[1 + k] = r > 0 ? std::min(best[1 + k], ts) : best[1 + k];
        }
    }
    cost.dense_us     = best[0];
    cost.sparse_us[0] = best[1];
    cost.sparse_us[1] = n_d > 1 ? best[2] : best[1];
    return cost;
}

std::mutex                                       kx_pays_mutex;
std::map<std::string, std::vector<float>>        kx_pays_measured; // key: model, pack, mode, threads
std::map<std::string, std::vector<bool>>         kx_pays_chosen;   // key: model, pack

// a file by its path and what says it changed (a pack rewritten at the same path is timed anew)
std::string kx_file_key(const std::string & path) {
    struct stat st = {};
    if (stat(path.c_str(), &st) != 0) {
        return path;
    }
    return kx_fmt("%s|%lld|%lld|%lld.%09ld", path.c_str(), (long long) st.st_ino, (long long) st.st_size,
                  (long long) st.st_mtim.tv_sec, (long) st.st_mtim.tv_nsec);
}

std::string kx_pays_key(const std::string & model_path, const std::string & pack_path) {
    return kx_file_key(model_path) + '\n' + kx_file_key(pack_path);
}

} // namespace

std::vector<float> kx_pays_measure(const std::string & model_path, const std::string & pack_path, int32_t mode,
                                   int32_t n_threads) {
    const std::string key = kx_pays_key(model_path, pack_path) + kx_fmt("\n%d\n%d", mode, n_threads);
    std::lock_guard<std::mutex> lock(kx_pays_mutex);
    if (auto it = kx_pays_measured.find(key); it != kx_pays_measured.end()) {
        return it->second;
    }
    const gguf_file model(model_path), pack(pack_path);
    const kx_pack_preview pv = kx_pack_preview_read(pack_path);
    std::vector<float> ratio(pv.listed.size(), -1.0f);
    // one timing per weight layout; its densities span the listed shares of the layers with it
    struct layout {
        int64_t il = -1; // the layer timed
        float   lo = 1, hi = 0;
    };
    std::map<std::string, layout> layouts;
    auto layout_of = [&](int64_t il) {
        std::string k;
        for (const char * n : { "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight" }) {
            const ggml_tensor * t = model.get("blk." + std::to_string(il) + "." + n);
            k += t ? std::string(ggml_type_name(t->type)) + "," : "-,";
        }
        const ggml_tensor * t = pack.get("blk." + std::to_string(il) + ".kx_down_t");
        return k + (t ? ggml_type_name(t->type) : "-");
    };
    for (int64_t il = 0; il < (int64_t) pv.listed.size(); ++il) {
        const float d = pv.listed[il];
        if (d < 0.0f || d >= kx_max_density) {
            continue; // unknown (assumed to gain), or denser than the select's fallback
        }
        layout & L = layouts[layout_of(il)];
        L.il = L.il < 0 ? il : L.il;
        L.lo = std::min(L.lo, d);
        L.hi = std::max(L.hi, d);
    }
    for (const auto & [name, L] : layouts) {
        const kx_layer_cost c = kx_time_layer(model, pack, L.il, mode, pv.activation, L.lo, L.hi, n_threads);
        int n = 0, gains = 0;
        for (int64_t il = 0; il < (int64_t) pv.listed.size(); ++il) {
            const float d = pv.listed[il];
            if (d >= 0.0f && d < kx_max_density && layout_of(il) == name) {
                ratio[il] = (float) (c.sparse_at(d) / c.dense_us);
                n++;
                gains += ratio[il] < kx_pays_max_ratio;
            }
        }
        LLAMA_LOG_INFO("kairox: FFN on this CPU, %d threads, layout %s: dense %.0f us, sparse %.0f-%.0f us at "
                       "%.0f-%.0f%% of the neurons; sparse gains on %d of %d layers\n", n_threads, name.c_str(),
                       c.dense_us, c.sparse_us[0], c.sparse_at(L.hi), 100.0 * L.lo, 100.0 * L.hi, gains, n);
    }
    // the measurement's rows went through the kernels' counters: they describe the run, not this
    kx_cpu_select_stats(nullptr, nullptr, nullptr, nullptr, true);
    kx_cpu_axpy_stats(nullptr, nullptr, nullptr, true);
    kx_cpu_ffn_stats(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, true);
    kx_pays_measured[key] = ratio;
    return ratio;
}

void kx_pays_remember(const std::string & model_path, const std::string & pack_path, std::vector<bool> pays) {
    std::lock_guard<std::mutex> lock(kx_pays_mutex);
    kx_pays_chosen[kx_pays_key(model_path, pack_path)] = std::move(pays);
}

std::vector<bool> kx_pays_recall(const std::string & model_path, const std::string & pack_path) {
    std::lock_guard<std::mutex> lock(kx_pays_mutex);
    auto it = kx_pays_chosen.find(kx_pays_key(model_path, pack_path));
    return it == kx_pays_chosen.end() ? std::vector<bool>() : it->second;
}
