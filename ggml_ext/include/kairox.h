// kairox runtime API, exported by the patched libllama. Plain C, new functions only: no
// struct or enum that llama-cpp-python mirrors is changed (see docs/ARCHITECTURE.md).
#pragma once

#include "llama.h"
#include "kx-tam.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kx_sparse_mode {
    KX_SPARSE_DENSE     = 0, // the model's own FFN (pack ignored)
    KX_SPARSE_EXACT     = 1, // gate for all neurons; up/down only where the activation fires
                             // (|act| > 0: equal to dense; a gated model's FFN, where every
                             // neuron fires, runs dense)
    KX_SPARSE_PREDICTED = 2, // the pack's predictor picks the neurons; gate/up/down on those
    KX_SPARSE_THRESHOLD = 3, // gate for all neurons; up/down where |act| > the pack's per-layer
                             // threshold (an approximation on gated models; exact on ReLU)
};

// Reads and validates the sparse pack at pack_path (docs/pack-format.md) against the model
// loaded from model_path, and attaches it to the model (replacing any earlier pack).
// Returns 0 on success. On failure returns nonzero, writes one sentence to err (if
// err_size > 0) and leaves the model without a pack: it keeps running dense.
LLAMA_API int32_t kx_model_load_pack(struct llama_model * model, const char * model_path,
                                     const char * pack_path, char * err, size_t err_size);

// 1 if a pack is attached, and whether it carries a predictor for every layer
LLAMA_API bool kx_model_has_pack(const struct llama_model * model);
LLAMA_API bool kx_model_pack_has_predictor(const struct llama_model * model);
// the FFN activation the attached pack records ("relu", "silu", "gelu"), NULL without a pack.
// Exact mode reproduces dense only for relu: elsewhere it skips the activations at or below
// the pack's threshold, and the tools say so.
LLAMA_API const char * kx_model_pack_activation(const struct llama_model * model);

// Selects how this context computes FFNs from its next decode on (graphs built for
// another mode are not reused). Returns 0, or nonzero with err filled when the mode needs
// a pack (or a predictor) the model lacks; the mode is then left unchanged.
LLAMA_API int32_t kx_context_set_sparse(struct llama_context * ctx, int32_t mode,
                                        char * err, size_t err_size);
LLAMA_API int32_t kx_context_get_sparse(const struct llama_context * ctx);

// Neuron slots (hybrid FFN): n_slots[il] neurons of layer il, the most frequently active by
// the pack's statistics, are copied to `device` (NULL: the first GPU; "CPU" keeps them in
// host memory, which exercises the same split on machines without a GPU) and computed
// there; the layer's other neurons are computed by the CPU from the host weights, both
// parts of one active list at the same time. The FFN weights must be in plain host
// memory (FFN tensors overridden to the CPU, no repacking). n_layer = 0 removes the slots.
// Call before the contexts that should use them decode (set the sparse mode after it).
// Returns 0, or nonzero with err filled (the model then has no slots and runs as before).
LLAMA_API int32_t kx_model_set_slots(struct llama_model * model, const int64_t * n_slots, int32_t n_layer,
                                     const char * device, char * err, size_t err_size);
// name of the ggml device holding the slots (NULL without slots)
LLAMA_API const char * kx_model_slots_device(const struct llama_model * model);
// device bytes the slots hold (0 without slots)
LLAMA_API int64_t kx_model_slots_bytes(const struct llama_model * model);
// neuron ids resident in layer il's slots, in slot order: copies up to capacity into dst
// and returns how many there are (0 without slots, -1 for a bad layer)
LLAMA_API int64_t kx_model_slots_resident(const struct llama_model * model, int32_t il, int32_t * dst,
                                          int64_t capacity);

// The slots' device also computes a share of every hybrid layer's host-side neurons, reading
// their rows from the page-locked host weights over PCIe (mapped, no copy) while the CPU
// computes the others: the device idles while the CPU streams its part, and PCIe adds its
// bandwidth to the CPU's. share in [0, 1): the fraction of the host side's summed activation
// frequency the device takes, hottest neurons first (0: none, the default). Waits for ctx's
// decode and refreshes its graphs; other contexts of the model must set their sparse mode
// again. Starting the balancer gives the share back to the CPU. 0, or 1 with err set (bad
// share, no slots, the balancer runs, weights the device's row kernels cannot read).
LLAMA_API int32_t kx_context_set_mapped_share(struct llama_context * ctx, float share, char * err, size_t err_size);
// neurons of layer il the slots' device computes from mapped host rows (0 without; -1 bad layer)
LLAMA_API int64_t kx_model_slots_mapped(const struct llama_model * model, int32_t il);

// Replaces residents of layer il's slots between decodes (no graph may run meanwhile): the
// neurons in evict go back to the host side, those in admit take freed or empty slots
// (rows copied from the host weights). Checked first, all or nothing; 0 or 1 with err set.
LLAMA_API int32_t kx_model_slots_swap(struct llama_model * model, int32_t il, const int32_t * evict,
                                      int32_t n_evict, const int32_t * admit, int32_t n_admit,
                                      char * err, size_t err_size);

