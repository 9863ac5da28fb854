// The balancer's per-layer decision on the GPU (include/kx-tam.h): one kernel updates the
// TAM scores and λ, picks the target groups, the loads and the evictions, and updates the
// residency, so a layer's decision needs no host round trip. Same decisions as
// python/kairox/balancer.py and llama/kx-tam.cpp.
//
// One block: a layer has at most tens of thousands of groups (28672 neurons in a 70B
// layer), which one block of 1024 threads walks in a few passes. "Top k by key" is a radix
// select over the 64-bit order key (8 passes of 8 bits, a 256-bin histogram in shared
// memory): it finds the k-th key exactly without sorting, and keys are unique, so "key >=
// k-th key" selects exactly k groups.
#include "kx-tam.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#define KX_TAM_THREADS 1024

struct kx_tam_shared {
    unsigned int hist[256];
    unsigned long long prefix;
    int k;
    int n_elig, n_res, n_cand;
    float lam, tau;
};

// the k-th largest (k >= 1) of key_of(i) over the i where want(i); every thread gets it
template <typename Want, typename Key>
static __device__ uint64_t kx_tam_kth(int n, int k, Want want, Key key_of, kx_tam_shared & sh) {
    uint64_t prefix = 0, mask = 0;
    if (threadIdx.x == 0) {
        sh.k = k;
    }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            sh.hist[b] = 0;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (want(i)) {
                const uint64_t key = key_of(i);
                if ((key & mask) == prefix) {
                    atomicAdd(&sh.hist[(key >> shift) & 255], 1u);
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int kk = sh.k, b = 255;
            for (; b > 0 && (int) sh.hist[b] < kk; --b) {
                kk -= sh.hist[b];
            }
            sh.k = kk;
            sh.prefix = prefix | ((uint64_t) b << shift);
        }
        __syncthreads();
        prefix = sh.prefix;
        mask |= (uint64_t) 255 << shift;
        __syncthreads(); // everyone has read sh before the next pass clears the histogram
    }
    return prefix;
}

static __global__ void kx_tam_step_kernel(kx_tam_config cfg, kx_tam_state * st, float * score, uint8_t * res,
                                          int n, int capacity, const uint8_t * active, int stall,
                                          uint8_t * admit, uint8_t * evict, int32_t * counts) {
    __shared__ kx_tam_shared sh;
    if (threadIdx.x == 0) {
        kx_tam_state s = *st;
        kx_tam_adapt(&cfg, &s, stall);
        *st = s;
        sh.lam = s.lam;
        sh.tau = kx_tam_tau(&cfg, s.lam);
        sh.n_elig = sh.n_res = sh.n_cand = 0;
    }
    __syncthreads();
    const float lam = sh.lam, tau = sh.tau;
    int n_elig = 0, n_res = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float s = kx_tam_score(lam, score[i], active[i]);
        score[i] = s;
        n_elig += res[i] || s > tau;
        n_res += res[i] != 0;
    }
    atomicAdd(&sh.n_elig, n_elig);
    atomicAdd(&sh.n_res, n_res);
    __syncthreads(); // also makes this block's score writes visible to all its threads

    auto key_of = [&](int i) { return kx_tam_key(score[i], res[i], i); };
    auto elig = [&](int i) { return res[i] || score[i] > tau; };
    const bool none = capacity == 0 || sh.n_elig == 0;
    const uint64_t t_min = !none && sh.n_elig > capacity ? kx_tam_kth(n, capacity, elig, key_of, sh) : 0;
    auto target = [&](int i) { return !none && elig(i) && key_of(i) >= t_min; };
    auto cand = [&](int i) { return !res[i] && target(i); };

    int c = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        c += cand(i);
    }
    atomicAdd(&sh.n_cand, c);
    __syncthreads();
    int na = sh.n_cand;
    uint64_t a_min = 0;
    if (cfg.max_admit >= 0 && na > cfg.max_admit) {
        na = cfg.max_admit;
        a_min = na > 0 ? kx_tam_kth(n, na, cand, key_of, sh) : ~(uint64_t) 0;
    }
    const int ne = max(0, na - (capacity - sh.n_res));
    auto pool = [&](int i) { return res[i] && !target(i); };
    auto worst = [&](int i) { return ~key_of(i); };
    const uint64_t e_min = ne > 0 ? kx_tam_kth(n, ne, pool, worst, sh) : ~(uint64_t) 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        admit[i] = na > 0 && cand(i) && key_of(i) >= a_min;
        evict[i] = ne > 0 && pool(i) && worst(i) >= e_min;
    }
    __syncthreads(); // the masks above read res: update it only after every thread is done
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        res[i] = (res[i] && !evict[i]) || admit[i];
    }
    if (threadIdx.x == 0) {
        counts[0] = na;
        counts[1] = ne;
    }
}

