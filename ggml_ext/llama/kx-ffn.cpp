// The neuron-sparse FFN graph for llama, qwen2 and gemma3 (one helper for all three).
//
//   exact:     g   = W_gate·x                       (all neurons: the truth)
//              sel = kx_select(act(g) > 0)          (threshold mode: > the pack's threshold)
//   predicted: s   = B·(A·x) + c                    (the pack's low-rank predictor)
//              sel = kx_select(s > 0)
//              g   = kx_mul_mat_rows(W_gate, x, sel)
//   both:      u   = kx_mul_mat_rows(W_up, x, sel)
//              h   = glu(g, u)                      (the dense path's own op: same numerics)
//              y   = kx_axpy_rows(W_down^T, h, sel) (pack rows, via the row map if permuted)
//
// Rows outside sel are 0 in g (predicted) and u, so h is 0 there and glu needs no mask.
// A gated model's activation is nonzero almost everywhere, so its exact mode would list every
// neuron: outside the hybrid its FFN stays llama.cpp's (same result, full speed).
// On the CPU the last three (and the predicted path's gate rows) run as one node,
// kx_ffn_rows (cpu/kx-ffn-rows.c: one barrier instead of three, each thread streaming its
// own neurons' rows; KB-7B's static split 1.26x faster on the H200, docs/benchmarking.md).
//
// Hybrid layers (neuron slots, kx-slots.h) split every step above over one active list:
//   GPU: g, u, h, y_gpu over the slot buffers through slotmap (resident neurons only)
//   CPU: g, u, h, y_cpu over the host weights through coldmap/colddown (the others)
//   y = y_cpu + y_gpu
// The predictor and select run where x is (the slots' device holds the predictor). Node
// order puts the CPU part first, so the GPU part heads the next split and the scheduler
// (patch 0010) runs it while the CPU part computes.
//
// One layer ahead (the balancer's pipeline, kx-balance.h): when layer il+1 is hybrid too,
// layer il also predicts il+1's active set from its own x, and two host nodes bracket the CPU
// part: the first starts the reloads of il+1's missing neurons (they run while both parts of
// il compute; three nodes, kx-pipeline.cpp), the last publishes those that landed into il+1's
// slot map. The scheduler
// queues il+1's slot part only after this CPU split returns, so it sees a settled map.
#include "kx-ffn.h"
#include "kx-hybrid.h"
#include "kx-warm.h"

#include "kx-ops.h"

#include "llama-cparams.h"
#include "llama-impl.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

// Prefill stays dense: above this many tokens per ubatch the union of active sets
// approaches the whole layer and dense GEMM kernels beat row gathers.
static constexpr int64_t kx_sparse_max_tokens = 8;
// kx_max_density (kx-pack.h): a selection denser than that runs every row; it bounds the
// worst case of a bad prediction.

// exact and threshold modes compute every neuron's gate and select on act(gate)
static bool kx_mode_gates_all(int32_t mode) {
    return mode == KX_SPARSE_EXACT || mode == KX_SPARSE_THRESHOLD;
}

// the |act(gate)| a neuron must exceed: 0 keeps exact mode exact on any model
static float kx_mode_threshold(int32_t mode, const kx_pack_layer & L) {
    return mode == KX_SPARSE_THRESHOLD ? L.threshold : 0.0f;
}

static bool kx_host_plain(const ggml_tensor * w) {
    // repacked CPU weights (extra buffer types) are not host buffers: their rows are
    // interleaved, so a row gather cannot read them
    return w && w->buffer && ggml_backend_buffer_is_host(w->buffer);
}

// act(g) * u with the dense path's own op
static ggml_tensor * kx_glu(ggml_context * ctx0, ggml_tensor * gv, ggml_tensor * uv, llm_ffn_op_type type_op) {
    switch (type_op) {
        case LLM_FFN_RELU: return ggml_reglu_split(ctx0, gv, uv);
        case LLM_FFN_SILU: return ggml_swiglu_split(ctx0, gv, uv);
        default:           return ggml_geglu_split(ctx0, gv, uv);
    }
}

