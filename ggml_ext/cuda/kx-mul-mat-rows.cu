// GGML_OP_KX_MUL_MAT_ROWS on CUDA: w·x for the neurons listed in sel, through an optional
// row map (GPU neuron slots: rowmap[i] = slot of neuron i, or -1 when not resident).
//
// One warp per listed neuron, grid-stride over the list: every warp streams one weight
// row once and dots it with all tokens' x (≤ KX_CUDA_MAX_TOKENS in registers), so a batch
// reads its union of rows once. Rows move in 16-byte loads (F32/F16) or one block per
// lane (Q8_0/Q4_0: 34/18-byte blocks, 2-byte aligned, read as 16-bit words). x is read
// as float, weights are dequantized on the fly: no x quantization pass (the CPU path
// quantizes x to Q8 for quantized weights; the difference stays within test tolerance).
// Gated (src[4], the up rows of a ReLU GLU): a neuron whose gate is <= 0 for every token
// is skipped before its row is read; about half of a predicted list does not fire, and a
// mapped row costs PCIe bandwidth.
//
// A lane issues KX_MMR_LOADS of its row's 16-byte loads before it uses any of them. Why:
// with one load per loop step a warp walked an 8 KiB row in 16 dependent round trips;
// over PCIe (mapped host rows) that made the kernel latency-bound, ~31 µs per layer for a
// row gather the gated form halved without getting faster (H200, KB-7B, Nsight Compute).
// No list (sel NULL): every row in order, a plain matvec.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_MMR_WARPS 4 // warps per block
#define KX_MMR_LOADS 8 // 16-byte loads a lane has in flight: 4 KiB per warp

// x: token t at x + t*sx (floats); adds w[c .. c+len) · x[c .. c+len) into acc
template <ggml_type type>
static __device__ __forceinline__ void kx_row_dot(const char * __restrict__ row, const float * __restrict__ x,
                                                  int64_t sx, int nt, int64_t k, int lane, float * acc) {
    if constexpr (type == GGML_TYPE_F16) {
        const int4 * r = (const int4 *) row; // 8 halves per load
        const int64_t nl = k/8;
        for (int64_t base = lane; base < nl; base += KX_MMR_LOADS*WARP_SIZE) {
            int4 raw[KX_MMR_LOADS];
#pragma unroll
            for (int u = 0; u < KX_MMR_LOADS; ++u) {
                const int64_t c8 = base + u*WARP_SIZE;
                raw[u] = c8 < nl ? r[c8] : make_int4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < KX_MMR_LOADS; ++u) {
                const int64_t c8 = base + u*WARP_SIZE;
                if (c8 >= nl) {
                    break;
                }
                const half2 * h = (const half2 *) &raw[u];
                float2 w[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    w[q] = __half22float2(h[q]);
                }
#pragma unroll
                for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                    if (t < nt) {
                        const float4 * xt = (const float4 *) (x + t*sx + c8*8);
                        const float4 a = xt[0], b = xt[1];
                        acc[t] += w[0].x*a.x + w[0].y*a.y + w[1].x*a.z + w[1].y*a.w
                                + w[2].x*b.x + w[2].y*b.y + w[3].x*b.z + w[3].y*b.w;
                    }
                }
            }
        }
    } else if constexpr (type == GGML_TYPE_F32) {
        const float4 * r = (const float4 *) row;
        const int64_t nl = k/4;
        for (int64_t base = lane; base < nl; base += KX_MMR_LOADS*WARP_SIZE) {
            float4 wl[KX_MMR_LOADS];
#pragma unroll
            for (int u = 0; u < KX_MMR_LOADS; ++u) {
                const int64_t c4 = base + u*WARP_SIZE;
                wl[u] = c4 < nl ? r[c4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < KX_MMR_LOADS; ++u) {
                const int64_t c4 = base + u*WARP_SIZE;
                if (c4 >= nl) {
                    break;
                }
                const float4 w = wl[u];
#pragma unroll
                for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                    if (t < nt) {
                        const float4 a = ((const float4 *) (x + t*sx))[c4];
                        acc[t] += w.x*a.x + w.y*a.y + w.z*a.z + w.w*a.w;
                    }
                }
            }
        }
    } else if constexpr (type == GGML_TYPE_Q8_0) {
        const block_q8_0 * r = (const block_q8_0 *) row;
        for (int64_t b = lane; b < k/QK8_0; b += WARP_SIZE) {
            const float d = __half2float(r[b].d);
            const uint16_t * q16 = (const uint16_t *) r[b].qs;
            float wv[QK8_0];
#pragma unroll
            for (int j = 0; j < QK8_0/2; ++j) {
                const uint16_t u = q16[j];
                wv[2*j]     = d*(float) (int8_t) (u & 0xFF);
                wv[2*j + 1] = d*(float) (int8_t) (u >> 8);
            }
#pragma unroll
            for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                if (t < nt) {
                    const float4 * xt = (const float4 *) (x + t*sx + b*QK8_0);
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < QK8_0/4; ++j) {
                        const float4 a = xt[j];
                        s += wv[4*j]*a.x + wv[4*j + 1]*a.y + wv[4*j + 2]*a.z + wv[4*j + 3]*a.w;
                    }
                    acc[t] += s;
                }
            }
        }
    } else { // Q4_0: element j = (qs[j] & 0xF) - 8, element j + 16 = (qs[j] >> 4) - 8
        const block_q4_0 * r = (const block_q4_0 *) row;
        for (int64_t b = lane; b < k/QK4_0; b += WARP_SIZE) {
            const float d = __half2float(r[b].d);
            const uint16_t * q16 = (const uint16_t *) r[b].qs;
            float wv[QK4_0];
#pragma unroll
            for (int j = 0; j < QK4_0/4; ++j) {
                const uint16_t u = q16[j];
                wv[2*j]          = d*(float) ((int) (u & 0xF) - 8);
                wv[2*j + 16]     = d*(float) ((int) ((u >> 4) & 0xF) - 8);
                wv[2*j + 1]      = d*(float) ((int) ((u >> 8) & 0xF) - 8);
                wv[2*j + 17]     = d*(float) ((int) (u >> 12) - 8);
            }
#pragma unroll
            for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                if (t < nt) {
                    const float4 * xt = (const float4 *) (x + t*sx + b*QK4_0);
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < QK4_0/4; ++j) {
                        const float4 a = xt[j];
                        s += wv[4*j]*a.x + wv[4*j + 1]*a.y + wv[4*j + 2]*a.z + wv[4*j + 3]*a.w;
                    }
                    acc[t] += s;
                }
            }
        }
    }
}

