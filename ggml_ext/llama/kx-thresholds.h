// Load-aware thresholds (DynamicInfer): a predictor threshold per side of every hybrid layer.
// The model, the grid and the search are python/kairox/thresholds.py's (the reference, tested
// against kx_thresholds_solve); this is the runtime's controller:
//   - the pack's calibration (kx_pack_layer::thr_*): per neuron and grid point, the share of
//     tokens computed and the output norm a skip drops
//   - the cost of a CPU neuron measured as the run goes (the host op's own timers,
//     kx_cpu_ffn_stats), of a GPU neuron from the device's matvec rate
//   - every kx_thr_period decodes, per hybrid layer, the sums over its current residents and
//     the pair (θ_g, θ_c) with the least modelled time within the error bound; the offsets go
//     to the layer's `thr_off` tensor, which the select of the graph reads (no rebuild)
#pragma once

#include "kx-pack.h"

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

struct kx_slots;

// per grid point: neurons computed and error of each side, for one resident set
struct kx_thr_sums {
    std::array<double, KX_THR_K> n_gpu{}, n_cpu{}, e_gpu{}, e_cpu{};
};

struct kx_thr_layer {
    int32_t kg = KX_THR_K0, kc = KX_THR_K0;   // the pair in force
    kx_thr_sums sums;
    bool have_sums = false;                   // sums of the current residents (static split: once)
    double row_bytes = 0;                     // gate + up + down bytes of one neuron
};

struct kx_thresholds {
    float  budget  = 0.0f;        // Err(θ_g, θ_c) <= Err(0, 0) + budget * E|y| (the layer's output norm)
    double gpu_gbs = 2000.0;      // the device's matvec rate (GB/s)
    // the CPU part's measured costs (ns): per computed neuron (the slowest thread's loop over
    // the rows it computed) and per call (the op's fixed part: x conversion, barriers)
    double t_cpu_ns = 0, o_cpu_ns = 0;
    int64_t decodes = 0, solves = 0, first = 0; // decodes seen, solves made, the decode of the first
    int64_t last_op = 0, last_work = 0, last_calls = 0, last_rows = 0; // counters at the last reading
    std::vector<kx_thr_layer> layers; // per model layer (those without slots unused)
};

// decodes between two solves (the first as soon as a decode's CPU costs were measured)
static constexpr int64_t kx_thr_period = 32;

// the sums of one layer (neuron-major tables [n_ff * KX_THR_K]); resident[i] != 0 for slots
void kx_thr_layer_sums(const float * sel, const float * err, int64_t n_ff, const uint8_t * resident, kx_thr_sums & out);
// the search (thresholds.py solve_sums): the grid points of the GPU and CPU thresholds
void kx_thr_solve(const kx_thr_sums & s, double budget, double norm, double t_gpu, double t_cpu, double o_gpu,
                  double o_cpu, int32_t * kg, int32_t * kc);

// The thresholds for these slots (budget >= 0: the extra error allowed, relative to the FFN
// output's norm; 0: no more than the static threshold's), or nullptr for off (< 0); either
// way the slots' offsets are reset to the static thresholds. gpu_gbs: the device's matvec
// rate (<= 0: the default). Throws std::runtime_error when the pack has no calibration.
std::unique_ptr<kx_thresholds> kx_thresholds_new(kx_slots & slots, const kx_pack & pack, double budget,
                                                 double gpu_gbs);
// After each decode (kx-boundary.cpp): true when a solve is due (the caller then waits for
// the context's graphs and calls kx_thresholds_solve_all).
bool kx_thresholds_tick(kx_thresholds & t);
// Reads the costs and, per hybrid layer, solves and stores changed offsets. moving: the
// residents change between solves (a balancer runs), so their sums are taken again.
void kx_thresholds_solve_all(kx_thresholds & t, const kx_slots & slots, const kx_pack & pack, bool moving);