// A predicted hybrid layer whose slots hold every neuron has nothing for the host: its graph is
// the device part alone, with no CPU split, no hand-off and no warm-up (the CPU split had 19 µs a
// layer of fixed cost, and the warm-up's list 23 µs of device time, where there was nothing to
// compute: KB-7B Q4_K_M on an H100, every neuron in slots). Only with the split as it was filled:
// the balancer reads each layer's list from the host part (and may give up a slot), the
// load-aware thresholds split the select by side, a mapped share reads host rows.
static bool kx_layer_whole(const kx_hybrid & hy, int32_t mode, int il) {
    if (mode != KX_SPARSE_PREDICTED || hy.balancer || hy.thr || !hy.slots || il < 0 ||
        (size_t) il >= hy.slots->layers.size()) {
        return false;
    }
    const kx_slot_layer & H = hy.slots->layers[il];
    const int64_t n_ff = H.slotmap ? ggml_nelements(H.slotmap) : 0;
    if (n_ff == 0 || H.n_mapped > 0 || H.n_slots < n_ff || (int64_t) H.resident.size() < n_ff) {
        return false;
    }
    return std::all_of(H.resident.begin(), H.resident.end(), [](int32_t id) { return id >= 0; });
}

// Hybrid layers warm the host's caches with their rows while the CPU waits for the device
// (kx-warm.cpp). On by default (kx_params::warm): KB-7B 1.05-1.20x, KB-13B 1.03-1.28x in every
// interleaved pair on the H200 (bench/results/archive/balance-live/warm/); beside a mapped share it
// neither gains nor loses. On a Q4_K_M model too, whose host rows are ~1 MB a layer: without it
// the device loses the next layer's list but the CPU part, reading cold rows, grows by more
// (KB-7B at 3 GiB, H100: 0.89-0.93x, bench/results/KB-7B-q4_k_m-h100/).
// layer il of these slots warms up: a predicted hybrid layer whose list the layer before can
// write to the host, on a device (with slots on the CPU both parts share one split: there is
// no wait to fill)
static bool kx_warm_layer(const kx_hybrid & hy, int32_t mode, int il) {
    return hy.warm_on && mode == KX_SPARSE_PREDICTED && !hy.slots->on_host && kx_slots_list_ahead(*hy.slots, il) &&
           il < hy.pack->n_layer && (size_t) il < hy.warm.size() && !kx_layer_whole(hy, mode, il);
}

// the balancer's pipeline prefetches layer il within the decode, from the list the warm-up
// reads (any mode: the pipeline's list comes from the predictor)
static bool kx_pipe_layer(const kx_hybrid & hy, int il) {
    return hy.pipeline() && kx_slots_list_ahead(*hy.slots, il) && il < hy.pack->n_layer && hy.pack->layers[il].pred;
}

// the prefetch's three phases (kx-pipeline.cpp): begin and end on one thread, the scan on all.
// Every compute thread calls every node (n_tasks only sizes the work buffer).
static void kx_pipe_begin_op(ggml_tensor *, const ggml_tensor *, int ith, int nth, void * hook) {
    if (ith == 0) {
        const kx_pipe_hook * h = (const kx_pipe_hook *) hook;
        kx_pipe_hook_prefetch(h->hybrid->balancer.get(), h->il, 0, h->hybrid->slots->layers[h->il].ahead, ith, nth);
    }
}

static void kx_pipe_scan_op(ggml_tensor *, const ggml_tensor *, int ith, int nth, void * hook) {
    const kx_pipe_hook * h = (const kx_pipe_hook *) hook;
    kx_pipe_hook_prefetch(h->hybrid->balancer.get(), h->il, 1, nullptr, ith, nth);
}

