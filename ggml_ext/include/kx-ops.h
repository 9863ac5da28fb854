// kairox ggml ops: the neuron-sparse FFN building blocks.
//
// A sparse FFN step for a batch of tokens x [n_embd, n_tokens]:
//   sel = ggml_kx_select(scores)                 active neuron ids (union over tokens)
//   g   = ggml_kx_mul_mat_rows(W_gate, x, sel)   only the listed rows, 0 elsewhere
//   u   = ggml_kx_mul_mat_rows(W_up,   x, sel)
//   h   = act(g) * u                             any stock GLU op (zeros stay zeros)
//   y   = ggml_kx_axpy_rows(W_down^T, h, sel)    sum of h_i * (row i of W_down^T)
//
// The active list lives in a tensor (I32 [n + 1]: count, then ids), never in op params,
// so one graph serves every token and can be reused or captured.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

// How ggml_kx_select decides that a score makes a neuron active (op param 2).
enum kx_select_act {
    KX_SELECT_SCORE = 0, // score > threshold            (predictor output)
    KX_SELECT_RELU  = 1, // |relu(score)| > threshold    (exact mode, gate pre-activation)
    KX_SELECT_SILU  = 2, // |silu(score)| > threshold
    KX_SELECT_GELU  = 3, // |gelu(score)| > threshold
};

// CUDA kernels share the inline helpers below (one definition for every backend)
#if defined(__CUDACC__)
#define KX_HOST_DEVICE __host__ __device__
#else
#define KX_HOST_DEVICE
#endif

// The activation value whose magnitude the rules above compare (KX_SELECT_SCORE: the raw
// score). GELU uses the tanh form, as ggml_gelu: only the decision depends on it. Shared
// by the select kernels (CPU, CUDA) and the activation profiler, so calibration and
// inference agree.
static inline KX_HOST_DEVICE float kx_act_value(float v, int32_t act) {
    switch (act) {
        case KX_SELECT_RELU: return v > 0.0f ? v : 0.0f;
        case KX_SELECT_SILU: return v / (1.0f + expf(-v));
        case KX_SELECT_GELU: {
            const float c = 0.7978845608028654f; // sqrt(2/pi)
            return 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
        }
        default: return v;
    }
}

// scores: F32 [n, n_tokens], contiguous rows.
// Result: I32 [n + 1]; [0] = count, [1 .. count] = ascending ids active in at least one
// token. When count > max_density * n the result lists all n ids (the layer then costs
// what a dense layer costs, and stays exact); max_density >= 1 disables that.
GGML_API struct ggml_tensor * ggml_kx_select(
        struct ggml_context * ctx,
        struct ggml_tensor  * scores,
        float                 threshold,
        float                 max_density,
        enum kx_select_act    act);

// ggml_kx_select whose list is also written to host memory the device can write (page-locked
// and mapped, e.g. a device's host buffer type; plain memory on the CPU backend), as
// host[1 .. count + 1] = the result, then host[0] = 1, the last store: a reader that sees
// host[0] == 1 sees the whole list, and resets host[0] to 0 once it is used. (The host-cache
// warm-up, kx-warm.cpp, reads layer il+1's list predicted during layer il this way, without a
// scheduler copy that would wait for the device.) host: I32 [n + 2], 16-byte aligned.
GGML_API struct ggml_tensor * ggml_kx_select_to_host(
        struct ggml_context * ctx,
        struct ggml_tensor  * scores,
        float                 threshold,
        float                 max_density,
        enum kx_select_act    act,
        int32_t             * host);

// ggml_kx_select with two thresholds, one per side of a hybrid layer (the load-aware
// thresholds, kx-thresholds.h): neuron i passes when its score > threshold + off[0] if
// rowmap[i] >= 0 (resident in the device's slots) and > threshold + off[1] otherwise.
// rowmap: I32 [n] (the slot map); off: F32 [2], a tensor so that the offsets change between
// decodes without rebuilding the graph. off = {0, 0} gives ggml_kx_select's list exactly.
// KX_SELECT_SCORE only (the predictor's scores).
GGML_API struct ggml_tensor * ggml_kx_select_split(
        struct ggml_context * ctx,
        struct ggml_tensor  * scores,
        float                 threshold,
        float                 max_density,
        struct ggml_tensor  * rowmap,
        struct ggml_tensor  * off);