// ---------------------------------------------------------------- live balancer
// Moves neurons between the two sides of every hybrid layer while decoding: after each decode,
// kx_context_balance commits the reloads that have landed, applies the last decision and
// queues its loads on a reload stream (rows from the page-locked host weights), and decides
// the next step from the decode's active lists (TAM, include/kx-tam.h) on a worker thread
// while the next decode runs. A neuron enters the slot map only after its rows have landed,
// so outputs are those of the static split whatever the reloads do.
// The back-off (llama/kx-backoff.cpp; reference kairox.backoff): the balancer runs `window`
// decoded tokens, is held `window` tokens (the split as it stands), and keeps running only
// where its median token time is below the held one by `margin`; the outcome holds window *
// 2^k tokens (k: the outcome's repeats, <= max_doubling) before the next probe. Token times
// are the context's single-token decodes (llama_perf_context; a context made with no_perf
// gives none, and the balancer then keeps running).
struct kx_backoff_config {
    int32_t window;       // tokens measured in each probe phase; 0: never back off
    int32_t settle;       // tokens after a switch not measured (the graph is rebuilt)
    float   margin;       // in [0, 1)
    int32_t max_doubling;
    float   drift;        // in [0, 1): a lost probe repeats once the static split's hit rate fell by this; 0: on schedule
};

// Load-aware decode threads (kx-threads.cpp; reference python/kairox/threads.py): the CPU's
// thread count of each single-token decode follows its measured time. Held while a window's
// mean stays within `drift` of the one it was chosen at; two windows in a row that moved probe
// n, 3n/4, n/2, n/4 (one window each; n: the context's n_threads) and keep the fastest, the
// largest within 3% of it. Holding fewer than n, it peeks at n after `recheck` decodes. Times are the context's eval
// counters (llama_perf_context; a context made with no_perf is never adapted).
struct kx_threads_config {
    int32_t window;  // decodes per measurement (their mean); 0: off (the context's n_threads throughout)
    double  drift;   // in (0, 1)
    int32_t recheck; // >= window
};

struct kx_balance_params {
    struct kx_tam_config tam;
    double  cpu_gbs;     // matvec rates of the stall model (a step whose host part outlasts its
    double  gpu_gbs;     // device part is a CPU stall); <= 0: 100 and 2000 GB/s
    int32_t method;      // enum kx_reload_method (include/kx-reload.h); 0: the gather kernel
    int32_t max_blocks;  // the gather kernel's grid cap (its share of the GPU)
    int32_t decide;      // enum kx_balance_decide: where the TAM step runs
    int32_t record;      // 1: keep every step's active lists (kx_model_balance_activity; tests)
    int32_t observe;     // 1: only record what ran (hits), decide and move nothing (the static split's figures)
    int32_t pipeline;    // 1: one layer ahead within each decode (below) instead of between decodes;
                         //    decide then picks who makes each prefetch: auto / inline the compute
                         //    threads (graph nodes), worker the balancer's own thread; a step loads
                         //    at most tam.max_admit, KX_PIPE_MAX_ADMIT where that is < 0
    int32_t late_every;  // tests: every n-th reload batch of a layer counts as landed two checks late (0: never)
    int32_t wait_limit_ms; // how long a boundary waits for the last reloads before the balancer stops
                           // (the split stays as it is, outputs unchanged); <= 0: 10000
    int32_t fail_at;     // tests, fault injection: the balancer's n-th reload batch fails to queue (0: never)
    int32_t hang_at;     // tests, fault injection: its n-th reload batch never finishes (0: never)
    int32_t trace_keep;  // records kept in memory (kx_model_balance_trace), the newest; <= 0: 262144, else >= 1024
    struct kx_backoff_config backoff; // window 0: the balancer never backs off
};
// The pipeline's loads per layer step unless tam.max_admit says otherwise: its step merges and
// sorts every candidate and victim on the critical path, so an uncapped step costs more than
// the loads it adds (docs/ARCHITECTURE.md, "The pipeline's load cap").
#define KX_PIPE_MAX_ADMIT 32

// The one-layer-ahead pipeline (pipeline = 1, the predicted mode's predictor): while hybrid
// layer i computes, layer i+1's active set is predicted from layer i's FFN input, and its
// best missing neurons (TAM candidates) are copied into the slots of its worst residents not
// predicted; before layer i+1's slot part is queued, reloads that landed enter its slot map
// and the others stay on the CPU side until a later check. The first hybrid layer is
// decided between decodes from its last active list. kairox.balancer.PrefetchLayer is the
// reference of one layer's steps.

enum kx_balance_decide {
    KX_DECIDE_AUTO   = 0, // on the slots' device when its engine can (one kernel, every layer), else a host worker
    KX_DECIDE_WORKER = 1, // a host thread, while the next decode runs
    KX_DECIDE_INLINE = 2, // the calling thread, at the boundary (measures the decision's cost)
};

