// The host op (GGML_OP_KX_FFN_ROWS on the CPU; ReLU, or SiLU with ACT silu) alone on one model's layer shapes: how
// fast it moves its rows against the scattered-read roof of bench/host_pages.c.
//
// LAYERS layers of random Q4_0 gate/up [N_FF rows of K] and Q8_0 transposed down [N_FF rows
// of K] (KB-70B: 28672 x 8192), or all three F16 (TYPES f16; KB-7B: 11008 x 4096), or all three
// Q4_K (TYPES q4k: a Q4_K_M model's gate/up with the pack's Q4_K down rows), or Q5_K gate/up
// with Q8_0 down rows (TYPES q5k: a Q5_K_M model's, with its pack's default), in one buffer of
// 4 KiB or 2 MiB pages; every repetition lists
// LISTED new random neurons per layer (about half fire: random weights) and computes the
// layers' ops as one graph on a thread pool. Bytes read: the listed gate rows and, for the
// neurons that fired, their up and down rows (the op's counters). The op's own counters
// (kx_cpu_ffn_stats) split its span: the slowest and the mean thread's row loops, the rest
// being its fixed cost; its phase counters (kx_cpu_ffn_phases) say where that goes (x
// conversion, the barriers' waits, column sums, the threads' entry spread).
//
//   cc -O2 -march=native bench/host_op.c -I vendor/llama.cpp/ggml/include -I ggml_ext/include
//      -L LIB -lggml-base -lggml-cpu -Wl,-rpath,LIB -o host_op
//   ./host_op PAGES(4k|2M) THREADS [LAYERS LISTED REPS N_FF K TYPES(q4|q4k|q5k|f16) ACT(relu|silu)]  # a JSON line
#define _GNU_SOURCE
#include "ggml.h"
#include "ggml-cpu.h"
#include "kx-ops.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return rng;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// random blocks of a quantized matrix: the leading fp16 scale small and positive (0x1C00 =
// 2^-8), any fp16 after it (Q4_K's dmin: n_scales 2) zero, so the dot products take either
// sign (about half the neurons fire) without overflow
static void fill_blocks(uint8_t * p, size_t n_blocks, size_t block_bytes, size_t n_scales) {
    for (size_t b = 0; b < n_blocks; ++b) {
        uint8_t * q = p + b * block_bytes;
        for (size_t i = 2 * n_scales; i < block_bytes; i += 8) {
            const uint64_t v = next_u64();
            memcpy(q + i, &v, block_bytes - i < 8 ? block_bytes - i : 8);
        }
        memset(q, 0, 2 * n_scales);
        q[1] = 0x1C;
    }
}

// random F16 values of either sign in [2^-3, 2^-2) (exponent fixed: no Inf, no NaN)
static void fill_f16(uint16_t * p, size_t n) {
    for (size_t i = 0; i < n; i += 4) {
        const uint64_t v = next_u64();
        for (size_t j = 0; j < 4 && i + j < n; ++j) {
            p[i + j] = (uint16_t) (((v >> (16*j)) & 0x83FF) | 0x3000);
        }
    }
}

// a weight of `type` (F16, or a quantized type ggml blocks) filled at random
static void fill_weight(struct ggml_tensor * t) {
    if (t->type == GGML_TYPE_F16) {
        fill_f16(t->data, (size_t) ggml_nelements(t));
        return;
    }
    const size_t bb = ggml_type_size(t->type);
    fill_blocks(t->data, ggml_nbytes(t) / bb, bb, t->type == GGML_TYPE_Q4_K || t->type == GGML_TYPE_Q5_K ? 2 : 1);
}

