// The sparse pack in memory: tensors read from the sidecar GGUF into one CPU buffer.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

struct llama_model;

// the load-aware thresholds' grid of score offsets: KX_THR_K points, KX_THR_K0 the static 0
// (python/kairox/thresholds.py GRID_REL)
#define KX_THR_K  11
#define KX_THR_K0 5

// A predicted list holding more than this share of a layer's neurons runs every row (the
// select's fallback; the sparse kernels then cost what the dense matvec costs). It is also
// the line under which a layer's sparse FFN gains: a layer whose calibrated lists hold more
// runs llama.cpp's dense FFN (repacked weights where the CPU backend has them).
static constexpr float kx_max_density = 0.6f;

// a low-rank predictor (docs/pack-format.md): score = b (a x) + c, neuron id i listed where
// score[i] > 0; all three tensors or none
struct kx_lowrank {
    ggml_tensor * a = nullptr; // [n_embd, rank]
    ggml_tensor * b = nullptr; // [rank, n_ff]
    ggml_tensor * c = nullptr; // F32 [n_ff]
    explicit operator bool() const { return a != nullptr; }
    int64_t nbytes() const { return a ? (int64_t) (ggml_nbytes(a) + ggml_nbytes(b) + ggml_nbytes(c)) : 0; }
};

struct kx_pack_layer {
    ggml_tensor * down_t = nullptr; // [n_embd, n_ff] ggml ne: one row per pack position
    ggml_tensor * rowmap = nullptr; // I32 [n_ff]: neuron id -> row of down_t; null if identity
    kx_lowrank pred;                // the layer's predictor, fed its FFN input (optional)
    kx_lowrank pred_ahead;          // fed layer l-1's FFN input: the list one layer early (optional)
    float threshold = 0.0f;         // activation magnitude above which a neuron counts as active
    std::vector<float> freq;        // [n_ff] measured activation frequency per neuron id (1 = unknown)
    // the load-aware thresholds' calibration (optional, kx-thresholds.h): score offsets, and per
    // neuron id and offset the share of tokens computed and the output norm a skip drops
    std::array<float, KX_THR_K> thr_grid = {};
    std::vector<float> thr_sel;     // [n_ff * KX_THR_K], neuron-major
    std::vector<float> thr_err;
    float thr_norm = 0.0f;          // the layer's mean FFN output norm on the calibration tokens
    // share of the neurons the predicted lists held on calibration tokens (the pack's optional
    // kx.listed_density; -1: not measured) and whether predicted mode runs this layer sparse
    float listed = -1.0f;
    bool  pays   = true;
};

struct kx_pack {
    std::string path;
    std::string activation; // relu | silu | gelu
    int64_t n_layer = 0;
    int64_t n_embd  = 0;
    int64_t n_ff    = 0;
    bool has_predictor = false;
    bool has_thresholds = false;    // every layer has its kx_thr_* calibration
    std::vector<kx_pack_layer> layers;

    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;

    ~kx_pack();
};

// printf into a std::string (the messages of kx_pack_error and the slot errors)
std::string kx_fmt(const char * format, ...);
// the C API's error out-parameter: msg into err (when err_size > 0), always terminated
void kx_set_err(char * err, size_t err_size, const std::string & msg);

// Thrown with one sentence saying which check failed.
struct kx_pack_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

std::shared_ptr<kx_pack> kx_pack_load(const llama_model & model, const std::string & model_path,
                                      const std::string & pack_path);

// What the load path needs before the model loads (which layers keep llama.cpp's repacked FFN
// weights), read from the pack's header alone: all empty when it cannot be read (the full load
// reports a bad pack)
struct kx_pack_preview {
    std::string        activation; // kx.base.activation
    std::vector<float> listed;     // kx.listed_density; empty when the pack has none
    bool               predictor = false; // layer 0 has a predictor (the pack has one for all or none)
};
kx_pack_preview kx_pack_preview_read(const std::string & pack_path);
// The row types a neuron slot of each layer holds (enum ggml_type: the model's ffn_gate and
// ffn_up, the pack's down rows), read from both files' headers before the model loads, with
// the pack's n_embd and n_ff; empty when either cannot be read (the full load says why)
struct kx_slot_types {
    int32_t gate, up, down;
};
std::vector<kx_slot_types> kx_slot_types_read(const std::string & model_path, const std::string & pack_path,
                                               int64_t * n_embd, int64_t * n_ff);
// whether predicted mode gains on a layer whose lists hold that share (-1: unknown, assumed),
// where the load measured nothing (kx-pays.h)
inline bool kx_layer_pays(float listed) {
    return listed < kx_max_density;
}

// ---- integrity (kx-pack-check.cpp)
// XXH3-64 (seed 0) of n bytes: the pack's checksums
uint64_t kx_xxh3(const void * data, size_t n);
// the first row of t (ggml_nrows rows, t's type, read from data) holding an inf or NaN; -1
// when all are finite or the type is not a float type (Q8_0: its block scales)
int64_t kx_first_nonfinite_row(const ggml_tensor * t, const void * data);
// fn(i) for every i in [0, n) on up to one thread per core; the first exception is rethrown
// after all threads stop
void kx_parallel_for(int64_t n, const std::function<void(int64_t)> & fn);
