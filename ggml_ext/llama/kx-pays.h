// Whether a layer's sparse FFN beats llama.cpp's dense FFN on the CPU that runs it, measured
// as the model loads (kx-pays.cpp), not assumed from a fixed density.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

// Per layer, the sparse FFN's time over the dense FFN's at the share of neurons the layer's
// predicted lists held on calibration tokens (kx.listed_density): < 1 where sparsity gains.
// One layer of each weight layout (the FFN tensors' and the pack's down-row types) is timed on
// the CPU backend with n_threads: llama.cpp's three matvecs over its weights (repacked where the
// CPU backend repacks them), and mode's sparse FFN (KX_SPARSE_PREDICTED: the predictor, the
// select, the fused row op; KX_SPARSE_THRESHOLD: every gate, the select, the row op) over
// plain rows at two densities, linear between them. -1 for a layer without a listed density.
// Memoized per (model, pack, mode, threads): llama-bench loads one model for many rows.
// Throws kx_pack_error when a file cannot be read.
// A layer runs sparse when its sparse FFN times at most this share of the dense one: a gain
// under 5% is within one timing's spread (two layers of KB-350M Q4_K_M timed 0.98 on two
// cores), not worth trading llama.cpp's layout for (python/kairox/pack.py TIMED_GAINS_BELOW)
constexpr float kx_pays_max_ratio = 0.95f;

std::vector<float> kx_pays_measure(const std::string & model_path, const std::string & pack_path, int32_t mode,
                                   int32_t n_threads);

// Which layers the load chose to run sparse (their FFN weights loaded unrepacked), kept for
// the pack load of the same model and pack (kx_pack_load): the choice and the weights' layout
// must agree. recall returns an empty vector when none was kept.
void kx_pays_remember(const std::string & model_path, const std::string & pack_path, std::vector<bool> pays);
std::vector<bool> kx_pays_recall(const std::string & model_path, const std::string & pack_path);
