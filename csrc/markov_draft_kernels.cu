// CUDA kernels of vllm_dspark::markov_draft. No torch headers: CI compiles
// this file with nvcc for sm_80/90/100/120 (scripts/compile_cuda.sh), and the
// SIMT harness (tests/ops/simt, scripts/emulate_cuda.py) compiles the very same
// source as host C++ and runs it against the PyTorch reference. Every global
// access goes through dev::gld/gst and every shared array through
// DSPARK_SMEM_ARRAY so that the harness can count bytes and check races; on
// the device they are plain loads, stores and __shared__ arrays.
//
// Pruned path (no out_logits), two launches (plus two when max_norms is not
// given):
//   1. cand_kernel, grid-wide over every (request, position) row and 4096-token
//      tile: reads the base logits once (16-byte loads) and bounds each token's
//      score by base_j +- M, M = max||w2|| * max||w1|| (inflated). M does not
//      depend on the previous token, so all positions are bounded at once. Each
//      tile keeps at most kKeep tokens whose upper bound reaches the tile's best
//      lower bound (top-kKeep by upper bound, radix select, when more do) and
//      records the largest upper bound it dropped.
//   2. walk_kernel, one block per request (plus helper blocks): merges its rows'
//      tiles into certified candidate sets (every token outside provably loses:
//      its upper bound is below the best lower bound inside), then walks the
//      positions in order with exact fp64 dots against the real embedding of
//      the real previous token. Small sets are scored for every possible
//      previous token up front (pair tables), so a walk through them needs no
//      memory round trip per position. A row whose set is not certified (tile
//      overflow, too many candidates, or ||e|| above the bound) is computed
//      densely and WIDE: the walker posts a job and every block of the grid
//      (helpers, and other walkers waiting for their own jobs) claims
//      256-token tiles of markov_w2; one tile read serves every job posted at
//      the time of the claim. A walker can always finish its own job alone, so
//      nothing waits on a block that might not be resident.
// Dense path (out_logits given; or shapes the pruned path does not take): per
// position, dense_kernel reads each markov_w2 tile once for all requests and
// writes the corrected logits and per-tile bests; pick_kernel picks the token.
//
// Draft vocabulary (p.d2t): everything above runs in draft ids [0, V); only
// the previous token's markov_w1 row is its target id (w1_row_of), and that
// row exists when it lies in [0, V1) (has_w1_row, the anchor policy).
//
// Head variants (p.head_type gated / rnn): the bias is markov_w2 @ v with v
// computed from the previous token's e by head_step (a block per request: the
// walker, or head_kernel on the dense path; the rnn state lives in the
// workspace, fp64). The candidate pass bounds ||v|| without the previous token
// (head_v_max: gated max||w1||, rnn sqrt(rank)); the walk uses each row's own
// ||v||. The pair tables (which precompute e-dots) are off for these heads.
//
// Graph-capturable: launch shapes depend only on the sizes, no host
// synchronisation, no allocation (scratch is the caller's workspace, see
// markov_workspace_bytes). Exactness: the same per-element math as the CPU twin
// (markov_common.h); scores use correctly rounded intrinsics (add_rn/div_rn),
// so neither contraction nor approximate division can move a score, and fast
// math is refused below.
// Fast math: refused where the toolkit says so (older nvcc define
// __USE_FAST_MATH__; nvcc 13 defines nothing, and scripts/compile_cuda.sh
// refuses the flags instead). Either way the score path is immune: add_rn /
// div_rn are PTX .rn operations without .ftz (markov_common.h).
#if defined(__USE_FAST_MATH__)
#error "markov_draft_kernels.cu must not be built with --use_fast_math: the op promises the reference's exact fp32 scores (IEEE division, no flush-to-zero, accurate logf)"
#endif

#include "markov_draft_kernels.h"

#if defined(DSPARK_SIMT)
#include "simt_compat.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace dspark {
namespace dev {
template <typename T>
using sptr = T*;
template <typename T>
__device__ __forceinline__ T gld(const T* p) { return *p; }
template <typename T>
__device__ __forceinline__ T gld_volatile(const T* p) { return *const_cast<const volatile T*>(p); }
template <typename T>
__device__ __forceinline__ void gst(T* p, T v) { *p = v; }
template <typename T>
__device__ __forceinline__ void gst_volatile(T* p, T v) { *const_cast<volatile T*>(p) = v; }
template <typename T, typename U>
__device__ __forceinline__ T* smem_cast(U* p) { return reinterpret_cast<T*>(p); }
// Fire-and-forget: pulls [p, p + bytes) into L2 without waiting for it.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
}
}  // namespace dev
}  // namespace dspark
#define DSPARK_SMEM_ARRAY(T, name, n) \
  __shared__ T name##_storage[n];     \
  T* name = name##_storage
#define DSPARK_DYN_SMEM(name)                                   \
  extern __shared__ __align__(16) unsigned char name##_raw[];   \
  unsigned char* name = name##_raw
#define DSPARK_LAUNCH(kfn, grid, block, smem, stream, ...) \
  kfn<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define DSPARK_GET_LAST_ERROR() cudaGetLastError()
#endif

#include <climits>

#include "markov_common.h"

namespace dspark {
namespace {

using dev::gld;
using dev::gld_volatile;
using dev::gst;
using dev::gst_volatile;
using dev::sptr;

constexpr int kCandThreads = 512;
constexpr int kTile1 = 8192;              // tokens per cand_kernel block
constexpr int kKeep = 256;                // tokens a tile may keep (1/32 of a tile)
constexpr int kWalkThreads = 512;
constexpr int kWalkWarps = kWalkThreads / 32;
constexpr int kHelpers = 96;              // helper blocks of the walk grid
constexpr int kTableCap = 16;             // pair tables for sets of at most this many
constexpr int kTablePos = 8;              // positions with pair tables
constexpr int kPrefetchCap = 256;         // sets whose rows the walk prefetches into L2
constexpr int kStage1 = 32;               // larger sets score their best-lower-bound token first
constexpr int kMaxRowTiles = 4096;        // B * ceil(V / kTile1) of the pruned path
constexpr int kMaxPrunedRank = 4096;      // e of the pruned path lives in shared memory
constexpr int kMaxPrunedBlock = 64;       // per-position state of the walk is shared memory
constexpr int kDenseTile = 256;           // tokens per dense tile
constexpr int kDenseThreads = 256;
constexpr int kDenseWarps = kDenseThreads / 32;
constexpr int kNormParts = 512;           // blocks of the max-norm prologue

// ------------------------------------------------------------------ elements
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Float <-> int keys with the same order (non-NaN), for atomicMax on shared ints.
__device__ __forceinline__ int order_key(float f) {
  const int k = __float_as_int(f);
  return k >= 0 ? k : k ^ 0x7fffffff;
}
__device__ __forceinline__ float key_float(int k) {
  return __int_as_float(k >= 0 ? k : k ^ 0x7fffffff);
}
__device__ __forceinline__ unsigned order_ukey(float f) {  // unsigned, for the radix select
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float ukey_float(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The fp32 values of one 16-byte vector of base logits.
template <typename TB>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void unpack(uint4 v, float* x) {
    x[0] = __uint_as_float(v.x);
    x[1] = __uint_as_float(v.y);
    x[2] = __uint_as_float(v.z);
    x[3] = __uint_as_float(v.w);
  }
};
template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void unpack(uint4 v, float* x) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    for (int q = 0; q < 4; ++q) {  // bf16 is the top half of an fp32: exact
      x[2 * q] = __uint_as_float(w[q] << 16);
      x[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
    }
  }
};
template <>
struct Vec<__half> {
  static constexpr int kN = 8;
  __device__ static void unpack(uint4 v, float* x) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    for (int q = 0; q < 4; ++q) {
      x[2 * q] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[q] & 0xffffu)));
      x[2 * q + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[q] >> 16)));
    }
  }
};

// ------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ int warp_sum_i(int v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

