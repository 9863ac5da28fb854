// GPU neuron slots (kx-slots.h): allocation and the one-time fill at load.
#include "kx-slots.h"
#include "kairox.h"
#include "kx-pack.h"
#include "kx-reload-engine.h"

#include "llama-model.h"

#include "ggml-backend-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <numeric>
#include <stdexcept>

kx_slots::~kx_slots() {
    for (ggml_backend_buffer_t b : map_bufs) {
        ggml_backend_buffer_free(b); // aliases only: the host memory stays the model's and the pack's
    }
    ggml_free(ctx_map);
    if (map_engine) {
        map_io->destroy(map_engine); // unmaps (and unpins) what it registered, after the aliases
    }
    ggml_backend_buffer_free(buf_dev);
    ggml_backend_buffer_free(buf_host);
    ggml_backend_buffer_free(buf_ahead);
    ggml_free(ctx_dev);
    ggml_free(ctx_host);
}

ggml_backend_dev_t kx_slots_device(const char * name) {
    if (name) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(name);
        if (!dev) {
            throw std::runtime_error(kx_fmt("no device named %s", name));
        }
        return dev;
    }
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (!dev) {
        throw std::runtime_error("GPU slots need a GPU, and this build or machine has none");
    }
    return dev;
}

// dst row s = src row rows[s] (src: a 2-D weight in host memory), staged on the host and
// sent in one copy (a copy per row would cost a synchronization each)
static void kx_gather_rows(const ggml_tensor * src, const std::vector<int32_t> & rows, ggml_tensor * dst) {
    GGML_ASSERT(src->type == dst->type && src->ne[0] == dst->ne[0] && (int64_t) rows.size() == dst->ne[1]);
    std::vector<uint8_t> stage(ggml_nbytes(dst));
    for (size_t s = 0; s < rows.size(); ++s) {
        std::memcpy(stage.data() + s*dst->nb[1], (const char *) src->data + rows[s]*src->nb[1], dst->nb[1]);
    }
    ggml_backend_tensor_set(dst, stage.data(), 0, stage.size());
}

// The slots' row ops over these row types, built as the graphs build them (a list, a row map)
// and asked of the device: a type its kernels do not read is refused here, by name, instead
// of left to the scheduler, which would run the op on the CPU and copy the slots there every
// token.
void kx_slots_check_types(ggml_backend_dev_t dev, int32_t gate, int32_t up, int32_t down, int64_t n_embd,
                          int64_t n_ff) {
    ggml_init_params ip = { ggml_tensor_overhead()*16, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * x   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, 1);
    ggml_tensor * h   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_ff, 1);
    ggml_tensor * sel = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_ff + 1);
    ggml_tensor * map = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_ff);
    auto row = [&](int32_t type) { return ggml_new_tensor_2d(ctx, (ggml_type) type, n_embd, 1); };
    struct probe { int32_t type; const char * what; ggml_tensor * op; };
    const probe probes[] = {
        { gate, "ffn_gate", ggml_kx_mul_mat_rows(ctx, row(gate), x, sel, map) },
        { up,   "ffn_up",   ggml_kx_mul_mat_rows(ctx, row(up), x, sel, map) },
        { down, "pack's down rows", ggml_kx_axpy_rows(ctx, row(down), h, sel, map) },
    };
    std::string bad;
    for (const probe & p : probes) {
        if (bad.empty() && !ggml_backend_dev_supports_op(dev, p.op)) {
            bad = kx_fmt("the neuron slots on %s cannot hold %s rows (the model's %s): its kernels read F32, F16, "
                         "Q8_0, Q4_0, Q4_K, Q5_K and Q6_K gate/up rows and F32, F16, Q8_0, Q4_K and Q6_K down rows; requantize "
                         "the model to one of those or run it without GPU slots", ggml_backend_dev_name(dev),
                         ggml_type_name((ggml_type) p.type), p.what);
        }
    }
    ggml_free(ctx);
    if (!bad.empty()) {
        throw std::runtime_error(bad);
    }
}

