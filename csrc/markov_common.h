// Per-element math of the Markov draft op, shared by the CPU twin
// (markov_draft_cpu.cpp) and the CUDA kernels (markov_draft_kernels.cu).
//
// No torch headers here: this file is compiled by nvcc in CI without a CUDA
// torch. Everything is plain C++ that is valid on host and device.
//
// The golden semantics live in vllm_dspark/ops/markov_reference.py; every
// function below names the line of that loop it reproduces.
#pragma once

#include <stdint.h>

#include <cmath>

#if defined(__CUDACC__)
#define DSPARK_HD __host__ __device__ __forceinline__
#else
#define DSPARK_HD inline
#endif

namespace dspark {

// Single correctly rounded fp32 operations. On the device they are written as
// PTX `add/sub/mul/div.rn.f32` without `.ftz`: an inline-asm instruction is
// never contracted into an FMA, never replaced by an approximate division and
// keeps subnormals, whatever -fmad / -prec-div / -ftz / --use_fast_math say
// (nvcc 13 defines no macro for --use_fast_math, so the score path has to be
// immune rather than only guarded). On the host the builds use -std=c++17
// (GCC: -ffp-contract=off), so the plain operators are single IEEE operations.
#if defined(__CUDA_ARCH__)
DSPARK_HD float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
DSPARK_HD float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
DSPARK_HD float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
DSPARK_HD float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#else
DSPARK_HD float add_rn(float a, float b) { return a + b; }
DSPARK_HD float sub_rn(float a, float b) { return a - b; }
DSPARK_HD float mul_rn(float a, float b) { return a * b; }
DSPARK_HD float div_rn(float a, float b) { return a / b; }
#endif

// ---------------------------------------------------------------------------
// Counter-based hash for seeded Gumbel noise (reference: gumbel_hash).
// ---------------------------------------------------------------------------
constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr uint32_t kMixC1 = 0x7FEB352Du;
constexpr uint32_t kMixC2 = 0x846CA68Bu;
constexpr uint32_t kJStep = 0x9E3779B1u;
constexpr double kTwoM32 = 2.3283064365386963e-10;  // 2^-32

DSPARK_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMixC1;
  x ^= x >> 15;
  x *= kMixC2;
  x ^= x >> 16;
  return x;
}

// key = mix32(mix32(mix32(lo32(seed) ^ golden) ^ hi32(seed)) ^ position)
DSPARK_HD uint32_t row_key(int64_t seed, int position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  uint32_t k = mix32(static_cast<uint32_t>(s) ^ kGolden);
  k = mix32(k ^ static_cast<uint32_t>(s >> 32));
  return mix32(k ^ static_cast<uint32_t>(position));
}

// h[j] = mix32(key ^ (j * 0x9e3779b1 mod 2^32))
DSPARK_HD uint32_t token_hash(uint32_t key, uint32_t j) {
  return mix32(key ^ (j * kJStep));
}

// Exact noise: fp32(-log(-log(u))) evaluated in fp64, u = (h + 0.5) * 2^-32.
DSPARK_HD float gumbel_exact(uint32_t h) {
  const double u = (static_cast<double>(h) + 0.5) * kTwoM32;
  return static_cast<float>(-::log(-::log(u)));
}

// Cheap fp32 evaluation of the same noise with a rigorous error margin:
// returns (lo, hi) with lo <= gumbel_exact(h) <= hi. For u >= 1/2 the inner
// log is taken as log1p of the exactly known (1 - u) so that the result does
// not lose precision near u = 1. logf/log1pf are within a few ulp; the margin
// 2e-5 * (1 + |g|) is about 100 times what the analysis needs.
DSPARK_HD void gumbel_bounds(uint32_t h, float* lo, float* hi) {
  float v;  // -log(u) > 0
  if (h >= 0x80000000u) {
    const uint32_t c = 0xFFFFFFFFu - h;  // 1 - u = (c + 0.5) * 2^-32, exact
    const float w = (static_cast<float>(c) + 0.5f) * 2.3283064365386963e-10f;
    v = -::log1pf(-w);
  } else {
    const float u = (static_cast<float>(h) + 0.5f) * 2.3283064365386963e-10f;
    v = -::logf(u);
  }
  const float g = -::logf(v);
  const float m = 2e-5f * (1.0f + ::fabsf(g));
  *lo = g - m;
  *hi = g + m;
}

// ---------------------------------------------------------------------------
// Scores (reference: `logits / T + g` in fp32, or `logits` when greedy).
// ---------------------------------------------------------------------------
// Two fp32 roundings, as the reference's `logits / T + g`.
DSPARK_HD float sampled_score(float logit, float temperature, float g) {
  return add_rn(div_rn(logit, temperature), g);
}

