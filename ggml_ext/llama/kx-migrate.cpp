// Runtime migration's policy (ATSInfer), the C++ port of python/kairox/migrate.py: the same
// rate window, threshold, cooldown and exact streaming choice, compared step for step on
// modelled decodes (tests/test_migrate.py). The load's streaming choice (kx-stream.cpp) is
// kx_migrate_choose; the streaming engine there feeds kx_migrator each decode step.
#include "kairox.h"
#include "kx-migrate.h"

#include <algorithm>
#include <cmath>
#include <memory>

static constexpr double kx_gb = 1e9;

// The step as a chain (kairox.migrate.step_time), a dynamic program over the Pareto front of
// (time so far, the next copy's earliest start, the readers' ends of the last
// kx_stream_slots - 1 streamed tensors), one front per length of the streamed run the chain
// ends in: what follows grows with each of them, so a state no earlier on every count than
// another of its front can never end first. The j-th streamed tensor takes slot
// j % kx_stream_slots, and its copy starts once the one before it is done and the reader of
// the tensor that slot held last has finished (the engine's event). Ties keep the order the
// candidates were made in (on the CPU first), as the reference's stable sort does; the end
// picked is the earliest, then the idler copy engine, then the shorter run.
double kx_migrate_choose(const std::vector<kx_migrate_tensor> & t, const kx_migrate_rates & r, int64_t gpu_bytes,
                         int64_t scratch_bytes, std::vector<bool> & streamed) {
    static_assert(kx_stream_slots >= 2, "one tensor in use, the next arriving");
    constexpr int32_t n_end = kx_stream_slots - 1;
    struct node { int32_t tensor; int32_t parent; };
    struct state {
        double e, c;         // time so far; the next copy's earliest start
        double ends[n_end];  // readers' ends of the last streamed tensors, oldest first
        int32_t node;
    };
    constexpr int32_t n_run = kx_stream_slots + 1;
    std::vector<node> nodes;                 // the streamed tensors of each path, linked back
    std::vector<state> front[n_run], next[n_run];
    front[0] = { state{ 0.0, 0.0, {}, -1 } };
    const int64_t slot = scratch_bytes / kx_stream_slots;
    int64_t done = 0;
    for (size_t i = 0; i < t.size(); ++i) {
        const double run  = (double) (t[i].gpu_bytes_before - done) / (r.gpu_gbs * kx_gb);
        const double rb   = (double) t[i].nbytes * t[i].read;
        done = t[i].gpu_bytes_before;
        for (auto & n : next) {
            n.clear();
        }
        for (int32_t k = 0; k < n_run; ++k) {
            for (const state & s : front[k]) {
                const double e = s.e + run;
                state cpu = s;
                cpu.e = e + rb / (r.cpu_gbs * kx_gb);
                next[0].push_back(cpu);
                if (t[i].nbytes <= slot && k < kx_stream_slots) {
                    const double arrived = s.c + (double) t[i].nbytes / (r.pcie_gbs * kx_gb);
                    nodes.push_back({ (int32_t) i, s.node });
                    state g;
                    g.e = std::max(e, arrived) + rb / (r.gpu_gbs * kx_gb);
                    // the next copy's slot was last read by the oldest end kept
                    g.c = std::max(arrived, s.ends[0]);
                    std::copy(s.ends + 1, s.ends + n_end, g.ends);
                    g.ends[n_end - 1] = g.e;
                    g.node = (int32_t) nodes.size() - 1;
                    next[k + 1].push_back(g);
                }
            }
        }
        for (int32_t k = 0; k < n_run; ++k) {
            std::stable_sort(next[k].begin(), next[k].end(), [](const state & a, const state & b) {
                if (a.e != b.e) {
                    return a.e < b.e;
                }
                if (a.c != b.c) {
                    return a.c < b.c;
                }
                return std::lexicographical_compare(a.ends, a.ends + n_end, b.ends, b.ends + n_end);
            });
            front[k].clear();
            for (const state & s : next[k]) {
                const bool dominated = std::any_of(front[k].begin(), front[k].end(), [&](const state & f) {
                    return f.c <= s.c && std::equal(f.ends, f.ends + n_end, s.ends, [](double a, double b) { return a <= b; });
                });
                if (!dominated) {
                    front[k].push_back(s);
                }
            }
        }
    }
    const state * best = nullptr;
    for (int32_t k = 0; k < n_run; ++k) {
        if (!front[k].empty() && (!best || front[k][0].e < best->e || (front[k][0].e == best->e && front[k][0].c < best->c))) {
            best = &front[k][0];
        }
    }
    streamed.assign(t.size(), false);
    for (int32_t k = best->node; k >= 0; k = nodes[k].parent) {
        streamed[nodes[k].tensor] = true;
    }
    return best->e + (double) (gpu_bytes - done) / (r.gpu_gbs * kx_gb);
}

