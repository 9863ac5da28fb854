// Slot reloads: copies of neuron rows from page-locked host memory into a device's slot
// buffers, queued on a stream of their own so they run behind the decode's compute, plus
// the small synchronous map writes that make a finished reload visible.
//
// libllama's balancer (llama/kx-balance.cpp) drives an engine through the tables below; the
// CUDA backend's registry hands them out (cuda/kx-reload.cu, patches/0006), and
// llama/kx-reload-engine.cpp has a host engine (plain memcpy) for CPU-device slots, so the
// same balancer runs in tests on machines without a GPU.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kx_tam_config;
struct ggml_backend;

// one contiguous run of bytes: host source (registered with host_register) -> device dest
struct kx_row_copy {
    const void * src;
    void *       dst;
    uint64_t     bytes;
};

// one 32-bit store into device memory (slot map entries)
struct kx_i32_write {
    int32_t * dst;
    int32_t   value;
    int32_t   pad;
};

enum kx_reload_method {
    KX_RELOAD_GATHER = 0, // one kernel reads the host rows through mapped page-locked memory (zero-copy)
    KX_RELOAD_MEMCPY = 1, // one cudaMemcpyAsync per run (the copy engine)
    KX_RELOAD_BATCH  = 2, // one cudaMemcpyBatchAsync for all runs (CUDA >= 12.8)
};

// Three tables by concern, each handed out by the backend registry under its own name
// (CUDA: cuda/kx-reload.cu): the engine's copies ("kx_reload_iface"), the balancer's
// decision on the engine's stream ("kx_tam_iface"), and page-locking host memory
// ("kx_pin_iface", no engine needed). A backend may hand out the first alone.

// the engine: its copies into slots and its stores into slot maps
struct kx_reload_iface {
    // an engine for device `device` (ggml's device index): its stream, event, staging; NULL on failure
    void *  (*create)(int32_t device, int32_t method, int32_t max_blocks);
    void    (*destroy)(void * r);
    // makes [ptr, ptr+size) readable by gathers (page-locks and maps it unless it already is);
    // 0 ok, nonzero with a message on stderr
    int32_t (*host_register)(void * r, void * ptr, size_t size);
    // the device address of a host byte in a range host_register made readable (kernels read
    // the host rows through it: the slots' mapped share, kx-slots.h); NULL outside such ranges
    void *  (*host_addr)(void * r, const void * host);
    // queues the copies behind everything queued before; waits first if the previous batch
    // still runs (its staging is reused). 0 ok
    int32_t (*copy)(void * r, const struct kx_row_copy * c, int64_t n);
    // stores, done when it returns (between decodes: the next graph sees them). 0 ok
    int32_t (*write_i32)(void * r, const struct kx_i32_write * w, int64_t n);
    // 1 when every queued copy has finished, 0 while some run, < 0 on error
    int32_t (*query)(void * r);
    // blocks until every queued copy has finished; returns the seconds waited (< 0 on error)
    double  (*wait)(void * r);

    // The one-layer-ahead pipeline (llama/kx-pipeline.cpp): a layer's reloads are queued while
    // the previous layer computes and must not wait on other layers' batches. tag_copy
    // queues copies with the staging and completion event of `tag` (a hybrid layer), waiting
    // only for that tag's previous batch; tag_query: 1 when the tag's copies have landed, 0
    // while they run, < 0 on error; queue_write: stores not ordered after any copy (the caller
    // publishes only landed rows): queued on the stream of `reader` (a backend of the engine's
    // device: the one whose next work reads them), behind what is queued there and ahead of
    // what follows, without waiting on the host (its staging is reused once the stores queued
    // a few calls before have run); reader NULL: on a stream of their own, done when it returns.
    int32_t (*tag_copy)(void * r, int32_t tag, const struct kx_row_copy * c, int64_t n);
    int32_t (*tag_query)(void * r, int32_t tag);
    int32_t (*queue_write)(void * r, struct ggml_backend * reader, const struct kx_i32_write * w, int64_t n);
    // The scheduler trace (include/kx-trace.h) of the reloads: *t_us (µs, ggml_time_us) is
    // written when the engine's stream reaches this point, i.e. when what was queued before it
    // has finished (a host engine: now). Queued around a batch, the two stamps give when the
    // engine moved it, beside the decode's splits.
    void    (*mark)(void * r, int64_t * t_us);
};

// The balancer's decision for every hybrid layer on the device, queued on engine r's stream
// behind its copies (without this table the host decides). create: n [n_layers] groups and
// capacity per layer, initial [Σn] residency. launch queues one step: layer l's active ids
// (ascending or not, each < n[l]) at active[l], n_active[l] of them, and stalls [n_layers].
// fetch, after the engine's wait(), gives λ [n_layers], counts [2 n_layers] (loads,
// evictions), the kernel's time in µs, and *ids: layer l's loads, ascending, from
// (*ids)[2 off_l] and its evictions from (*ids)[2 off_l + n[l]] (off_l = n[0] + ... +
// n[l-1]), valid until the next launch.
// Why ids, not masks: a mask of every neuron each way cost the host a fill, a copy and a
// scan per neuron and decode (KB-70B: 2.3 M neurons, 3 masks), where the lists hold
// thousands (active) and tens (loads, evictions) per layer.
struct kx_tam_iface {
    void *  (*create)(void * r, const struct kx_tam_config * cfg, int32_t n_layers, const int32_t * n,
                      const int32_t * capacity, const uint8_t * initial);
    void    (*destroy)(void * t);
    int32_t (*launch)(void * r, void * t, const int32_t * const * active, const int32_t * n_active,
                      const int32_t * stalls);
    int32_t (*fetch)(void * t, const int32_t ** ids, float * lam, int32_t * counts, float * kernel_us);
    // back to create's state with residency initial [Σn], queued on engine r's stream (the
    // engine's wait() covers it); the last launch's results are dropped. 0 ok
    int32_t (*reset)(void * r, void * t, const uint8_t * initial);
};

// Page-locks [ptr, ptr+size) for every device, mapped: the host weights' buffer
// (llama/kx-host.cpp) after its pages exist. 0 ok, nonzero with a message on stderr. unpin
// undoes it before the pages go.
struct kx_pin_iface {
    int32_t (*pin)(void * ptr, size_t size);
    void    (*unpin)(void * ptr);
};

typedef const struct kx_reload_iface * (*kx_reload_iface_get_t)(void);
typedef const struct kx_tam_iface *    (*kx_tam_iface_get_t)(void);
typedef const struct kx_pin_iface *    (*kx_pin_iface_get_t)(void);

#ifdef __cplusplus
}
#endif
