// GGML_OP_KX_MUL_MAT_ROWS on CUDA: w·x for the neurons listed in sel, through an optional
// row map (GPU neuron slots: rowmap[i] = slot of neuron i, or -1 when not resident).
//
// One warp per listed neuron (K-quants: a block, its warps splitting the row), grid-stride
// over the list: every warp streams one weight row (or its part) once and dots it with all
// tokens' x (≤ KX_CUDA_MAX_TOKENS in registers), so a batch reads its union of rows once. Rows
// move in 16-byte loads (F32/F16 straight to registers, Q8_0/Q4_0 staged through shared
// memory); K-quants (Q4_K, Q5_K, Q6_K) a super-block at a time, the lanes splitting its quant
// bytes (kx_row_dot_k, kx_mul_mat_rows_k_kernel); a Q8_0/Q4_0 row that is not
// 16-byte aligned falls back to one block per lane read as 16-bit words. x is read
// as float, weights are dequantized on the fly: no x quantization pass (the CPU path
// quantizes x to Q8 for quantized weights; the difference stays within test tolerance).
// Every kernel is compiled for one token (NT = 1, the decode) and for up to
// KX_CUDA_MAX_TOKENS. Why: with the count known only at run time each lane kept 8
// accumulators live, and the Q4_K row kernel took 110 registers a thread (4 blocks an SM on the
// H100); for one token it takes 56.
// Gated (src[4], the up rows of a ReLU GLU): a neuron whose gate is <= 0 for every token
// is skipped before its row is read; about half of a predicted list does not fire, and a
// mapped row costs PCIe bandwidth. The op stores relu(g) * u, the GLU's output, so no GLU
// kernel follows it.
//
// A lane issues KX_MMR_LOADS of its row's 16-byte loads before it uses any of them. Why:
// with one load per loop step a warp walked an 8 KiB row in 16 dependent round trips;
// over PCIe (mapped host rows) that made the kernel latency-bound, ~31 µs per layer for a
// row gather the gated form halved without getting faster (H200, KB-7B, Nsight Compute).
// No list (sel NULL): every row in order, a plain matvec. Short F32/F16 rows (512 B to 2 KiB:
// the predictor's B) take kx_mul_mat_rows_short_kernel, short Q8_0 rows (8-32 blocks)
// kx_mul_mat_rows_short_q8_0_kernel, several rows per warp.
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

// Units [0, nu) of src into the warp's shared stage st[0, cap) (zeros past nu): a lane's N
// loads all in flight before its stores, then the warp meets.
template <int N>
static __device__ __forceinline__ void kx_stage_units(const int4 * __restrict__ src, int64_t nu, int4 * st, int cap,
                                                      int lane) {
    int4 raw[N];
#pragma unroll
    for (int u = 0; u < N; ++u) {
        const int c = lane + u*WARP_SIZE;
        raw[u] = c < nu ? src[c] : int4{};
    }
#pragma unroll
    for (int u = 0; u < N; ++u) {
        const int c = lane + u*WARP_SIZE;
        if (c < cap) {
            st[c] = raw[u];
        }
    }
    __syncwarp();
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

// bytes of one block of the type
template <ggml_type type>
static constexpr int kx_block_bytes = type == GGML_TYPE_Q8_0 ? (int) sizeof(block_q8_0)
                                    : type == GGML_TYPE_Q4_0 ? (int) sizeof(block_q4_0)
                                    : type == GGML_TYPE_Q4_K ? (int) sizeof(block_q4_K)
                                    : type == GGML_TYPE_Q5_K ? (int) sizeof(block_q5_K)
                                    : (int) sizeof(block_q6_K);

// the 32 weights of one Q8_0 (34 bytes) or Q4_0 (18) block, dequantized as ggml's
// dequantize_row_*. Bytes are read as 16-bit words: both block sizes are even, so this is
// aligned wherever the row is.
template <ggml_type type>
static __device__ __forceinline__ void kx_sub_dequant(const char * blk, float * wv) {
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
    } else {
        // element i = (qs[i] & 0xF) - 8, element i + 16 = (qs[i] >> 4) - 8
        static_assert(type == GGML_TYPE_Q4_0, "Q8_0 or Q4_0 (K-quants: kx_row_dot_k)");
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
    }
}

