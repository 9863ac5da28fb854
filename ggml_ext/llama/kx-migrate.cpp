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

// the step as a chain (kairox.migrate.step_time), a dynamic program over the Pareto front of
// (time so far, copy engine's time so far), one front per length of the streamed run the chain
// ends in: a pair no earlier on both counts than another of its front can never end first.
// Ties keep the order the candidates were made in (on the CPU first), as the reference's stable
// sort does; the end picked is the earliest, then the idler copy engine, then the shorter run.
double kx_migrate_choose(const std::vector<kx_migrate_tensor> & t, const kx_migrate_rates & r, int64_t gpu_bytes,
                         int64_t scratch_bytes, std::vector<bool> & streamed) {
    struct node { int32_t tensor; int32_t parent; };
    struct state { double e, c; int32_t node; };
    constexpr int32_t n_run = kx_stream_slots + 1;
    std::vector<node> nodes;                 // the streamed tensors of each path, linked back
    std::vector<state> front[n_run], next[n_run];
    front[0] = { { 0.0, 0.0, -1 } };
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
                next[0].push_back({ e + rb / (r.cpu_gbs * kx_gb), s.c, s.node });
                if (t[i].nbytes <= slot && k < kx_stream_slots) {
                    const double c2 = s.c + (double) t[i].nbytes / (r.pcie_gbs * kx_gb);
                    nodes.push_back({ (int32_t) i, s.node });
                    next[k + 1].push_back({ std::max(e, c2) + rb / (r.gpu_gbs * kx_gb), c2, (int32_t) nodes.size() - 1 });
                }
            }
        }
        for (int32_t k = 0; k < n_run; ++k) {
            std::stable_sort(next[k].begin(), next[k].end(), [](const state & a, const state & b) {
                return a.e != b.e ? a.e < b.e : a.c < b.c;
            });
            front[k].clear();
            for (const state & s : next[k]) {
                if (front[k].empty() || s.c < front[k].back().c) {
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
    int64_t done = 0;
    for (size_t i = 0; i < t.size(); ++i) {
        elapsed += (double) (t[i].gpu_bytes_before - done) / (r.gpu_gbs * kx_gb);
        done = t[i].gpu_bytes_before;
        const double rb = (double) t[i].nbytes * t[i].read;
        if (streamed[i]) {
            copy_end += (double) t[i].nbytes / (r.pcie_gbs * kx_gb);
            elapsed = std::max(elapsed, copy_end) + rb / (r.gpu_gbs * kx_gb);
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
