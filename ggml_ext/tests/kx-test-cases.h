// test-backend-ops cases for the kairox ops: each backend (CUDA) against the CPU backend's
// reference path. Included by tests/test-backend-ops.cpp (patches/0007) after test_case,
// registered from make_test_cases_eval(); select with -o KX_SELECT, KX_MUL_MAT_ROWS, KX_AXPY_ROWS.
#pragma once

#include "kx-ops.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

// A random active list (ascending, `density` of n) in the I32 [n + 1] layout of kx_select.
static void kx_init_sel(ggml_tensor * t, int64_t n, double density, std::mt19937 & rng) {
    std::vector<int32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const int64_t count = std::min<int64_t>(n, (int64_t) (density*n));
    std::sort(ids.begin(), ids.begin() + count);
    std::vector<int32_t> data(n + 1, 0);
    data[0] = (int32_t) count;
    std::copy(ids.begin(), ids.begin() + count, data.begin() + 1);
    ggml_backend_tensor_set(t, data.data(), 0, data.size()*sizeof(int32_t));
}

// A GPU-slot row map: n_rows random neurons in random rows, the other neurons -1.
static void kx_init_rowmap(ggml_tensor * t, int64_t n, int64_t n_rows, std::mt19937 & rng) {
    std::vector<int32_t> neurons(n);
    std::iota(neurons.begin(), neurons.end(), 0);
    std::shuffle(neurons.begin(), neurons.end(), rng);
    std::vector<int32_t> map(n, -1);
    for (int64_t r = 0; r < n_rows; ++r) {
        map[neurons[r]] = (int32_t) r;
    }
    ggml_backend_tensor_set(t, map.data(), 0, map.size()*sizeof(int32_t));
}

// GGML_OP_KX_SELECT: the list must be identical (count, then the ascending ids); entries
// past the count are unspecified and not compared.
struct test_kx_select : public test_case {
    const int64_t n, nt;
    const float thr, max_density;
    const int32_t act;
    const bool split; // ggml_kx_select_split: 40% of neurons resident, offsets -1/4 and +3/8
    ggml_tensor * map = nullptr;
    ggml_tensor * off = nullptr;

    std::string vars() override { return VARS_TO_STR6(n, nt, thr, max_density, act, split); }

    test_kx_select(int64_t n, int64_t nt, float thr, float max_density, int32_t act, bool split = false)
        : n(n), nt(nt), thr(thr), max_density(max_density), act(act), split(split) {}

    ggml_tensor * build_graph(ggml_context * ctx) override {
        ggml_tensor * s = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, nt);
        ggml_set_name(s, "scores");
        ggml_tensor * out;
        if (split) {
            map = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
            off = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 2);
            out = ggml_kx_select_split(ctx, s, thr, max_density, map, off);
        } else {
            out = ggml_kx_select(ctx, s, thr, max_density, (enum kx_select_act) act);
        }
        ggml_set_name(out, "out");
        return out;
    }

    // scores on a grid of 1/64 offset by 1/128: none lies within float rounding of a
    // threshold, so CPU and CUDA activation functions (expf, tanhf) decide alike
    void initialize_tensors(ggml_context * ctx) override {
        std::mt19937 rng(99);
        std::uniform_int_distribution<int> u(-128, 127);
        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
            if (t == map) {
                kx_init_rowmap(t, n, n * 2 / 5, rng);
                continue;
            }
            if (t == off) { // multiples of 1/64 too: the thresholds stay 1/128 from every score
                const float o[2] = { -0.25f, 0.375f };
                ggml_backend_tensor_set(t, o, 0, sizeof(o));
                continue;
            }
            std::vector<float> v(ggml_nelements(t));
            for (float & x : v) {
                x = (float) u(rng)/64.0f + 1.0f/128.0f;
            }
            ggml_backend_tensor_set(t, v.data(), 0, v.size()*sizeof(float));
        }
    }

    double max_err() override { return 0.0; }

    double err(const float * a, const float * b, size_t len) override {
        if (len != (size_t) n + 1) {
            return test_case::err(a, b, len); // the sentinel tensors around the node
        }
        if (a[0] != b[0]) {
            return 1.0;
        }
        for (int64_t j = 1; j <= (int64_t) a[0]; ++j) {
            if (a[j] != b[j]) {
                return 1.0;
            }
        }
        return 0.0;
    }
};

