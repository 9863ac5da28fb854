// Reading, validating and fingerprinting sparse packs (docs/pack-format.md).
//
// This is the runtime's copy of the checks in python/kairox/pack.py (the reference);
// tests/test_sparse.py feeds both the same broken packs. Every refusal is one sentence
// naming the check that failed, so the caller can print it and keep running dense.
#include "kairox.h"
#include "kx-pack.h"

#include "llama-arch.h"
#include "llama-model.h"

#include "ggml-cpu.h"
#include "gguf.h"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdarg>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>

namespace {

// version 2 = version 1 + optional ahead predictors (blk.L.kx_ahead_*: the hybrid's lists one
// layer early) and an optional kx.stats key; version 3 = version 2 + the
// checksum tensor (required), the only version read: older packs cannot be checked
constexpr uint32_t    KX_PACK_VERSION = 3;
constexpr const char * KX_CHECKSUM    = "kx_checksum";
constexpr const char * KX_PACK_ARCH   = "kxpack";
constexpr uint64_t    KX_FP_SAMPLE    = 4096;

struct gguf_ptr {
    gguf_context * g    = nullptr;
    ggml_context * meta = nullptr;
    ~gguf_ptr() {
        if (g)    { gguf_free(g); }
        if (meta) { ggml_free(meta); }
    }
};

struct file_ptr {
    FILE * f = nullptr;
    explicit file_ptr(const std::string & path) : f(std::fopen(path.c_str(), "rb")) {}
    ~file_ptr() { if (f) { std::fclose(f); } }
};


int64_t file_size(FILE * f) {
    if (std::fseek(f, 0, SEEK_END) != 0) {
        return -1;
    }
    return (int64_t) ftello(f);
}

void open_gguf(gguf_ptr & out, const std::string & path, const char * what) {
    gguf_init_params ip = { /*.no_alloc =*/ true, /*.ctx =*/ &out.meta };
    out.g = gguf_init_from_file(path.c_str(), ip);
    if (!out.g) {
        throw kx_pack_error(kx_fmt("%s %s is not a readable GGUF file; it may be truncated or corrupt",
                                what, path.c_str()));
    }
}

// every tensor's data must lie inside the file
void check_complete(const gguf_ptr & gp, const std::string & path, const char * what) {
    file_ptr fp(path);
    const int64_t size = fp.f ? file_size(fp.f) : -1;
    if (size < 0) {
        throw kx_pack_error(kx_fmt("cannot read %s %s", what, path.c_str()));
    }
    const size_t data = gguf_get_data_offset(gp.g);
    for (int64_t i = 0; i < gguf_get_n_tensors(gp.g); ++i) {
        const uint64_t end = data + gguf_get_tensor_offset(gp.g, i) + gguf_get_tensor_size(gp.g, i);
        if (end > (uint64_t) size) {
            throw kx_pack_error(kx_fmt("%s %s is truncated: tensor %s ends past the end of the file",
                                    what, path.c_str(), gguf_get_tensor_name(gp.g, i)));
        }
    }
}

uint64_t fnv1a(uint64_t h, const void * data, size_t n) {
    const uint8_t * p = (const uint8_t *) data;
    for (size_t i = 0; i < n; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

std::string fingerprint_of(const gguf_ptr & gp, const std::string & path) {
    file_ptr fp(path);
    if (!fp.f) {
        throw kx_pack_error(kx_fmt("cannot read model %s", path.c_str()));
    }
    uint64_t h = 0xcbf29ce484222325ULL;
    const size_t data = gguf_get_data_offset(gp.g);
    std::vector<uint8_t> buf(KX_FP_SAMPLE);
    for (int64_t i = 0; i < gguf_get_n_tensors(gp.g); ++i) {
        const char * name = gguf_get_tensor_name(gp.g, i);
        h = fnv1a(h, name, std::strlen(name) + 1); // with its 0 byte
        const uint32_t type = (uint32_t) gguf_get_tensor_type(gp.g, i);
        h = fnv1a(h, &type, 4); // little-endian hosts only (as ggml)
        const ggml_tensor * t = ggml_get_tensor(gp.meta, name);
        const uint64_t n_dims = (uint64_t) ggml_n_dims(t);
        h = fnv1a(h, &n_dims, 8);
        for (uint64_t d = 0; d < n_dims; ++d) {
            const uint64_t ne = (uint64_t) t->ne[d];
            h = fnv1a(h, &ne, 8);
        }
        const uint64_t nbytes = gguf_get_tensor_size(gp.g, i);
        const uint64_t off    = data + gguf_get_tensor_offset(gp.g, i);
        const uint64_t s      = std::min<uint64_t>(KX_FP_SAMPLE, nbytes);
        const uint64_t mid    = (nbytes/2)/KX_FP_SAMPLE*KX_FP_SAMPLE;
        const uint64_t ranges[3][2] = {
            { 0, s }, { mid, std::min<uint64_t>(mid + KX_FP_SAMPLE, nbytes) }, { nbytes - s, nbytes } };
        for (const auto & r : ranges) {
            const size_t n = (size_t) (r[1] - r[0]);
            if (fseeko(fp.f, (off_t) (off + r[0]), SEEK_SET) != 0 || std::fread(buf.data(), 1, n, fp.f) != n) {
                throw kx_pack_error(kx_fmt("%s is truncated: tensor %s ends past the end of the file",
                                        path.c_str(), name));
            }
            h = fnv1a(h, buf.data(), n);
        }
    }
    return kx_fmt("kxfp1-%016" PRIx64, h);
}

int64_t find_key(const gguf_ptr & gp, const std::string & path, const char * key, gguf_type type) {
    const int64_t id = gguf_find_key(gp.g, key);
    if (id < 0) {
        throw kx_pack_error(kx_fmt("pack %s lacks the key %s", path.c_str(), key));
    }
    if (gguf_get_kv_type(gp.g, id) != type) {
        throw kx_pack_error(kx_fmt("pack %s: %s has type %s, expected %s", path.c_str(), key,
                                gguf_type_name(gguf_get_kv_type(gp.g, id)), gguf_type_name(type)));
    }
    return id;
}

uint32_t get_u32(const gguf_ptr & gp, const std::string & path, const char * key) {
    return gguf_get_val_u32(gp.g, find_key(gp, path, key, GGUF_TYPE_UINT32));
}

std::string get_str(const gguf_ptr & gp, const std::string & path, const char * key) {
    return gguf_get_val_str(gp.g, find_key(gp, path, key, GGUF_TYPE_STRING));
}

std::string model_str(const gguf_ptr & gp, const std::string & key) {
    const int64_t id = gguf_find_key(gp.g, key.c_str());
    return id >= 0 && gguf_get_kv_type(gp.g, id) == GGUF_TYPE_STRING ? gguf_get_val_str(gp.g, id) : "";
}

// the optional kx.listed_density: F32 [n_layer] in [0, 1], or absent (empty)
std::vector<float> listed_density(const gguf_ptr & gp, const std::string & path, int64_t n_layer) {
    const char * key = "kx.listed_density";
    const int64_t id = gguf_find_key(gp.g, key);
    if (id < 0) {
        return {};
    }
    if (gguf_get_kv_type(gp.g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(gp.g, id) != GGUF_TYPE_FLOAT32 ||
        (int64_t) gguf_get_arr_n(gp.g, id) != n_layer) {
        throw kx_pack_error(kx_fmt("pack %s: %s must be %" PRId64 " float32 values", path.c_str(), key, n_layer));
    }
    const float * v = (const float *) gguf_get_arr_data(gp.g, id);
    std::vector<float> out(v, v + n_layer);
    for (float x : out) {
        if (!(x >= 0.0f && x <= 1.0f)) {
            throw kx_pack_error(kx_fmt("pack %s: %s has values outside [0, 1]", path.c_str(), key));
        }
    }
    return out;
}

// the model's FFN activation as kairox records it (python: pack._base_model)
std::string model_activation(const gguf_ptr & gp, const std::string & arch) {
    std::string act = model_str(gp, arch + ".hidden_activation");
    if (act.empty()) {
        act = arch == "gemma3" ? "gelu" : "silu";
    }
    return act;
}

void check_tensor(const ggml_tensor * t, const std::string & path, std::initializer_list<ggml_type> types,
                  int64_t ne0, int64_t ne1) {
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1) {
        throw kx_pack_error(kx_fmt("pack %s: %s has shape (ggml ne) [%" PRId64 ", %" PRId64 "], expected [%" PRId64
                                ", %" PRId64 "]", path.c_str(), t->name, t->ne[0], t->ne[1], ne0, ne1));
    }
    for (ggml_type ty : types) {
        if (t->type == ty) {
            return;
        }
    }
    throw kx_pack_error(kx_fmt("pack %s: %s has type %s, which this pack version does not allow",
                            path.c_str(), t->name, ggml_type_name(t->type)));
}

} // namespace

void kx_set_err(char * err, size_t err_size, const std::string & msg) {
    if (err && err_size > 0) {
        std::snprintf(err, err_size, "%s", msg.c_str());
    }
}

std::string kx_fmt(const char * format, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, format);
    std::vsnprintf(buf, sizeof(buf), format, ap);
    va_end(ap);
    return buf;
}

kx_pack::~kx_pack() {
    if (buf) { ggml_backend_buffer_free(buf); }
    if (ctx) { ggml_free(ctx); }
}

std::shared_ptr<kx_pack> kx_pack_load(const llama_model & model, const std::string & model_path,
                                      const std::string & path) {
    gguf_ptr gp;
    {
        file_ptr probe(path);
        if (!probe.f) {
            throw kx_pack_error(kx_fmt("no pack at %s", path.c_str()));
        }
    }
    open_gguf(gp, path, "pack");
    check_complete(gp, path, "pack");

    // ---- metadata
    const std::string arch = get_str(gp, path, "general.architecture");
    if (arch != KX_PACK_ARCH) {
        throw kx_pack_error(kx_fmt("%s is not a kairox pack (general.architecture is '%s', not '%s')",
                                path.c_str(), arch.c_str(), KX_PACK_ARCH));
    }
    const uint32_t version = get_u32(gp, path, "kx.pack.version");
    if (version != KX_PACK_VERSION) {
        throw kx_pack_error(kx_fmt("pack %s has format version %u, but this kairox reads version %u; "
                                "rebuild the pack with this kairox", path.c_str(), version, KX_PACK_VERSION));
    }
    // the checksums first: every later check then reads data known to be what was written
    const int64_t n_tensors = gguf_get_n_tensors(gp.g);
    std::vector<uint64_t> sums;
    {
        const ggml_tensor * ck = n_tensors > 0 ? ggml_get_tensor(gp.meta, gguf_get_tensor_name(gp.g, n_tensors - 1))
                                               : nullptr;
        if (!ck || std::strcmp(ck->name, KX_CHECKSUM) != 0) {
            throw kx_pack_error(kx_fmt("pack %s lacks its checksum tensor %s (the last tensor); rebuild the pack "
                                    "with this kairox", path.c_str(), KX_CHECKSUM));
        }
        check_tensor(ck, path, { GGML_TYPE_I64 }, n_tensors, 1);
        sums.resize((size_t) n_tensors);
        std::vector<uint8_t> head(gguf_get_data_offset(gp.g));
        file_ptr f(path);
        const size_t off = gguf_get_data_offset(gp.g) + gguf_get_tensor_offset(gp.g, n_tensors - 1);
        if (!f.f || std::fread(head.data(), 1, head.size(), f.f) != head.size() ||
            fseeko(f.f, (off_t) off, SEEK_SET) != 0 || std::fread(sums.data(), 8, sums.size(), f.f) != sums.size()) {
            throw kx_pack_error(kx_fmt("pack %s is truncated: cannot read its checksums", path.c_str()));
        }
        if (kx_xxh3(head.data(), head.size()) != sums.back()) {
            throw kx_pack_error(kx_fmt("pack %s: its header (metadata and tensor list) does not match its checksum; "
                                    "the file is damaged: rebuild or copy the pack again", path.c_str()));
        }
    }
    auto verify = [&](const char * name, const void * data, size_t n) {
        const int64_t id = gguf_find_tensor(gp.g, name);
        if (kx_xxh3(data, n) != sums[(size_t) id]) {
            throw kx_pack_error(kx_fmt("pack %s: tensor %s does not match its checksum; the file is damaged: "
                                    "rebuild or copy the pack again", path.c_str(), name));
        }
    };
    get_str(gp, path, "kx.pack.created_by");
    const std::string method = get_str(gp, path, "kx.pack.method");
    if (method.empty() || method.front() != '{' || method.back() != '}') {
        throw kx_pack_error(kx_fmt("pack %s: kx.pack.method is not a JSON object", path.c_str()));
    }
    auto pack = std::make_shared<kx_pack>();
    pack->path = path;
    const std::string base_arch = get_str(gp, path, "kx.base.architecture");
    pack->n_layer    = get_u32(gp, path, "kx.base.n_layer");
    pack->n_embd     = get_u32(gp, path, "kx.base.n_embd");
    pack->n_ff       = get_u32(gp, path, "kx.base.n_ff");
    pack->activation = get_str(gp, path, "kx.base.activation");
    const std::string fp = get_str(gp, path, "kx.base.fingerprint");
    const uint32_t group_size = get_u32(gp, path, "kx.group_size");
    if (pack->n_layer < 1 || pack->n_embd < 1 || pack->n_ff < 1 || group_size < 1) {
        throw kx_pack_error(kx_fmt("pack %s records an empty model or group size 0", path.c_str()));
    }
    if (pack->activation != "relu" && pack->activation != "silu" && pack->activation != "gelu") {
        throw kx_pack_error(kx_fmt("pack %s records activation '%s' (supported: relu, silu, gelu)",
                                path.c_str(), pack->activation.c_str()));
    }

    // ---- the model at hand
    {
        gguf_ptr mp;
        open_gguf(mp, model_path, "model");
        check_complete(mp, model_path, "model");
        const std::string mfp = fingerprint_of(mp, model_path);
        if (mfp != fp) {
            throw kx_pack_error(kx_fmt("pack %s was made for a different model (pack fingerprint %s, %s has %s); "
                                    "rebuild the pack for this model", path.c_str(), fp.c_str(),
                                    model_path.c_str(), mfp.c_str()));
        }
        const std::string march = llm_arch_name(model.arch);
        const std::string mact  = model_activation(mp, march);
        bool same_ff = true;
        for (uint32_t il = 0; il < model.hparams.n_layer(); ++il) {
            same_ff = same_ff && (int64_t) model.hparams.n_ff(il) == pack->n_ff;
        }
        if (march != base_arch || (int64_t) model.hparams.n_layer() != pack->n_layer ||
            (int64_t) model.hparams.n_embd != pack->n_embd || !same_ff || mact != pack->activation) {
            throw kx_pack_error(kx_fmt("pack %s records %s %" PRId64 " layers x %" PRId64 " embd x %" PRId64 " ff %s, "
                                    "but %s is %s %u layers x %u embd x %u ff %s", path.c_str(), base_arch.c_str(),
                                    pack->n_layer, pack->n_embd, pack->n_ff, pack->activation.c_str(),
                                    model_path.c_str(), march.c_str(), model.hparams.n_layer(), model.hparams.n_embd,
                                    model.hparams.n_ff(0), mact.c_str()));
        }
    }

    // ---- tensor inventory
    const int64_t n_ff = pack->n_ff, n_embd = pack->n_embd, n_layer = pack->n_layer;
    std::set<std::string> names;
    for (int64_t i = 0; i < gguf_get_n_tensors(gp.g); ++i) {
        const std::string name = gguf_get_tensor_name(gp.g, i);
        for (const char * bad : { "ffn_up", "ffn_gate", "ffn_down" }) {
            if (name.find(bad) != std::string::npos) {
                throw kx_pack_error(kx_fmt("pack %s holds tensor '%s', whose name llama.cpp tools would take "
                                        "for a model weight", path.c_str(), name.c_str()));
            }
        }
        names.insert(name);
    }
    std::set<std::string> expected = { "kx_threshold", KX_CHECKSUM };
    auto need = [&](const std::string & name) -> ggml_tensor * {
        ggml_tensor * t = names.count(name) ? ggml_get_tensor(gp.meta, name.c_str()) : nullptr;
        if (!t) {
            throw kx_pack_error(kx_fmt("pack %s lacks the tensor %s", path.c_str(), name.c_str()));
        }
        expected.insert(name);
        return t;
    };

    // a context holding the pack's tensors plus one row map per permuted layer
    ggml_init_params cp = { /*.mem_size =*/ ggml_tensor_overhead()*(size_t) (8*n_layer + 4), nullptr, true };
    pack->ctx = ggml_init(cp);
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> copies; // (in pack file meta, in pack->ctx)
    auto take = [&](ggml_tensor * src) {
        ggml_tensor * t = ggml_dup_tensor(pack->ctx, src);
        ggml_set_name(t, src->name);
        copies.emplace_back(src, t);
        return t;
    };

    pack->layers.resize(n_layer);
    std::vector<ggml_tensor *> perms(n_layer), groups(n_layer), freqs(n_layer);
    int n_pred = 0;
    for (int64_t il = 0; il < n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        ggml_tensor * down = need(p + "kx_down_t");
        check_tensor(down, path, { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K },
                     n_embd, n_ff);
        perms[il]  = need(p + "kx_perm");
        groups[il] = need(p + "kx_group");
        freqs[il]  = need(p + "kx_freq");
        check_tensor(perms[il],  path, { GGML_TYPE_I32 }, n_ff, 1);
        check_tensor(groups[il], path, { GGML_TYPE_I32 }, n_ff, 1);
        check_tensor(freqs[il],  path, { GGML_TYPE_F32 }, n_ff, 1);
        auto & L = pack->layers[il];
        L.down_t = take(down);
        // a predictor trio: all three tensors or none; returns them validated, or nulls
        auto trio = [&](const char * const (&k)[3]) -> std::array<ggml_tensor *, 3> {
            int have = 0;
            for (const char * name : k) {
                have += names.count(p + name) ? 1 : 0;
            }
            if (have != 0 && have != 3) {
                throw kx_pack_error(kx_fmt("pack %s: layer %" PRId64 " has %d of the 3 tensors %s, %s, %s; "
                                        "they come together", path.c_str(), il, have, k[0], k[1], k[2]));
            }
            if (have == 0) {
                return { nullptr, nullptr, nullptr };
            }
            ggml_tensor * a = need(p + k[0]);
            ggml_tensor * b = need(p + k[1]);
            ggml_tensor * c = need(p + k[2]);
            const int64_t rank = a->ne[1];
            if (rank < 1) {
                throw kx_pack_error(kx_fmt("pack %s: %s must be 2-D [rank, n_embd]", path.c_str(), a->name));
            }
            // Q8_0: the writer pads the rank to whole blocks (zero rows of A, columns of B)
            check_tensor(a, path, { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 }, n_embd, rank);
            check_tensor(b, path, { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 }, rank, n_ff);
            check_tensor(c, path, { GGML_TYPE_F32 }, n_ff, 1);
            return { a, b, c };
        };
        static const char * const pred_k[3]  = { "kx_pred_a", "kx_pred_b", "kx_pred_c" };
        static const char * const ahead_k[3] = { "kx_ahead_a", "kx_ahead_b", "kx_ahead_c" };
        auto load = [&](const std::array<ggml_tensor *, 3> & t) {
            return t[0] ? kx_lowrank{ take(t[0]), take(t[1]), take(t[2]) } : kx_lowrank{};
        };
        L.pred  = load(trio(pred_k));
        L.pred_ahead = load(trio(ahead_k));
        n_pred += L.pred ? 1 : 0;
    }
    ggml_tensor * thr = need("kx_threshold");
    check_tensor(thr, path, { GGML_TYPE_F32 }, n_layer, 1);
    // the load-aware thresholds' calibration: every layer's two tables and the grid, or none
    std::vector<ggml_tensor *> thr_sel(n_layer), thr_err(n_layer);
    ggml_tensor * thr_grid = nullptr, * thr_norm = nullptr;
    if (names.count("kx_thr_grid")) {
        thr_grid = need("kx_thr_grid");
        thr_norm = need("kx_thr_norm");
        check_tensor(thr_grid, path, { GGML_TYPE_F32 }, KX_THR_K, n_layer);
        check_tensor(thr_norm, path, { GGML_TYPE_F32 }, n_layer, 1);
        for (int64_t il = 0; il < n_layer; ++il) {
            const std::string p = "blk." + std::to_string(il) + ".";
            thr_sel[il] = need(p + "kx_thr_sel");
            thr_err[il] = need(p + "kx_thr_err");
            check_tensor(thr_sel[il], path, { GGML_TYPE_F32 }, KX_THR_K, n_ff);
            check_tensor(thr_err[il], path, { GGML_TYPE_F32 }, KX_THR_K, n_ff);
        }
    }
    for (const auto & name : names) {
        if (!expected.count(name)) {
            throw kx_pack_error(kx_fmt("pack %s holds unexpected tensor '%s'; it is not part of pack version %u",
                                    path.c_str(), name.c_str(), version));
        }
    }
    pack->has_predictor = n_pred == n_layer;

    // ---- read the small tensors and validate them before allocating the big ones
    file_ptr fp_(path);
    const size_t data = gguf_get_data_offset(gp.g);
    std::set<std::string> unread; // tensors whose checksum is still to verify
    // reads a tensor's bytes; verified against its checksum unless `later` (the big ones are
    // verified in parallel after reading)
    auto read_into = [&](const ggml_tensor * meta_t, void * dst, bool later = false) {
        const int64_t id = gguf_find_tensor(gp.g, meta_t->name);
        const size_t  n  = gguf_get_tensor_size(gp.g, id);
        if (fseeko(fp_.f, (off_t) (data + gguf_get_tensor_offset(gp.g, id)), SEEK_SET) != 0 ||
            std::fread(dst, 1, n, fp_.f) != n) {
            throw kx_pack_error(kx_fmt("pack %s is truncated: cannot read %s", path.c_str(), meta_t->name));
        }
        if (!later) {
            verify(meta_t->name, dst, n);
            unread.erase(meta_t->name);
        }
    };
    unread = expected;
    unread.erase(KX_CHECKSUM);
    std::vector<float> thresholds(n_layer);
    read_into(thr, thresholds.data());
    if (thr_grid) {
        std::vector<float> grid((size_t) n_layer * KX_THR_K), norm(n_layer);
        read_into(thr_grid, grid.data());
        read_into(thr_norm, norm.data());
        for (int64_t il = 0; il < n_layer; ++il) {
            auto & L = pack->layers[il];
            L.thr_norm = norm[il];
            if (!(norm[il] >= 0.0f) || !std::isfinite(norm[il])) {
                throw kx_pack_error(kx_fmt("pack %s: kx_thr_norm must be finite values >= 0", path.c_str()));
            }
            std::copy_n(grid.begin() + il * KX_THR_K, KX_THR_K, L.thr_grid.begin());
            bool ok = L.thr_grid[KX_THR_K0] == 0.0f;
            for (int k = 1; k < KX_THR_K; ++k) {
                ok = ok && std::isfinite(L.thr_grid[k]) && L.thr_grid[k] > L.thr_grid[k - 1];
            }
            if (!ok) {
                throw kx_pack_error(kx_fmt("pack %s: kx_thr_grid of layer %" PRId64 " must ascend through 0 at "
                                        "position %d", path.c_str(), il, KX_THR_K0));
            }
            L.thr_sel.resize((size_t) n_ff * KX_THR_K);
            L.thr_err.resize((size_t) n_ff * KX_THR_K);
            read_into(thr_sel[il], L.thr_sel.data());
            read_into(thr_err[il], L.thr_err.data());
            for (size_t j = 0; j < L.thr_sel.size(); ++j) {
                if (!(L.thr_sel[j] >= 0.0f && L.thr_sel[j] <= 1.0f) || !(L.thr_err[j] >= 0.0f) ||
                    !std::isfinite(L.thr_err[j])) {
                    throw kx_pack_error(kx_fmt("pack %s: the threshold tables of layer %" PRId64 " hold values "
                                            "outside their range (shares in [0, 1], errors finite and >= 0)",
                                            path.c_str(), il));
                }
            }
        }
        pack->has_thresholds = true;
    }
    std::vector<std::vector<int32_t>> rowmaps(n_layer);
    const int64_t n_groups = (n_ff + group_size - 1)/group_size;
    for (int64_t il = 0; il < n_layer; ++il) {
        if (!std::isfinite(thresholds[il])) {
            throw kx_pack_error(kx_fmt("pack %s: kx_threshold has non-finite values", path.c_str()));
        }
        pack->layers[il].threshold = thresholds[il];
        std::vector<int32_t> perm(n_ff), group(n_ff);
        std::vector<float> freq(n_ff);
        read_into(perms[il], perm.data());
        read_into(groups[il], group.data());
        read_into(freqs[il], freq.data());
        std::vector<int32_t> inv(n_ff, -1);
        bool identity = true;
        for (int64_t p = 0; p < n_ff; ++p) {
            const int32_t id = perm[p];
            if (id < 0 || id >= n_ff || inv[id] != -1) {
                throw kx_pack_error(kx_fmt("pack %s: %s is not a permutation of 0..%" PRId64, path.c_str(),
                                        perms[il]->name, n_ff - 1));
            }
            inv[id] = (int32_t) p;
            identity = identity && id == p;
        }
        for (int64_t p = 0; p < n_ff; ++p) {
            if (group[p] < 0 || group[p] >= n_groups) {
                throw kx_pack_error(kx_fmt("pack %s: %s has group ids outside 0..%" PRId64, path.c_str(),
                                        groups[il]->name, n_groups - 1));
            }
            if (p > 0 && group[p] < group[p - 1]) {
                throw kx_pack_error(kx_fmt("pack %s: %s is not non-decreasing (a group must be a contiguous run "
                                        "of pack rows)", path.c_str(), groups[il]->name));
            }
            if (!(freq[p] >= 0.0f && freq[p] <= 1.0f)) {
                throw kx_pack_error(kx_fmt("pack %s: %s has values outside [0, 1]", path.c_str(), freqs[il]->name));
            }
        }
        pack->layers[il].freq = std::move(freq);
        if (!identity) {
            rowmaps[il] = std::move(inv);
            ggml_tensor * rm = ggml_new_tensor_1d(pack->ctx, GGML_TYPE_I32, n_ff);
            ggml_format_name(rm, "blk.%d.kx_rowmap", (int) il);
            pack->layers[il].rowmap = rm;
        }
    }

    // ---- the big tensors, into one host buffer marked as weights (the scheduler then runs
    // the ops that read them on the CPU backend, where the buffer lives); in huge pages, as
    // the host op reads the transposed down rows scattered (kx-host.cpp). Not page-locked:
    // the slots lock what their mapped share reads.
    pack->buf = ggml_backend_alloc_ctx_tensors_from_buft(pack->ctx, kx_host_buffer_type(false, 0));
    if (!pack->buf) {
        throw kx_pack_error(kx_fmt("cannot allocate host memory for pack %s", path.c_str()));
    }
    ggml_backend_buffer_set_usage(pack->buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (const auto & [src, dst] : copies) {
        read_into(src, dst->data, /*later =*/ true);
        unread.erase(src->name);
    }
    // the rows the FFN reads: checksums and finite values, one tensor per job (all cores: a
    // 7B F16 pack is ~3 GB)
    kx_parallel_for((int64_t) copies.size(), [&](int64_t i) {
        const ggml_tensor * t = copies[(size_t) i].second;
        verify(t->name, t->data, ggml_nbytes(t));
        const int64_t row = kx_first_nonfinite_row(t, t->data);
        if (row >= 0) {
            throw kx_pack_error(kx_fmt("pack %s: %s has non-finite values (row %" PRId64 ")", path.c_str(), t->name,
                                    row));
        }
    });
    // what this loader does not keep (the ahead predictors) is verified all the same
    for (const std::string & name : std::set<std::string>(unread)) { // read_into erases from unread
        const ggml_tensor * t = ggml_get_tensor(gp.meta, name.c_str());
        std::vector<uint8_t> buf(ggml_nbytes(t));
        read_into(t, buf.data());
    }
    for (int64_t il = 0; il < n_layer; ++il) {
        if (pack->layers[il].rowmap) {
            std::memcpy(pack->layers[il].rowmap->data, rowmaps[il].data(), (size_t) n_ff*sizeof(int32_t));
        }
    }
    const std::vector<float> listed = listed_density(gp, path, n_layer);
    for (int64_t il = 0; il < (int64_t) listed.size(); ++il) {
        pack->layers[il].listed = listed[il];
        pack->layers[il].pays   = kx_layer_pays(listed[il]); // the load's measured choice, when made, replaces it
    }
    return pack;
}

std::vector<kx_slot_types> kx_slot_types_read(const std::string & model_path, const std::string & pack_path,
                                               int64_t * n_embd, int64_t * n_ff) {
    try {
        gguf_ptr mp, pp;
        open_gguf(mp, model_path, "model");
        open_gguf(pp, pack_path, "pack");
        const int64_t n_layer = get_u32(pp, pack_path, "kx.base.n_layer");
        *n_embd = get_u32(pp, pack_path, "kx.base.n_embd");
        *n_ff   = get_u32(pp, pack_path, "kx.base.n_ff");
        auto type_of = [](const ggml_context * meta, const std::string & name) {
            const ggml_tensor * t = ggml_get_tensor(const_cast<ggml_context *>(meta), name.c_str());
            return t ? (int32_t) t->type : -1;
        };
        std::vector<kx_slot_types> out(n_layer);
        for (int64_t il = 0; il < n_layer; ++il) {
            const std::string b = "blk." + std::to_string(il) + ".";
            out[il] = { type_of(mp.meta, b + "ffn_gate.weight"), type_of(mp.meta, b + "ffn_up.weight"),
                        type_of(pp.meta, b + "kx_down_t") };
            if (out[il].gate < 0 || out[il].up < 0 || out[il].down < 0) {
                return {};
            }
        }
        return out;
    } catch (const kx_pack_error &) {
        return {}; // the full load says what is wrong with them
    }
}

kx_pack_preview kx_pack_preview_read(const std::string & pack_path) {
    kx_pack_preview pv;
    try {
        gguf_ptr gp;
        open_gguf(gp, pack_path, "pack");
        pv.activation = get_str(gp, pack_path, "kx.base.activation");
        const int64_t id = gguf_find_key(gp.g, "kx.base.n_layer");
        if (id >= 0 && gguf_get_kv_type(gp.g, id) == GGUF_TYPE_UINT32) {
            pv.listed = listed_density(gp, pack_path, gguf_get_val_u32(gp.g, id));
        }
        pv.predictor = gguf_find_tensor(gp.g, "blk.0.kx_pred_a") >= 0;
    } catch (const kx_pack_error &) {
        return {}; // the full load says what is wrong with it
    }
    return pv;
}