struct Best {
  float s;
  long long j;
};
__device__ __forceinline__ Best best_of(Best a, Best b) {
  return better(b.s, b.j, a.s, a.j) ? b : a;
}
__device__ __forceinline__ Best warp_best(Best v) {
  for (int off = 16; off > 0; off >>= 1) {
    Best o;
    o.s = __shfl_xor_sync(0xffffffffu, v.s, off);
    o.j = __shfl_xor_sync(0xffffffffu, v.j, off);
    v = best_of(v, o);
  }
  return v;
}

// Block reductions over NW warps. The leading barrier protects the scratch
// from the previous reduction's readers; every thread then reads all partials
// (no third barrier).
template <int NW>
__device__ __forceinline__ float block_max(float v, sptr<float> scr) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scr[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = scr[0];
  for (int w = 1; w < NW; ++w) r = fmaxf(r, scr[w]);
  return r;
}
template <int NW>
__device__ __forceinline__ int block_sum_i(int v, sptr<int> scr) {
  v = warp_sum_i(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scr[threadIdx.x >> 5] = v;
  __syncthreads();
  int r = 0;
  for (int w = 0; w < NW; ++w) r += scr[w];
  return r;
}
template <int NW>
__device__ __forceinline__ void block_sum2(double& a, double& b, sptr<double> scr) {
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    scr[threadIdx.x >> 5] = a;
    scr[NW + (threadIdx.x >> 5)] = b;
  }
  __syncthreads();
  a = 0.0;
  b = 0.0;
  for (int w = 0; w < NW; ++w) {  // fixed order: every thread gets the same sums
    a += scr[w];
    b += scr[NW + w];
  }
}
template <int NW>
__device__ __forceinline__ Best block_best(Best v, sptr<float> scr_s, sptr<long long> scr_j) {
  v = warp_best(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    scr_s[threadIdx.x >> 5] = v.s;
    scr_j[threadIdx.x >> 5] = v.j;
  }
  __syncthreads();
  Best r{scr_s[0], scr_j[0]};
  for (int w = 1; w < NW; ++w) r = best_of(r, Best{scr_s[w], scr_j[w]});
  return r;
}

// block_best and a block sum of `count` with the same two barriers.
template <int NW>
__device__ __forceinline__ Best block_best_count(Best v, int* count, sptr<float> scr_s,
                                                 sptr<long long> scr_j, sptr<int> scr_i) {
  v = warp_best(v);
  const int c = warp_sum_i(*count);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    scr_s[threadIdx.x >> 5] = v.s;
    scr_j[threadIdx.x >> 5] = v.j;
    scr_i[threadIdx.x >> 5] = c;
  }
  __syncthreads();
  Best r{scr_s[0], scr_j[0]};
  int total = scr_i[0];
  for (int w = 1; w < NW; ++w) {
    r = best_of(r, Best{scr_s[w], scr_j[w]});
    total += scr_i[w];
  }
  *count = total;
  return r;
}

// ------------------------------------------------------------- workspace
struct TileHead {
  float kept_mlb;  // best lower bound among the kept tokens (-inf: none kept)
  float drop_ub;   // largest upper bound among tokens dropped for capacity
  int count;       // kept tokens
  int pad;
};
struct Entry {
  int idx;
  float base;
};

struct Workspace {
  int64_t T1, Td;       // cand tiles per row, dense tiles
  float* norm_parts;    // [kNormParts * 2]
  float* max_norms;     // [2] when computed here
  TileHead* heads;      // [R * B * T1]
  Entry* kept;          // [R * B * T1 * kKeep]
  Entry* fsets;         // [R * B * T1 * kKeep] certified sets, compact per row
  int* zero_words;      // njobs, walkers_done, job_row[R*B], cov[Td], lock[Td]
  int64_t n_zero;
  float* je;            // [R * B * rank] embeddings of posted jobs
  float* jbest_s;       // [R * B * Td]
  long long* jbest_j;   // [R * B * Td]
  double* hz;           // [R * 3 * rank] head pre-activations (gated / rnn heads only)
  double* hstate;       // [R * rank] rnn state, fp64 (rnn head only)
};

inline size_t align256(size_t x) { return (x + 255) / 256 * 256; }

inline Workspace carve(const MarkovDraftParams& p, void* base, size_t* total) {
  Workspace w{};
  w.T1 = (p.V + kTile1 - 1) / kTile1;
  w.Td = (p.V + kDenseTile - 1) / kDenseTile;
  const int64_t rows = p.R * p.B;
  char* c = static_cast<char*>(base);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* q = c == nullptr ? nullptr : c + off;
    off += align256(bytes);
    return q;
  };
  w.norm_parts = reinterpret_cast<float*>(take(sizeof(float) * kNormParts * 2));
  w.max_norms = reinterpret_cast<float*>(take(sizeof(float) * 2));
  w.heads = reinterpret_cast<TileHead*>(take(sizeof(TileHead) * rows * w.T1));
  w.kept = reinterpret_cast<Entry*>(take(sizeof(Entry) * rows * w.T1 * kKeep));
  w.fsets = reinterpret_cast<Entry*>(take(sizeof(Entry) * rows * w.T1 * kKeep));
  w.n_zero = 2 + rows + 2 * w.Td;
  w.zero_words = reinterpret_cast<int*>(take(sizeof(int) * w.n_zero));
  w.je = reinterpret_cast<float*>(take(sizeof(float) * rows * p.rank));
  w.jbest_s = reinterpret_cast<float*>(take(sizeof(float) * rows * w.Td));
  w.jbest_j = reinterpret_cast<long long*>(take(sizeof(long long) * rows * w.Td));
  const bool head = p.head_type != kHeadVanilla;
  w.hz = reinterpret_cast<double*>(take(head ? sizeof(double) * p.R * 3 * p.rank : 0));
  w.hstate = reinterpret_cast<double*>(take(p.head_type == kHeadRnn ? sizeof(double) * p.R * p.rank : 0));
  if (total != nullptr) *total = off;
  return w;
}

__device__ __forceinline__ int* njobs_word(const Workspace& w) { return w.zero_words; }
__device__ __forceinline__ int* walkers_done_word(const Workspace& w) { return w.zero_words + 1; }
__device__ __forceinline__ int* job_rows(const Workspace& w) { return w.zero_words + 2; }
__device__ __forceinline__ int* tile_cov(const Workspace& w, int64_t rows) {
  return w.zero_words + 2 + rows;
}
__device__ __forceinline__ int* tile_lock(const Workspace& w, int64_t rows) {
  return w.zero_words + 2 + rows + w.Td;
}

__device__ __forceinline__ const float* norms_src(const MarkovDraftParams& p, const Workspace& w) {
  return p.max_norms != nullptr ? p.max_norms : w.max_norms;
}

// Lower / upper bound of a token's score from its base logit and a bias bound.
__device__ __forceinline__ void score_bounds(float x, float m, bool sampled, float T, uint32_t key,
                                             int64_t j, float* lb, float* ub) {
  const float l = sub_rn(x, m), u = add_rn(x, m);
  if (!sampled) {
    *lb = l;
    *ub = u;
    return;
  }
  float glo, ghi;
  gumbel_bounds(token_hash(key, static_cast<uint32_t>(j)), &glo, &ghi);
  *lb = sampled_score(l, T, glo);
  *ub = sampled_score(u, T, ghi);
}

__device__ __forceinline__ float exact_score(float logit, bool sampled, float T, uint32_t key,
                                             int64_t j) {
  if (!sampled) return logit;
  return sampled_score(logit, T, gumbel_exact(token_hash(key, static_cast<uint32_t>(j))));
}

// max ||v|| over every previous token: max||w1|| (vanilla, gated), sqrt(rank) (rnn).
__device__ __forceinline__ float v_max_of(const MarkovDraftParams& p, const float* mn) {
  return head_v_max(p.head_type, p.rank, gld(mn));
}

// M = max||w2|| * max||v||, inflated like every other bias bound.
__device__ __forceinline__ float uniform_bound(const MarkovDraftParams& p, const float* mn) {
  return bias_bound(gld(mn + 1), bound_scale(static_cast<double>(v_max_of(p, mn))));
}

template <typename T>
__device__ __forceinline__ float ldf(const T* p, int64_t i) { return to_f(gld(p + i)); }

