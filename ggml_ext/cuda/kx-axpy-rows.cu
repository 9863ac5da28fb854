// GGML_OP_KX_AXPY_ROWS on CUDA: y[:, t] = sum over listed neurons i of h[i, t] * wt[row(i)],
// the down projection as a sum of rows (wt = W_down transposed, one row per neuron).
//
// Grid: column tiles of KX_AXPY_THREADS×CPT outputs × row groups. A block takes the listed
// neurons j ≡ blockIdx.y (mod row groups) in stages of KX_AXPY_THREADS: first every thread
// looks up one of them (list entry, row map, h for each token) and the block compacts those
// with a row here and h != 0 into shared memory; then each thread streams its CPT columns of
// the staged rows, four rows per step, accumulating all tokens in registers, and finally adds
// its partial sums to y with one atomicAdd per column and token (on compute capability 9.0
// and up one float4 atomicAdd per four columns and token). Rows are read coalesced.
// Why staged: looking an entry up takes three dependent loads (list, map, h) before its row
// can be requested; done one entry at a time per thread that chain made the kernel
// latency-bound (H200, KB-7B slots: ~34 µs per layer for ~2 MB of rows, Nsight Compute), while
// the staged form issues the lookups of a stage at once and keeps four independent row loads
// in flight per thread. Why four columns a thread (CPT = 4 where the rows allow it): a
// quantized column costs its block's scale decode and several loads, which four neighbouring
// columns share. Measured alone it moved KB-7B Q4_K_M's Q4_K slot rows from 20.5 to 19.3 µs per
// layer for ~3.7 MB (H100, Nsight Compute): the grid's 1.33 waves bound the kernel
// (kx_resident_blocks). Atomic order (and the order of a stage) makes the last
// bits of y vary from run to run; the test tolerance covers it.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

#define KX_AXPY_THREADS 256 // threads per block, and list entries per stage

// columns c .. c + CPT of one row into w (CPT = 4: c % 4 == 0, and the row aligned as
// kx_axpy_cpt asks). Four columns of a quantized row share their block, sub-block and scale,
// so one thread decodes those once and reads the quants as one or two words.
template <ggml_type type, int CPT>
static __device__ __forceinline__ void kx_load_cols(const char * __restrict__ row, int64_t c, float * w) {
    if constexpr (type == GGML_TYPE_F32) {
        if constexpr (CPT == 4) {
            const float4 v = *(const float4 *) ((const float *) row + c);
            w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
        } else {
            w[0] = ((const float *) row)[c];
        }
    } else if constexpr (type == GGML_TYPE_F16) {
        if constexpr (CPT == 4) {
            const uint2 v = *(const uint2 *) ((const half *) row + c);
            const float2 a = __half22float2(*(const half2 *) &v.x), b = __half22float2(*(const half2 *) &v.y);
            w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y;
        } else {
            w[0] = __half2float(((const half *) row)[c]);
        }
    } else if constexpr (type == GGML_TYPE_Q8_0) {
        const block_q8_0 * b = (const block_q8_0 *) row + c/QK8_0;
        const float d = __half2float(b->d);
        const int j = c % QK8_0;
        if constexpr (CPT == 4) { // qs + j is 2-byte aligned: two 16-bit words
            const uint16_t * q = (const uint16_t *) (b->qs + j);
            const uint32_t lo = q[0], hi = q[1];
            w[0] = d*(float) (int8_t) (lo & 0xFF); w[1] = d*(float) (int8_t) (lo >> 8);
            w[2] = d*(float) (int8_t) (hi & 0xFF); w[3] = d*(float) (int8_t) (hi >> 8);
        } else {
            w[0] = d*(float) b->qs[j];
        }
    } else if constexpr (type == GGML_TYPE_Q4_K) {
        // column j of a super-block: 64-wide chunk j/64 holds sub-blocks 2(j/64) (low nibbles)
        // and 2(j/64) + 1 (high nibbles) in the same 32 bytes (ggml's dequantize_row_q4_K)
        const block_q4_K * b = (const block_q4_K *) row + c/QK_K;
        const int j  = c % QK_K;
        const int hi = (j >> 5) & 1;
        const float2 dm = kx_k4_scale_min(b->scales, 2*(j >> 6) + hi, __half22float2(b->dm));
        const uint8_t * q = b->qs + 32*(j >> 6) + (j & 31);
        if constexpr (CPT == 4) { // 4-byte aligned: 144-byte blocks on a 4-byte aligned row
            const uint32_t v = *(const uint32_t *) q >> (4*hi);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                w[i] = dm.x*(float) ((v >> (8*i)) & 0xF) - dm.y;
            }
        } else {
            w[0] = dm.x*(float) (hi ? q[0] >> 4 : q[0] & 0xF) - dm.y;
        }
    } else { // Q6_K: 128-wide halves of four 32-wide quarters (ggml's dequantize_row_q6_K)
        static_assert(type == GGML_TYPE_Q6_K, "a row type");
        const block_q6_K * b = (const block_q6_K *) row + c/QK_K;
        const int j  = c % QK_K;
        const int n  = j >> 7;         // half
        const int qd = (j >> 5) & 3;   // quarter: ql low/high nibble at +0/+32, qh bits 2*qd
        const int l  = j & 31;
        const float s = __half2float(b->d)*b->scales[8*n + l/16 + 2*qd]; // l .. l + 3 share it
        const uint8_t * ql = b->ql + 64*n + l + 32*(qd & 1);
        const uint8_t * qh = b->qh + 32*n + l;
        uint32_t vl, vh;
        if constexpr (CPT == 4) { // 210-byte blocks: 2-byte aligned only
            vl = (uint32_t) ((const uint16_t *) ql)[0] | (uint32_t) ((const uint16_t *) ql)[1] << 16;
            vh = (uint32_t) ((const uint16_t *) qh)[0] | (uint32_t) ((const uint16_t *) qh)[1] << 16;
        } else {
            vl = ql[0];
            vh = qh[0];
        }
        vl >>= 4*(qd >> 1);
        vh >>= 2*qd;
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
            w[i] = s*(float) ((int) (((vl >> (8*i)) & 0xF) | (((vh >> (8*i)) & 3) << 4)) - 32);
        }
    }
}