// The host copy of ggml_kx_select_to_host for any select node (ggml_kx_select_split's too);
// returns sel.
GGML_API struct ggml_tensor * ggml_kx_select_set_host(struct ggml_tensor * sel, int32_t * host);

// the host copy of a select node (NULL: none); the byte offset of the pointer in op params
#define KX_SELECT_HOST_PARAM 16
static inline int32_t * kx_select_host(const struct ggml_tensor * sel) {
    int32_t * p;
    memcpy(&p, (const char *) sel->op_params + KX_SELECT_HOST_PARAM, sizeof(p));
    return p;
}

// Row maps (rowmap, I32 [n] or NULL): neuron i lives in row rowmap[i] of the weight, or
// nowhere in it when rowmap[i] < 0. A GPU slot buffer holds some neurons' rows in any
// order (its map sends the others to -1); the host copy of a hybrid layer maps the
// GPU-resident neurons to -1, so each side computes only its own neurons of one list.

// w: [k, n_rows] of any type with a CPU vec_dot (F32, F16, BF16, Q4_0, Q8_0, K-quants, ...);
// x: F32 [k, n_tokens]; sel: I32 [n + 1] from ggml_kx_select, or NULL for every neuron;
// rowmap: NULL (neuron i is row i, n = n_rows) or I32 [n].
// Result: F32 [n, n_tokens]; rows listed in sel (and present in w) hold w·x, all other
// rows are 0. Without sel and rowmap it is a plain matvec; the CUDA kernel gives each row
// one warp, which on short rows (the predictor's 256-wide B) beats ggml's one block per row.
GGML_API struct ggml_tensor * ggml_kx_mul_mat_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap);

// The plain matvec plus a bias: w·x + b for every row (no list, no map); b: F32 [n_rows],
// added to every token's column. The predictor's B·(A·x) + c in one op: its add was a kernel
// of its own on the decode's critical path.
GGML_API struct ggml_tensor * ggml_kx_mul_mat_rows_bias(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * b);

// The up projection of a ReLU GLU and the GLU itself: gate F32 [n, n_tokens] holds the gate
// values of the same neurons (0 where unlisted); the result is relu(g) * u, what ggml_reglu
// gives after the ungated op (g > 0 ? g*u : 0, so the same bits). A listed row whose gate is
// <= 0 for every token is not read: relu(g) * u is 0 there whatever u is.
GGML_API struct ggml_tensor * ggml_kx_mul_mat_rows_gated(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap,
        struct ggml_tensor  * gate);

// Whether the axpy kernels read transposed down rows of this type and m columns: F32, F16,
// and whole blocks of Q8_0 (m % 32 == 0), Q4_K or Q6_K (m % 256 == 0).
GGML_API bool kx_down_type_ok(enum ggml_type type, int64_t m);

// wt: [m, n_rows] of a type kx_down_type_ok takes: one contiguous row of m outputs per neuron;
// h: F32 [n, n_tokens]; sel: I32 [n + 1]; rowmap: NULL (neuron i is row i) or I32 [n].
// Result: F32 [m, n_tokens], column t = sum over i in sel (present in wt) of
// h[i, t] * wt[row(i)].
GGML_API struct ggml_tensor * ggml_kx_axpy_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * wt,
        struct ggml_tensor  * h,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap);

// The three steps above fused for the CPU (no CUDA kernel: the GPU keeps the separate ops):
// y = sum over i in sel with rowmap[i] >= 0 of act(g_i) * (up[rowmap[i]] . x) * down_t[downmap[i]],
// g_i = gate[rowmap[i]] . x, or gate_pre[i] when given (F32 [n, n_tokens]: the exact path
// computed every gate). gate, up: [k, n_rows] of one type with a CPU vec_dot; down_t: as
// ggml_kx_axpy_rows's wt; rowmap/downmap: NULL (neuron i is row i) or I32 [n]; act:
// KX_SELECT_RELU, _SILU or _GELU (the GLU of the dense path). Result: F32 [m, n_tokens].
GGML_API struct ggml_tensor * ggml_kx_ffn_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * gate,
        struct ggml_tensor  * up,
        struct ggml_tensor  * down_t,
        struct ggml_tensor  * x,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap,
        struct ggml_tensor  * downmap,
        struct ggml_tensor  * gate_pre,
        enum kx_select_act    act);