// One base logit, dtype chosen at run time: the walk and the dense path read
// few of them, and one instantiation per weight dtype keeps the build small.
__device__ __forceinline__ float base_at(const MarkovDraftParams& p, int64_t i) {
  switch (p.base_dtype) {
    case DType::kBFloat16: return ldf(static_cast<const __nv_bfloat16*>(p.base), i);
    case DType::kFloat16: return ldf(static_cast<const __half*>(p.base), i);
    default: return ldf(static_cast<const float*>(p.base), i);
  }
}

// The previous token as a row of markov_w1. Drafted tokens are draft ids (rows
// of w2 and of the base logits); w1 is indexed by target ids, so with a draft
// vocabulary the drafted token goes through d2t (markov_common.h) first. A tok
// here is always a written token, in [0, V).
__device__ __forceinline__ int64_t w1_row_of(const MarkovDraftParams& p, int64_t tok) {
  return p.d2t != nullptr ? draft_to_target(tok, gld(p.d2t + tok)) : tok;
}
// Anchor policy: an id outside markov_w1 has no Markov embedding (e = 0).
__device__ __forceinline__ bool has_w1_row(const MarkovDraftParams& p, int64_t id) {
  return id >= 0 && id < p.V1;
}

// ------------------------------------------------ prologue: max_norms on device
// Only when the caller passes no max_norms: one pass over markov_w1.
template <typename TW>
__global__ void __launch_bounds__(256) norm_parts_kernel(MarkovDraftParams p, Workspace w) {
  DSPARK_SMEM_ARRAY(float, scr, 8);
  const TW* w1 = static_cast<const TW*>(p.w1);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float m1 = 0.f, m2 = 0.f;
  // w1 has V1 rows and w2 V (they differ with a draft vocabulary).
  const int64_t n = p.V1 > p.V ? p.V1 : p.V;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * 8 + warp; j < n;
       j += static_cast<int64_t>(gridDim.x) * 8) {
    if (j < p.V1) {  // warp-uniform
      double acc = 0.0;
      for (int64_t k = lane; k < p.rank; k += 32) {
        const double x = static_cast<double>(ldf(w1, j * p.rank + k));
        acc += x * x;
      }
      acc = warp_sum(acc);
      // Rounded up by 1e-6 relative (as markov_max_norms): no row's fp64 norm
      // can exceed the fp32 maximum.
      m1 = fmaxf(m1, static_cast<float>(sqrt(acc) * (1.0 + 1e-6)));
    }
    if (j < p.V) m2 = fmaxf(m2, gld(p.norms + j));
  }
  m1 = block_max<8>(m1, scr);
  m2 = block_max<8>(m2, scr);
  if (threadIdx.x == 0) {
    gst(w.norm_parts + 2 * blockIdx.x, m1);
    gst(w.norm_parts + 2 * blockIdx.x + 1, m2);
  }
}

__global__ void __launch_bounds__(256) norm_final_kernel(Workspace w, int parts) {
  DSPARK_SMEM_ARRAY(float, scr, 8);
  float m1 = 0.f, m2 = 0.f;
  for (int q = threadIdx.x; q < parts; q += 256) {
    m1 = fmaxf(m1, gld(w.norm_parts + 2 * q));
    m2 = fmaxf(m2, gld(w.norm_parts + 2 * q + 1));
  }
  m1 = block_max<8>(m1, scr);
  m2 = block_max<8>(m2, scr);
  if (threadIdx.x == 0) {
    gst(w.max_norms, m1);
    gst(w.max_norms + 1, m2);
  }
}

// ------------------------------------------------------- 1. candidate pass
template <typename TB>
__global__ void __launch_bounds__(kCandThreads) cand_kernel(MarkovDraftParams p, Workspace w) {
  constexpr int VN = Vec<TB>::kN;
  constexpr int NV = kTile1 / VN / kCandThreads;  // vectors per thread
  constexpr int NE = NV * VN + 1;                  // + one head/tail element
  constexpr int NW = kCandThreads / 32;
  DSPARK_SMEM_ARRAY(float, scr_f, NW);
  DSPARK_SMEM_ARRAY(int, scr_i, NW);
  DSPARK_SMEM_ARRAY(unsigned, hist, 256);
  static_assert(kCandThreads >= 256, "one thread per histogram bin");
  DSPARK_SMEM_ARRAY(unsigned, sel, 2);  // radix select: prefix, remaining rank
  DSPARK_SMEM_ARRAY(int, s_count, 1);

  const int tid = threadIdx.x;
  const int64_t nblk = static_cast<int64_t>(gridDim.x);
  const int64_t blk = blockIdx.x;
  // The walk's job words start at zero (the walk runs after this launch).
  for (int64_t q = blk * kCandThreads + tid; q < w.n_zero; q += nblk * kCandThreads) {
    gst(w.zero_words + q, 0);
  }

  const int64_t row = blk / w.T1, tile = blk % w.T1;
  const int64_t r = row / p.B, i = row % p.B;
  const float T = gld(p.temperature + r);
  const bool sampled = T > 0.f;
  const uint32_t key = sampled ? row_key(gld(p.seeds + r), static_cast<int>(i)) : 0u;
  const float M = uniform_bound(p, norms_src(p, w));

  const TB* b = static_cast<const TB*>(p.base) + row * p.V;
  const int64_t j0 = tile * kTile1;
  const int64_t j1 = j0 + kTile1 < p.V ? j0 + kTile1 : p.V;
  // 16-byte aligned body [a0, a1); the few elements before and after it are
  // loaded one by one.
  const uintptr_t addr0 = reinterpret_cast<uintptr_t>(b + j0);
  int64_t head = static_cast<int64_t>(((16 - (addr0 & 15)) & 15) / sizeof(TB));
  if (head > j1 - j0) head = j1 - j0;
  const int64_t a0 = j0 + head;
  const int64_t a1 = a0 + (j1 - a0) / VN * VN;

  float xs[NE], lb[NE], ub[NE];
  int jx[NE];  // token id, -1: no element
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int64_t jv = a0 + (static_cast<int64_t>(v) * kCandThreads + tid) * VN;
    float x[VN];
    if (jv < a1) {
      Vec<TB>::unpack(gld(reinterpret_cast<const uint4*>(b + jv)), x);
    }
#pragma unroll
    for (int u = 0; u < VN; ++u) {
      const int e = v * VN + u;
      if (jv < a1) {
        jx[e] = static_cast<int>(jv + u);
        xs[e] = x[u];
        score_bounds(x[u], M, sampled, T, key, jv + u, &lb[e], &ub[e]);
      } else {
        jx[e] = -1;
        xs[e] = lb[e] = ub[e] = neg_inf();
      }
    }
  }
  {  // head (tid < head) or tail element
    const int64_t tail = j1 - a1;
    int64_t j = -1;
    if (tid < head) j = j0 + tid;
    else if (tid >= VN && tid - VN < tail) j = a1 + (tid - VN);
    jx[NE - 1] = static_cast<int>(j);
    xs[NE - 1] = lb[NE - 1] = ub[NE - 1] = neg_inf();
    if (j >= 0) {
      xs[NE - 1] = ldf(b, j);
      score_bounds(xs[NE - 1], M, sampled, T, key, j, &lb[NE - 1], &ub[NE - 1]);
    }
  }

  // Phase 1: the tile's best lower bound (NaN bounds are ignored: NaN never wins).
  float m = neg_inf();
#pragma unroll
  for (int e = 0; e < NE; ++e) m = fmaxf(m, lb[e]);
  const float mlb = block_max<NW>(m, scr_f);

  // Phase 2: how many upper bounds reach it.
  int n = 0;
