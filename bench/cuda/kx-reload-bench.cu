// The slot reload benchmark (bench/reload.py compiles it with nvcc and loads it): neuron rows
// from page-locked host memory into device memory by a kairox build's reload engine, alone
// and beside a device-memory-bound kernel stream, with a decode's small copies timed meanwhile.
//
// It drives the engine only through its table of functions (include/kx-reload.h), which the
// caller takes from the CUDA registry ("kx_reload_iface", patches/0006), so the measurement
// runs the shipped engine while libggml-cuda carries no benchmark.
#include "kx-reload.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

// reads a device buffer over and over: stands in for the decode's kernels beside a reload
static __global__ void kx_reload_busy_kernel(const float4 * x, int64_t n, float * sink) {
    float4 acc = make_float4(0, 0, 0, 0);
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t) gridDim.x * blockDim.x) {
        const float4 v = x[i];
        acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    if (acc.x + acc.y + acc.z + acc.w == 12345.0f) {
        *sink = acc.x; // never in practice: keeps the loads
    }
}

// Moves n_rows rows of row_bytes, in runs of group_rows contiguous rows picked at random from a
// page-locked pool 4x larger, by `method` (max_blocks caps the gather's grid) through the
// engine io on device 0, best of reps.
// out[0] reload GB/s alone; out[1] reload GB/s beside a device-memory-bound kernel stream
// lasting about as long; out[2] that stream's slowdown (time with / without the reload); out[3] the worst wait of a
// 64 KiB host-to-device copy on a third stream (a decode's activation transfer) while the
// reload runs, in µs; out[4] the same copy's time with nothing else running, in µs.
// 0 ok; 1 bad arguments; 2 a failure (a message on stderr).
extern "C" __attribute__((visibility("default"))) int32_t kx_reload_bench(
        const kx_reload_iface * io, int32_t method, int64_t row_bytes, int32_t group_rows, int64_t n_rows,
        int32_t max_blocks, int32_t reps, double * out) {
    if (!io || row_bytes <= 0 || group_rows <= 0 || n_rows < group_rows || reps <= 0 || !out) {
        return 1;
    }
    const int64_t n_groups = n_rows / group_rows;
    const size_t group_bytes = (size_t) row_bytes * group_rows;
    const int64_t pool_groups = 4 * n_groups;
    const size_t crit_bytes = 64 << 10;
    const int64_t busy_n = (int64_t) (1u << 30) / sizeof(float4); // 1 GiB read per busy kernel
    char * pool = nullptr, * crit_h = nullptr, * dst = nullptr, * crit_d = nullptr;
    float4 * busy = nullptr;
    float * sink = nullptr;
    cudaStream_t s_busy = nullptr, s_crit = nullptr;
    void * eng = nullptr;
    int32_t rc = 0;
    std::vector<kx_row_copy> copies(n_groups);
    auto fail = [&](const char * what) { fprintf(stderr, "kx_reload_bench: %s\n", what); rc = 2; };
    auto secs = [](auto t0) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    do {
        if (cudaSetDevice(0) != cudaSuccess ||
            cudaMallocHost((void **) &pool, (size_t) pool_groups * group_bytes) != cudaSuccess ||
            cudaMallocHost((void **) &crit_h, crit_bytes) != cudaSuccess ||
            cudaMalloc((void **) &dst, (size_t) n_groups * group_bytes) != cudaSuccess ||
            cudaMalloc((void **) &crit_d, crit_bytes) != cudaSuccess ||
            cudaMalloc((void **) &busy, (size_t) busy_n * sizeof(float4)) != cudaSuccess ||
            cudaMalloc((void **) &sink, sizeof(float)) != cudaSuccess ||
            cudaStreamCreateWithFlags(&s_busy, cudaStreamNonBlocking) != cudaSuccess ||
            cudaStreamCreateWithFlags(&s_crit, cudaStreamNonBlocking) != cudaSuccess) {
            fail("allocation failed");
            break;
        }
        cudaMemset(busy, 0, (size_t) busy_n * sizeof(float4));
        for (size_t i = 0; i < (size_t) pool_groups * group_bytes; i += 4096) {
            pool[i] = (char) i; // touch every page
        }
        eng = io->create(0, method, max_blocks);
        if (!eng || io->host_register(eng, pool, (size_t) pool_groups * group_bytes)) {
            fail("engine");
            break;
        }
        // distinct random groups of the pool (a seeded shuffle), to consecutive slots
        std::vector<int64_t> pick(pool_groups);
        for (int64_t i = 0; i < pool_groups; ++i) {
            pick[i] = i;
        }
        uint64_t z = 0x9E3779B97F4A7C15ull;
        for (int64_t i = pool_groups - 1; i > 0; --i) {
            z = z * 6364136223846793005ull + 1442695040888963407ull;
            std::swap(pick[i], pick[(int64_t) ((z >> 33) % (uint64_t) (i + 1))]);
        }
        for (int64_t g = 0; g < n_groups; ++g) {
            copies[g] = { pool + (size_t) pick[g] * group_bytes, dst + (size_t) g * group_bytes, group_bytes };
        }
        const double bytes = (double) n_groups * group_bytes;
        double best = 1e30;
        for (int32_t k = 0; k <= reps; ++k) { // the first is a warm-up
            const auto t0 = std::chrono::steady_clock::now();
            if (io->copy(eng, copies.data(), n_groups) || io->wait(eng) < 0) {
                fail("copy");
                break;
            }
            if (k > 0) {
                best = std::min(best, secs(t0));
            }
        }
        if (rc) {
            break;
        }
        out[0] = bytes / best / 1e9;
        // the busy stream alone: one pass over 1 GiB timed, then as many passes as last
        // about as long as the reload alone, so the two overlap over the whole measurement
        const int busy_grid = 132 * 8;
        cudaDeviceSynchronize();
        auto t0 = std::chrono::steady_clock::now();
        kx_reload_busy_kernel<<<busy_grid, 256, 0, s_busy>>>(busy, busy_n, sink);
        cudaStreamSynchronize(s_busy);
        if (cudaGetLastError() != cudaSuccess) { // no code for this GPU: the times would mean nothing
            fail("busy kernel");
            break;
        }
        const int passes = std::max(1, (int) (best / secs(t0) + 0.5));
        t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < passes; ++i) {
            kx_reload_busy_kernel<<<busy_grid, 256, 0, s_busy>>>(busy, busy_n, sink);
        }
        cudaStreamSynchronize(s_busy);
        const double busy_alone = secs(t0);
        // critical copy alone
        cudaEvent_t c0, c1;
        cudaEventCreate(&c0);
        cudaEventCreate(&c1);
        // one critical copy, timed on its stream (ms)
        auto crit_ms = [&] {
            cudaEventRecord(c0, s_crit);
            cudaMemcpyAsync(crit_d, crit_h, crit_bytes, cudaMemcpyHostToDevice, s_crit);
            cudaEventRecord(c1, s_crit);
            cudaEventSynchronize(c1);
            float ms = 0;
            cudaEventElapsedTime(&ms, c0, c1);
            return ms;
        };
        float crit_alone = 1e30f;
        for (int i = 0; i < 20; ++i) {
            crit_alone = std::min(crit_alone, crit_ms());
        }
        // together: the reload, the busy stream and critical copies issued one after another
        // until the reload is done
        cudaDeviceSynchronize();
        t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < passes; ++i) {
            kx_reload_busy_kernel<<<busy_grid, 256, 0, s_busy>>>(busy, busy_n, sink);
        }
        const auto tr = std::chrono::steady_clock::now();
        if (io->copy(eng, copies.data(), n_groups)) {
            fail("copy beside compute");
            cudaEventDestroy(c0);
            cudaEventDestroy(c1);
            break;
        }
        float crit_worst = 0.0f;
        while (io->query(eng) == 0) {
            crit_worst = std::max(crit_worst, crit_ms());
        }
        const double reload_busy = secs(tr);
        cudaStreamSynchronize(s_busy);
        const double busy_with = secs(t0);
        out[1] = bytes / reload_busy / 1e9;
        out[2] = busy_with / busy_alone;
        out[3] = 1000.0 * crit_worst;
        out[4] = 1000.0 * crit_alone;
        cudaEventDestroy(c0);
        cudaEventDestroy(c1);
    } while (false);
    if (eng) {
        io->destroy(eng);
    }
    cudaFreeHost(pool);
    cudaFreeHost(crit_h);
    cudaFree(dst);
    cudaFree(crit_d);
    cudaFree(busy);
    cudaFree(sink);
    if (s_busy) cudaStreamDestroy(s_busy);
    if (s_crit) cudaStreamDestroy(s_crit);
    return rc;
}
