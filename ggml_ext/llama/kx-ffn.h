// The sparse FFN graph (kx-ffn.cpp), called from llm_graph_context::build_ffn.
#pragma once

#include "llama-graph.h"

// Sparse replacement for one dense FFN, or nullptr when this FFN must stay dense (no pack
// or dense mode, a batch larger than kx_sparse_max_tokens, biases/scales/LoRA, weights
// not in plain host memory, ...). The arguments are build_ffn's.
ggml_tensor * kx_build_ffn_sparse(
        const llm_graph_context & g,
        ggml_tensor * cur,
        ggml_tensor * up,   ggml_tensor * up_b,   ggml_tensor * up_s,
        ggml_tensor * gate, ggml_tensor * gate_b, ggml_tensor * gate_s,
        ggml_tensor * down, ggml_tensor * down_b, ggml_tensor * down_s,
        ggml_tensor * act_scales,
        llm_ffn_op_type type_op, llm_ffn_gate_type type_gate, int il);