// one layer's step: the decode's activity, what ran on the GPU, what the step decided
struct kx_balance_record {
    int32_t step;
    int32_t layer;
    int32_t n_active;     // neurons listed by the decode
    int32_t n_hit;        // of those, resident (computed from the slots)
    int32_t n_load;       // neurons the step decided to load
    int32_t n_evict;
    int32_t stall;        // enum kx_tam_stall the step was decided with
    float   lam;          // λ after the step
    float   wait_us;      // time the boundary waited for the previous reloads
    float   decide_us;    // time of the layer's decision
    int64_t reload_bytes; // bytes the loads move
    int32_t late;         // pipeline: 1 earlier loads still in flight at this step (no decision),
                          // 2 this step's loads had not landed when its layer began,
                          // 4 its predicted list had not come by then (no decision)
    int32_t decided;      // 1: the step made a decision (0: only what ran was recorded)
    float   hold_us;      // pipeline, decide = worker: time the layer's CPU part waited, at its
                          // end, for the balancer thread's decision (0: it was done)
    int32_t pad;
};

// Starts (params non-NULL) or stops the balancer on the model's slots. 0, or 1 with err set.
LLAMA_API int32_t kx_model_balancer_start(struct llama_model * model, const struct kx_balance_params * params,
                                          char * err, size_t err_size);
// One boundary (0, or 1 with err set; 0 and nothing done without a balancer). libllama runs
// it by itself after every successful decode of a context whose model has a balancer
// (llama_decode, llama_process); a call of one's own adds a boundary. Synchronizes the context first.
LLAMA_API int32_t kx_context_balance(struct llama_context * ctx, char * err, size_t err_size);
// Applies and lands everything decided so far (the slots then hold the decided residents).
LLAMA_API int32_t kx_model_balance_drain(struct llama_model * model, char * err, size_t err_size);
// Copies up to capacity records (steps in order, layers within a step); returns how many are
// kept: the newest, between half of params.trace_keep and all of it (every one in record mode;
// a trace file gets every one).
LLAMA_API int64_t kx_model_balance_trace(struct llama_model * model, struct kx_balance_record * dst, int64_t capacity);
// The back-off's samples, oldest first (the newest 65536 at most): each measured token's
// seconds, the static split's hit rate where the back-off counted one (else -1) and whether
// the balancer ran after it (kairox.backoff.run_backoff on the first two gives the third).
// Copies up to capacity; returns how many are kept (0 without a balancer).
LLAMA_API int64_t kx_model_backoff_trace(struct llama_model * model, double * seconds, double * hits, uint8_t * on,
                                         int64_t capacity);
// Record mode: the active ids of hybrid layer il at step; returns the count (-1: none kept).
LLAMA_API int64_t kx_model_balance_activity(struct llama_model * model, int64_t step, int32_t il, int32_t * dst,
                                            int64_t capacity);
// The reload engine's benchmark ships in no library: bench/cuda/kx-reload-bench.cu, built and run
// by bench/reload.py on the engine the CUDA registry hands out ("kx_reload_iface", kx-reload.h).

// ---------------------------------------------------------------- load-aware thresholds
// DynamicInfer's per-device thresholds (llama/kx-thresholds.h, python/kairox/thresholds.py):
// in predicted mode a resident neuron is computed when its predictor score > θ_g, a host-side
// one when > θ_c. Every few decodes, per hybrid layer, the runtime picks the pair from the
// pack's calibration grid with the least modelled layer time (the CPU part's cost measured as
// it runs) whose calibrated error, the summed norm of the skipped FFN terms, stays within the
// static pair's (θ_g = θ_c = 0) plus budget times the layer's mean FFN output norm. budget 0:
// no more error than the static threshold; > 0: a declared approximation (0.01: at most 1% of
// the output's norm added); < 0: off (the static thresholds). Needs slots, the predicted mode
// and a pack with the calibration (kx_thr_*). Waits for ctx's decode and refreshes its graphs;
// other contexts of the model must set their sparse mode again. 0, or 1 with err set.
LLAMA_API int32_t kx_context_set_error_budget(struct llama_context * ctx, float budget, char * err, size_t err_size);

struct kx_thr_info {
    float   theta_g, theta_c;  // the offsets in force (score units)
    int32_t kg, kc;            // their grid points (5: the static 0)
    float   err_added;         // calibrated error the pair adds to the static pair's, / the output norm
    float   n_gpu, n_cpu;      // expected neurons computed per token on each side with the pair
    float   n_cpu_static;      // ... on the CPU with the static pair
    float   t_cpu_ns;          // measured: the CPU part's ns per computed neuron
    float   o_cpu_ns;          // ... and per call
    int32_t solves;            // solves so far
};
// layer il's thresholds (0), or 1 when off / not a hybrid layer
LLAMA_API int32_t kx_model_thresholds(const struct llama_model * model, int32_t il, struct kx_thr_info * out);
// The search on one layer's calibration (for tests against the reference): sel, err
// [n_ff * 11] neuron-major, resident[i] != 0 for the GPU side; times in any one unit.
LLAMA_API void    kx_thresholds_solve(const float * sel, const float * err, int64_t n_ff, const uint8_t * resident,
                                      float budget, float norm, double t_gpu, double t_cpu, double o_gpu,
                                      double o_cpu, int32_t * kg, int32_t * kc);