static void kx_pipe_end_op(ggml_tensor *, const ggml_tensor *, int ith, int nth, void * hook) {
    if (ith == 0) {
        const kx_pipe_hook * h = (const kx_pipe_hook *) hook;
        kx_pipe_hook_prefetch(h->hybrid->balancer.get(), h->il, 2, nullptr, ith, nth);
    }
}

static void kx_pipe_publish_op(ggml_tensor *, const ggml_tensor *, int ith, int, void * hook) {
    if (ith == 0) {
        const kx_pipe_hook * h = (const kx_pipe_hook *) hook;
        kx_pipe_hook_publish(h->hybrid->balancer.get(), h->il, h->consume ? h->hybrid->slots->layers[h->il].ahead : nullptr,
                             h->reader);
    }
}

// the graph scheduler's backend of ggml device `device` (nullptr when it has none)
static ggml_backend_t kx_sched_backend_of(const llm_graph_context & g, const std::string & device) {
    for (int i = 0; i < ggml_backend_sched_get_n_backends(g.sched); ++i) {
        ggml_backend_t be = ggml_backend_sched_get_backend(g.sched, i);
        ggml_backend_dev_t dev = ggml_backend_get_device(be);
        if (dev && device == ggml_backend_dev_name(dev)) {
            return be;
        }
    }
    return nullptr;
}

// s = B·(A·x) + c with the predictor copy on the slots' device where there is one.
// There B runs as a row op without a list (several short rows a warp), c added in its
// epilogue: ggml's matvec gives each row a block, 15.9 µs per layer for KB-7B's [256, 11008]
// F32 B on the decode's critical path (H200, Nsight Compute), and the add was a 3.4 µs kernel
// of its own (H100). Rows in 16-byte loads need rank % 8 == 0; another rank stays on ggml's
// matvec rather than copying B to the CPU each token.
static ggml_tensor * kx_predict(ggml_context * ctx0, ggml_tensor * cur, const kx_lowrank & host,
                                const kx_lowrank * dev) {
    // the slots copy each of a layer's predictors whole or not at all (kx-slots.cpp)
    const bool on_dev = dev && *dev;
    const kx_lowrank & p = on_dev ? *dev : host;
    ggml_tensor * s = ggml_mul_mat(ctx0, p.a, cur);
    if (on_dev && p.b->ne[0] % 8 == 0) {
        return ggml_kx_mul_mat_rows_bias(ctx0, p.b, s, p.c);
    }
    return ggml_add(ctx0, ggml_mul_mat(ctx0, p.b, s), p.c);
}