#pragma unroll
  for (int e = 0; e < NE; ++e) n += (jx[e] >= 0 && ub[e] >= mlb) ? 1 : 0;
  n = block_sum_i<NW>(n, scr_i);

  // Over capacity: keep only keys above the kKeep-th largest upper bound
  // (MSB-first radix select on order-preserving keys).
  unsigned cut = 0;  // keep ukey(ub) > cut  (0: keep all that reach mlb)
  bool use_cut = false;
  float drop_ub = neg_inf();
  if (n > kKeep) {
    use_cut = true;
    if (tid == 0) {
      sel[0] = 0u;
      sel[1] = static_cast<unsigned>(kKeep);
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
      if (tid < 256) hist[tid] = 0u;
      __syncthreads();
      const unsigned prefix = sel[0];
      const unsigned hmask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
#pragma unroll
      for (int e = 0; e < NE; ++e) {
        if (jx[e] >= 0 && ub[e] >= mlb) {
          const unsigned k = order_ukey(ub[e]);
          if ((k & hmask) == (prefix & hmask)) atomicAdd(hist + ((k >> shift) & 255u), 1u);
        }
      }
      __syncthreads();
      if (tid == 0) {
        unsigned want = sel[1], cum = 0;
        int bin = 255;
        for (; bin > 0; --bin) {
          const unsigned h = hist[bin];
          if (cum + h >= want) break;
          cum += h;
        }
        sel[0] = prefix | (static_cast<unsigned>(bin) << shift);
        sel[1] = want - cum;
      }
      __syncthreads();
    }
    cut = sel[0];
    drop_ub = ukey_float(cut);  // the kKeep-th largest: the largest dropped
  }

  // Phase 3: write the kept tokens and the tile's certificate.
  if (tid == 0) s_count[0] = 0;
  __syncthreads();
  float kept_m = neg_inf();
  Entry* out = w.kept + (row * w.T1 + tile) * kKeep;
#pragma unroll
  for (int e = 0; e < NE; ++e) {
    if (jx[e] < 0 || !(ub[e] >= mlb)) continue;
    if (use_cut && !(order_ukey(ub[e]) > cut)) continue;
    const int pos = atomicAdd(s_count + 0, 1);
    if (pos < kKeep) {  // always true: the cut leaves fewer than kKeep
      gst(out + pos, Entry{jx[e], xs[e]});
      kept_m = fmaxf(kept_m, lb[e]);
    }
  }
  kept_m = block_max<NW>(kept_m, scr_f);
  if (tid == 0) {
    const int cnt = s_count[0];
    gst(w.heads + row * w.T1 + tile,
        TileHead{kept_m, drop_ub, cnt < kKeep ? cnt : kKeep, 0});
  }
}


// ----------------------------------------------------- dense tile scoring
// Exact scores of tokens [t * kDenseTile, ...) of one row against embedding
// `e` (e_valid false: e = 0, the anchor policy); a warp per token, the best
// (score, id) of the tile goes to jbest. Also writes out_logits when given.
template <typename TW, typename TE, int NT>
__device__ __forceinline__ void score_tile(const MarkovDraftParams& p, const Workspace& w, int64_t t,
                           int64_t row, const TE* e, bool e_valid, sptr<float> scr_s,
                           sptr<long long> scr_j) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = row / p.B, i = row % p.B;
  const float T = gld(p.temperature + r);
  const bool sampled = T > 0.f;
  const uint32_t key = sampled ? row_key(gld(p.seeds + r), static_cast<int>(i)) : 0u;
  const TW* w2 = static_cast<const TW*>(p.w2);
  const int64_t j0 = t * kDenseTile;
  const int64_t j1 = j0 + kDenseTile < p.V ? j0 + kDenseTile : p.V;
  Best best{neg_inf(), LLONG_MAX};
  for (int64_t j = j0 + warp; j < j1; j += NW) {
    double acc = 0.0;
    if (e_valid) {
      for (int64_t k = lane; k < p.rank; k += 32) {
        acc += static_cast<double>(ldf(w2, j * p.rank + k)) * static_cast<double>(ldf(e, k));
      }
    }
    acc = warp_sum(acc);
    const float logit = add_rn(base_at(p, row * p.V + j), static_cast<float>(acc));
    if (p.out_logits != nullptr && lane == 0) gst(p.out_logits + row * p.V + j, logit);
    const float sc = exact_score(logit, sampled, T, key, j);
    if (better(sc, j, best.s, best.j)) best = Best{sc, j};
  }
  best = block_best<NW>(best, scr_s, scr_j);
  if (threadIdx.x == 0) {
    gst(w.jbest_s + row * w.Td + t, best.s);
    gst(w.jbest_j + row * w.Td + t, best.j);
  }
}

// One claimed tile of the walk's dense jobs: every job posted (and published)
// so far that this tile has not served yet, in slot order.
template <typename TW>
__device__ __forceinline__ void serve_tile(const MarkovDraftParams& p, const Workspace& w, int64_t t,
                           sptr<int> s_range, sptr<float> scr_s, sptr<long long> scr_j) {
  const int64_t rows = p.R * p.B;
  int* cov = tile_cov(w, rows);
  if (threadIdx.x == 0) {
    const int c = gld_volatile(cov + t);
    int n = c;
    const int posted = gld_volatile(njobs_word(w));
    while (n < posted && gld_volatile(job_rows(w) + n) != 0) ++n;
    s_range[0] = c;
    s_range[1] = n;
  }
  __syncthreads();
  const int c = s_range[0], n = s_range[1];
  __threadfence();  // acquire: the jobs' embeddings were published before their slots
  for (int q = c; q < n; ++q) {
    const int64_t row = gld_volatile(job_rows(w) + q) - 1;
    score_tile<TW, float, kWalkThreads>(p, w, t, row, w.je + row * p.rank, true, scr_s, scr_j);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // release: the tile bests before the coverage count
    gst_volatile(cov + t, n);
    __threadfence();
    atomicExch(tile_lock(w, rows) + t, 0);
  }
}

// ------------------------------------------------------------- head step
// One position of a gated or rnn head (reference: head_stepper), by a whole
// block for request r, row `row`: z = head_hidden[row] + head_w @ x with x = e
// (gated) or [s ; e] (rnn, the request's fp64 state in the workspace), a warp
// per output; then, a thread per k, v_k (and the new state). e_at(k) reads e,
// v_put(k, v) writes v (it may overwrite e: thread k reads e_k, then writes
// v_k). Returns ||v|| (fp64) to every thread; v is published on return.
template <int NT, typename EAt, typename VPut>
__device__ __forceinline__ double head_step(const MarkovDraftParams& p, const Workspace& w, int64_t r,
                                            int64_t row, EAt e_at, VPut v_put, sptr<double> scr_d) {
  constexpr int NW = NT / 32;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int64_t rank = p.rank;
  const bool rnn = p.head_type == kHeadRnn;
  const int64_t m = head_hidden_width(p.head_type, rank), in = head_in_width(p.head_type, rank);
  double* z = w.hz + r * 3 * rank;
  double* s = w.hstate + r * rank;  // rnn only
  const float* hh = p.head_hidden + row * m;
  for (int64_t k = warp; k < m; k += NW) {
    double acc = 0.0;
    for (int64_t c = lane; c < in; c += 32) {
      const double x = !rnn ? static_cast<double>(e_at(c))
                            : c < rank ? gld(s + c) : static_cast<double>(e_at(c - rank));
      acc += static_cast<double>(gld(p.head_w + k * in + c)) * x;
    }
    acc = warp_sum(acc);
    if (lane == 0) gst(z + k, static_cast<double>(gld(hh + k)) + acc);
  }
  __syncthreads();  // z complete; every read of e and of the old state done
  double n2 = 0.0, unused = 0.0;
  for (int64_t k = tid; k < rank; k += NT) {
    float v;
    if (rnn) {
      gst(s + k, rnn_state(gld(z + k), gld(z + rank + k), gld(s + k)));
      v = rnn_value(gld(z + 2 * rank + k));
    } else {
      v = gated_value(gld(z + k), static_cast<double>(e_at(k)));
    }
    v_put(k, v);
    n2 += static_cast<double>(v) * static_cast<double>(v);
  }
  block_sum2<NW>(n2, unused, scr_d);  // its barriers also publish v and the state
  return sqrt(n2);
}

// --------------------------------------------------------- 2. the walk
// walk_kernel: one block per request (its walker) plus kHelpers helper blocks.
// A walker runs the CPU twin's phases (markov_draft_cpu.cpp) as named device
// functions:
//   1. Walker::merge        cand_kernel's tiles -> one certified candidate set
//                           per row (the twin's pass 1 of RowSolver::pruned);
//   2. Walker::pair_tables  small sets only: every (previous candidate,
//                           candidate) dot, confidence and norm check;
//   3. Walker::walk         the positions in order (the twin's draft_request):
//                           walk_tables while the pair tables decide, else
//                           prev_embedding, then Walker::pruned: the exact
//                           scores of the certified set (RowSolver::pruned's
//                           phase 2);
//   4. Walker::dense        an uncertified row (RowSolver::dense), computed
//                           wide: the walker posts a job whose markov_w2 tiles
//                           every block serves (WalkBlock::help: the helpers).
// The phases are __forceinline__: the kernel is still one function, with the
// registers it had as one body (scripts/compile_cuda.sh prints them).

