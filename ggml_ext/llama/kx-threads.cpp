// Load-aware decode threads (kx-threads.h). Why: a decode step's host threads meet at a
// barrier after every op, so when other processes take cores, one descheduled thread holds
// up the rest and a step with as many threads as cores slows far more than the CPU share
// taken (docs/ARCHITECTURE.md, "Decode threads under load").
#include "kx-threads.h"

#include <algorithm>
#include <cmath>

// a count within this factor of the fastest mean is as fast: an idle machine keeps its threads
static constexpr double kx_threads_tie = 1.03;
// a lost peek doubles the wait before the next, up to this many times recheck
static constexpr int64_t kx_threads_max_wait = 8;
enum { KX_THREADS_HOLD = 0, KX_THREADS_PROBE = 1, KX_THREADS_PEEK = 2 };

bool kx_threads_init(kx_threads & t, int32_t n_max, const kx_threads_config & cfg) {
    if (n_max < 1 || cfg.window < 1 || cfg.recheck < cfg.window || !(cfg.drift > 0.0 && cfg.drift < 1.0)) {
        return false;
    }
    t = kx_threads();
    t.cfg   = cfg;
    t.n_max = t.n = n_max;
    t.wait  = cfg.recheck;
    for (int32_t c : { n_max, std::max(1, n_max * 3 / 4), std::max(1, n_max / 2), std::max(1, n_max / 4) }) {
        if (std::find(t.cands.begin(), t.cands.end(), c) == t.cands.end()) {
            t.cands.push_back(c);
        }
    }
    std::sort(t.cands.rbegin(), t.cands.rend());
    return true;
}

static void kx_threads_set(kx_threads & t, int32_t n) {
    if (n != t.n) {
        t.skip = 1;
    }
    t.n = n;
}

int32_t kx_threads_step(kx_threads & t, double seconds) {
    if (t.skip > 0) {
        t.skip -= 1;
        return t.n;
    }
    t.samples.push_back(seconds);
    if ((int32_t) t.samples.size() < t.cfg.window) {
        return t.n;
    }
    double mean = 0.0;
    for (double x : t.samples) { // summed in order, as the reference does
        mean += x;
    }
    mean /= (double) t.samples.size();
    t.samples.clear();
    if (t.state == KX_THREADS_HOLD) {
        t.held += t.cfg.window;
        if (t.base < 0.0) {
            t.base = mean;
        } else if (std::abs(mean - t.base) > t.cfg.drift * t.base) {
            // two windows in a row: one noisy window is not a load
            if (++t.moved >= 2 && t.held >= t.quiet) {
                t.state = KX_THREADS_PROBE;
                t.moved = 0;
                t.kept  = t.n;
                t.tried.clear();
                t.probes += 1;
                kx_threads_set(t, t.cands[0]);
            }
        } else {
            t.moved = 0;
            if (t.n < t.n_max && t.held >= t.wait) {
                t.state = KX_THREADS_PEEK;
                t.kept  = t.n;
                kx_threads_set(t, t.n_max);
            }
        }
        return t.n;
    }
    if (t.state == KX_THREADS_PEEK) {
        if (mean <= t.base * kx_threads_tie) { // all the threads are as fast again: which count is fastest now
            t.state = KX_THREADS_PROBE;
            t.tried.clear();
            t.tried[t.n] = mean;
            t.probes += 1;
            kx_threads_set(t, t.cands[1]);
        } else {
            t.state = KX_THREADS_HOLD;
            t.held  = 0;
            t.wait  = std::min(2 * t.wait, kx_threads_max_wait * t.cfg.recheck);
            kx_threads_set(t, t.kept);
        }
        return t.n;
    }
    t.tried[t.n] = mean;
    for (int32_t c : t.cands) {
        if (!t.tried.count(c)) {
            kx_threads_set(t, c);
            return t.n;
        }
    }
    double fastest = mean;
    for (const auto & [c, s] : t.tried) {
        fastest = std::min(fastest, s);
    }
    int32_t best = 0;
    for (const auto & [c, s] : t.tried) {
        if (s <= fastest * kx_threads_tie) {
            best = std::max(best, c);
        }
    }
    t.state = KX_THREADS_HOLD;
    t.base  = t.tried[best];
    t.held  = 0;
    t.wait  = t.cfg.recheck;
    // a probe that kept its count (a machine whose speed wanders by itself) makes the next wait
    t.quiet = best == t.kept ? std::min(std::max(2 * t.quiet, (int64_t) 4 * t.cfg.window),
                                        kx_threads_max_wait * t.cfg.recheck) : 0;
    kx_threads_set(t, best);
    return t.n;
}

int32_t kx_threads_run(const kx_threads_config * cfg, int32_t n_max, const double * seconds, int64_t n,
                       int32_t * counts) {
    kx_threads t;
    if (!cfg || (n > 0 && (!seconds || !counts)) || !kx_threads_init(t, n_max, *cfg)) {
        return 1;
    }
    for (int64_t i = 0; i < n; ++i) {
        counts[i] = kx_threads_step(t, seconds[i]);
    }
    return 0;
}
