// The balancer's back-off (include/kairox.h: struct kx_backoff_config; reference
// python/kairox/backoff.py): from the context's decoded-token times, whether the balancer runs
// for the next token. Probes on (window tokens), then held (window tokens); keeps the faster by
// median, holds that outcome for a while, probes again.
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
    std::vector<double> s_on, s_off;
};

// one decoded token's seconds (it ran with the previous answer); whether the balancer runs next
bool kx_backoff_step(kx_backoff & b, double seconds);