// What every block of the walk grid has: its shared memory and the dense job
// protocol's words. Walkers and helpers both serve dense tiles.
struct WalkBlock {
  static constexpr int NT = kWalkThreads, NW = kWalkWarps;
  const MarkovDraftParams& p;
  const Workspace& w;
  sptr<float> scr_f;        // [NW] reduction scratch
  sptr<int> scr_i;          // [NW]
  sptr<double> scr_d;       // [2 * NW]
  sptr<float> scr_bs;       // [NW]
  sptr<long long> scr_bj;   // [NW]
  sptr<int> s_range;        // [2] serve_tile's job range
  sptr<int> s_ctl;          // [4] claim, pending, slot, pos
  sptr<long long> s_prev;   // [1] previous token as a row of w1 (its target id)
  sptr<int> s_prev_a;       // [1] its index in the previous pair table, -1: none
  sptr<int> s_Lkey;         // [B] best kept lower bound (order key)
  sptr<int> s_Dkey;         // [B] largest dropped upper bound (order key)
  sptr<int> s_nF;           // [B] certified set sizes
  sptr<int> s_tidx;         // [kTablePos * kTableCap] table candidates: token id,
  sptr<float> s_tbase;      //   base logit,
  sptr<float> s_tg;         //   exact Gumbel noise (sampled)
  sptr<float> s_pd;         // [kTablePos * kTableCap * kTableCap] pair dots
  sptr<float> s_pconf;      // [kTablePos * kTableCap] confidence per previous candidate
  sptr<int> s_pok;          // [kTablePos * kTableCap] its ||e|| within the bound
  sptr<float> s_e;          // [rank] the previous token's embedding (dynamic)
  sptr<int> s_cnt;          // [B * T1] kept tokens per tile (dynamic)
  int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  int64_t rows = p.R * p.B;
  int64_t Td = w.Td;
  int* cov = tile_cov(w, rows);
  int* lock = tile_lock(w, rows);

  // Helper block: serve dense tiles of posted jobs until every walker is done.
  template <typename TW>
  __device__ __forceinline__ void help() const {
    int64_t cursor = (static_cast<int64_t>(blockIdx.x) * 131) % Td;
    while (true) {
      if (tid == 0) {
        const bool done = gld_volatile(walkers_done_word(w)) >= p.R;
        const int posted = gld_volatile(njobs_word(w));
        int found = -1;
        if (!done && posted > 0) {
          for (int64_t u = cursor; u < cursor + Td; ++u) {
            const int64_t t = u % Td;
            if (gld_volatile(cov + t) >= posted) continue;
            if (atomicCAS(lock + t, 0, 1) == 0) {
              found = static_cast<int>(t);
              cursor = u + 1;
              break;
            }
          }
        }
        s_ctl[0] = found;
        s_ctl[1] = done ? 1 : 0;
      }
      __syncthreads();
      const int claim = s_ctl[0], done = s_ctl[1];
      __syncthreads();
      if (claim >= 0) {
        serve_tile<TW>(p, w, claim, s_range, scr_bs, scr_bj);
      } else if (done) {
        break;
      } else {
        __nanosleep(2000);
      }
    }
  }
};

// The walker of request r = blockIdx.x (CPU twin: draft_request + RowSolver).
template <typename TW>
struct Walker : WalkBlock {
  int64_t r;
  const TW* w1;
  const TW* w2;
  float T;
  bool sampled;
  int64_t seed;
  const float* mn;
  double e_max;
  float w2_max;
  float M;
  int64_t anchor;
  int64_t B, T1;

  __device__ __forceinline__ explicit Walker(const WalkBlock& b)
      : WalkBlock(b),
        r(blockIdx.x),
        w1(static_cast<const TW*>(p.w1)),
        w2(static_cast<const TW*>(p.w2)),
        T(gld(p.temperature + r)),
        sampled(T > 0.f),
        seed(gld(p.seeds + r)),
        mn(norms_src(p, w)),
        e_max(static_cast<double>(v_max_of(p, mn))),
        w2_max(gld(mn + 1)),
        M(uniform_bound(p, mn)),
        anchor(gld(p.anchor + r)),
        B(p.B),
        T1(w.T1) {}

  // Row i is certified when every dropped token's upper bound is below the
  // best lower bound kept (tokens below a tile's own best lower bound were
  // never candidates). Equal keys (e.g. both -inf) do not certify.
  __device__ __forceinline__ bool certified(int64_t i) const { return s_Dkey[i] < s_Lkey[i]; }
  // (Not for gated / rnn heads: their v is not a function of the previous token alone.)
  __device__ __forceinline__ bool in_table(int64_t i) const {
    return p.head_type == kHeadVanilla && i < kTablePos && certified(i) && s_nF[i] >= 1 &&
           s_nF[i] <= kTableCap;
  }
  // Position i is walked from the tables when its set and the previous one
  // (the possible previous tokens) are both small.
  __device__ __forceinline__ bool tabled(int64_t i) const {
    return in_table(i) && (i == 0 || in_table(i - 1));
  }
  __device__ __forceinline__ int table_index(int64_t i, int64_t tok) const {
    if (!in_table(i)) return -1;
    for (int q = 0; q < s_nF[i]; ++q) if (s_tidx[i * kTableCap + q] == tok) return q;
    return -1;
  }

  // ---- phase 1, merge: the tiles of every row into certified sets.
  __device__ __forceinline__ void merge() {
    // The tile headers are loaded together with the parameters (one round
    // trip); B * T1 <= kMaxRowTiles = kHeadsPerThread * NT.
    constexpr int kHeadsPerThread = kMaxRowTiles / NT;
    TileHead heads[kHeadsPerThread];
#pragma unroll
    for (int q = 0; q < kHeadsPerThread; ++q) {
      const int64_t k = tid + static_cast<int64_t>(q) * NT;
      if (k < B * T1) heads[q] = gld(w.heads + r * B * T1 + k);
    }
    // What the walk reads later without knowing it yet: into L2 now.
    if (tid == 0) dev::prefetch_l2(w1 + (has_w1_row(p, anchor) ? anchor : 0) * p.rank,
                                   p.rank * sizeof(TW));
    if (tid == 1 && p.conf_base != nullptr) dev::prefetch_l2(p.conf_base + r * B, B * sizeof(float));
    if (tid == 2 && p.conf_w != nullptr) dev::prefetch_l2(p.conf_w, p.rank * sizeof(float));
    for (int64_t i = tid; i < B; i += NT) {
      s_Lkey[i] = order_key(neg_inf());
      s_Dkey[i] = order_key(neg_inf());
      s_nF[i] = 0;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < kHeadsPerThread; ++q) {
      const int64_t k = tid + static_cast<int64_t>(q) * NT;
      if (k >= B * T1) continue;
      const int64_t i = k / T1;
      s_cnt[k] = heads[q].count;
      if (heads[q].count > 0) atomicMax(s_Lkey + i, order_key(heads[q].kept_mlb));
      atomicMax(s_Dkey + i, order_key(heads[q].drop_ub));
    }
    __syncthreads();
    for (int64_t k = tid; k < B * T1 * kKeep; k += NT) {
      const int64_t tile_k = k / kKeep, q = k % kKeep, i = tile_k / T1;
      if (q >= s_cnt[tile_k] || !certified(i)) continue;
      const Entry en = gld(w.kept + r * B * T1 * kKeep + k);
      const uint32_t key = sampled ? row_key(seed, static_cast<int>(i)) : 0u;
      float lb, ub;
      score_bounds(en.base, M, sampled, T, key, en.idx, &lb, &ub);
      if (!(ub >= key_float(s_Lkey[i]))) continue;
      const int pos = atomicAdd(s_nF + i, 1);
      gst(w.fsets + (r * B + i) * T1 * kKeep + pos, en);
      if (i < kTablePos && pos < kTableCap) {
        s_tidx[i * kTableCap + pos] = en.idx;
        s_tbase[i * kTableCap + pos] = en.base;
        s_tg[i * kTableCap + pos] =
            sampled ? gumbel_exact(token_hash(key, static_cast<uint32_t>(en.idx))) : 0.f;
      }
    }
    __syncthreads();
  }

