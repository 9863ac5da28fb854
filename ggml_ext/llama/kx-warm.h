// Warming the host's caches with layer il+1's rows while the CPU waits for the device
// (kx-warm.cpp): the first node of a hybrid layer's CPU split.
#pragma once

#include "ggml.h"

#include <cstdint>

struct kx_slot_layer;

// what the node reads: the layer's predicted list (kx_slot_layer::ahead) and maps, and the
// host weights the layer's CPU part reads (set at graph build; stable while graphs live)
struct kx_warm_hook {
    const kx_slot_layer * L    = nullptr;
    const ggml_tensor *   gate = nullptr;
    const ggml_tensor *   up   = nullptr;
    const ggml_tensor *   down = nullptr; // the pack's down_t
};

// a ggml_custom1_op_t: userdata is a kx_warm_hook; the node must be named "kx_warm..."
void kx_warm_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata);