static int cmp_i32(const void * a, const void * b) {
    return *(const int32_t *) a - *(const int32_t *) b;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s 4k|2M THREADS [LAYERS LISTED REPS N_FF K TYPES(q4|q4k|q5k|f16) ACT(relu|silu)]\n",
                argv[0]);
        return 2;
    }
    const int     huge    = strcmp(argv[1], "2M") == 0;
    const int     nth     = atoi(argv[2]);
    const int     layers  = argc > 3 ? atoi(argv[3]) : 8;
    const int     listed  = argc > 4 ? atoi(argv[4]) : 1305;
    const int     reps    = argc > 5 ? atoi(argv[5]) : 20;
    const int64_t n_ff    = argc > 6 ? atoll(argv[6]) : 28672;
    const int64_t k       = argc > 7 ? atoll(argv[7]) : 8192;
    const char *  types   = argc > 8 ? argv[8] : "q4";
    const int     silu    = argc > 9 && strcmp(argv[9], "silu") == 0; // one pass: every listed up and down row
    enum ggml_type tw = GGML_TYPE_Q4_0, td = GGML_TYPE_Q8_0;         // gate and up; transposed down
    if (strcmp(types, "f16") == 0) {
        tw = td = GGML_TYPE_F16;
    } else if (strcmp(types, "q4k") == 0) {
        tw = td = GGML_TYPE_Q4_K;
    } else if (strcmp(types, "q5k") == 0) {
        tw = GGML_TYPE_Q5_K;
    } else if (strcmp(types, "q4") != 0) {
        fprintf(stderr, "TYPES: q4, q4k, q5k or f16, not %s\n", types);
        return 2;
    }

    const size_t w_row = ggml_row_size(tw, k);
    const size_t d_row = ggml_row_size(td, k);
    const size_t weights = (size_t) layers * n_ff * (2 * w_row + d_row);
    const size_t mem = weights + (64u << 20);
    void * buf = mmap(NULL, mem, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    madvise(buf, mem, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);

    struct ggml_init_params ip = { mem, buf, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, 1);
    // zero-sum x: a Q4_K row (dmin 0) has values of one sign, so its dot product with x is
    // then as likely negative as positive, as with the other types
    double x_sum = 0.0;
    for (int64_t i = 0; i < k; ++i) {
        ((float *) x->data)[i] = (float) ((int64_t) (next_u64() % 2001) - 1000) / 1000.0f;
        x_sum += ((float *) x->data)[i];
    }
    for (int64_t i = 0; i < k; ++i) {
        ((float *) x->data)[i] -= (float) (x_sum / (double) k);
    }
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    struct ggml_tensor ** sel = malloc(sizeof(*sel) * layers);
    for (int l = 0; l < layers; ++l) {
        struct ggml_tensor * g = ggml_new_tensor_2d(ctx, tw, k, n_ff);
        struct ggml_tensor * u = ggml_new_tensor_2d(ctx, tw, k, n_ff);
        struct ggml_tensor * d = ggml_new_tensor_2d(ctx, td, k, n_ff);
        fill_weight(g);
        fill_weight(u);
        fill_weight(d);
        sel[l] = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_ff + 1);
        ggml_build_forward_expand(gf, ggml_kx_ffn_rows(ctx, g, u, d, x, sel[l], NULL, NULL, NULL,
                                                    silu ? KX_SELECT_SILU : KX_SELECT_RELU));
    }

    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(nth);
    struct ggml_threadpool * tp = ggml_threadpool_new(&tpp);
    struct ggml_cplan plan = ggml_graph_plan(gf, nth, tp);
    plan.work_data = malloc(plan.work_size ? plan.work_size : 1);

    uint8_t * mark = calloc((size_t) n_ff, 1);
    double best = 1e30, sum = 0.0;
    int64_t listed_all = 0, skipped_all = 0, op_ns = 0, loop_max_ns = 0, loop_mean_ns = 0;
    int64_t phase_ns[KX_FFN_N_PHASES] = { 0 };
    for (int rep = 0; rep <= reps; ++rep) {
        for (int l = 0; l < layers; ++l) {
            int32_t * s = (int32_t *) sel[l]->data;
            memset(mark, 0, (size_t) n_ff);
            s[0] = listed;
            for (int i = 0; i < listed; ++i) {
                int32_t id;
                do { id = (int32_t) (next_u64() % (uint64_t) n_ff); } while (mark[id]);
                mark[id] = 1;
                s[1 + i] = id;
            }
            qsort(s + 1, (size_t) listed, sizeof(int32_t), cmp_i32); // the select op lists in id order
        }
        int64_t up_skipped = 0, op = 0, lmax = 0, lmean = 0;
        kx_cpu_ffn_stats(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, true);
        kx_cpu_ffn_phases(NULL, true);
        const double t0 = now_s();
        if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "compute failed\n");
            return 1;
        }
        const double t = now_s() - t0;
        kx_cpu_ffn_stats(&up_skipped, NULL, &op, &lmax, &lmean, NULL, NULL, NULL, true);
        int64_t ph[KX_FFN_N_PHASES];
        kx_cpu_ffn_phases(ph, true);
        if (rep == 0) {
            continue; // warm-up: page faults of the work buffer, thread start
        }
        best = t < best ? t : best;
        sum += t;
        listed_all += (int64_t) listed * layers;
        skipped_all += up_skipped;
        op_ns += op;
        loop_max_ns += lmax;
        loop_mean_ns += lmean;
        for (int p = 0; p < KX_FFN_N_PHASES; ++p) {
            phase_ns[p] += ph[p];
        }
    }
    const double per_call_us = 1e-3 / ((double) reps * layers); // ns summed over the timed calls -> µs per call
    const double fired = (double) (listed_all - skipped_all) / reps / layers;
    const double bytes = (double) listed * w_row + fired * (w_row + d_row); // per layer
    printf("{\"types\": \"%s\", \"act\": \"%s\", \"pages\": \"%s\", \"threads\": %d, \"layers\": %d, \"listed\": %d, \"fired\": %.1f, \"n_ff\": %lld, "
           "\"k\": %lld, \"mb_per_layer\": %.2f, \"us_per_layer_best\": %.1f, \"us_per_layer_mean\": %.1f, "
           "\"gbs_best\": %.2f, \"gbs_mean\": %.2f, \"op_us\": %.1f, \"loop_max_us\": %.1f, \"loop_mean_us\": %.1f, "
           "\"phases_us\": {\"x\": %.2f, \"wait1\": %.2f, \"a\": %.2f, \"wait2\": %.2f, \"b\": %.2f, \"wait3\": %.2f, "
           "\"sums\": %.2f, \"skew\": %.2f}}\n",
           types, silu ? "silu" : "relu", huge ? "2M" : "4k", nth, layers, listed, fired, (long long) n_ff, (long long) k, bytes / 1e6,
           best / layers * 1e6, sum / reps / layers * 1e6, bytes * layers / best / 1e9, bytes * layers * reps / sum / 1e9,
           op_ns * per_call_us, loop_max_ns * per_call_us, loop_mean_ns * per_call_us,
           phase_ns[KX_FFN_PH_X] * per_call_us, phase_ns[KX_FFN_PH_WAIT1] * per_call_us, phase_ns[KX_FFN_PH_A] * per_call_us,
           phase_ns[KX_FFN_PH_WAIT2] * per_call_us, phase_ns[KX_FFN_PH_B] * per_call_us,
           phase_ns[KX_FFN_PH_WAIT3] * per_call_us, phase_ns[KX_FFN_PH_SUMS] * per_call_us,
           phase_ns[KX_FFN_PH_SKEW] * per_call_us);
    ggml_threadpool_free(tp);
    ggml_free(ctx);
    munmap(buf, mem);
    return 0;
}
