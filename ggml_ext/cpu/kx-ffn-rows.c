// GGML_OP_KX_FFN_ROWS on the CPU: a whole sparse FFN over the listed neurons in one node,
//
//   y[:, t] = sum over i in sel with map[i] >= 0 of  act(g_it) * u_it * down_t[dmap[i]]
//   g_it = gate[map[i]] . x_t  (or gpre[i, t] when the exact path computed every gate)
//   u_it = up[map[i]] . x_t
//
// Why one node: the four-node form (rows of gate, rows of up, GLU, axpy) costs three
// barriers per layer and its axpy splits the OUTPUT columns, so every thread walks every
// listed row for a 512-byte slice of it (a latency-bound walk of 16 threads over the same
// rows). Here each thread owns a contiguous share of the listed neurons and streams their
// gate, up and down rows itself (24 KiB per neuron of an F16 4096-wide model), summing into
// a private accumulator; one barrier later the threads add the accumulators column-wise.
//
// Determinism: each accumulator's neurons depend only on the list, the map and the thread
// count (one pass, SiLU/GELU: a thread's even split of the neurons present in this weight,
// counted per static slice of the list before the first barrier; two passes, ReLU: a
// chunk's, whichever thread takes it), and the column sums add the accumulators in order,
// so a graph gives the same bits every time it runs with the same threads.
//
// The activation is ggml's own vector GLU on blocks of KX_FFN_BLK neurons: element-wise,
// so each neuron gets what the dense path's GLU op computes for it.
//
// ReLU: a neuron whose gate is not positive for any token contributes exactly 0 whatever its
// up row holds (relu(g) * u with relu(g) = 0), so its up row is not read: a gate row, then
// the up and down rows only of the neurons that fire. The predictor lists about twice the
// neurons that fire (KB-7B: 53% of listed host neurons nonzero), so this skips ~19% of the
// host part's bytes. SiLU/GELU never give an exact 0 and read every row.
//
// ReLU in two passes, split by rows rather than neurons: a neuron that fires costs three
// rows and one that does not costs one, and the list comes in hotness order, so an even
// split of the neurons left the slowest thread's loop 25% (KB-7B) to 27% (KB-13B) above
// the mean one's (H200, 16 threads, kx_cpu_ffn_stats). Pass a: the gates, split evenly
// over the present neurons, written to a shared array with the ids; one barrier; pass b:
// the up and down rows, split evenly over the neurons that fired.
//
// Each pass runs in KX_FFN_CHUNKS chunks per thread, and a thread that is free takes the
// next one (a shared counter); a pass-b chunk sums into its own accumulator, so pass b makes
// no chunk whose accumulator (n_embd floats, zeroed and read back by the column sums) is
// more bytes than the up and down rows it sums (kx_ffn_chunk_min): KB-7B Q4_K_M at 3 GiB
// fires ~72 host neurons a layer, which 16 threads cut into 64 chunks of about one neuron,
// 2 MiB of accumulator traffic for 0.3 MiB of rows (bench/results/host-pages/). Why: with the
// rows split evenly the slowest thread's loop stayed 19-26% above the mean (H200, KB-7B,
// bench/results/archive/balance-live/two-pass/), so what was left was per-thread speed, not work.
// Measured (chunks/): the spread fell to 9-11%, but the slowest loop did not shorten. Kept:
// it is not slower there, and a thread slowed for other reasons (a small core, a preempted
// one) no longer holds up the layer. Op param 1 (ggml_kx_ffn_rows_own_shares) gives each
// thread its own contiguous chunks (an even split) instead: after the warm-up (kx-warm.cpp)
// each core's rows are in its own L2.
//
// Own shares, then stealing: a thread takes its own chunks from the front, and when they
// are done it takes another thread's chunks from the back (the part the warm-up reached
// last, if at all). Why: with even own shares and no stealing, KB-70B's slowest loop was 236
// µs per layer against a mean of 183 and the decode 23.57 tok/s against 30.63 with chunks
// taken by any free thread (H200, bench/results/archive/balance-live/kb70b-warm/): an even
// split of the rows is not an even split of the time. The sums stay the same bits: a pass-a
// chunk writes its gates by rank, a pass-b chunk into its own accumulator, whichever thread
// takes it.
//
// One token (decode) with Q4_0, Q4_K, Q5_K, Q6_K or F16 gate/up and Q8_0, F16, Q4_K or Q6_K
// down rows: four rows at a time (kx-dot.h, kx_axpy_rows), bit for bit the row-by-row result;
// in one pass (SiLU, GELU) the block's gate and up rows go four at a time at its flush. Why:
// the op alone on KB-70B's shapes scaled linearly with threads on the H200 host, 3.2 GB/s
// each, against 68-80 GB/s for the same scattered reads without the arithmetic
// (bench/results/host-pages/): a
// thread walking one row at a time keeps too few reads in flight. Four rows walked
// together are four prefetch streams and four independent chains (development VM, 2
// threads: 8.6-9.7 -> 11.8 GB/s; H200, KB-70B: the decode 1.18-1.27x,
// bench/results/archive/balance-live/kb70b-rows4/). Several tokens, and the reference path, go row
// by row.
//
// No software prefetch: requesting the next neuron's gate/up rows and the block's down rows
// whole into L2 ran 6% slower on the H200 host (KB-7B, 16 threads, interleaved A/B rows,
// bench/results/archive/balance-live/prefetch/), and the next row 1-2 rows ahead was no faster on
// the development VM (bench/host_op.c).
#include "kx-ops-cpu.h"
#include "kx-ops.h"