// a copy of a pack predictor on the slots' device (none where the pack has none)
static kx_lowrank kx_lowrank_dup(ggml_context * ctx, const kx_lowrank & p, int64_t il, const char * what) {
    if (!p) {
        return {};
    }
    kx_lowrank d = { ggml_dup_tensor(ctx, p.a), ggml_dup_tensor(ctx, p.b), ggml_dup_tensor(ctx, p.c) };
    ggml_format_name(d.a, "blk.%d.kx_slot_%s_a", (int) il, what);
    ggml_format_name(d.b, "blk.%d.kx_slot_%s_b", (int) il, what);
    ggml_format_name(d.c, "blk.%d.kx_slot_%s_c", (int) il, what);
    return d;
}

static void kx_lowrank_set(const kx_lowrank & dst, const kx_lowrank & src) {
    if (!dst) {
        return;
    }
    ggml_tensor * const d[3] = { dst.a, dst.b, dst.c };
    const ggml_tensor * const s[3] = { src.a, src.b, src.c };
    for (int i = 0; i < 3; ++i) {
        ggml_backend_tensor_set(d[i], s[i]->data, 0, ggml_nbytes(s[i]));
    }
}

std::unique_ptr<kx_slots> kx_slots_build(const llama_model & model, const kx_pack & pack,
                                         const std::vector<int64_t> & n_slots, const char * device,
                                         int32_t faults) {
    const int64_t n_layer = pack.n_layer, n_ff = pack.n_ff, n_embd = pack.n_embd;
    if ((int64_t) n_slots.size() != n_layer) {
        throw std::runtime_error(kx_fmt("slots for %zu layers given, the model has %" PRId64,
                                        n_slots.size(), n_layer));
    }
    ggml_backend_dev_t dev = kx_slots_device(device);
    auto slots = std::make_unique<kx_slots>();
    slots->device = ggml_backend_dev_name(dev);
    slots->on_host = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    slots->layers.resize(n_layer);

    // pass 1: checks and tensor shapes. Per layer the device context holds 7 slot tensors (gate,
    // up, down, three maps, the threshold offsets) and two predictors of 3 (own and ahead); the
    // host context 3 (coldmap, colddown, seen).
    constexpr size_t kx_slot_tensors = 7 + 2*3;
    ggml_init_params ip = { ggml_tensor_overhead()*(kx_slot_tensors*(size_t) n_layer + 1), nullptr, true };
    slots->ctx_dev  = ggml_init(ip);
    slots->ctx_host = ggml_init(ip);
    std::vector<int32_t> checked; // type combinations the device was asked about
    for (int64_t il = 0; il < n_layer; ++il) {
        const int64_t S = std::min<int64_t>(std::max<int64_t>(n_slots[il], 0), n_ff);
        if (S == 0) {
            continue;
        }
        const llama_layer & ml = model.layers[il];
        const kx_pack_layer & pl = pack.layers[il];
        for (const ggml_tensor * w : { ml.ffn_gate, ml.ffn_up }) {
            if (!w || !w->buffer || !ggml_backend_buffer_is_host(w->buffer) || w->ne[1] != n_ff) {
                throw std::runtime_error(kx_fmt(
                    "layer %" PRId64 ": the FFN weights must be in plain host memory for slots (load the "
                    "model with the FFN tensors on the CPU and without repacking)", il));
            }
        }
        // quantization mixes vary types by layer (Q4_K_M: Q4_K and Q6_K): each new combination once
        const int32_t types = (int32_t) ml.ffn_gate->type | (int32_t) ml.ffn_up->type << 8 | (int32_t) pl.down_t->type << 16;
        if (std::find(checked.begin(), checked.end(), types) == checked.end()) {
            kx_slots_check_types(dev, ml.ffn_gate->type, ml.ffn_up->type, pl.down_t->type, n_embd, n_ff);
            checked.push_back(types);
        }
        kx_slot_layer & L = slots->layers[il];
        L.n_slots = S;
        auto dev_t = [&](ggml_type type, int64_t ne0, int64_t ne1, const char * what) {
            ggml_tensor * t = ggml_new_tensor_2d(slots->ctx_dev, type, ne0, ne1);
            ggml_format_name(t, "blk.%d.kx_slot_%s", (int) il, what);
            return t;
        };
        L.gate    = dev_t(ml.ffn_gate->type, n_embd, S, "gate");
        L.up      = dev_t(ml.ffn_up->type, n_embd, S, "up");
        L.down    = dev_t(pl.down_t->type, n_embd, S, "down");
        L.slotmap = dev_t(GGML_TYPE_I32, n_ff, 1, "map");
        L.mapmap  = dev_t(GGML_TYPE_I32, n_ff, 1, "mapmap");
        L.mapdown = dev_t(GGML_TYPE_I32, n_ff, 1, "mapdown");
        L.thr_off = dev_t(GGML_TYPE_F32, 2, 1, "thr_off");
        L.pred       = kx_lowrank_dup(slots->ctx_dev, pl.pred, il, "pred");
        // layer 0's list is never predicted a layer early (kx_slots_list_ahead)
        L.pred_ahead = il > 0 ? kx_lowrank_dup(slots->ctx_dev, pl.pred_ahead, il, "ahead") : kx_lowrank{};
        L.coldmap  = ggml_new_tensor_1d(slots->ctx_host, GGML_TYPE_I32, n_ff);
        L.colddown = ggml_new_tensor_1d(slots->ctx_host, GGML_TYPE_I32, n_ff);
        ggml_format_name(L.coldmap, "blk.%d.kx_coldmap", (int) il);
        ggml_format_name(L.colddown, "blk.%d.kx_colddown", (int) il);
        L.seen = ggml_new_tensor_1d(slots->ctx_host, GGML_TYPE_I32, n_ff + 1);
        ggml_format_name(L.seen, "blk.%d.kx_seen", (int) il);
    }
    if (!ggml_get_first_tensor(slots->ctx_dev)) {
        return slots; // no layer has slots: everything stays on the host
    }
    slots->buf_dev = faults & KX_FAULT_SLOTS ? nullptr
                   : ggml_backend_alloc_ctx_tensors_from_buft(slots->ctx_dev, ggml_backend_dev_buffer_type(dev));
    if (!slots->buf_dev) {
        throw std::runtime_error(kx_fmt("cannot allocate %s memory for the neuron slots", slots->device.c_str()));
    }
    // weights: the scheduler runs the ops reading them on the device that holds them
    ggml_backend_buffer_set_usage(slots->buf_dev, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    slots->bytes_dev = ggml_backend_buffer_get_size(slots->buf_dev);
    slots->buf_host = ggml_backend_alloc_ctx_tensors_from_buft(slots->ctx_host, ggml_backend_cpu_buffer_type());
    if (!slots->buf_host) {
        throw std::runtime_error("cannot allocate host memory for the slot maps");
    }
    ggml_backend_buffer_set_usage(slots->buf_host, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    // the predicted lists the device writes for the host-cache warm-up and the pipeline:
    // page-locked memory the device maps (its host buffer type), plain memory on the CPU;
    // without one the warm-up and the pipeline are off for these slots
    const size_t ahead_stride = (sizeof(int32_t) * (size_t) (n_ff + 2) + 63) / 64 * 64;
    ggml_backend_buffer_type_t ahead_buft =
        slots->on_host ? ggml_backend_cpu_buffer_type() : ggml_backend_dev_host_buffer_type(dev);
    if (ahead_buft) {
        slots->buf_ahead = ggml_backend_buft_alloc_buffer(ahead_buft, ahead_stride * (size_t) n_layer);
    }
    if (slots->buf_ahead) {
        ggml_backend_buffer_clear(slots->buf_ahead, 0);
        char * base = (char *) ggml_backend_buffer_get_base(slots->buf_ahead);
        for (int64_t il = 0; il < n_layer; ++il) {
            if (slots->layers[il].n_slots > 0) {
                slots->layers[il].ahead = (int32_t *) (base + ahead_stride * (size_t) il);
            }
        }
    }

    // pass 2: choose the residents (most frequently active first; ties by id) and fill
    for (int64_t il = 0; il < n_layer; ++il) {
        kx_slot_layer & L = slots->layers[il];
        if (L.n_slots == 0) {
            continue;
        }
        const llama_layer & ml = model.layers[il];
        const kx_pack_layer & pl = pack.layers[il];
        std::vector<int32_t> order(n_ff);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pl.freq[a] > pl.freq[b]; });
        L.resident.assign(order.begin(), order.begin() + L.n_slots);

        const int32_t * down_row = pl.rowmap ? (const int32_t *) pl.rowmap->data : nullptr;
        std::vector<int32_t> slotmap(n_ff, -1), coldmap(n_ff), colddown(n_ff), resident_down(L.n_slots);
        for (int64_t i = 0; i < n_ff; ++i) {
            coldmap[i]  = (int32_t) i;
            colddown[i] = down_row ? down_row[i] : (int32_t) i;
        }
        for (int64_t s = 0; s < L.n_slots; ++s) {
            const int32_t i = L.resident[s];
            resident_down[s] = colddown[i];
            slotmap[i] = (int32_t) s;
            coldmap[i] = colddown[i] = -1;
        }
        kx_gather_rows(ml.ffn_gate, L.resident, L.gate);
        kx_gather_rows(ml.ffn_up, L.resident, L.up);
        kx_gather_rows(pl.down_t, resident_down, L.down);
        ggml_backend_tensor_set(L.slotmap, slotmap.data(), 0, ggml_nbytes(L.slotmap));
        ggml_backend_tensor_memset(L.mapmap, 0xFF, 0, ggml_nbytes(L.mapmap)); // -1: nothing mapped
        ggml_backend_tensor_memset(L.mapdown, 0xFF, 0, ggml_nbytes(L.mapdown));
        ggml_backend_tensor_memset(L.thr_off, 0, 0, ggml_nbytes(L.thr_off)); // the static thresholds
        std::memcpy(L.coldmap->data, coldmap.data(), ggml_nbytes(L.coldmap));
        std::memcpy(L.colddown->data, colddown.data(), ggml_nbytes(L.colddown));
        ((int32_t *) L.seen->data)[0] = -1; // no decode recorded yet
        kx_lowrank_set(L.pred, pl.pred);
        kx_lowrank_set(L.pred_ahead, pl.pred_ahead);
    }
    return slots;
}

