// kairox scheduler trace (include/kx-trace.h): a fixed record array, written at exit.
#include "kx-trace.h"

#include "ggml-impl.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct kx_trace_rec * kx_recs;
static int64_t               kx_cap;
static atomic_llong          kx_n;       // records handed out (may pass kx_cap: dropped)
static atomic_int            kx_graph = -1;
static char *                kx_path;
static atomic_int            kx_state;   // 0 off, 1 on
static void               (* _Atomic kx_flush)(void); // kx_trace_set_flush

static void kx_trace_atexit(void) {
    if (kx_trace_dump(kx_path) < 0) {
        fprintf(stderr, "kairox: cannot write the trace to %s\n", kx_path);
    }
}

int32_t kx_trace_start(const char * path, int64_t max_records) {
    // called while loading, before any graph runs (kx_model_params_apply)
    if (!path || !*path) {
        return 1;
    }
    if (atomic_load(&kx_state) == 1) {
        return strcmp(kx_path, path) == 0 ? 0 : 1;
    }
    kx_cap  = max_records > 0 ? max_records : 131072;
    kx_recs = (struct kx_trace_rec *) calloc((size_t) kx_cap, sizeof(*kx_recs));
    kx_path = strdup(path);
    if (!kx_recs || !kx_path) {
        free(kx_recs);
        free(kx_path);
        kx_recs = NULL;
        kx_path = NULL;
        return 1;
    }
    atexit(kx_trace_atexit);
    atomic_store(&kx_state, 1);
    return 0;
}

bool kx_trace_enabled(void) {
    return atomic_load_explicit(&kx_state, memory_order_relaxed) == 1;
}

void kx_trace_next_graph(void) {
    atomic_fetch_add(&kx_graph, 1);
}

// names go into JSON strings unescaped: quotes and backslashes become '?'
static void kx_copy_name(char * dst, size_t n, const char * src) {
    snprintf(dst, n, "%s", src ? src : "");
    for (char * c = dst; *c; c++) {
        if (*c == '"' || *c == '\\' || (unsigned char) *c < 0x20) {
            *c = '?';
        }
    }
}

struct kx_trace_rec * kx_trace_add(int32_t split, const char * backend, enum kx_trace_part part,
                                   const struct ggml_cgraph * g) {
    if (!kx_trace_enabled()) {
        return NULL;
    }
    const int64_t i = atomic_fetch_add(&kx_n, 1);
    if (i >= kx_cap) {
        return NULL;
    }
    struct kx_trace_rec * r = &kx_recs[i];
    r->graph   = atomic_load(&kx_graph);
    r->split   = split;
    r->part    = (char) part;
    r->n_nodes = g ? g->n_nodes : 0;
    kx_copy_name(r->backend, sizeof(r->backend), backend);
    kx_copy_name(r->first, sizeof(r->first), g && g->n_nodes > 0 ? g->nodes[0]->name : "");
    kx_copy_name(r->last,  sizeof(r->last),  g && g->n_nodes > 0 ? g->nodes[g->n_nodes - 1]->name : "");
    return r;
}

struct kx_trace_rec * kx_trace_add_reload(int32_t il, int64_t n_copies, int64_t bytes) {
    struct kx_trace_rec * r = kx_trace_add(-1, "reload", KX_TRACE_RELOAD, NULL);
    if (r) {
        r->n_nodes = (int32_t) n_copies;
        r->bytes   = bytes;
        if (il >= 0) {
            snprintf(r->first, sizeof(r->first), "reload-%d", (int) il);
        } else {
            snprintf(r->first, sizeof(r->first), "reload");
        }
        memcpy(r->last, r->first, sizeof(r->last));
    }
    return r;
}

void kx_trace_set_flush(void (*flush)(void)) {
    atomic_store(&kx_flush, flush);
}

int64_t kx_trace_dump(const char * path) {
    if (!path || !kx_recs) {
        return 0;
    }
    void (*flush)(void) = atomic_load(&kx_flush);
    if (flush) {
        flush();
    }
    FILE * f = fopen(path, "w");
    if (!f) {
        return -1;
    }
    const int64_t n_all = atomic_load(&kx_n);
    const int64_t n     = n_all < kx_cap ? n_all : kx_cap;
    for (int64_t i = 0; i < n; i++) {
        const struct kx_trace_rec * r = &kx_recs[i];
        fprintf(f, "{\"graph\":%d,\"split\":%d,\"part\":\"%c\",\"backend\":\"%s\",\"n_nodes\":%d,"
                   "\"first\":\"%s\",\"last\":\"%s\",\"t0\":%lld,\"t1\":%lld,\"bytes\":%lld}\n",
                r->graph, r->split, r->part, r->backend, r->n_nodes, r->first, r->last,
                (long long) r->t0, (long long) r->t1, (long long) r->bytes);
    }
    fprintf(f, "{\"dropped\":%lld}\n", (long long) (n_all - n));
    const int bad = ferror(f);
    return fclose(f) == 0 && !bad ? n : -1;
}
