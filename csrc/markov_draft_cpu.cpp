// CPU twin of vllm_dspark::markov_draft: OpenMP over requests, exact candidate
// pruning per row. The per-element math comes from markov_common.h, the same
// header the CUDA kernels use.
//
// Per (request, position) row, instead of the V x rank Markov matvec:
//   1. one streaming pass over the vocabulary bounds every token's score by
//      base_j +- M (plus, when sampling, table bounds of its Gumbel noise),
//      keeps the running maximum lower bound and collects the tokens whose
//      upper bound reaches it. Tier 1 takes M from the largest row norm, so the
//      pass reads only the base logits; if its candidates overflow, tier 2
//      repeats the pass with each token's own norm;
//   2. exact scores (fp64 dot products, exact noise) are computed only for the
//      candidates whose own bound can still beat the best exact score so far.
// A row whose tier-2 candidates overflow kCandCap, and every row when
// out_logits is requested, is computed densely instead.
// Gated / rnn heads (head_type 1 / 2): head_step turns the previous token's
// embedding e into v (and advances the rnn state) before the row is solved;
// the bias and the bound then read v and ||v||, the confidence still reads e.
// The CUDA kernel (markov_draft_kernels.cu) has the same phases under device
// names: pass 1 is cand_kernel + Walker::merge, phase 2 is Walker::pruned
// (plus Walker::pair_tables for small sets), RowSolver::dense is
// Walker::dense, and draft_request's loop is Walker::walk.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "markov_common.h"
#include "markov_cpu_gumbel_table.h"
#include "markov_draft_args.h"

namespace dspark {
namespace {

constexpr int64_t kChunk = 256;     // tokens per vectorised step of pass 1
constexpr int64_t kCandCap = 4096;  // candidates kept before a row goes dense
constexpr float kInf = std::numeric_limits<float>::infinity();

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// fp32 copies of a chunk of 16-bit logits. bf16 is the top half of an fp32,
// so a shift widens it exactly (and vectorises); fp16 goes through c10.
inline void widen_chunk(const c10::BFloat16* __restrict in, float* __restrict out, int64_t n) {
  static_assert(sizeof(c10::BFloat16) == sizeof(uint16_t), "bf16 is 16 bits");
  alignas(64) uint16_t raw[kChunk];
  alignas(64) uint32_t bits[kChunk];
  std::memcpy(raw, in, static_cast<size_t>(n) * sizeof(uint16_t));  // n <= kChunk
  for (int64_t t = 0; t < n; ++t) bits[t] = static_cast<uint32_t>(raw[t]) << 16;
  std::memcpy(out, bits, static_cast<size_t>(n) * sizeof(float));
}
inline void widen_chunk(const c10::Half* __restrict in, float* __restrict out, int64_t n) {
  for (int64_t t = 0; t < n; ++t) out[t] = static_cast<float>(in[t]);
}

// Maximum of x[0..n) (NaN entries are ignored). Eight independent lanes so
// that the compiler vectorises it without reassociating a single chain.
inline float chunk_max(const float* __restrict x, int64_t n) {
  float acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = -kInf;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int u = 0; u < 8; ++u) acc[u] = x[t + u] > acc[u] ? x[t + u] : acc[u];
  }
  for (; t < n; ++t) acc[0] = x[t] > acc[0] ? x[t] : acc[0];
  float m = acc[0];
  for (int u = 1; u < 8; ++u) m = acc[u] > m ? acc[u] : m;
  return m;
}

template <typename TW>
inline double dot64(const TW* __restrict w, const double* __restrict e, int64_t n) {
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    a0 += static_cast<double>(to_f(w[k])) * e[k];
    a1 += static_cast<double>(to_f(w[k + 1])) * e[k + 1];
    a2 += static_cast<double>(to_f(w[k + 2])) * e[k + 2];
    a3 += static_cast<double>(to_f(w[k + 3])) * e[k + 3];
  }
  for (; k < n; ++k) a0 += static_cast<double>(to_f(w[k])) * e[k];
  return (a0 + a1) + (a2 + a3);
}

