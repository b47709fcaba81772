// CUDA kernels of vllm_dspark::markov_draft. Plain CUDA, no torch headers (CI
// compiles this file with `nvcc -c -arch=sm_90`, see scripts/compile_cuda.sh);
// the torch glue is markov_draft_cuda.cpp. The per-element math (hash, noise,
// bounds, scores, tie rule, confidence) is markov_common.h, shared with the CPU
// twin that CI runs against the PyTorch reference.
//
// Pruned path (no out_logits): one block per request walks the block's
// positions in order. Per position: pass 1 takes the maximum lower bound of all
// scores, pass 2 collects the tokens whose upper bound reaches it into shared
// memory, and warps compute the exact fp64 dot products of those candidates
// only. More than kCandCap candidates: the same block scores every token (dense
// fallback). Dense path (out_logits given): per position, a wide kernel writes
// every corrected logit and a per-request kernel picks the token.
//
// Both paths are graph-capturable: fixed launch shapes, no host
// synchronisation, no allocation, all scratch in shared memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>

#include "markov_common.h"
#include "markov_draft_kernels.h"

namespace dspark {
namespace {

constexpr int kThreads = 512;  // pruned kernel: one block per request
constexpr int kWarps = kThreads / 32;
constexpr int kCandCap = 2048;
constexpr int kPickThreads = 1024;
constexpr int kLogitThreads = 256;
constexpr int kLogitTokensPerBlock = 256;
constexpr size_t kMaxDynamicSmem = 32 * 1024;  // e (fp32 [rank]); + ~9 KB static < 48 KB

__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float ld(const __half* p, int64_t i) { return __half2float(p[i]); }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

struct Best {
  float s;
  long long j;
};

__device__ __forceinline__ Best best_of(Best a, Best b) {
  return better(b.s, b.j, a.s, a.j) ? b : a;
}

__device__ __forceinline__ Best warp_best(Best v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Best o;
    o.s = __shfl_xor_sync(0xffffffffu, v.s, off);
    o.j = __shfl_xor_sync(0xffffffffu, v.j, off);
    v = best_of(v, o);
  }
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

struct Reduce {  // shared scratch of the block reductions
  float s[33];
  long long j[33];
  double d[33];
};

template <int NT>
__device__ Best block_best(Best v, Reduce& red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_best(v);
  __syncthreads();  // the scratch may still be read by an earlier reduction
  if (lane == 0) {
    red.s[warp] = v.s;
    red.j[warp] = v.j;
  }
  __syncthreads();
  if (warp == 0) {
    Best w = lane < NT / 32 ? Best{red.s[lane], red.j[lane]} : Best{neg_inf(), LLONG_MAX};
    w = warp_best(w);
    if (lane == 0) {
      red.s[32] = w.s;
      red.j[32] = w.j;
    }
  }
  __syncthreads();
  return Best{red.s[32], red.j[32]};
}

template <int NT>
__device__ double block_sum(double v, Reduce& red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red.d[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double w = lane < NT / 32 ? red.d[lane] : 0.0;
    w = warp_sum(w);
    if (lane == 0) red.d[32] = w;
  }
  __syncthreads();
  return red.d[32];
}

template <int NT>
__device__ float block_max(float v, Reduce& red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red.s[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < NT / 32 ? red.s[lane] : neg_inf();
    w = warp_max(w);
    if (lane == 0) red.s[32] = w;
  }
  __syncthreads();
  return red.s[32];
}

// Exact fp64 dot of w2[j] with e (fp32 in shared memory) by one warp; every
// lane gets the sum.
template <typename TW>
__device__ __forceinline__ double warp_dot(const TW* w2, int64_t j, const float* e, int64_t rank) {
  const TW* w = w2 + j * rank;
  double acc = 0.0;
  for (int64_t k = threadIdx.x & 31; k < rank; k += 32) {
    acc += static_cast<double>(ld(w, k)) * static_cast<double>(e[k]);
  }
  return warp_sum(acc);
}

// Confidence of one position from the block-reduced Markov dot.
__device__ __forceinline__ float position_conf(const MarkovDraftParams& p, int64_t row,
                                               double markov_dot) {
  if (p.conf_base == nullptr) return 1.0f;
  return confidence(static_cast<double>(p.conf_base[row]) + markov_dot);
}

template <typename TB, typename TW>
__global__ void __launch_bounds__(kThreads) markov_pruned_kernel(MarkovDraftParams p) {
  extern __shared__ float s_e[];  // [rank]
  __shared__ int s_cand[kCandCap];
  __shared__ int s_count;
  __shared__ long long s_prev;
  __shared__ Reduce red;

  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const TW* w1 = static_cast<const TW*>(p.w1);
  const TW* w2 = static_cast<const TW*>(p.w2);
  const float T = p.temperature[r];
  const bool sampled = T > 0.f;
  const float Tn = sampled ? T : 1.f;
  double run = 1.0;  // early stop state, used by thread 0
  bool alive = true;
  int length = 0;
  if (tid == 0) s_prev = p.anchor[r];
  __syncthreads();

  for (int64_t i = 0; i < p.B; ++i) {
    const int64_t row = r * p.B + i;
    const int64_t prev = s_prev;
    for (int64_t k = tid; k < p.rank; k += kThreads) s_e[k] = ld(w1, prev * p.rank + k);
    __syncthreads();
    double en2 = 0.0, cd = 0.0;
    for (int64_t k = tid; k < p.rank; k += kThreads) {
      const double e = static_cast<double>(s_e[k]);
      en2 += e * e;
      if (p.conf_w != nullptr) cd += e * static_cast<double>(p.conf_w[k]);
    }
    en2 = block_sum<kThreads>(en2, red);
    cd = block_sum<kThreads>(cd, red);
    const float scale = bound_scale(sqrt(en2));
    const uint32_t key = sampled ? row_key(p.seeds[r], static_cast<int>(i)) : 0u;
    const TB* b = static_cast<const TB*>(p.base) + row * p.V;

    // Pass 1: the best lower bound of any score.
    float mlb = neg_inf();
    for (int64_t j = tid; j < p.V; j += kThreads) {
      float lb = ld(b, j) - bias_bound(p.norms[j], scale);
      if (sampled) {
        float glo, ghi;
        gumbel_bounds(token_hash(key, static_cast<uint32_t>(j)), &glo, &ghi);
        lb = sampled_score(lb, Tn, glo);
      }
      mlb = fmaxf(mlb, lb);
    }
    mlb = block_max<kThreads>(mlb, red);
    if (tid == 0) s_count = 0;
    __syncthreads();

    // Pass 2: tokens whose upper bound reaches it.
    for (int64_t j = tid; j < p.V; j += kThreads) {
      float ub = ld(b, j) + bias_bound(p.norms[j], scale);
      if (sampled) {
        float glo, ghi;
        gumbel_bounds(token_hash(key, static_cast<uint32_t>(j)), &glo, &ghi);
        ub = sampled_score(ub, Tn, ghi);
      }
      if (ub >= mlb) {
        const int pos = atomicAdd(&s_count, 1);
        if (pos < kCandCap) s_cand[pos] = static_cast<int>(j);
      }
    }
    __syncthreads();
    const int n = s_count;
    const bool dense = n > kCandCap;
    const int64_t count = dense ? p.V : n;

    // Exact scores of the candidates (or of every token).
    Best best{neg_inf(), LLONG_MAX};
    for (int64_t q = warp; q < count; q += kWarps) {
      const int64_t j = dense ? q : s_cand[q];
      const double dot = warp_dot(w2, j, s_e, p.rank);
      const float logit = ld(b, j) + static_cast<float>(dot);
      const float sc = sampled
          ? sampled_score(logit, Tn, gumbel_exact(token_hash(key, static_cast<uint32_t>(j))))
          : logit;
      if (better(sc, j, best.s, best.j)) best = Best{sc, j};
    }
    if (lane != 0) best = Best{neg_inf(), LLONG_MAX};
    best = block_best<kThreads>(best, red);

    if (tid == 0) {
      // Only NaN logits leave no candidate; keep the next row's read in bounds.
      if (best.j < 0 || best.j >= p.V) best.j = 0;
      p.out_tokens[row] = best.j;
      if (p.out_stats != nullptr) p.out_stats[row] = static_cast<int32_t>(count);
      const float c = position_conf(p, row, cd);
      p.out_conf[row] = c;
      alive = early_stop_step(&run, alive, c, p.threshold);
      length += alive ? 1 : 0;
      s_prev = best.j;
    }
    __syncthreads();
  }
  if (tid == 0) p.out_lengths[r] = length;
}

__device__ __forceinline__ int64_t prev_token(const MarkovDraftParams& p, int64_t r, int64_t i) {
  return i == 0 ? p.anchor[r] : p.out_tokens[r * p.B + i - 1];
}

// Dense path, step 1 of position i: every corrected logit of every request.
template <typename TB, typename TW>
__global__ void __launch_bounds__(kLogitThreads) markov_logits_kernel(MarkovDraftParams p,
                                                                      int64_t i) {
  extern __shared__ float s_e[];  // [rank]
  const int64_t r = blockIdx.y;
  const int64_t row = r * p.B + i;
  const int64_t prev = prev_token(p, r, i);
  const TW* w1 = static_cast<const TW*>(p.w1);
  for (int64_t k = threadIdx.x; k < p.rank; k += kLogitThreads) {
    s_e[k] = ld(w1, prev * p.rank + k);
  }
  __syncthreads();
  const TB* b = static_cast<const TB*>(p.base) + row * p.V;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kLogitTokensPerBlock;
  const int64_t j1 = j0 + kLogitTokensPerBlock < p.V ? j0 + kLogitTokensPerBlock : p.V;
  const int warp = threadIdx.x >> 5;
  for (int64_t j = j0 + warp; j < j1; j += kLogitThreads / 32) {
    const double dot = warp_dot(static_cast<const TW*>(p.w2), j, s_e, p.rank);
    if ((threadIdx.x & 31) == 0) p.out_logits[row * p.V + j] = ld(b, j) + static_cast<float>(dot);
  }
}

// Dense path, step 2 of position i: pick the token, confidence, length.
template <typename TW>
__global__ void __launch_bounds__(kPickThreads) markov_pick_kernel(MarkovDraftParams p,
                                                                   int64_t i) {
  __shared__ Reduce red;
  const int64_t r = blockIdx.x;
  const int64_t row = r * p.B + i;
  const float T = p.temperature[r];
  const bool sampled = T > 0.f;
  const float Tn = sampled ? T : 1.f;
  const uint32_t key = sampled ? row_key(p.seeds[r], static_cast<int>(i)) : 0u;
  const float* l = p.out_logits + row * p.V;
  Best best{neg_inf(), LLONG_MAX};
  for (int64_t j = threadIdx.x; j < p.V; j += kPickThreads) {
    const float sc = sampled
        ? sampled_score(l[j], Tn, gumbel_exact(token_hash(key, static_cast<uint32_t>(j))))
        : l[j];
    if (better(sc, j, best.s, best.j)) best = Best{sc, j};
  }
  best = block_best<kPickThreads>(best, red);

  const TW* w1 = static_cast<const TW*>(p.w1);
  const int64_t prev = prev_token(p, r, i);
  double cd = 0.0;
  if (p.conf_w != nullptr) {
    for (int64_t k = threadIdx.x; k < p.rank; k += kPickThreads) {
      cd += static_cast<double>(ld(w1, prev * p.rank + k)) * static_cast<double>(p.conf_w[k]);
    }
  }
  cd = block_sum<kPickThreads>(cd, red);
  if (threadIdx.x == 0) {
    if (best.j < 0 || best.j >= p.V) best.j = 0;  // NaN logits only
    p.out_tokens[row] = best.j;
    if (p.out_stats != nullptr) p.out_stats[row] = static_cast<int32_t>(p.V);
    p.out_conf[row] = position_conf(p, row, cd);
    if (i == p.B - 1) {  // every confidence of this request is written by now
      double run = 1.0;
      bool alive = true;
      int length = 0;
      for (int64_t k = 0; k < p.B; ++k) {
        alive = early_stop_step(&run, alive, p.out_conf[r * p.B + k], p.threshold);
        length += alive ? 1 : 0;
      }
      p.out_lengths[r] = length;
    }
  }
}

template <typename TB, typename TW>
cudaError_t launch_typed(const MarkovDraftParams& p, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(p.rank) * sizeof(float);
  if (smem > kMaxDynamicSmem) return cudaErrorInvalidValue;
  if (p.out_logits == nullptr) {
    markov_pruned_kernel<TB, TW><<<static_cast<unsigned>(p.R), kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((p.V + kLogitTokensPerBlock - 1) / kLogitTokensPerBlock),
                  static_cast<unsigned>(p.R));
  for (int64_t i = 0; i < p.B; ++i) {
    markov_logits_kernel<TB, TW><<<grid, kLogitThreads, smem, stream>>>(p, i);
    markov_pick_kernel<TW><<<static_cast<unsigned>(p.R), kPickThreads, 0, stream>>>(p, i);
  }
  return cudaGetLastError();
}

template <typename TB>
cudaError_t launch_w(const MarkovDraftParams& p, cudaStream_t stream) {
  switch (p.w_dtype) {
    case DType::kFloat32: return launch_typed<TB, float>(p, stream);
    case DType::kBFloat16: return launch_typed<TB, __nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<TB, __half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_markov_draft(const MarkovDraftParams& p, cudaStream_t stream) {
  if (p.R == 0 || p.B == 0) return cudaSuccess;
  if (p.R > 65535 || p.V <= 0 || p.V >= (int64_t(1) << 31) || p.rank <= 0) {
    return cudaErrorInvalidValue;
  }
  switch (p.base_dtype) {
    case DType::kFloat32: return launch_w<float>(p, stream);
    case DType::kBFloat16: return launch_w<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_w<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dspark