// acc[t] += 32 dequantized weights · x[t][col .. col + 32). NT: the tokens a kernel is
// compiled for (1, the decode; or KX_CUDA_MAX_TOKENS with nt <= NT): acc has NT entries.
template <int NT>
static __device__ __forceinline__ void kx_sub_dot(const float * wv, const float * __restrict__ x, int64_t sx,
                                                  int nt, int64_t col, float * acc) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
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
// chunks start on units (Q4_0 256, Q8_0 128)
template <ggml_type type>
static constexpr __host__ __device__ int kx_stage_blocks() {
    int c = KX_MMR_QLOADS*WARP_SIZE*16/kx_block_bytes<type>;
    while (c*kx_block_bytes<type> % 16 != 0) {
        --c;
    }
    return c;
}

// A K-quant row (Q4_K, Q5_K, Q6_K) · x. A warp takes one super-block at a time and the lanes
// split its quant bytes evenly, so the 32 lanes' x loads fall on whole 128-byte lines:
// Q4_K/Q5_K lane L reads qs[32c + 4l .. +4) (c = L/8, l = L%8), the weights 64c + 4l + [0, 4)
// (low nibbles, sub-block 2c) and 64c + 32 + 4l + [0, 4) (high nibbles, sub-block 2c + 1); Q6_K
// lane L reads ql and qh bytes 2l, 2l + 1 of half n = L/16 (l = L%16), the weights
// 128n + 2l + [0, 2) + {0, 32, 64, 96}. It replaced a lane per 32-weight sub-block, whose x
// loads were 128 bytes apart, every load a different line. Measured alone this changed
// nothing (H100, KB-7B Q4_K_M slot rows: 15.1 / 13.9 µs against 15.8-17.5 / 11.6-13.6 per layer,
// Nsight Compute): the grid's waves bound the kernel (kx_resident_blocks). KX_MMR_KBLOCKS
// super-blocks' loads are in flight at once.
#define KX_MMR_KBLOCKS 4

// four quant values · four x values
static __device__ __forceinline__ float kx_dot4(const float4 a, int v0, int v1, int v2, int v3) {
    return a.x*(float) v0 + a.y*(float) v1 + a.z*(float) v2 + a.w*(float) v3;
}