#include "kx-axpy.h"
#include "kx-dot.h"
#include "vec.h"

#include <stdatomic.h>
#include <string.h>
#include <time.h>

#define KX_CACHE_LINE 64
// a thread's counters: two cache lines of int64 (kx_ffn_work.cnt), its own (no false sharing)
#define KX_FFN_LINE_WORDS (2 * KX_CACHE_LINE / 8)
// neurons per activation block: a whole number of AVX-512 lanes
#define KX_FFN_BLK    16
// ReLU's two passes: chunks per thread of each pass, taken by whichever thread is free
#define KX_FFN_CHUNKS 4

static size_t kx_ffn_align(size_t n) {
    return (n + KX_CACHE_LINE - 1) / KX_CACHE_LINE * KX_CACHE_LINE;
}

// wdata: [x in vec_dot_type] [per thread: two cache lines (present count, loop ns, entry time,
//        rows read, the chunks taken from its share in pass a, in pass b, -, -, its phases' ns)]
//        [the two passes' chunk counters: one cache line] [fired count per pass-a chunk]
//        [two-pass ReLU: the gates (n x nt floats) and ids (n) of the present neurons, by rank]
//        [KX_FFN_CHUNKS per thread: accumulator m x nt floats (one pass uses one per thread)]
//        [per thread: g, u, h blocks of KX_FFN_BLK x nt, then k floats for the reference path]
struct kx_ffn_work {
    char    * xq;
    int64_t * cnt;    // cnt[ith * KX_FFN_LINE_WORDS]
    atomic_int_fast64_t * next; // [2]: the next chunk of pass a, of pass b (own cache line)
    int64_t * fired;  // fired[c]: neurons of pass-a chunk c that fired
    float   * gs;     // gs[rank * nt + t]
    int32_t * rid;    // rid[rank]
    float   * acc;    // accumulator j (a thread's, or a pass-b chunk's): acc + j * acc_stride
    float   * blk;    // thread j: blk + j * blk_stride
    size_t    acc_stride;
    size_t    blk_stride;
    size_t    size;   // bytes of the whole buffer
};

// the work buffer's parts at base (NULL: sizes only, every pointer NULL: offsets from a null
// pointer are undefined behaviour, and UBSan builds check it)
static struct kx_ffn_work kx_ffn_layout(char * base, const struct ggml_tensor * node, int nth) {
    const struct ggml_tensor * gate = node->src[0];
    const struct ggml_tensor * x    = node->src[3];
    const enum ggml_type vdt = ggml_get_type_traits_cpu(gate->type)->vec_dot_type;
    const int64_t k  = gate->ne[0];
    const int64_t m  = node->ne[0];
    const int64_t nt = x->ne[1];
#define KX_AT(off) (base ? base + (off) : NULL)

    struct kx_ffn_work w;
    size_t off = 0;
    w.xq = base;
    if (x->type != vdt) {
        off += kx_ffn_align(ggml_row_size(vdt, k) * (size_t) nt);
    }
    w.cnt = (int64_t *) KX_AT(off);
    off += (size_t) nth * KX_FFN_LINE_WORDS * sizeof(int64_t);
    w.next = (atomic_int_fast64_t *) KX_AT(off);
    off += KX_CACHE_LINE;
    w.fired = (int64_t *) KX_AT(off);
    off += kx_ffn_align(sizeof(int64_t) * (size_t) (KX_FFN_CHUNKS * nth));
    const int64_t n = node->src[4]->ne[0] - 1; // neurons: sel is I32 [n + 1]
    w.gs = (float *) KX_AT(off);
    off += kx_ffn_align(sizeof(float) * (size_t) (n * nt));
    w.rid = (int32_t *) KX_AT(off);
    off += kx_ffn_align(sizeof(int32_t) * (size_t) n);
    w.acc_stride = kx_ffn_align(sizeof(float) * (size_t) (m * nt)) / sizeof(float);
    w.acc = (float *) KX_AT(off);
    off += (size_t) (KX_FFN_CHUNKS * nth) * w.acc_stride * sizeof(float);
    w.blk_stride = kx_ffn_align(sizeof(float) * (3 * KX_FFN_BLK * (size_t) nt + (size_t) k)) / sizeof(float);
    w.blk = (float *) KX_AT(off);
    w.size = off + (size_t) nth * w.blk_stride * sizeof(float);
#undef KX_AT
    return w;
}

