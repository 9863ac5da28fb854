// The planner's solvers in C++ for the load path (include/kairox.h: kx_plan_dense,
// kx_plan_slots). python/kairox/plan.py (solve_dense, solve_slots) is the readable reference;
// tests compare them on random cases, choice for choice.
#include "kairox.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

double kx_plan_dense(const int64_t * nbytes, const double * cpu_s, const double * gpu_s, int32_t n, int64_t budget,
                     int64_t unit, double handoff_s, bool * on_gpu) {
    if (n < 0 || unit <= 0 || (n > 0 && (!nbytes || !cpu_s || !gpu_s || !on_gpu))) {
        return -1.0;
    }
    const int64_t cap = std::max<int64_t>(0, budget / unit);
    const double  inf = std::numeric_limits<double>::infinity();
    std::vector<int64_t> w((size_t) n);
    for (int32_t i = 0; i < n; ++i) {
        w[i] = (nbytes[i] + unit - 1) / unit;
    }
    // cost[c*2 + d]: the best time using c units with the last tensor on device d (0 CPU, 1 GPU);
    // choice keeps each step's previous device to walk the best path back
    std::vector<double> cost((size_t) (cap + 1) * 2, inf), next(cost.size());
    std::vector<int8_t> choice((size_t) n * (cap + 1) * 2, 0);
    cost[0] = 0.0; // execution starts on the CPU (the token embedding)
    for (int32_t i = 0; i < n; ++i) {
        std::fill(next.begin(), next.end(), inf);
        int8_t * ch = choice.data() + (size_t) i * (cap + 1) * 2;
        for (int d = 0; d < 2; ++d) {
            const double  t     = d == 0 ? cpu_s[i] : gpu_s[i];
            const int64_t shift = d == 0 ? 0 : w[i];
            if (shift > cap) {
                continue; // does not fit even alone
            }
            for (int prev = 0; prev < 2; ++prev) {
                const double hop = prev != d ? handoff_s : 0.0;
                for (int64_t c = 0; c + shift <= cap; ++c) {
                    const double v = cost[c * 2 + prev] + t + hop;
                    double & dst = next[(c + shift) * 2 + d];
                    if (v < dst) {
                        dst = v;
                        ch[(c + shift) * 2 + d] = (int8_t) prev;
                    }
                }
            }
        }
        cost.swap(next);
    }
    // end on the CPU: sampling reads the logits on the host
    int64_t bc = 0;
    int     bd = 0;
    double  best = inf;
    for (int64_t c = 0; c <= cap; ++c) {
        for (int d = 0; d < 2; ++d) {
            const double v = cost[c * 2 + d] + (d == 1 ? handoff_s : 0.0);
            if (v < best) {
                best = v;
                bc = c;
                bd = d;
            }
        }
    }
    for (int32_t i = n - 1; i >= 0; --i) {
        on_gpu[i] = bd == 1;
        const int prev = choice[((size_t) i * (cap + 1) + bc) * 2 + bd];
        if (bd == 1) {
            bc -= w[i];
        }
        bd = prev;
    }
    return best;
}

