// Streamed weights (ATSInfer's CPU-GPU overlap for tensors a budget leaves on the CPU): the
// GPU multiplies some host-resident tensors from a scratch buffer that its copy engine fills
// ahead of their use, so PCIe reads weights while the CPU reads its own, and a token costs
// about max(CPU bytes / CPU rate, streamed bytes / PCIe rate) instead of their sum.
//
// The choice (kx_stream_choose) is made before the load, by kx-migrate's policy; the host
// tensors a slot holds (the streamed ones and those that may be later) load plain into
// page-locked host memory, the others as llama.cpp places them. The engine (kx_stream) runs
// per context through the scheduler's hooks (kx-sched-stream.h) and, with migration, measures
// each decode step and streams another set when the machine's rates moved (ATSInfer's runtime
// migration: kx_migrator).
#pragma once

#include "kx-migrate.h"
#include "kx-placement.h"
#include "kx-sched-stream.h"
#include "kx-timer.h"

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

struct llama_context;

// decode steps after a graph is split anew that migration does not sample
static constexpr int32_t kx_stream_settle = 3;

// The host tensors of a placement as the migrator's chain (execution order): each with the
// GPU-resident bytes read before it; one a slot cannot hold (or an MoE expert tensor, read in
// part) is larger than the scratch, so it is never streamed
struct kx_stream_chain {
    std::vector<kx_migrate_tensor> tensors;
    std::vector<std::string>       names;
    int64_t                        gpu_bytes = 0; // the GPU-resident weights a step reads
};
kx_stream_chain kx_stream_chain_of(const std::vector<kx_place_item> & all, const std::vector<std::string> & cpu,
                                   int64_t scratch);

struct kx_stream_choice {
    std::vector<std::string> cpu;      // the budget's host tensors, the streamed ones among them
    std::vector<std::string> streamed; // in execution order
    std::vector<std::string> slotted;  // those a slot holds: streamed now, or later by migration
    int64_t scratch = 0;               // bytes the slots take on the device
    double  step_s  = 0;               // the modelled decode step (kx_migrate_choose)
    double  plain_s = 0;               // ... without streaming
    std::string placed;                // the knapsack's log line for `cpu` (empty: everything fits)
};

// The budget's placement with streaming: the knapsack again under the budget less the
// scratch, then the exact streaming choice over its host tensors (each one at most a slot,
// no more than kx_stream_slots of them in a row without a CPU tensor between, so one device
// split never needs more slots than there are). Falls back to the plain placement (nothing
// streamed) when that models no faster. Each distinct dry run is made once.
kx_stream_choice kx_stream_choose(const kx_dry_run_fn & dry, int64_t budget, const kx_dense_rates & rates);

// The streaming policy's rates for these host tensors: the CPU's and the GPU's the byte-weighted
// harmonic mean of each tensor type's rate (one rate, as the policy takes, that prices the host
// tensors all computed on one side exactly as the per-type rates do), PCIe as given
kx_migrate_rates kx_stream_rates(const kx_dense_rates & rates, const std::vector<kx_place_item> & all,
                                 const std::vector<std::string> & cpu);

// runtime migration's settings (kx_params: migrate, the rates of the load's choice)
struct kx_stream_migrate {
    bool           on = true;
    kx_dense_rates rates;
};

struct kx_stream {
    struct item {
        ggml_tensor *         t;
        void *                host;     // its page-locked copy
        ggml_backend_buffer_t host_buf;
        int64_t               nbytes;
        int32_t               pos = -1; // in the current graph's order of use; slot = pos % n_slots
        bool                  on  = false; // streamed (else the CPU multiplies it)
    };
    // a span of device work timed by two events, for the step it belongs to
    struct span {
        void *  a;
        void *  b;
        int64_t step;
        double  bytes;
        bool    copy; // a copy (PCIe) or a device split (GPU)
    };
    // one decode step's measurements, fed to the migrator once its spans completed
    struct step_rec {
        int64_t           id;
        kx_migrate_sample s = {};
        int32_t           open = 0;    // spans not read back yet
        bool              closed = false; // the next graph started
        bool              skip   = false; // not fed: the graph was split anew just before
    };
    ggml_backend_sched_t  sched   = nullptr;
    ggml_backend_dev_t    dev     = nullptr;
    ggml_backend_t        copier  = nullptr; // a second backend of dev: its stream carries the copies
    ggml_backend_buffer_t scratch = nullptr;
    int64_t               slot_bytes = 0;
    int32_t               n_slots    = kx_stream_slots;
    std::vector<item>     items;
    std::unordered_map<const ggml_tensor *, int32_t> index;
    std::vector<ggml_backend_buffer_t> host_bufs;
    std::vector<int32_t>  order;   // items in the current graph's order of use (on: they point at the scratch)
    std::vector<int32_t>  loaded;  // per slot: the item whose copy was queued last (-1: none)
    std::vector<ggml_backend_event_t> copied, freed; // per slot: its last copy; its last reader
    std::vector<int32_t>  cur;     // the items of the view being queued (before -> after)
    std::vector<int64_t>  seen;    // per item: the scan that saw it last
    int64_t               scan     = 0;
    int64_t               n_copies = 0;
    int64_t               copy_bytes = 0;
    kx_sched_stream       hook = {};

    // runtime migration
    llama_context *       ctx     = nullptr;
    bool                  migrate = false;
    kx_migrator           mig;
    kx_stream_chain       chain;
    std::vector<int32_t>  chain_item;  // chain tensor -> item (-1: a slot does not hold it)
    const kx_timer_iface * timer  = nullptr;
    std::vector<void *>   timers;      // free ones
    std::vector<void *>   all_timers;
    std::deque<span>      spans;
    std::deque<step_rec>  steps;
    void *                split_a = nullptr; // the device split being queued: its start
    int64_t               graphs  = -1;      // the scheduler's graph count at the current step
    int64_t               cpu_ns  = 0;       // ... its CPU split time then
    bool                  decode  = false;   // the current graph is a decode step (no offload)
    int64_t               n_steps = 0;
    int64_t               n_migrations = 0; // another set streamed (mig.n_moved: the rates moved)
    int32_t               settle       = 0; // decode steps not sampled after a graph was split anew

    ~kx_stream();
    void graph(ggml_cgraph * g);
    void before(ggml_backend_t backend, ggml_cgraph * g);
    void after(ggml_backend_t backend, ggml_cgraph * g);
    void copy(int32_t i); // queues item i into its slot on the copier's stream
    int32_t of(const ggml_tensor * t) const;
    int32_t n_on() const;
    // migration: a new graph computation closes the step before it; completed spans are read
    // back and complete steps fed to the migrator, whose new choice is streamed from the next
    // graph on
    void tick();
    void * timer_take();
    void apply(const std::vector<bool> & chosen);
};

// the host buffer of a tensor an engine streams (nullptr: not streamed)
ggml_backend_buffer_t kx_stream_home(const ggml_tensor * t);

// The engine for ctx's model: its tensors in page-locked host memory of this type (the
// choice above put them there) are streamed through a scratch on dev, those the load's
// choice picks from the start (the same rates give the same choice). nullptr when the model
// has none; throws std::runtime_error when the device cannot (no events, no memory).
std::shared_ptr<kx_stream> kx_stream_start(llama_context * ctx, ggml_backend_dev_t dev,
                                           ggml_backend_buffer_type_t host_buft, const kx_stream_migrate & mc);
