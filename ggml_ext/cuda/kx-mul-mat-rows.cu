// GGML_OP_KX_MUL_MAT_ROWS on CUDA: w·x for the neurons listed in sel, through an optional
// row map (GPU neuron slots: rowmap[i] = slot of neuron i, or -1 when not resident).
//
// One warp per listed neuron, grid-stride over the list: every warp streams one weight
// row once and dots it with all tokens' x (≤ KX_CUDA_MAX_TOKENS in registers), so a batch
// reads its union of rows once. Rows move in 16-byte loads (F32/F16 straight to registers,
// Q8_0/Q4_0 staged through shared memory; a quantized row that is not 16-byte aligned
// falls back to one block per lane read as 16-bit words; K-quants (Q4_K, Q5_K, Q6_K) go
// the same way with a lane per eighth of a 256-weight super-block). x is read
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
// No list (sel NULL): every row in order, a plain matvec. Short contiguous F32/F16 rows (512
// B to 2 KiB: the predictor's B) take kx_mul_mat_rows_short_kernel, several rows per warp.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_MMR_WARPS 4 // warps per block
#define KX_MMR_LOADS 8 // 16-byte loads a lane has in flight: 4 KiB per warp
#define KX_MMR_QLOADS 9 // the same for quantized rows, staged: 288 units = 4608 bytes per warp

// A row as 16-byte units: a lane loads units lane, lane + 32, ... KX_MMR_LOADS at a time,
// then hands each to use(unit, index) in order.
template <typename U, typename F>
static __device__ __forceinline__ void kx_row_stream(const U * __restrict__ r, int64_t nl, int lane, F use) {
    for (int64_t base = lane; base < nl; base += KX_MMR_LOADS*WARP_SIZE) {
        U raw[KX_MMR_LOADS];
#pragma unroll
        for (int u = 0; u < KX_MMR_LOADS; ++u) {
            const int64_t c = base + u*WARP_SIZE;
            raw[u] = c < nl ? r[c] : U{};
        }
#pragma unroll
        for (int u = 0; u < KX_MMR_LOADS; ++u) {
            const int64_t c = base + u*WARP_SIZE;
            if (c >= nl) {
                break;
            }
            use(raw[u], c);
        }
    }
}

// one 16-byte unit of an F16 (8 weights) or F32 (4 weights) row · x at the unit's first
// weight (xt, 16-byte aligned): the one place both row kernels write this dot
template <ggml_type type>
static __device__ __forceinline__ float kx_unit_dot(const int4 & raw, const float * __restrict__ xt) {
    const float4 a = ((const float4 *) xt)[0];
    if constexpr (type == GGML_TYPE_F16) {
        const half2 * h = (const half2 *) &raw;
        const float2 w0 = __half22float2(h[0]), w1 = __half22float2(h[1]);
        const float2 w2 = __half22float2(h[2]), w3 = __half22float2(h[3]);
        const float4 b = ((const float4 *) xt)[1];
        return w0.x*a.x + w0.y*a.y + w1.x*a.z + w1.y*a.w + w2.x*b.x + w2.y*b.y + w3.x*b.z + w3.y*b.w;
    } else {
        static_assert(type == GGML_TYPE_F32, "F16 or F32 units");
        const float4 w = *(const float4 *) &raw;
        return w.x*a.x + w.y*a.y + w.z*a.z + w.w*a.w;
    }
}

// K-quants: 256-weight super-blocks of 8 sub-blocks of 32 weights each
template <ggml_type type>
static constexpr bool kx_is_k = type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K;

// bytes of one block of the type, and the 32-weight sub-blocks in it (a lane's unit of work)
template <ggml_type type>
static constexpr int kx_block_bytes = type == GGML_TYPE_Q8_0 ? (int) sizeof(block_q8_0)
                                    : type == GGML_TYPE_Q4_0 ? (int) sizeof(block_q4_0)
                                    : type == GGML_TYPE_Q4_K ? (int) sizeof(block_q4_K)
                                    : type == GGML_TYPE_Q5_K ? (int) sizeof(block_q5_K)
                                    : (int) sizeof(block_q6_K);
template <ggml_type type>
static constexpr int kx_block_subs = kx_is_k<type> ? QK_K/32 : 1;

