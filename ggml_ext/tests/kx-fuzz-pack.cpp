// libFuzzer target over the sparse pack loader (kx_pack_load: what every tool runs on
// --sparse-pack), built with AddressSanitizer and UBSan by scripts/sanitize.sh.
//
// Each input is a pack file, loaded against one fixed model (-kx_model=PATH, loaded once). An input whose last byte is odd (a bit of the stored header
// checksum in a pack) is loaded as it is: the checksums must refuse any change. Otherwise its
// checksum tensor is first recomputed over the mutated bytes (when the file still parses), so
// the mutations also reach the structural and value checks behind the checksums. Either way the loader must return a pack or throw
// kx_pack_error; a crash, a sanitizer report or any other exception is a finding.
#include "kx-pack.h"

#include "gguf.h"
#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

llama_model * g_model = nullptr;
std::string   g_model_path;
std::string   g_pack_path;

void quiet_log(ggml_log_level, const char *, void *) {}

// the writer's rule (python/kairox/gguffile.py): XXH3-64 of every tensor's bytes, then of
// the bytes before the data section; false when the file does not parse that far
bool restamp(std::vector<uint8_t> & buf) {
    FILE * f = std::fopen(g_pack_path.c_str(), "wb");
    if (!f) {
        return false;
    }
    std::fwrite(buf.data(), 1, buf.size(), f);
    std::fclose(f);
    gguf_init_params ip = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(g_pack_path.c_str(), ip);
    if (!g) {
        return false;
    }
    const int64_t n    = gguf_get_n_tensors(g);
    const size_t  data = gguf_get_data_offset(g);
    bool ok = n > 0 && std::strcmp(gguf_get_tensor_name(g, n - 1), "kx_checksum") == 0 && data <= buf.size();
    std::vector<uint64_t> sums;
    for (int64_t i = 0; ok && i + 1 < n; ++i) {
        const size_t off = data + gguf_get_tensor_offset(g, i), size = gguf_get_tensor_size(g, i);
        ok = off <= buf.size() && size <= buf.size() - off;
        if (ok) {
            sums.push_back(kx_xxh3(buf.data() + off, size));
        }
    }
    const size_t at = ok ? data + gguf_get_tensor_offset(g, n - 1) : 0;
    ok = ok && gguf_get_tensor_size(g, n - 1) == 8 * (size_t) n && at <= buf.size() && 8 * (size_t) n <= buf.size() - at;
    if (ok) {
        sums.push_back(kx_xxh3(buf.data(), data));
        std::memcpy(buf.data() + at, sums.data(), 8 * sums.size());
    }
    gguf_free(g);
    return ok;
}

} // namespace

// its one parameter, -kx_model=PATH, rides on libFuzzer's command line (libFuzzer notes the
// flag as unknown to it and goes on)
extern "C" int LLVMFuzzerInitialize(int * argc, char *** argv) {
    const char * model = nullptr;
    for (int i = 1; i < *argc; ++i) {
        if (std::strncmp((*argv)[i], "-kx_model=", 10) == 0) {
            model = (*argv)[i] + 10;
        }
    }
    if (!model) {
        std::fprintf(stderr, "kx-fuzz-pack: give -kx_model=PATH, the model the corpus packs were made for\n");
        std::exit(2);
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    // a full load (the hyperparameters the loader checks come with it; a tiny model is quick)
    g_model = llama_model_load_from_file(model, llama_model_default_params());
    if (!g_model) {
        std::fprintf(stderr, "kx-fuzz-pack: cannot load %s\n", model);
        std::exit(2);
    }
    g_model_path = model;
    g_pack_path  = "/tmp/kx-fuzz-pack." + std::to_string(getpid()) + ".gguf";
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    std::vector<uint8_t> buf(data, data + size);
    if (size > 0 && (data[size - 1] & 1) == 0) {
        restamp(buf);
    }
    FILE * f = std::fopen(g_pack_path.c_str(), "wb");
    if (!f) {
        std::abort();
    }
    std::fwrite(buf.data(), 1, buf.size(), f);
    std::fclose(f);
    try {
        kx_pack_load(*g_model, g_model_path, g_pack_path); // the pack is freed at once
    } catch (const kx_pack_error &) {
        // a refusal: what damaged input must get
    }
    return 0;
}