// The row ops' common inputs: an active list of `density` of n neurons, and a row map when
// the weight holds fewer rows than neurons (a slot buffer); other inputs uniform unless
// init_other() fills them.
struct test_kx_rows : public test_case {
    const ggml_type type;
    const int64_t width, n, nt, n_rows; // width: k (gather) or m (axpy)
    const double density;
    const uint32_t seed;
    ggml_tensor * sel = nullptr;
    ggml_tensor * map = nullptr;

    test_kx_rows(ggml_type type, int64_t width, int64_t n, int64_t nt, int64_t n_rows, double density, uint32_t seed)
        : type(type), width(width), n(n), nt(nt), n_rows(n_rows), density(density), seed(seed) {}

    std::string vars() override { return VARS_TO_STR6(type, width, n, nt, n_rows, density); }

    // the weight [width, n_rows] plus sel and the row map (when rows < n)
    ggml_tensor * new_inputs(ggml_context * ctx) {
        sel = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n + 1);
        map = n_rows < n ? ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n) : nullptr;
        return ggml_new_tensor_2d(ctx, type, width, n_rows);
    }

    virtual bool init_other(ggml_tensor * t, std::mt19937 & rng) { (void) t; (void) rng; return false; }

    void initialize_tensors(ggml_context * ctx) override {
        std::mt19937 rng(seed);
        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
            if (t == sel) {
                kx_init_sel(t, n, density, rng);
            } else if (t == map) {
                kx_init_rowmap(t, n, n_rows, rng);
            } else if (!init_other(t, rng)) {
                init_tensor_uniform(t);
            }
        }
    }
};

// GGML_OP_KX_MUL_MAT_ROWS over a whole weight (rows = n) or a slot buffer (rows < n, map);
// unlisted: no list at all (every row, the predictor's plain matvec); bias: that matvec plus
// a bias (ggml_kx_mul_mat_rows_bias, the predictor's B·t + c).
struct test_kx_mul_mat_rows : public test_kx_rows {
    bool gated, listed, bias;
    test_kx_mul_mat_rows(ggml_type type, int64_t k, int64_t n, int64_t nt, int64_t n_rows, double density,
                         bool gated = false, bool listed = true, bool bias = false)
        : test_kx_rows(type, k, n, nt, n_rows, density, 1234), gated(gated), listed(listed), bias(bias) {}

    std::string vars() override {
        return test_kx_rows::vars() + ",gated=" + (gated ? "1" : "0") + ",listed=" + (listed ? "1" : "0") +
               ",bias=" + (bias ? "1" : "0");
    }

    ggml_tensor * build_graph(ggml_context * ctx) override {
        ggml_tensor * w = new_inputs(ctx);
        ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, width, nt);
        ggml_tensor * out;
        if (bias) {
            out = ggml_kx_mul_mat_rows_bias(ctx, w, x, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_rows));
        } else if (gated) {
            // gate values of either sign: the gated rows must read 0 on both backends
            ggml_tensor * g = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, nt);
            out = ggml_kx_mul_mat_rows_gated(ctx, w, x, listed ? sel : nullptr, map, g);
        } else {
            out = ggml_kx_mul_mat_rows(ctx, w, x, listed ? sel : nullptr, map);
        }
        ggml_set_name(out, "out");
        return out;
    }

    // the reference dots dequantized rows with float x; CUDA does the same in float
    double max_nmse_err() override { return type == GGML_TYPE_F32 ? 1e-6 : 5e-4; }
};

// GGML_OP_KX_AXPY_ROWS, with some activations exactly 0 (skipped) as after ReLU.
struct test_kx_axpy_rows : public test_kx_rows {
    ggml_tensor * h = nullptr;

    test_kx_axpy_rows(ggml_type type, int64_t m, int64_t n, int64_t nt, int64_t n_rows, double density)
        : test_kx_rows(type, m, n, nt, n_rows, density, 4321) {}

