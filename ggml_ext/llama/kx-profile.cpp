// Matrix-vector throughput of one weight type on one backend: the measured costs the
// placement solver (python/kairox/plan.py) divides bytes by.
//
// Decode reads every weight once per token, so a matvec's time over its weight bytes is the
// rate that matters. Memory bandwidth alone misjudges it: on the CPU a Q4_0 matvec spends
// more time unpacking nibbles per byte than an F16 one, so its effective rate falls below
// the streaming read; on the GPU small matrices are launch-bound. The matrix here is made
// big enough (n_bytes) that caches do not hold it, and the input is one token (n = 1).
#include "kairox.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <vector>

// a row of deterministic pseudo-random values in [-1, 1): weights only need realistic
// magnitudes (no NaN or inf scales after quantization), not statistics
static void kx_profile_fill(float * dst, int64_t n, uint64_t & state) {
    for (int64_t i = 0; i < n; ++i) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        dst[i] = (float) ((state >> 40) & 0xFFFFFF) / (float) (1 << 23) - 1.0f;
    }
}

// the weight types ggml_quantize_chunk writes without an importance matrix
static bool kx_profile_type_ok(int32_t type) {
    switch (type) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
            return true;
        default:
            return false;
    }
}

int32_t kx_profile_matvec(int32_t type, int64_t n_bytes, int64_t n_cols, int32_t on_gpu, int32_t n_threads,
                          int32_t n_reps, double * seconds, int64_t * bytes_read) {
    if (!kx_profile_type_ok(type)) {
        return 1;
    }
    if (n_cols <= 0 || n_cols % ggml_blck_size((ggml_type) type) != 0 || n_bytes <= 0 || n_reps <= 0 || !seconds) {
        return 1;
    }
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(on_gpu ? GGML_BACKEND_DEVICE_TYPE_GPU
                                                             : GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) {
        return 2;  // no such device in this build or on this machine
    }
    const size_t row_size = ggml_row_size((ggml_type) type, n_cols);
    const int64_t n_rows = std::max<int64_t>(1, n_bytes / (int64_t) row_size);

    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    if (!backend) {
        return 2;
    }
    if (!on_gpu && n_threads > 0) {
        auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
        if (set_threads) {
            set_threads(backend, n_threads);
        }
    }
    ggml_init_params ip = { 4 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, (ggml_type) type, n_cols, n_rows);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_cols, 1);
    ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    int32_t rc = 0;
    if (!buf) {
        rc = 3;  // the matrix does not fit on this device
    } else {
        // one block of rows quantized once and written at every offset: contents do not
        // change a matvec's speed, and quantizing 1 GiB would take longer than measuring it
        uint64_t state = 0x6b78u;
        const int64_t blk = std::min(n_rows, std::max<int64_t>(1, (4 << 20) / n_cols));
        std::vector<float> src((size_t) (blk * n_cols));
        std::vector<uint8_t> q((size_t) (blk * row_size));
        kx_profile_fill(src.data(), blk * n_cols, state);
        ggml_quantize_chunk((ggml_type) type, src.data(), q.data(), 0, blk, n_cols, nullptr);
        for (int64_t r0 = 0; r0 < n_rows; r0 += blk) {
            const int64_t nr = std::min(blk, n_rows - r0);
            ggml_backend_tensor_set(w, q.data(), (size_t) r0 * row_size, (size_t) nr * row_size);
        }
        kx_profile_fill(src.data(), n_cols, state);
        ggml_backend_tensor_set(x, src.data(), 0, ggml_nbytes(x));
        // one warm-up (first-touch, kernel selection), then the best of n_reps; compute
        // returns after the backend has finished (synchronous for every backend)
        double best = 1e30;
        for (int32_t i = 0; i <= n_reps && rc == 0; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
                rc = 4;
            }
            ggml_backend_synchronize(backend);
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (i > 0) {
                best = std::min(best, dt);
            }
        }
        *seconds = best;
        if (bytes_read) {
            *bytes_read = (int64_t) ggml_nbytes(w);
        }
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    ggml_backend_free(backend);
    return rc;
}
