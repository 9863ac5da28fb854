// Streamed weights (kx-stream.h): the choice on the load path and the engine behind the
// scheduler's hooks (patches/0018).
//
// The engine never changes a graph. A streamed tensor points either at its page-locked host
// copy (the stock placement: the CPU multiplies it, or a prompt batch's offload copies it) or
// at a slot of the device's scratch buffer, whose buffer the scheduler then assigns to the
// device like any resident weight. Which one is decided per graph before it is split
// ("on" for a decode step: every run of streamed tensors between two CPU ops fits the
// slots, since one device split may read a whole run). On, the graph's order of use numbers
// them and tensor p lives in slot p % n_slots. The copier's stream copies tensor p once the
// reader of p - n_slots has been queued behind an event (freed), and the device's stream
// waits for the copy (copied) before the split that reads p; the first ones of the next token
// are copied behind the last readers of this one. So the copy engine runs up to n_slots
// tensors ahead of the device, while the CPU works on the tensors in between.
#include "kx-stream.h"

#include "kairox.h"
#include "kx-migrate.h"
#include "kx-pack.h"
#include "kx-trace.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>

// streamed tensors -> their host buffer, for every context's engine: where the placement put
// them, whichever buffer they point at now
static std::mutex kx_stream_mu;
static std::unordered_map<const ggml_tensor *, ggml_backend_buffer_t> kx_stream_homes;

ggml_backend_buffer_t kx_stream_home(const ggml_tensor * t) {
    std::lock_guard<std::mutex> lk(kx_stream_mu);
    auto it = kx_stream_homes.find(t);
    return it == kx_stream_homes.end() ? nullptr : it->second;
}

kx_stream_chain kx_stream_chain_of(const std::vector<kx_place_item> & all, const std::vector<std::string> & cpu,
                                   int64_t scratch) {
    std::map<std::string, const kx_place_item *> by_name;
    for (const kx_place_item & it : all) {
        by_name[it.name] = &it;
    }
    kx_stream_chain ch;
    for (const kx_place_group & g : kx_place_groups(all)) {
        for (const std::string & n : g.names) {
            const kx_place_item * it = by_name.at(n);
            if (std::find(cpu.begin(), cpu.end(), n) == cpu.end()) {
                ch.gpu_bytes += (int64_t) ((double) it->bytes * it->read);
                continue;
            }
            // an MoE expert tensor is read in part: streamed it would cross PCIe whole
            ch.tensors.push_back({ it->read >= 1.0 ? it->bytes : scratch + 1, ch.gpu_bytes, it->read });
            ch.names.push_back(n);
        }
    }
    return ch;
}

kx_migrate_rates kx_stream_rates(const kx_dense_rates & rates, const std::vector<kx_place_item> & all,
                                 const std::vector<std::string> & cpu) {
    // (one type's rate exactly as given: the mean of equal rates may differ in the last bit,
    // and ties in the policy are broken by exact comparison)
    std::map<std::string, double> type_bytes;
    for (const kx_place_item & it : all) {
        if (std::find(cpu.begin(), cpu.end(), it.name) != cpu.end()) {
            type_bytes[it.type] += (double) it.bytes * it.read;
        }
    }
    kx_migrate_rates r = { rates.cpu_gbs, rates.gpu_gbs, rates.pcie_gbs };
    if (type_bytes.size() == 1) {
        r.cpu_gbs = rates.cpu_of(type_bytes.begin()->first);
        r.gpu_gbs = rates.gpu_of(type_bytes.begin()->first);
    } else if (type_bytes.size() > 1) {
        double bytes = 0, cpu_s = 0, gpu_s = 0;
        for (const auto & [type, b] : type_bytes) {
            bytes += b;
            cpu_s += b / rates.cpu_of(type);
            gpu_s += b / rates.gpu_of(type);
        }
        r.cpu_gbs = bytes / cpu_s;
        r.gpu_gbs = bytes / gpu_s;
    }
    return r;
}

