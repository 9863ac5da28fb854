// Warming the host's caches with the next layer's rows while the CPU waits for the device.
//
// A hybrid layer step is: the device's serial part (the previous FFN's sum, attention, norm,
// predictor, select: ~70-80 µs for KB-7B on the H200) while the host threads wait, then the
// host part reading ~9 MB of scattered rows at the host's read roof (~70-80 GB/s, 100-120 µs)
// beside the device's slot part. The host is idle for the first and memory-bound in the
// second, so rows that the second will read are pulled into the caches during the first.
//
// Which rows: layer il+1's active set is predicted during layer il, beside its host part, on
// the device (the pack's predictor of il+1 applied to il's FFN input; the residual stream
// changes little from one layer to the next), and its select writes the list straight into
// page-locked host memory (ggml_kx_select_to_host): no scheduler copy, no wait.
//
// When: the first node of layer il+1's CPU split is this op, named "kx_warm". The scheduler
// (patch 0012, kx-trace.h) then starts the split without waiting for the device; thread 0
// polls the device between its rows and waits for it, the other threads stop as soon as it
// has (kx_sched_drain_done). The host part then reads from the caches what was warmed. The
// warm-up only reads: whatever it gets wrong costs bandwidth, never a result.
//
// Each thread warms the rows of its own share of the predicted host-side neurons, in the
// order the host op's first pass splits the real list (an even split of the neurons present
// on the host, in list order), and the host op then keeps each thread on its own share
// (ggml_kx_ffn_rows_own_shares), so most rows are in the L2 of the core that reads them: all
// gate rows first, then the up and down rows (ReLU reads those only for neurons that fire,
// about half of the listed ones). Measured (H200, bench/results/archive/balance-live/warm/): KB-7B's
// slowest host loop 110-113 -> 82 µs per layer with own shares, but 117-126 µs when any free
// thread took the next chunk (lines another core pulled in read slower than DRAM there); the
// decode 1.05-1.20x (KB-7B), 1.03-1.28x (KB-13B). On by default; kx_params::warm = false turns it off.
#include "kx-warm.h"
#include "kx-slots.h"
#include "kx-stats.h"

#include "kairox.h"

#include "kx-trace.h"

#include <atomic>
#include <cstdint>

// counters (kx_warm_stats): calls, calls with a predicted list, rows and bytes read ahead
enum { KX_WARM_CALLS, KX_WARM_LISTS, KX_WARM_ROWS, KX_WARM_BYTES, KX_WARM_N_STATS };
static std::atomic<int64_t> kx_warm_stat[KX_WARM_N_STATS];

void kx_warm_stats(int64_t * out, bool reset) {
    kx_stats_read(kx_warm_stat, out, reset);
}

// reads one word per cache line of a row: the loads are independent, so the core keeps
// many lines in flight and the hardware prefetcher follows the row
static uint64_t kx_warm_row(const char * row, size_t nb) {
    uint64_t acc = 0;
    for (size_t o = 0; o < nb; o += 64) {
        acc ^= *(const uint64_t *) (row + o);
    }
    return acc;
}

static volatile uint64_t kx_warm_sink; // keeps the loads

void kx_warm_op(ggml_tensor *, const ggml_tensor *, int ith, int nth, void * userdata) {
    const kx_warm_hook * h = (const kx_warm_hook *) userdata;
    int32_t * host = h->L->ahead;
    const bool have = host && __atomic_load_n(host, __ATOMIC_ACQUIRE) == 1;
    if (ith == 0) {
        kx_warm_stat[KX_WARM_CALLS] += 1;
        kx_warm_stat[KX_WARM_LISTS] += have;
    }
    // thread 0 checks the device every few rows (a query costs ~1 µs), the others every row
    auto stop = [&](int64_t rows) {
        if (ith != 0) {
            return kx_sched_drain_done();
        }
        return rows % 4 == 0 && !kx_sched_drain_busy();
    };
    int64_t rows = 0;
    int64_t bytes = 0;
    if (have) {
        const int32_t   count = host[1];
        const int32_t * ids   = host + 2;
        const int32_t * cmap  = (const int32_t *) h->L->coldmap->data;
        const int32_t * dmap  = (const int32_t *) h->L->colddown->data;
        int64_t total = 0;
        for (int32_t j = 0; j < count; ++j) {
            total += cmap[ids[j]] >= 0;
        }
        const int64_t r0 = total*ith/nth;
        const int64_t r1 = total*(ith + 1)/nth;
        uint64_t acc = 0;
        int32_t j0 = 0; // where rank r0 starts in the list (found in pass 0, reused in pass 1)
        // pass 0: gate rows; pass 1: up and down rows
        for (int pass = 0; pass < 2; ++pass) {
            int64_t r = pass == 0 ? 0 : r0;
            for (int32_t j = j0; j < count && r < r1; ++j) {
                const int32_t i   = ids[j];
                const int32_t row = cmap[i];
                if (row < 0 || r++ < r0) {
                    continue;
                }
                if (pass == 0 && r == r0 + 1) {
                    j0 = j;
                }
                if (stop(rows)) {
                    goto done;
                }
                if (pass == 0) {
                    acc ^= kx_warm_row((const char *) h->gate->data + (size_t) row*h->gate->nb[1], h->gate->nb[1]);
                    bytes += (int64_t) h->gate->nb[1];
                } else {
                    acc ^= kx_warm_row((const char *) h->up->data + (size_t) row*h->up->nb[1], h->up->nb[1]);
                    acc ^= kx_warm_row((const char *) h->down->data + (size_t) dmap[i]*h->down->nb[1], h->down->nb[1]);
                    bytes += (int64_t) (h->up->nb[1] + h->down->nb[1]);
                }
                ++rows;
            }
        }
done:
        kx_warm_sink = acc;
    }
    if (ith == 0) {
        kx_sched_drain_pending();
        if (have) {
            __atomic_store_n(host, 0, __ATOMIC_RELEASE); // used: the next token's list sets it again
        }
    }
    kx_warm_stat[KX_WARM_ROWS]  += rows;
    kx_warm_stat[KX_WARM_BYTES] += bytes;
}