    ggml_tensor * build_graph(ggml_context * ctx) override {
        ggml_tensor * wt = new_inputs(ctx);
        h = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, nt);
        ggml_tensor * out = ggml_kx_axpy_rows(ctx, wt, h, sel, map);
        ggml_set_name(out, "out");
        return out;
    }

    bool init_other(ggml_tensor * t, std::mt19937 & rng) override {
        if (t != h) {
            return false;
        }
        std::vector<float> v(ggml_nelements(t));
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (float & x : v) {
            x = u(rng);
            x = x < -0.5f ? 0.0f : x; // a quarter exactly zero
        }
        ggml_backend_tensor_set(t, v.data(), 0, v.size()*sizeof(float));
        return true;
    }

    double max_nmse_err() override { return 1e-6; }
};

// Three matvecs that read one x (attention's Q, K and V), of mixed weight types, summed: on
// CUDA the first quantizes x to q8_1 and the other two reuse that copy (patch 0020); the sum
// must match the CPU's. Select with -o MUL_MAT_SHARED_X (a case name, not an op: no such op exists).
struct test_kx_q8_1_reuse : public test_case {
    const ggml_type t0, t1, t2;
    const int64_t k, n, nt;

    test_kx_q8_1_reuse(ggml_type t0, ggml_type t1, ggml_type t2, int64_t k, int64_t n, int64_t nt)
        : t0(t0), t1(t1), t2(t2), k(k), n(n), nt(nt) {}

    std::string op_desc(ggml_tensor * t) override { (void) t; return "MUL_MAT_SHARED_X"; }
    std::string vars() override { return VARS_TO_STR6(t0, t1, t2, k, n, nt); }

    ggml_tensor * build_graph(ggml_context * ctx) override {
        ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, nt);
        ggml_tensor * y = nullptr;
        for (ggml_type t : {t0, t1, t2}) {
            ggml_tensor * yi = ggml_mul_mat(ctx, ggml_new_tensor_2d(ctx, t, k, n), x);
            y = y ? ggml_add(ctx, y, yi) : yi;
        }
        ggml_set_name(y, "out");
        return y;
    }

    double max_nmse_err() override { return 5e-4; }
};