// fewest fired neurons of a pass-b chunk: its up and down rows at least the bytes of its
// accumulator of n floats (F16 rows of KB-7B's shape: 1; Q4_K: 4)
static int64_t kx_ffn_chunk_min(int64_t n, const struct ggml_tensor * up, const struct ggml_tensor * down) {
    const int64_t rows = (int64_t) (up->nb[1] + down->nb[1]);
    const int64_t per  = ((int64_t) sizeof(float)*n + rows - 1)/rows;
    return per > 1 ? per : 1;
}

size_t kx_ffn_rows_work_size(const struct ggml_tensor * node, int n_tasks) {
    return kx_ffn_layout(NULL, node, n_tasks).size;
}

// counters (kx_cpu_ffn_stats): up rows skipped, calls, where a call's time goes, how evenly
// its threads' rows were spread, and the chunks taken from another thread's share
enum { KX_FFN_UP_SKIPPED, KX_FFN_CALLS, KX_FFN_OP_NS, KX_FFN_WORK_MAX_NS, KX_FFN_WORK_MEAN_NS,
       KX_FFN_ROWS_MAX, KX_FFN_ROWS_MEAN, KX_FFN_STOLEN, KX_FFN_N_STATS };
static atomic_int_fast64_t kx_ffn_stat[KX_FFN_N_STATS];
static atomic_int_fast64_t kx_ffn_phase[KX_FFN_N_PHASES];

void kx_cpu_ffn_phases(int64_t * out, bool reset) {
    for (int i = 0; i < KX_FFN_N_PHASES; ++i) {
        if (out) {
            out[i] = atomic_load(&kx_ffn_phase[i]);
        }
        if (reset) {
            atomic_store(&kx_ffn_phase[i], 0);
        }
    }
}

void kx_cpu_ffn_stats(int64_t * up_skipped, int64_t * calls, int64_t * op_ns, int64_t * work_max_ns,
                      int64_t * work_mean_ns, int64_t * rows_max, int64_t * rows_mean, int64_t * stolen,
                      bool reset) {
    int64_t * out[KX_FFN_N_STATS] = { up_skipped, calls, op_ns, work_max_ns, work_mean_ns, rows_max, rows_mean,
                                      stolen };
    for (int i = 0; i < KX_FFN_N_STATS; ++i) {
        if (out[i]) {
            *out[i] = atomic_load(&kx_ffn_stat[i]);
        }
        if (reset) {
            atomic_store(&kx_ffn_stat[i], 0);
        }
    }
}

// a monotonic clock in ns: two reads per thread and call (~50 ns against a ~100 µs call)
static int64_t kx_ffn_now_ns(void) {
#ifdef _WIN32
    return ggml_time_us() * 1000;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
}

// own shares: thread s owns chunks [nck*s/nth, nck*(s+1)/nth) of a pass; taken[s] (in its
// cache line, zeroed before the first barrier) packs how many were taken from the front (low
// 32 bits, the owner) and from the back (high 32 bits, other threads)
#define KX_FFN_TAKEN_A 4 // the pass's word in the thread's cache line
#define KX_FFN_TAKEN_B 5

// takes one chunk of thread s's share: its front (owner) or its back; -1 when none is left
static int64_t kx_ffn_take(atomic_int_fast64_t * taken, int64_t nck, int s, int nth, bool front) {
    const int64_t base = nck*s/nth;
    const int64_t size = nck*(s + 1)/nth - base;
    int_fast64_t v = atomic_load_explicit(taken, memory_order_relaxed);
    for (;;) {
        const int64_t f = v & 0xffffffff;
        const int64_t b = v >> 32;
        if (f + b >= size) {
            return -1;
        }
        const int_fast64_t nv = front ? v + 1 : v + ((int_fast64_t) 1 << 32);
        if (atomic_compare_exchange_weak_explicit(taken, &v, nv, memory_order_relaxed, memory_order_relaxed)) {
            return front ? base + f : base + size - 1 - b;
        }
    }
}

// the next chunk of [0, nck) this thread works on, or -1: taken from a shared counter
// (dynamic), or the thread's own share from the front, then the others' from the back
// (own shares; word: KX_FFN_TAKEN_A or _B)
static int64_t kx_ffn_claim(const struct kx_ffn_work * w, int word, int64_t nck, int ith, int nth, bool dyn) {
    if (dyn) {
        const int64_t c = atomic_fetch_add_explicit(&w->next[word - KX_FFN_TAKEN_A], 1, memory_order_relaxed);
        return c < nck ? c : -1;
    }
    const int64_t cs = KX_FFN_LINE_WORDS;
    int64_t c = kx_ffn_take((atomic_int_fast64_t *) (w->cnt + ith*cs + word), nck, ith, nth, true);
    for (int d = 1; c < 0 && d < nth; ++d) {
        const int s = (ith + d) % nth;
        c = kx_ffn_take((atomic_int_fast64_t *) (w->cnt + s*cs + word), nck, s, nth, false);
        if (c >= 0) {
            atomic_fetch_add_explicit(&kx_ffn_stat[KX_FFN_STOLEN], 1, memory_order_relaxed);
        }
    }
    return c;
}

