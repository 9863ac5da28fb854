// Constructors of the kairox ggml ops (compiled into ggml-base; see include/kx-ops.h).
#include "kx-ops.h"

#include "ggml-impl.h"

struct ggml_tensor * ggml_kx_select(
        struct ggml_context * ctx,
        struct ggml_tensor  * scores,
        float                 threshold,
        float                 max_density,
        enum kx_select_act    act) {
    GGML_ASSERT(scores->type == GGML_TYPE_F32);
    GGML_ASSERT(scores->nb[0] == sizeof(float));
    GGML_ASSERT(scores->ne[2] == 1 && scores->ne[3] == 1);
    GGML_ASSERT(act >= KX_SELECT_SCORE && act <= KX_SELECT_GELU);
    // ids are I32, and count = n must fit too
    GGML_ASSERT(scores->ne[0] < INT32_MAX);

    struct ggml_tensor * result = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, scores->ne[0] + 1);
    ggml_set_op_params_f32(result, 0, threshold);
    ggml_set_op_params_f32(result, 1, max_density);
    ggml_set_op_params_i32(result, 2, (int32_t) act);
    result->op     = GGML_OP_KX_SELECT;
    result->src[0] = scores;
    return result;
}

struct ggml_tensor * ggml_kx_select_to_host(
        struct ggml_context * ctx,
        struct ggml_tensor  * scores,
        float                 threshold,
        float                 max_density,
        enum kx_select_act    act,
        int32_t             * host) {
    return ggml_kx_select_set_host(ggml_kx_select(ctx, scores, threshold, max_density, act), host);
}

struct ggml_tensor * ggml_kx_select_set_host(struct ggml_tensor * sel, int32_t * host) {
    GGML_ASSERT(sel->op == GGML_OP_KX_SELECT);
    GGML_ASSERT(host != NULL && ((uintptr_t) host) % 16 == 0);
    memcpy((char *) sel->op_params + KX_SELECT_HOST_PARAM, &host, sizeof(host));
    return sel;
}

struct ggml_tensor * ggml_kx_select_split(
        struct ggml_context * ctx,
        struct ggml_tensor  * scores,
        float                 threshold,
        float                 max_density,
        struct ggml_tensor  * rowmap,
        struct ggml_tensor  * off) {
    GGML_ASSERT(rowmap->type == GGML_TYPE_I32 && ggml_is_contiguous(rowmap) && ggml_nelements(rowmap) == scores->ne[0]);
    GGML_ASSERT(off->type == GGML_TYPE_F32 && ggml_is_contiguous(off) && ggml_nelements(off) == 2);
    struct ggml_tensor * result = ggml_kx_select(ctx, scores, threshold, max_density, KX_SELECT_SCORE);
    result->src[1] = rowmap;
    result->src[2] = off;
    return result;
}

static void kx_check_sel(const struct ggml_tensor * sel, int64_t n) {
    GGML_ASSERT(sel->type == GGML_TYPE_I32);
    GGML_ASSERT(ggml_is_contiguous(sel));
    GGML_ASSERT(sel->ne[0] == n + 1 && ggml_nelements(sel) == n + 1);
}

// n neurons over a weight of n_rows rows: the map (when given) has one entry per neuron
static void kx_check_rowmap(const struct ggml_tensor * rowmap, int64_t n, int64_t n_rows) {
    if (rowmap) {
        GGML_ASSERT(rowmap->type == GGML_TYPE_I32 && ggml_is_contiguous(rowmap));
        GGML_ASSERT(ggml_nelements(rowmap) == n);
    } else {
        GGML_ASSERT(n_rows >= n);
    }
}

struct ggml_tensor * ggml_kx_mul_mat_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap) {
    GGML_ASSERT(w->ne[2] == 1 && w->ne[3] == 1);
    GGML_ASSERT(w->nb[0] == ggml_type_size(w->type));
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float));
    GGML_ASSERT(x->ne[2] == 1 && x->ne[3] == 1);
    GGML_ASSERT(w->ne[0] == x->ne[0]);
    const int64_t n = rowmap ? ggml_nelements(rowmap) : w->ne[1];
    if (sel) { // no list: every neuron
        kx_check_sel(sel, n);
    }
    kx_check_rowmap(rowmap, n, w->ne[1]);

    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, x->ne[1]);
    result->op     = GGML_OP_KX_MUL_MAT_ROWS;
    result->src[0] = w;
    result->src[1] = x;
    result->src[2] = sel;
    result->src[3] = rowmap;
    return result;
}

struct ggml_tensor * ggml_kx_mul_mat_rows_bias(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * b) {
    struct ggml_tensor * result = ggml_kx_mul_mat_rows(ctx, w, x, NULL, NULL);
    GGML_ASSERT(b->type == GGML_TYPE_F32 && ggml_is_contiguous(b) && ggml_nelements(b) == w->ne[1]);
    result->src[5] = b;
    return result;
}