kx_stream_choice kx_stream_choose(const kx_dry_run_fn & dry_run, int64_t budget, const kx_dense_rates & rates) {
    // a dry run loads the model's metadata and sizes a context: each placement tried below
    // starts from the same one with nothing moved, and their rounds may ask for the same sets
    std::map<std::vector<std::string>, kx_dry_sizes> dry_made;
    const kx_dry_run_fn dry = [&](const std::vector<std::string> & cpu) {
        auto it = dry_made.find(cpu);
        return it != dry_made.end() ? it->second : dry_made.emplace(cpu, dry_run(cpu)).first->second;
    };
    kx_stream_choice plain;
    plain.cpu = kx_place_dense(dry, budget, rates, &plain.placed);
    if (plain.cpu.empty()) {
        return plain;
    }
    const kx_dry_sizes all = dry({});
    std::map<std::string, const kx_place_item *> by_name;
    for (const kx_place_item & it : all.items) {
        by_name[it.name] = &it;
    }
    // the modelled step of a placement (cpu: its host tensors), streaming what fits a slot of
    // the scratch (0: nothing); `c` gets the choice
    auto model = [&](const std::vector<std::string> & cpu, int64_t scratch, kx_stream_choice * c) {
        const kx_stream_chain ch = kx_stream_chain_of(all.items, cpu, scratch);
        std::vector<bool> st;
        const double s = kx_migrate_choose(ch.tensors, kx_stream_rates(rates, all.items, cpu), ch.gpu_bytes, scratch, st);
        if (c) {
            for (size_t i = 0; i < ch.tensors.size(); ++i) {
                if (st[i]) {
                    c->streamed.push_back(ch.names[i]);
                }
                if (ch.tensors[i].nbytes <= scratch / kx_stream_slots) {
                    c->slotted.push_back(ch.names[i]);
                }
            }
        }
        return s;
    };
    plain.plain_s = plain.step_s = model(plain.cpu, 0, nullptr);
    // The slot size: each of the host tensors' sizes, largest first (the output head's slots
    // would hold two layers' FFN tensors; a layer tensor's leave the head to the CPU). Each
    // scratch is placed again and modelled; the fastest wins.
    std::vector<int64_t> sizes;
    for (const std::string & n : plain.cpu) {
        const kx_place_item * it = by_name.at(n);
        if (it->read >= 1.0) {
            sizes.push_back(it->bytes);
        }
    }
    std::sort(sizes.rbegin(), sizes.rend());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    kx_stream_choice best = plain;
    for (size_t k = 0; k < sizes.size() && k < 3; ++k) {
        kx_stream_choice c;
        c.scratch = (int64_t) kx_stream_slots * sizes[k];
        try {
            c.cpu = kx_place_dense(dry, budget - c.scratch, rates, &c.placed);
        } catch (const std::exception &) {
            continue; // the scratch does not fit beside the KV cache and compute buffers
        }
        c.step_s  = model(c.cpu, c.scratch, &c);
        // the slots need only hold the largest tensor they may: the same choice, and what
        // the engine's chain finds again from the tensors it holds (kx_stream_start)
        int64_t largest = 0;
        for (const std::string & n : c.slotted) {
            largest = std::max(largest, by_name.at(n)->bytes);
        }
        c.scratch = (int64_t) kx_stream_slots * largest;
        c.plain_s = plain.plain_s;
        if (!c.streamed.empty() && c.step_s < best.step_s) {
            best = c;
        }
    }
    return best;
}

int32_t kx_stream_place(const char * const * names, const int64_t * nbytes, const double * read,
                        const char * const * types, int32_t n, int64_t fixed, int64_t budget, double cpu_gbs,
                        double gpu_gbs, double pcie_gbs, double handoff_us, const char * hw_profile, bool copies,
                        int8_t * where, int64_t * scratch) {
    if (n < 0 || (n > 0 && (!names || !nbytes || !read || !where)) || !scratch || cpu_gbs <= 0 || gpu_gbs <= 0 ||
        pcie_gbs <= 0 || handoff_us < 0) {
        return -1;
    }
    kx_dense_rates rates;
    rates.cpu_gbs    = cpu_gbs;
    rates.gpu_gbs    = gpu_gbs;
    rates.handoff_us = handoff_us;
    rates.pcie_gbs   = pcie_gbs;
    if (hw_profile) {
        try {
            rates = kx_dense_rates_read(hw_profile);
        } catch (const std::exception &) {
            return -1;
        }
    }
    std::vector<kx_place_item> items;
    for (int32_t i = 0; i < n; ++i) {
        if (!names[i] || nbytes[i] < 0 || !(read[i] > 0 && read[i] <= 1) || (types && !types[i])) {
            return -1;
        }
        items.push_back({ names[i], nbytes[i], read[i], types ? kx_type_key(types[i]) : "" });
    }
    // a dry run whose KV cache and compute buffers do not follow the choice, but for the copy
    // of the largest host tensor that an offloaded prompt batch makes (with `copies`)
    auto dry = [&](const std::vector<std::string> & cpu) {
        kx_dry_sizes d;
        d.kv = fixed;
        for (const kx_place_item & it : items) {
            if (std::find(cpu.begin(), cpu.end(), it.name) == cpu.end()) {
                d.items.push_back(it);
                d.movable += it.bytes;
            } else if (copies) {
                d.compute = std::max(d.compute, it.bytes);
            }
        }
        d.weights = d.movable;
        return d;
    };
    kx_stream_choice c;
    try {
        c = kx_stream_choose(dry, budget, rates);
    } catch (const std::exception &) {
        return -2;
    }
    for (int32_t i = 0; i < n; ++i) {
        const bool on_cpu = std::find(c.cpu.begin(), c.cpu.end(), items[i].name) != c.cpu.end();
        const bool st = std::find(c.streamed.begin(), c.streamed.end(), items[i].name) != c.streamed.end();
        const bool sl = std::find(c.slotted.begin(), c.slotted.end(), items[i].name) != c.slotted.end();
        where[i] = (int8_t) (st ? 2 : sl ? 3 : on_cpu ? 1 : 0);
    }
    *scratch = c.scratch;
    return 0;
}

