// The CUDA reload engine (include/kx-reload.h): neuron rows from page-locked host memory into
// slot buffers on a stream of its own, by one of three transfer methods, and the synchronous
// slot-map stores that publish a finished reload. Handed to libllama by the CUDA registry as
// "kx_reload_iface" (patches/0006).
//
// Why a gather kernel: slot rows are scattered in the host weights (one 4-8 KiB row per
// neuron and matrix), and the copy engine moves small separate copies slowly
// (../shared/reference/hardware.md: 2.9 GB/s for random 8 KiB rows, 13 GB/s batched), while
// SM threads reading mapped page-locked memory keep enough PCIe reads in flight for
// 30-50 GB/s. The kernel's grid is capped (max_blocks) so it never holds more than a
// slice of the GPU beside the decode's kernels; the copy engines stay free for the
// decode's own transfers. bench/cuda/kx-reload-bench.cu measures the three methods.
#include "kx-reload.h"
#include "kx-ops-cuda.cuh"
#include "ggml-backend-impl.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#define KX_RELOAD_THREADS 256

#define KX_RELOAD_CHECK(x, ret)                                                              \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "kx reload: %s: %s\n", #x, cudaGetErrorString(e_));              \
            return ret;                                                                      \
        }                                                                                    \
    } while (0)

namespace {

struct kx_host_range {
    uintptr_t host;
    uintptr_t dev;
    size_t    size;
    bool      registered; // by us: unregistered at destroy
};

// page-locked descriptors a gather kernel reads, and the event after the batch using them
struct kx_reload_batch {
    kx_row_copy * staging = nullptr;
    int64_t staging_cap = 0;
    cudaEvent_t done = nullptr;
    bool pending = false;
};

// queue_write()'s staging: a ring, each entry reused once its stores have run
struct kx_write_stage {
    kx_i32_write * stage = nullptr;
    int64_t cap = 0;
    cudaEvent_t done = nullptr;
    bool pending = false;
};

// entries in the ring: a pipeline step queues one store per layer, so an entry comes back a few
// layer steps (hundreds of µs) later, long after its kernel ran
#define KX_RELOAD_WRITE_RING 4

struct kx_cuda_reload {
    int device = 0;
    int method = KX_RELOAD_GATHER;
    int max_blocks = 64;
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;            // after everything queued on the stream
    bool pending = false;
    std::vector<kx_host_range> ranges;     // sorted by host address
    kx_reload_batch whole;                 // copy(): one batch at a time
    std::vector<kx_reload_batch> tags;     // tag_copy(): one batch per tag
    kx_i32_write * wstage = nullptr;
    int64_t wstage_cap = 0;
    kx_write_stage ring[KX_RELOAD_WRITE_RING]; // queue_write()'s on a reader's stream
    int32_t ring_next = 0;
    cudaStream_t side = nullptr;           // queue_write()'s without a reader (created on first use)
    kx_i32_write * sstage = nullptr;
    int64_t sstage_cap = 0;
};

} // namespace

// each block walks copies b, b + grid, ...; 16-byte words where both ends are aligned
static __global__ void kx_reload_gather_kernel(const kx_row_copy * copies, int64_t n) {
    for (int64_t c = blockIdx.x; c < n; c += gridDim.x) {
        const kx_row_copy cp = copies[c];
        const char * src = (const char *) cp.src;
        char * dst = (char *) cp.dst;
        if ((((uintptr_t) src | (uintptr_t) dst) & 15) == 0) {
            const int64_t nw = (int64_t) (cp.bytes / 16);
            for (int64_t w = threadIdx.x; w < nw; w += blockDim.x) {
                ((uint4 *) dst)[w] = ((const uint4 *) src)[w];
            }
            for (int64_t b = nw * 16 + threadIdx.x; b < (int64_t) cp.bytes; b += blockDim.x) {
                dst[b] = src[b];
            }
        } else {
            for (int64_t b = threadIdx.x; b < (int64_t) cp.bytes; b += blockDim.x) {
                dst[b] = src[b];
            }
        }
    }
}

static __global__ void kx_reload_write_kernel(const kx_i32_write * w, int64_t n) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        *w[i].dst = w[i].value;
    }
}

