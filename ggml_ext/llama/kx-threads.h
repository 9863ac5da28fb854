// Load-aware decode threads (reference python/kairox/threads.py): from the context's
// single-token decode times, the CPU thread count of the next decode. Holds a count while a
// window's mean stays within `drift` of the mean it was chosen at; when two windows in a row
// moved (another process took cores, or gave them back) it probes n, 3n/4, n/2, n/4 one window each
// and keeps the fastest (the largest within 3% of it). Holding fewer than n, it peeks at n for
// one window after `recheck` decodes: as fast as the held count, a probe follows; slower, the
// held count comes back and the next peek waits twice as long (at most 8 x recheck).
#pragma once

#include "kairox.h"

#include <cstdint>
#include <map>
#include <vector>

struct kx_threads {
    kx_threads_config    cfg   = {};
    std::vector<int32_t> cands;          // most first
    int32_t              n_max = 0;
    int32_t              n     = 0;      // the next decode's count
    int32_t              state = 0;      // 0 holding, 1 probing, 2 peeking at n_max
    double               base  = -1.0;   // the held count's window mean when chosen (< 0: not yet)
    int32_t              moved = 0;      // windows in a row whose mean moved by more than the drift
    int64_t              held  = 0;      // decodes timed at the held count since it was chosen (or peeked)
    int64_t              wait  = 0;      // decodes the next peek waits for
    int32_t              kept  = 0;      // the held count while a peek or probe runs
    int64_t              quiet = 0;      // decodes held before a move may probe (fruitless probes double it)
    int32_t              skip  = 0;      // decodes not timed after a change (the pool resizes)
    int64_t              probes = 0;
    std::vector<double>  samples;
    std::map<int32_t, double> tried;     // a probe's means by count
};

// false for bad arguments (n_max < 1, window < 1, recheck < window, drift outside (0, 1))
bool    kx_threads_init(kx_threads & t, int32_t n_max, const kx_threads_config & cfg);
// one decode's seconds at the current count; the count the next decode runs with
int32_t kx_threads_step(kx_threads & t, double seconds);