  // ---- phase 2, pair tables: for small sets, every (previous candidate,
  // candidate) dot product, the confidence and the norm check of every
  // previous candidate. Also starts the walk's state.
  __device__ __forceinline__ void pair_tables() {
    // Rows the walk may need later (moderate sets): into L2 now, without
    // waiting, so that its dependent loads hit L2 instead of DRAM.
    {
      const int64_t row_bytes = p.rank * static_cast<int64_t>(sizeof(TW));
      for (int64_t i = 0; i < B; ++i) {
        const int nF = s_nF[i];
        if (nF > kPrefetchCap) continue;
        for (int q = tid; q < 2 * nF; q += NT) {
          const Entry en = gld(w.fsets + (r * B + i) * T1 * kKeep + q / 2);
          if (q & 1) {
            const int64_t prev = w1_row_of(p, en.idx);
            if (has_w1_row(p, prev)) dev::prefetch_l2(w1 + prev * p.rank, row_bytes);
          } else {
            dev::prefetch_l2(w2 + static_cast<int64_t>(en.idx) * p.rank, row_bytes);
          }
        }
      }
    }
    for (int task = warp; task < kTablePos * kTableCap * (kTableCap + 1); task += NW) {
      const int i = task / (kTableCap * (kTableCap + 1));
      const int a = (task / (kTableCap + 1)) % kTableCap;
      const int k = task % (kTableCap + 1) - 1;  // -1: norm and confidence
      if (i >= B || !tabled(i)) continue;
      const int nprev = i == 0 ? 1 : s_nF[i - 1];
      if (a >= nprev || k >= s_nF[i]) continue;
      const int64_t prev = i == 0 ? anchor : w1_row_of(p, s_tidx[(i - 1) * kTableCap + a]);
      const bool valid = has_w1_row(p, prev);
      double x = 0.0, y = 0.0;
      if (valid) {
        for (int64_t c = lane; c < p.rank; c += 32) {
          const double ev = static_cast<double>(ldf(w1, prev * p.rank + c));
          if (k < 0) {
            x += ev * ev;
            if (p.conf_w != nullptr) y += ev * static_cast<double>(gld(p.conf_w + c));
          } else {
            const int64_t j = s_tidx[i * kTableCap + k];
            x += ev * static_cast<double>(ldf(w2, j * p.rank + c));
          }
        }
      }
      x = warp_sum(x);
      if (k < 0) y = warp_sum(y);  // k is warp-uniform
      if (lane == 0) {
        if (k < 0) {
          s_pok[i * kTableCap + a] = sqrt(x) <= e_max ? 1 : 0;
          s_pconf[i * kTableCap + a] =
              p.conf_base != nullptr ? confidence(static_cast<double>(gld(p.conf_base + r * B + i)) + y)
                                     : 1.0f;
        } else {
          s_pd[(i * kTableCap + a) * kTableCap + k] = static_cast<float>(x);
        }
      }
    }
    if (tid == 0) {
      s_prev[0] = anchor;
      s_prev_a[0] = 0;  // the anchor is the one "previous candidate" of position 0
    }
    __syncthreads();
  }

  // ---- phase 3, the walk: positions in order, each from the tables, else
  // from the certified set, else dense.
  __device__ __forceinline__ void walk() {
    if (p.head_type == kHeadRnn) {  // s_{-1} = 0 (published by prev_embedding's barriers)
      for (int64_t k = tid; k < p.rank; k += NT) gst(w.hstate + r * p.rank + k, 0.0);
    }
    int64_t i = 0;
    while (true) {
      i = walk_tables(i);
      if (i >= B) break;
      // ---- block-wide step for position i
      const bool generic = certified(i);
      double e_norm;  // ||v||: the bias reads v (e itself for the vanilla head)
      const float conf = prev_embedding(r * B + i, &e_norm);
      if (p.head_type != kHeadVanilla) {
        const sptr<float> e = s_e;
        e_norm = head_step<NT>(
            p, w, r, r * B + i, [&](int64_t k) { return static_cast<float>(e[k]); },
            [&](int64_t k, float v) { e[k] = v; }, scr_d);
      }
      if (!(generic && e_norm <= e_max && pruned(i, e_norm, conf))) dense(i, conf);
      __syncthreads();
      ++i;
    }
    if (tid == 0) {
      __threadfence();
      atomicAdd(walkers_done_word(w), 1);
    }
  }

  // Writes position i's outputs (thread 0) and moves the walk on.
  __device__ __forceinline__ void finish(int64_t i, int64_t tok, int32_t stat, float c, int a) {
    const int64_t row = r * B + i;
    if (tok < 0 || tok >= p.V) tok = 0;  // NaN policy: a row of only NaN proposes 0
    gst(p.out_tokens + row, static_cast<int64_t>(tok));
    if (p.out_stats != nullptr) gst(p.out_stats + row, stat);
    gst(p.out_conf + row, c);
    s_prev[0] = w1_row_of(p, tok);
    s_prev_a[0] = a;
  }

  // Thread 0 walks every position it can from the pair tables alone, from
  // position i on; returns (to every thread) the first position it could not.
  __device__ __forceinline__ int64_t walk_tables(int64_t i) {
    if (tid == 0) {
      while (i < B && tabled(i) && s_prev_a[0] >= 0) {
        const int a = s_prev_a[0];
        if (!s_pok[i * kTableCap + a]) break;  // ||e|| above the bound: not certified
        Best best{neg_inf(), LLONG_MAX};
        int bk = -1;
        bool nan = false;
        for (int k = 0; k < s_nF[i]; ++k) {
          const float logit = add_rn(s_tbase[i * kTableCap + k],
                                     s_pd[(i * kTableCap + a) * kTableCap + k]);
          const float sc = sampled ? sampled_score(logit, T, s_tg[i * kTableCap + k]) : logit;
          const int64_t j = s_tidx[i * kTableCap + k];
          nan |= sc != sc;
          if (better(sc, j, best.s, best.j)) {
            best = Best{sc, j};
            bk = k;
          }
        }
        if (nan || bk < 0) break;  // a NaN bias voids the certificate: go dense
        finish(i, best.j, s_nF[i], s_pconf[i * kTableCap + a], i + 1 < B ? bk : -1);
        ++i;
      }
      s_ctl[3] = static_cast<int>(i);
    }
    __syncthreads();
    return s_ctl[3];
  }

  // The previous token's embedding into s_e, its norm and row `row`'s
  // confidence (CPU twin: draft_request's e64 and row_conf). Everything the
  // step reads that does not depend on the candidates, in one round trip.
  __device__ __forceinline__ float prev_embedding(int64_t row, double* e_norm) {
    const int64_t prev = s_prev[0];
    const bool valid = has_w1_row(p, prev);
    double en2 = 0.0, cd = 0.0;
    for (int64_t k = tid; k < p.rank; k += NT) {
      const float ev = valid ? ldf(w1, prev * p.rank + k) : 0.f;
      s_e[k] = ev;
      en2 += static_cast<double>(ev) * static_cast<double>(ev);
      if (p.conf_w != nullptr) cd += static_cast<double>(ev) * static_cast<double>(gld(p.conf_w + k));
    }
    const float cbase = p.conf_base != nullptr ? gld(p.conf_base + row) : 0.f;
    block_sum2<NW>(en2, cd, scr_d);  // its barriers also publish s_e
    *e_norm = sqrt(en2);
    return p.conf_base != nullptr ? confidence(static_cast<double>(cbase) + cd) : 1.0f;
  }

