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
// on the reload stream, beside the decode. The inputs move as id lists (each layer's active
// neurons, thousands of a layer's tens of thousands) through page-locked staging, and each
// block builds its layer's mask on the device; the loads and evictions (tens per layer) are
// written as ascending id lists straight into mapped page-locked memory. Why: as masks of
// every neuron (in, and both out) they cost the host a fill, copies and a scan per neuron and
// decode: 2.3 M neurons on KB-70B.

// the ids i in [0, n) with flag(i), ascending, into out; their count. Every thread of the
// block calls it (blockDim.x a multiple of 32); a chunk of blockDim.x ids at a time, each
// thread's place from its warp's ballot and the warps' counts before it.
template <typename Flag>
static __device__ int kx_tam_compact(int n, Flag flag, int32_t * out, int * warp_n, int * total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    int base = 0;
    for (int c = 0; c < n; c += blockDim.x) {
        const int i = c + threadIdx.x;
        const bool f = i < n && flag(i);
        const unsigned int ballot = __ballot_sync(0xffffffffu, f);
        if (lane == 0) {
            warp_n[warp] = __popc(ballot);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int s = 0;
            for (int w = 0; w < n_warps; ++w) {
                const int k = warp_n[w];
                warp_n[w] = s;
                s += k;
            }
            *total = s;
        }
        __syncthreads();
        if (f) {
            out[base + warp_n[warp] + __popc(ballot & ((1u << lane) - 1u))] = i;
        }
        base += *total;
        __syncthreads(); // warp_n and total are read before the next chunk writes them
    }
    return base;
}

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
    uint8_t * d_res = nullptr, * d_act = nullptr, * d_adm = nullptr, * d_ev = nullptr; // masks [n_total]
    int32_t * d_ids = nullptr;       // the active ids of a step [n_total at most]
    int32_t * d_counts = nullptr;
    // page-locked staging: active ids in (copied); [2 n_layers] (first id, count) and stalls in,
    // the loads' and evictions' ids out [2 n_total] (mapped: the kernel reads and writes them
    // in place); counts and states out (copied)
    int32_t * h_ids = nullptr, * h_span = nullptr, * h_out = nullptr;
    int32_t * h_stall = nullptr, * h_counts = nullptr;
    kx_tam_state * h_st = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    bool launched = false;
};