// ---------------------------------------------------------------- one parameter set
// Every runtime choice of kairox, set on a model and context by two calls (any libllama
// client: the common tools through --sparse/--vram-budget/..., kairox.Llama from Python):
//   struct kx_params kp = kx_params_default();  kp.vram_budget = 7ll << 30;  ...
//   kx_model_params_apply(&kp, &mparams, ...);   // before llama_model_load_from_file
//   model = llama_model_load_from_file(path, mparams); ctx = llama_init_from_model(model, cparams);
//   kx_context_apply(ctx, path, &kp, ...);       // pack, slots, mode, balancer, trace
// From then on libllama runs the balancer's boundary after every decode of ctx by itself
// (llama_decode / llama_process): no client code runs between tokens.
// Defaults reproduce llama.cpp: no pack, dense FFN, nothing moved.

#define KX_SPARSE_AUTO (-1) // dense unless a pack or a hybrid placement is asked for; then
                            // predicted when the pack has a predictor, else exact (ReLU) or
                            // threshold (gated models)

enum kx_balancer_mode {
    KX_BALANCER_OFF      = 0, // the static split: the slots keep the pack's hottest neurons
    KX_BALANCER_FIXED    = 1, // TAM admission with a fixed λ
    KX_BALANCER_ADAPTIVE = 2, // TAM admission, λ adapted from each step's stall type
};

enum kx_status {
    KX_OK         = 0,
    KX_ERR_PARAMS = 1, // a bad or contradictory parameter; nothing was changed
    KX_ERR_PACK   = 2, // the pack (or the mode it needs) cannot be used: the model runs dense
    KX_ERR_BUDGET = 3, // the model cannot run within the VRAM budget (or the hybrid it needs is unavailable)
    KX_ERR_FAILED = 4, // the runtime failed (allocation, device): err says where
};

// tests, fault injection at load (kx_params.faults, bits): memory refused where the runtime
// allocates it, to check what the user then sees
enum kx_fault {
    KX_FAULT_SLOTS     = 1, // the slots' buffer cannot be allocated: a clear error (or the fallback)
    KX_FAULT_HOST_LOCK = 2, // page-locking the host weights is refused: they stay pageable, a warning
    KX_FAULT_HOST_MAP  = 4, // no memory for the host weights: the model does not load
};

struct kx_params {
    int32_t         sparse;            // enum kx_sparse_mode or KX_SPARSE_AUTO (default)
    const char *    sparse_pack;       // NULL: MODEL.kxpack.gguf next to the model
    // the hybrid FFN: each layer's hottest neurons in GPU slots, the rest computed by the CPU
    // at the same time; asked for by any of vram_budget, gpu_slots (or per layer) and plan
    int64_t         vram_budget;       // bytes everything on the GPU must stay under (weights, slots,
                                       // predictors, KV cache, compute buffers); 0: no budget
    int64_t         gpu_slots;         // neurons per layer in the slots; < 0: none given (default)
    const int64_t * gpu_slots_layers;  // or one count per layer (n_gpu_slots_layers values)
    int32_t         n_gpu_slots_layers;
    const char *    plan;              // a `kairox plan` file: dense tensors kept on the CPU, slots per layer
    const char *    slots_device;      // ggml device of the slots; NULL: the first GPU; "CPU": host memory
                                       // (the same split on machines without a GPU: tests)
    bool            pinned;            // under a budget: host weights page-locked, the model read, not mapped
                                       // (default true; false: mapped, and nothing streams)
    bool            warm;              // hybrid: warm the host caches with the next layer's rows (default true)
    bool            stream;            // a budget of whole tensors: host tensors the placement picks are copied
                                       // into a GPU scratch ahead of their use and multiplied there (default
                                       // true; with pinned only: the model is then read, not mapped)
    bool            migrate;           // ... and which of them stream follows the CPU, GPU and PCIe rates measured
                                       // over the last decode steps (runtime migration; default false: it
                                       // has not yet measured faster, docs/ARCHITECTURE.md)
    float           mapped_share;      // hybrid: share of the host side the GPU reads over PCIe, [0, 1)
    int32_t         balancer;          // enum kx_balancer_mode (default off)
    struct kx_balance_params balance;  // the balancer's settings (balance.tam.adaptive follows `balancer`)
    const char *    trace;             // balancer records as JSON lines, appended as the run goes; NULL: none
    const char *    sched_trace;       // the scheduler's split trace (include/kx-trace.h), for the whole
                                       // process, written at exit (`kairox trace FILE`); NULL: none
    int64_t         sched_trace_max;   // records it keeps (<= 0: 131072)
    float           error_budget;      // hybrid, predicted: load-aware thresholds (kx_context_set_error_budget)
                                       // adding at most this relative FFN output error; < 0: off (default -1)
    bool            fallback_dense;    // what the client does on KX_ERR_PACK (a sparse mode or hybrid asked
                                       // for that cannot run): true, run dense with a warning; false (the
                                       // default), stop with the error. kx_context_apply leaves the context
                                       // dense either way; the tools and kairox.Llama read this field
    int32_t         faults;            // tests: enum kx_fault bits, memory refused at load (0: none)
    // filled by kx_model_params_apply, not by the caller: free bytes of the slots' device before
    // the model loads (the budget's zero; the CUDA context is not counted), -1 unknown
    int64_t         vram_free_at_load;
    bool            measure_gain;      // sparse without the hybrid, a pack with listed densities: time each
                                       // layer's sparse FFN against the dense one on this CPU before the model
                                       // loads, and run sparse only where it is 5% faster (kx_sparse_cost; default
                                       // true). false: sparse wherever the lists hold under 60% of the neurons
    // filled by kx_model_params_apply: the budget holds the whole model dense (weights, KV cache,
    // compute buffers and the margin), and with the automatic sparse mode it then runs dense on
    // the GPU, as llama.cpp does with every layer offloaded (the split pays only where part of the
    // model must stay on the CPU); an explicit sparse mode or slot count runs as asked
    bool            whole_fits;
    // a `kairox profile-hw` file (kx_params_read_hw_profile): the measured CPU and GPU matvec
    // rates per weight type and the hand-off the budget's placement prices tensors at; NULL:
    // balance.cpu_gbs / gpu_gbs, else 100 and 2000 GB/s
    const char *    hw_profile;
    // load-aware decode threads (struct kx_threads_config; default off: window 0)
    struct kx_threads_config threads;
};

