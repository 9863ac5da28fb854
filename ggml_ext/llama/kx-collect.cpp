// The activation profiler behind `kairox prepare`: an eval callback that watches a dense
// forward pass and keeps, per layer, what predictor training, grouping and the statistics
// need, so Python never sees a full activation tensor:
//   ffn_norm-L  the FFN input x (the predictor's input)          -> rows kept per decode
//   ffn_gate-L  the gate pre-activation g                         -> |act(g)| histogram,
//               active mask (|act(g)| > threshold, the kx_select rule), per-neuron counts
//   l_out-L     the residual stream after layer L                 -> cos(l_out[L-1], l_out[L])
// Per-decode rows (x, masks) are overwritten by the next kx_collector_begin; aggregates
// (histograms, counts, cosine sums) grow until kx_collector_reset.
#include "kairox.h"
#include "kx-ops.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

struct kx_collector {
    int32_t n_layer;
    int32_t n_embd;
    int32_t n_ff;
    int32_t act;          // enum kx_select_act
    int32_t max_tokens;   // rows per layer per decode
    int64_t mask_bytes;   // ceil(n_ff / 8): one bit per neuron, little-endian bit order

    std::vector<float> thr;  // [n_layer]

    // per decode: [n_layer][max_tokens * n_embd], [n_layer][max_tokens * mask_bytes]
    std::vector<std::vector<float>>   x;
    std::vector<std::vector<uint8_t>> mask;
    std::vector<int32_t> n_x;     // rows of x captured per layer since begin
    std::vector<int32_t> n_mask;  // rows of masks captured per layer since begin
    std::vector<std::vector<float>> prev_out;  // l_out of layer L-1 for the current ubatch
    std::vector<int32_t> prev_rows;

    // aggregates
    std::vector<std::vector<int64_t>> counts;  // [n_layer][n_ff]
    std::vector<std::vector<int64_t>> hist;    // [n_layer][KX_COLLECT_HIST_BINS]
    std::vector<double>  cos_sum;              // [n_layer]
    std::vector<int64_t> cos_n;
    int64_t n_skipped = 0;                     // watched tensors of an unexpected shape or type
    bool stop_after_last = false;              // end the graph after the last l_out

    std::vector<float> tmp;  // a copy of tensors that do not live in host memory
};

// "ffn_gate-12" -> (kind, 12); kind 0 = none
enum { KX_T_NONE = 0, KX_T_X = 1, KX_T_GATE = 2, KX_T_OUT = 3 };

static int kx_tensor_kind(const char * name, int32_t n_layer, int32_t * il) {
    static const struct { const char * prefix; int kind; } watched[] = {
        { "ffn_norm-", KX_T_X }, { "ffn_gate-", KX_T_GATE }, { "l_out-", KX_T_OUT },
    };
    for (const auto & w : watched) {
        const size_t n = std::strlen(w.prefix);
        if (std::strncmp(name, w.prefix, n) == 0) {
            char * end = nullptr;
            const long v = std::strtol(name + n, &end, 10);
            if (end != name + n && *end == '\0' && v >= 0 && v < n_layer) {
                *il = (int32_t) v;
                return w.kind;
            }
            return KX_T_NONE;
        }
    }
    return KX_T_NONE;
}

int32_t kx_collect_hist_bins(void) {
    return KX_COLLECT_HIST_BINS;
}

void kx_collect_hist_range(double * lo_log10, double * hi_log10) {
    if (lo_log10) { *lo_log10 = KX_COLLECT_HIST_LO; }
    if (hi_log10) { *hi_log10 = KX_COLLECT_HIST_HI; }
}

// bin 0: exactly 0; bins 1..N-1 log-uniform in [10^lo, 10^hi), the first and last also
// taking what lies below / above the range (see kairox.h)
static inline int32_t kx_hist_bin(float a) {
    if (a <= 0.0f) {
        return 0;
    }
    constexpr double width = (KX_COLLECT_HIST_HI - KX_COLLECT_HIST_LO) / (KX_COLLECT_HIST_BINS - 2);
    const double pos = (std::log10((double) a) - KX_COLLECT_HIST_LO) / width;
    if (pos < 0.0) {
        return 1;
    }
    return (int32_t) std::min<double>(1.0 + std::floor(pos), KX_COLLECT_HIST_BINS - 1);
}

