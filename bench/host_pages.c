// Scattered row reads from host memory in 4 KiB pages against 2 MiB pages (transparent huge
// pages): the access pattern of the hybrid's host op, without the model. Each "layer" reads
// ROWS random rows of ROW_BYTES out of its own SPAN_MIB window of one large anonymous buffer
// (a layer's gate, up and down matrices), all threads sharing the rows as the op does;
// consecutive layers take consecutive windows, so every layer starts cold as in a decode.
//
//   cc -O2 -march=native -fopenmp bench/host_pages.c -o host_pages
//   ./host_pages GIB ROW_BYTES ROWS SPAN_MIB     # prints one JSON line per page size
//
// Why it exists: kx-host.cpp puts the host weights in huge pages; this measures what that
// is worth on a machine's own memory system, apart from everything else in a decode.
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// sum of 64-bit words of one row: a load per 8 bytes, vectorized by the compiler
static uint64_t row_sum(const uint64_t * p, size_t n) {
    uint64_t s = 0;
    for (size_t i = 0; i < n; ++i) {
        s += p[i];
    }
    return s;
}

static uint64_t anon_huge_kib(void) {
    FILE * f = fopen("/proc/meminfo", "r");
    char line[256];
    uint64_t kib = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (sscanf(line, "AnonHugePages: %lu kB", &kib) == 1) {
            break;
        }
    }
    if (f) {
        fclose(f);
    }
    return kib;
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s GIB ROW_BYTES ROWS SPAN_MIB\n", argv[0]);
        return 2;
    }
    const size_t size  = (size_t) atol(argv[1]) << 30;
    const size_t row   = (size_t) atol(argv[2]) / 64 * 64;
    const int    rows  = atoi(argv[3]);
    const size_t span  = (size_t) atol(argv[4]) << 20;
    const int    n_win = (int) (size / span);
    const int    reps  = 3;
    uint64_t sink = 0;
    for (int huge = 0; huge <= 1; ++huge) {
        char * p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        const int adv = madvise(p, size, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < size; i += 4096) {
            p[i] = (char) i;
        }
        const uint64_t huge_kib = anon_huge_kib();
        // the same random rows for both page sizes (a fixed seed), new rows every repetition
        // (no row is read twice from the caches)
        int64_t * off = malloc(sizeof(int64_t) * (size_t) rows * n_win * reps);
        uint64_t s = 88172645463325252ull;
        for (int w = 0; w < n_win * reps; ++w) {
            for (int r = 0; r < rows; ++r) {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                off[(size_t) w * rows + r] = (int64_t) ((w % n_win) * span + (s % ((span - row) / 64)) * 64);
            }
        }
        double best = 1e30;
        for (int rep = 0; rep < reps; ++rep) {
            const double t0 = now_s();
            for (int w = 0; w < n_win; ++w) {
                const int64_t * o = off + ((size_t) rep * n_win + w) * rows;
                #pragma omp parallel for schedule(static) reduction(+:sink)
                for (int r = 0; r < rows; ++r) {
                    sink += row_sum((const uint64_t *) (p + o[r]), row / 8);
                }
            }
            const double t = now_s() - t0;
            best = t < best ? t : best;
        }
        printf("{\"pages\": \"%s\", \"madvise\": %d, \"anon_huge_mib\": %.0f, \"threads\": %d, \"row_bytes\": %zu, "
               "\"rows_per_layer\": %d, \"span_mib\": %zu, \"layers\": %d, \"gbs\": %.2f, \"us_per_layer\": %.1f}\n",
               huge ? "2M" : "4k", adv, huge_kib / 1024.0, omp_get_max_threads(), row, rows, span >> 20, n_win,
               (double) row * rows * n_win / best / 1e9, best / n_win * 1e6);
        free(off);
        munmap(p, size);
    }
    return sink == 42 ? 3 : 0; // keeps the reads
}
