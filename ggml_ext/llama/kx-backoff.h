// The balancer's back-off (include/kairox.h: struct kx_backoff_config; reference
// python/kairox/backoff.py): from the context's decoded-token times, whether the balancer runs
// for the next token. Probes on (window tokens), then held (window tokens); keeps the faster by
// median, holds that outcome for a while, probes again (after a loss: once the static split's
// hit rate has fallen by drift, or after four holds).
#pragma once

#include "kairox.h"

#include <cstdint>
#include <vector>

struct kx_backoff {
    kx_backoff_config cfg = {};
    bool    on       = true;
    int32_t phase    = 0;  // 0 probing on, 1 probing held, 2 holding the outcome
    int64_t n        = 0;  // tokens in the phase
    int32_t streak   = 0;  // repeats of the last outcome
    int32_t last_won = -1; // -1: no outcome yet
    int64_t hold     = 0;  // tokens the outcome holds
    double  lost_hit = -1; // the static split's hit rate in the last lost probe (< 0: no drift gate)
    std::vector<double> s_on, s_off, h_off, recent;
};

// one measured token as the boundary fed it to the back-off, and the answer
struct kx_backoff_sample {
    double  seconds;
    double  hit; // < 0: not counted
    uint8_t on;
};

// whether the next token's static hit rate is used (the boundary counts it only then)
bool kx_backoff_wants_hit(const kx_backoff & b);
// one decoded token's seconds (it ran with the previous answer) and, held, the static split's
// hit rate on it (< 0: not counted); whether the balancer runs next
bool kx_backoff_step(kx_backoff & b, double seconds, double hit);