// what a budgeted context measured on its device (bytes)
struct kx_vram_report {
    int64_t budget;
    int64_t base;      // after load: dense tensors, KV cache, compute buffers
    int64_t slots;     // the slot buffers
    int64_t used;      // after a warm-up batch: everything
    int64_t n_slots;   // neurons in slots, all layers
};

LLAMA_API struct kx_params kx_params_default(void);
// Checks a `kairox profile-hw` file (its cpu_gbs and gpu_gbs > 0; per-type rates and the
// hand-off optional) and names it in kp->hw_profile; balance.cpu_gbs / gpu_gbs left at 0 take
// its rates. Returns KX_OK, or KX_ERR_PARAMS with err set (the path kept only when it reads).
LLAMA_API int32_t kx_params_read_hw_profile(struct kx_params * kp, const char * path, char * err, size_t err_size);
// true when kp asks for the hybrid placement (budget, slot counts or a plan)
LLAMA_API bool    kx_params_hybrid(const struct kx_params * kp);
// Adjusts model parameters for kp before the model loads: FFN weights (and a plan's CPU
// tensors) in host memory without repacking, page-locked and read rather than mapped when
// kp->pinned; the budget's zero is read here. The override patterns live as long as the
// process. Returns enum kx_status (err filled unless KX_OK).
LLAMA_API int32_t kx_model_params_apply(struct kx_params * kp, struct llama_model_params * mp, char * err,
                                        size_t err_size);
// The same for the model at model_path (NULL: as above). A sparse run without the hybrid
// then reads the pack's measured list density (kx.listed_density) before the model loads:
// the FFN of a layer whose predicted lists hold more than 60% of its neurons runs dense, and
// keeps llama.cpp's repacked weights; only the other layers' FFN weights load unrepacked.
LLAMA_API int32_t kx_model_params_apply_model(struct kx_params * kp, struct llama_model_params * mp,
                                              const char * model_path, char * err, size_t err_size);
// The same with the context's parameters (NULL: llama_context_default_params()). Under a VRAM
// budget a dry run of the load (no memory allocated) measures the KV cache and compute buffers;
// when the dense tensors do not fit beside them, the tensor-level knapsack (kx_plan_dense) keeps
// those worth the least per byte on the CPU instead of refusing the budget.
LLAMA_API int32_t kx_model_params_apply_ctx(struct kx_params * kp, struct llama_model_params * mp,
                                            const struct llama_context_params * cp, const char * model_path,
                                            char * err, size_t err_size);
// The dense tensors' knapsack (python/kairox/plan.py solve_dense is the reference): n tensors in
// execution order, each nbytes (rounded up to unit) taking cpu_s or gpu_s seconds per token, a
// device switch between neighbours costing handoff_s (half a round trip), execution starting and
// ending on the CPU. Fills on_gpu (n values) and returns the modelled seconds per token.
// Runtime migration's policy (python/kairox/migrate.py Migrator is the reference): n tensors
// the budget left on the CPU in execution order (bytes, the GPU-resident bytes read before
// each, the share of each a token reads), the GPU's resident bytes, the scratch buffer, the
// rates of the load's plan (GB/s), the threshold, cooldown and window of the re-estimate, and
// the least modelled gain of a new set over the current one.
// NULL for bad arguments. Each decode step's measurements go to kx_migrate_step (1: a new
// choice was made, 0: none, -1: bad state); kx_migrate_streamed fills the current choice
// (n flags) and returns how many stream.
// The back-off's policy on a series of n token times (seconds) and of the static split's hit
// rates (hits, NULL for none; read where the policy asks for one): on[i] = 1 where the balancer
// runs after token i (kairox.backoff.run_backoff is the reference). 0, or 1 for bad arguments.
LLAMA_API int32_t kx_backoff_run(const struct kx_backoff_config * cfg, const double * seconds, const double * hits,
                                 int64_t n, uint8_t * on);
// The decode threads' policy on a series of n single-token decode times (seconds) from n_max
// threads: counts[i] = the thread count after decode i (kairox.threads.ThreadsPolicy is the
// reference). 0, or 1 for bad arguments.
LLAMA_API int32_t kx_threads_run(const struct kx_threads_config * cfg, int32_t n_max, const double * seconds,
                                 int64_t n, int32_t * counts);
