// Runtime migration's policy (kx-migrate.cpp; python/kairox/migrate.py is the reference): the
// rates re-estimated from the last decode steps, and the host tensors to stream into GPU
// scratch, chosen again when a rate moves.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

// the streamed tensors' scratch slots: one tensor in use, the next arriving; also the most
// that stream in a row without a CPU tensor between (one device split reads such a run at once)
static constexpr int32_t kx_stream_slots = 2;

struct kx_migrate_rates {
    double cpu_gbs  = 100.0;
    double gpu_gbs  = 2000.0;
    double pcie_gbs = 50.0;
};

// a tensor the budget left on the CPU: its bytes (what streaming copies), the share a token
// reads, the GPU-resident bytes the step reads before it
struct kx_migrate_tensor {
    int64_t nbytes;
    int64_t gpu_bytes_before;
    double  read;
};

// one decode step as measured: bytes and seconds of each side, and the host-to-device copies
struct kx_migrate_sample {
    double cpu_bytes, cpu_s, gpu_bytes, gpu_s, copy_bytes, copy_s;
};

// the streamed set that makes the step shortest (each tensor fitting one of the scratch's
// kx_stream_slots slots, no more than kx_stream_slots in a row without a CPU tensor between, a
// copy waiting for its slot's last reader); returns the modelled step seconds
double kx_migrate_choose(const std::vector<kx_migrate_tensor> & t, const kx_migrate_rates & r, int64_t gpu_bytes,
                         int64_t scratch_bytes, std::vector<bool> & streamed);
// the modelled step with this set streamed (kairox.migrate.step_time)
double kx_migrate_step_time(const std::vector<kx_migrate_tensor> & t, const kx_migrate_rates & r, int64_t gpu_bytes,
                            const std::vector<bool> & streamed);

struct kx_migrator {
    std::vector<kx_migrate_tensor> tensors;
    int64_t gpu_bytes     = 0;
    int64_t scratch_bytes = 0;
    double  threshold     = 0.15; // relative change of a rate that makes the choice again
    int32_t cooldown      = 5;    // decode steps at least between two choices
    int32_t window        = 8;    // steps the rates are estimated over
    double  min_gain      = 0.03; // a new set must model this much faster than the current one at
                                  // the new rates (a change re-splits the graph; see migrate.py)

    kx_migrate_rates rates;       // those of the current choice
    kx_migrate_rates seen;        // the last estimate (a side with no work keeps it)
    std::vector<bool> streamed;
    std::deque<kx_migrate_sample> samples;
    int64_t steps = 0;
    int64_t last  = 0;
    int64_t n_moved = 0;          // re-estimates past the threshold (a new set or not)

    void init(const kx_migrate_rates & r);
    // feed one step; true when it made a new choice (streamed holds it): the rates moved past
    // the threshold and the best set at them beats the current one by min_gain
    bool step(const kx_migrate_sample & s);
};