static void kx_add_test_cases(std::vector<std::unique_ptr<test_case>> & test_cases) {
    // one q8_1 copy of x for three matvecs: the decode (1 token) and a small batch
    for (int64_t nt : {1, 3}) {
        test_cases.emplace_back(new test_kx_q8_1_reuse(GGML_TYPE_Q4_K, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, 4096, 1024, nt));
        test_cases.emplace_back(new test_kx_q8_1_reuse(GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q5_K, 512, 300, nt));
    }
    // select: every activation rule, batches, the density fallback (0.6 of n active or more)
    // CUDA: 33 is two ballots, 1000 has a partial last one, 140001 gives the write kernel's
    // warps several groups of 32 ballots each
    for (int64_t n : {33, 1000, 11008, 28672, 140001}) {
        for (int64_t nt : {1, 3}) {
            test_cases.emplace_back(new test_kx_select(n, nt, 0.5f, 0.6f, KX_SELECT_SCORE));
            test_cases.emplace_back(new test_kx_select(n, nt, 0.3f, 0.6f, KX_SELECT_RELU));
            test_cases.emplace_back(new test_kx_select(n, nt, 0.1f, 1.0f, KX_SELECT_SILU));
            test_cases.emplace_back(new test_kx_select(n, nt, 0.1f, 1.0f, KX_SELECT_GELU));
            test_cases.emplace_back(new test_kx_select(n, nt, -0.9f, 0.6f, KX_SELECT_SCORE)); // falls back
            test_cases.emplace_back(new test_kx_select(n, nt, 0.5f, 0.6f, KX_SELECT_SCORE, true));
        }
    }
    // row gathers: LLaMA-7B-like and small odd shapes, whole weights and slot buffers
    for (ggml_type type : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}) {
        for (int64_t nt : {1, 4, 8}) {
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, nt, 1000, 0.11));
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, nt, 300, 0.5));
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 11008, nt, 11008, 0.11));
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 11008, nt, 2752, 0.11));
        }
        // quantized rows: staged chunks with a tail (8448 = 33 x 256), and rows whose length is
        // not a multiple of 16 bytes (96: one block per lane, unstaged)
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 8448, 1000, 2, 300, 0.5));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 96, 1000, 3, 1000, 0.3));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, 1, 300, 0.5, true));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, 3, 1000, 0.3, true));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, 1, 1000, 0.0));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, 2, 1000, 1.0));
        // no list: every row (the predictor's B, 256 wide), ungated and gated, and a map
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 11008, 1, 11008, 1.0, false, false));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 11008, 4, 11008, 1.0, false, false));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 1000, 2, 1000, 1.0, true, false));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, 1, 300, 1.0, false, false));
        // no list over short rows (F32/F16 512 B - 2 KiB: several rows a warp), n not a multiple
        // of the rows a warp takes
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 512, 28673, 1, 28673, 1.0, false, false));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 128, 1001, 3, 1001, 1.0, false, false));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 1024, 999, 8, 999, 1.0, false, false));
        // the plain matvec plus a bias: short rows (the predictor's B), and rows the general
        // kernel takes
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 11008, 1, 11008, 1.0, false, false, true));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 512, 1001, 3, 1001, 1.0, false, false, true));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 1000, 1, 1000, 1.0, false, false, true));
    }
    // K-quant rows (super-blocks of 256): LLaMA-7B and -13B widths, a row whose super-blocks
    // end inside a batch of loads (8448 = 33), Q6_K rows that are not whole 16-byte units
    // (8448, 5120), gated, and the plain matvec
    for (ggml_type type : {GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K}) {
        for (int64_t nt : {1, 4, 8}) {
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, nt, 300, 0.5));
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 11008, nt, 11008, 0.11));
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 11008, nt, 2752, 0.11));
            test_cases.emplace_back(new test_kx_mul_mat_rows(type, 5120, 13824, nt, 3000, 0.11));
        }
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 8448, 1000, 2, 300, 0.5));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 1000, 1, 300, 0.5, true));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 1000, 3, 1000, 0.3, true));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 256, 1000, 1, 1000, 0.0));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 512, 1000, 2, 1000, 1.0));
        test_cases.emplace_back(new test_kx_mul_mat_rows(type, 4096, 1000, 2, 1000, 1.0, false, false));
    }
    for (ggml_type type : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0}) {
        for (int64_t nt : {1, 4, 8}) {
            test_cases.emplace_back(new test_kx_axpy_rows(type, 256, 1000, nt, 1000, 0.11));
            test_cases.emplace_back(new test_kx_axpy_rows(type, 320, 1000, nt, 300, 0.5));
            test_cases.emplace_back(new test_kx_axpy_rows(type, 4096, 11008, nt, 11008, 0.11));
            test_cases.emplace_back(new test_kx_axpy_rows(type, 4096, 11008, nt, 2752, 0.11));
        }
        test_cases.emplace_back(new test_kx_axpy_rows(type, 256, 1000, 1, 1000, 0.0));
        test_cases.emplace_back(new test_kx_axpy_rows(type, 256, 1000, 2, 1000, 1.0));
        if (type != GGML_TYPE_Q8_0) { // widths not a multiple of 4: a column per thread
            test_cases.emplace_back(new test_kx_axpy_rows(type, 322, 1000, 1, 300, 0.5));
            test_cases.emplace_back(new test_kx_axpy_rows(type, 322, 1000, 3, 1000, 0.11));
        }
    }
    // K-quant down rows (a pack's --down-type q4_k / q6_k): whole super-blocks, LLaMA-7B and
    // -13B widths, a tile (256 columns) per super-block
    for (ggml_type type : {GGML_TYPE_Q4_K, GGML_TYPE_Q6_K}) {
        for (int64_t nt : {1, 4, 8}) {
            test_cases.emplace_back(new test_kx_axpy_rows(type, 256, 1000, nt, 1000, 0.11));
            test_cases.emplace_back(new test_kx_axpy_rows(type, 4096, 11008, nt, 2752, 0.11));
            test_cases.emplace_back(new test_kx_axpy_rows(type, 5120, 13824, nt, 3000, 0.11));
        }
        test_cases.emplace_back(new test_kx_axpy_rows(type, 512, 1000, 1, 1000, 0.0));
        test_cases.emplace_back(new test_kx_axpy_rows(type, 512, 1000, 2, 1000, 1.0));
    }
}