// out[j] = sum_k fp64(w[j, k]) * e[k] for nrows consecutive rows: the dense
// path's inner loop. Four rows at a time with eight lanes each, in a fixed
// order, so the compiler vectorises it (AVX-512 / AVX2 clones picked at run
// time, SSE2 otherwise) without reassociating anything itself.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DSPARK_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DSPARK_SIMD_CLONES
#endif

#define DSPARK_DOT_ROWS_BODY(LOAD)                                                  \
  int64_t j = 0;                                                                    \
  for (; j + 4 <= nrows; j += 4) {                                                  \
    double acc[4][8] = {};                                                          \
    int64_t k = 0;                                                                  \
    for (; k + 8 <= rank; k += 8) {                                                 \
      for (int q = 0; q < 4; ++q) {                                                 \
        for (int u = 0; u < 8; ++u) {                                               \
          acc[q][u] += static_cast<double>(LOAD((j + q) * rank + k + u)) * e[k + u]; \
        }                                                                           \
      }                                                                             \
    }                                                                               \
    for (; k < rank; ++k) {                                                         \
      for (int q = 0; q < 4; ++q) {                                                 \
        acc[q][k & 7] += static_cast<double>(LOAD((j + q) * rank + k)) * e[k];      \
      }                                                                             \
    }                                                                               \
    for (int q = 0; q < 4; ++q) {                                                   \
      const double* c = acc[q];                                                     \
      out[j + q] = ((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7])); \
    }                                                                               \
  }                                                                                 \
  for (; j < nrows; ++j) {                                                          \
    double c[8] = {};                                                               \
    for (int64_t k = 0; k < rank; ++k) {                                            \
      c[k & 7] += static_cast<double>(LOAD(j * rank + k)) * e[k];                   \
    }                                                                               \
    out[j] = ((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7]));     \
  }

DSPARK_SIMD_CLONES void dot_rows_f32(const float* __restrict w, int64_t nrows, int64_t rank,
                                     const double* __restrict e, double* __restrict out) {
#define DSPARK_LOAD_F32(i) w[i]
  DSPARK_DOT_ROWS_BODY(DSPARK_LOAD_F32)
#undef DSPARK_LOAD_F32
}

