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

// the reference path's dot of one weight row (dequantized into scratch, k floats) with x, in double
float  kx_row_dot_ref(const struct ggml_tensor * w, const char * row, const float * x, float * scratch);

// adds to the counters kx_cpu_axpy_stats reads (the fused FFN op counts as the axpy does)
void   kx_cpu_axpy_stats_add(int64_t nonzero, int64_t rows, int64_t elsewhere);

#ifdef __cplusplus
}
#endif