// scale and min of sub-block j of a Q4_K/Q5_K super-block: 6-bit values packed in 12 bytes
// (the layout of ggml's get_scale_min_k4)
static __device__ __forceinline__ void kx_scale_min_k4(int j, const uint8_t * q, float & sc, float & m) {
    if (j < 4) {
        sc = (float) (q[j] & 63);
        m  = (float) (q[j + 4] & 63);
    } else {
        sc = (float) ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        m  = (float) ((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// sub-block j's 32 weights of one quantized block, dequantized as ggml's dequantize_row_*.
// Bytes are read as 16-bit words: every block size is even, so this is aligned wherever the
// row is (Q6_K's 210-byte blocks are 2-byte aligned only).
// Q8_0 (34 bytes), Q4_0 (18): j = 0, the block's 32 weights. Q4_K (144): sub-block j's nibbles
// are the low (j even) or high (j odd) halves of qs[32 (j/2) ..]; Q5_K (176) adds bit j of
// qh[l] as 16; Q6_K (210): 128-weight halves h = j/4 of 64 ql and 32 qh bytes, quarter r = j%4
// reads ql[32 (r%2) + l] (low nibble for r < 2), qh[l] bits 2r, scales 2r + l/16.
template <ggml_type type>
static __device__ __forceinline__ void kx_sub_dequant(const char * blk, int j, float * wv) {
    if constexpr (type == GGML_TYPE_Q8_0) {
        const block_q8_0 * b = (const block_q8_0 *) blk;
        const float d = __half2float(b->d);
        const uint16_t * q16 = (const uint16_t *) b->qs;
#pragma unroll
        for (int i = 0; i < QK8_0/2; ++i) {
            const uint16_t u = q16[i];
            wv[2*i]     = d*(float) (int8_t) (u & 0xFF);
            wv[2*i + 1] = d*(float) (int8_t) (u >> 8);
        }
    } else if constexpr (type == GGML_TYPE_Q4_0) { // element i = (qs[i] & 0xF) - 8, element i + 16 = (qs[i] >> 4) - 8
        const block_q4_0 * b = (const block_q4_0 *) blk;
        const float d = __half2float(b->d);
        const uint16_t * q16 = (const uint16_t *) b->qs;
#pragma unroll
        for (int i = 0; i < QK4_0/4; ++i) {
            const uint16_t u = q16[i];
            wv[2*i]      = d*(float) ((int) (u & 0xF) - 8);
            wv[2*i + 16] = d*(float) ((int) ((u >> 4) & 0xF) - 8);
            wv[2*i + 1]  = d*(float) ((int) ((u >> 8) & 0xF) - 8);
            wv[2*i + 17] = d*(float) ((int) (u >> 12) - 8);
        }
    } else if constexpr (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K) {
        using block = std::conditional_t<type == GGML_TYPE_Q4_K, block_q4_K, block_q5_K>;
        const block * b = (const block *) blk;
        const float2 dm = __half22float2(b->dm);
        float sc, m;
        kx_scale_min_k4(j, b->scales, sc, m);
        const float d1 = dm.x*sc, m1 = dm.y*m;
        const uint16_t * q16 = (const uint16_t *) (b->qs + 32*(j/2));
        const int sh = 4*(j%2);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint32_t u = (uint32_t) q16[i] >> sh;
            int v0 = (int) (u & 0xF), v1 = (int) ((u >> 8) & 0xF);
            if constexpr (type == GGML_TYPE_Q5_K) {
                const uint32_t h = (uint32_t) ((const uint16_t *) b->qh)[i] >> j;
                v0 += (int) (h & 1) << 4;
                v1 += (int) ((h >> 8) & 1) << 4;
            }
            wv[2*i]     = d1*(float) v0 - m1;
            wv[2*i + 1] = d1*(float) v1 - m1;
        }
    } else {
        static_assert(type == GGML_TYPE_Q6_K, "a quantized type");
        const block_q6_K * b = (const block_q6_K *) blk;
        const float d = __half2float(b->d);
        const int h = j/4, r = j%4;
        const uint16_t * ql = (const uint16_t *) (b->ql + 64*h + 32*(r%2));
        const uint16_t * qh = (const uint16_t *) (b->qh + 32*h);
        const int shl = 4*(r/2), shh = 2*r;
        const float s0 = d*(float) b->scales[8*h + 2*r], s1 = d*(float) b->scales[8*h + 2*r + 1];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint32_t lo = (uint32_t) ql[i] >> shl, hi = (uint32_t) qh[i] >> shh;
            const int v0 = (int) ((lo & 0xF) | ((hi & 3) << 4)) - 32;
            const int v1 = (int) (((lo >> 8) & 0xF) | (((hi >> 8) & 3) << 4)) - 32;
            const float s = i < 8 ? s0 : s1; // weights 0-15 and 16-31 have their own scale
            wv[2*i]     = s*(float) v0;
            wv[2*i + 1] = s*(float) v1;
        }
    }
}

// acc[t] += 32 dequantized weights · x[t][col .. col + 32)
static __device__ __forceinline__ void kx_sub_dot(const float * wv, const float * __restrict__ x, int64_t sx,
                                                  int nt, int64_t col, float * acc) {
#pragma unroll
    for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
        if (t < nt) {
            const float4 * xt = (const float4 *) (x + t*sx + col);
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float4 a = xt[j];
                s += wv[4*j]*a.x + wv[4*j + 1]*a.y + wv[4*j + 2]*a.z + wv[4*j + 3]*a.w;
            }
            acc[t] += s;
        }
    }
}