// NT: tokens the kernel is compiled for (1, the decode; or KX_CUDA_MAX_TOKENS with nt ≤ NT)
template <ggml_type type, int CPT, int NT>
static __global__ void kx_axpy_rows_kernel(const char * __restrict__ wt, int64_t wt_nb1,
                                           const float * __restrict__ h, int64_t sh,
                                           const int32_t * __restrict__ sel, const int32_t * __restrict__ rowmap,
                                           float * __restrict__ y, int64_t sy, int64_t m, int nt, bool vec) {
    __shared__ int32_t s_row[KX_AXPY_THREADS];
    __shared__ float   s_h[KX_AXPY_THREADS][NT];
    __shared__ int     s_n;

    const int64_t c = ((int64_t) blockIdx.x*KX_AXPY_THREADS + threadIdx.x)*CPT; // first column
    const int64_t count = sel[0];
    // this block's list entries: j = blockIdx.y + q*gridDim.y for q in [0, nq)
    const int64_t nq = count > blockIdx.y ? (count - blockIdx.y + gridDim.y - 1)/gridDim.y : 0;
    float acc[CPT][NT] = {};
    bool any = false;
    for (int64_t q0 = 0; q0 < nq; q0 += KX_AXPY_THREADS) {
        if (threadIdx.x == 0) {
            s_n = 0;
        }
        __syncthreads();
        const int64_t q = q0 + threadIdx.x;
        if (q < nq) {
            const int32_t i = sel[1 + blockIdx.y + q*gridDim.y];
            const int32_t r = rowmap ? rowmap[i] : i;
            if (r >= 0) {
                float hv[NT];
                bool nz = false;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    hv[t] = t < nt ? h[i + t*sh] : 0.0f;
                    nz |= hv[t] != 0.0f;
                }
                if (nz) {
                    const int e = atomicAdd(&s_n, 1);
                    s_row[e] = r;
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        s_h[e][t] = hv[t];
                    }
                }
            }
        }
        __syncthreads();
        const int n = s_n;
        any |= n > 0;
        if (c < m) {
            int e = 0;
            for (; e + 4 <= n; e += 4) {
                float w[4][CPT];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    kx_load_cols<type, CPT>(wt + (int64_t) s_row[e + u]*wt_nb1, c, w[u]);
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        const float hv = s_h[e + u][t];
#pragma unroll
                        for (int k = 0; k < CPT; ++k) {
                            acc[k][t] += hv*w[u][k];
                        }
                    }
                }
            }
            for (; e < n; ++e) {
                float w[CPT];
                kx_load_cols<type, CPT>(wt + (int64_t) s_row[e]*wt_nb1, c, w);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const float hv = s_h[e][t];
#pragma unroll
                    for (int k = 0; k < CPT; ++k) {
                        acc[k][t] += hv*w[k];
                    }
                }
            }
        }
        __syncthreads(); // the next stage overwrites s_row / s_h
    }
    if (any && c < m) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < nt) {
#if __CUDA_ARCH__ >= 900
                if constexpr (CPT == 4) {
                    if (vec) { // one vector atomic for the thread's four columns
                        atomicAdd((float4 *) (y + c + t*sy), make_float4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
                        continue;
                    }
                }
#endif
#pragma unroll
                for (int k = 0; k < CPT; ++k) {
                    atomicAdd(y + c + k + t*sy, acc[k][t]);
                }
            }
        }
    }
}