static ggml_tensor * kx_build_ffn_hybrid(
        const llm_graph_context & g, ggml_tensor * cur, ggml_tensor * up, ggml_tensor * gate,
        llm_ffn_op_type type_op, int32_t mode, enum kx_select_act act,
        const kx_hybrid & hy, const kx_pack_layer & L, const kx_slot_layer & H, int il) {
    ggml_context * ctx0 = g.ctx0;
    const kx_pack & pack = *hy.pack;
    kx_slots & slots = *hy.slots;
    auto on_cpu = [&](ggml_tensor * t) {
        // the host part must stay on the CPU even where the scheduler would spread the
        // device's nodes over unassigned neighbours (the GLU has no weight to pin it)
        ggml_backend_sched_set_tensor_backend(g.sched, t, g.backend_cpu);
        return t;
    };

    ggml_tensor * sel;
    ggml_tensor * g_all = nullptr;
    if (kx_mode_gates_all(mode)) {
        // exact / threshold: the true gate of every neuron, from the host weights
        g_all = on_cpu(ggml_mul_mat(ctx0, gate, cur));
        g.cb(g_all, "ffn_gate", il);
        sel = on_cpu(ggml_kx_select(ctx0, g_all, kx_mode_threshold(mode, L), kx_max_density, act));
    } else {
        ggml_tensor * s = kx_predict(ctx0, cur, L.pred, &H.pred);
        g.cb(s, "kx_pred", il);
        // load-aware thresholds (kx-thresholds.h): one offset per side, read from the slots' device
        sel = hy.thr ? ggml_kx_select_split(ctx0, s, 0.0f, kx_max_density, H.slotmap, H.thr_off)
                              : ggml_kx_select(ctx0, s, 0.0f, kx_max_density, KX_SELECT_SCORE);
    }
    g.cb(sel, "kx_sel", il);
    const bool whole     = kx_layer_whole(hy, mode, il);
    const bool warm      = kx_warm_layer(hy, mode, il);
    const bool warm_next = kx_warm_layer(hy, mode, il + 1);
    const bool pipe_next = kx_pipe_layer(hy, il + 1);
    if (warm) {
        // first on the CPU, before anything that reads the split's inputs (kx-warm.h)
        kx_warm_hook & wh = hy.warm[il];
        wh = { &H, gate, up, L.down_t };
        ggml_build_forward_expand(g.gf, sel);
        ggml_tensor * w = on_cpu(ggml_map_custom1(ctx0, H.coldmap, kx_warm_op, GGML_N_TASKS_MAX, &wh));
        ggml_set_name(w, "kx_warm");
        ggml_build_forward_expand(g.gf, w);
    }
    // layer il+1's list predicted from this x (the residual stream changes little from one
    // layer to the next), written by its select into host memory for the warm-up and the
    // pipeline: no scheduler copy, so nothing waits for it
    auto list_next = [&]() {
        const kx_slot_layer & N = slots.layers[il + 1];
        const kx_pack_layer & P = pack.layers[il + 1];
        // its ahead predictor where the pack has one (trained on this input), else its own
        ggml_tensor * s = P.pred_ahead ? kx_predict(ctx0, cur, P.pred_ahead, &N.pred_ahead)
                                       : kx_predict(ctx0, cur, P.pred, &N.pred);
        // with load-aware thresholds, the rows the host part will read (not those it skips);
        // the pipeline needs the whole list (a listed resident is no victim)
        ggml_tensor * sn = ggml_kx_select_set_host(
            hy.thr && !pipe_next ? ggml_kx_select_split(ctx0, s, 0.0f, kx_max_density, N.slotmap, N.thr_off)
                                 : ggml_kx_select(ctx0, s, 0.0f, kx_max_density, KX_SELECT_SCORE), N.ahead);
        g.cb(sn, "kx_sel_next", il);
        ggml_build_forward_expand(g.gf, sn);
    };
    if (pipe_next && slots.on_host) {
        list_next(); // one split: the list first, for the prefetch below
    }
    // the balancer's view of this decode: the list, copied on the CPU beside the host part
    // (which receives the list anyway); a few KiB per layer, only while a balancer runs (starting
    // or stopping one rebuilds the graphs). The pipeline's prefetch reads it as a node of its
    // own; otherwise the host op copies it while scanning the list
    kx_pipe_hook * hook = pipe_next ? const_cast<kx_pipe_hook *>(&hy.hooks[il + 1]) : nullptr;
    if (pipe_next) {
        ggml_tensor * seen = on_cpu(ggml_cpy(ctx0, sel, H.seen));
        ggml_build_forward_expand(g.gf, seen);
        hook->consume = !warm_next;
        hook->reader  = kx_sched_backend_of(g, slots.device);
        // after the copy above (the prefetch observes this layer's list): the reloads then run
        // beside both parts of this layer. The prefetch waits for layer il+1's list, which the
        // device writes beside this CPU part; with the balancer's thread the node only posts
        // the step and the thread waits and decides
        ggml_tensor * p = on_cpu(ggml_map_custom1(ctx0, seen, kx_pipe_begin_op, 1, hook));
        if (!hy.pipe_worker()) {
            p = on_cpu(ggml_map_custom1(ctx0, p, kx_pipe_scan_op, GGML_N_TASKS_MAX, hook));
            p = on_cpu(ggml_map_custom1(ctx0, p, kx_pipe_end_op, 1, hook));
        }
        ggml_build_forward_expand(g.gf, p);
    }

    // host part (neurons not resident): coldmap sends the resident ones to -1; none where the
    // slots hold every neuron (the balancer, which reads the host part's list, is off then)
    ggml_tensor * yc = nullptr;
    if (!whole) {
        yc = on_cpu(ggml_kx_ffn_rows(ctx0, gate, up, L.down_t, cur, sel, H.coldmap, H.colddown, g_all, act));
        if (hy.balancer && !pipe_next) {
            ggml_kx_ffn_rows_copy_list(yc, H.seen);
        }
        if (warm) {
            ggml_kx_ffn_rows_own_shares(yc); // each core reads the rows it warmed
        }
        g.cb(yc, "ffn_out_cpu", il);
        if (warm_next || pipe_next) {
            // in the split of the other CPU nodes: the device nodes that follow (the next layer's
            // list among them) then head the next split and run beside this CPU part
            ggml_build_forward_expand(g.gf, yc);
        }
    }
    if (pipe_next) {
        // last on the CPU, before the scheduler queues anything of layer il+1
        ggml_build_forward_expand(g.gf, on_cpu(ggml_map_custom1(ctx0, yc, kx_pipe_publish_op, 1, hook)));
    }

    // device parts: the resident neurons from the slots, and the mapped share of the host side
    // read from the host rows over PCIe (kx-slots.h), the same three steps through their own
    // weights and maps in the same split; for ReLU the up rows only of neurons whose gate fired
    // (the host op skips them the same way, kx-ffn-rows.c), and the GLU in the up rows' op
    auto device_part = [&](ggml_tensor * gate_w, ggml_tensor * up_w, ggml_tensor * down_w, ggml_tensor * map,
                           ggml_tensor * dmap, const char * up_name, const char * act_name, const char * out_name) {
        ggml_tensor * gv = ggml_kx_mul_mat_rows(ctx0, gate_w, cur, sel, map);
        ggml_tensor * hv;
        if (type_op == LLM_FFN_RELU) {
            hv = ggml_kx_mul_mat_rows_gated(ctx0, up_w, cur, sel, map, gv); // relu(g) * u: the GLU too
        } else {
            ggml_tensor * uv = ggml_kx_mul_mat_rows(ctx0, up_w, cur, sel, map);
            g.cb(uv, up_name, il);
            hv = kx_glu(ctx0, gv, uv, type_op);
        }
        g.cb(hv, act_name, il);
        ggml_tensor * yv = ggml_kx_axpy_rows(ctx0, down_w, hv, sel, dmap);
        g.cb(yv, out_name, il);
        return yv;
    };
    if ((warm_next || pipe_next) && !(pipe_next && slots.on_host)) {
        list_next();
    }
    ggml_tensor * yg = device_part(H.gate, H.up, H.down, H.slotmap, H.slotmap, "ffn_up_gpu", "ffn_act_gpu", "ffn_out_gpu");
    if (H.n_mapped > 0) {
        yg = ggml_add(ctx0, yg, device_part(H.map_gate, H.map_up, H.map_down, H.mapmap, H.mapdown,
                                            "ffn_up_map", "ffn_act_map", "ffn_out_map"));
    }

    ggml_tensor * y = yc ? ggml_add(ctx0, yc, yg) : yg;
    g.cb(y, "ffn_out", il);
    return y;
}