struct kx_collector * kx_collector_new(int32_t n_layer, int32_t n_embd, int32_t n_ff, int32_t act,
                                       int32_t max_tokens) {
    if (n_layer < 1 || n_embd < 1 || n_ff < 1 || max_tokens < 1 ||
        act < KX_SELECT_RELU || act > KX_SELECT_GELU) {
        return nullptr;
    }
    auto * c = new kx_collector();
    c->n_layer    = n_layer;
    c->n_embd     = n_embd;
    c->n_ff       = n_ff;
    c->act        = act;
    c->max_tokens = max_tokens;
    c->mask_bytes = (n_ff + 7) / 8;
    c->thr.assign(n_layer, 0.0f);
    c->x.resize(n_layer);
    c->mask.resize(n_layer);
    c->n_x.assign(n_layer, 0);
    c->n_mask.assign(n_layer, 0);
    c->prev_out.resize(n_layer);
    c->prev_rows.assign(n_layer, 0);
    c->counts.assign(n_layer, std::vector<int64_t>(n_ff, 0));
    c->hist.assign(n_layer, std::vector<int64_t>(KX_COLLECT_HIST_BINS, 0));
    c->cos_sum.assign(n_layer, 0.0);
    c->cos_n.assign(n_layer, 0);
    return c;
}

void kx_collector_free(struct kx_collector * c) {
    delete c;
}

int32_t kx_collector_set_thresholds(struct kx_collector * c, const float * thr) {
    if (!c || !thr) {
        return 1;
    }
    for (int32_t il = 0; il < c->n_layer; ++il) {
        if (!std::isfinite(thr[il]) || thr[il] < 0.0f) {
            return 1;
        }
    }
    c->thr.assign(thr, thr + c->n_layer);
    return 0;
}

void kx_collector_begin(struct kx_collector * c) {
    if (c) {
        std::fill(c->n_x.begin(), c->n_x.end(), 0);
        std::fill(c->n_mask.begin(), c->n_mask.end(), 0);
    }
}

void kx_collector_reset(struct kx_collector * c) {
    if (!c) {
        return;
    }
    for (auto & v : c->counts) { std::fill(v.begin(), v.end(), 0); }
    for (auto & v : c->hist)   { std::fill(v.begin(), v.end(), 0); }
    std::fill(c->cos_sum.begin(), c->cos_sum.end(), 0.0);
    std::fill(c->cos_n.begin(), c->cos_n.end(), 0);
    c->n_skipped = 0;
}

// The tensor's F32 rows, from host memory directly or through a copy.
static const float * kx_host_rows(kx_collector * c, const ggml_tensor * t) {
    if (t->buffer && ggml_backend_buffer_is_host(t->buffer)) {
        return (const float *) t->data;
    }
    c->tmp.resize(ggml_nelements(t));
    ggml_backend_tensor_get(t, c->tmp.data(), 0, ggml_nbytes(t));
    return c->tmp.data();
}

static void kx_take_x(kx_collector * c, int32_t il, const float * v, int32_t rows) {
    auto & dst = c->x[il];
    const int32_t room = c->max_tokens - c->n_x[il];
    const int32_t n = std::min(rows, room);
    if (n < rows) {
        c->n_skipped++;
    }
    if (n <= 0) {
        return;
    }
    if (dst.empty()) {
        dst.resize((size_t) c->max_tokens * c->n_embd);
    }
    std::memcpy(dst.data() + (size_t) c->n_x[il] * c->n_embd, v, sizeof(float) * n * c->n_embd);
    c->n_x[il] += n;
}

static void kx_take_gate(kx_collector * c, int32_t il, const float * g, int32_t rows) {
    const float thr = c->thr[il];
    auto & cnt  = c->counts[il];
    auto & hist = c->hist[il];
    auto & dst  = c->mask[il];
    if (dst.empty()) {
        dst.resize((size_t) c->max_tokens * c->mask_bytes);
    }
    for (int32_t t = 0; t < rows; ++t) {
        const float * gt = g + (size_t) t * c->n_ff;
        const bool keep = c->n_mask[il] < c->max_tokens;
        uint8_t * m = keep ? dst.data() + (size_t) c->n_mask[il] * c->mask_bytes : nullptr;
        if (m) {
            std::memset(m, 0, c->mask_bytes);
        }
        for (int32_t i = 0; i < c->n_ff; ++i) {
            const float a = std::fabs(kx_act_value(gt[i], c->act));
            hist[kx_hist_bin(a)]++;
            if (a > thr) {  // the kx_select rule: |act(g)| > threshold
                cnt[i]++;
                if (m) {
                    m[i >> 3] |= (uint8_t) (1u << (i & 7));
                }
            }
        }
        if (keep) {
            c->n_mask[il]++;
        } else {
            c->n_skipped++;
        }
    }
}

