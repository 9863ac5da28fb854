// CPU kernels of the kairox ops (compiled into ggml-cpu; dispatched from ggml-cpu.c by
// patches/0003). One op per file: kx-select.c, kx-mul-mat-rows.c, kx-axpy-rows.c, kx-ffn-rows.c.
#pragma once

#include "ggml-cpu-impl.h"

#ifdef __cplusplus
extern "C" {
#endif

void   ggml_compute_forward_kx_select      (const struct ggml_compute_params * params, struct ggml_tensor * dst);
void   ggml_compute_forward_kx_mul_mat_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void   ggml_compute_forward_kx_axpy_rows   (const struct ggml_compute_params * params, struct ggml_tensor * dst);
void   ggml_compute_forward_kx_ffn_rows    (const struct ggml_compute_params * params, struct ggml_tensor * dst);

// bytes of params->wdata that ggml_compute_forward_kx_mul_mat_rows needs with n_tasks threads
size_t kx_mul_mat_rows_work_size(const struct ggml_tensor * node, int n_tasks);
// the same for ggml_compute_forward_kx_ffn_rows
size_t kx_ffn_rows_work_size(const struct ggml_tensor * node, int n_tasks);

// x (F32, nt rows of k, row stride x_nb1) in the weight's vec_dot_type, row t at xq + t*xq_row:
// this thread's share of every row's blocks. Why split within a row: one token is one row,
// and converting it on one thread held the others at the next barrier (Q8_K, a Q4_K model's
// vector type, is ggml's scalar reference on x86: five times Q8_0's time). A block's bytes
// depend on its own values only, so the result is that of one call per row, as in ggml's
// mul_mat, which splits the same way.
void   kx_x_convert(enum ggml_type vdt, const char * x, size_t x_nb1, int64_t k, int64_t nt, char * xq, size_t xq_row,
                    int ith, int nth);

// the reference path's dot of one weight row (dequantized into scratch, k floats) with x, in double
float  kx_row_dot_ref(const struct ggml_tensor * w, const char * row, const float * x, float * scratch);

// adds to the counters kx_cpu_axpy_stats reads (the fused FFN op counts as the axpy does)
void   kx_cpu_axpy_stats_add(int64_t nonzero, int64_t rows, int64_t elsewhere);

#ifdef __cplusplus
}
#endif