struct kx_migrate_state;
LLAMA_API struct kx_migrate_state * kx_migrate_new(const int64_t * nbytes, const int64_t * gpu_bytes_before,
                                                   const double * read, int32_t n, int64_t gpu_bytes,
                                                   int64_t scratch_bytes, double cpu_gbs, double gpu_gbs,
                                                   double pcie_gbs, double threshold, int32_t cooldown,
                                                   int32_t window, double min_gain);
LLAMA_API int32_t kx_migrate_step(struct kx_migrate_state * st, double cpu_bytes, double cpu_s, double gpu_bytes,
                                  double gpu_s, double copy_bytes, double copy_s);
LLAMA_API int32_t kx_migrate_streamed(const struct kx_migrate_state * st, bool * streamed, int32_t n);
LLAMA_API void    kx_migrate_free(struct kx_migrate_state * st);
// The knapsack's items for n tensor names (python/kairox/plan.py dense_groups is the reference):
// group[i] receives the item tensor i belongs to, items numbered in execution order (layer,
// then attention, router, FFN up side, down side; the output head last), the tensors one layer
// runs side by side (q/k/v, gate/up, its MoE experts) one item, each layer's points pinned to
// the GPU (its norms, attention over the KV cache) items without tensors. Returns the number of
// items, or -1 for bad arguments.
LLAMA_API int32_t kx_place_order(const char * const * names, int32_t n, int32_t * group);
// The budget's placement with streamed weights (kx_stream_choose; python/kairox/migrate.py
// stream_placement is the reference) for n tensors (names, bytes, the share a token reads)
// whose dry run keeps `fixed` bytes on the GPU whatever moves (KV cache, compute buffers,
// vectors) and, with `copies`, a copy of the largest host tensor (llama.cpp's op offload of a
// prompt batch): where[i] = 0 on the GPU, 1 on the CPU, 2 on the CPU and streamed, 3 on the CPU in a slot's reach
// (runtime migration may stream it); *scratch the
// slots' bytes. Rates in GB/s, the hand-off in µs; with a `kairox profile-hw` file
// (hw_profile, may be NULL) its rates instead, each tensor priced at its ggml type's (types,
// may be NULL: none). Returns 0, -1 for bad arguments (or an unreadable profile), -2 when the
// budget is too small.
LLAMA_API int32_t kx_stream_place(const char * const * names, const int64_t * nbytes, const double * read,
                                  const char * const * types, int32_t n, int64_t fixed, int64_t budget,
                                  double cpu_gbs, double gpu_gbs, double pcie_gbs, double handoff_us,
                                  const char * hw_profile, bool copies, int8_t * where, int64_t * scratch);
LLAMA_API double  kx_plan_dense(const int64_t * nbytes, const double * cpu_s, const double * gpu_s, int32_t n,
                                int64_t budget, int64_t unit, double handoff_s, bool * on_gpu);
// Neuron slots per layer (python/kairox/plan.py solve_slots is the reference): layer l has
// n_group[l] groups whose expected active rows per token are freq[off_l ..] (the layers' values
// one after another), each group_bytes[l] bytes over rows_per_group[l] rows; the layer's FFN
// takes max(CPU rows, GPU rows) x row bytes / that side's rate (bytes/s) since both sides run at
// once. Fills taken[l] (that layer's hottest groups resident) within budget bytes and returns
// the modelled seconds per token; < 0 for bad arguments.
LLAMA_API double  kx_plan_slots(const double * freq, const int64_t * n_group, const int64_t * group_bytes,
                                const int64_t * rows_per_group, const double * cpu_bps, const double * gpu_bps,
                                int32_t n_layer, int64_t budget, int64_t * taken);
// Layers whose FFN runs sparse in predicted mode (the rest dense: their lists are too dense
// to gain), out of the model's; 0 without a pack.
LLAMA_API int32_t kx_model_sparse_layers(const struct llama_model * model);
// Per layer of the model at model_path with the pack at pack_path (NULL: next to the model), the
// sparse FFN's time over the dense FFN's on this CPU with n_threads, at the share of neurons
// the layer's predicted lists held on calibration tokens; < 0.95 where sparsity gains (what the load
// decides with kx_params::measure_gain). mode: KX_SPARSE_PREDICTED or KX_SPARSE_THRESHOLD.
// ratio[il] = -1 where the pack lists no share or one of 60% or more (the layer runs dense
// without timing). Writes n_layer values (the pack's). Returns KX_OK, or KX_ERR_PACK with err.
LLAMA_API int32_t kx_sparse_cost(const char * model_path, const char * pack_path, int32_t mode, int32_t n_threads,
                                 float * ratio, int32_t n_layer, char * err, size_t err_size);
// Applies kp to a context of a model loaded with kx_model_params_apply's parameters: loads
// the pack, places the slots (counts given, from the plan, or filling the VRAM budget,
// measured around a warm-up batch), selects the sparse mode, sets the mapped share, starts
// the balancer and its trace. Returns enum kx_status; on KX_ERR_PACK the context is left
// dense and err says why (the caller stops unless kp->fallback_dense); on other errors the
// caller should not use the context.
LLAMA_API int32_t kx_context_apply(struct llama_context * ctx, const char * model_path, const struct kx_params * kp,
                                   char * err, size_t err_size);