// part `part` of `parts`: super-blocks [part*KX_MMR_KBLOCKS, +KX_MMR_KBLOCKS) of every
// parts*KX_MMR_KBLOCKS (kx_mul_mat_rows_k_kernel: a warp's part of a row)
template <ggml_type type, int NT>
static __device__ __forceinline__ void kx_row_dot_k(const char * __restrict__ row, const float * __restrict__ x,
                                                    int64_t sx, int nt, int64_t k, int lane, int part, int parts,
                                                    float * acc) {
    constexpr int bs = kx_block_bytes<type>;
    const int64_t nb = k/QK_K;
    for (int64_t b0 = (int64_t) part*KX_MMR_KBLOCKS; b0 < nb; b0 += (int64_t) parts*KX_MMR_KBLOCKS) {
        if constexpr (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K) {
            using block = std::conditional_t<type == GGML_TYPE_Q4_K, block_q4_K, block_q5_K>;
            const int c = lane/8, l = lane%8;
            uint32_t q[KX_MMR_KBLOCKS], qh[KX_MMR_KBLOCKS];
            float2 lo[KX_MMR_KBLOCKS], hi[KX_MMR_KBLOCKS]; // (d·scale, dmin·min) of sub-blocks 2c, 2c + 1
#pragma unroll
            for (int u = 0; u < KX_MMR_KBLOCKS; ++u) {
                if (b0 + u < nb) {
                    const block * b = (const block *) (row + (b0 + u)*bs);
                    q[u] = ((const uint32_t *) (b->qs + 32*c))[l];
                    if constexpr (type == GGML_TYPE_Q5_K) {
                        qh[u] = ((const uint32_t *) b->qh)[l];
                    }
                    const float2 dm = __half22float2(b->dm);
                    // the 8 lanes of a chunk read the same scale bytes: one transaction
                    lo[u] = kx_k4_scale_min(b->scales, 2*c, dm);
                    hi[u] = kx_k4_scale_min(b->scales, 2*c + 1, dm);
                }
            }
#pragma unroll
            for (int u = 0; u < KX_MMR_KBLOCKS; ++u) {
                if (b0 + u >= nb) {
                    break;
                }
                int v[8]; // low nibbles: weights 4l + [0, 4) of sub-block 2c; high: of 2c + 1
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    v[i]     = (int) ((q[u] >> (8*i)) & 0xF);
                    v[i + 4] = (int) ((q[u] >> (8*i + 4)) & 0xF);
                    if constexpr (type == GGML_TYPE_Q5_K) {
                        v[i]     += (int) ((qh[u] >> (8*i + 2*c)) & 1) << 4;
                        v[i + 4] += (int) ((qh[u] >> (8*i + 2*c + 1)) & 1) << 4;
                    }
                }
                const int64_t col = (b0 + u)*QK_K + 64*c + 4*l;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < nt) {
                        const float4 a = *(const float4 *) (x + t*sx + col);
                        const float4 e = *(const float4 *) (x + t*sx + col + 32);
                        // d·sc·Σ v·x − dmin·m·Σ x, per sub-block
                        acc[t] += lo[u].x*kx_dot4(a, v[0], v[1], v[2], v[3]) - lo[u].y*(a.x + a.y + a.z + a.w)
                                + hi[u].x*kx_dot4(e, v[4], v[5], v[6], v[7]) - hi[u].y*(e.x + e.y + e.z + e.w);
                    }
                }
            }
        } else {
            static_assert(type == GGML_TYPE_Q6_K, "a K-quant");
            const int n = lane/16, l = 2*(lane%16);
            uint32_t qa[KX_MMR_KBLOCKS], qb[KX_MMR_KBLOCKS], qh[KX_MMR_KBLOCKS]; // 16-bit words
            float s[KX_MMR_KBLOCKS][4]; // d·scale of the four quarters at l
#pragma unroll
            for (int u = 0; u < KX_MMR_KBLOCKS; ++u) {
                if (b0 + u < nb) {
                    const block_q6_K * b = (const block_q6_K *) (row + (b0 + u)*bs);
                    qa[u] = ((const uint16_t *) (b->ql + 64*n))[l/2];
                    qb[u] = ((const uint16_t *) (b->ql + 64*n + 32))[l/2];
                    qh[u] = ((const uint16_t *) (b->qh + 32*n))[l/2];
                    const float d = __half2float(b->d);
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        s[u][r] = d*(float) b->scales[8*n + l/16 + 2*r];
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < KX_MMR_KBLOCKS; ++u) {
                if (b0 + u >= nb) {
                    break;
                }
                int v[4][2]; // quarter r, weight l + i
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const uint32_t a = qa[u] >> (8*i), b = qb[u] >> (8*i), h = qh[u] >> (8*i);
                    v[0][i] = (int) ((a & 0xF)        | ((h & 3) << 4))        - 32;
                    v[1][i] = (int) ((b & 0xF)        | (((h >> 2) & 3) << 4)) - 32;
                    v[2][i] = (int) (((a >> 4) & 0xF) | (((h >> 4) & 3) << 4)) - 32;
                    v[3][i] = (int) (((b >> 4) & 0xF) | (((h >> 6) & 3) << 4)) - 32;
                }
                const int64_t col = (b0 + u)*QK_K + 128*n + l;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < nt) {
                        float sum = 0.0f;
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const float2 a = *(const float2 *) (x + t*sx + col + 32*r);
                            sum += s[u][r]*(a.x*(float) v[r][0] + a.y*(float) v[r][1]);
                        }
                        acc[t] += sum;
                    }
                }
            }
        }
    }
}