// ------------------------------------------------------------------ the engine

int32_t kx_stream::of(const ggml_tensor * t) const {
    t = t && t->view_src ? t->view_src : t; // (a view of a weight reads the weight)
    if (!t || !t->buffer || (t->buffer != scratch && std::find(host_bufs.begin(), host_bufs.end(), t->buffer) == host_bufs.end())) {
        return -1;
    }
    auto it = index.find(t);
    return it == index.end() ? -1 : it->second;
}

int32_t kx_stream::n_on() const {
    return (int32_t) std::count_if(items.begin(), items.end(), [](const item & x) { return x.on; });
}

void kx_stream::graph(ggml_cgraph * g) {
    // a graph whose ops on these tensors the device offloads (a prompt batch: it copies the
    // host copies itself) streams none of them
    bool offloaded = false;
    for (int i = 0; i < ggml_graph_n_nodes(g) && !offloaded; ++i) {
        ggml_tensor * node = ggml_graph_node(g, i);
        for (int k = 0; k < GGML_MAX_SRC && node->src[k] && !offloaded; ++k) {
            offloaded = of(node->src[k]) >= 0 && ggml_backend_dev_offload_op(dev, node);
        }
    }
    decode = !offloaded;
    // the first steps of a graph split anew run slower (CUDA graphs are captured, caches cold):
    // their rates would make the migrator move again for nothing
    settle = decode ? kx_stream_settle : 0;
    // The order of use. A streamed tensor takes the next slot unless kx_stream_slots of them
    // ran in a row without an op on a host weight between (one device split would read them
    // all at once): then the CPU multiplies it in this graph, which ends the run. The choice
    // caps runs in its chain's order, which is not always the graph's (a layer's gate and up
    // are one group there, by name; the graph runs up first).
    ++scan;
    std::vector<int32_t> use;
    int32_t run = 0;
    for (int i = 0; i < ggml_graph_n_nodes(g) && decode; ++i) {
        ggml_tensor * node = ggml_graph_node(g, i);
        for (int k = 0; k < GGML_MAX_SRC && node->src[k]; ++k) {
            const ggml_tensor * s = node->src[k];
            const int32_t it = of(s);
            if (it >= 0 && seen[it] == scan) {
                continue; // read before: placed then
            }
            if (it >= 0) {
                seen[it] = scan;
            }
            if (it >= 0 && items[it].on && run < n_slots) {
                use.push_back(it);
                run += 1;
            } else if (it >= 0 || (s->buffer && ggml_backend_buffer_get_usage(s->buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS &&
                                   ggml_backend_buffer_is_host(s->buffer))) {
                run = 0; // an op the CPU computes: a split boundary
            }
        }
    }
    for (item & x : items) {
        x.pos = -1;
    }
    order = use;
    for (size_t p = 0; p < order.size(); ++p) {
        items[order[p]].pos = (int32_t) p;
    }
    char * base = (char *) ggml_backend_buffer_get_base(scratch);
    for (item & x : items) {
        if (x.pos >= 0) {
            x.t->buffer = scratch;
            x.t->data   = base + (x.pos % n_slots) * slot_bytes;
        } else {
            x.t->buffer = x.host_buf;
            x.t->data   = x.host;
        }
    }
}

void * kx_stream::timer_take() {
    // only while a sampled decode step runs: every other one, so that the events' cost
    // (~1-2 µs of host time each, 2 per copy and per device split) stays off most steps
    if (!migrate || !decode || steps.empty() || steps.back().closed || steps.back().id % 2 != 0) {
        return nullptr;
    }
    if (timers.empty()) {
        void * ev = timer->make(copier);
        if (!ev) {
            return nullptr;
        }
        all_timers.push_back(ev);
        return ev;
    }
    void * ev = timers.back();
    timers.pop_back();
    return ev;
}

void kx_stream::copy(int32_t i) {
    item & x = items[i];
    const int32_t s = x.pos % n_slots;
    ggml_backend_event_wait(copier, freed[s]);
    // timed from behind the wait: the span is the copy itself
    void * a = timer_take();
    void * b = a ? timer_take() : nullptr;
    if (b) {
        timer->record(a, copier);
    }
    ggml_backend_tensor_set_async(copier, x.t, x.host, 0, (size_t) x.nbytes);
    if (b) {
        timer->record(b, copier);
        spans.push_back({ a, b, steps.back().id, (double) x.nbytes, true });
        steps.back().open += 1;
    } else if (a) {
        timers.push_back(a);
    }
    ggml_backend_event_record(copied[s], copier);
    loaded[s] = i;
    n_copies += 1;
    copy_bytes += x.nbytes;
}

void kx_stream::before(ggml_backend_t backend, ggml_cgraph * g) {
    cur.clear();
    if (ggml_backend_get_device(backend) != dev) {
        return;
    }
    if (migrate) {
        tick();
    }
    if (!order.empty()) {
        ++scan;
        for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
            ggml_tensor * node = ggml_graph_node(g, i);
            for (int k = 0; k < GGML_MAX_SRC && node->src[k]; ++k) {
                const int32_t it = of(node->src[k]);
                if (it >= 0 && items[it].pos >= 0 && seen[it] != scan) {
                    seen[it] = scan;
                    cur.push_back(it);
                }
            }
        }
        for (int32_t it : cur) {
            const int32_t s = items[it].pos % n_slots;
            if (loaded[s] != it) {
                copy(it); // not prefetched (the first token, or another order of use)
            }
            ggml_backend_event_wait(backend, copied[s]);
        }
    }
    // the split's time on the device, from behind its waits for copies
    split_a = timer_take();
    if (split_a) {
        timer->record(split_a, backend);
    }
}