// the device address of a host byte, through the registered range holding it; 0 if none
static uintptr_t kx_reload_dev_addr(const kx_cuda_reload & r, const void * host) {
    const uintptr_t h = (uintptr_t) host;
    auto it = std::upper_bound(r.ranges.begin(), r.ranges.end(), h,
                               [](uintptr_t v, const kx_host_range & x) { return v < x.host; });
    if (it == r.ranges.begin()) {
        return 0;
    }
    --it;
    return h < it->host + it->size ? it->dev + (h - it->host) : 0;
}

template <typename T>
static bool kx_reload_grow(T *& buf, int64_t & cap, int64_t n) {
    if (n <= cap) {
        return true;
    }
    const int64_t c = std::max<int64_t>(n, 2 * cap + 1024);
    cudaFreeHost(buf);
    buf = nullptr;
    cap = 0;
    if (cudaMallocHost((void **) &buf, (size_t) c * sizeof(T)) != cudaSuccess) {
        buf = nullptr;
        return false;
    }
    cap = c;
    return true;
}

static double kx_reload_wait(void * p) {
    auto * r = (kx_cuda_reload *) p;
    if (!r->pending) {
        return 0.0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    KX_RELOAD_CHECK(cudaEventSynchronize(r->done), -1.0);
    r->pending = false;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

static int32_t kx_reload_query(void * p) {
    auto * r = (kx_cuda_reload *) p;
    if (!r->pending) {
        return 1;
    }
    const cudaError_t e = cudaEventQuery(r->done);
    if (e == cudaSuccess) {
        r->pending = false;
        return 1;
    }
    if (e == cudaErrorNotReady) {
        return 0;
    }
    fprintf(stderr, "kx reload: cudaEventQuery: %s\n", cudaGetErrorString(e));
    return -1;
}

static void kx_reload_destroy(void * p) {
    auto * r = (kx_cuda_reload *) p;
    if (!r) {
        return;
    }
    cudaSetDevice(r->device);
    if (r->stream) {
        cudaStreamSynchronize(r->stream);
    }
    for (const kx_host_range & x : r->ranges) {
        if (x.registered) {
            cudaHostUnregister((void *) x.host);
        }
    }
    if (r->side) {
        cudaStreamSynchronize(r->side);
        cudaStreamDestroy(r->side);
    }
    for (kx_write_stage & w : r->ring) {
        if (w.done) {
            cudaEventSynchronize(w.done); // its kernel reads the staging
            cudaEventDestroy(w.done);
        }
        cudaFreeHost(w.stage);
    }
    r->tags.push_back(r->whole);
    for (const kx_reload_batch & b : r->tags) {
        cudaFreeHost(b.staging);
        if (b.done && b.done != r->done) {
            cudaEventDestroy(b.done);
        }
    }
    cudaFreeHost(r->wstage);
    cudaFreeHost(r->sstage);
    if (r->done) {
        cudaEventDestroy(r->done);
    }
    if (r->stream) {
        cudaStreamDestroy(r->stream);
    }
    delete r;
}

static void * kx_reload_create(int32_t device, int32_t method, int32_t max_blocks) {
    if (method < KX_RELOAD_GATHER || method > KX_RELOAD_BATCH || max_blocks <= 0) {
        fprintf(stderr, "kx reload: bad method %d or block cap %d\n", (int) method, (int) max_blocks);
        return nullptr;
    }
#if CUDART_VERSION < 12080
    if (method == KX_RELOAD_BATCH) {
        fprintf(stderr, "kx reload: cudaMemcpyBatchAsync needs CUDA 12.8 or newer\n");
        return nullptr;
    }
#endif
    auto * r = new kx_cuda_reload;
    r->device = device;
    r->method = method;
    r->max_blocks = max_blocks;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming) != cudaSuccess) {
        fprintf(stderr, "kx reload: cannot create a stream on device %d\n", (int) device);
        kx_reload_destroy(r);
        return nullptr;
    }
    return r;
}