static int32_t kx_down_row(const kx_pack_layer & pl, int32_t i) {
    return pl.rowmap ? ((const int32_t *) pl.rowmap->data)[i] : i;
}

// ---------------------------------------------------------------- mapped share

static void * kx_alias_base(ggml_backend_buffer_t b) {
    return b->context;
}

// A tensor of the slots' device whose data is host memory's device address: w's type and
// shape, no copy. Its buffer (one per alias, covering exactly its bytes) belongs to the
// device's buffer type, so the scheduler runs the ops reading it there and never copies
// it; freeing the buffer frees nothing else.
static ggml_tensor * kx_alias(kx_slots & slots, ggml_backend_buffer_type_t buft, const ggml_tensor * w,
                              void * addr, const char * name) {
    ggml_tensor * t = ggml_dup_tensor(slots.ctx_map, w);
    ggml_set_name(t, name);
    ggml_backend_buffer_i iface = {};
    iface.get_base = kx_alias_base;
    ggml_backend_buffer_t b = ggml_backend_buffer_init(buft, iface, addr, ggml_backend_buft_get_alloc_size(buft, t));
    ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    slots.map_bufs.push_back(b);
    if (ggml_backend_tensor_alloc(b, t, addr) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error(kx_fmt("cannot alias %s on %s", w->name, slots.device.c_str()));
    }
    return t;
}

