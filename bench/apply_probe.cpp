// The balancer's apply phase, alone: why it costs 7-9 µs per layer step on the H200 machine
// (KB-70B adaptive rows, bench/results/KB-70B-q4_0-h200/kb70b-ids/) for ~32 loads and ~32 evictions.
//
// As in kx_balance_apply: per layer, the last step's loads enter (slot map, host maps, residency
// bits, slot -> neuron) and this step's evictions leave (the same maps and the down row of the
// neuron); 80 layers of 28672 neurons, 8594 slots, random neurons. Between repeats other threads
// stream 1 GiB (a decode's weight reads), so the maps are cold as after a real decode. Variants,
// interleaved: plain (as kx-balance.cpp applied before the first-pass prefetch), and with a first pass over every layer that
// prefetches the lines the second pass writes (many misses in flight instead of one at a time).
//
//   g++ -O2 -std=c++17 -pthread bench/apply_probe.cpp -o /tmp/apply_probe && /tmp/apply_probe 15
// Prints one JSON object: median and min µs per layer of each variant.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

static constexpr int32_t n_layer = 80, n_ff = 28672, n_slots = 8594, n_move = 32;

struct layer {
    std::vector<int32_t> slot_of, coldmap, colddown, down_row, resident;
    std::vector<uint64_t> bits;
    std::vector<std::pair<int32_t, int32_t>> inflight;
    std::vector<int32_t> evict, free_slots;
};

static void stream(std::vector<char> & w, int32_t n_thread) {
    std::vector<std::thread> pool;
    std::atomic<uint64_t> sink{0};
    for (int32_t t = 0; t < n_thread; ++t) {
        pool.emplace_back([&, t] {
            uint64_t acc = 0;
            for (size_t i = w.size() / n_thread * t; i < w.size() / n_thread * (t + 1); i += 64) {
                acc += (uint64_t) w[i];
            }
            sink += acc;
        });
    }
    for (auto & th : pool) {
        th.join();
    }
}

int main(int argc, char ** argv) {
    const int32_t n_thread = argc > 1 ? std::atoi(argv[1]) : (int32_t) std::thread::hardware_concurrency();
    const int32_t n_rep = argc > 2 ? std::atoi(argv[2]) : 12;
    std::mt19937 rng(1);
    std::vector<layer> ls(n_layer);
    for (layer & L : ls) {
        L.slot_of.assign(n_ff, -1);
        L.coldmap.resize(n_ff);
        L.colddown.resize(n_ff);
        L.down_row.resize(n_ff);
        L.bits.assign((n_ff + 63) / 64, 0);
        L.resident.assign(n_slots, -1);
        for (int32_t i = 0; i < n_ff; ++i) {
            L.coldmap[i] = L.colddown[i] = i;
            L.down_row[i] = (int32_t) ((i * 7919) % n_ff);
        }
        for (int32_t s = 0; s < n_slots; ++s) {
            L.free_slots.push_back(s);
        }
    }
    std::vector<char> weights((size_t) 1 << 30, 1);
    const char * names[2] = { "plain", "prefetch" };
    std::vector<double> us[2];
    for (int32_t rep = 0; rep < n_rep; ++rep) {
        for (int32_t v = 0; v < 2; ++v) {
            // the step's moves: loads of free neurons (in flight since the last boundary), evictions of residents
            for (layer & L : ls) {
                L.inflight.clear();
                L.evict.clear();
                for (int32_t k = 0; k < n_move && !L.free_slots.empty(); ++k) {
                    const int32_t i = (int32_t) (rng() % n_ff);
                    if (L.slot_of[i] < 0 && std::none_of(L.inflight.begin(), L.inflight.end(), [&](auto & p) { return p.first == i; })) {
                        L.inflight.push_back({ i, L.free_slots.back() });
                        L.free_slots.pop_back();
                    }
                }
                for (int32_t k = 0; k < n_move; ++k) {
                    const int32_t i = (int32_t) (rng() % n_ff);
                    if (L.slot_of[i] >= 0 && std::find(L.evict.begin(), L.evict.end(), i) == L.evict.end()) {
                        L.evict.push_back(i);
                    }
                }
            }
            stream(weights, n_thread);
            const auto t0 = std::chrono::steady_clock::now();
            if (v == 1) {
                for (const layer & L : ls) {
                    for (const auto & [i, s] : L.inflight) {
                        __builtin_prefetch(&L.coldmap[i], 1);
                        __builtin_prefetch(&L.colddown[i], 1);
                        __builtin_prefetch(&L.slot_of[i], 1);
                        __builtin_prefetch(&L.bits[i >> 6], 1);
                        __builtin_prefetch(&L.resident[s], 1);
                    }
                    for (int32_t i : L.evict) {
                        __builtin_prefetch(&L.coldmap[i], 1);
                        __builtin_prefetch(&L.colddown[i], 1);
                        __builtin_prefetch(&L.down_row[i], 0);
                        __builtin_prefetch(&L.slot_of[i], 1);
                        __builtin_prefetch(&L.bits[i >> 6], 1);
                    }
                }
            }
            for (layer & L : ls) {
                for (const auto & [i, s] : L.inflight) {
                    L.coldmap[i] = L.colddown[i] = -1;
                    L.slot_of[i] = s;
                    L.bits[i >> 6] |= 1ull << (i & 63);
                    L.resident[s] = i;
                }
                for (int32_t i : L.evict) {
                    const int32_t s = L.slot_of[i];
                    L.coldmap[i] = i;
                    L.colddown[i] = L.down_row[i];
                    L.slot_of[i] = -1;
                    L.bits[i >> 6] &= ~(1ull << (i & 63));
                    L.resident[s] = -1;
                    L.free_slots.push_back(s);
                }
            }
            us[v].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n_layer);
        }
    }
    int64_t moved = 0;
    for (const layer & L : ls) {
        moved += (int64_t) L.inflight.size() + (int64_t) L.evict.size();
    }
    std::printf("{\"threads\": %d, \"reps\": %d, \"moves_per_layer_last\": %.1f", n_thread, n_rep, (double) moved / n_layer);
    for (int32_t v = 0; v < 2; ++v) {
        std::sort(us[v].begin(), us[v].end());
        std::printf(", \"%s\": {\"median_us\": %.2f, \"min_us\": %.2f}", names[v], us[v][us[v].size() / 2], us[v][0]);
    }
    std::printf("}\n");
    return 0;
}