static int32_t kx_reload_host_register(void * p, void * ptr, size_t size) {
    auto * r = (kx_cuda_reload *) p;
    if (!ptr || size == 0) {
        return 1;
    }
    KX_RELOAD_CHECK(cudaSetDevice(r->device), 2);
    if (kx_reload_dev_addr(*r, ptr) && kx_reload_dev_addr(*r, (const char *) ptr + size - 1)) {
        return 0; // already covered
    }
    kx_host_range x = { (uintptr_t) ptr, 0, size, false };
    void * dev = nullptr;
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, ptr) == cudaSuccess && at.type == cudaMemoryTypeHost) {
        // page-locked already (a CUDA host buffer): only its device address is needed
        KX_RELOAD_CHECK(cudaHostGetDevicePointer(&dev, ptr, 0), 3);
    } else {
        cudaGetLastError(); // cudaPointerGetAttributes may leave an error for plain memory
        KX_RELOAD_CHECK(cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped), 4);
        x.registered = true;
        KX_RELOAD_CHECK(cudaHostGetDevicePointer(&dev, ptr, 0), 5);
    }
    x.dev = (uintptr_t) dev;
    r->ranges.insert(std::upper_bound(r->ranges.begin(), r->ranges.end(), x,
                                      [](const kx_host_range & a, const kx_host_range & b) { return a.host < b.host; }),
                     x);
    return 0;
}

// queues the copies on the reload stream with batch b's staging (whose last use must have
// finished), then records b's event and the stream's
static int32_t kx_reload_launch(kx_cuda_reload * r, kx_reload_batch & b, const kx_row_copy * c, int64_t n) {
    switch (r->method) {
        case KX_RELOAD_GATHER: {
            if (!kx_reload_grow(b.staging, b.staging_cap, n)) {
                return 4;
            }
            for (int64_t i = 0; i < n; ++i) {
                const uintptr_t s = kx_reload_dev_addr(*r, c[i].src);
                if (!s) {
                    fprintf(stderr, "kx reload: source %p was not registered\n", c[i].src);
                    return 5;
                }
                b.staging[i] = { (const void *) s, c[i].dst, c[i].bytes };
            }
            kx_row_copy * d_copies = nullptr;
            KX_RELOAD_CHECK(cudaHostGetDevicePointer((void **) &d_copies, b.staging, 0), 6);
            const int grid = (int) std::min<int64_t>(n, r->max_blocks);
            kx_reload_gather_kernel<<<grid, KX_RELOAD_THREADS, 0, r->stream>>>(d_copies, n);
            KX_RELOAD_CHECK(cudaGetLastError(), 7);
            break;
        }
        case KX_RELOAD_MEMCPY:
            for (int64_t i = 0; i < n; ++i) {
                KX_RELOAD_CHECK(cudaMemcpyAsync(c[i].dst, c[i].src, c[i].bytes, cudaMemcpyHostToDevice, r->stream), 8);
            }
            break;
        case KX_RELOAD_BATCH: {
#if CUDART_VERSION >= 12080
            std::vector<void *> dsts(n);
            std::vector<const void *> srcs(n);
            std::vector<size_t> sizes(n);
            for (int64_t i = 0; i < n; ++i) {
                dsts[i] = c[i].dst;
                srcs[i] = c[i].src;
                sizes[i] = c[i].bytes;
            }
            cudaMemcpyAttributes attr = {};
            attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
            size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
            KX_RELOAD_CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), (size_t) n, &attr,
                                                 &attr_idx, 1, r->stream), 9);
#else
            size_t fail_idx = 0;
            KX_RELOAD_CHECK(cudaMemcpyBatchAsync(dsts.data(), (void **) srcs.data(), sizes.data(), (size_t) n, &attr,
                                                 &attr_idx, 1, &fail_idx, r->stream), 9);
#endif
#endif
            break;
        }
    }
    if (b.done != r->done) {
        KX_RELOAD_CHECK(cudaEventRecord(b.done, r->stream), 10);
        b.pending = true;
    }
    KX_RELOAD_CHECK(cudaEventRecord(r->done, r->stream), 10);
    r->pending = true;
    return 0;
}

static int32_t kx_reload_copy(void * p, const kx_row_copy * c, int64_t n) {
    auto * r = (kx_cuda_reload *) p;
    if (n <= 0) {
        return 0;
    }
    KX_RELOAD_CHECK(cudaSetDevice(r->device), 2);
    if (kx_reload_wait(r) < 0) { // the staging below is still read by the last batch
        return 3;
    }
    r->whole.done = r->done;
    return kx_reload_launch(r, r->whole, c, n);
}