void kx_slots_set_mapped_share(kx_slots & slots, const llama_model & model, const kx_pack & pack, float share) {
    if (!(share >= 0.0f && share < 1.0f)) {
        throw std::runtime_error(kx_fmt("the mapped share must be in [0, 1), not %g", (double) share));
    }
    const int64_t n_ff = pack.n_ff;
    // the device part: give every mapped neuron back to the host side first
    for (int64_t il = 0; il < (int64_t) slots.layers.size(); ++il) {
        kx_slot_layer & L = slots.layers[il];
        if (L.n_slots == 0 || L.n_mapped == 0) {
            continue;
        }
        for (int64_t i = 0; i < n_ff; ++i) {
            if (L.mapped[i]) {
                kx_slot_to_host(L, pack.layers[il], (int32_t) i);
            }
        }
        L.mapped.assign(n_ff, 0);
        ggml_backend_tensor_memset(L.mapmap, 0xFF, 0, ggml_nbytes(L.mapmap));
        ggml_backend_tensor_memset(L.mapdown, 0xFF, 0, ggml_nbytes(L.mapdown));
        ggml_backend_tensor_memset(L.thr_off, 0, 0, ggml_nbytes(L.thr_off)); // the static thresholds
        L.n_mapped = 0;
    }
    slots.mapped_share = 0.0f;
    if (share == 0.0f) {
        return;
    }

    ggml_backend_dev_t dev = ggml_backend_dev_by_name(slots.device.c_str());
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    if (!slots.map_engine) {
        int32_t index = 0;
        slots.map_io = kx_reload_engine(slots.device, &index);
        slots.map_engine = slots.map_io->create(index, KX_RELOAD_GATHER, 1);
        if (!slots.map_engine || !slots.map_io->host_addr) {
            throw std::runtime_error(kx_fmt("cannot map host memory for %s", slots.device.c_str()));
        }
        ggml_init_params ip = { ggml_tensor_overhead()*(size_t) (3*slots.layers.size() + 1), nullptr, true };
        slots.ctx_map = ggml_init(ip);
    }
    // the host rows' device addresses: the whole buffers, as the balancer's reloads do
    auto addr_of = [&](const ggml_tensor * w) {
        if (slots.map_io->host_register(slots.map_engine, ggml_backend_buffer_get_base(w->buffer),
                                        ggml_backend_buffer_get_size(w->buffer))) {
            throw std::runtime_error(kx_fmt("the host memory of %s cannot be mapped for %s (load the model "
                                            "with page-locked host weights)", w->name, slots.device.c_str()));
        }
        void * a = slots.map_io->host_addr(slots.map_engine, w->data);
        if (!a) {
            throw std::runtime_error(kx_fmt("%s has no device address on %s", w->name, slots.device.c_str()));
        }
        return a;
    };
    for (int64_t il = 0; il < (int64_t) slots.layers.size(); ++il) {
        kx_slot_layer & L = slots.layers[il];
        if (L.n_slots == 0) {
            continue;
        }
        const llama_layer & ml = model.layers[il];
        const kx_pack_layer & pl = pack.layers[il];
        // the types: the device's row kernels read them (kx_slots_check_types, when the slots were built)
        if (!L.map_gate) {
            L.map_gate = kx_alias(slots, buft, ml.ffn_gate, addr_of(ml.ffn_gate), kx_fmt("blk.%d.kx_map_gate", (int) il).c_str());
            L.map_up   = kx_alias(slots, buft, ml.ffn_up, addr_of(ml.ffn_up), kx_fmt("blk.%d.kx_map_up", (int) il).c_str());
            L.map_down = kx_alias(slots, buft, pl.down_t, addr_of(pl.down_t), kx_fmt("blk.%d.kx_map_down", (int) il).c_str());
        }
        // host-side neurons, hottest first (ties by id), until their frequency reaches the share
        const int32_t * coldmap = (const int32_t *) L.coldmap->data;
        std::vector<int32_t> cold;
        double total = 0.0;
        for (int64_t i = 0; i < n_ff; ++i) {
            if (coldmap[i] >= 0) {
                cold.push_back((int32_t) i);
                total += pl.freq[i];
            }
        }
        std::stable_sort(cold.begin(), cold.end(), [&](int32_t a, int32_t b) { return pl.freq[a] > pl.freq[b]; });
        std::vector<int32_t> mm(n_ff, -1), md(n_ff, -1);
        L.mapped.assign(n_ff, 0);
        int32_t * cm = (int32_t *) L.coldmap->data;
        int32_t * cd = (int32_t *) L.colddown->data;
        double acc = 0.0;
        for (int32_t i : cold) {
            if (acc >= share * total) {
                break;
            }
            acc += pl.freq[i];
            mm[i] = cm[i];
            md[i] = cd[i];
            cm[i] = cd[i] = -1;
            L.mapped[i] = 1;
            ++L.n_mapped;
        }
        ggml_backend_tensor_set(L.mapmap, mm.data(), 0, ggml_nbytes(L.mapmap));
        ggml_backend_tensor_set(L.mapdown, md.data(), 0, ggml_nbytes(L.mapdown));
    }
    slots.mapped_share = share;
}

