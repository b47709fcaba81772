// Raw-pointer entry point of the CUDA Markov draft kernels. No torch headers:
// markov_draft_kernels.cu compiles with plain nvcc (CI) and, as host C++, in
// the SIMT emulation harness (tests/ops/simt, DSPARK_SIMT defined); the torch
// glue (markov_draft_cuda.cpp, built only with a CUDA torch) fills these params.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(DSPARK_SIMT)
#include "simt_compat.h"
#else
#include <cuda_runtime.h>
#endif

namespace dspark {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct MarkovDraftParams {
  const void* base;          // [R, B, V] base_dtype
  DType base_dtype;
  const int64_t* anchor;     // [R] (out of [0, V1): no Markov embedding)
  const void* w1;            // [V1, rank] w_dtype, indexed by target ids
  const void* w2;            // [V, rank] w_dtype
  DType w_dtype;
  const float* norms;        // [V] ||w2_j||
  const float* max_norms;    // [2] (max ||w1_j|| rounded up, max norms[j]) or nullptr
  const float* conf_base;    // [R, B] or nullptr
  const float* conf_w;       // [rank] or nullptr
  const float* temperature;  // [R]
  const int64_t* seeds;      // [R]
  int64_t* out_tokens;       // [R, B]
  float* out_conf;           // [R, B]
  float* out_logits;         // [R, B, V] or nullptr (nullptr: pruned path)
  int32_t* out_stats;        // [R, B] or nullptr
  const int64_t* d2t;        // [V] draft id -> target id offsets, or nullptr (identity)
  const float* head_hidden;  // [R, B, m] the head's hidden part (gated m = rank, rnn 3 rank), or nullptr
  const float* head_w;       // gated [rank, rank], rnn [3 rank, 2 rank], or nullptr
  int head_type;             // kHeadVanilla (0), kHeadGated (1), kHeadRnn (2): markov_common.h
  int64_t R, B, V, rank;
  int64_t V1;                // rows of w1 (V without d2t): the ids with an embedding
};

// Bytes of global scratch launch_markov_draft needs for these sizes (a pure
// function of the sizes, of the head type and of whether out_logits /
// max_norms are given). The
// torch glue allocates it with the caching allocator before the launch; under
// CUDA-graph capture that allocation comes from the graph's private pool, so
// it is neither a host synchronisation nor a cudaMalloc inside the graph.
size_t markov_workspace_bytes(const MarkovDraftParams& p);

// Enqueues the whole draft on `stream`: fixed launch shapes for given sizes,
// no host synchronisation and no allocation, so it can be captured in a CUDA
// graph. `workspace` must hold markov_workspace_bytes(p) bytes (256-aligned);
// its contents on entry do not matter. Returns the launch error.
cudaError_t launch_markov_draft(const MarkovDraftParams& p, void* workspace,
                                cudaStream_t stream);

}  // namespace dspark
