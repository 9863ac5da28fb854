// The pipeline's end phase, its selection alone: the ~50 µs per layer step it spends before its
// first load on KB-7B (bench/results/KB-7B-f16-h100/plain/: end 74-94 µs, 76 + 0.15 per load).
//
// As kx_pipe_end ran before its load cap (KX_PIPE_MAX_ADMIT; this probe is why the cap came,
// bench/results/KB-7B-f16-h100/pipe-cap/): the scan threads' candidates (listed, not resident; TAM
// keys, higher is better) and victims (resident, not listed; lower is worse) are merged; the
// candidates sorted best first, the worst victims selected and sorted; loads are the pairs in
// that order while a candidate's key beats its victim's. Variants, interleaved on the same keys:
//   sort: as kx_pipe_end;
//   heap: a max-heap of candidates and a min-heap of victims popped pair by pair until the
//         crossing (touches only the pairs it moves, but each pop is a log-depth sift).
// Exits non-zero when the two select other loads.
//
//   g++ -O2 -std=c++17 -pthread bench/select_probe.cpp -o /tmp/select_probe && /tmp/select_probe 16 300
// Arguments: scan threads (the slices the keys arrive in), repeats, candidates, victims, and the
// victims' key range as a share of the candidates' (0.5: victims below the median candidate).
// Prints one JSON object: the pairs selected and median and min µs per layer step of each variant.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

using keys = std::vector<uint64_t>;

static void merge(const std::vector<keys> & parts, keys & out) {
    out.clear();
    for (const keys & p : parts) {
        out.insert(out.end(), p.begin(), p.end());
    }
}

static void select_sort(const std::vector<keys> & tc, const std::vector<keys> & tv, keys & cand, keys & vict, keys & out) {
    merge(tc, cand);
    std::sort(cand.begin(), cand.end(), std::greater<uint64_t>());
    merge(tv, vict);
    const size_t need = std::min(vict.size(), cand.size());
    if (need < vict.size()) {
        std::nth_element(vict.begin(), vict.begin() + need, vict.end());
        vict.resize(need);
    }
    std::sort(vict.begin(), vict.end());
    out.clear();
    for (size_t j = 0; j < vict.size() && cand[j] > vict[j]; ++j) {
        out.push_back(cand[j]);
    }
}

static void select_heap(const std::vector<keys> & tc, const std::vector<keys> & tv, keys & cand, keys & vict, keys & out) {
    merge(tc, cand);
    merge(tv, vict);
    std::make_heap(cand.begin(), cand.end());
    std::make_heap(vict.begin(), vict.end(), std::greater<uint64_t>());
    out.clear();
    auto ce = cand.end();
    auto ve = vict.end();
    while (ce != cand.begin() && ve != vict.begin() && cand.front() > vict.front()) {
        out.push_back(cand.front());
        std::pop_heap(cand.begin(), ce--);
        std::pop_heap(vict.begin(), ve--, std::greater<uint64_t>());
    }
}

int main(int argc, char ** argv) {
    const int32_t n_thread = argc > 1 ? std::atoi(argv[1]) : 16;
    const int32_t n_rep    = argc > 2 ? std::atoi(argv[2]) : 300;
    const int32_t n_cand   = argc > 3 ? std::atoi(argv[3]) : 700;
    const int32_t n_vict   = argc > 4 ? std::atoi(argv[4]) : 2300;
    const double  v_share  = argc > 5 ? std::atof(argv[5]) : 0.5;
    if (n_thread < 1 || n_rep < 1 || n_cand < 0 || n_vict < 0 || v_share <= 0 || v_share > 2) {
        std::fprintf(stderr, "select_probe: bad arguments\n");
        return 2;
    }
    std::mt19937_64 rng(1);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    const double top = 4e18; // keys below 2^63 for a victims' range up to twice the candidates'
    const char * names[2] = { "sort", "heap" };
    std::vector<double> us[2];
    size_t pairs = 0;
    keys cand, vict, out[2];
    for (int32_t rep = 0; rep < n_rep; ++rep) {
        std::vector<keys> tc(n_thread), tv(n_thread);
        for (int32_t i = 0; i < n_cand; ++i) {
            tc[i % n_thread].push_back((uint64_t) (u(rng) * top));
        }
        for (int32_t i = 0; i < n_vict; ++i) {
            tv[i % n_thread].push_back((uint64_t) (u(rng) * v_share * top));
        }
        for (int32_t k = 0; k < 2; ++k) {
            const int32_t v = (rep + k) % 2; // interleaved: each variant first on every other repeat
            const auto t0 = std::chrono::steady_clock::now();
            (v == 0 ? select_sort : select_heap)(tc, tv, cand, vict, out[v]);
            us[v].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
        if (out[0] != out[1]) {
            std::fprintf(stderr, "select_probe: the variants select other loads (repeat %d)\n", rep);
            return 1;
        }
        pairs = out[0].size();
    }
    std::printf("{\"threads\": %d, \"reps\": %d, \"candidates\": %d, \"victims\": %d, \"pairs_last\": %zu",
                n_thread, n_rep, n_cand, n_vict, pairs);
    for (int32_t v = 0; v < 2; ++v) {
        std::sort(us[v].begin(), us[v].end());
        std::printf(", \"%s\": {\"median_us\": %.2f, \"min_us\": %.2f}", names[v], us[v][us[v].size() / 2], us[v][0]);
    }
    std::printf("}\n");
    return 0;
}