static inline float bf16_bits_to_f(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

DSPARK_SIMD_CLONES void dot_rows_bf16(const uint16_t* __restrict w, int64_t nrows, int64_t rank,
                                      const double* __restrict e, double* __restrict out) {
#define DSPARK_LOAD_BF16(i) bf16_bits_to_f(w[i])
  DSPARK_DOT_ROWS_BODY(DSPARK_LOAD_BF16)
#undef DSPARK_LOAD_BF16
}

void dot_rows_f16(const c10::Half* __restrict w, int64_t nrows, int64_t rank,
                  const double* __restrict e, double* __restrict out) {
#define DSPARK_LOAD_F16(i) static_cast<float>(w[i])
  DSPARK_DOT_ROWS_BODY(DSPARK_LOAD_F16)
#undef DSPARK_LOAD_F16
}

inline void dot_rows(const float* w, int64_t n, int64_t rank, const double* e, double* out) {
  dot_rows_f32(w, n, rank, e, out);
}
inline void dot_rows(const c10::BFloat16* w, int64_t n, int64_t rank, const double* e,
                     double* out) {
  dot_rows_bf16(reinterpret_cast<const uint16_t*>(w), n, rank, e, out);
}
inline void dot_rows(const c10::Half* w, int64_t n, int64_t rank, const double* e, double* out) {
  dot_rows_f16(w, n, rank, e, out);
}

constexpr int64_t kDenseRows = 256;  // tokens per dot_rows call of the dense path

struct Args {
  const void* base;
  const int64_t* anchor;
  const void* w1;
  const void* w2;
  const float* norms;
  const float* conf_base;  // nullable
  const float* conf_w;     // nullable
  const float* temperature;
  const int64_t* seeds;
  int64_t* out_tokens;
  float* out_conf;
  float* out_logits;  // nullable
  int32_t* out_stats;  // nullable
  const int64_t* d2t;  // nullable: [V] offsets, draft id -> target id (the row of w1)
  const float* head_hidden;  // nullable: [R, B, m] the head's hidden part (gated m = rank, rnn 3 rank)
  const float* head_w;       // nullable: [m, rank] gated, [3 rank, 2 rank] rnn
  int head_type;             // kHeadVanilla / kHeadGated / kHeadRnn (markov_common.h)
  float max_norm;      // max_j norms[j]
  int64_t R, B, V, rank;
  int64_t V1;          // rows of w1: the ids with a Markov embedding are [0, V1)
};

// The previous token as a row of markov_w1: drafted tokens are draft ids
// (the rows of w2 and of the base logits), w1 is indexed by target ids.
inline int64_t prev_of(const Args& a, int64_t tok) {
  return a.d2t != nullptr ? draft_to_target(tok, a.d2t[tok]) : tok;
}

struct Scratch {
  std::vector<int32_t> cand;
  std::vector<float> cand_ub;
  std::vector<double> e64;
  std::vector<float> row;  // [V] logits of a dense row (allocated on first use)
  // Head variants: the rnn state [rank] (fp64, zero at each block's start), the
  // pre-activations z [3 rank], the token side [s ; e] [2 rank] and v [rank].
  std::vector<double> state, z, x, v64;

  void init_head(const Args& a) {
    if (a.head_type == kHeadVanilla) return;
    state.assign(a.rank, 0.0);
    z.resize(3 * a.rank);
    x.resize(2 * a.rank);
    v64.resize(a.rank);
  }
};

// One position of a gated or rnn head (reference: head_stepper): v from the
// previous token's embedding e (and the rnn state, which it advances) into v,
// as fp32 values held in fp64. Returns ||v||^2 (fp64), the row's bias bound.
inline double head_step(const Args& a, int64_t row, const double* e, double* state, double* z,
                        double* x, double* v) {
  const int64_t rank = a.rank;
  const int64_t m = head_hidden_width(a.head_type, rank), in = head_in_width(a.head_type, rank);
  const float* hh = a.head_hidden + row * m;
  const double* xs = e;  // gated: the token side is e
  if (a.head_type == kHeadRnn) {
    std::memcpy(x, state, sizeof(double) * rank);
    std::memcpy(x + rank, e, sizeof(double) * rank);
    xs = x;
  }
  for (int64_t k = 0; k < m; ++k) {
    z[k] = static_cast<double>(hh[k]) + dot64(a.head_w + k * in, xs, in);
  }
  double n2 = 0.0;
  for (int64_t k = 0; k < rank; ++k) {
    float vk;
    if (a.head_type == kHeadGated) {
      vk = gated_value(z[k], e[k]);
    } else {
      state[k] = rnn_state(z[k], z[rank + k], state[k]);
      vk = rnn_value(z[2 * rank + k]);
    }
    v[k] = static_cast<double>(vk);
    n2 += v[k] * v[k];
  }
  return n2;
}

template <typename TB, typename TW>
struct RowSolver {
  const Args& a;
  Scratch& s;
  const TB* base;       // [V] of this row
  const TW* w2;         // [V, rank]
  const double* e64;    // [rank] the vector the bias is markov_w2 @ (v; e for the vanilla head)
  float T;              // > 0: sampled
  bool sampled;
  uint32_t key;
  int64_t n_exact = 0;

  // The reference's score of token j (exact).
  bool given = false;   // base already holds the corrected logits (no bias)

  inline float exact_score(int64_t j) {
    ++n_exact;
    const float logit = given
        ? to_f(base[j])
        : to_f(base[j]) + static_cast<float>(dot64(w2 + j * a.rank, e64, a.rank));
    if (!sampled) return logit;
    return sampled_score(logit, T, gumbel_exact(token_hash(key, static_cast<uint32_t>(j))));
  }

  // Every corrected logit of the row (into logits_out, or scratch), then the
  // pick over them.
  int64_t dense(float* logits_out) {
    if (logits_out == nullptr) {
      if (static_cast<int64_t>(s.row.size()) < a.V) s.row.resize(a.V);
      logits_out = s.row.data();
    }
    alignas(64) double tmp[kDenseRows];
    for (int64_t j0 = 0; j0 < a.V; j0 += kDenseRows) {
      const int64_t n = std::min(kDenseRows, a.V - j0);
      dot_rows(w2 + j0 * a.rank, n, a.rank, e64, tmp);
      for (int64_t t = 0; t < n; ++t) {
        logits_out[j0 + t] = to_f(base[j0 + t]) + static_cast<float>(tmp[t]);
      }
    }
    n_exact = a.V;
    return pick_from_logits(a, s, logits_out, w2, e64, T, sampled, key);
  }

  // The reference's argmax over a row of final logits. Greedy: one max pass.
  // Sampled: the same bound-and-verify pass as the pruned path with a zero bias
  // bound, so the exact fp64 noise is evaluated only for a few tokens.
  static int64_t pick_from_logits(const Args& a, Scratch& s, const float* logits, const TW* w2,
                                  const double* e64, float T, bool sampled, uint32_t key) {
    RowSolver<float, TW> g{a, s, logits, w2, e64, T, sampled, key};
    g.given = true;
    int64_t tok = g.pruned(0.f, bias_bound(0.f, 0.f));
    if (tok >= 0) return tok;
    float best_s = -kInf;  // thousands of (near-)ties: score every token
    int64_t best_j = std::numeric_limits<int64_t>::max();
    for (int64_t j = 0; j < a.V; ++j) {
      const float sc = sampled
          ? sampled_score(logits[j], T, gumbel_exact(token_hash(key, static_cast<uint32_t>(j))))
          : logits[j];
      if (better(sc, j, best_s, best_j)) {
        best_s = sc;
        best_j = j;
      }
    }
    return best_j;
  }

  // Upper bound of token j's score from its own row norm (phase 2 refinement).
  inline float refined_ub(int64_t j, float scale, const GumbelTables& tab) const {
    const float ub = to_f(base[j]) + bias_bound(a.norms[j], scale);
    if (!sampled) return ub;
    return sampled_score(ub, T, tab.hi[tab.bucket(token_hash(key, static_cast<uint32_t>(j)))]);
  }

  // Pruned pick. `uniform_m` >= 0: every token's bias bound is taken as this
  // one value (the largest row norm; pass 1 then reads only the base logits);
  // < 0: each token's own bound. Returns the token, or -1 when the candidates
  // overflow (the caller retries with per-token bounds, then goes dense).
  int64_t pruned(float scale, float uniform_m) {
    const GumbelTables& tab = gumbel_tables();
    const bool uniform = uniform_m >= 0.f;
    const float* norms = a.norms;
    int32_t* cand = s.cand.data();
    float* cand_ub = s.cand_ub.data();
    int64_t n = 0;
    float max_lb = -kInf;
    int64_t arg_lb = -1;
    alignas(64) float bf[kChunk];
    alignas(64) float ub[kChunk];
    alignas(64) float lb[kChunk];
    alignas(64) uint32_t hh[kChunk];
    alignas(64) float ghi[kChunk];
    alignas(64) float glo[kChunk];
    auto append = [&](int64_t j, float u) -> bool {
      if (n == kCandCap) {  // compact with the current (higher) lower bound
        int64_t w = 0;
        for (int64_t q = 0; q < n; ++q) {
          if (cand_ub[q] >= max_lb) {
            cand[w] = cand[q];
            cand_ub[w] = cand_ub[q];
            ++w;
          }
        }
        n = w;
        if (n > kCandCap / 2) return false;
      }
      cand[n] = static_cast<int32_t>(j);
      cand_ub[n] = u;
      ++n;
      return true;
    };
    for (int64_t c0 = 0; c0 < a.V; c0 += kChunk) {
      const int64_t len = std::min(kChunk, a.V - c0);
      const float* x;  // base logits of the chunk as fp32
      if constexpr (std::is_same_v<TB, float>) {
        x = base + c0;
      } else {
        widen_chunk(base + c0, bf, len);
        x = bf;
      }
      if (uniform && !sampled) {
        // Greedy with one bound M: lb = x - M and ub = x + M are monotone in x,
        // so the chunk's maximum decides both.
        const float cmax = chunk_max(x, len);
        const float clb = cmax - uniform_m;
        if (clb > max_lb) {
          max_lb = clb;
          for (int64_t t = 0; t < len; ++t) {
            if (x[t] == cmax) {
              arg_lb = c0 + t;
              break;
            }
          }
        }
        if (cmax + uniform_m >= max_lb) {
          for (int64_t t = 0; t < len; ++t) {
            const float u = x[t] + uniform_m;
            if (u >= max_lb && !append(c0 + t, u)) return -1;
          }
        }
        continue;
      }
      if (uniform) {
        for (int64_t t = 0; t < len; ++t) {
          ub[t] = x[t] + uniform_m;
          lb[t] = x[t] - uniform_m;
        }
      } else {
        const float* nr = norms + c0;
        for (int64_t t = 0; t < len; ++t) {
          const float m = bias_bound(nr[t], scale);
          ub[t] = x[t] + m;
          lb[t] = x[t] - m;
        }
      }
      if (sampled) {
        for (int64_t t = 0; t < len; ++t) {
          hh[t] = static_cast<uint32_t>(bucket_of(token_hash(key, static_cast<uint32_t>(c0 + t))));
        }
        for (int64_t t = 0; t < len; ++t) {  // gathers
          ghi[t] = tab.hi[hh[t]];
          glo[t] = tab.lo[hh[t]];
        }
        for (int64_t t = 0; t < len; ++t) {
          ub[t] = sampled_score(ub[t], T, ghi[t]);
          lb[t] = sampled_score(lb[t], T, glo[t]);
        }
      }
      const float cmax_lb = chunk_max(lb, len);
      const float cmax_ub = chunk_max(ub, len);
      if (cmax_lb > max_lb) {
        max_lb = cmax_lb;
        for (int64_t t = 0; t < len; ++t) {
          if (lb[t] == cmax_lb) {
            arg_lb = c0 + t;
            break;
          }
        }
      }
      if (cmax_ub >= max_lb) {
        for (int64_t t = 0; t < len; ++t) {
          if (ub[t] >= max_lb && !append(c0 + t, ub[t])) return -1;
        }
      }
    }
    // Phase 2: exact scores, best lower-bound token first; every other
    // candidate only if its own (per-token) bound can still beat the best.
    float best_s = -kInf;
    int64_t best_j = std::numeric_limits<int64_t>::max();
    if (arg_lb >= 0) {
      best_s = exact_score(arg_lb);
      best_j = arg_lb;
    }
    for (int64_t q = 0; q < n; ++q) {
      const int64_t j = cand[q];
      if (j == arg_lb || cand_ub[q] < max_lb) continue;
      if (!may_win(uniform ? refined_ub(j, scale, tab) : cand_ub[q], j, best_s, best_j)) continue;
      const float sc = exact_score(j);
      if (better(sc, j, best_s, best_j)) {
        best_s = sc;
        best_j = j;
      }
    }
    return best_j;
  }
};

// Confidence of one (request, position) row; e64 is the previous token's embedding.
inline float row_conf(const Args& a, int64_t row, const double* e64) {
  if (a.conf_base == nullptr) return 1.0f;
  double z = static_cast<double>(a.conf_base[row]);
  if (a.conf_w) {
    double d = 0.0;
    for (int64_t k = 0; k < a.rank; ++k) d += e64[k] * static_cast<double>(a.conf_w[k]);
    z += d;
  }
  return confidence(z);
}

template <typename TB, typename TW>
void draft_request(const Args& a, int64_t r, Scratch& s) {
  const TW* w1 = static_cast<const TW*>(a.w1);
  const TW* w2 = static_cast<const TW*>(a.w2);
  const float T = a.temperature[r];
  const bool sampled = T > 0.f;
  int64_t prev = a.anchor[r];
  double* e64 = s.e64.data();
  if (a.head_type != kHeadVanilla) std::fill(s.state.begin(), s.state.end(), 0.0);  // s_{-1} = 0
  for (int64_t i = 0; i < a.B; ++i) {
    const int64_t row = r * a.B + i;
    // Anchor policy: an id outside markov_w1 has no Markov embedding (e = 0).
    const bool valid = prev >= 0 && prev < a.V1;
    const TW* w1row = w1 + (valid ? prev : 0) * a.rank;
    double en2 = 0.0;
    for (int64_t k = 0; k < a.rank; ++k) {
      e64[k] = valid ? static_cast<double>(to_f(w1row[k])) : 0.0;
      en2 += e64[k] * e64[k];
    }
    // The bias reads v: e itself (vanilla), or the head's v with its own norm.
    const double* v64 = e64;
    if (a.head_type != kHeadVanilla) {
      en2 = head_step(a, row, e64, s.state.data(), s.z.data(), s.x.data(), s.v64.data());
      v64 = s.v64.data();
    }
    RowSolver<TB, TW> solver{a, s, static_cast<const TB*>(a.base) + row * a.V, w2, v64,
                             sampled ? T : 1.f, sampled,
                             sampled ? row_key(a.seeds[r], static_cast<int>(i)) : 0u};
    int64_t tok = -1;
    if (a.out_logits == nullptr) {
      const float scale = bound_scale(std::sqrt(en2));
      tok = solver.pruned(scale, bias_bound(a.max_norm, scale));  // base logits only
      if (tok < 0) tok = solver.pruned(scale, -1.f);               // per-token bounds
    }
    if (tok < 0) {
      solver.n_exact = 0;
      tok = solver.dense(a.out_logits ? a.out_logits + row * a.V : nullptr);
    }
    if (tok < 0 || tok >= a.V) tok = 0;  // only NaN logits leave no winner
    a.out_tokens[row] = tok;
    if (a.out_stats) a.out_stats[row] = static_cast<int32_t>(solver.n_exact);

    a.out_conf[row] = row_conf(a, row, e64);
    prev = prev_of(a, tok);
  }
}

template <typename TB, typename TW>
void run_dense_all(const Args& a);

template <typename TB, typename TW>
void run_all(const Args& a) {
  if (a.out_logits != nullptr) return run_dense_all<TB, TW>(a);
  (void)gumbel_tables();  // build once, outside the parallel region
  const int64_t R = a.R;
  // One thread per request at most: a batch-1 call stays on the calling thread.
  const int threads = static_cast<int>(std::min<int64_t>(R, omp_get_max_threads()));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch s;
    s.cand.resize(kCandCap);
    s.cand_ub.resize(kCandCap);
    s.e64.resize(a.rank);
    s.init_head(a);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r) draft_request<TB, TW>(a, r, s);
  }
}