// the budget's measurements (false when the context has no budget)
LLAMA_API bool    kx_context_vram(const struct llama_context * ctx, struct kx_vram_report * out);

// The budget's arithmetic (python/kairox/budget.py is the reference; tests compare them).
// A layer's slot costs: per_neuron bytes (gate + up + down rows), pred bytes of all the GPU
// predictors and maps, n_layer, n_ff. margin: bytes kept free for what the hybrid graph
// allocates after the base reading.
LLAMA_API int64_t kx_budget_margin(int64_t budget);
// slots per layer that fill what the budget leaves after base, or -1 with err set
LLAMA_API int64_t kx_budget_auto_slots(int64_t budget, int64_t base, int64_t per_neuron, int64_t pred,
                                       int64_t n_layer, int64_t n_ff, char * err, size_t err_size);
// per-layer slot counts that fill what the budget leaves after base (python: budget.auto_slot_counts):
// the slot solve (kx_plan_slots) over freq, the n_layer x n_ff measured activation frequencies
// (the pack's, by neuron id), at the stall model's rates (GB/s; <= 0: 100 and 2000). The same
// count in every layer when the frequencies are unknown (NULL or all 1). 0, or 1 with err set.
LLAMA_API int32_t kx_budget_auto_counts(int64_t budget, int64_t base, int64_t per_neuron, int64_t pred,
                                        int32_t n_layer, int64_t n_ff, const float * freq, double cpu_gbs,
                                        double gpu_gbs, int64_t * counts, char * err, size_t err_size);
// 0 when counts fit beside base, else 1 with err set
LLAMA_API int32_t kx_budget_check_slots(int64_t budget, int64_t base, int64_t per_neuron, int64_t pred,
                                        int64_t n_ff, const int64_t * counts, int32_t n_layer,
                                        char * err, size_t err_size);
// counts lowered as evenly as the layers allow until at least `over` bytes are given back
LLAMA_API void    kx_budget_shrink(int64_t * counts, int32_t n_layer, int64_t over, int64_t per_neuron);

// A budget of whole tensors' streamed weights (kx_params.stream): out[8] = tensors streamed now,
// scratch bytes on the device, copies queued and their bytes since the context started, the
// tensors a slot holds (those migration may stream), the migrations made (another set streamed
// since the load's), the decode steps measured, the choices made again (the measured rates
// moved). Returns 1 when the context streams, 0 when not (out zeroed), -1 without out.
LLAMA_API int32_t kx_context_stream_stats(const struct llama_context * ctx, int64_t * out);

// name of the buffer type holding the model tensor `name` ("CPU", "CUDA0", "CUDA_Host", ...),
// NULL when the model has no such tensor: where a placement put each weight (a streamed one:
// its host memory, whichever buffer a graph reads it from)
LLAMA_API const char * kx_model_tensor_buffer_type(const struct llama_model * model, const char * name);

// "dense" / "exact" / "predicted" / "threshold" -> mode, -1 for anything else
LLAMA_API int32_t kx_sparse_mode_from_str(const char * s);

// Matrix-vector throughput of a weight type (enum ggml_type) on the CPU (on_gpu 0) or the
// first GPU (1): one token times a matrix of n_cols columns and about n_bytes of weights,
// best of n_reps after a warm-up. n_threads: CPU threads (<= 0: the backend's default).
// Returns 0 and sets *seconds (and *bytes_read, the matrix bytes), 1 for bad arguments or a
// type that cannot be written without an importance matrix, 2 without such a device, 3 when
// the matrix does not fit, 4 when the backend fails. Used by `kairox profile-hw`.
LLAMA_API int32_t kx_profile_matvec(int32_t type, int64_t n_bytes, int64_t n_cols, int32_t on_gpu,
                                    int32_t n_threads, int32_t n_reps, double * seconds, int64_t * bytes_read);

// ---------------------------------------------------------------- activation profiler
// An eval callback that aggregates a dense forward pass in native code (`kairox prepare`).
// Install it through llama_context_params: cb_eval = kx_collector_eval,
// cb_eval_user_data = the collector; request logits for every token so the last layer
// keeps all rows. Watched tensors (names from llama.cpp's graph): ffn_norm-L (FFN input),
// ffn_gate-L (gate pre-activation), l_out-L (residual stream); all must be F32.

// |act(g)| histogram: bin 0 holds exact zeros, bins 1..N-1 split [10^LO, 10^HI) into
// N-2 log-uniform bins (2.5% wide each); bin 1 also takes (0, 10^LO) and bin N-1 what
// lies at or above 10^HI. A threshold read from it is good to one bin (2.5%), finer
// than any sparsity target needs.
#define KX_COLLECT_HIST_BINS 1026
#define KX_COLLECT_HIST_LO   (-8.0)
#define KX_COLLECT_HIST_HI   (  3.0)

enum kx_collect_rows {
    KX_COLLECT_X    = 0, // rows of FFN input kept since kx_collector_begin
    KX_COLLECT_MASK = 1, // rows of active masks kept since kx_collector_begin
};

struct kx_collector;