// x: token t at x + t*sx (floats); adds w[c .. c+len) · x[c .. c+len) into acc
// (K-quants: kx_mul_mat_rows_k_kernel). fast (Q8_0/Q4_0 rows aligned for it, kx_mmr_fast): the
// warp reads a chunk of whole blocks in 16-byte units, KX_MMR_QLOADS per lane in flight, into
// shared memory, then each lane dequantizes one block from there. Why: a lane reading its own
// 18- or 34-byte block in 2-byte words had one block in flight, the same latency bound the F16
// path had before its loads were batched. Otherwise a lane takes one block at a time straight
// from the row.
template <ggml_type type, bool fast, int NT>
static __device__ __forceinline__ void kx_row_dot(const char * __restrict__ row, const float * __restrict__ x,
                                                  int64_t sx, int nt, int64_t k, int lane, float * acc) {
    if constexpr (type == GGML_TYPE_F16 || type == GGML_TYPE_F32) {
        constexpr int epu = type == GGML_TYPE_F16 ? 8 : 4; // weights per 16-byte unit
        kx_row_stream((const int4 *) row, k/epu, lane, [&](const int4 & raw, int64_t c) {
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) {
                    acc[t] += kx_unit_dot<type>(raw, x + t*sx + c*epu);
                }
            }
        });
    } else {
        static_assert(!kx_is_k<type>, "K-quant rows: kx_mul_mat_rows_k_kernel");
        constexpr int bs = kx_block_bytes<type>;
        const int64_t nb = k/32; // blocks in the row
        if constexpr (fast) {
            constexpr int cb = kx_stage_blocks<type>();
            __shared__ int4 stage[KX_MMR_WARPS][KX_MMR_QLOADS*WARP_SIZE];
            int4 * st = stage[threadIdx.x/WARP_SIZE];
            const int4 * r = (const int4 *) row;
            const int64_t nl = nb*bs/16;
            for (int64_t b0 = 0; b0 < nb; b0 += cb) {
                const int64_t l0 = b0*bs/16; // chunks hold whole units: cb*bs is a multiple of 16
                kx_stage_units<KX_MMR_QLOADS>(r + l0, min((int64_t) cb*bs/16, nl - l0), st, KX_MMR_QLOADS*WARP_SIZE, lane);
                const int64_t ns = min((int64_t) cb, nb - b0);
                for (int64_t s = lane; s < ns; s += WARP_SIZE) {
                    float wv[32];
                    kx_sub_dequant<type>((const char *) st + s*bs, wv);
                    kx_sub_dot<NT>(wv, x, sx, nt, (b0 + s)*32, acc);
                }
                __syncwarp(); // the next chunk overwrites the stage
            }
        } else {
            for (int64_t s = lane; s < nb; s += WARP_SIZE) {
                float wv[32];
                kx_sub_dequant<type>(row + s*bs, wv);
                kx_sub_dot<NT>(wv, x, sx, nt, s*32, acc);
            }
        }
    }
}

// The weight row of list entry i, or -1 where nothing is to be read: i is listed but not in
// this weight (rowmap -1: the other side computes it), or gated (ReLU up rows) and its gate is
// <= 0 for every token (it adds 0).
static __device__ __forceinline__ int32_t kx_row_to_read(const int32_t * __restrict__ rowmap,
                                                         const float * __restrict__ gate, int32_t i, int64_t n, int nt) {
    const int32_t r = rowmap ? rowmap[i] : i;
    if (r < 0 || !gate) {
        return r;
    }
    bool on = false;
    for (int t = 0; t < nt; ++t) {
        on |= gate[i + t*n] > 0.0f;
    }
    return on ? r : -1;
}

// What a row op stores for neuron i and token t from its dot s: s plus the bias, or for the
// gated op (the up rows of a ReLU GLU) relu(g) * s, the GLU's output (ggml's reglu: g > 0 ? g*u : 0)
static __device__ __forceinline__ float kx_row_out(float s, const float * __restrict__ gate,
                                                   const float * __restrict__ bias, int32_t i, int t, int64_t n) {
    if (gate) {
        const float g = gate[i + t*n];
        return g > 0.0f ? g*s : 0.0f;
    }
    return bias ? s + bias[i] : s;
}

// Every row of dst has one writer, so no memset (a graph node of its own) is needed before
// the kernel: list entry j writes its own row (0 where it reads nothing) and the
// unlisted ids between the previous entry and itself; entry `count` stands for the ids after
// the last one (all of them with an empty list), written by the kernel's first thread group.
// Lists are ascending (kx_select), so the gaps do not overlap.
static __device__ __forceinline__ void kx_rows_zero_gap(const int32_t * __restrict__ sel, int64_t j, int64_t count,
                                                        float * __restrict__ dst, int64_t n, int nt, int tid, int nthr) {
    const int64_t lo = j > 0 ? (int64_t) sel[j] + 1 : 0;
    const int64_t hi = j < count ? (int64_t) sel[1 + j] : n;
    for (int t = 0; t < nt; ++t) {
        for (int64_t r = lo + tid; r < hi; r += nthr) {
            dst[r + t*n] = 0.0f;
        }
    }
}

