// Which kairox ops (and shapes/types) the CUDA kernels handle; anything else stays on the
// CPU backend, where every case is implemented.
#include "kx-ops-cuda.cuh"
#include "kx-ops.h"

bool ggml_cuda_kx_supports_op(const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    switch (op->op) {
        case GGML_OP_KX_SELECT:
            return src0->type == GGML_TYPE_F32 && src0->nb[0] == sizeof(float);
        case GGML_OP_KX_MUL_MAT_ROWS:
            switch (src0->type) {
                case GGML_TYPE_F32:
                case GGML_TYPE_F16:
                    // rows in 16-byte loads: whole loads per row, 16-byte aligned rows
                    if (src0->ne[0] % 8 != 0) {
                        return false;
                    }
                    break;
                case GGML_TYPE_Q8_0:
                case GGML_TYPE_Q4_0:
                case GGML_TYPE_Q4_K: // rows of whole 256-weight super-blocks (ggml's own rule)
                case GGML_TYPE_Q5_K:
                case GGML_TYPE_Q6_K:
                    break;
                default:
                    return false;
            }
            // x is read as float4
            return src1->type == GGML_TYPE_F32 && src1->ne[1] <= KX_CUDA_MAX_TOKENS && src1->nb[1] % 16 == 0;
        case GGML_OP_KX_AXPY_ROWS:
            return kx_down_type_ok(src0->type, src0->ne[0]) && src1->type == GGML_TYPE_F32 &&
                   src1->ne[1] <= KX_CUDA_MAX_TOKENS;
        default:
            return false;
    }
}
