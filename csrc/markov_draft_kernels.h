// Raw-pointer entry point of the CUDA Markov draft kernels. No torch headers:
// markov_draft_kernels.cu compiles with plain nvcc (CI), and the torch glue
// (markov_draft_cuda.cpp, built only with a CUDA torch) fills these params.
#pragma once

#include <stdint.h>

#include <cuda_runtime.h>

namespace dspark {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct MarkovDraftParams {
  const void* base;          // [R, B, V] base_dtype
  DType base_dtype;
  const int64_t* anchor;     // [R]
  const void* w1;            // [V, rank] w_dtype
  const void* w2;            // [V, rank] w_dtype
  DType w_dtype;
  const float* norms;        // [V]
  const float* conf_base;    // [R, B] or nullptr
  const float* conf_w;       // [rank] or nullptr
  const float* temperature;  // [R]
  const int64_t* seeds;      // [R]
  double threshold;
  int64_t* out_tokens;       // [R, B]
  float* out_conf;           // [R, B]
  int32_t* out_lengths;      // [R]
  float* out_logits;         // [R, B, V] or nullptr (nullptr: pruned path)
  int32_t* out_stats;        // [R, B] or nullptr
  int64_t R, B, V, rank;
};

// Enqueues the whole draft on `stream`: no host synchronisation and no
// allocation, so it can be captured in a CUDA graph. Returns the launch error.
cudaError_t launch_markov_draft(const MarkovDraftParams& p, cudaStream_t stream);

}  // namespace dspark