static inline int64_t kx_ffn_row(const int32_t * map, int64_t i) {
    return map ? map[i] : i;
}

// parts 0..n-1 hold cnt[p*stride] ranks each, in order: the part that holds rank target
// (n when none does), and in *before the ranks of the parts ahead of it
static int64_t kx_ffn_seek(const int64_t * cnt, int64_t stride, int64_t n, int64_t target, int64_t * before) {
    int64_t q = 0;
    int64_t p = 0;
    for (; p < n && q + cnt[p*stride] <= target; ++p) {
        q += cnt[p*stride];
    }
    *before = q;
    return p;
}

// one token's gates of ng (<= 4) neurons from their rows at once (kx-dot.h), into gs[q[n]];
// returns how many fired
static int64_t kx_ffn_gates4(float * gs, enum ggml_type type, const void * const * rows, const int64_t * q, int ng,
                             int64_t k, const char * xq) {
    float g[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
    const bool done = kx_dot_rows(type, k, ng, rows, xq, g); // the caller checked kx_dot_rows_ok
    GGML_ASSERT(done);
    int64_t fired = 0;
    for (int n = 0; n < ng; ++n) {
        gs[q[n]] = g[n];
        fired += g[n] > 0.0f;
    }
    return fired;
}

// act(g) * u over one block, with the dense path's GLU (the reference path too: the stock
// GLU op it stands for has no other)
static void kx_ffn_glu(int32_t act, int n, float * h, const float * g, const float * u) {
    switch (act) {
        case KX_SELECT_RELU: ggml_vec_reglu_f32(n, h, g, u); break;
        case KX_SELECT_SILU: ggml_vec_swiglu_f32(n, h, g, u); break;
        default:             ggml_vec_geglu_f32(n, h, g, u); break;
    }
}

// one row's dot with x_t: ggml's matvec kernel, or the reference path's double precision
static inline float kx_ffn_dot(const struct ggml_tensor * w, const char * row, const char * xq, const float * xf,
                               float * scratch, bool ref) {
    if (ref) {
        return kx_row_dot_ref(w, row, xf, scratch);
    }
    float d;
    ggml_get_type_traits_cpu(w->type)->vec_dot((int) w->ne[0], &d, 0, row, 0, xq, 0, 1);
    return d;
}

// neuron i's gate for token t: given (the exact path computed every gate) or its row's dot
static inline float kx_ffn_gate(const struct ggml_tensor * gpre, int64_t i, int64_t t, const struct ggml_tensor * gate,
                                const char * grow, const char * xq, const float * xf, float * scratch, bool ref) {
    return gpre ? *(const float *) ((const char *) gpre->data + i*sizeof(float) + t*gpre->nb[1])
                : kx_ffn_dot(gate, grow, xq, xf, scratch, ref);
}

// a block of up to KX_FFN_BLK neurons with their g and u: act(g) * u, then the down rows
// of the nonzero ones into the thread's accumulator
struct kx_ffn_blk {
    int64_t nt;
    int32_t act;
    int64_t m;
    float * gb;     // [nt][KX_FFN_BLK]
    float * ub;
    float * hb;
    float * acc;    // [nt][m]
    const struct ggml_tensor * down;
    const int32_t * dmap;
    bool    ref;
    int     nb;     // neurons in the block
    int32_t ids[KX_FFN_BLK];
    // gate rows (one pass without the ReLU skip) and up rows computed at the flush, four at
    // a time (kx-dot.h; one token): NULL otherwise
    const struct ggml_tensor * gate4;
    const struct ggml_tensor * up4;
    bool    down4;  // one token: the nonzero down rows four at a time (kx_axpy_rows; row by row
                    // for a type it has no path for)
    const char * xq;
    const void * grow[KX_FFN_BLK];
    const void * urow[KX_FFN_BLK];
    int64_t nonzero; // (neuron, token) pairs added
    int64_t rows;    // down rows read (a neuron with a nonzero h for any token)
};

// out[b] = row b of w · xq for the block's nb rows, four at a time (w NULL: nothing to do)
static void kx_ffn_blk_dots(const struct ggml_tensor * w, int nb, const void * const * rows, const char * xq,
                            float * out) {
    for (int b = 0; w && b < nb; b += 4) {
        kx_dot_rows(w->type, w->ne[0], nb - b < 4 ? nb - b : 4, rows + b, xq, out + b);
    }
}

static void kx_ffn_blk_flush(struct kx_ffn_blk * B) {
    if (B->nb == 0) {
        return;
    }
    kx_ffn_blk_dots(B->gate4, B->nb, B->grow, B->xq, B->gb);
    kx_ffn_blk_dots(B->up4,   B->nb, B->urow, B->xq, B->ub);
    for (int64_t t = 0; t < B->nt; ++t) {
        for (int b = B->nb; b < KX_FFN_BLK; ++b) {
            B->gb[t*KX_FFN_BLK + b] = 0.0f;
            B->ub[t*KX_FFN_BLK + b] = 0.0f;
        }
        kx_ffn_glu(B->act, KX_FFN_BLK, B->hb + t*KX_FFN_BLK, B->gb + t*KX_FFN_BLK, B->ub + t*KX_FFN_BLK);
    }
    if (B->down4) { // kx_axpy_rows
        const void * dr[4];
        float        dv[4];
        int          nd = 0;
        for (int b = 0; b <= B->nb; ++b) {
            if (b < B->nb && B->hb[b] != 0.0f) {
                dr[nd] = (const char *) B->down->data + kx_ffn_row(B->dmap, B->ids[b])*B->down->nb[1];
                dv[nd++] = B->hb[b];
            }
            if (nd == 4 || (b == B->nb && nd > 0)) {
                if (!kx_axpy_rows(B->down->type, B->m, nd, B->acc, dr, dv)) {
                    for (int r = 0; r < nd; ++r) {
                        kx_axpy_row(B->down->type, 0, B->m, B->acc, dr[r], dv[r], false);
                    }
                }
                B->nonzero += nd;
                B->rows += nd;
                nd = 0;
            }
        }
        B->nb = 0;
        return;
    }
    for (int b = 0; b < B->nb; ++b) {
        const int64_t dr = kx_ffn_row(B->dmap, B->ids[b]);
        const char * drow = (const char *) B->down->data + dr*B->down->nb[1];
        const int64_t before = B->nonzero;
        for (int64_t t = 0; t < B->nt; ++t) {
            const float v = B->hb[t*KX_FFN_BLK + b];
            if (v == 0.0f) {
                continue;
            }
            ++B->nonzero;
            kx_axpy_row(B->down->type, 0, B->m, B->acc + t*B->m, drow, v, B->ref);
        }
        B->rows += B->nonzero > before;
    }
    B->nb = 0;
}

void ggml_compute_forward_kx_ffn_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * gate = dst->src[0];
    const struct ggml_tensor * up   = dst->src[1];
    const struct ggml_tensor * down = dst->src[2];
    const struct ggml_tensor * x    = dst->src[3];
    const struct ggml_tensor * sel  = dst->src[4];
    const int32_t * map  = dst->src[5] ? (const int32_t *) dst->src[5]->data : NULL;
    const int32_t * dmap = dst->src[6] ? (const int32_t *) dst->src[6]->data : NULL;
    const struct ggml_tensor * gpre = dst->src[7];
    const int32_t act = ggml_get_op_params_i32(dst, 0);

    const int  ith = params->ith;
    const int  nth = params->nth;
    const bool ref = params->use_ref;
    // ReLU: two passes, the up rows only of neurons whose gate fired; SiLU/GELU: one pass
    const bool two_pass = act == KX_SELECT_RELU;

    const int64_t k  = gate->ne[0];
    const int64_t m  = dst->ne[0];
    const int64_t nt = x->ne[1];

    const enum ggml_type vdt  = ggml_get_type_traits_cpu(gate->type)->vec_dot_type;
    const bool           conv = x->type != vdt;
    const size_t         xrow = conv ? ggml_row_size(vdt, k) : x->nb[1];
    const struct kx_ffn_work w = kx_ffn_layout((char *) params->wdata, dst, nth);
    const char * xq = conv ? w.xq : (const char *) x->data;
    float * acc = w.acc + (size_t) ith * w.acc_stride;
    float * gb  = w.blk + (size_t) ith * w.blk_stride;   // [nt][KX_FFN_BLK] each
    float * ub  = gb + KX_FFN_BLK * nt;
    float * hb  = ub + KX_FFN_BLK * nt;
    float * scr = hb + KX_FFN_BLK * nt;                  // k floats: a dequantized row (reference path)

    const int64_t t_enter = kx_ffn_now_ns();
    // this thread's counters: [0] neurons present in its static slice, [1] its phase-2 ns,
    // [2] its entry time, [3] rows read, [4] [5] chunks taken, [8 + p] phase p's ns (kx-ops.h)
    int64_t * line = w.cnt + ith * KX_FFN_LINE_WORDS;
    int64_t * ph   = line + 8;
    int64_t   t_ph = t_enter; // the current phase's start
    line[2] = t_enter;
#define KX_FFN_PHASE_END(p) do { const int64_t t_ = kx_ffn_now_ns(); ph[p] = t_ - t_ph; t_ph = t_; } while (0)

    const int32_t * list  = (const int32_t *) sel->data;
    const int64_t   count = list[0];
    const int32_t * ids   = list + 1;

    // phase 1: convert x (each row's blocks split across threads); count the neurons present
    // in this weight in a static slice of the list; zero the private accumulator (one pass) or
    // the chunk counters (two)
    if (conv && !ref) {
        kx_x_convert(vdt, (const char *) x->data, x->nb[1], k, nt, w.xq, xrow, ith, nth);
    }
    {
        const int64_t j0 = count*ith/nth;
        const int64_t j1 = count*(ith + 1)/nth;
        int64_t n = 0;
        for (int64_t j = j0; j < j1; ++j) {
            n += kx_ffn_row(map, ids[j]) >= 0;
        }
        line[0] = n;
        line[KX_FFN_TAKEN_A] = 0; // own shares: none taken yet (read after the barriers)
        line[KX_FFN_TAKEN_B] = 0;
        if (dst->src[8]) { // ggml_kx_ffn_rows_copy_list
            int32_t * out = (int32_t *) dst->src[8]->data;
            memcpy(out + 1 + j0, ids + j0, sizeof(int32_t) * (size_t) (j1 - j0));
            if (ith == 0) {
                out[0] = (int32_t) count;
            }
        }
    }
    if (two_pass) {
        if (ith == 0) { // no thread takes a chunk before the barrier
            atomic_store_explicit(&w.next[0], 0, memory_order_relaxed);
            atomic_store_explicit(&w.next[1], 0, memory_order_relaxed);
        }
    } else {
        memset(acc, 0, sizeof(float) * (size_t) (m * nt));
    }
    ph[KX_FFN_PH_WAIT2] = 0; // one pass: no second barrier, no pass b
    ph[KX_FFN_PH_B]     = 0;
    KX_FFN_PHASE_END(KX_FFN_PH_X);
    ggml_barrier(params->threadpool);
    KX_FFN_PHASE_END(KX_FFN_PH_WAIT1);

    // phase 2: this thread's share of the present neurons, ranks [r0, r1) in list order
    int64_t total = 0;
    for (int s = 0; s < nth; ++s) {
        total += w.cnt[s * KX_FFN_LINE_WORDS];
    }
    const int64_t r0 = total*ith/nth;
    const int64_t r1 = total*(ith + 1)/nth;
    // the static slices' present counts, one per thread's cache line
    const int64_t cstride = KX_FFN_LINE_WORDS;
    int64_t rank;
    int64_t j = count*kx_ffn_seek(w.cnt, cstride, nth, r0, &rank)/nth;
    struct kx_ffn_blk B = { .nt = nt, .act = act, .m = m, .gb = gb, .ub = ub, .hb = hb, .acc = acc,
                            .down = down, .dmap = dmap, .ref = ref, .xq = xq };
    // one token: gate rows (pass a) and up rows (pass b, at each block's flush) four at a
    // time where kx-dot.h has a path for their type, the down rows where kx-axpy.h has
    const bool rows4 = !ref && nt == 1;
    const bool gate4 = rows4 && kx_dot_rows_ok(gate->type) && !gpre;
    const struct ggml_tensor * up4 = rows4 && kx_dot_rows_ok(up->type) ? up : NULL;
    B.down4 = rows4;
    int64_t up_skipped = 0;
    int64_t rows = 0; // gate and up rows read here (down rows: B.rows)
    int64_t present = r1 - r0; // present neurons this thread computed
    int64_t nacc = 0;          // two passes: pass-b chunks, one accumulator each
    if (!two_pass) {
        // every up row is read, so gates and ups can both wait for the block's flush and go
        // four at a time (SiLU/GELU: the models most users run)
        B.gate4 = gate4 ? gate : NULL;
        B.up4   = up4;
        while (rank < r1) {
            // gather the next block of present neurons, computing their g and u
            for (; j < count && rank < r1 && B.nb < KX_FFN_BLK; ++j) {
                const int64_t i = ids[j];
                const int64_t r = kx_ffn_row(map, i);
                if (r < 0) {
                    continue;
                }
                if (rank++ < r0) {
                    continue;
                }
                const char * grow = (const char *) gate->data + r*gate->nb[1];
                const char * urow = (const char *) up->data + r*up->nb[1];
                B.grow[B.nb] = grow; // B.gate4, B.up4 (one token): their dots at the flush
                B.urow[B.nb] = urow;
                for (int64_t t = 0; t < nt && !B.gate4; ++t) {
                    const float * xf = (const float *) ((const char *) x->data + t*x->nb[1]);
                    gb[t*KX_FFN_BLK + B.nb] = kx_ffn_gate(gpre, i, t, gate, grow, xq + t*xrow, xf, scr, ref);
                }
                for (int64_t t = 0; t < nt && !B.up4; ++t) {
                    const float * xf = (const float *) ((const char *) x->data + t*x->nb[1]);
                    ub[t*KX_FFN_BLK + B.nb] = kx_ffn_dot(up, urow, xq + t*xrow, xf, scr, ref);
                }
                rows += (gpre == NULL) + 1;
                B.ids[B.nb++] = (int32_t) i;
            }
            kx_ffn_blk_flush(&B);
        }
    } else {
        // pass a: chunks of ranks [q0, q1) of the present neurons, their gates into the
        // shared array, the fired ones counted per chunk
        const bool dyn = ggml_get_op_params_i32(dst, 1) == 0;
        const int64_t nca = total < KX_FFN_CHUNKS*nth ? total : KX_FFN_CHUNKS*nth;
        int64_t gates = 0;
        for (int64_t c; (c = kx_ffn_claim(&w, KX_FFN_TAKEN_A, nca, ith, nth, dyn)) >= 0; ) {
            const int64_t q0 = total*c/nca;
            const int64_t q1 = total*(c + 1)/nca;
            // the list position of rank q0: from the start of the static slice that holds it
            int64_t q;
            int64_t jj = count*kx_ffn_seek(w.cnt, cstride, nth, q0, &q)/nth;
            int64_t fired = 0;
            const void * grp[4]; // gate4: rows waiting to be computed together, and their ranks
            int64_t      gq[4];
            int          ng = 0;
            for (; jj < count && q < q1; ++jj) {
                const int64_t i = ids[jj];
                const int64_t r = kx_ffn_row(map, i);
                if (r < 0 || q++ < q0) {
                    continue;
                }
                const int64_t qi = q - 1;
                const char * grow = (const char *) gate->data + r*gate->nb[1];
                w.rid[qi] = (int32_t) i;
                if (gate4) {
                    grp[ng] = grow;
                    gq[ng++] = qi;
                    if (ng == 4) {
                        fired += kx_ffn_gates4(w.gs, gate->type, grp, gq, ng, k, xq);
                        ng = 0;
                    }
                    continue;
                }
                bool on = false;
                for (int64_t t = 0; t < nt; ++t) {
                    const float * xf = (const float *) ((const char *) x->data + t*x->nb[1]);
                    const float g = kx_ffn_gate(gpre, i, t, gate, grow, xq + t*xrow, xf, scr, ref);
                    w.gs[qi*nt + t] = g;
                    on |= g > 0.0f;   // a NaN gate is no reason either: ReLU maps it to 0
                }
                fired += on;
            }
            if (ng > 0) {
                fired += kx_ffn_gates4(w.gs, gate->type, grp, gq, ng, k, xq);
            }
            w.fired[c] = fired;
            gates += q1 - q0;
            up_skipped += (q1 - q0) - fired;
        }
        present = gates;
        rows = gpre ? 0 : gates;
        KX_FFN_PHASE_END(KX_FFN_PH_A);
        ggml_barrier(params->threadpool);
        KX_FFN_PHASE_END(KX_FFN_PH_WAIT2);

        // pass b: chunks of fired ranks [f0, f1) of all F, each into its own accumulator (so
        // the sum does not depend on which thread took it); a chunk starts at the pass-a
        // chunk that holds fired neuron f0
        int64_t F = 0;
        for (int64_t c = 0; c < nca; ++c) {
            F += w.fired[c];
        }
        // at most KX_FFN_CHUNKS per thread, none smaller than kx_ffn_chunk_min (see the top);
        // counted per token, so one token's sums are the bits of the same token among several
        const int64_t per = kx_ffn_chunk_min(m, up, down);
        nacc = (F + per - 1)/per;
        nacc = nacc < KX_FFN_CHUNKS*nth ? nacc : KX_FFN_CHUNKS*nth;
        B.up4 = up4;
        for (int64_t c; (c = kx_ffn_claim(&w, KX_FFN_TAKEN_B, nacc, ith, nth, dyn)) >= 0; ) {
            const int64_t f0 = F*c/nacc;
            const int64_t f1 = F*(c + 1)/nacc;
            int64_t f;
            int64_t q = total*kx_ffn_seek(w.fired, 1, nca, f0, &f)/nca;
            B.acc = w.acc + (size_t) c * w.acc_stride;
            memset(B.acc, 0, sizeof(float) * (size_t) (m * nt));
            for (; f < f1; ++q) {
                bool on = false;
                for (int64_t t = 0; t < nt; ++t) {
                    on |= w.gs[q*nt + t] > 0.0f;
                }
                if (!on || f++ < f0) {
                    continue;
                }
                const int64_t i = w.rid[q];
                const char * urow = (const char *) up->data + kx_ffn_row(map, i)*up->nb[1];
                B.urow[B.nb] = urow; // B.up4: its dot at the flush
                for (int64_t t = 0; t < nt; ++t) {
                    const float * xf = (const float *) ((const char *) x->data + t*x->nb[1]);
                    gb[t*KX_FFN_BLK + B.nb] = w.gs[q*nt + t];
                    ub[t*KX_FFN_BLK + B.nb] = B.up4 ? 0.0f : kx_ffn_dot(up, urow, xq + t*xrow, xf, scr, ref);
                }
                B.ids[B.nb++] = (int32_t) i;
                ++rows;
                if (B.nb == KX_FFN_BLK) {
                    kx_ffn_blk_flush(&B);
                }
            }
            kx_ffn_blk_flush(&B);
        }
    }
    // every thread: in two passes one that computed no gate may still own fired neurons
    kx_cpu_axpy_stats_add(B.nonzero, present, ith == 0 ? count - total : 0);
    if (up_skipped) {
        atomic_fetch_add(&kx_ffn_stat[KX_FFN_UP_SKIPPED], up_skipped);
    }
    KX_FFN_PHASE_END(two_pass ? KX_FFN_PH_B : KX_FFN_PH_A);
    line[1] = ph[KX_FFN_PH_A] + ph[KX_FFN_PH_B]; // the neuron loop: the passes (one pass: B is 0)
    line[3] = rows + B.rows;
    line[6] = t_ph; // arrival at the last barrier: thread 0 reads it after (its wait is written later)
    ggml_barrier(params->threadpool);
    KX_FFN_PHASE_END(KX_FFN_PH_WAIT3);

    // phase 3: columns split across threads, accumulators added in order: one pass, the
    // threads' (threads that owned no neuron hold zeros and are skipped); two passes, the
    // pass-b chunks' (none is empty)
    const int64_t c0 = m*ith/nth;
    const int64_t c1 = m*(ith + 1)/nth;
    for (int64_t t = 0; t < nt; ++t) {
        float * y = (float *) ((char *) dst->data + t*dst->nb[1]);
        memset(y + c0, 0, sizeof(float) * (size_t) (c1 - c0));
        for (int64_t s = 0; s < (two_pass ? nacc : nth); ++s) {
            if (!two_pass && total*s/nth == total*(s + 1)/nth) {
                continue;
            }
            ggml_vec_acc_f32((int) (c1 - c0), y + c0, w.acc + (size_t) s * w.acc_stride + t*m + c0);
        }
    }
    if (ith == 0) {
        int64_t wmax = 0;
        int64_t wsum = 0;
        int64_t rmax = 0;
        int64_t rsum = 0;
        int64_t psum[KX_FFN_PH_WAIT3] = { 0 };   // the phases before the last barrier
        int64_t e0 = line[2], e1 = line[2];      // first and last entry
        int64_t amax = line[6], asum = 0;        // arrivals at the last barrier
        for (int s = 0; s < nth; ++s) {
            const int64_t * ls = w.cnt + s * KX_FFN_LINE_WORDS;
            wmax = ls[1] > wmax ? ls[1] : wmax;
            wsum += ls[1];
            rmax = ls[3] > rmax ? ls[3] : rmax;
            rsum += ls[3];
            for (int p = 0; p < KX_FFN_PH_WAIT3; ++p) {
                psum[p] += ls[8 + p];
            }
            e0 = ls[2] < e0 ? ls[2] : e0;
            e1 = ls[2] > e1 ? ls[2] : e1;
            amax = ls[6] > amax ? ls[6] : amax;
            asum += ls[6];
        }
        for (int p = 0; p < KX_FFN_PH_WAIT3; ++p) {
            atomic_fetch_add(&kx_ffn_phase[p], psum[p] / nth);
        }
        // everyone leaves the last barrier when the last arrives: the mean thread waited this long
        atomic_fetch_add(&kx_ffn_phase[KX_FFN_PH_WAIT3], amax - asum / nth);
        atomic_fetch_add(&kx_ffn_phase[KX_FFN_PH_SUMS], kx_ffn_now_ns() - t_ph);
        atomic_fetch_add(&kx_ffn_phase[KX_FFN_PH_SKEW], e1 - e0);
        atomic_fetch_add(&kx_ffn_stat[KX_FFN_CALLS], 1);
        atomic_fetch_add(&kx_ffn_stat[KX_FFN_OP_NS], kx_ffn_now_ns() - t_enter);
        atomic_fetch_add(&kx_ffn_stat[KX_FFN_WORK_MAX_NS], wmax);
        atomic_fetch_add(&kx_ffn_stat[KX_FFN_WORK_MEAN_NS], wsum / nth);
        atomic_fetch_add(&kx_ffn_stat[KX_FFN_ROWS_MAX], rmax);
        atomic_fetch_add(&kx_ffn_stat[KX_FFN_ROWS_MEAN], rsum / nth);
    }
#undef KX_FFN_PHASE_END
}