// Strictly better in the reference's argmax order (ties -> lowest index).
DSPARK_HD bool better(float s, int64_t j, float best_s, int64_t best_j) {
  return s > best_s || (s == best_s && j < best_j);
}

// Could a token whose score is at most `ub` still win against (best_s, best_j)?
DSPARK_HD bool may_win(float ub, int64_t j, float best_s, int64_t best_j) {
  return ub > best_s || (ub == best_s && j < best_j);
}

// ---------------------------------------------------------------------------
// Pruning bound. |fp32(w2_j . e)| <= ||w2_j|| * ||e||; the bound is inflated by
// a relative 1e-5 (covers fp32 rounding of the norms and of the bias, ~1e-7)
// plus an absolute 1e-30 (covers underflow), so it can never cut the winner.
// base + M and base - M are then upper and lower bounds of fp32(base + bias)
// because fp32 rounding is monotone.
// ---------------------------------------------------------------------------
constexpr double kBoundRel = 1e-5;
constexpr float kBoundAbs = 1e-30f;

DSPARK_HD float bound_scale(double e_norm) {
  return static_cast<float>(e_norm * (1.0 + kBoundRel));
}

DSPARK_HD float bias_bound(float w2_norm, float scale) {
  return add_rn(mul_rn(w2_norm, scale), kBoundAbs);
}

// ---------------------------------------------------------------------------
// Draft vocabulary (reference: markov_recurrence's `prev = tok + d2t[tok]`).
// The next position's markov_w1 row is the drafted token's TARGET id. The sum
// wraps modulo 2^64 like torch's int64 add instead of being undefined on a
// garbage offset; the caller's range check then gives such an id no embedding.
// ---------------------------------------------------------------------------
DSPARK_HD int64_t draft_to_target(int64_t draft_id, int64_t offset) {
  return static_cast<int64_t>(static_cast<uint64_t>(draft_id) + static_cast<uint64_t>(offset));
}

// ---------------------------------------------------------------------------
// Confidence (reference: sigmoid in fp64, returned as fp32).
// ---------------------------------------------------------------------------
DSPARK_HD double sigmoid64(double z) { return 1.0 / (1.0 + ::exp(-z)); }

DSPARK_HD float confidence(double z) { return static_cast<float>(sigmoid64(z)); }

// ---------------------------------------------------------------------------
// Head variants (reference: head_stepper). head_type 0 vanilla (v = e),
// 1 gated, 2 rnn. z is fp64(head_hidden) + the fp64 matvec of head_w with the
// token side (gated: e; rnn: [s ; e]); v is rounded once to fp32 and then
// takes e's place in the bias; the rnn state stays fp64.
// ---------------------------------------------------------------------------
constexpr int kHeadVanilla = 0;
constexpr int kHeadGated = 1;
constexpr int kHeadRnn = 2;

// Width of head_hidden's rows (m) and of head_w's rows (the token side).
DSPARK_HD int64_t head_hidden_width(int head_type, int64_t rank) {
  return head_type == kHeadRnn ? 3 * rank : rank;
}
DSPARK_HD int64_t head_in_width(int head_type, int64_t rank) {
  return head_type == kHeadRnn ? 2 * rank : rank;
}

// gated: v = fp32(sigmoid(z) * e)
DSPARK_HD float gated_value(double z, double e) { return static_cast<float>(sigmoid64(z) * e); }

// rnn: s' = sigmoid(a) * s + (1 - sigmoid(a)) * tanh(c), v = fp32(tanh(o))
DSPARK_HD double rnn_state(double a, double c, double s) {
  const double g = sigmoid64(a);
  return g * s + (1.0 - g) * ::tanh(c);
}
DSPARK_HD float rnn_value(double o) { return static_cast<float>(::tanh(o)); }

// A bound of ||v|| that does not depend on the previous token, for the CUDA
// candidate pass: gated |g| <= 1, so ||v|| <= ||e|| <= e_max (fp32 rounding of
// g * e is monotone and never exceeds |e|); rnn |tanh| <= 1, so ||v|| <=
// sqrt(rank), rounded up by 1e-6 relative like markov_max_norms.
DSPARK_HD float head_v_max(int head_type, int64_t rank, float e_max) {
  return head_type == kHeadRnn ? static_cast<float>(::sqrt(static_cast<double>(rank)) * (1.0 + 1e-6))
                               : e_max;
}

}  // namespace dspark
