// The back-off's state machine (kx-backoff.h), step for step python/kairox/backoff.py's
// Backoff (tests/test_backoff.py runs both on the same token times).
#include "kx-backoff.h"

#include <algorithm>

// the median as Python's statistics.median takes it (the mean of the middle two of an even count)
static double kx_median(std::vector<double> v) {
    const size_t m = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + m, v.end());
    const double hi = v[m];
    if (v.size() % 2 == 1) {
        return hi;
    }
    const double lo = *std::max_element(v.begin(), v.begin() + m);
    return (lo + hi) / 2.0;
}

// a gated hold is checked at the end of each hold length, on the window before it
static bool kx_backoff_checked(const kx_backoff & b, int64_t n) {
    const int64_t m = n % b.hold;
    return m == 0 || m > b.hold - b.cfg.window;
}

bool kx_backoff_wants_hit(const kx_backoff & b) {
    const kx_backoff_config & c = b.cfg;
    return c.window > 0 && c.drift > 0.0f &&
           (b.phase == 1 || (b.phase == 2 && b.lost_hit >= 0 && kx_backoff_checked(b, b.n + 1)));
}

bool kx_backoff_step(kx_backoff & b, double seconds, double hit) {
    const kx_backoff_config & c = b.cfg;
    if (c.window <= 0) {
        return true;
    }
    b.n += 1;
    if (b.phase == 0) {
        if (b.n > c.settle) {
            b.s_on.push_back(seconds);
        }
        if (b.n == (int64_t) c.settle + c.window) {
            b.phase = 1;
            b.n     = 0;
            b.on    = false;
        }
    } else if (b.phase == 1) {
        if (b.n > c.settle) {
            b.s_off.push_back(seconds);
            if (hit >= 0) {
                b.h_off.push_back(hit);
            }
        }
        if (b.n == (int64_t) c.settle + c.window) {
            const bool won = kx_median(b.s_on) < kx_median(b.s_off) * (1.0 - (double) c.margin);
            b.streak   = (b.last_won == (int32_t) won) ? b.streak + 1 : 0;
            b.last_won = won;
            b.hold     = (int64_t) c.window << std::min(b.streak, c.max_doubling);
            b.lost_hit = !won && c.drift > 0.0f && !b.h_off.empty() ? kx_median(b.h_off) : -1.0;
            b.phase    = 2;
            b.n        = 0;
            b.on       = won;
            b.s_on.clear();
            b.s_off.clear();
            b.h_off.clear();
            b.recent.clear();
        }
    } else {
        if (b.lost_hit >= 0 && hit >= 0 && kx_backoff_checked(b, b.n)) {
            b.recent.push_back(hit);
            if (b.recent.size() > (size_t) c.window) {
                b.recent.erase(b.recent.begin());
            }
        }
        // after a loss, nothing changed is no reason to pay for another probe: it waits for the
        // hit rate of the last window to fall below the lost probe's (at most four holds); the
        // median only at a check
        if (b.n % b.hold == 0 && (b.lost_hit < 0 || b.n == 4 * b.hold ||
                                  (b.recent.size() == (size_t) c.window &&
                                   kx_median(b.recent) < b.lost_hit - (double) c.drift))) {
            b.phase = 0;
            b.n     = 0;
            b.on    = true;
        }
    }
    return b.on;
}

int32_t kx_backoff_run(const kx_backoff_config * cfg, const double * seconds, const double * hits, int64_t n,
                       uint8_t * on) {
    if (!cfg || (n > 0 && (!seconds || !on)) || cfg->window < 0 || cfg->settle < 0 || cfg->max_doubling < 0 ||
        !(cfg->margin >= 0.0f && cfg->margin < 1.0f) || !(cfg->drift >= 0.0f && cfg->drift < 1.0f)) {
        return 1;
    }
    kx_backoff b;
    b.cfg = *cfg;
    for (int64_t i = 0; i < n; ++i) {
        const double hit = hits && kx_backoff_wants_hit(b) ? hits[i] : -1.0;
        on[i] = kx_backoff_step(b, seconds[i], hit) ? 1 : 0;
    }
    return 0;
}
