// The balancer's per-layer decision on the host (include/kx-tam.h): the same decisions as
// python/kairox/balancer.py and cuda/kx-tam.cu, for the CPU-only runtime and as the C++
// side of the trace-replay tests.
#include "kx-tam.h"

#include <algorithm>
#include <functional>
#include <vector>

// the key of rank k (1-based) among keys, largest first; keys are unique
static uint64_t kx_tam_kth_largest(std::vector<uint64_t> & keys, size_t k) {
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint64_t>());
    return keys[k - 1];
}

int32_t kx_tam_step(const kx_tam_config * cfg, kx_tam_state * st, float * score, uint8_t * resident, int32_t n,
                    int32_t capacity, const uint8_t * active, int32_t stall, uint8_t * admit, uint8_t * evict,
                    int32_t * n_admit, int32_t * n_evict) {
    if (!cfg || !st || !score || !resident || !active || !admit || !evict || n < 0 || capacity < 0 ||
        capacity > n) {
        return 1;
    }
    kx_tam_adapt(cfg, st, stall);
    const float lam = st->lam;
    const float tau = kx_tam_tau(cfg, lam);
    std::vector<uint64_t> key(n);
    std::vector<uint8_t> elig(n);
    std::vector<uint64_t> pool;
    int32_t n_res = 0;
    for (int32_t i = 0; i < n; ++i) {
        score[i] = kx_tam_score(lam, score[i], active[i]);
        key[i] = kx_tam_key(score[i], resident[i], i);
        elig[i] = resident[i] || score[i] > tau;
        n_res += resident[i] ? 1 : 0;
        if (elig[i]) {
            pool.push_back(key[i]);
        }
    }
    // target: the top `capacity` eligible groups; t_min the smallest key in it
    uint64_t t_min = 0;
    const bool none = capacity == 0 || pool.empty();
    if (!none && (int32_t) pool.size() > capacity) {
        t_min = kx_tam_kth_largest(pool, capacity);
    }
    auto in_target = [&](int32_t i) { return !none && elig[i] && key[i] >= t_min; };
    // loads: the best non-resident groups of the target, at most max_admit of them
    pool.clear();
    for (int32_t i = 0; i < n; ++i) {
        if (in_target(i) && !resident[i]) {
            pool.push_back(key[i]);
        }
    }
    size_t na = pool.size();
    uint64_t a_min = 0;
    if (cfg->max_admit >= 0 && na > (size_t) cfg->max_admit) {
        na = cfg->max_admit;
        a_min = na > 0 ? kx_tam_kth_largest(pool, na) : UINT64_MAX;
    }
    // evictions: a load needs a free slot or one of the worst residents outside the target
    const int32_t ne = std::max<int32_t>(0, (int32_t) na - (capacity - n_res));
    pool.clear();
    for (int32_t i = 0; i < n; ++i) {
        if (resident[i] && !in_target(i)) {
            pool.push_back(~key[i]); // the worst first: the largest of the inverted keys
        }
    }
    const uint64_t e_min = ne > 0 ? kx_tam_kth_largest(pool, ne) : UINT64_MAX;
    for (int32_t i = 0; i < n; ++i) {
        admit[i] = na > 0 && in_target(i) && !resident[i] && key[i] >= a_min;
        evict[i] = ne > 0 && resident[i] && !in_target(i) && ~key[i] >= e_min;
    }
    for (int32_t i = 0; i < n; ++i) {
        resident[i] = (resident[i] && !evict[i]) || admit[i];
    }
    if (n_admit) {
        *n_admit = (int32_t) na;
    }
    if (n_evict) {
        *n_evict = ne;
    }
    return 0;
}

int32_t kx_tam_replay(const kx_tam_config * cfg, int32_t n, int32_t capacity, const uint8_t * initial,
                      int32_t n_steps, const uint8_t * active, const int32_t * stalls, uint8_t * admit,
                      uint8_t * evict, float * lam) {
    if (!cfg || !initial || n_steps < 0 || (n_steps > 0 && (!active || !stalls || !admit || !evict || !lam))) {
        return 1;
    }
    kx_tam_state st;
    kx_tam_state_init(cfg, &st);
    std::vector<float> score(n, 0.0f);
    std::vector<uint8_t> res(initial, initial + n);
    for (int32_t t = 0; t < n_steps; ++t) {
        const size_t o = (size_t) t * n;
        if (kx_tam_step(cfg, &st, score.data(), res.data(), n, capacity, active + o, stalls[t], admit + o,
                        evict + o, nullptr, nullptr)) {
            return 1;
        }
        lam[t] = st.lam;
    }
    return 0;
}