void kx_stream::after(ggml_backend_t backend, ggml_cgraph *) {
    if (split_a) {
        void * b = timer_take();
        if (b) {
            timer->record(b, backend);
            spans.push_back({ split_a, b, steps.back().id, 0.0, false });
            steps.back().open += 1;
        } else {
            timers.push_back(split_a);
        }
        split_a = nullptr;
    }
    for (int32_t it : cur) {
        const int32_t p = items[it].pos, s = p % n_slots;
        ggml_backend_event_record(freed[s], backend);
        // the next tensor of this slot: later in this graph, else the first of the next token's
        const int32_t n = (int32_t) order.size();
        const int32_t next = order[p + n_slots < n ? p + n_slots : s];
        if (loaded[s] != next) {
            copy(next);
        }
    }
    cur.clear();
}

void kx_stream::tick() {
    int64_t st[KX_SCHED_N_STATS];
    kx_sched_stats(st, false);
    if (st[KX_SCHED_GRAPHS] != graphs) {
        // a new graph computation: the step before it ends here (its CPU splits ran
        // synchronously, so their time is in the counter)
        if (!steps.empty() && !steps.back().closed) {
            step_rec & r = steps.back();
            r.closed = true;
            r.s.cpu_s = (double) (st[KX_SCHED_CPU_NS] - cpu_ns) * 1e-9;
        }
        graphs = st[KX_SCHED_GRAPHS];
        cpu_ns = st[KX_SCHED_CPU_NS];
        if (decode) {
            // the bytes each side reads in this graph (split already: pos is its order of use)
            step_rec r = { n_steps++ };
            r.skip = settle > 0;
            settle = std::max(0, settle - 1);
            double on_bytes = 0;
            for (size_t k = 0; k < chain.tensors.size(); ++k) {
                const kx_migrate_tensor & t = chain.tensors[k];
                const bool on = chain_item[k] >= 0 && items[chain_item[k]].pos >= 0;
                (on ? on_bytes : r.s.cpu_bytes) += (double) t.nbytes * t.read;
            }
            r.s.gpu_bytes = (double) chain.gpu_bytes + on_bytes;
            steps.push_back(r);
        }
    }
    // the spans that completed, in the order they were queued
    while (!spans.empty()) {
        const span & sp = spans.front();
        const double dt = timer->elapsed(sp.a, sp.b);
        if (dt < 0) {
            break;
        }
        for (step_rec & r : steps) {
            if (r.id == sp.step) {
                (sp.copy ? r.s.copy_s : r.s.gpu_s) += dt;
                r.s.copy_bytes += sp.copy ? sp.bytes : 0.0;
                r.open -= 1;
                break;
            }
        }
        timers.push_back(sp.a);
        timers.push_back(sp.b);
        spans.pop_front();
    }
    // complete steps to the migrator, in order; a step not timed has no GPU or copy sample
    while (!steps.empty() && steps.front().closed && steps.front().open == 0) {
        kx_migrate_sample s = steps.front().s;
        const bool skip = steps.front().skip;
        steps.pop_front();
        if (skip) {
            continue;
        }
        if (s.gpu_s <= 0) {
            s.gpu_bytes = 0;
        }
        if (mig.step(s)) {
            apply(mig.streamed);
        }
    }
}

