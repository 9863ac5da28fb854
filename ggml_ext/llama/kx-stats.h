// Counters kept as atomics and read through a kx_*_stats(out, reset) call (kairox.h), and the
// host clock the boundary's phases are timed with.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

// out[i] = s[i] (out may be NULL), then s[i] = 0 when reset
template <size_t N>
inline void kx_stats_read(std::atomic<int64_t> (&s)[N], int64_t * out, bool reset) {
    for (size_t i = 0; i < N; ++i) {
        if (out) {
            out[i] = s[i].load();
        }
        if (reset) {
            s[i].store(0);
        }
    }
}

// ns from t to now, and t moved to now (one phase ends where the next begins)
inline int64_t kx_lap_ns(std::chrono::steady_clock::time_point & t) {
    const auto now = std::chrono::steady_clock::now();
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - t).count();
    t = now;
    return ns;
}