double kx_migrate_step_time(const std::vector<kx_migrate_tensor> & t, const kx_migrate_rates & r, int64_t gpu_bytes,
                            const std::vector<bool> & streamed) {
    double elapsed = 0.0, copy_end = 0.0;
    double freed[kx_stream_slots] = {}; // when each slot's last reader finished
    int64_t done = 0;
    int32_t j = 0;
    for (size_t i = 0; i < t.size(); ++i) {
        elapsed += (double) (t[i].gpu_bytes_before - done) / (r.gpu_gbs * kx_gb);
        done = t[i].gpu_bytes_before;
        const double rb = (double) t[i].nbytes * t[i].read;
        if (streamed[i]) {
            copy_end = std::max(copy_end, freed[j % kx_stream_slots]) + (double) t[i].nbytes / (r.pcie_gbs * kx_gb);
            elapsed = std::max(elapsed, copy_end) + rb / (r.gpu_gbs * kx_gb);
            freed[j++ % kx_stream_slots] = elapsed;
        } else {
            elapsed += rb / (r.cpu_gbs * kx_gb);
        }
    }
    return elapsed + (double) (gpu_bytes - done) / (r.gpu_gbs * kx_gb);
}

void kx_migrator::init(const kx_migrate_rates & r) {
    rates = seen = r;
    samples.clear();
    steps = last = n_moved = 0;
    kx_migrate_choose(tensors, rates, gpu_bytes, scratch_bytes, streamed);
}

bool kx_migrator::step(const kx_migrate_sample & s) {
    ++steps;
    samples.push_back(s);
    if ((int32_t) samples.size() > window) {
        samples.pop_front();
    }
    if ((int32_t) samples.size() < window || steps - last < cooldown) {
        return false;
    }
    double cb = 0, cs = 0, gb = 0, gs = 0, pb = 0, ps = 0;
    for (const kx_migrate_sample & x : samples) {
        cb += x.cpu_bytes; cs += x.cpu_s; gb += x.gpu_bytes; gs += x.gpu_s; pb += x.copy_bytes; ps += x.copy_s;
    }
    auto rate = [](double b, double t, double last) { return b > 0 && t > 0 ? b / t / kx_gb : last; };
    seen = { rate(cb, cs, seen.cpu_gbs), rate(gb, gs, seen.gpu_gbs), rate(pb, ps, seen.pcie_gbs) };
    const double moved = std::max({ std::fabs(seen.cpu_gbs / rates.cpu_gbs - 1), std::fabs(seen.gpu_gbs / rates.gpu_gbs - 1),
                                    std::fabs(seen.pcie_gbs / rates.pcie_gbs - 1) });
    if (moved <= threshold) {
        return false;
    }
    rates = seen;
    last  = steps;
    n_moved += 1;
    std::vector<bool> st;
    const double t = kx_migrate_choose(tensors, rates, gpu_bytes, scratch_bytes, st);
    if (t > (1.0 - min_gain) * kx_migrate_step_time(tensors, rates, gpu_bytes, streamed)) {
        return false; // hardly faster at these rates: not worth a new split
    }
    streamed = st;
    return true;
}

struct kx_migrate_state {
    kx_migrator m;
};

kx_migrate_state * kx_migrate_new(const int64_t * nbytes, const int64_t * gpu_bytes_before, const double * read,
                                  int32_t n, int64_t gpu_bytes, int64_t scratch_bytes, double cpu_gbs, double gpu_gbs,
                                  double pcie_gbs, double threshold, int32_t cooldown, int32_t window,
                                  double min_gain) {
    if (n < 0 || (n > 0 && (!nbytes || !gpu_bytes_before || !read)) || cpu_gbs <= 0 || gpu_gbs <= 0 ||
        pcie_gbs <= 0 || threshold < 0 || cooldown < 0 || window < 1 || !(min_gain >= 0 && min_gain < 1)) {
        return nullptr;
    }
    auto st = std::make_unique<kx_migrate_state>();
    for (int32_t i = 0; i < n; ++i) {
        st->m.tensors.push_back({ nbytes[i], gpu_bytes_before[i], read[i] });
    }
    st->m.gpu_bytes     = gpu_bytes;
    st->m.scratch_bytes = scratch_bytes;
    st->m.threshold     = threshold;
    st->m.cooldown      = cooldown;
    st->m.window        = window;
    st->m.min_gain      = min_gain;
    st->m.init({ cpu_gbs, gpu_gbs, pcie_gbs });
    return st.release();
}

int32_t kx_migrate_step(kx_migrate_state * st, double cpu_bytes, double cpu_s, double gpu_bytes, double gpu_s,
                        double copy_bytes, double copy_s) {
    if (!st) {
        return -1;
    }
    return st->m.step({ cpu_bytes, cpu_s, gpu_bytes, gpu_s, copy_bytes, copy_s }) ? 1 : 0;
}

int32_t kx_migrate_streamed(const kx_migrate_state * st, bool * streamed, int32_t n) {
    if (!st || n != (int32_t) st->m.tensors.size() || (n > 0 && !streamed)) {
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        streamed[i] = st->m.streamed[i];
    }
    return (int32_t) std::count(st->m.streamed.begin(), st->m.streamed.end(), true);
}

void kx_migrate_free(kx_migrate_state * st) {
    delete st;
}