void kx_stream::apply(const std::vector<bool> & chosen) {
    bool changed = false;
    for (size_t k = 0; k < chain.tensors.size(); ++k) {
        // (a chain tensor no slot holds is never chosen: it is larger than a slot)
        if (chain_item[k] >= 0 && items[chain_item[k]].on != (bool) chosen[k]) {
            items[chain_item[k]].on = chosen[k];
            changed = true;
        }
    }
    const kx_migrate_rates & r = mig.rates;
    LLAMA_LOG_INFO("kairox: rates moved (CPU %.1f, GPU %.0f, PCIe %.1f GB/s over the last %d steps): %s %d of the %zu "
                   "host tensors\n", r.cpu_gbs, r.gpu_gbs, r.pcie_gbs, mig.window,
                   changed ? "the GPU streams" : "the GPU keeps streaming", n_on(), chain.tensors.size());
    if (changed) {
        n_migrations += 1;
        ctx->kx_stream_changed(); // the next decode's graph is split anew
    }
}

void llama_context::kx_stream_changed() {
    cparams.kx_stream_gen += 1;
}

kx_stream::~kx_stream() {
    if (sched) {
        ggml_backend_sched_synchronize(sched); // its streams may still wait on the events
        kx_sched_set_stream(sched, nullptr);
    }
    if (copier) {
        ggml_backend_synchronize(copier);
    }
    std::lock_guard<std::mutex> lk(kx_stream_mu);
    for (item & x : items) { // the model outlives its contexts: its tensors point home again
        x.t->buffer = x.host_buf;
        x.t->data   = x.host;
        kx_stream_homes.erase(x.t);
    }
    for (ggml_backend_event_t e : copied) {
        ggml_backend_event_free(e);
    }
    for (ggml_backend_event_t e : freed) {
        ggml_backend_event_free(e);
    }
    for (void * ev : all_timers) {
        timer->free(ev);
    }
    if (scratch) {
        ggml_backend_buffer_free(scratch);
    }
    if (copier) {
        ggml_backend_free(copier);
    }
}

// the placement's items as the model holds them: its matrices on dev or moved to host memory
// (the blocks' and the output head; the token embeddings stay on the CPU in every placement
// and are read a row at a time)
static std::vector<kx_place_item> kx_stream_model_items(const llama_model & model, ggml_backend_dev_t dev,
                                                        std::vector<std::string> & cpu) {
    std::vector<kx_place_item> items;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (!t->buffer || t->ne[1] <= 1) {
            continue;
        }
        const bool on_dev = kx_buft_on_dev(ggml_backend_buffer_get_type(t->buffer), dev);
        if (!on_dev && kx_tensor_layer(name).first < 0 && name != "output.weight") {
            continue;
        }
        items.push_back(kx_place_item_of(model, name, t));
        if (!on_dev) {
            cpu.push_back(name);
        }
    }
    return items;
}