// blocks per staged chunk: the most whose bytes fit the stage and end on a 16-byte unit, so
// chunks start on units (Q4_0 256, Q8_0 128, Q4_K 32, Q5_K 26, Q6_K 16)
template <ggml_type type>
static constexpr __host__ __device__ int kx_stage_blocks() {
    int c = KX_MMR_QLOADS*WARP_SIZE*16/kx_block_bytes<type>;
    while (c*kx_block_bytes<type> % 16 != 0) {
        --c;
    }
    return c;
}

// x: token t at x + t*sx (floats); adds w[c .. c+len) · x[c .. c+len) into acc.
// Quantized rows: a lane takes one 32-weight sub-block at a time (a whole Q8_0/Q4_0 block, an
// eighth of a K-quant super-block). staged (rows whose start and length are multiples of 16
// bytes): the warp reads a chunk of whole blocks in 16-byte units, KX_MMR_QLOADS per lane in
// flight, into shared memory, then each lane dequantizes from there. Why: a lane reading its
// own 18- or 34-byte block in 2-byte words had one block in flight, the same latency bound
// the F16 path had before its loads were batched.
template <ggml_type type, bool staged>
static __device__ __forceinline__ void kx_row_dot(const char * __restrict__ row, const float * __restrict__ x,
                                                  int64_t sx, int nt, int64_t k, int lane, float * acc) {
    if constexpr (type == GGML_TYPE_F16 || type == GGML_TYPE_F32) {
        constexpr int epu = type == GGML_TYPE_F16 ? 8 : 4; // weights per 16-byte unit
        kx_row_stream((const int4 *) row, k/epu, lane, [&](const int4 & raw, int64_t c) {
#pragma unroll
            for (int t = 0; t < KX_CUDA_MAX_TOKENS; ++t) {
                if (t < nt) {
                    acc[t] += kx_unit_dot<type>(raw, x + t*sx + c*epu);
                }
            }
        });
    } else {
        constexpr int bs  = kx_block_bytes<type>;
        constexpr int sub = kx_block_subs<type>;
        const int64_t nsub = k/32; // sub-blocks in the row
        if constexpr (staged) {
            constexpr int cb = kx_stage_blocks<type>();
            __shared__ int4 stage[KX_MMR_WARPS][KX_MMR_QLOADS*WARP_SIZE];
            int4 * st = stage[threadIdx.x/WARP_SIZE];
            const int4 * r = (const int4 *) row;
            const int64_t nb = nsub/sub;
            const int64_t nl = nb*bs/16;
            for (int64_t b0 = 0; b0 < nb; b0 += cb) {
                const int64_t l0 = b0*bs/16; // chunks hold whole units: cb*bs is a multiple of 16
                const int64_t ln = min((int64_t) cb*bs/16, nl - l0);
                int4 raw[KX_MMR_QLOADS];
#pragma unroll
                for (int u = 0; u < KX_MMR_QLOADS; ++u) {
                    const int64_t c = lane + u*WARP_SIZE;
                    raw[u] = c < ln ? r[l0 + c] : int4{};
                }
#pragma unroll
                for (int u = 0; u < KX_MMR_QLOADS; ++u) {
                    st[lane + u*WARP_SIZE] = raw[u];
                }
                __syncwarp();
                const int64_t ns = min((int64_t) cb, nb - b0)*sub;
                for (int64_t s = lane; s < ns; s += WARP_SIZE) {
                    float wv[32];
                    kx_sub_dequant<type>((const char *) st + (s/sub)*bs, (int) (s%sub), wv);
                    kx_sub_dot(wv, x, sx, nt, (b0*sub + s)*32, acc);
                }
                __syncwarp(); // the next chunk overwrites the stage
            }
        } else {
            for (int64_t s = lane; s < nsub; s += WARP_SIZE) {
                float wv[32];
                kx_sub_dequant<type>(row + (s/sub)*bs, (int) (s%sub), wv);
                kx_sub_dot(wv, x, sx, nt, s*32, acc);
            }
        }
    }
}