// columns per thread: 4 where the rows allow 4-column loads (m % 4 == 0; F32 rows 16-byte,
// F16 8-byte, Q4_K 4-byte aligned; Q8_0 and Q6_K read 16-bit words), else 1
static int kx_axpy_cpt(const ggml_tensor * wt) {
    const uintptr_t a = wt->type == GGML_TYPE_F32 ? 16 : wt->type == GGML_TYPE_F16 ? 8 : wt->type == GGML_TYPE_Q4_K ? 4 : 2;
    return wt->ne[0] % 4 == 0 && (uintptr_t) wt->data % a == 0 && (uintptr_t) wt->nb[1] % a == 0 ? 4 : 1;
}

struct kx_axpy_args {
    const char * wt; int64_t wt_nb1;
    const float * h; int64_t sh;
    const int32_t * sel; const int32_t * rowmap;
    float * y; int64_t sy;
    int64_t m; int nt;
    int64_t n; // neurons (h's rows): the most list entries there can be
    int device; cudaStream_t stream;
};

// Grid: column tiles × row groups, as many groups as one wave of blocks holds (at most one
// per neuron), so the densest list keeps every SM busy while a short one still spreads over
// them; fixed from shapes and the device (graph capture)
template <ggml_type type, int CPT, int NT>
static void kx_axpy_launch(const kx_axpy_args & a) {
    const void * kernel = (const void *) kx_axpy_rows_kernel<type, CPT, NT>;
    const int64_t tiles  = (a.m + KX_AXPY_THREADS*CPT - 1)/(KX_AXPY_THREADS*CPT);
    const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(a.n, kx_resident_blocks(kernel, KX_AXPY_THREADS, a.device)/tiles));
    const dim3 grid((unsigned) tiles, (unsigned) std::min<int64_t>(groups, 65535));
    // a thread's four columns as one 16-byte vector atomic (compute capability 9.0 and up): y and
    // each token's column aligned
    const bool vec = CPT == 4 && (uintptr_t) a.y % 16 == 0 && a.sy % 4 == 0;
    kx_axpy_rows_kernel<type, CPT, NT><<<grid, KX_AXPY_THREADS, 0, a.stream>>>(
        a.wt, a.wt_nb1, a.h, a.sh, a.sel, a.rowmap, a.y, a.sy, a.m, a.nt, vec);
}

void ggml_cuda_kx_axpy_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * wt     = dst->src[0];
    const ggml_tensor * h      = dst->src[1];
    const ggml_tensor * sel    = dst->src[2];
    const ggml_tensor * rowmap = dst->src[3];
    cudaStream_t stream = ctx.stream();

    const int64_t m  = wt->ne[0];
    const int     nt = (int) h->ne[1];
    GGML_ASSERT(nt <= KX_CUDA_MAX_TOKENS);

    CUDA_CHECK(cudaMemsetAsync(dst->data, 0, ggml_nbytes(dst), stream));

    const int32_t * map = rowmap ? (const int32_t *) rowmap->data : nullptr;
    const kx_axpy_args a = { (const char *) wt->data, (int64_t) wt->nb[1], (const float *) h->data, (int64_t) (h->nb[1]/sizeof(float)),
                             (const int32_t *) sel->data, map, (float *) dst->data, (int64_t) (dst->nb[1]/sizeof(float)),
                             m, nt, h->ne[0], ctx.device, stream };
    const int cpt = kx_axpy_cpt(wt);
#define KX_AXPY_LAUNCH2(T, C) if (nt == 1) { kx_axpy_launch<T, C, 1>(a); } else { kx_axpy_launch<T, C, KX_CUDA_MAX_TOKENS>(a); }
#define KX_AXPY_LAUNCH(T) if (cpt == 4) { KX_AXPY_LAUNCH2(T, 4); } else { KX_AXPY_LAUNCH2(T, 1); }
    switch (wt->type) {
        case GGML_TYPE_F32:  KX_AXPY_LAUNCH(GGML_TYPE_F32);  break;
        case GGML_TYPE_F16:  KX_AXPY_LAUNCH(GGML_TYPE_F16);  break;
        case GGML_TYPE_Q8_0: KX_AXPY_LAUNCH(GGML_TYPE_Q8_0); break;
        case GGML_TYPE_Q4_K: KX_AXPY_LAUNCH(GGML_TYPE_Q4_K); break;
        case GGML_TYPE_Q6_K: KX_AXPY_LAUNCH(GGML_TYPE_Q6_K); break;
        default: GGML_ABORT("kx_axpy_rows: unsupported type %s", ggml_type_name(wt->type));
    }
#undef KX_AXPY_LAUNCH2
#undef KX_AXPY_LAUNCH
}
