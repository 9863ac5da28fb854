// Tensor-level placement under a VRAM budget (kx-placement.cpp): which dense tensors stay on
// the CPU when they do not all fit on the GPU beside the KV cache and compute buffers.
#pragma once

#include "llama.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

// the knapsack's resolution: 1 MiB keeps a Q4 attention matrix of a 7B model (9 MiB) from
// being rounded to twice its size, and the table small (KB-70B at 22 GiB: 18 MB)
static constexpr int64_t kx_plan_dense_unit = 1 << 20;

// device memory a load takes beyond llama.cpp's buffer sizes, which the dry run cannot see:
// the driver rounds each allocation up (2 MiB pages) and the backend's streams and handles
// take some. Measured on the H200: KB-350M's base was 5 MiB over its model, KV and compute
// buffers; the placement keeps this much free so the runtime's own base reading fits too.
static constexpr int64_t kx_place_alloc_slack = 16 << 20;

// a weight type's name as the hardware profile keys it: lower case ("q4_k"; ggml names the
// K-quants "q4_K", gguf-py and the profile "q4_k")
inline std::string kx_type_key(std::string type) {
    std::transform(type.begin(), type.end(), type.begin(), [](unsigned char c) { return (char) std::tolower(c); });
    return type;
}

// decode rates of the cost model (kairox.costs.Rates, plan.HwProfile.handoff_us)
struct kx_dense_rates {
    double cpu_gbs    = 100.0;
    double gpu_gbs    = 2000.0;
    double handoff_us = 23.5; // one CPU<->GPU round trip of the hidden state
    double pcie_gbs   = 50.0; // host-to-device copies (what streamed tensors cross)
    // measured matvec rates by weight type (`kairox profile-hw`; keys as kx_type_key spells
    // them): a quantized matvec can run below the streaming read on the CPU; a type not listed
    // takes the rate above
    std::map<std::string, double> cpu_type_gbs, gpu_type_gbs;
    double cpu_of(const std::string & type) const {
        const auto it = cpu_type_gbs.find(type);
        return it != cpu_type_gbs.end() ? it->second : cpu_gbs;
    }
    double gpu_of(const std::string & type) const {
        const auto it = gpu_type_gbs.find(type);
        return it != gpu_type_gbs.end() ? it->second : gpu_gbs;
    }
};
// a `kairox profile-hw` file's rates (python: kairox.plan.HwProfile.from_json); throws naming what is wrong
kx_dense_rates kx_dense_rates_read(const std::string & path);

// "blk.3.attn_q.weight" -> (3, "attn_q.weight"); (-1, name) outside the blocks
std::pair<int, std::string> kx_tensor_layer(const std::string & name);
// tensor names grouped by kind ("attn_q.weight": its layers, in the order given), kinds in
// first-seen order; names outside the blocks apart
struct kx_tensor_kinds {
    std::vector<std::string> order;
    std::map<std::string, std::vector<int>> layers;
    std::vector<std::string> other;
};
kx_tensor_kinds kx_tensors_by_kind(const std::vector<std::string> & names);
// "attn_q.weight 0-11,14; output.weight": a set of tensors by kind and layer ranges
std::string kx_names_text(const std::vector<std::string> & names);
// "512 MiB"
std::string kx_mib(int64_t bytes);
// s with the characters special to llama.cpp's override patterns (ECMAScript regex) escaped
std::string kx_regex_escape(const std::string & s);

// What a dry run of the load (no_alloc: every buffer sized, nothing allocated) takes on a
// device, in bytes, and the dense matrices there (name, bytes) that could move to the CPU.
// llama.cpp's buffers of a context and its model on dev (device memory, not its host buffer
// types), bytes
struct kx_dev_bytes {
    int64_t weights = 0;
    int64_t kv      = 0;
    int64_t compute = 0;
};
kx_dev_bytes kx_dev_buffers(llama_context * ctx, ggml_backend_dev_t dev);
bool kx_buft_on_dev(ggml_backend_buffer_type_t buft, ggml_backend_dev_t dev);

// a dense matrix the placement may move: its bytes, and the share of them a token reads (an
// MoE expert tensor: n_expert_used / n_expert, as ATSInfer counts them; 1 otherwise)
struct kx_place_item {
    std::string name;
    int64_t     bytes;
    double      read;
    std::string type = ""; // weight type as kx_type_key spells it: the rate it is priced at (kx_dense_rates)
};
// a model's matrix as an item (the share of it a token reads from the model's experts)
kx_place_item kx_place_item_of(const llama_model & model, const std::string & name, const ggml_tensor * t);
struct kx_dry_sizes : kx_dev_bytes {
    int64_t movable = 0; // bytes of items
    std::vector<kx_place_item> items;
    int64_t total() const { return weights + kv + compute; }
};
kx_dry_sizes kx_dry_run(const llama_model_params & mp, const llama_context_params & cp, const char * model_path,
                        ggml_backend_dev_t dev);
// what the knapsack places as one (kx_place_groups): a tensor, the tensors of one layer that
// run side by side, or a point of the layer pinned to the GPU (no tensors, no bytes)
struct kx_place_group {
    std::vector<std::string> names;
    int64_t bytes;
    double  read_bytes; // what a token reads of them
    bool    pinned;
};
int kx_exec_rank(const std::string & kind);
// the knapsack's chain, in execution order
std::vector<kx_place_group> kx_place_groups(const std::vector<kx_place_item> & items);
// the caller's dry run with these dense tensors (by name) also kept on the CPU
using kx_dry_run_fn = std::function<kx_dry_sizes(const std::vector<std::string> & cpu_names)>;

// true when a dry run's sizes (weights, KV cache, compute buffers) and the margin fit under budget
bool kx_place_fits(const kx_dry_sizes & d, int64_t budget);

// The dense tensors (by name) to keep on the CPU so that everything fits under budget; empty
// when all fit. Throws with the sizes when the KV cache and compute buffers alone do not fit.
// Logs the placement, or with `text` writes the line there instead (a caller comparing placements).
std::vector<std::string> kx_place_dense(const kx_dry_run_fn & dry, int64_t budget, const kx_dense_rates & rates,
                                        std::string * text = nullptr);