#define KX_TAM_CHECK(x)                                                                          \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "kx_cuda_tam_replay: %s: %s\n", #x, cudaGetErrorString(e_));         \
            rc = 2;                                                                              \
            goto done;                                                                           \
        }                                                                                        \
    } while (0)

extern "C" int32_t kx_cuda_tam_replay(const kx_tam_config * cfg, int32_t n, int32_t capacity,
                                      const uint8_t * initial, int32_t n_steps, const uint8_t * active,
                                      const int32_t * stalls, uint8_t * admit, uint8_t * evict, float * lam,
                                      float * step_us) {
    if (!cfg || !initial || n <= 0 || capacity < 0 || capacity > n || n_steps < 0 ||
        (n_steps > 0 && (!active || !stalls || !admit || !evict || !lam))) {
        return 1;
    }
    int32_t rc = 0;
    kx_tam_state st0;
    kx_tam_state_init(cfg, &st0);
    kx_tam_state * d_st = nullptr;
    float * d_score = nullptr;
    uint8_t *d_res = nullptr, *d_act = nullptr, *d_adm = nullptr, *d_ev = nullptr;
    int32_t * d_counts = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    float total_ms = 0.0f;
    const size_t sz = (size_t) n, all = (size_t) n * n_steps;
    KX_TAM_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    KX_TAM_CHECK(cudaEventCreate(&e0));
    KX_TAM_CHECK(cudaEventCreate(&e1));
    KX_TAM_CHECK(cudaMalloc(&d_st, sizeof(kx_tam_state)));
    KX_TAM_CHECK(cudaMalloc(&d_score, sz * sizeof(float)));
    KX_TAM_CHECK(cudaMalloc(&d_res, sz));
    KX_TAM_CHECK(cudaMalloc(&d_act, all + 1));
    KX_TAM_CHECK(cudaMalloc(&d_adm, all + 1));
    KX_TAM_CHECK(cudaMalloc(&d_ev, all + 1));
    KX_TAM_CHECK(cudaMalloc(&d_counts, 2 * sizeof(int32_t)));
    KX_TAM_CHECK(cudaMemcpyAsync(d_st, &st0, sizeof(st0), cudaMemcpyHostToDevice, stream));
    KX_TAM_CHECK(cudaMemsetAsync(d_score, 0, sz * sizeof(float), stream));
    KX_TAM_CHECK(cudaMemcpyAsync(d_res, initial, sz, cudaMemcpyHostToDevice, stream));
    if (n_steps > 0) {
        KX_TAM_CHECK(cudaMemcpyAsync(d_act, active, all, cudaMemcpyHostToDevice, stream));
    }
    for (int32_t t = 0; t < n_steps; ++t) {
        const size_t o = (size_t) t * n;
        KX_TAM_CHECK(cudaEventRecord(e0, stream));
        kx_tam_step_kernel<<<1, KX_TAM_THREADS, 0, stream>>>(*cfg, d_st, d_score, d_res, n, capacity, d_act + o,
                                                             stalls[t], d_adm + o, d_ev + o, d_counts);
        KX_TAM_CHECK(cudaGetLastError());
        KX_TAM_CHECK(cudaEventRecord(e1, stream));
        kx_tam_state st;
        KX_TAM_CHECK(cudaMemcpyAsync(&st, d_st, sizeof(st), cudaMemcpyDeviceToHost, stream));
        KX_TAM_CHECK(cudaStreamSynchronize(stream));
        float ms = 0.0f;
        KX_TAM_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        total_ms += ms;
        lam[t] = st.lam;
    }
    if (n_steps > 0) {
        KX_TAM_CHECK(cudaMemcpyAsync(admit, d_adm, all, cudaMemcpyDeviceToHost, stream));
        KX_TAM_CHECK(cudaMemcpyAsync(evict, d_ev, all, cudaMemcpyDeviceToHost, stream));
        KX_TAM_CHECK(cudaStreamSynchronize(stream));
    }
    if (step_us) {
        *step_us = n_steps > 0 ? 1000.0f * total_ms / n_steps : 0.0f;
    }
done:
    cudaFree(d_st);
    cudaFree(d_score);
    cudaFree(d_res);
    cudaFree(d_act);
    cudaFree(d_adm);
    cudaFree(d_ev);
    cudaFree(d_counts);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (stream) cudaStreamDestroy(stream);
    return rc;
}