template <ggml_type type, bool fast, int NT>
static __global__ void kx_mul_mat_rows_kernel(const char * __restrict__ w, int64_t w_nb1,
                                              const float * __restrict__ x, int64_t sx,
                                              const int32_t * __restrict__ sel, const int32_t * __restrict__ rowmap,
                                              const float * __restrict__ gate, const float * __restrict__ bias,
                                              float * __restrict__ dst, int64_t n, int64_t k, int nt) {
    const int     lane   = threadIdx.x % WARP_SIZE;
    const int64_t warp   = (int64_t) blockIdx.x*KX_MMR_WARPS + threadIdx.x/WARP_SIZE;
    const int64_t nwarps = (int64_t) gridDim.x*KX_MMR_WARPS;
    const int64_t count  = sel ? sel[0] : n;
    if (sel && warp == 0) {
        kx_rows_zero_gap(sel, count, count, dst, n, nt, lane, WARP_SIZE);
    }
    for (int64_t j = warp; j < count; j += nwarps) {
        const int32_t i = sel ? sel[1 + j] : (int32_t) j;
        if (sel) {
            kx_rows_zero_gap(sel, j, count, dst, n, nt, lane, WARP_SIZE);
        }
        const int32_t r = kx_row_to_read(rowmap, gate, i, n, nt);
        if (r < 0) {
            if (lane < nt) {
                dst[i + lane*n] = 0.0f;
            }
            continue;
        }
        float acc[NT] = {0.0f};
        kx_row_dot<type, fast, NT>(w + r*w_nb1, x, sx, nt, k, lane, acc);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < nt) {
                const float s = warp_reduce_sum(acc[t]);
                if (lane == 0) {
                    dst[i + t*n] = kx_row_out(s, gate, bias, i, t, n);
                }
            }
        }
    }
}

// K-quant rows (Q4_K, Q5_K, Q6_K), a block per listed neuron: warp w of the block takes
// KX_MMR_KBLOCKS super-blocks of every KX_MMR_WARPS*KX_MMR_KBLOCKS (a 4096-wide row: 4 each,
// one batch of loads), and the block adds the warps' sums in shared memory. Why: with a warp
// per row the warp walked a 4096-wide Q4_K row in 4 dependent batches of ~50 instructions a
// super-block at 13 cycles between issues (Nsight Compute: 0.38 eligible warps per scheduler,
// stalls on L1TEX), 11.5 µs a layer for the slots' gate rows of KB-7B Q4_K_M (H100) while
// llama.cpp's dense matvec, a block per row, read seven times the bytes in 16.7. A block per
// row: gate 11.5 -> 9.5 µs, gated up 11.1 -> 8.8 (same model and GPU). Every thread of a block
// reads the same list entry, so the skips are uniform and the barriers safe.
template <ggml_type type, int NT>
static __global__ void kx_mul_mat_rows_k_kernel(const char * __restrict__ w, int64_t w_nb1,
                                                const float * __restrict__ x, int64_t sx,
                                                const int32_t * __restrict__ sel, const int32_t * __restrict__ rowmap,
                                                const float * __restrict__ gate, const float * __restrict__ bias,
                                                float * __restrict__ dst, int64_t n, int64_t k, int nt) {
    static_assert(kx_is_k<type>, "K-quant rows");
    __shared__ float part[KX_MMR_WARPS][NT];
    const int     lane  = threadIdx.x % WARP_SIZE;
    const int     wi    = threadIdx.x / WARP_SIZE;
    const int64_t count = sel ? sel[0] : n;
    if (sel && blockIdx.x == 0) {
        kx_rows_zero_gap(sel, count, count, dst, n, nt, threadIdx.x, blockDim.x);
    }
    for (int64_t j = blockIdx.x; j < count; j += gridDim.x) {
        const int32_t i = sel ? sel[1 + j] : (int32_t) j;
        if (sel) {
            kx_rows_zero_gap(sel, j, count, dst, n, nt, threadIdx.x, blockDim.x);
        }
        const int32_t r = kx_row_to_read(rowmap, gate, i, n, nt);
        if (r < 0) {
            if (threadIdx.x < nt) {
                dst[i + threadIdx.x*n] = 0.0f;
            }
            continue;
        }
        float acc[NT] = {0.0f};
        kx_row_dot_k<type, NT>(w + r*w_nb1, x, sx, nt, k, lane, wi, KX_MMR_WARPS, acc);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < nt) {
                const float s = warp_reduce_sum(acc[t]);
                if (lane == 0) {
                    part[wi][t] = s;
                }
            }
        }
        __syncthreads();
        if (threadIdx.x < nt) {
            float s = 0.0f;
#pragma unroll
            for (int u = 0; u < KX_MMR_WARPS; ++u) {
                s += part[u][threadIdx.x];
            }
            dst[i + threadIdx.x*n] = kx_row_out(s, gate, bias, i, threadIdx.x, n);
        }
        __syncthreads(); // the next row overwrites part
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
                                                    int64_t sx, const float * __restrict__ bias,
                                                    float * __restrict__ dst, int64_t n, int nt) {
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
                        dst[ch*R + r + t*n] = bias ? v + bias[ch*R + r] : v;
                    }
                }
            }
        }
    }
}

