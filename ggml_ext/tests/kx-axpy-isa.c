// The host kernels' rows-at-once down-row paths (kx_axpy_rows, ggml_ext/cpu/kx-axpy.h) against
// their row-by-row form (kx_axpy_row) at the vector width of the flags this file is built
// with: the library is built for the machine that builds it, so an AVX2-only machine's path
// is checked here by building this file with -march=haswell on any x86 machine.
//
//   cc -O2 -march=native|haswell kx-axpy-isa.c -I ggml/include -I ggml/src -I ggml/src/ggml-cpu
//      -I ggml_ext/cpu -L LIB -lggml-cpu -lggml-base -Wl,-rpath,LIB
//
// Prints "width W" (the lanes of the rows-at-once paths, 0 where there are none) and one line
// per type, "TYPE ok" or "TYPE differs ..."; exits 1 on any difference.
#include "kx-axpy.h"

#include "ggml.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x2545F4914F6CDD1Dull;

// uniform in [-1, 1)
static float next_f32(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float) ((rng >> 40) / (double) (1ull << 24)) * 2.0f - 1.0f;
}

// four rows of m columns of type t from random floats (a large-valued first row makes the
// K-quants' mins matter), checked with every row count 1-4 against row by row
static int check(enum ggml_type t, int64_t m) {
    float src[4 * 1024];
    for (int64_t i = 0; i < 4 * m; ++i) {
        src[i] = next_f32() + (i < m ? 3.0f : 0.0f);
    }
    const size_t row = ggml_row_size(t, m);
    char * q = malloc(4 * row);
    ggml_quantize_chunk(t, src, q, 0, 4, m, NULL);
    const void * rows[4] = { q, q + row, q + 2 * row, q + 3 * row };
    const float v[4] = { 0.75f, -1.5f, 0.3f, 2.25f };
    int bad = 0;
    for (int nr = 1; nr <= 4; ++nr) {
        float y0[1024], y1[1024];
        for (int64_t i = 0; i < m; ++i) {
            y0[i] = y1[i] = next_f32();
        }
        if (!kx_axpy_rows(t, m, nr, y0, rows, v)) {
            continue; // no rows-at-once path here: the op goes row by row anyway
        }
        for (int r = 0; r < nr; ++r) {
            kx_axpy_row(t, 0, m, y1, rows[r], v[r], false);
        }
        if (memcmp(y0, y1, sizeof(float) * (size_t) m) != 0) {
            int64_t i = 0;
            while (y0[i] == y1[i]) {
                ++i;
            }
            printf("%s differs with %d rows: column %lld %.9g against %.9g\n", ggml_type_name(t), nr, (long long) i,
                   y0[i], y1[i]);
            bad = 1;
        }
    }
    free(q);
    if (!bad) {
        printf("%s ok\n", ggml_type_name(t));
    }
    return bad;
}

int main(void) {
#if defined(KX_V)
    printf("width %d\n", KX_V);
#else
    printf("width 0\n");
#endif
    int bad = 0;
    bad |= check(GGML_TYPE_Q8_0, 96);
    bad |= check(GGML_TYPE_F16, 101);  // past the last whole vector
    bad |= check(GGML_TYPE_Q4_K, 512);
    bad |= check(GGML_TYPE_Q6_K, 512);
    return bad;
}