double kx_plan_slots(const double * freq, const int64_t * n_group, const int64_t * group_bytes,
                     const int64_t * rows_per_group, const double * cpu_bps, const double * gpu_bps, int32_t n_layer,
                     int64_t budget, int64_t * taken) {
    if (n_layer < 0 || (n_layer > 0 && (!freq || !n_group || !group_bytes || !rows_per_group || !cpu_bps || !gpu_bps
                                        || !taken))) {
        return -1.0;
    }
    const int32_t L = n_layer;
    std::vector<int64_t> off((size_t) L + 1, 0);
    for (int32_t l = 0; l < L; ++l) {
        if (n_group[l] < 0 || group_bytes[l] <= 0 || rows_per_group[l] <= 0 || cpu_bps[l] <= 0 || gpu_bps[l] <= 0) {
            return -1.0;
        }
        off[l + 1] = off[l] + n_group[l];
    }
    // each layer's groups hottest first (a stable order: equal frequencies keep their ids' order)
    std::vector<std::vector<int64_t>> order((size_t) L);
    std::vector<double> per_row(L), cpu_mass(L), gpu_mass(L, 0.0);
    for (int32_t l = 0; l < L; ++l) {
        const double * f = freq + off[l];
        order[l].resize((size_t) n_group[l]);
        std::iota(order[l].begin(), order[l].end(), 0);
        std::stable_sort(order[l].begin(), order[l].end(), [f](int64_t a, int64_t b) { return -f[a] < -f[b]; });
        per_row[l]  = (double) group_bytes[l] / (double) rows_per_group[l];
        cpu_mass[l] = std::accumulate(f, f + n_group[l], 0.0); // in id order, as the reference sums
        taken[l]    = 0;
    }
    // a layer's FFN time: both sides run at once (bytes read per token over each side's rate)
    auto t = [&](int32_t l, double cm, double gm) {
        return std::max(cm * per_row[l] / cpu_bps[l], gm * per_row[l] / gpu_bps[l]);
    };
    auto next_freq = [&](int32_t l) { return freq[off[l] + order[l][(size_t) taken[l]]]; };
    auto gain = [&](int32_t l) {
        if (taken[l] >= n_group[l]) {
            return -1.0;
        }
        const double f = next_freq(l);
        return t(l, cpu_mass[l], gpu_mass[l]) - t(l, cpu_mass[l] - f, gpu_mass[l] + f);
    };
    // the best seconds saved per byte first; one entry per layer, (key, layer) ascending
    using entry = std::pair<double, int32_t>;
    std::priority_queue<entry, std::vector<entry>, std::greater<entry>> heap;
    for (int32_t l = 0; l < L; ++l) {
        heap.push({ -gain(l) / (double) group_bytes[l], l });
    }
    int64_t left = budget;
    while (!heap.empty()) {
        const auto [g, l] = heap.top();
        heap.pop();
        if (-g <= 0) {
            break; // no layer gains from another group
        }
        if (group_bytes[l] > left) {
            continue; // this layer is done; others may have smaller groups
        }
        const double f = next_freq(l);
        cpu_mass[l] -= f;
        gpu_mass[l] += f;
        taken[l] += 1;
        left -= group_bytes[l];
        heap.push({ -gain(l) / (double) group_bytes[l], l });
    }
    // the ratio order loses only at the budget's edge: trade a layer's last group for the next
    // groups of another while that lowers the total
    std::vector<std::vector<double>> cum((size_t) L);
    for (int32_t l = 0; l < L; ++l) {
        cum[l].resize((size_t) n_group[l] + 1);
        cum[l][0] = 0.0;
        for (int64_t k = 0; k < n_group[l]; ++k) {
            cum[l][k + 1] = cum[l][k] + freq[off[l] + order[l][k]];
        }
    }
    auto cost = [&](int32_t l, int64_t k) {
        const double m = cum[l][k];
        return t(l, cpu_mass[l] + gpu_mass[l] - m, m);
    };
    for (int32_t it = 0; it < 4 * L; ++it) {
        double  best = 0.0;
        int32_t bi = -1, bj = -1;
        int64_t badd = 0;
        for (int32_t i = 0; i < L; ++i) {
            if (taken[i] == 0) {
                continue;
            }
            const int64_t free = left + group_bytes[i];
            const double  d_i  = cost(i, taken[i] - 1) - cost(i, taken[i]);
            for (int32_t j = 0; j < L; ++j) {
                if (j == i) {
                    continue;
                }
                const int64_t k    = std::min(n_group[j] - taken[j], free / group_bytes[j]);
                const double  base = cost(j, taken[j]);
                double  gain_j = 0.0;
                int64_t add    = 0;
                for (int64_t a = 1; a <= k; ++a) {
                    const double v = base - cost(j, taken[j] + a);
                    if (a == 1 || v >= gain_j) { // the largest count among equal gains
                        gain_j = v;
                        add    = a;
                    }
                }
                if (gain_j - d_i > best + 1e-15) {
                    best = gain_j - d_i;
                    bi = i;
                    bj = j;
                    badd = add;
                }
            }
        }
        if (bi < 0) {
            break;
        }
        for (const auto & [l, dk] : { std::pair<int32_t, int64_t>{ bi, -1 }, std::pair<int32_t, int64_t>{ bj, badd } }) {
            const double m0 = cum[l][taken[l]];
            taken[l] += dk;
            const double m1 = cum[l][taken[l]];
            cpu_mass[l] -= m1 - m0;
            gpu_mass[l] += m1 - m0;
            left -= dk * group_bytes[l];
        }
    }
    double total = 0.0;
    for (int32_t l = 0; l < L; ++l) {
        total += t(l, cpu_mass[l], gpu_mass[l]);
    }
    return total;
}