// 1 when tag's batch has finished (or none was queued), 0 while it runs, < 0 on error
static int32_t kx_reload_tag_query(void * p, int32_t tag) {
    auto * r = (kx_cuda_reload *) p;
    if (tag < 0 || tag >= (int32_t) r->tags.size() || !r->tags[tag].pending) {
        return 1;
    }
    const cudaError_t e = cudaEventQuery(r->tags[tag].done);
    if (e == cudaSuccess) {
        r->tags[tag].pending = false;
        return 1;
    }
    if (e == cudaErrorNotReady) {
        return 0;
    }
    fprintf(stderr, "kx reload: cudaEventQuery: %s\n", cudaGetErrorString(e));
    return -1;
}

static int32_t kx_reload_tag_copy(void * p, int32_t tag, const kx_row_copy * c, int64_t n) {
    auto * r = (kx_cuda_reload *) p;
    if (tag < 0) {
        return 1;
    }
    if (n <= 0) {
        return 0;
    }
    KX_RELOAD_CHECK(cudaSetDevice(r->device), 2);
    if (tag >= (int32_t) r->tags.size()) {
        r->tags.resize(tag + 1);
    }
    kx_reload_batch & b = r->tags[tag];
    if (!b.done) {
        KX_RELOAD_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming), 3);
    }
    if (b.pending) { // the tag's staging is still read by its last batch
        KX_RELOAD_CHECK(cudaEventSynchronize(b.done), 3);
        b.pending = false;
    }
    return kx_reload_launch(r, b, c, n);
}

// queues the stores w on `stream` through page-locked staging (whose last reader must have
// finished): a kernel reads them from host memory
static int32_t kx_reload_store_queue(cudaStream_t stream, kx_i32_write *& stage, int64_t & cap,
                                     const kx_i32_write * w, int64_t n) {
    if (!kx_reload_grow(stage, cap, n)) {
        return 4;
    }
    std::copy(w, w + n, stage);
    kx_i32_write * d_w = nullptr;
    KX_RELOAD_CHECK(cudaHostGetDevicePointer((void **) &d_w, stage, 0), 6);
    kx_reload_write_kernel<<<(unsigned) ((n + 255) / 256), 256, 0, stream>>>(d_w, n);
    KX_RELOAD_CHECK(cudaGetLastError(), 7);
    return 0;
}

// stores w through staging on `stream`, done when it returns
static int32_t kx_reload_store(cudaStream_t stream, kx_i32_write *& stage, int64_t & cap,
                               const kx_i32_write * w, int64_t n) {
    const int32_t rc = kx_reload_store_queue(stream, stage, cap, w, n);
    if (rc == 0) {
        KX_RELOAD_CHECK(cudaStreamSynchronize(stream), 8);
    }
    return rc;
}

static int32_t kx_reload_write_i32(void * p, const kx_i32_write * w, int64_t n) {
    auto * r = (kx_cuda_reload *) p;
    if (n <= 0) {
        return 0;
    }
    KX_RELOAD_CHECK(cudaSetDevice(r->device), 2);
    // ordered after the copies queued before (a map entry is published after its rows land)
    const int32_t rc = kx_reload_store(r->stream, r->wstage, r->wstage_cap, w, n);
    if (rc == 0) {
        r->pending = false;
        for (kx_reload_batch & b : r->tags) {
            b.pending = false;
        }
    }
    return rc;
}

// Stored by a kernel on the reader's stream: the device's next split sees them without the host
// waiting (a store on a side stream waited for took 18-19 µs of each pipeline step on the H200)
static int32_t kx_reload_queue_write(void * p, ggml_backend * reader, const kx_i32_write * w, int64_t n) {
    auto * r = (kx_cuda_reload *) p;
    if (n <= 0) {
        return 0;
    }
    KX_RELOAD_CHECK(cudaSetDevice(r->device), 2);
    if (!reader) {
        if (!r->side) {
            KX_RELOAD_CHECK(cudaStreamCreateWithFlags(&r->side, cudaStreamNonBlocking), 3);
        }
        return kx_reload_store(r->side, r->sstage, r->sstage_cap, w, n);
    }
    cudaStream_t stream = ((ggml_backend_cuda_context *) reader->context)->stream();
    kx_write_stage & s = r->ring[r->ring_next];
    r->ring_next = (r->ring_next + 1) % KX_RELOAD_WRITE_RING;
    if (!s.done) {
        KX_RELOAD_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming), 3);
    }
    if (s.pending) {
        KX_RELOAD_CHECK(cudaEventSynchronize(s.done), 3);
        s.pending = false;
    }
    const int32_t rc = kx_reload_store_queue(stream, s.stage, s.cap, w, n);
    if (rc != 0) {
        return rc;
    }
    KX_RELOAD_CHECK(cudaEventRecord(s.done, stream), 8);
    s.pending = true;
    return 0;
}

