// Load-aware thresholds: the runtime's controller (kx-thresholds.h; the reference and the
// model are python/kairox/thresholds.py).
#include "kx-thresholds.h"
#include "kairox.h"
#include "kx-slots.h"

#include "kx-ops.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <stdexcept>

void kx_thr_layer_sums(const float * sel, const float * err, int64_t n_ff, const uint8_t * resident, kx_thr_sums & out) {
    out = kx_thr_sums();
    // neuron after neuron, in double: the reference adds the same terms in the same order
    for (int64_t i = 0; i < n_ff; ++i) {
        const float * s = sel + i * KX_THR_K;
        const float * e = err + i * KX_THR_K;
        auto & n = resident[i] ? out.n_gpu : out.n_cpu;
        auto & r = resident[i] ? out.e_gpu : out.e_cpu;
        for (int k = 0; k < KX_THR_K; ++k) {
            n[k] += (double) s[k];
            r[k] += (double) e[k];
        }
    }
}

// relative slack of the bound and of a time tie (as thresholds.py: BOUND_TOL, TIE_TOL)
static constexpr double kx_thr_bound_tol = 1e-6;
static constexpr double kx_thr_tie_tol   = 1e-9;

void kx_thr_solve(const kx_thr_sums & s, double budget, double norm, double t_gpu, double t_cpu, double o_gpu,
                  double o_cpu, int32_t * kg_out, int32_t * kc_out) {
    const int32_t K0 = KX_THR_K0;
    const double bound = (s.e_gpu[K0] + s.e_cpu[K0]) * (1.0 + kx_thr_bound_tol) + budget * norm;
    auto time_of = [&](int kg, int kc) {
        return std::max(o_gpu + t_gpu * s.n_gpu[kg], o_cpu + t_cpu * s.n_cpu[kc]);
    };
    int32_t bg = K0, bc = K0;
    double best_t = time_of(K0, K0);
    double best_e = s.e_gpu[K0] + s.e_cpu[K0];
    for (int kg = 0; kg < KX_THR_K; ++kg) {
        for (int kc = 0; kc < KX_THR_K; ++kc) {
            const double e = s.e_gpu[kg] + s.e_cpu[kc];
            if (e > bound) {
                continue;
            }
            const double t = time_of(kg, kc);
            const int d = std::abs(kg - K0) + std::abs(kc - K0), best_d = std::abs(bg - K0) + std::abs(bc - K0);
            if (t < best_t * (1.0 - kx_thr_tie_tol) ||
                (t <= best_t * (1.0 + kx_thr_tie_tol) && (e < best_e || (e == best_e && d < best_d)))) {
                bg = kg; bc = kc; best_t = t; best_e = e;
            }
        }
    }
    *kg_out = bg;
    *kc_out = bc;
}

static void kx_thr_store(const kx_slot_layer & S, const kx_pack_layer & pl, int32_t kg, int32_t kc) {
    const float off[2] = { pl.thr_grid[kg], pl.thr_grid[kc] };
    ggml_backend_tensor_set(S.thr_off, off, 0, sizeof(off));
}

std::unique_ptr<kx_thresholds> kx_thresholds_new(kx_slots & slots, const kx_pack & pack, double budget,
                                                 double gpu_gbs) {
    const bool on = budget >= 0;
    if (on && !pack.has_thresholds) {
        throw std::runtime_error("the sparse pack has no threshold calibration (kx_thr_*): write it again with "
                                 "this kairox (`kairox prepare`, or `kairox synth --pack`)");
    }
    if (on && !pack.has_predictor) {
        throw std::runtime_error("load-aware thresholds move the predictor's thresholds: the pack has no predictor");
    }
    for (int64_t il = 0; il < pack.n_layer; ++il) {
        kx_slot_layer & S = slots.layers[il];
        if (S.n_slots > 0 && S.thr_off) {
            kx_thr_store(S, pack.layers[il], KX_THR_K0, KX_THR_K0);
        }
    }
    if (!on) {
        return nullptr;
    }
    auto t = std::make_unique<kx_thresholds>();
    t->budget  = (float) budget;
    t->gpu_gbs = gpu_gbs > 0 ? gpu_gbs : 2000.0;
    t->layers.resize(pack.n_layer);
    for (int64_t il = 0; il < pack.n_layer; ++il) {
        const kx_slot_layer & S = slots.layers[il];
        if (S.n_slots > 0) {
            t->layers[il].row_bytes = (double) (S.gate->nb[1] + S.up->nb[1] + S.down->nb[1]);
        }
    }
    return t;
}

