// The reload tables of a ggml device (include/kx-reload.h), as its backend's registry hands
// them out (CUDA: cuda/kx-reload.cu): the engine that moves neuron rows into the slots (for
// slots on the CPU, a host engine whose copies are done when queued), the balancer's decision
// on that engine, and the page-locking of host memory. The slots' mapped share (mapping host
// rows), the balancer's reloads and the host weights' buffer (kx-host.cpp) use them.
#pragma once

#include "kx-reload.h"

#include <cstdint>
#include <string>

// The engine of ggml device `device` ("CPU": the host engine) and the device's index for its
// create(). Throws std::runtime_error when the device's backend has none.
const kx_reload_iface * kx_reload_engine(const std::string & device, int32_t * index);
// The balancer's decision on that device's engine; nullptr: the host decides (CPU slots, or
// a backend without one).
const kx_tam_iface * kx_reload_decision(const std::string & device);
// The first GPU backend's page-locking of host memory, or nullptr (no GPU, or none to lock for).
const kx_pin_iface * kx_reload_pinning();
// Queues copies on an engine: tag < 0 with copy(), else with tag_copy(tag). While the scheduler
// trace records, the batch becomes a reload record of model layer il (< 0: several layers)
// stamped by the engine's stream before and after it. The engine's return code.
int32_t kx_reload_queue(const kx_reload_iface * io, void * engine, int32_t tag, int32_t il,
                        const kx_row_copy * c, int64_t n);