// out_logits requested: every row is dense. Position by position, tiles of
// markov_w2 are shared by all requests (read once per position, not once per
// request), then each request picks its token.
template <typename TB, typename TW>
void run_dense_all(const Args& a) {
  const int64_t R = a.R, B = a.B, V = a.V, rank = a.rank;
  const TW* w1 = static_cast<const TW*>(a.w1);
  const TW* w2 = static_cast<const TW*>(a.w2);
  const TB* base = static_cast<const TB*>(a.base);
  (void)gumbel_tables();
  std::vector<int64_t> prev(a.anchor, a.anchor + R);
  std::vector<double> E(static_cast<size_t>(R * rank));  // [R, rank] embeddings
  // Head variants: v per request [R, rank] (the bias reads it), the rnn states
  // [R, rank] (zero at the block's start) and one request's head scratch.
  const bool head = a.head_type != kHeadVanilla;
  std::vector<double> Vh(head ? static_cast<size_t>(R * rank) : 0);
  std::vector<double> S(head ? static_cast<size_t>(R * rank) : 0, 0.0);
  std::vector<double> Z(head ? 3 * rank : 0), X(head ? 2 * rank : 0);
  const double* bias_vec = head ? Vh.data() : E.data();
  const int64_t ntiles = (V + kDenseRows - 1) / kDenseRows;
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      const bool valid = prev[r] >= 0 && prev[r] < a.V1;  // anchor policy: e = 0
      for (int64_t k = 0; k < rank; ++k) {
        E[r * rank + k] = valid ? static_cast<double>(to_f(w1[prev[r] * rank + k])) : 0.0;
      }
      if (head) {
        head_step(a, r * B + i, &E[r * rank], &S[r * rank], Z.data(), X.data(), &Vh[r * rank]);
      }
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; ++t) {
      alignas(64) double tmp[kDenseRows];
      const int64_t j0 = t * kDenseRows;
      const int64_t n = std::min(kDenseRows, V - j0);
      for (int64_t r = 0; r < R; ++r) {
        dot_rows(w2 + j0 * rank, n, rank, bias_vec + r * rank, tmp);
        const int64_t row = r * B + i;
        const TB* b = base + row * V + j0;
        float* out = a.out_logits + row * V + j0;
        for (int64_t u = 0; u < n; ++u) out[u] = to_f(b[u]) + static_cast<float>(tmp[u]);
      }
    }
    const int threads = static_cast<int>(std::min<int64_t>(R, omp_get_max_threads()));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      Scratch s;
      s.cand.resize(kCandCap);
      s.cand_ub.resize(kCandCap);
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = r * B + i;
        const float T = a.temperature[r];
        const bool sampled = T > 0.f;
        int64_t tok = RowSolver<TB, TW>::pick_from_logits(
            a, s, a.out_logits + row * V, w2, &E[r * rank], sampled ? T : 1.f, sampled,
            sampled ? row_key(a.seeds[r], static_cast<int>(i)) : 0u);
        if (tok < 0 || tok >= V) tok = 0;  // only NaN logits leave no winner
        a.out_tokens[row] = tok;
        if (a.out_stats) a.out_stats[row] = static_cast<int32_t>(V);
        a.out_conf[row] = row_conf(a, row, &E[r * rank]);
        prev[r] = prev_of(a, tok);
      }
    }
  }
}