// The same for short Q8_0 rows (the predictor's B at rank 256-1024: 8-32 blocks): a lane per
// block, a warp holding 32/LPR whole rows. Why: through kx_mul_mat_rows_kernel a warp took one
// 272-byte row and left 24 of its lanes idle; KB-7B Q4_K_M's Q8_0 B then cost 12.1 µs per
// layer on the critical path, where the F16 B's short kernel took 4.3 (H100, Nsight Compute).
// A warp's 32 blocks are 1088 contiguous bytes (a contiguous B, 16-byte aligned: its rows are
// 272-1088 bytes, whole 16-byte units), read in 16-byte units into shared memory before each
// lane dequantizes its block there. Why: the lanes' own 34-byte blocks read as 16-bit words
// were 17 scattered loads a lane, and that kernel took 8.3 µs a layer for 3 MB (H100).
template <int LPR, int NT>
static __global__ void kx_mul_mat_rows_short_q8_0_kernel(const char * __restrict__ w, int64_t w_nb1,
                                                         const float * __restrict__ x, int64_t sx,
                                                         const float * __restrict__ bias,
                                                         float * __restrict__ dst, int64_t n, int nt) {
    constexpr int R  = WARP_SIZE/LPR;                          // rows per warp
    constexpr int NU = WARP_SIZE*(int) sizeof(block_q8_0)/16;  // 16-byte units of a warp's blocks
    constexpr int NL = (NU + WARP_SIZE - 1)/WARP_SIZE;         // ... a lane loads
    __shared__ int4 stage[KX_MMR_WARPS][NU];
    const int     lane   = threadIdx.x % WARP_SIZE;
    const int64_t warp   = (int64_t) blockIdx.x*KX_MMR_WARPS + threadIdx.x/WARP_SIZE;
    const int64_t nwarps = (int64_t) gridDim.x*KX_MMR_WARPS;
    const int     rl = lane/LPR, bl = lane%LPR; // the lane's row in the warp's rows, its block
    for (int64_t ch = warp; ch*R < n; ch += nwarps) {
        const int64_t i = ch*R + rl;
        float acc[NT] = {0.0f};
        int4 * st = stage[threadIdx.x/WARP_SIZE];
        // the last warp's rows end early
        kx_stage_units<NL>((const int4 *) (w + ch*R*w_nb1), min((int64_t) NU, (n - ch*R)*w_nb1/16), st, NU, lane);
        if (i < n) {
            float wv[32];
            kx_sub_dequant<GGML_TYPE_Q8_0>((const char *) st + lane*(int) sizeof(block_q8_0), wv);
            kx_sub_dot<NT>(wv, x, sx, nt, 32*bl, acc);
        }
        __syncwarp(); // the next rows overwrite the stage
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < nt) {
                float v = acc[t];
#pragma unroll
                for (int o = LPR/2; o > 0; o >>= 1) {
                    v += __shfl_xor_sync(0xffffffff, v, o, WARP_SIZE);
                }
                if (bl == 0 && i < n) {
                    dst[i + t*n] = bias ? v + bias[i] : v;
                }
            }
        }
    }
}