void kx_slot_to_host(kx_slot_layer & L, const kx_pack_layer & pl, int32_t i) {
    ((int32_t *) L.coldmap->data)[i]  = i;
    ((int32_t *) L.colddown->data)[i] = kx_down_row(pl, i);
}

void kx_slot_row_copies(const kx_slot_layer & L, const llama_layer & ml, const kx_pack_layer & pl, int32_t i,
                        int32_t s, kx_row_copy out[3]) {
    const ggml_tensor * src[3] = { ml.ffn_gate, ml.ffn_up, pl.down_t };
    const ggml_tensor * dst[3] = { L.gate, L.up, L.down };
    const int32_t row[3] = { i, i, kx_down_row(pl, i) };
    for (int k = 0; k < 3; ++k) {
        out[k] = { (const char *) src[k]->data + (size_t) row[k] * src[k]->nb[1],
                   (char *) dst[k]->data + (size_t) s * dst[k]->nb[1], (uint64_t) dst[k]->nb[1] };
    }
}

void kx_slots_swap(kx_slots & slots, const llama_model & model, const kx_pack & pack, int32_t il,
                   const int32_t * evict, int32_t n_evict, const int32_t * admit, int32_t n_admit) {
    if (il < 0 || il >= (int32_t) slots.layers.size() || slots.layers[il].n_slots == 0) {
        throw std::runtime_error(kx_fmt("layer %d has no neuron slots", (int) il));
    }
    if (n_evict < 0 || n_admit < 0 || (n_evict > 0 && !evict) || (n_admit > 0 && !admit)) {
        throw std::runtime_error("swap: bad neuron lists");
    }
    kx_slot_layer & L = slots.layers[il];
    const int64_t n_ff = pack.n_ff;
    std::vector<int32_t> slot_of(n_ff, -1);
    std::vector<int32_t> empty;
    for (int64_t s = 0; s < L.n_slots; ++s) {
        if (L.resident[s] >= 0) {
            slot_of[L.resident[s]] = (int32_t) s;
        } else {
            empty.push_back((int32_t) s);
        }
    }
    std::vector<uint8_t> seen(n_ff, 0);
    for (int32_t k = 0; k < n_evict; ++k) {
        const int32_t i = evict[k];
        if (i < 0 || i >= n_ff || slot_of[i] < 0 || seen[i]) {
            throw std::runtime_error(kx_fmt("swap: layer %d: neuron %d is not resident (or listed twice)", (int) il, (int) i));
        }
        seen[i] = 1;
    }
    for (int32_t k = 0; k < n_admit; ++k) {
        const int32_t i = admit[k];
        if (i < 0 || i >= n_ff || slot_of[i] >= 0 || seen[i]) {
            throw std::runtime_error(kx_fmt("swap: layer %d: neuron %d is resident, out of range or listed twice", (int) il, (int) i));
        }
        if (!L.mapped.empty() && L.mapped[i]) {
            // it would be computed twice: by its slot and from its mapped host rows
            throw std::runtime_error(kx_fmt("swap: layer %d: neuron %d is computed from mapped host rows "
                                            "(set the mapped share to 0 first)", (int) il, (int) i));
        }
        seen[i] = 1;
    }
    if (n_admit > n_evict + (int32_t) empty.size()) {
        throw std::runtime_error(kx_fmt("swap: layer %d: %d neurons to load, %d slots free after the evictions",
                                        (int) il, (int) n_admit, (int) (n_evict + empty.size())));
    }
    const llama_layer & ml = model.layers[il];
    const kx_pack_layer & pl = pack.layers[il];
    int32_t * coldmap = (int32_t *) L.coldmap->data;
    int32_t * colddown = (int32_t *) L.colddown->data;
    const int32_t none = -1;
    for (int32_t k = 0; k < n_evict; ++k) {
        const int32_t i = evict[k], s = slot_of[i];
        L.resident[s] = -1;
        empty.push_back(s);
        kx_slot_to_host(L, pl, i); // one active list is split by these maps
        ggml_backend_tensor_set(L.slotmap, &none, (size_t) i * sizeof(int32_t), sizeof(int32_t));
    }
    // freed slots are refilled last-freed first; any order is valid, this one is deterministic
    for (int32_t k = 0; k < n_admit; ++k) {
        const int32_t i = admit[k];
        const int32_t s = empty.back();
        empty.pop_back();
        kx_row_copy rows[3];
        kx_slot_row_copies(L, ml, pl, i, s, rows);
        ggml_tensor * dst[3] = { L.gate, L.up, L.down };
        for (int r = 0; r < 3; ++r) {
            ggml_backend_tensor_set(dst[r], rows[r].src, (size_t) ((const char *) rows[r].dst - (const char *) dst[r]->data),
                                    rows[r].bytes);
        }
        ggml_backend_tensor_set(L.slotmap, &s, (size_t) i * sizeof(int32_t), sizeof(int32_t));
        coldmap[i] = colddown[i] = -1;
        L.resident[s] = i;
    }
}