// Each thread of a ggml_kx_ffn_rows node starts on its own even share of the listed rows (not
// on chunks taken by whichever thread is free), and only when its share is done takes the last
// chunks of others' (kx-ffn-rows.c): when a node before it read those rows ahead on the same
// split (kx-warm.cpp), they are in the L2 of the core that reads them. (Reading lines another
// core just pulled in ran slower than DRAM: KB-7B on the H200 host, 16 threads, slowest loop
// 117-126 µs against 110-113 µs without the warm-up, and 82 µs with own shares.)
GGML_API void ggml_kx_ffn_rows_own_shares(struct ggml_tensor * ffn_rows);

// The node also writes its list (count, then the ids) into dst, an I32 tensor in host memory at
// least as long as the list (the balancer's view of the decode, kx_slot_layer::seen): each thread
// copies the slice of the list it scans anyway, so no copy node (and its barrier) is needed.
GGML_API void ggml_kx_ffn_rows_copy_list(struct ggml_tensor * ffn_rows, struct ggml_tensor * dst);

// Rows the CPU kernels were asked to compute, summed over ggml_kx_select calls since the
// last reset: `selected` ids listed (after the density fallback), `total` ids possible,
// `calls` selections, `fallbacks` selections that went dense. Any pointer may be NULL.
GGML_BACKEND_API void kx_cpu_select_stats(int64_t * selected, int64_t * total, int64_t * calls,
                                          int64_t * fallbacks, bool reset);

// Nonzero activations the CPU kernels of ggml_kx_axpy_rows and ggml_kx_ffn_rows met among the listed rows,
// summed over (row, token) pairs since the last reset. For ReLU models this counts the
// truly active neurons that were computed: exact mode gives the true active count,
// predicted mode the correctly predicted ones (recall = predicted / exact, same tokens).
// `rows` counts the listed rows the kernel computed (per call, not per token), `elsewhere`
// the listed rows it skipped because the row map sends them to -1 (the other side of a
// hybrid layer has them). Any pointer may be NULL.
GGML_BACKEND_API void kx_cpu_axpy_stats(int64_t * nonzero, int64_t * rows, int64_t * elsewhere, bool reset);

// ggml_kx_ffn_rows since the last reset: up_skipped, listed rows of ReLU layers whose up row
// it did not read (gate <= 0 for every token: the neuron adds exactly 0; once per row and
// call); calls; op_ns, the time thread 0 spent in the op (entry to exit, ns summed over calls);
// work_max_ns / work_mean_ns, the slowest / the mean thread's neuron loop per call (summed):
// op - work_max is the op's fixed cost (x conversion, barriers, column sums), work_max -
// work_mean the threads' imbalance; rows_max / rows_mean, the weight rows (gate, up, down)
// read by the busiest / the mean thread per call (summed), the imbalance the split leaves;
// stolen, the chunks a thread took from another's share (own shares only, kx-ffn-rows.c).
// Any pointer may be NULL.
GGML_BACKEND_API void kx_cpu_ffn_stats(int64_t * up_skipped, int64_t * calls, int64_t * op_ns,
                                       int64_t * work_max_ns, int64_t * work_mean_ns,
                                       int64_t * rows_max, int64_t * rows_mean, int64_t * stolen,
                                       bool reset);

// Where the fused FFN op's time goes (kx-ffn-rows.c), ns summed over calls, each phase the mean
// thread's: converting x and counting its slice of the list, waiting at the first barrier,
// pass a (the gates; one pass: the whole loop), waiting at the second barrier, pass b (the
// up and down rows of the neurons that fired; one pass: 0), waiting at the last barrier
// (from the threads' arrival times), then thread 0's column sums to the op's end, and the
// spread of the threads' entry times. out: KX_FFN_N_PHASES values (may be NULL, to reset only).
enum kx_ffn_phase {
    KX_FFN_PH_X, KX_FFN_PH_WAIT1, KX_FFN_PH_A, KX_FFN_PH_WAIT2, KX_FFN_PH_B, KX_FFN_PH_WAIT3,
    KX_FFN_PH_SUMS, KX_FFN_PH_SKEW, KX_FFN_N_PHASES,
};
GGML_BACKEND_API void kx_cpu_ffn_phases(int64_t * out, bool reset);

#ifdef __cplusplus
}
#endif