template <ggml_type type, bool staged>
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
        kx_row_dot<type, staged>(w + r*w_nb1, x, sx, nt, k, lane, acc);
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

// The plain matvec over short contiguous rows: a warp reads R whole rows (KX_MMR_LOADS
// 16-byte units per lane, 4 KiB) in one batch of loads. Why: the predictor's B has rows of
// 512 B to 2 KiB (rank 256-512), where one warp per row left most of a lane's batch empty
// and streamed KB-70B's [512, 28672] F16 B at 1.1 TB/s, 26.5 µs per layer on the decode's
// critical path (H200, Nsight Compute); this kernel reads it in 9.2 µs (3.2 TB/s).
// A lane's unit u belongs to row u/(KX_MMR_LOADS/R).
template <ggml_type type, int R, int NT>
static __global__ void kx_mul_mat_rows_short_kernel(const int4 * __restrict__ w, const float * __restrict__ x,
                                                    int64_t sx, float * __restrict__ dst, int64_t n, int nt) {
    constexpr int UPR = KX_MMR_LOADS/R;       // a lane's units per row
    constexpr int NL  = UPR*WARP_SIZE;        // units per row
    constexpr int EPU = type == GGML_TYPE_F16 ? 8 : 4; // weights per unit
    const int     lane   = threadIdx.x % WARP_SIZE;
    const int64_t warp   = (int64_t) blockIdx.x*KX_MMR_WARPS + threadIdx.x/WARP_SIZE;
    const int64_t nwarps = (int64_t) gridDim.x*KX_MMR_WARPS;
    for (int64_t ch = warp; ch*R < n; ch += nwarps) {
        const int64_t nu = min((int64_t) R, n - ch*R)*NL; // units of this warp's rows
        const int4 * wc = w + ch*R*NL;
        int4 raw[KX_MMR_LOADS];
#pragma unroll
        for (int u = 0; u < KX_MMR_LOADS; ++u) {
            const int c = lane + u*WARP_SIZE;
            raw[u] = c < nu ? wc[c] : int4{};
        }
        float acc[R][NT] = {};
#pragma unroll
        for (int u = 0; u < KX_MMR_LOADS; ++u) {
            const int col = (lane + (u % UPR)*WARP_SIZE)*EPU; // first weight of the unit in its row
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) {
                    acc[u/UPR][t] += kx_unit_dot<type>(raw[u], x + t*sx + col);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) {
                    const float v = warp_reduce_sum(acc[r][t]);
                    if (lane == 0 && ch*R + r < n) {
                        dst[ch*R + r + t*n] = v;
                    }
                }
            }
        }
    }
}

