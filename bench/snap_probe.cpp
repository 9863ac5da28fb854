// The balancer's snapshot after a decode, alone: why it costs 18-22 µs per layer step on the
// H200 machine (KB-70B, bench/results/KB-70B-q4_0-h200/kb70b-ids/) against ~3.5 on the 2-core VM.
//
// As in kx_balance_step: 80 layers of 28672 neurons, ~4960 active ids each (ascending), written
// by the decode's threads (each a slice, as ggml_cpy splits rows), then read by one thread
// that copies each list and counts hits. Between repeats the threads stream 1 GiB (the decode's
// weight reads), so the slot maps are cold as after a real decode. Variants, interleaved:
//   int32    hits through the int32 neuron -> slot map (what kx-balance.cpp does)
//   bitmap   hits through a 1-bit residency map (3.5 KiB a layer instead of 112)
//   copy     the lists' copy alone
//   bitpre   the bitmap, each layer's lines prefetched while the layer before is counted
// each with the other threads spinning on an atomic during the snapshot (ggml's threadpool
// polls for a while after a graph) or parked on a condition variable.
//
//   g++ -O2 -std=c++17 -pthread bench/snap_probe.cpp -o /tmp/snap_probe && /tmp/snap_probe 16
// Prints one JSON object: median and min µs per layer of each variant.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

static constexpr int32_t n_layer = 80, n_ff = 28672, n_slots = 8594;

int main(int argc, char ** argv) {
    const int32_t n_thread = argc > 1 ? std::atoi(argv[1]) : (int32_t) std::thread::hardware_concurrency();
    const int32_t n_rep = argc > 2 ? std::atoi(argv[2]) : 12;
    std::mt19937 rng(1);
    std::vector<std::vector<int32_t>> seen(n_layer, std::vector<int32_t>(n_ff + 1));
    std::vector<std::vector<int32_t>> lists(n_layer), slot_of(n_layer, std::vector<int32_t>(n_ff, -1));
    std::vector<std::vector<uint64_t>> bits(n_layer, std::vector<uint64_t>((n_ff + 63) / 64, 0));
    std::vector<std::vector<int32_t>> snap(n_layer);
    for (int32_t l = 0; l < n_layer; ++l) {
        for (int32_t s = 0; s < n_slots; ++s) {
            const int32_t i = (int32_t) (rng() % n_ff);
            slot_of[l][i] = s;
            bits[l][i >> 6] |= 1ull << (i & 63);
        }
        for (int32_t i = 0; i < n_ff; ++i) {
            if (rng() % 1000 < 173) { // 4960 / 28672
                lists[l].push_back(i);
            }
        }
        snap[l].reserve(n_ff);
    }
    std::vector<char> weights((size_t) 1 << 30, 1);
    // the worker threads: on a phase number, write their slices and stream their weights
    std::atomic<int32_t> phase{0}, done{0};
    std::atomic<bool> spin{true};
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::thread> pool;
    std::atomic<uint64_t> sink{0};
    for (int32_t t = 0; t < n_thread; ++t) {
        pool.emplace_back([&, t] {
            for (int32_t seen_phase = 0;;) {
                int32_t p;
                if (spin.load()) {
                    while ((p = phase.load(std::memory_order_acquire)) == seen_phase) {}
                } else {
                    std::unique_lock<std::mutex> lk(mu);
                    cv.wait(lk, [&] { return (p = phase.load()) != seen_phase; });
                }
                seen_phase = p;
                if (p < 0) {
                    return;
                }
                uint64_t acc = 0;
                const size_t w0 = weights.size() / n_thread * t, w1 = weights.size() / n_thread * (t + 1);
                for (size_t i = w0; i < w1; i += 64) {
                    acc += (uint64_t) weights[i];
                }
                for (int32_t l = 0; l < n_layer; ++l) {
                    const int32_t n = (int32_t) lists[l].size();
                    const int32_t k0 = n / n_thread * t, k1 = t + 1 == n_thread ? n : n / n_thread * (t + 1);
                    std::copy(lists[l].begin() + k0, lists[l].begin() + k1, seen[l].begin() + 1 + k0);
                    if (t == 0) {
                        seen[l][0] = n;
                    }
                }
                sink += acc;
                done.fetch_add(1);
            }
        });
    }
    const char * names[8] = { "int32_spin", "bitmap_spin", "copy_spin", "bitpre_spin", "int32_park", "bitmap_park", "copy_park", "bitpre_park" };
    std::vector<double> us[8];
    int64_t hits_total[8] = {};
    int32_t p = 0;
    for (int32_t rep = 0; rep < n_rep; ++rep) {
        for (int32_t v = 0; v < 8; ++v) {
            spin = v < 4;
            done = 0;
            {
                std::lock_guard<std::mutex> lk(mu);
                phase.store(++p, std::memory_order_release);
            }
            cv.notify_all();
            while (done.load() < n_thread) {}
            const auto t0 = std::chrono::steady_clock::now();
            int64_t hits = 0;
            for (int32_t l = 0; l < n_layer; ++l) {
                const int32_t * s = seen[l].data();
                snap[l].assign(s + 1, s + 1 + s[0]);
                if (v % 4 == 3) {
                    if (l + 1 < n_layer) {
                        const char * nb = (const char *) bits[l + 1].data();
                        for (size_t o = 0; o < bits[l + 1].size() * sizeof(uint64_t); o += 64) {
                            __builtin_prefetch(nb + o);
                        }
                    }
                    if (l == 0) {
                        const char * nb = (const char *) bits[0].data();
                        for (size_t o = 0; o < bits[0].size() * sizeof(uint64_t); o += 64) {
                            __builtin_prefetch(nb + o);
                        }
                    }
                }
                if (v % 4 == 0) {
                    for (int32_t i : snap[l]) {
                        hits += slot_of[l][i] >= 0;
                    }
                } else if (v % 4 == 1 || v % 4 == 3) {
                    const uint64_t * b = bits[l].data();
                    for (int32_t i : snap[l]) {
                        hits += (b[i >> 6] >> (i & 63)) & 1;
                    }
                }
            }
            us[v].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n_layer);
            hits_total[v] += hits;
        }
    }
    if (hits_total[0] != hits_total[1] || hits_total[0] != hits_total[3]) {
        std::fprintf(stderr, "snap_probe: the bitmap's hits differ from the map's\n");
        return 1;
    }
    {
        std::lock_guard<std::mutex> lk(mu);
        phase.store(-1);
    }
    cv.notify_all();
    for (auto & th : pool) {
        th.join();
    }
    std::printf("{\"threads\": %d, \"reps\": %d, \"hits_per_token\": %lld", n_thread, n_rep, (long long) (hits_total[0] / n_rep));
    for (int32_t v = 0; v < 8; ++v) {
        std::sort(us[v].begin(), us[v].end());
        std::printf(", \"%s\": {\"median_us\": %.2f, \"min_us\": %.2f}", names[v], us[v][us[v].size() / 2], us[v][0]);
    }
    std::printf("}\n");
    return (int) (sink.load() == 42);
}