  // Position i from its certified set (block-uniform call, ||e|| within the
  // bound): the per-row bound with the real ||e||, exact scores for every
  // candidate whose upper bound reaches the best lower bound. False when a
  // NaN score voids the certificate (the caller goes dense).
  __device__ __forceinline__ bool pruned(int64_t i, double e_norm, float conf) {
    const int64_t row = r * B + i;
    const int nF = s_nF[i];
    const Entry* fset = w.fsets + row * T1 * kKeep;
    const float M2 = bias_bound(w2_max, bound_scale(e_norm));
    const uint32_t key = sampled ? row_key(seed, static_cast<int>(i)) : 0u;
    // The set is streamed from the workspace (L2) twice rather than copied:
    // it can hold up to T1 * kKeep tokens.
    Best bl{neg_inf(), LLONG_MAX};  // best lower bound and its slot
    for (int q = tid; q < nF; q += NT) {
      const Entry en = gld(fset + q);
      float lb, ub;
      score_bounds(en.base, M2, sampled, T, key, en.idx, &lb, &ub);
      if (better(lb, q, bl.s, bl.j)) bl = Best{lb, q};
    }
    bl = block_best<NW>(bl, scr_bs, scr_bj);
    float mlb = bl.s;
    if (nF > kStage1 && bl.j != LLONG_MAX) {
      // Large set: the exact score of the best-lower-bound token first; only
      // tokens whose upper bound reaches it can still win (as the CPU twin).
      if (warp == 0) {
        const Entry en = gld(fset + bl.j);
        const int64_t j = en.idx;
        double acc = 0.0;
        for (int64_t k = lane; k < p.rank; k += 32) {
          acc += static_cast<double>(ldf(w2, j * p.rank + k)) * static_cast<double>(s_e[k]);
        }
        acc = warp_sum(acc);
        if (lane == 0) {
          scr_f[0] = exact_score(add_rn(en.base, static_cast<float>(acc)), sampled, T, key, j);
        }
      }
      __syncthreads();
      const float s1 = scr_f[0];
      if (s1 > mlb) mlb = s1;  // a NaN score keeps the lower bound
      __syncthreads();  // scr_f is reused below
    }
    Best best{neg_inf(), LLONG_MAX};
    int cnt = 0, nan = 0;
    for (int q = warp; q < nF; q += NW) {
      const Entry en = gld(fset + q);
      float lb, ub;
      score_bounds(en.base, M2, sampled, T, key, en.idx, &lb, &ub);
      if (!(ub >= mlb)) continue;  // warp-uniform: every lane has the same entry
      const int64_t j = en.idx;
      double acc = 0.0;
      for (int64_t k = lane; k < p.rank; k += 32) {
        acc += static_cast<double>(ldf(w2, j * p.rank + k)) * static_cast<double>(s_e[k]);
      }
      acc = warp_sum(acc);
      const float sc = exact_score(add_rn(en.base, static_cast<float>(acc)), sampled, T, key, j);
      nan |= sc != sc;
      ++cnt;
      if (better(sc, j, best.s, best.j)) best = Best{sc, j};
    }
    int flags = lane == 0 ? cnt + (nan << 20) : 0;
    best = block_best_count<NW>(best, &flags, scr_bs, scr_bj, scr_i);
    if ((flags >> 20) == 0 && best.j != LLONG_MAX) {
      if (tid == 0) finish(i, best.j, flags & 0xfffff, conf, table_index(i, best.j));
      return true;
    }
    return false;
  }

  // ---- phase 4, dense fallback: position i not certified. The walker posts
  // a job (s_e, published) and serves markov_w2 tiles with every block that
  // helps, until every tile has served it; then picks from the tile bests.
  __device__ __forceinline__ void dense(int64_t i, float conf) {
    const int64_t row = r * B + i;
    for (int64_t k = tid; k < p.rank; k += NT) gst(w.je + row * p.rank + k, static_cast<float>(s_e[k]));
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const int slot = atomicAdd(njobs_word(w), 1);
      gst_volatile(job_rows(w) + slot, static_cast<int>(row + 1));
      s_ctl[2] = slot;
    }
    __syncthreads();
    const int slot = s_ctl[2];
    int64_t cursor = (r * 131) % Td;
    while (true) {
      if (tid == 0) {
        int found = -1, pending = 0;
        for (int64_t u = cursor; u < cursor + Td; ++u) {
          const int64_t t = u % Td;
          if (gld_volatile(cov + t) > slot) continue;
          pending = 1;
          if (atomicCAS(lock + t, 0, 1) == 0) {
            if (gld_volatile(cov + t) > slot) {
              atomicExch(lock + t, 0);
              continue;
            }
            found = static_cast<int>(t);
            cursor = u + 1;
            break;
          }
        }
        s_ctl[0] = found;
        s_ctl[1] = pending;
      }
      __syncthreads();
      const int claim = s_ctl[0], pending = s_ctl[1];
      __syncthreads();
      if (claim >= 0) {
        serve_tile<TW>(p, w, claim, s_range, scr_bs, scr_bj);
      } else if (!pending) {
        break;
      } else {
        __nanosleep(1000);
      }
    }
    __threadfence();
    Best best{neg_inf(), LLONG_MAX};
    for (int64_t t = tid; t < Td; t += NT) {
      best = best_of(best, Best{gld(w.jbest_s + row * Td + t), gld(w.jbest_j + row * Td + t)});
    }
    best = block_best<NW>(best, scr_bs, scr_bj);
    if (tid == 0) finish(i, best.j, static_cast<int32_t>(p.V), conf, table_index(i, best.j));
  }
};

template <typename TW>
__global__ void __launch_bounds__(kWalkThreads, 1) walk_kernel(MarkovDraftParams p, Workspace w) {
  constexpr int NW = kWalkWarps;
  DSPARK_SMEM_ARRAY(float, scr_f, NW);
  DSPARK_SMEM_ARRAY(int, scr_i, NW);
  DSPARK_SMEM_ARRAY(double, scr_d, 2 * NW);
  DSPARK_SMEM_ARRAY(float, scr_bs, NW);
  DSPARK_SMEM_ARRAY(long long, scr_bj, NW);
  DSPARK_SMEM_ARRAY(int, s_range, 2);
  DSPARK_SMEM_ARRAY(int, s_ctl, 4);
  DSPARK_SMEM_ARRAY(long long, s_prev, 1);
  DSPARK_SMEM_ARRAY(int, s_prev_a, 1);
  DSPARK_SMEM_ARRAY(int, s_Lkey, kMaxPrunedBlock);
  DSPARK_SMEM_ARRAY(int, s_Dkey, kMaxPrunedBlock);
  DSPARK_SMEM_ARRAY(int, s_nF, kMaxPrunedBlock);
  DSPARK_SMEM_ARRAY(int, s_tidx, kTablePos * kTableCap);
  DSPARK_SMEM_ARRAY(float, s_tbase, kTablePos * kTableCap);
  DSPARK_SMEM_ARRAY(float, s_tg, kTablePos * kTableCap);
  DSPARK_SMEM_ARRAY(float, s_pd, kTablePos * kTableCap * kTableCap);
  DSPARK_SMEM_ARRAY(float, s_pconf, kTablePos * kTableCap);
  DSPARK_SMEM_ARRAY(int, s_pok, kTablePos * kTableCap);
  DSPARK_DYN_SMEM(dyn);
  const WalkBlock blk{p, w, scr_f, scr_i, scr_d, scr_bs, scr_bj, s_range, s_ctl, s_prev,
                      s_prev_a, s_Lkey, s_Dkey, s_nF, s_tidx, s_tbase, s_tg, s_pd,
                      s_pconf, s_pok,
                      dev::smem_cast<float>(dyn),                 // s_e   [rank]
                      dev::smem_cast<int>(dyn + 4 * p.rank)};     // s_cnt [B * T1]
  if (static_cast<int64_t>(blockIdx.x) >= p.R) {
    blk.help<TW>();
    return;
  }
  Walker<TW> walker(blk);
  walker.merge();        // 1. certified candidate sets
  walker.pair_tables();  // 2. pair tables of the small sets
  walker.walk();         // 3. the positions in order (4. dense fallback inside)
}

