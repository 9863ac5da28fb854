// kairox extension library: version and build facts, for `kairox info`.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// "kairox <version> llama.cpp <commit> <backends>", static storage.
const char * kx_version(void);

#ifdef __cplusplus
}
#endif
