// kx_select's kernel alone on the device, timed with CUDA events over repeated launches:
// the decode's shape (one token, n scores, `density` of them > 0), scores warm in L2 and,
// with a 256 MiB buffer written between launches, cold. Separates the kernel's own time
// from what a profiler that flushes caches reports.
//
//   nvcc -O2 -arch=sm_90 -std=c++17 bench/select_time.cu -I ggml_ext/include -I ggml_ext/cuda \
//        -I vendor/llama.cpp/ggml/include -I vendor/llama.cpp/ggml/src -o /tmp/select_time
//   /tmp/select_time [n] [density] [reps]
#include "kx-select.cu"

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <random>
#include <vector>

void ggml_cuda_set_device(int device) { cudaSetDevice(device); }
// the ggml symbols the included op file refers to, so this links without ggml
[[noreturn]] void ggml_cuda_error(const char * stmt, const char * func, const char * file, int line, const char * msg) {
    fprintf(stderr, "CUDA error: %s: %s (%s at %s:%d)\n", msg, stmt, func, file, line);
    exit(1);
}
extern "C" void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "abort at %s:%d (%s)\n", file, line, fmt);
    exit(1);
}

// the op's entry point is compiled in but never called here (the bench launches the kernels)
std::unique_ptr<ggml_cuda_pool> ggml_backend_cuda_context::new_pool_for_device(int, int) {
    fprintf(stderr, "no pool in this bench\n");
    exit(1);
}

int main(int argc, char ** argv) {
    const int64_t n    = argc > 1 ? atoll(argv[1]) : 28672;
    const double  dens = argc > 2 ? atof(argv[2]) : 0.045;
    const int     reps = argc > 3 ? atoi(argv[3]) : 200;
    std::vector<float> h(n);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (float & v : h) {
        v = u(rng) < dens ? 1.0f : -1.0f;
    }
    float * s; int32_t * out; char * junk; uint32_t * masks;
    const size_t junk_bytes = 256u << 20;
    CUDA_CHECK(cudaMalloc(&s, n*sizeof(float)));
    CUDA_CHECK(cudaMalloc(&out, (n + 1)*sizeof(int32_t)));
    CUDA_CHECK(cudaMalloc(&junk, junk_bytes));
    CUDA_CHECK(cudaMalloc(&masks, (n + 31)/32*sizeof(uint32_t)));
    CUDA_CHECK(cudaMemcpy(s, h.data(), n*sizeof(float), cudaMemcpyHostToDevice));
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    for (int cold = 0; cold < 2; ++cold) {
        float total = 0.0f;
        for (int r = 0; r < reps; ++r) {
            if (cold) {
                CUDA_CHECK(cudaMemsetAsync(junk, r, junk_bytes)); // evicts the scores from L2
            }
            cudaEventRecord(a);
#ifdef KX_SELECT_BALLOT_WARPS // the grid-wide version: ballots, then the one-block write
            kx_select_launch(s, out, nullptr, masks, n, 1, n*sizeof(float), 0.0f, 0.6f, KX_SELECT_SCORE, nullptr, nullptr, 0);
#else                         // the one-block version (the earlier kernel)
            kx_select_kernel<<<1, KX_SELECT_THREADS>>>(s, out, n, 1, n*sizeof(float), 0.0f, 0.6f, KX_SELECT_SCORE);
#endif
            cudaEventRecord(b);
            CUDA_CHECK(cudaEventSynchronize(b));
            float ms;
            cudaEventElapsedTime(&ms, a, b);
            total += ms;
        }
        std::vector<int32_t> got(n + 1), want; // the list must be the rule's, in order
        CUDA_CHECK(cudaMemcpy(got.data(), out, (n + 1)*sizeof(int32_t), cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < n; ++i) {
            if (h[i] > 0.0f) {
                want.push_back((int32_t) i);
            }
        }
        const int32_t count = got[0];
        if ((size_t) count != want.size() || !std::equal(want.begin(), want.end(), got.begin() + 1)) {
            fprintf(stderr, "wrong list: %d ids, want %zu\n", count, want.size());
            return 1;
        }
        printf("{\"n\": %lld, \"density\": %.4f, \"scores\": \"%s\", \"reps\": %d, \"us_per_launch\": %.2f, \"listed\": %d}\n",
               (long long) n, dens, cold ? "cold" : "warm", reps, 1000.0f*total/reps, count);
    }
    return 0;
}