// `need` blocks of KX_MMR_WARPS warps, at most one wave of `kernel` (kx_resident_blocks)
static dim3 kx_mmr_grid(const void * kernel, int64_t need, int device) {
    const int64_t wave = kx_resident_blocks(kernel, KX_MMR_WARPS*WARP_SIZE, device);
    return dim3((unsigned) std::max<int64_t>(1, std::min(need, wave)));
}

// kx_mul_mat_rows_short_kernel for w when it applies (see there), else false
static bool kx_mul_mat_rows_short(const ggml_tensor * w, const float * x, int64_t sx, const float * bias, float * dst,
                                  int64_t n, int nt, int device, cudaStream_t stream) {
    const dim3 block(KX_MMR_WARPS*WARP_SIZE);
    if (w->type == GGML_TYPE_Q8_0) {
        const int64_t lpr = w->ne[0]/QK8_0; // lanes (blocks) per row
        if (w->ne[1] != n || (lpr != 8 && lpr != 16 && lpr != 32) || !ggml_is_contiguous(w) || (uintptr_t) w->data % 16 != 0) {
            return false;
        }
        const int64_t need = ((n*lpr + WARP_SIZE - 1)/WARP_SIZE + KX_MMR_WARPS - 1)/KX_MMR_WARPS;
        const char * wd = (const char *) w->data;
#define KX_MMR_SHORT_Q8_NT(L, NT) kx_mul_mat_rows_short_q8_0_kernel<L, NT><<<kx_mmr_grid( \
        (const void *) kx_mul_mat_rows_short_q8_0_kernel<L, NT>, need, device), block, 0, stream>>>(wd, w->nb[1], x, sx, bias, dst, n, nt)
#define KX_MMR_SHORT_Q8(L) if (nt == 1) { KX_MMR_SHORT_Q8_NT(L, 1); } else { KX_MMR_SHORT_Q8_NT(L, KX_CUDA_MAX_TOKENS); }
        if (lpr == 8) { KX_MMR_SHORT_Q8(8); } else if (lpr == 16) { KX_MMR_SHORT_Q8(16); } else { KX_MMR_SHORT_Q8(32); }
#undef KX_MMR_SHORT_Q8
#undef KX_MMR_SHORT_Q8_NT
        return true;
    }
    if ((w->type != GGML_TYPE_F32 && w->type != GGML_TYPE_F16) || !ggml_is_contiguous(w) ||
        (uintptr_t) w->data % 16 != 0 || w->ne[1] != n) {
        return false;
    }
    const int64_t nl = w->nb[1]/16; // units per row
    const int r = nl == 32 ? 8 : nl == 64 ? 4 : nl == 128 ? 2 : 0;
    if (w->nb[1] % 16 != 0 || r == 0) {
        return false;
    }
    const int64_t need = ((n + r - 1)/r + KX_MMR_WARPS - 1)/KX_MMR_WARPS;
    const int4 * wd = (const int4 *) w->data;
#define KX_MMR_SHORT_NT(T, R, NT) kx_mul_mat_rows_short_kernel<T, R, NT><<<kx_mmr_grid( \
        (const void *) kx_mul_mat_rows_short_kernel<T, R, NT>, need, device), block, 0, stream>>>(wd, x, sx, bias, dst, n, nt)
#define KX_MMR_SHORT(T, R) if (nt == 1) { KX_MMR_SHORT_NT(T, R, 1); } else { KX_MMR_SHORT_NT(T, R, KX_CUDA_MAX_TOKENS); }
    if (w->type == GGML_TYPE_F16) {
        if (r == 8) { KX_MMR_SHORT(GGML_TYPE_F16, 8); } else if (r == 4) { KX_MMR_SHORT(GGML_TYPE_F16, 4); } else { KX_MMR_SHORT(GGML_TYPE_F16, 2); }
    } else {
        if (r == 8) { KX_MMR_SHORT(GGML_TYPE_F32, 8); } else if (r == 4) { KX_MMR_SHORT(GGML_TYPE_F32, 4); } else { KX_MMR_SHORT(GGML_TYPE_F32, 2); }
    }