struct ggml_tensor * ggml_kx_mul_mat_rows_gated(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap,
        struct ggml_tensor  * gate) {
    struct ggml_tensor * result = ggml_kx_mul_mat_rows(ctx, w, x, sel, rowmap);
    GGML_ASSERT(gate->type == GGML_TYPE_F32 && ggml_are_same_shape(gate, result) && ggml_is_contiguous(gate));
    result->src[4] = gate;
    return result;
}

// The transposed down rows' types the axpy kernels read (kx-axpy.h, kx-axpy-rows.cu), in whole
// blocks: a row of m columns is whole Q8_0 blocks or K-quant super-blocks
bool kx_down_type_ok(enum ggml_type type, int64_t m) {
    switch (type) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
            return true;
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q6_K:
            return m % ggml_blck_size(type) == 0;
        default:
            return false;
    }
}

struct ggml_tensor * ggml_kx_axpy_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * wt,
        struct ggml_tensor  * h,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap) {
    GGML_ASSERT(kx_down_type_ok(wt->type, wt->ne[0]));
    GGML_ASSERT(wt->ne[2] == 1 && wt->ne[3] == 1);
    GGML_ASSERT(wt->nb[0] == ggml_type_size(wt->type));
    GGML_ASSERT(h->type == GGML_TYPE_F32 && h->nb[0] == sizeof(float));
    GGML_ASSERT(h->ne[2] == 1 && h->ne[3] == 1);
    const int64_t n = h->ne[0];
    kx_check_sel(sel, n);
    kx_check_rowmap(rowmap, n, wt->ne[1]);

    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, wt->ne[0], h->ne[1]);
    result->op     = GGML_OP_KX_AXPY_ROWS;
    result->src[0] = wt;
    result->src[1] = h;
    result->src[2] = sel;
    result->src[3] = rowmap;
    return result;
}

struct ggml_tensor * ggml_kx_ffn_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * gate,
        struct ggml_tensor  * up,
        struct ggml_tensor  * down_t,
        struct ggml_tensor  * x,
        struct ggml_tensor  * sel,
        struct ggml_tensor  * rowmap,
        struct ggml_tensor  * downmap,
        struct ggml_tensor  * gate_pre,
        enum kx_select_act    act) {
    GGML_ASSERT(act == KX_SELECT_RELU || act == KX_SELECT_SILU || act == KX_SELECT_GELU);
    GGML_ASSERT(gate->type == up->type && ggml_are_same_shape(gate, up));
    GGML_ASSERT(gate->ne[2] == 1 && gate->ne[3] == 1 && gate->nb[0] == ggml_type_size(gate->type));
    GGML_ASSERT(up->nb[0] == ggml_type_size(up->type));
    GGML_ASSERT(kx_down_type_ok(down_t->type, down_t->ne[0]));
    GGML_ASSERT(down_t->ne[2] == 1 && down_t->ne[3] == 1 && down_t->nb[0] == ggml_type_size(down_t->type));
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1);
    GGML_ASSERT(gate->ne[0] == x->ne[0]);
    const int64_t n = rowmap ? ggml_nelements(rowmap) : gate->ne[1];
    kx_check_sel(sel, n);
    kx_check_rowmap(rowmap, n, gate->ne[1]);
    kx_check_rowmap(downmap, n, down_t->ne[1]);
    if (gate_pre) {
        GGML_ASSERT(gate_pre->type == GGML_TYPE_F32 && gate_pre->nb[0] == sizeof(float));
        GGML_ASSERT(gate_pre->ne[0] == n && gate_pre->ne[1] == x->ne[1]);
    }

    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, down_t->ne[0], x->ne[1]);
    ggml_set_op_params_i32(result, 0, (int32_t) act);
    result->op     = GGML_OP_KX_FFN_ROWS;
    result->src[0] = gate;
    result->src[1] = up;
    result->src[2] = down_t;
    result->src[3] = x;
    result->src[4] = sel;
    result->src[5] = rowmap;
    result->src[6] = downmap;
    result->src[7] = gate_pre;
    return result;
}

void ggml_kx_ffn_rows_own_shares(struct ggml_tensor * ffn_rows) {
    GGML_ASSERT(ffn_rows->op == GGML_OP_KX_FFN_ROWS);
    ggml_set_op_params_i32(ffn_rows, 1, 1);
}

void ggml_kx_ffn_rows_copy_list(struct ggml_tensor * ffn_rows, struct ggml_tensor * dst) {
    GGML_ASSERT(ffn_rows->op == GGML_OP_KX_FFN_ROWS);
    GGML_ASSERT(dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));
    GGML_ASSERT(ggml_nelements(dst) >= ggml_nelements(ffn_rows->src[4]));
    ffn_rows->src[8] = dst;
}