static __global__ void kx_tam_layers_kernel(kx_tam_config cfg, const kx_tam_layer_dev * layers, kx_tam_state * st,
                                            float * score, uint8_t * res, uint8_t * active, const int32_t * ids,
                                            const int32_t * span, const int32_t * stall, uint8_t * admit,
                                            uint8_t * evict, int32_t * counts, int32_t * out) {
    __shared__ kx_tam_shared sh;
    __shared__ int warp_n[KX_TAM_THREADS / 32];
    __shared__ int total;
    const int l = blockIdx.x;
    const kx_tam_layer_dev L = layers[l];
    // the layer's active mask from its ids
    uint8_t * act = active + L.off;
    for (int i = threadIdx.x; i < L.n; i += blockDim.x) {
        act[i] = 0;
    }
    __syncthreads();
    const int32_t first = span[2 * l], n_ids = span[2 * l + 1];
    for (int j = threadIdx.x; j < n_ids; j += blockDim.x) {
        const int32_t i = ids[first + j];
        if (i >= 0 && i < L.n) { // the host's lists are the graph's: never trusted with a store
            act[i] = 1;
        }
    }
    __syncthreads();
    kx_tam_step_block(cfg, st + l, score + L.off, res + L.off, L.n, L.capacity, act, stall[l],
                      admit + L.off, evict + L.off, counts + 2 * l, sh);
    __syncthreads(); // the masks are complete
    const uint8_t * adm = admit + L.off, * ev = evict + L.off;
    kx_tam_compact(L.n, [&](int i) { return adm[i] != 0; }, out + 2 * L.off, warp_n, &total);
    kx_tam_compact(L.n, [&](int i) { return ev[i] != 0; }, out + 2 * L.off + L.n, warp_n, &total);
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
    cudaFree(t->d_ids);
    cudaFree(t->d_counts);
    cudaFreeHost(t->h_ids);
    cudaFreeHost(t->h_span);
    cudaFreeHost(t->h_out);
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
              cudaMalloc(&t->d_ids, N * sizeof(int32_t)) == cudaSuccess &&
              cudaMalloc(&t->d_counts, 2 * L * sizeof(int32_t)) == cudaSuccess &&
              cudaMallocHost(&t->h_ids, N * sizeof(int32_t)) == cudaSuccess &&
              cudaHostAlloc(&t->h_span, 2 * L * sizeof(int32_t), cudaHostAllocMapped) == cudaSuccess &&
              cudaHostAlloc(&t->h_out, 2 * N * sizeof(int32_t), cudaHostAllocMapped) == cudaSuccess &&
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

// back to a new table's state (the back-off's return: fresh scores and λ, residency
// `initial`), queued on `stream` behind what runs there: no allocation, so no cudaFree's
// device-wide synchronization. The last launch's results are dropped.
int32_t ggml_cuda_kx_tam_batch_reset(void * p, cudaStream_t stream, const uint8_t * initial) {
    auto * t = (kx_cuda_tam_batch *) p;
    const size_t N = (size_t) t->n_total, L = (size_t) t->n_layers;
    std::vector<kx_tam_state> st(L);
    for (auto & x : st) {
        kx_tam_state_init(&t->cfg, &x);
    }
    // pageable sources: each copy returns once its bytes are staged, so the vectors may go
    if (cudaMemcpyAsync(t->d_st, st.data(), L * sizeof(kx_tam_state), cudaMemcpyHostToDevice, stream) != cudaSuccess ||
        cudaMemsetAsync(t->d_score, 0, N * sizeof(float), stream) != cudaSuccess ||
        cudaMemcpyAsync(t->d_res, initial, N, cudaMemcpyHostToDevice, stream) != cudaSuccess) {
        return 1;
    }
    t->launched = false;
    return 0;
}

// queues one step of every layer on `stream`: layer l's active ids at active[l] (n_active[l]),
// stalls [n_layers]
int32_t ggml_cuda_kx_tam_batch_launch(void * p, cudaStream_t stream, const int32_t * const * active,
                                      const int32_t * n_active, const int32_t * stalls) {
    auto * t = (kx_cuda_tam_batch *) p;
    const size_t L = (size_t) t->n_layers;
    int64_t n_ids = 0;
    for (size_t l = 0; l < L; ++l) {
        if (n_active[l] < 0 || n_ids + n_active[l] > t->n_total) {
            return 1;
        }
        memcpy(t->h_ids + n_ids, active[l], (size_t) n_active[l] * sizeof(int32_t));
        t->h_span[2 * l] = (int32_t) n_ids;
        t->h_span[2 * l + 1] = n_active[l];
        n_ids += n_active[l];
    }
    memcpy(t->h_stall, stalls, L * sizeof(int32_t));
    int32_t * d_stall = nullptr, * d_span = nullptr, * d_out = nullptr;
    if (cudaHostGetDevicePointer((void **) &d_stall, t->h_stall, 0) != cudaSuccess ||
        cudaHostGetDevicePointer((void **) &d_span, t->h_span, 0) != cudaSuccess ||
        cudaHostGetDevicePointer((void **) &d_out, t->h_out, 0) != cudaSuccess ||
        (n_ids > 0 && cudaMemcpyAsync(t->d_ids, t->h_ids, (size_t) n_ids * sizeof(int32_t), cudaMemcpyHostToDevice,
                                      stream) != cudaSuccess) ||
        cudaEventRecord(t->e0, stream) != cudaSuccess) {
        return 1;
    }
    kx_tam_layers_kernel<<<t->n_layers, KX_TAM_THREADS, 0, stream>>>(t->cfg, t->d_layers, t->d_st, t->d_score,
                                                                       t->d_res, t->d_act, t->d_ids, d_span, d_stall,
                                                                       t->d_adm, t->d_ev, t->d_counts, d_out);
    if (cudaGetLastError() != cudaSuccess || cudaEventRecord(t->e1, stream) != cudaSuccess ||
        cudaMemcpyAsync(t->h_counts, t->d_counts, 2 * L * sizeof(int32_t), cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaMemcpyAsync(t->h_st, t->d_st, L * sizeof(kx_tam_state), cudaMemcpyDeviceToHost, stream) != cudaSuccess) {
        return 2;
    }
    t->launched = true;
    return 0;
}

// the last launch's results (the caller has waited for the stream): the loads' and
// evictions' ids (*ids, include/kx-reload.h), λ [n_layers], counts [2 n_layers] (loads,
// evictions), the kernel's time
int32_t ggml_cuda_kx_tam_batch_fetch(void * p, const int32_t ** ids, float * lam, int32_t * counts, float * kernel_us) {
    auto * t = (kx_cuda_tam_batch *) p;
    if (!t->launched) {
        return 1;
    }
    const size_t L = (size_t) t->n_layers;
    *ids = t->h_out;
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
