// kairox runtime API, exported by the patched libllama. Plain C, new functions only: no
// struct or enum that llama-cpp-python mirrors is changed (see docs/ARCHITECTURE.md).
#pragma once

#include "llama.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kx_sparse_mode {
    KX_SPARSE_DENSE     = 0, // the model's own FFN (pack ignored)
    KX_SPARSE_EXACT     = 1, // gate for all neurons; up/down only where the activation fires
    KX_SPARSE_PREDICTED = 2, // the pack's predictor picks the neurons; gate/up/down on those
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

// Selects how this context computes FFNs from its next decode on (graphs built for
// another mode are not reused). Returns 0, or nonzero with err filled when the mode needs
// a pack (or a predictor) the model lacks; the mode is then left unchanged.
LLAMA_API int32_t kx_context_set_sparse(struct llama_context * ctx, int32_t mode,
                                        char * err, size_t err_size);
LLAMA_API int32_t kx_context_get_sparse(const struct llama_context * ctx);

// "dense" / "exact" / "predicted" -> mode, -1 for anything else
LLAMA_API int32_t kx_sparse_mode_from_str(const char * s);

#ifdef __cplusplus
}
#endif