template <typename TB>
void dispatch_w(const Args& a, at::ScalarType wt) {
  switch (wt) {
    case at::kFloat: return run_all<TB, float>(a);
    case at::kBFloat16: return run_all<TB, c10::BFloat16>(a);
    case at::kHalf: return run_all<TB, c10::Half>(a);
    default: TORCH_CHECK(false, "markov_draft: unsupported weight dtype ", wt);
  }
}

void markov_draft_cpu(const at::Tensor& base_logits, const at::Tensor& anchor_ids,
                      const at::Tensor& markov_w1, const at::Tensor& markov_w2,
                      const at::Tensor& w2_row_norms,
                      const std::optional<at::Tensor>& conf_base,
                      const std::optional<at::Tensor>& conf_w_markov,
                      const at::Tensor& temperature, const at::Tensor& seeds,
                      const at::Tensor& out_tokens, const at::Tensor& out_conf,
                      const std::optional<at::Tensor>& out_logits,
                      const std::optional<at::Tensor>& out_stats,
                      const std::optional<at::Tensor>& max_norms,
                      const std::optional<at::Tensor>& d2t,
                      const std::optional<at::Tensor>& head_hidden,
                      const std::optional<at::Tensor>& head_w, int64_t head_type) {
  // max_norms only feeds the CUDA kernel's prev-independent bound; the CPU twin
  // bounds each row with the exact embedding norm (checked for shape only).
  const MarkovShapes sh = check_markov_args(
      base_logits, anchor_ids, markov_w1, markov_w2, w2_row_norms, conf_base, conf_w_markov,
      temperature, seeds, out_tokens, out_conf, out_logits, out_stats, max_norms, d2t,
      head_hidden, head_w, head_type);
  if (sh.num_reqs == 0 || sh.block == 0) return;
  TORCH_CHECK(sh.vocab > 0, "markov_draft: vocab must be > 0");
  // Inputs are read in place when contiguous (the usual case).
  const at::Tensor base = base_logits.contiguous();
  const at::Tensor anchor = anchor_ids.contiguous();
  const at::Tensor w1 = markov_w1.contiguous();
  const at::Tensor w2 = markov_w2.contiguous();
  const at::Tensor norms = w2_row_norms.contiguous();
  const at::Tensor temp = temperature.contiguous();
  const at::Tensor sd = seeds.contiguous();
  at::Tensor cb, cw, dt, hh, hw;
  if (conf_base.has_value()) cb = conf_base->contiguous();
  if (head_hidden.has_value()) hh = head_hidden->contiguous();
  if (head_w.has_value()) hw = head_w->contiguous();
  if (conf_w_markov.has_value()) cw = conf_w_markov->contiguous();
  if (d2t.has_value()) dt = d2t->contiguous();

  // Anchors are not range-checked: an out-of-range anchor means "no Markov
  // embedding" (markov_reference.py), the same on both twins and sync-free.

  Args a{};
  a.base = base.data_ptr();
  a.anchor = anchor.data_ptr<int64_t>();
  a.w1 = w1.data_ptr();
  a.w2 = w2.data_ptr();
  a.norms = norms.data_ptr<float>();
  a.conf_base = cb.defined() ? cb.data_ptr<float>() : nullptr;
  a.conf_w = cw.defined() ? cw.data_ptr<float>() : nullptr;
  a.temperature = temp.data_ptr<float>();
  a.seeds = sd.data_ptr<int64_t>();
  a.out_tokens = out_tokens.data_ptr<int64_t>();
  a.out_conf = out_conf.data_ptr<float>();
  a.out_logits = out_logits.has_value() ? out_logits->data_ptr<float>() : nullptr;
  a.out_stats = out_stats.has_value() ? out_stats->data_ptr<int32_t>() : nullptr;
  a.d2t = dt.defined() ? dt.data_ptr<int64_t>() : nullptr;
  a.head_type = static_cast<int>(head_type);
  a.head_hidden = hh.defined() ? hh.data_ptr<float>() : nullptr;
  a.head_w = hw.defined() ? hw.data_ptr<float>() : nullptr;
  a.V1 = sh.w1_rows;
  float max_norm = 0.f;
  max_norm = std::max(max_norm, chunk_max(a.norms, sh.vocab));
  a.max_norm = max_norm;
  a.R = sh.num_reqs;
  a.B = sh.block;
  a.V = sh.vocab;
  a.rank = sh.rank;

  switch (base.scalar_type()) {
    case at::kFloat: return dispatch_w<float>(a, w2.scalar_type());
    case at::kBFloat16: return dispatch_w<c10::BFloat16>(a, w2.scalar_type());
    case at::kHalf: return dispatch_w<c10::Half>(a, w2.scalar_type());
    default: TORCH_CHECK(false, "markov_draft: unsupported base_logits dtype ", base.scalar_type());
  }
}

}  // namespace
}  // namespace dspark

TORCH_LIBRARY_IMPL(vllm_dspark, CPU, m) { m.impl("markov_draft", &dspark::markov_draft_cpu); }