static void * kx_reload_tam_new(void * p, const kx_tam_config * cfg, int32_t n_layers, const int32_t * n,
                                const int32_t * capacity, const uint8_t * initial) {
    auto * r = (kx_cuda_reload *) p;
    if (cudaSetDevice(r->device) != cudaSuccess) {
        return nullptr;
    }
    return ggml_cuda_kx_tam_batch_new(cfg, n_layers, n, capacity, initial);
}

static int32_t kx_reload_tam_launch(void * p, void * t, const int32_t * const * active, const int32_t * n_active,
                                    const int32_t * stalls) {
    auto * r = (kx_cuda_reload *) p;
    KX_RELOAD_CHECK(cudaSetDevice(r->device), 2);
    if (ggml_cuda_kx_tam_batch_launch(t, r->stream, active, n_active, stalls)) {
        return 3;
    }
    KX_RELOAD_CHECK(cudaEventRecord(r->done, r->stream), 4);
    r->pending = true;
    return 0;
}

static int32_t kx_reload_tam_reset(void * p, void * t, const uint8_t * initial) {
    auto * r = (kx_cuda_reload *) p;
    KX_RELOAD_CHECK(cudaSetDevice(r->device), 2);
    if (ggml_cuda_kx_tam_batch_reset(t, r->stream, initial)) {
        return 3;
    }
    KX_RELOAD_CHECK(cudaEventRecord(r->done, r->stream), 4);
    r->pending = true;
    return 0;
}

static void * kx_reload_host_addr(void * p, const void * host) {
    return p ? (void *) kx_reload_dev_addr(*(const kx_cuda_reload *) p, host) : nullptr;
}

static int32_t kx_reload_host_pin(void * ptr, size_t size) {
    // portable: the engines of every device see it; mapped: gathers and the mapped share
    // read it through its device address (kx_reload_host_register finds it page-locked)
    KX_RELOAD_CHECK(cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped), 1);
    return 0;
}

static void kx_reload_host_unpin(void * ptr) {
    if (cudaHostUnregister(ptr) != cudaSuccess) {
        cudaGetLastError(); // a range that was never locked: nothing to undo
    }
}

// only while the scheduler trace records (an event on the engine's stream, kx-trace-mark.cu)
static void kx_reload_mark(void * p, int64_t * t_us) {
    auto * r = (kx_cuda_reload *) p;
    if (cudaSetDevice(r->device) != cudaSuccess || ggml_cuda_kx_stamp(r->stream, t_us) != cudaSuccess) {
        (void) cudaGetLastError(); // an unstamped record is left out of the trace (t1 stays 0)
    }
}

static const kx_reload_iface kx_cuda_reload_iface_v = {
    kx_reload_create, kx_reload_destroy, kx_reload_host_register, kx_reload_host_addr, kx_reload_copy,
    kx_reload_write_i32, kx_reload_query, kx_reload_wait,
    kx_reload_tag_copy, kx_reload_tag_query, kx_reload_queue_write, kx_reload_mark,
};

static const kx_tam_iface kx_cuda_tam_iface_v = {
    kx_reload_tam_new, ggml_cuda_kx_tam_batch_free, kx_reload_tam_launch, ggml_cuda_kx_tam_batch_fetch,
    kx_reload_tam_reset,
};

static const kx_pin_iface kx_cuda_pin_iface_v = {
    kx_reload_host_pin, kx_reload_host_unpin,
};

const kx_reload_iface * ggml_cuda_kx_reload_iface(void) {
    return &kx_cuda_reload_iface_v;
}

const kx_tam_iface * ggml_cuda_kx_tam_iface(void) {
    return &kx_cuda_tam_iface_v;
}

const kx_pin_iface * ggml_cuda_kx_pin_iface(void) {
    return &kx_cuda_pin_iface_v;
}