static void kx_take_out(kx_collector * c, int32_t il, const float * h, int32_t rows) {
    const int32_t n = c->n_embd;
    if (il > 0 && c->prev_rows[il - 1] == rows) {
        const float * p = c->prev_out[il - 1].data();
        for (int32_t t = 0; t < rows; ++t) {
            double dot = 0.0, na = 0.0, nb = 0.0;
            for (int32_t j = 0; j < n; ++j) {
                const double a = p[(size_t) t * n + j], b = h[(size_t) t * n + j];
                dot += a * b; na += a * a; nb += b * b;
            }
            if (na > 0.0 && nb > 0.0) {
                c->cos_sum[il] += dot / std::sqrt(na * nb);
                c->cos_n[il]++;
            }
        }
    }
    if (il + 1 < c->n_layer) {  // the next layer compares against this one
        c->prev_out[il].assign(h, h + (size_t) rows * n);
        c->prev_rows[il] = rows;
    }
}

bool kx_collector_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * c = (kx_collector *) user_data;
    int32_t il = -1;
    const int kind = c ? kx_tensor_kind(t->name, c->n_layer, &il) : KX_T_NONE;
    if (ask) {
        return kind != KX_T_NONE;
    }
    if (kind == KX_T_NONE) {
        return true;  // keep computing
    }
    const int64_t width = kind == KX_T_GATE ? c->n_ff : c->n_embd;
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || t->ne[0] != width ||
        t->ne[2] != 1 || t->ne[3] != 1) {
        c->n_skipped++;
        return true;
    }
    const int32_t rows = (int32_t) t->ne[1];
    const float * v = kx_host_rows(c, t);
    switch (kind) {
        case KX_T_X:    kx_take_x(c, il, v, rows);    break;
        case KX_T_GATE: kx_take_gate(c, il, v, rows); break;
        case KX_T_OUT:  kx_take_out(c, il, v, rows);  break;
    }
    // Past the last layer's output nothing is watched: returning false ends this split's
    // compute, which skips the output projection. Profiling asks for every token's output
    // (else the last layer keeps only output rows), and on a 262k-token vocabulary (Gemma 3)
    // those logits cost more than all the layers (measured: 75 -> see docs/results) while
    // nobody reads them.
    return !(kind == KX_T_OUT && il == c->n_layer - 1 && c->stop_after_last);
}

void kx_collector_set_stop_after_last(struct kx_collector * c, bool stop) {
    if (c) {
        c->stop_after_last = stop;
    }
}

int32_t kx_collector_n_rows(const struct kx_collector * c, int32_t il, int32_t what) {
    if (!c || il < 0 || il >= c->n_layer) {
        return -1;
    }
    return what == KX_COLLECT_X ? c->n_x[il] : c->n_mask[il];
}

static bool kx_layer_ok(const kx_collector * c, int32_t il, const void * dst) {
    return c && il >= 0 && il < c->n_layer && dst;
}

// copy the first n entries of a per-layer buffer; -1 when dst holds fewer than n
template <typename T>
static int64_t kx_copy_rows(const std::vector<T> & src, int64_t n, T * dst, int64_t capacity) {
    if (capacity < n) {
        return -1;
    }
    std::copy(src.begin(), src.begin() + n, dst);
    return n;
}

int64_t kx_collector_get_x(const struct kx_collector * c, int32_t il, float * dst, int64_t capacity) {
    return kx_layer_ok(c, il, dst) ? kx_copy_rows(c->x[il], (int64_t) c->n_x[il] * c->n_embd, dst, capacity) : -1;
}

int64_t kx_collector_get_mask(const struct kx_collector * c, int32_t il, uint8_t * dst, int64_t capacity) {
    return kx_layer_ok(c, il, dst) ? kx_copy_rows(c->mask[il], (int64_t) c->n_mask[il] * c->mask_bytes, dst, capacity) : -1;
}

int32_t kx_collector_get_counts(const struct kx_collector * c, int32_t il, int64_t * dst) {
    return kx_layer_ok(c, il, dst) && kx_copy_rows(c->counts[il], c->n_ff, dst, c->n_ff) >= 0 ? 0 : 1;
}

int32_t kx_collector_get_hist(const struct kx_collector * c, int32_t il, int64_t * dst) {
    return kx_layer_ok(c, il, dst) && kx_copy_rows(c->hist[il], KX_COLLECT_HIST_BINS, dst, KX_COLLECT_HIST_BINS) >= 0 ? 0 : 1;
}

int32_t kx_collector_get_cosine(const struct kx_collector * c, int32_t il, double * sum, int64_t * n) {
    if (!kx_layer_ok(c, il, sum) || !n) {
        return 1;
    }
    *sum = c->cos_sum[il];
    *n   = c->cos_n[il];
    return 0;
}

int64_t kx_collector_n_skipped(const struct kx_collector * c) {
    return c ? c->n_skipped : -1;
}
