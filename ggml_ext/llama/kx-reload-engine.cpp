// The engines that move rows into slots (kx-reload-engine.h): the device backend's own, or the
// host engine below for CPU-device slots (tests on machines without a GPU).
#include "kx-reload-engine.h"
#include "kx-pack.h"

#include "ggml-backend.h"
#include "kx-trace.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

// CPU-device slots live in host memory: copies are done when queued. It keeps the balancer's
// ordering (commit at the next boundary), so CPU-device tests walk the same states.
static void *  kx_host_create(int32_t, int32_t, int32_t) { static int32_t tag; return &tag; }
static void    kx_host_destroy(void *) {}
static int32_t kx_host_register(void *, void *, size_t) { return 0; }
static int32_t kx_host_copy(void *, const kx_row_copy * c, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        std::memcpy(c[i].dst, c[i].src, c[i].bytes);
    }
    return 0;
}
static int32_t kx_host_write_i32(void *, const kx_i32_write * w, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        *w[i].dst = w[i].value;
    }
    return 0;
}
static int32_t kx_host_query(void *) { return 1; }
static double  kx_host_wait(void *) { return 0.0; }
static int32_t kx_host_tag_copy(void * r, int32_t, const kx_row_copy * c, int64_t n) { return kx_host_copy(r, c, n); }
static int32_t kx_host_tag_query(void *, int32_t) { return 1; }
static void *  kx_host_addr(void *, const void * host) { return const_cast<void *>(host); }
static int32_t kx_host_queue_write(void * r, ggml_backend *, const kx_i32_write * w, int64_t n) {
    return kx_host_write_i32(r, w, n);
}

static void    kx_host_mark(void *, int64_t * t_us) { *t_us = ggml_time_us(); }

static const kx_reload_iface kx_host_reload = {
    kx_host_create, kx_host_destroy, kx_host_register, kx_host_addr, kx_host_copy, kx_host_write_i32, kx_host_query,
    kx_host_wait, kx_host_tag_copy, kx_host_tag_query, kx_host_queue_write, kx_host_mark,
};

int32_t kx_reload_queue(const kx_reload_iface * io, void * engine, int32_t tag, int32_t il,
                        const kx_row_copy * c, int64_t n) {
    kx_trace_rec * rec = nullptr;
    if (n > 0 && kx_trace_enabled()) { // the boundary queues empty batches too
        int64_t bytes = 0;
        for (int64_t i = 0; i < n; ++i) {
            bytes += (int64_t) c[i].bytes;
        }
        rec = kx_trace_add_reload(il, n, bytes);
    }
    if (rec) {
        io->mark(engine, &rec->t0);
    }
    const int32_t rc = tag < 0 ? io->copy(engine, c, n) : io->tag_copy(engine, tag, c, n);
    if (rec && rc == 0) {
        io->mark(engine, &rec->t1);
    }
    return rc;
}


// the table the registry of device `device`'s backend hands out under `name`, or nullptr
template <typename T>
static const T * kx_reload_table(const std::string & device, const char * name) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(device.c_str());
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto get = reg ? (const T * (*)(void)) ggml_backend_reg_get_proc_address(reg, name) : nullptr;
    return get ? get() : nullptr;
}

const kx_reload_iface * kx_reload_engine(const std::string & device, int32_t * index) {
    if (device == "CPU") {
        *index = 0;
        return &kx_host_reload;
    }
    const kx_reload_iface * io = kx_reload_table<kx_reload_iface>(device, "kx_reload_iface");
    if (!io) {
        throw std::runtime_error(kx_fmt("the %s backend cannot reload slots", device.c_str()));
    }
    size_t k = device.size();
    while (k > 0 && device[k - 1] >= '0' && device[k - 1] <= '9') {
        --k;
    }
    *index = k < device.size() ? std::atoi(device.c_str() + k) : 0;
    return io;
}

const kx_tam_iface * kx_reload_decision(const std::string & device) {
    return device == "CPU" ? nullptr : kx_reload_table<kx_tam_iface>(device, "kx_tam_iface");
}

const kx_pin_iface * kx_reload_pinning() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            return kx_reload_table<kx_pin_iface>(ggml_backend_dev_name(dev), "kx_pin_iface");
        }
    }
    return nullptr;
}