#undef KX_MMR_SHORT
#undef KX_MMR_SHORT_NT
    return true;
}

// whether Q8_0/Q4_0 rows take the staged loads of kx_row_dot: 16-byte aligned rows (k % 256
// == 0, and a 16-byte aligned base: ggml buffers, mapped GGUF data)
static bool kx_mmr_fast(const ggml_tensor * w) {
    return (uintptr_t) w->data % 16 == 0 && w->nb[1] % 16 == 0;
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

    const int64_t sx = x->nb[1]/sizeof(float);
    const float * bias = dst->src[5] ? (const float *) dst->src[5]->data : nullptr; // no list, no map (kx-ops.h)
    if (!sel && !rowmap && !dst->src[4] &&
        kx_mul_mat_rows_short(w, (const float *) x->data, sx, bias, (float *) dst->data, n, nt, ctx.device, stream)) {
        return;
    }
    // a warp for every neuron the list can hold, up to one wave of blocks (kx_resident_blocks)
    const int64_t need = (n + KX_MMR_WARPS - 1)/KX_MMR_WARPS;
    const dim3 block(KX_MMR_WARPS*WARP_SIZE);
    const int32_t * list = sel ? (const int32_t *) sel->data : nullptr;
    const int32_t * map = rowmap ? (const int32_t *) rowmap->data : nullptr;
    const float * gate = dst->src[4] ? (const float *) dst->src[4]->data : nullptr; // [n, nt], contiguous
    const bool fast = kx_mmr_fast(w);
#define KX_MMR_LAUNCH_NT(T, S, NT) kx_mul_mat_rows_kernel<T, S, NT><<<kx_mmr_grid((const void *) kx_mul_mat_rows_kernel<T, S, NT>, \
        need, ctx.device), block, 0, stream>>>((const char *) w->data, w->nb[1], (const float *) x->data, sx, list, map, gate, \
        bias, (float *) dst->data, n, k, nt)
#define KX_MMR_LAUNCH(T, S) if (nt == 1) { KX_MMR_LAUNCH_NT(T, S, 1); } else { KX_MMR_LAUNCH_NT(T, S, KX_CUDA_MAX_TOKENS); }
    switch (w->type) {
        case GGML_TYPE_F32:  KX_MMR_LAUNCH(GGML_TYPE_F32, false); break;
        case GGML_TYPE_F16:  KX_MMR_LAUNCH(GGML_TYPE_F16, false); break;
// Q8_0/Q4_0: staged where the rows allow it (kx_mmr_fast)
#define KX_MMR_QUANT(T) case T: \
            if (fast) { KX_MMR_LAUNCH(T, true); } else { KX_MMR_LAUNCH(T, false); } \
            break
        KX_MMR_QUANT(GGML_TYPE_Q8_0);
        KX_MMR_QUANT(GGML_TYPE_Q4_0);
#undef KX_MMR_QUANT
        // K-quant blocks hold 16-bit (Q6_K) or 32-bit (dm) fields, so their rows are always
        // aligned for kx_row_dot_k's words; a block per neuron the list can hold, up to one wave
#define KX_MMR_K_NT(T, NT) kx_mul_mat_rows_k_kernel<T, NT><<<kx_mmr_grid((const void *) kx_mul_mat_rows_k_kernel<T, NT>, \
        n, ctx.device), block, 0, stream>>>((const char *) w->data, w->nb[1], (const float *) x->data, sx, list, map, gate, \
        bias, (float *) dst->data, n, k, nt)
#define KX_MMR_K(T) case T: if (nt == 1) { KX_MMR_K_NT(T, 1); } else { KX_MMR_K_NT(T, KX_CUDA_MAX_TOKENS); } break
        KX_MMR_K(GGML_TYPE_Q4_K);
        KX_MMR_K(GGML_TYPE_Q5_K);
        KX_MMR_K(GGML_TYPE_Q6_K);
#undef KX_MMR_K
#undef KX_MMR_K_NT
        default: GGML_ABORT("kx_mul_mat_rows: unsupported type %s", ggml_type_name(w->type));
    }
#undef KX_MMR_LAUNCH
#undef KX_MMR_LAUNCH_NT
}