ggml_tensor * kx_build_ffn_sparse(
        const llm_graph_context & g,
        ggml_tensor * cur,
        ggml_tensor * up,   ggml_tensor * up_b,   ggml_tensor * up_s,
        ggml_tensor * gate, ggml_tensor * gate_b, ggml_tensor * gate_s,
        ggml_tensor * down, ggml_tensor * down_b, ggml_tensor * down_s,
        ggml_tensor * act_scales,
        llm_ffn_op_type type_op, llm_ffn_gate_type type_gate, int il) {
    const kx_hybrid * hy   = g.cparams.kx_sparse_hybrid;
    const kx_pack *   pack = hy ? hy->pack.get() : nullptr;
    const int32_t     mode = g.cparams.kx_sparse_mode;
    if (!pack || mode == 0 || il < 0 || il >= pack->n_layer) {
        return nullptr;
    }
    if (g.arch != LLM_ARCH_LLAMA && g.arch != LLM_ARCH_QWEN2 && g.arch != LLM_ARCH_GEMMA3) {
        return nullptr;
    }
    if (up_b || up_s || gate_b || gate_s || down_b || down_s || act_scales || !gate || !down ||
        gate->type != up->type || type_gate != LLM_FFN_PAR || (g.loras && !g.loras->empty())) {
        return nullptr;
    }
    enum kx_select_act act;
    switch (type_op) {
        case LLM_FFN_RELU: act = KX_SELECT_RELU; break;
        case LLM_FFN_SILU: act = KX_SELECT_SILU; break;
        case LLM_FFN_GELU: act = KX_SELECT_GELU; break;
        default: return nullptr;
    }
    const kx_pack_layer & L = pack->layers[il];
    if (up->ne[0] != pack->n_embd || up->ne[1] != pack->n_ff || cur->ne[0] != pack->n_embd ||
        cur->ne[1] > kx_sparse_max_tokens || ggml_nrows(cur) != cur->ne[1]) {
        return nullptr;
    }
    const bool slots = hy->slots && hy->slots->layers[il].n_slots > 0;
    if (mode == KX_SPARSE_PREDICTED && !L.pred) {
        return nullptr; // no predictor: the dense FFN
    }
    if (!slots && (mode == KX_SPARSE_EXACT ? act != KX_SELECT_RELU : !L.pays)) {
        return nullptr; // every neuron fires, or the lists are too dense to gain: the dense FFN
    }
    if (!kx_host_plain(up) || !kx_host_plain(gate)) {
        static bool warned = false;
        if (!warned) {
            warned = true;
            LLAMA_LOG_WARN("%s: layer %d: FFN weights are not in plain host memory (offloaded or repacked); "
                           "such layers run dense (load the model with use_extra_bufts=false / --no-repack)\n",
                           __func__, il);
        }
        return nullptr;
    }

    ggml_context * ctx0 = g.ctx0;
    if (!ggml_is_contiguous(cur)) {
        cur = ggml_cont(ctx0, cur);
    }
    const kx_slot_layer * H = slots ? &hy->slots->layers[il] : nullptr;
    if (H) {
        return kx_build_ffn_hybrid(g, cur, up, gate, type_op, mode, act, *hy, L, *H, il);
    }

    ggml_tensor * sel;
    ggml_tensor * gv = nullptr;
    if (kx_mode_gates_all(mode)) {
        gv = ggml_mul_mat(ctx0, gate, cur);
        g.cb(gv, "ffn_gate", il);
        sel = ggml_kx_select(ctx0, gv, kx_mode_threshold(mode, L), kx_max_density, act);
    } else {
        ggml_tensor * s = kx_predict(ctx0, cur, L.pred, nullptr);
        g.cb(s, "kx_pred", il);
        sel = ggml_kx_select(ctx0, s, 0.0f, kx_max_density, KX_SELECT_SCORE);
    }
    g.cb(sel, "kx_sel", il);
    ggml_tensor * y = ggml_kx_ffn_rows(ctx0, gate, up, L.down_t, cur, sel, nullptr, L.rowmap,
                                       gv, act);
    g.cb(y, "ffn_out", il);
    return y;
}
