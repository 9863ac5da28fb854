// Host memory for weights that the CPU reads row by row (the hybrid's host-side FFN tensors,
// the pack's transposed down rows): anonymous memory asked to come in 2 MiB pages
// (transparent huge pages, MADV_HUGEPAGE), page-locked and mapped for the GPUs when the
// buffer type is the pinned one (include/kairox.h: kx_host_buffer_type).
//
// Why: the host op reads each token's active rows scattered over a layer's matrices, one
// 4.5-8.5 KiB row per neuron and matrix out of hundreds of MiB per layer (KB-70B: 132 MiB
// of gate rows). With 4 KiB pages almost every row misses the TLB and spans two or three
// pages: a page walk each, and the hardware prefetcher stops at every page boundary. The
// model loaded from its file is in 4 KiB page-cache pages and cudaMallocHost does not ask
// for huge pages either. Measured on a 2-core development VM (random rows of a 16 GiB
// buffer, AVX-512 reads, 2 threads): 4608-byte rows 13.4-14.1 GB/s with 4 KiB pages and
// 17.9-18.9 GB/s with 2 MiB pages; 8704-byte rows 17.8-18.8 against 21.6-22.2 GB/s.
//
// Where the kernel gives no huge pages (transparent_hugepage "never") the memory is simply
// small-paged.
#include "kairox.h"
#include "kx-reload-engine.h"

#include "ggml-backend-impl.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>

namespace {

constexpr size_t KX_HOST_PAGE  = 2u << 20; // the huge page the mapping is aligned to
constexpr size_t KX_HOST_ALIGN = 64;       // tensor alignment (ggml_aligned_malloc's)

std::atomic<int64_t> kx_host_pageable{0};

size_t kx_host_len(size_t size) {
    return (size + KX_HOST_PAGE - 1) / KX_HOST_PAGE * KX_HOST_PAGE;
}

// 2 MiB-aligned anonymous memory of kx_host_len(size) bytes, advised to come in huge pages
void * kx_host_map(size_t size) {
    const size_t len = kx_host_len(size);
    // over-map by one huge page, then trim both ends: the kept range starts on a 2 MiB boundary
    void * raw = mmap(nullptr, len + KX_HOST_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        return nullptr;
    }
    const uintptr_t r = (uintptr_t) raw;
    const uintptr_t p = (r + KX_HOST_PAGE - 1) / KX_HOST_PAGE * KX_HOST_PAGE;
    if (p > r) {
        munmap(raw, p - r);
    }
    if (p + len < r + len + KX_HOST_PAGE) {
        munmap((void *) (p + len), r + len + KX_HOST_PAGE - (p + len));
    }
    // before the first touch: the pages are chosen when they fault in
    if (madvise((void *) p, len, MADV_HUGEPAGE) != 0) {
        static std::once_flag once;
        std::call_once(once, [] { fprintf(stderr, "kairox: no transparent huge pages here: host weights in 4 KiB pages\n"); });
    }
    return (void *) p;
}

struct kx_host_type {
    ggml_backend_buffer_type buft;
    bool pinned;
    int32_t faults; // KX_FAULT_HOST_LOCK | KX_FAULT_HOST_MAP bits (tests)
};

void kx_host_buffer_free(ggml_backend_buffer_t buffer) {
    void * p = buffer->context; // the CPU from-pointer buffer's base
    const auto * t = (const kx_host_type *) buffer->buft->context;
    if (t->pinned) {
        if (const kx_pin_iface * pin = kx_reload_pinning()) {
            pin->unpin(p);
        }
    }
    munmap(p, kx_host_len(buffer->size));
}

const char * kx_host_buft_name(ggml_backend_buffer_type_t buft) {
    return ((const kx_host_type *) buft->context)->pinned ? "KX_Host_Pinned" : "KX_Host";
}

ggml_backend_buffer_t kx_host_buft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    if (size == 0) {
        return ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), 0);
    }
    const auto * t = (const kx_host_type *) buft->context;
    void * p = t->faults & KX_FAULT_HOST_MAP ? nullptr : kx_host_map(size);
    if (!p) {
        fprintf(stderr, "kairox: cannot map %.2f MiB of host memory\n", size / 1048576.0);
        return nullptr;
    }
    if (t->pinned) {
        const kx_pin_iface * pin = kx_reload_pinning();
        // locking faults every page in (as huge pages where advised); without it the buffer
        // still works, its GPU copies then go through the driver's staging
        if (pin && ((t->faults & KX_FAULT_HOST_LOCK) || pin->pin(p, kx_host_len(size)) != 0)) {
            fprintf(stderr, "kairox: %.2f MiB of host weights stay pageable (locking failed)\n", size / 1048576.0);
            kx_host_pageable += (int64_t) size; // (a client that hides the load's output reads this)
        }
    }
    ggml_backend_buffer_t buffer = ggml_backend_cpu_buffer_from_ptr(p, size);
    buffer->buft = buft;
    buffer->iface.free_buffer = kx_host_buffer_free;
    return buffer;
}

size_t kx_host_buft_alignment(ggml_backend_buffer_type_t) {
    return KX_HOST_ALIGN;
}

bool kx_host_buft_is_host(ggml_backend_buffer_type_t) {
    return true;
}

kx_host_type kx_host_make(bool pinned, int32_t faults) {
    kx_host_type t = {};
    t.buft.iface = {
        /* .get_name       = */ kx_host_buft_name,
        /* .alloc_buffer   = */ kx_host_buft_alloc,
        /* .get_alignment  = */ kx_host_buft_alignment,
        /* .get_max_size   = */ nullptr,
        /* .get_alloc_size = */ nullptr,
        /* .is_host        = */ kx_host_buft_is_host,
    };
    // the CPU device, as the CPU buffer type's own: its backend runs the ops reading the weights
    t.buft.device = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    t.pinned = pinned;
    t.faults = faults;
    return t;
}

} // namespace

int64_t kx_host_pageable_bytes(void) {
    return kx_host_pageable.load();
}

ggml_backend_buffer_type_t kx_host_buffer_type(bool pinned, int32_t faults) {
    // a type per combination: ggml compares buffer types by address
    constexpr int32_t host_faults = KX_FAULT_HOST_LOCK | KX_FAULT_HOST_MAP;
    static kx_host_type types[2][host_faults + 1] = {};
    static std::once_flag once;
    std::call_once(once, [] {
        for (int32_t p = 0; p < 2; ++p) {
            for (int32_t f = 0; f <= host_faults; ++f) {
                types[p][f] = kx_host_make(p == 1, f & host_faults);
                types[p][f].buft.context = &types[p][f];
            }
        }
    });
    return &types[pinned ? 1 : 0][faults & host_faults].buft;
}