std::shared_ptr<kx_stream> kx_stream_start(llama_context * ctx, ggml_backend_dev_t dev,
                                           ggml_backend_buffer_type_t host_buft, const kx_stream_migrate & mc) {
    const llama_model & model = ctx->get_model();
    auto st = std::make_shared<kx_stream>();
    st->dev = dev;
    st->ctx = ctx;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (t->buffer && ggml_backend_buffer_get_type(t->buffer) == host_buft) {
            st->index[t] = (int32_t) st->items.size();
            st->items.push_back({ t, t->data, t->buffer, (int64_t) ggml_nbytes(t) });
            if (std::find(st->host_bufs.begin(), st->host_bufs.end(), t->buffer) == st->host_bufs.end()) {
                st->host_bufs.push_back(t->buffer);
            }
        }
    }
    if (st->items.empty()) {
        return nullptr;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    const int64_t align = (int64_t) ggml_backend_buft_get_alignment(buft);
    int64_t largest = 0;
    for (const kx_stream::item & x : st->items) {
        largest = std::max(largest, x.nbytes);
        st->slot_bytes = std::max(st->slot_bytes, (x.nbytes + align - 1) / align * align);
    }
    st->copier = ggml_backend_dev_init(dev, nullptr);
    for (int32_t s = 0; st->copier && s < st->n_slots; ++s) {
        st->copied.push_back(ggml_backend_event_new(dev));
        st->freed.push_back(ggml_backend_event_new(dev));
        if (!st->copied.back() || !st->freed.back()) {
            throw std::runtime_error(kx_fmt("streaming tensors to %s needs its events, which it has none of",
                                            ggml_backend_dev_name(dev)));
        }
    }
    if (!st->copier) {
        throw std::runtime_error(kx_fmt("cannot start a second %s backend for the streamed tensors' copies",
                                        ggml_backend_dev_name(dev)));
    }
    st->scratch = ggml_backend_buft_alloc_buffer(buft, (size_t) (st->slot_bytes * st->n_slots));
    if (!st->scratch) {
        throw std::runtime_error(kx_fmt("cannot allocate the streamed tensors' scratch (%s) on %s",
                                        kx_mib(st->slot_bytes * st->n_slots).c_str(), ggml_backend_dev_name(dev)));
    }
    ggml_backend_buffer_set_usage(st->scratch, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    if (!mc.on) {
        // without migration the load put only the streamed ones here
        for (kx_stream::item & x : st->items) {
            x.on = true;
        }
    } else {
        // the load's choice again from the same chain and rates (kx_stream_choose made it so),
        // and the migrator that may change it; the chain's scratch is the load's (two of the
        // largest)
        std::vector<std::string> cpu;
        const std::vector<kx_place_item> all = kx_stream_model_items(model, dev, cpu);
        st->chain = kx_stream_chain_of(all, cpu, (int64_t) kx_stream_slots * largest);
        for (const std::string & n : st->chain.names) {
            const ggml_tensor * t = model.get_tensor(n.c_str());
            auto it = t ? st->index.find(t) : st->index.end();
            st->chain_item.push_back(it == st->index.end() ? -1 : it->second);
        }
        st->mig.tensors       = st->chain.tensors;
        st->mig.gpu_bytes     = st->chain.gpu_bytes;
        st->mig.scratch_bytes = (int64_t) kx_stream_slots * largest;
        st->mig.init(kx_stream_rates(mc.rates, all, cpu));
        const std::vector<bool> & first = st->mig.streamed;
        for (size_t k = 0; k < st->chain.tensors.size(); ++k) {
            if (st->chain_item[k] >= 0) {
                st->items[st->chain_item[k]].on = first[k];
            }
        }
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        auto get = (const kx_timer_iface * (*)(void)) ggml_backend_reg_get_proc_address(reg, "kx_timer_iface");
        st->timer   = get ? get() : nullptr;
        st->migrate = st->timer != nullptr; // (a device without timers keeps the load's choice)
    }
    {
        std::lock_guard<std::mutex> lk(kx_stream_mu);
        for (const kx_stream::item & x : st->items) {
            kx_stream_homes[x.t] = x.host_buf;
        }
    }
    st->loaded.assign((size_t) st->n_slots, -1);
    st->seen.assign(st->items.size(), -1);
    st->sched = ctx->get_sched();
    st->hook.user   = st.get();
    st->hook.graph  = [](void * u, ggml_cgraph * g) { ((kx_stream *) u)->graph(g); };
    st->hook.before = [](void * u, ggml_backend_t b, ggml_cgraph * g) { ((kx_stream *) u)->before(b, g); };
    st->hook.after  = [](void * u, ggml_backend_t b, ggml_cgraph * g) { ((kx_stream *) u)->after(b, g); };
    kx_sched_set_stream(st->sched, &st->hook);
    return st;
}
