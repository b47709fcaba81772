// vllm_dspark::row_argmax on CPU: the argmax of chosen rows of a [N, V] logits
// matrix, as torch.argmax(x[rows], -1) gives it (the first maximum; a row with
// a NaN gives its first NaN).
//
// Why not torch.argmax: on this CPU its last-dimension argmax does not
// vectorise. It took 9 ms for 224 x 49,152 fp32 logits (20 ms in bf16), while
// amax took 0.75 ms. A greedy verify of 32 requests x 7 drafts needs exactly
// that argmax. Here each row takes one vectorised pass for its maximum (and a
// NaN flag), then the first index that holds it is found in the one chunk
// where that maximum first appeared. The gather into a new tensor is skipped
// too: `rows` indexes x directly.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace dspark {
namespace {

constexpr int64_t kChunk = 512;

// The build has no -march flag (the .so may run on another x86 machine), so the
// hot loops are cloned for AVX-512 and AVX2 and picked at load time (GCC ifunc).
// Without the clones the widening and the max ran as SSE2: 0.14 ms for 7 bf16
// rows of 49,152, a seventh of a batch-1 verify's rejection sampler.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DSPARK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DSPARK_CLONES
#endif

// fp32 view of a chunk. bf16 is the top half of an fp32: a shift widens it exactly.
DSPARK_CLONES void widen_bf16(const uint16_t* __restrict raw, float* __restrict buf, int64_t n) {
  uint32_t bits[kChunk];
  for (int64_t t = 0; t < n; ++t) bits[t] = static_cast<uint32_t>(raw[t]) << 16;
  std::memcpy(buf, bits, static_cast<size_t>(n) * sizeof(float));
}
inline const float* widen(const float* p, float*, int64_t) { return p; }
inline const float* widen(const c10::BFloat16* p, float* buf, int64_t n) {
  widen_bf16(reinterpret_cast<const uint16_t*>(p), buf, n);
  return buf;
}
inline const float* widen(const c10::Half* p, float* buf, int64_t n) {
  for (int64_t t = 0; t < n; ++t) buf[t] = static_cast<float>(p[t]);
  return buf;
}

// The chunk's maximum; *bad is set when it holds a NaN.
DSPARK_CLONES float chunk_max(const float* __restrict x, int64_t n, float start, int* bad) {
  float m = start;
  int b = 0;
#pragma omp simd reduction(max : m) reduction(| : b)
  for (int64_t t = 0; t < n; ++t) {
    m = x[t] > m ? x[t] : m;
    b |= x[t] != x[t];
  }
  *bad |= b;
  return m;
}

// One pass keeps the first chunk whose maximum beats every chunk before it; the
// index is then looked up in that chunk alone. A row with a NaN is rare and
// takes a second pass for its first NaN, which torch.argmax returns.
template <typename T>
int64_t argmax_row(const T* row, int64_t V) {
  alignas(64) float buf[kChunk];
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_chunk = 0;
  int nan = 0;
  for (int64_t s = 0; s < V; s += kChunk) {
    const int64_t n = std::min(kChunk, V - s);
    const float m = chunk_max(widen(row + s, buf, n), n, best, &nan);
    if (m > best) {
      best = m;
      best_chunk = s;
    }
  }
  if (nan) {
    for (int64_t s = 0; s < V; s += kChunk) {
      const int64_t n = std::min(kChunk, V - s);
      const float* x = widen(row + s, buf, n);
      for (int64_t t = 0; t < n; ++t)
        if (x[t] != x[t]) return s + t;
    }
  }
  const int64_t n = std::min(kChunk, V - best_chunk);
  const float* x = widen(row + best_chunk, buf, n);
  for (int64_t t = 0; t < n; ++t)
    if (x[t] == best) return best_chunk + t;
  return 0;  // every value is -inf: torch.argmax gives 0 too
}

at::Tensor row_argmax_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(x.dim() == 2, "row_argmax: x must be [N, V], got ", x.sizes());
  TORCH_CHECK(x.size(1) > 0, "row_argmax: x has no columns");
  const at::Tensor xc = x.contiguous();
  at::Tensor idx;
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1, "row_argmax: rows must be 1-D, got ", rows->sizes());
    TORCH_CHECK(rows->scalar_type() == at::kLong || rows->scalar_type() == at::kInt,
                "row_argmax: rows must be int32 or int64, got ", rows->scalar_type());
    idx = rows->to(at::kLong).contiguous();
  } else {
    idx = at::arange(x.size(0), x.options().dtype(at::kLong));
  }
  const int64_t R = idx.size(0), N = xc.size(0), V = xc.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row_argmax: row ", ip[i], " of ", N);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto* base) {
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) op[i] = argmax_row(base + ip[i] * V, V);
    });
  };
  switch (xc.scalar_type()) {
    case at::kFloat: run(xc.data_ptr<float>()); break;
    case at::kBFloat16: run(xc.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(xc.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "row_argmax: x must be float32, bfloat16 or float16, got ", xc.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace dspark

TORCH_LIBRARY_IMPL(vllm_dspark, CPU, m) { m.impl("row_argmax", &dspark::row_argmax_cpu); }
