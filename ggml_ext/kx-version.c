// kx_version (include/kx-version.h): the version string `kairox info` prints, with the pinned
// llama.cpp commit and the backends compiled in.
#include "kx-version.h"

#ifndef KX_LLAMA_COMMIT
#define KX_LLAMA_COMMIT "unknown"
#endif

const char * kx_version(void) {
#ifdef KX_CUDA
    return "kairox 0.1.0 llama.cpp " KX_LLAMA_COMMIT " cpu+cuda";
#else
    return "kairox 0.1.0 llama.cpp " KX_LLAMA_COMMIT " cpu";
#endif
}