template <ggml_type type>
static __global__ void kx_mul_mat_rows_kernel(const char * __restrict__ w, int64_t w_nb1,
                                              const float * __restrict__ x, int64_t sx,
                                              const int32_t * __restrict__ sel, const int32_t * __restrict__ rowmap,
                                              const float * __restrict__ gate,
                                              float * __restrict__ dst, int64_t n, int64_t k, int nt) {
    const int     lane   = threadIdx.x % WARP_SIZE;
    const int64_t warp   = (int64_t) blockIdx.x*KX_MMR_WARPS + threadIdx.x/WARP_SIZE;
    const int64_t nwarps = (int64_t) gridDim.x*KX_MMR_WARPS;
    const int64_t count  = sel ? sel[0] : n;
    for (int64_t j = warp; j < count; j += nwarps) {
        const int32_t i = sel ? sel[1 + j] : (int32_t) j;
        const int32_t r = rowmap ? rowmap[i] : i;
        if (r < 0) {
            continue; // listed but not in this weight: the other side computes it
        }
        if (gate) { // gated (ReLU up rows): a neuron whose gate is <= 0 for every token adds 0
            bool on = false;
            for (int t = 0; t < nt; ++t) {
                on |= gate[i + t*n] > 0.0f;
            }
            if (!on) {
                continue;
            }
        }
        float acc[KX_CUDA_MAX_TOKENS] = {0.0f};
        kx_row_dot<type>(w + r*w_nb1, x, sx, nt, k, lane, acc);
#pragma unroll
        for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
            if (t < nt) {
                const float s = warp_reduce_sum(acc[t]);
                if (lane == 0) {
                    dst[i + t*n] = s;
                }
            }
        }
    }
}

void ggml_cuda_kx_mul_mat_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * w      = dst->src[0];
    const ggml_tensor * x      = dst->src[1];
    const ggml_tensor * sel    = dst->src[2];
    const ggml_tensor * rowmap = dst->src[3];
    cudaStream_t stream = ctx.stream();

    const int64_t n  = dst->ne[0];
    const int64_t k  = w->ne[0];
    const int     nt = (int) x->ne[1];
    GGML_ASSERT(nt <= KX_CUDA_MAX_TOKENS);
    GGML_ASSERT(dst->nb[1] == n*(int64_t) sizeof(float));

    // unlisted (and non-resident) neurons must read 0: the GLU after this op relies on it;
    // a plain matvec (no list, no map, no gate) writes every row
    if (sel || rowmap || dst->src[4]) {
        CUDA_CHECK(cudaMemsetAsync(dst->data, 0, ggml_nbytes(dst), stream));
    }

    // enough warps to keep every SM's memory pipeline full at the densest list, no more
    const int nsm = ggml_cuda_info().devices[ctx.device].nsm;
    const int64_t blocks = std::min<int64_t>((n + KX_MMR_WARPS - 1)/KX_MMR_WARPS, (int64_t) nsm*16);
    const dim3 grid((unsigned) std::max<int64_t>(1, blocks));
    const dim3 block(KX_MMR_WARPS*WARP_SIZE);
    const int64_t sx = x->nb[1]/sizeof(float);
    const int32_t * list = sel ? (const int32_t *) sel->data : nullptr;
    const int32_t * map = rowmap ? (const int32_t *) rowmap->data : nullptr;
    const float * gate = dst->src[4] ? (const float *) dst->src[4]->data : nullptr; // [n, nt], contiguous
#define KX_MMR_LAUNCH(T) kx_mul_mat_rows_kernel<T><<<grid, block, 0, stream>>>( \
        (const char *) w->data, w->nb[1], (const float *) x->data, sx, list, map, gate, \
        (float *) dst->data, n, k, nt)
    switch (w->type) {
        case GGML_TYPE_F32:  KX_MMR_LAUNCH(GGML_TYPE_F32);  break;
        case GGML_TYPE_F16:  KX_MMR_LAUNCH(GGML_TYPE_F16);  break;
        case GGML_TYPE_Q8_0: KX_MMR_LAUNCH(GGML_TYPE_Q8_0); break;
        case GGML_TYPE_Q4_0: KX_MMR_LAUNCH(GGML_TYPE_Q4_0); break;
        default: GGML_ABORT("kx_mul_mat_rows: unsupported type %s", ggml_type_name(w->type));
    }
#undef KX_MMR_LAUNCH
}
