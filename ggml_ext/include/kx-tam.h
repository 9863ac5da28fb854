// The online balancer's per-layer decision: Temporal Activation Momentum (TAM) scores,
// admission and eviction of neuron groups into a layer's GPU slots, and the adaptive λ.
// python/kairox/balancer.py (LayerBalancer) is the readable reference; the host version
// (llama/kx-tam.cpp) and the CUDA one (cuda/kx-tam.cu) make the same decisions on the same
// inputs, bit for bit: float32 arithmetic in the reference's order, no fused multiply-add,
// and one total order of groups, (score descending, resident first, id ascending).
#pragma once

#include "kx-ops.h"  // KX_HOST_DEVICE

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KX_TAM_API __attribute__((visibility("default")))

struct kx_tam_config {
    float   lam;        // λ at start
    float   eps;        // τ = (1 − λ) + ε; ε ≤ −(1 − λ_min) makes every listed group a candidate
    float   alpha;      // largest step of λ
    float   alpha_min;  // smallest step of λ
    float   lam_min;
    float   lam_max;
    int32_t adaptive;   // 0: λ stays fixed
    int32_t max_admit;  // groups loaded per step (< 0: as many as qualify)
};

// what changes between steps besides scores and residency (4 words: device-copyable)
struct kx_tam_state {
    float   lam;
    float   alpha;
    int32_t last_dir;   // -1, 0, +1: the last direction λ moved
    int32_t pad;
};

enum kx_tam_stall {
    KX_TAM_STALL_NONE = 0,
    KX_TAM_STALL_IO   = 1, // the step waited on reloads: raise λ (conservative)
    KX_TAM_STALL_CPU  = 2, // the step waited on the CPU part: lower λ (react faster)
};

static inline KX_HOST_DEVICE void kx_tam_state_init(const struct kx_tam_config * c, struct kx_tam_state * s) {
    s->lam = c->lam;
    s->alpha = c->alpha;
    s->last_dir = 0;
    s->pad = 0;
}

// λ after a step that stalled this way: the step halves on a direction flip (down to
// alpha_min) and doubles back (up to alpha) while the direction holds
static inline KX_HOST_DEVICE void kx_tam_adapt(const struct kx_tam_config * c, struct kx_tam_state * s,
                                               int32_t stall) {
    const int32_t d = stall == KX_TAM_STALL_IO ? 1 : stall == KX_TAM_STALL_CPU ? -1 : 0;
    if (!c->adaptive || d == 0) {
        return;
    }
    if (s->last_dir != 0 && d != s->last_dir) {
        const float h = s->alpha / 2.0f;
        s->alpha = h > c->alpha_min ? h : c->alpha_min;
    } else if (s->last_dir == d) {
        const float g = s->alpha * 2.0f;
        s->alpha = g < c->alpha ? g : c->alpha;
    }
    s->last_dir = d;
    float lam = s->lam + (float) d * s->alpha; // d * alpha is exact: one rounding, fused or not
    lam = lam < c->lam_min ? c->lam_min : lam;
    s->lam = lam > c->lam_max ? c->lam_max : lam;
}

static inline KX_HOST_DEVICE float kx_tam_tau(const struct kx_tam_config * c, float lam) {
    return (1.0f - lam) + c->eps;
}

// s ← λ·s + (1 − λ)·a, rounded after the product and after the sum (the reference's
// numpy order); a fused multiply-add would round once and can decide a tie differently
static inline KX_HOST_DEVICE float kx_tam_score(float lam, float s, int32_t active) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(__fmul_rn(lam, s), active ? __fsub_rn(1.0f, lam) : 0.0f);
#else
    volatile float p = lam * s; // volatile: the host compiler may not contract this either
    return p + (active ? 1.0f - lam : 0.0f);
#endif
}

// the order key: larger is better. Scores are >= 0, so their bits order as the values do;
// then residents before non-residents, then lower ids first. Unique per group.
static inline KX_HOST_DEVICE uint64_t kx_tam_key(float score, int32_t resident, int32_t id) {
    union { float f; uint32_t u; } v;
    v.f = score;
    return ((uint64_t) v.u << 32) | ((uint64_t) (resident ? 1 : 0) << 31) | (uint64_t) (0x7FFFFFFF - id);
}

// One step of one layer on the host. score [n] and resident [n] (0/1) are updated in place;
// admit [n] and evict [n] receive 0/1 masks (what to load into slots, what to give up);
// *n_admit / *n_evict their counts. Returns 0, or 1 for bad arguments.
KX_TAM_API int32_t kx_tam_step(const struct kx_tam_config * cfg, struct kx_tam_state * st, float * score,
                               uint8_t * resident, int32_t n, int32_t capacity, const uint8_t * active,
                               int32_t stall, uint8_t * admit, uint8_t * evict, int32_t * n_admit,
                               int32_t * n_evict);

// A recorded trace replayed from empty scores: initial [n] residents, active [n_steps, n]
// and stalls [n_steps] in; admit / evict [n_steps, n] masks and lam [n_steps] (λ after each
// step) out. The host version is in libllama; kx_cuda_tam_replay (libggml-cuda, same
// arguments plus the mean GPU time of one step in *step_us) runs every step as one kernel.
KX_TAM_API int32_t kx_tam_replay(const struct kx_tam_config * cfg, int32_t n, int32_t capacity,
                                 const uint8_t * initial, int32_t n_steps, const uint8_t * active,
                                 const int32_t * stalls, uint8_t * admit, uint8_t * evict, float * lam);
KX_TAM_API int32_t kx_cuda_tam_replay(const struct kx_tam_config * cfg, int32_t n, int32_t capacity,
                                      const uint8_t * initial, int32_t n_steps, const uint8_t * active,
                                      const int32_t * stalls, uint8_t * admit, uint8_t * evict, float * lam,
                                      float * step_us);

#ifdef __cplusplus
}
#endif
