// The pack's integrity checks: checksums over every tensor and the header, and finite
// values in the rows the FFN reads (docs/pack-format.md, "Checksums"). The reference is
// python/kairox/pack.py (_check_sums, first_nonfinite_row); tests damage packs both read.
#include "kx-pack.h"

#define XXH_INLINE_ALL // header-only: llama.cpp's vendored xxHash, nothing else links it
#include "hash/xxhash/xxhash.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

uint64_t kx_xxh3(const void * data, size_t n) {
    return (uint64_t) XXH3_64bits(data, n);
}

namespace {

// true when any of n values has an all-ones exponent (inf or NaN): an OR over the row, no
// branch per value, so the compiler can vectorize it
bool any_nonfinite_f16(const uint16_t * h, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        bad |= (uint32_t) ((h[i] & 0x7c00u) == 0x7c00u);
    }
    return bad != 0;
}

bool any_nonfinite_f32(const uint32_t * f, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        bad |= (uint32_t) ((f[i] & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
}

} // namespace

int64_t kx_first_nonfinite_row(const ggml_tensor * t, const void * data) {
    const int64_t n_rows = ggml_nrows(t);
    const size_t  row    = ggml_row_size(t->type, t->ne[0]);
    const uint8_t * p = (const uint8_t *) data;
    for (int64_t r = 0; r < n_rows; ++r, p += row) {
        bool bad = false;
        switch (t->type) {
            case GGML_TYPE_F32:
                bad = any_nonfinite_f32((const uint32_t *) p, t->ne[0]);
                break;
            case GGML_TYPE_F16:
                bad = any_nonfinite_f16((const uint16_t *) p, t->ne[0]);
                break;
            case GGML_TYPE_Q8_0:
            case GGML_TYPE_Q4_K:
            case GGML_TYPE_Q6_K: {
                // only a block's F16 scales can be non-finite, the quants are integers:
                // block_q8_0 and block_q4_K start with theirs (d; d, dmin), block_q6_K ends with d
                const size_t bs = ggml_type_size(t->type);
                const size_t at = t->type == GGML_TYPE_Q6_K ? bs - 2 : 0;
                const int    ns = t->type == GGML_TYPE_Q4_K ? 2 : 1;
                for (size_t b = 0; b < row && !bad; b += bs) {
                    for (int k = 0; k < ns; ++k) {
                        uint16_t d;
                        std::memcpy(&d, p + b + at + 2*k, sizeof(d));
                        bad |= (d & 0x7c00u) == 0x7c00u;
                    }
                }
                break;
            }
            default:
                return -1; // integer tensors; pack versions allow no other float types here
        }
        if (bad) {
            return r;
        }
    }
    return -1;
}

void kx_parallel_for(int64_t n, const std::function<void(int64_t)> & fn) {
    const int64_t n_threads = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
    std::atomic<int64_t> next{0};
    std::exception_ptr first;
    std::mutex mu;
    auto work = [&]() {
        for (int64_t i; (i = next.fetch_add(1)) < n; ) {
            try {
                fn(i);
            } catch (...) {
                std::lock_guard<std::mutex> lock(mu);
                if (!first) {
                    first = std::current_exception();
                }
                next = n; // stop handing out work
            }
        }
    };
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < n_threads; ++t) {
        pool.emplace_back(work);
    }
    work();
    for (auto & th : pool) {
        th.join();
    }
    if (first) {
        std::rethrow_exception(first);
    }
}