// act: KX_SELECT_RELU / _SILU / _GELU (kx-ops.h); max_tokens: rows kept per layer per decode
// (more are counted in the aggregates but not kept). NULL for invalid arguments.
LLAMA_API struct kx_collector * kx_collector_new(int32_t n_layer, int32_t n_embd, int32_t n_ff,
                                                 int32_t act, int32_t max_tokens);
LLAMA_API void    kx_collector_free(struct kx_collector * c);
// per-layer thresholds (n_layer finite values >= 0): neuron i is active iff |act(g_i)| > thr
LLAMA_API int32_t kx_collector_set_thresholds(struct kx_collector * c, const float * thr);
// the ggml_backend_sched_eval_callback; user_data is the collector
LLAMA_API bool    kx_collector_eval(struct ggml_tensor * t, bool ask, void * user_data);
// before each llama_decode: forget the previous decode's rows (aggregates stay)
LLAMA_API void    kx_collector_begin(struct kx_collector * c);
// zero the aggregates (counts, histograms, cosine sums, skipped)
LLAMA_API void    kx_collector_reset(struct kx_collector * c);
// rows kept for layer il since begin (what: enum kx_collect_rows); -1 for a bad layer
LLAMA_API int32_t kx_collector_n_rows(const struct kx_collector * c, int32_t il, int32_t what);
// copy the kept rows: x as rows x n_embd floats, masks as rows x ceil(n_ff/8) bytes (bit i of
// a row is neuron i, little-endian bit order). Return the count copied, -1 if capacity is short.
LLAMA_API int64_t kx_collector_get_x(const struct kx_collector * c, int32_t il, float * dst, int64_t capacity);
LLAMA_API int64_t kx_collector_get_mask(const struct kx_collector * c, int32_t il, uint8_t * dst, int64_t capacity);
// aggregates of layer il: active count per neuron [n_ff], histogram [KX_COLLECT_HIST_BINS],
// sum and count of cos(l_out[il-1], l_out[il]) over tokens (layer 0: none)
LLAMA_API int32_t kx_collector_get_counts(const struct kx_collector * c, int32_t il, int64_t * dst);
LLAMA_API int32_t kx_collector_get_hist(const struct kx_collector * c, int32_t il, int64_t * dst);
LLAMA_API int32_t kx_collector_get_cosine(const struct kx_collector * c, int32_t il, double * sum, int64_t * n);
// stop = true: the callback ends the graph's compute after the last layer's output (the
// logits are then not computed: only for profiling, whose outputs nobody reads)
LLAMA_API void    kx_collector_set_stop_after_last(struct kx_collector * c, bool stop);
// watched tensors ignored (unexpected type/shape) or rows beyond max_tokens
LLAMA_API int64_t kx_collector_n_skipped(const struct kx_collector * c);
LLAMA_API int32_t kx_collect_hist_bins(void);
LLAMA_API void    kx_collect_hist_range(double * lo_log10, double * hi_log10);

// Host memory for weights the CPU reads row by row (llama/kx-host.cpp): buffers in 2 MiB pages
// (transparent huge pages) and, when pinned, page-locked and mapped for the GPUs (left
// pageable, with a message, where locking fails). For tensor_buft_overrides of a hybrid's
// host-side weights, loaded without mmap. faults: kx_params.faults (tests; 0 normally).
LLAMA_API ggml_backend_buffer_type_t kx_host_buffer_type(bool pinned, int32_t faults);
// bytes of the pinned type's buffers left pageable (locking failed) since the process started
LLAMA_API int64_t kx_host_pageable_bytes(void);

// Warming the host's caches with the next layer's rows during the device's serial part
// (llama/kx-warm.cpp; on unless kx_params::warm is false; hybrid layers after the
// first with the predictor on the slots' device, not with the balancer's pipeline).
// out: 4 values (may be NULL, to reset only): warm nodes run, those that had a predicted
// list, rows read ahead, bytes read ahead.
LLAMA_API void    kx_warm_stats(int64_t * out, bool reset);

// The live balancer's boundary (kx_context_balance), host time by phase since the last reset
// (llama/kx-balance.cpp). out: 15 values (may be NULL, to reset only): boundaries, ns in
// kx_context_balance, ns of it synchronizing the context, taking the decode's active lists
// and GPU hits, waiting for the reload stream (or the host decision), reading the device
// decision, applying the last one (the host's maps and copy list), starting the next one, and
// applying's device calls: storing the slot-map entries, queueing the copies; then the
// boundaries the back-off held the balancer at (no step), its returns to the static split
// (each switch to held), the neurons those loaded and the ns they took, and the held
// boundaries at which a return's loads were still in flight (they enter once landed).
LLAMA_API void    kx_balance_stats(int64_t * out, bool reset);

// The balancer's pipeline within each decode (llama/kx-pipeline.cpp), host time by phase since
// the last reset. out: 7 values (may be NULL): prefetch steps, ns waiting for the predicted
// lists, ns in begin (landed loads, marks), in the scan (thread 0's slice), in end (the
// choice, evictions, copy list), queueing the copies, and in publish (the wait for the
// balancer's thread, settling, the map stores).
LLAMA_API void    kx_pipe_stats(int64_t * out, bool reset);

#ifdef __cplusplus
}
#endif