// the CPU part's costs since the last reading (the host op's counters are process-wide and
// other code may reset them: a window that went backwards is skipped); baseline: only the
// reading, no costs (what came before belongs to other runs)
static void kx_thr_measure(kx_thresholds & t, bool baseline = false) {
    int64_t calls = 0, op = 0, work = 0, rows = 0;
    kx_cpu_ffn_stats(nullptr, &calls, &op, &work, nullptr, nullptr, nullptr, nullptr, false);
    kx_cpu_axpy_stats(nullptr, &rows, nullptr, false);
    const int64_t dc = calls - t.last_calls, dop = op - t.last_op, dw = work - t.last_work, dr = rows - t.last_rows;
    t.last_calls = calls; t.last_op = op; t.last_work = work; t.last_rows = rows;
    if (baseline || dc <= 0 || dr <= 0 || dop < dw || dw <= 0) {
        return;
    }
    const double per_row  = (double) dw / (double) dr;
    const double per_call = (double) (dop - dw) / (double) dc;
    // a running mean over windows: one window's noise (a preempted thread) moves it a quarter
    const bool first = t.t_cpu_ns == 0;
    t.t_cpu_ns = first ? per_row  : 0.75 * t.t_cpu_ns + 0.25 * per_row;
    t.o_cpu_ns = first ? per_call : 0.75 * t.o_cpu_ns + 0.25 * per_call;
}

bool kx_thresholds_tick(kx_thresholds & t) {
    ++t.decodes;
    if (t.decodes == 1) {
        kx_thr_measure(t, true); // the zero of the first window (the decode before held a prefill)
        return false;
    }
    if (t.t_cpu_ns == 0) {
        return true; // every decode until the first window measures (a client may reset the counters)
    }
    return (t.decodes - t.first) % kx_thr_period == 0;
}

void kx_thresholds_solve_all(kx_thresholds & t, const kx_slots & slots, const kx_pack & pack, bool moving) {
    kx_thr_measure(t);
    if (t.t_cpu_ns <= 0) {
        return;
    }
    if (t.solves == 0) {
        t.first = t.decodes; // later solves every kx_thr_period decodes from this one
    }
    std::vector<uint8_t> res;
    for (int64_t il = 0; il < pack.n_layer; ++il) {
        const kx_slot_layer & S = slots.layers[il];
        if (S.n_slots <= 0 || !S.thr_off) {
            continue;
        }
        const kx_pack_layer & pl = pack.layers[il];
        kx_thr_layer & T = t.layers[il];
        if (!T.have_sums || moving) {
            // the residents move with the balancer: the sums are taken again at every solve
            res.assign(pack.n_ff, 0);
            for (int32_t i : S.resident) {
                if (i >= 0) {
                    res[i] = 1;
                }
            }
            kx_thr_layer_sums(pl.thr_sel.data(), pl.thr_err.data(), pack.n_ff, res.data(), T.sums);
            T.have_sums = true;
        }
        const double t_gpu_ns = T.row_bytes / t.gpu_gbs; // bytes / (GB/s) = ns
        int32_t kg = KX_THR_K0, kc = KX_THR_K0;
        kx_thr_solve(T.sums, t.budget, pl.thr_norm, t_gpu_ns, t.t_cpu_ns, 0.0, t.o_cpu_ns, &kg, &kc);
        if (kg != T.kg || kc != T.kc) {
            kx_thr_store(S, pl, kg, kc);
            T.kg = kg;
            T.kc = kc;
        }
    }
    ++t.solves;
}

void kx_thresholds_solve(const float * sel, const float * err, int64_t n_ff, const uint8_t * resident, float budget,
                         float norm, double t_gpu, double t_cpu, double o_gpu, double o_cpu, int32_t * kg, int32_t * kc) {
    kx_thr_sums s;
    kx_thr_layer_sums(sel, err, n_ff, resident, s);
    kx_thr_solve(s, budget, norm, t_gpu, t_cpu, o_gpu, o_cpu, kg, kc);
}
