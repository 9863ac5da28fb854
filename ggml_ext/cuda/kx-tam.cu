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
#include <cstring>
#include <vector>

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

// one layer's step by the whole block
static __device__ void kx_tam_step_block(const kx_tam_config & cfg, kx_tam_state * st, float * score, uint8_t * res,
                                         int n, int capacity, const uint8_t * active, int stall,
                                         uint8_t * admit, uint8_t * evict, int32_t * counts, kx_tam_shared & sh) {
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

static __global__ void kx_tam_step_kernel(kx_tam_config cfg, kx_tam_state * st, float * score, uint8_t * res,
                                          int n, int capacity, const uint8_t * active, int stall,
                                          uint8_t * admit, uint8_t * evict, int32_t * counts) {
    __shared__ kx_tam_shared sh;
    kx_tam_step_block(cfg, st, score, res, n, capacity, active, stall, admit, evict, counts, sh);
}

// ---------------------------------------------------------------- every layer in one launch
// The live balancer decides all hybrid layers of a step at once: one block per layer (layers
// are independent), so a step costs about one layer's time (tens of µs) whatever the depth,
// on the reload stream, beside the decode. Inputs (active masks, stalls) and outputs
// (admit/evict masks, λ, counts) move through page-locked staging.

struct kx_tam_layer_dev {
    int64_t off;      // the layer's first group in the concatenated arrays
    int32_t n;
    int32_t capacity;
};

struct kx_cuda_tam_batch {
    kx_tam_config cfg;
    int32_t n_layers = 0;
    int64_t n_total = 0;
    kx_tam_layer_dev * d_layers = nullptr;
    kx_tam_state * d_st = nullptr;
    float * d_score = nullptr;
    uint8_t * d_res = nullptr, * d_act = nullptr, * d_adm = nullptr, * d_ev = nullptr;
    int32_t * d_counts = nullptr;
    // page-locked staging: active in; stalls in (read by the kernel in place); results out
    uint8_t * h_act = nullptr, * h_adm = nullptr, * h_ev = nullptr;
    int32_t * h_stall = nullptr, * h_counts = nullptr;
    kx_tam_state * h_st = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    bool launched = false;
};

static __global__ void kx_tam_layers_kernel(kx_tam_config cfg, const kx_tam_layer_dev * layers, kx_tam_state * st,
                                            float * score, uint8_t * res, const uint8_t * active,
                                            const int32_t * stall, uint8_t * admit, uint8_t * evict,
                                            int32_t * counts) {
    __shared__ kx_tam_shared sh;
    const int l = blockIdx.x;
    const kx_tam_layer_dev L = layers[l];
    kx_tam_step_block(cfg, st + l, score + L.off, res + L.off, L.n, L.capacity, active + L.off, stall[l],
                      admit + L.off, evict + L.off, counts + 2 * l, sh);
}

void ggml_cuda_kx_tam_batch_free(void * p) {
    auto * t = (kx_cuda_tam_batch *) p;
    if (!t) {
        return;
    }
    cudaFree(t->d_layers);
    cudaFree(t->d_st);
    cudaFree(t->d_score);
    cudaFree(t->d_res);
    cudaFree(t->d_act);
    cudaFree(t->d_adm);
    cudaFree(t->d_ev);
    cudaFree(t->d_counts);
    cudaFreeHost(t->h_act);
    cudaFreeHost(t->h_adm);
    cudaFreeHost(t->h_ev);
    cudaFreeHost(t->h_stall);
    cudaFreeHost(t->h_counts);
    cudaFreeHost(t->h_st);
    if (t->e0) cudaEventDestroy(t->e0);
    if (t->e1) cudaEventDestroy(t->e1);
    delete t;
}

void * ggml_cuda_kx_tam_batch_new(const kx_tam_config * cfg, int32_t n_layers, const int32_t * n,
                                  const int32_t * capacity, const uint8_t * initial) {
    auto * t = new kx_cuda_tam_batch;
    t->cfg = *cfg;
    t->n_layers = n_layers;
    std::vector<kx_tam_layer_dev> layers(n_layers);
    for (int32_t l = 0; l < n_layers; ++l) {
        layers[l] = { t->n_total, n[l], capacity[l] };
        t->n_total += n[l];
    }
    const size_t N = (size_t) t->n_total, L = (size_t) n_layers;
    std::vector<kx_tam_state> st(L);
    for (auto & x : st) {
        kx_tam_state_init(cfg, &x);
    }
    bool ok = cudaMalloc(&t->d_layers, L * sizeof(kx_tam_layer_dev)) == cudaSuccess &&
              cudaMalloc(&t->d_st, L * sizeof(kx_tam_state)) == cudaSuccess &&
              cudaMalloc(&t->d_score, N * sizeof(float)) == cudaSuccess &&
              cudaMalloc(&t->d_res, N) == cudaSuccess && cudaMalloc(&t->d_act, N) == cudaSuccess &&
              cudaMalloc(&t->d_adm, N) == cudaSuccess && cudaMalloc(&t->d_ev, N) == cudaSuccess &&
              cudaMalloc(&t->d_counts, 2 * L * sizeof(int32_t)) == cudaSuccess &&
              cudaMallocHost(&t->h_act, N) == cudaSuccess && cudaMallocHost(&t->h_adm, N) == cudaSuccess &&
              cudaMallocHost(&t->h_ev, N) == cudaSuccess &&
              cudaMallocHost(&t->h_stall, L * sizeof(int32_t)) == cudaSuccess &&
              cudaMallocHost(&t->h_counts, 2 * L * sizeof(int32_t)) == cudaSuccess &&
              cudaMallocHost(&t->h_st, L * sizeof(kx_tam_state)) == cudaSuccess &&
              cudaEventCreate(&t->e0) == cudaSuccess && cudaEventCreate(&t->e1) == cudaSuccess &&
              cudaMemcpy(t->d_layers, layers.data(), L * sizeof(kx_tam_layer_dev), cudaMemcpyHostToDevice) == cudaSuccess &&
              cudaMemcpy(t->d_st, st.data(), L * sizeof(kx_tam_state), cudaMemcpyHostToDevice) == cudaSuccess &&
              cudaMemset(t->d_score, 0, N * sizeof(float)) == cudaSuccess &&
              cudaMemcpy(t->d_res, initial, N, cudaMemcpyHostToDevice) == cudaSuccess;
    if (!ok) {
        fprintf(stderr, "kx tam batch: allocation failed (%s)\n", cudaGetErrorString(cudaGetLastError()));
        ggml_cuda_kx_tam_batch_free(t);
        return nullptr;
    }
    return t;
}

// queues one step of every layer on `stream`: active [n_total] masks, stalls [n_layers]
int32_t ggml_cuda_kx_tam_batch_launch(void * p, cudaStream_t stream, const uint8_t * active, const int32_t * stalls) {
    auto * t = (kx_cuda_tam_batch *) p;
    const size_t N = (size_t) t->n_total, L = (size_t) t->n_layers;
    memcpy(t->h_act, active, N);
    memcpy(t->h_stall, stalls, L * sizeof(int32_t));
    int32_t * d_stall = nullptr;
    if (cudaHostGetDevicePointer((void **) &d_stall, t->h_stall, 0) != cudaSuccess ||
        cudaMemcpyAsync(t->d_act, t->h_act, N, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
        cudaEventRecord(t->e0, stream) != cudaSuccess) {
        return 1;
    }
    kx_tam_layers_kernel<<<t->n_layers, KX_TAM_THREADS, 0, stream>>>(t->cfg, t->d_layers, t->d_st, t->d_score,
                                                                       t->d_res, t->d_act, d_stall, t->d_adm,
                                                                       t->d_ev, t->d_counts);
    if (cudaGetLastError() != cudaSuccess || cudaEventRecord(t->e1, stream) != cudaSuccess ||
        cudaMemcpyAsync(t->h_adm, t->d_adm, N, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaMemcpyAsync(t->h_ev, t->d_ev, N, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaMemcpyAsync(t->h_counts, t->d_counts, 2 * L * sizeof(int32_t), cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaMemcpyAsync(t->h_st, t->d_st, L * sizeof(kx_tam_state), cudaMemcpyDeviceToHost, stream) != cudaSuccess) {
        return 2;
    }
    t->launched = true;
    return 0;
}

// the last launch's results (the caller has waited for the stream): masks [n_total] into
// admit / evict, λ [n_layers], counts [2 n_layers] (loads, evictions), the kernel's time
int32_t ggml_cuda_kx_tam_batch_fetch(void * p, uint8_t * admit, uint8_t * evict, float * lam, int32_t * counts,
                                     float * kernel_us) {
    auto * t = (kx_cuda_tam_batch *) p;
    if (!t->launched) {
        return 1;
    }
    const size_t N = (size_t) t->n_total, L = (size_t) t->n_layers;
    memcpy(admit, t->h_adm, N);
    memcpy(evict, t->h_ev, N);
    memcpy(counts, t->h_counts, 2 * L * sizeof(int32_t));
    for (size_t l = 0; l < L; ++l) {
        lam[l] = t->h_st[l].lam;
    }
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, t->e0, t->e1);
    *kernel_us = 1000.0f * ms;
    t->launched = false;
    return 0;
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