// ------------------------------------------------------------ dense path
// Position i for every request: each block reads one markov_w2 tile once for
// all requests (the later requests' re-reads hit L2) and keeps the tile's best.
// Gated / rnn heads: before dense_kernel(i), v of position i for every
// request (a block each) into the job embeddings w.je, from e of the token
// pick_kernel(i - 1) wrote; the rnn state starts at zero at i == 0.
template <typename TW>
__global__ void __launch_bounds__(256) head_kernel(MarkovDraftParams p, Workspace w, int64_t i) {
  DSPARK_SMEM_ARRAY(double, scr_d, 16);
  const int64_t r = blockIdx.x, row = r * p.B + i;
  const TW* w1 = static_cast<const TW*>(p.w1);
  const int64_t prev = i == 0 ? gld(p.anchor + r) : w1_row_of(p, gld(p.out_tokens + row - 1));
  const bool valid = has_w1_row(p, prev);
  float* v = w.je + row * p.rank;
  for (int64_t k = threadIdx.x; k < p.rank; k += 256) {
    gst(v + k, valid ? ldf(w1, prev * p.rank + k) : 0.f);  // e, overwritten by v below
    if (i == 0 && p.head_type == kHeadRnn) gst(w.hstate + r * p.rank + k, 0.0);
  }
  __syncthreads();
  head_step<256>(
      p, w, r, row, [&](int64_t k) { return gld(v + k); }, [&](int64_t k, float x) { gst(v + k, x); },
      scr_d);
}

template <typename TW>
__global__ void __launch_bounds__(kDenseThreads) dense_kernel(MarkovDraftParams p, Workspace w,
                                                               int64_t i) {
  DSPARK_SMEM_ARRAY(float, scr_s, kDenseWarps);
  DSPARK_SMEM_ARRAY(long long, scr_j, kDenseWarps);
  const int64_t t = blockIdx.x;
  const TW* w1 = static_cast<const TW*>(p.w1);
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t row = r * p.B + i;
    if (p.head_type != kHeadVanilla) {  // v from head_kernel (always defined: no anchor policy on v)
      score_tile<TW, float, kDenseThreads>(p, w, t, row, w.je + row * p.rank, true, scr_s, scr_j);
      continue;
    }
    const int64_t prev = i == 0 ? gld(p.anchor + r) : w1_row_of(p, gld(p.out_tokens + row - 1));
    const bool valid = has_w1_row(p, prev);
    score_tile<TW, TW, kDenseThreads>(p, w, t, row, w1 + (valid ? prev : 0) * p.rank, valid,
                                          scr_s, scr_j);
  }
}

template <typename TW>
__global__ void __launch_bounds__(256) pick_kernel(MarkovDraftParams p, Workspace w, int64_t i) {
  DSPARK_SMEM_ARRAY(float, scr_s, 8);
  DSPARK_SMEM_ARRAY(long long, scr_j, 8);
  DSPARK_SMEM_ARRAY(double, scr_d, 16);
  const int64_t r = blockIdx.x, row = r * p.B + i;
  Best best{neg_inf(), LLONG_MAX};
  for (int64_t t = threadIdx.x; t < w.Td; t += 256) {
    best = best_of(best, Best{gld(w.jbest_s + row * w.Td + t), gld(w.jbest_j + row * w.Td + t)});
  }
  best = block_best<8>(best, scr_s, scr_j);
  const TW* w1 = static_cast<const TW*>(p.w1);
  const int64_t prev = i == 0 ? gld(p.anchor + r) : w1_row_of(p, gld(p.out_tokens + row - 1));
  const bool valid = has_w1_row(p, prev);
  double cd = 0.0, unused = 0.0;
  if (valid && p.conf_w != nullptr) {
    for (int64_t k = threadIdx.x; k < p.rank; k += 256) {
      cd += static_cast<double>(ldf(w1, prev * p.rank + k)) * static_cast<double>(gld(p.conf_w + k));
    }
  }
  block_sum2<8>(cd, unused, scr_d);
  if (threadIdx.x == 0) {
    const int64_t tok = best.j < 0 || best.j >= p.V ? 0 : best.j;  // NaN policy
    gst(p.out_tokens + row, static_cast<int64_t>(tok));
    if (p.out_stats != nullptr) gst(p.out_stats + row, static_cast<int32_t>(p.V));
    const float c = p.conf_base != nullptr
                        ? confidence(static_cast<double>(gld(p.conf_base + row)) + cd)
                        : 1.0f;
    gst(p.out_conf + row, c);
  }
}

// -------------------------------------------------------------- launcher
bool takes_pruned(const MarkovDraftParams& p, int64_t T1) {
  return p.out_logits == nullptr && p.rank <= kMaxPrunedRank && p.B <= kMaxPrunedBlock &&
         p.B * T1 <= kMaxRowTiles;
}

template <typename TB, typename TW>
cudaError_t launch_typed(const MarkovDraftParams& p, const Workspace& w, cudaStream_t stream) {
  if (takes_pruned(p, w.T1)) {
    if (p.max_norms == nullptr) {
      auto* parts = &norm_parts_kernel<TW>;
      DSPARK_LAUNCH(parts, dim3(kNormParts), dim3(256), 0, stream, p, w);
      auto* final_ = &norm_final_kernel;
      DSPARK_LAUNCH(final_, dim3(1), dim3(256), 0, stream, w, kNormParts);
    }
    auto* cand = &cand_kernel<TB>;
    DSPARK_LAUNCH(cand, dim3(static_cast<unsigned>(p.R * p.B * w.T1)), dim3(kCandThreads), 0,
                  stream, p, w);
    const size_t smem = static_cast<size_t>(4 * p.rank + 4 * p.B * w.T1);
    auto* walk = &walk_kernel<TW>;
    DSPARK_LAUNCH(walk, dim3(static_cast<unsigned>(p.R + kHelpers)), dim3(kWalkThreads), smem,
                  stream, p, w);
    return DSPARK_GET_LAST_ERROR();
  }
  auto* dense = &dense_kernel<TW>;
  auto* pick = &pick_kernel<TW>;
  auto* head = &head_kernel<TW>;
  for (int64_t i = 0; i < p.B; ++i) {
    if (p.head_type != kHeadVanilla) {
      DSPARK_LAUNCH(head, dim3(static_cast<unsigned>(p.R)), dim3(256), 0, stream, p, w, i);
    }
    DSPARK_LAUNCH(dense, dim3(static_cast<unsigned>(w.Td)), dim3(kDenseThreads), 0, stream, p, w,
                  i);
    DSPARK_LAUNCH(pick, dim3(static_cast<unsigned>(p.R)), dim3(256), 0, stream, p, w, i);
  }
  return DSPARK_GET_LAST_ERROR();
}

template <typename TB>
cudaError_t launch_w(const MarkovDraftParams& p, const Workspace& w, cudaStream_t stream) {
  switch (p.w_dtype) {
    case DType::kFloat32: return launch_typed<TB, float>(p, w, stream);
    case DType::kBFloat16: return launch_typed<TB, __nv_bfloat16>(p, w, stream);
    case DType::kFloat16: return launch_typed<TB, __half>(p, w, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

size_t markov_workspace_bytes(const MarkovDraftParams& p) {
  size_t total = 0;
  carve(p, nullptr, &total);
  return total;
}

cudaError_t launch_markov_draft(const MarkovDraftParams& p, void* workspace,
                                cudaStream_t stream) {
  if (p.R == 0 || p.B == 0) return cudaSuccess;
  if (p.R > (int64_t(1) << 24) || p.V <= 0 || p.V >= (int64_t(1) << 31) || p.V1 <= 0 ||
      p.rank <= 0 || workspace == nullptr || p.head_type < kHeadVanilla || p.head_type > kHeadRnn ||
      (p.head_type != kHeadVanilla && (p.head_hidden == nullptr || p.head_w == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const Workspace w = carve(p, workspace, nullptr);
  if (p.R * p.B * w.T1 >= (int64_t(1) << 31) || w.Td >= (int64_t(1) << 31)) {
    return cudaErrorInvalidValue;
  }
  switch (p.base_dtype) {
    case DType::kFloat32: return launch_w<float>(p, w, stream);
    case DType::kBFloat16: return launch_w<__nv_bfloat16>(p, w, stream);
    case DType::kFloat16: return launch_w<__half>(p, w, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dspark