// kx_mul_mat_rows_short_kernel for w when it applies (see there), else false
static bool kx_mul_mat_rows_short(const ggml_tensor * w, const float * x, int64_t sx, float * dst,
                                  int64_t n, int nt, int nsm, cudaStream_t stream) {
    if ((w->type != GGML_TYPE_F32 && w->type != GGML_TYPE_F16) || !ggml_is_contiguous(w) ||
        (uintptr_t) w->data % 16 != 0 || w->ne[1] != n) {
        return false;
    }
    const int64_t nl = w->nb[1]/16; // units per row
    const int r = nl == 32 ? 8 : nl == 64 ? 4 : nl == 128 ? 2 : 0;
    if (w->nb[1] % 16 != 0 || r == 0) {
        return false;
    }
    const int64_t warps = (n + r - 1)/r;
    const dim3 grid((unsigned) std::min<int64_t>((warps + KX_MMR_WARPS - 1)/KX_MMR_WARPS, (int64_t) nsm*16));
    const dim3 block(KX_MMR_WARPS*WARP_SIZE);
    const int4 * wd = (const int4 *) w->data;
#define KX_MMR_SHORT(T, R) (nt == 1 ? kx_mul_mat_rows_short_kernel<T, R, 1><<<grid, block, 0, stream>>>(wd, x, sx, dst, n, nt) \
                                    : kx_mul_mat_rows_short_kernel<T, R, KX_CUDA_MAX_TOKENS><<<grid, block, 0, stream>>>(wd, x, sx, dst, n, nt))
    if (w->type == GGML_TYPE_F16) {
        if (r == 8) { KX_MMR_SHORT(GGML_TYPE_F16, 8); } else if (r == 4) { KX_MMR_SHORT(GGML_TYPE_F16, 4); } else { KX_MMR_SHORT(GGML_TYPE_F16, 2); }
    } else {
        if (r == 8) { KX_MMR_SHORT(GGML_TYPE_F32, 8); } else if (r == 4) { KX_MMR_SHORT(GGML_TYPE_F32, 4); } else { KX_MMR_SHORT(GGML_TYPE_F32, 2); }
    }
#undef KX_MMR_SHORT
    return true;
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

    const int nsm = ggml_cuda_info().devices[ctx.device].nsm;
    const int64_t sx = x->nb[1]/sizeof(float);
    if (!sel && !rowmap && !dst->src[4] &&
        kx_mul_mat_rows_short(w, (const float *) x->data, sx, (float *) dst->data, n, nt, nsm, stream)) {
        return;
    }
    // enough warps to keep every SM's memory pipeline full at the densest list, no more
    const int64_t blocks = std::min<int64_t>((n + KX_MMR_WARPS - 1)/KX_MMR_WARPS, (int64_t) nsm*16);
    const dim3 grid((unsigned) std::max<int64_t>(1, blocks));
    const dim3 block(KX_MMR_WARPS*WARP_SIZE);
    const int32_t * list = sel ? (const int32_t *) sel->data : nullptr;
    const int32_t * map = rowmap ? (const int32_t *) rowmap->data : nullptr;
    const float * gate = dst->src[4] ? (const float *) dst->src[4]->data : nullptr; // [n, nt], contiguous
    // quantized rows staged in 16-byte units need 16-byte aligned rows (k % 256 == 0 for
    // Q4_0 and Q8_0, any k for Q4_K and Q5_K, k % 2048 == 0 for Q6_K; and a 16-byte aligned
    // base: ggml buffers, mapped GGUF data)
    const bool staged = (uintptr_t) w->data % 16 == 0 && w->nb[1] % 16 == 0;
#define KX_MMR_LAUNCH(T, S) kx_mul_mat_rows_kernel<T, S><<<grid, block, 0, stream>>>( \
        (const char *) w->data, w->nb[1], (const float *) x->data, sx, list, map, gate, \
        (float *) dst->data, n, k, nt)
    switch (w->type) {
        case GGML_TYPE_F32:  KX_MMR_LAUNCH(GGML_TYPE_F32, false); break;
        case GGML_TYPE_F16:  KX_MMR_LAUNCH(GGML_TYPE_F16, false); break;
// quantized rows: staged through shared memory where the rows allow it (see above)
#define KX_MMR_QUANT(T) case T: \
            if (staged) { KX_MMR_LAUNCH(T, true); } else { KX_MMR_LAUNCH(T, false); } \
            break
        KX_MMR_QUANT(GGML_TYPE_Q8_0);
        KX_MMR_QUANT(GGML_TYPE_Q4_0);
        KX_MMR_QUANT(GGML_TYPE_Q4_K);
        KX_MMR_QUANT(GGML_TYPE_Q5_K);
        KX_MMR_QUANT(GGML_TYPE_Q6_K);
#undef KX_MMR_QUANT
        default: GGML_ABORT("kx_mul_mat_rows: unsupported type %s", ggml_type_name(w->type));
    }
#undef KX_MMR_LAUNCH
}
