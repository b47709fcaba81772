// SIMT emulation of the CUDA subset used by csrc/markov_draft_kernels.cu, so
// that the real kernel source runs on the host under g++ (test code only; see
// README.md beside this file and scripts/emulate_cuda.py).
//
// Model: every CUDA thread of a block is a fiber (tests/ops/simt/simt_runtime.cpp
// switches stacks by hand, no OS threads). Fibers run one at a time and switch
// only at synchronisation points (__syncthreads, warp collectives, __nanosleep)
// plus, when SIMT_PREEMPT is set, at random shared/global accesses; the next
// fiber is picked at random from a seeded generator. Warp collectives really
// exchange values: the 32 lanes run up to the collective, then it completes.
//
// Checks (each failure aborts the run with a message and exit status 3):
//   * shared-memory races: per 4-byte word the last writer and the last two
//     readers are kept with the barrier interval (and the warp's __syncwarp
//     epoch) they happened in; a write and another thread's access in the same
//     interval conflict unless both are atomics or both threads are lanes of one
//     warp separated by a __syncwarp;
//   * reads of shared words never written in this block;
//   * barrier divergence: all live threads of a block must wait at the same
//     __syncthreads (same source line), none may have exited; every lane of a
//     collective's mask must reach the same collective with the same mask;
//   * global accesses outside the buffers the harness registered.
// Counters: global bytes read/written per launch (requested, and distinct
// 32-byte sectors), blocks, threads, barriers and barrier intervals with global
// loads per block (see scripts/bench_markov_op.py --model).
#pragma once

#include <stdint.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 { unsigned x, y, z, w; };

typedef int cudaError_t;
typedef void* cudaStream_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorLaunchFailure = 4;
inline const char* cudaGetErrorString(cudaError_t e) { return e == 0 ? "no error" : "simt error"; }

namespace simt {

// ----------------------------------------------------------------- runtime API
struct ThreadCtx {
  dim3 tid;
  int linear;  // thread index in the block
};
ThreadCtx* cur();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void syncthreads(const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);
uint64_t warp_collective(int op, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line);
void maybe_preempt();
void nanosleep_yield();
void fail(const char* fmt, ...);

// Global memory bookkeeping.
void global_access(const void* p, size_t bytes, bool write, bool atomic);
// A fire-and-forget L2 prefetch: counted as DRAM traffic, makes the sectors
// L2-resident for the latency counters, is not a load the thread waits for.
void global_prefetch(const void* p, size_t bytes);
// Shared memory bookkeeping: arena base of the current block and checks.
unsigned char* smem_static_alloc(const void* key, size_t bytes, size_t align);
unsigned char* smem_dynamic();
void smem_access(const void* p, size_t bytes, int kind);  // 0 read, 1 write, 2 atomic
cudaError_t last_error();
extern bool g_in_kernel;

using KernelBody = std::function<void()>;
cudaError_t launch(const char* name, dim3 grid, dim3 block, size_t smem, KernelBody body);

// ----------------------------------------------------------- shared pointers
// A pointer into the current block's shared arena. Every dereference goes
// through the race detector.
template <typename T>
class SharedRef {
 public:
  explicit SharedRef(T* p) : p_(p) {}
  operator T() const {
    maybe_preempt();
    smem_access(p_, sizeof(T), 0);
    return *p_;
  }
  SharedRef& operator=(T v) {
    maybe_preempt();
    smem_access(p_, sizeof(T), 1);
    *p_ = v;
    return *this;
  }
  SharedRef& operator=(const SharedRef& o) { return *this = static_cast<T>(o); }
  SharedRef& operator+=(T v) { return *this = static_cast<T>(*this) + v; }
  SharedRef& operator-=(T v) { return *this = static_cast<T>(*this) - v; }
  T* raw() const { return p_; }

 private:
  T* p_;
};

template <typename T>
class sptr {
 public:
  sptr() : p_(nullptr) {}
  explicit sptr(T* p) : p_(p) {}
  SharedRef<T> operator[](int64_t i) const { return SharedRef<T>(p_ + i); }
  SharedRef<T> operator*() const { return SharedRef<T>(p_); }
  sptr operator+(int64_t i) const { return sptr(p_ + i); }
  sptr operator-(int64_t i) const { return sptr(p_ - i); }
  sptr& operator+=(int64_t i) { p_ += i; return *this; }
  T* raw() const { return p_; }

 private:
  T* p_;
};

template <typename T, typename U>
sptr<T> sptr_cast(sptr<U> p) { return sptr<T>(reinterpret_cast<T*>(p.raw())); }

}  // namespace simt

// ------------------------------------------------------------- CUDA builtins
#define threadIdx (::simt::cur()->tid)
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())
inline void __syncthreads(const char* f = __builtin_FILE(), int l = __builtin_LINE()) {
  ::simt::syncthreads(f, l);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* f = __builtin_FILE(),
                       int l = __builtin_LINE()) {
  ::simt::syncwarp(mask, f, l);
}

namespace simt {
enum { kShflIdx = 0, kShflXor = 1, kShflDown = 2, kShflUp = 3, kBallot = 4, kAny = 5, kAll = 6 };
template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
}  // namespace simt

#define DSPARK_SIMT_SHFL(name, op)                                                        \
  template <typename T>                                                                   \
  inline T name(unsigned mask, T v, int arg, int width = 32, const char* f = __builtin_FILE(), \
                int l = __builtin_LINE()) {                                               \
    return ::simt::from_bits<T>(::simt::warp_collective(op, mask, ::simt::to_bits(v), arg, width, f, l)); \
  }
DSPARK_SIMT_SHFL(__shfl_sync, ::simt::kShflIdx)
DSPARK_SIMT_SHFL(__shfl_xor_sync, ::simt::kShflXor)
DSPARK_SIMT_SHFL(__shfl_down_sync, ::simt::kShflDown)
DSPARK_SIMT_SHFL(__shfl_up_sync, ::simt::kShflUp)
#undef DSPARK_SIMT_SHFL

inline unsigned __ballot_sync(unsigned mask, int pred, const char* f = __builtin_FILE(),
                              int l = __builtin_LINE()) {
  return static_cast<unsigned>(::simt::warp_collective(::simt::kBallot, mask, pred != 0, 0, 32, f, l));
}
inline int __any_sync(unsigned mask, int pred, const char* f = __builtin_FILE(),
                      int l = __builtin_LINE()) {
  return static_cast<int>(::simt::warp_collective(::simt::kAny, mask, pred != 0, 0, 32, f, l));
}
inline int __all_sync(unsigned mask, int pred, const char* f = __builtin_FILE(),
                      int l = __builtin_LINE()) {
  return static_cast<int>(::simt::warp_collective(::simt::kAll, mask, pred != 0, 0, 32, f, l));
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
inline void __threadfence() { ::simt::maybe_preempt(); }
inline void __threadfence_block() {}
inline void __nanosleep(unsigned) { ::simt::nanosleep_yield(); }

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
// Correctly rounded fp32 ops: the harness is built with -ffp-contract=off, so
// plain operators are single IEEE operations.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }

// ------------------------------------------------------------------- atomics
// Fibers never switch inside these, so plain read-modify-write is atomic.
namespace simt {
template <typename T>
inline T* atomic_target(T* p) {
  global_access(p, sizeof(T), true, true);
  return p;
}
template <typename T>
inline T* atomic_target(sptr<T> p) {
  maybe_preempt();
  smem_access(p.raw(), sizeof(T), 2);
  return p.raw();
}
}  // namespace simt

template <typename P, typename T>
inline T atomicAdd(P p, T v) { T* q = ::simt::atomic_target(p); T o = *q; *q = o + v; return o; }
template <typename P, typename T>
inline T atomicMax(P p, T v) { T* q = ::simt::atomic_target(p); T o = *q; *q = o > v ? o : v; return o; }
template <typename P, typename T>
inline T atomicMin(P p, T v) { T* q = ::simt::atomic_target(p); T o = *q; *q = o < v ? o : v; return o; }
template <typename P, typename T>
inline T atomicExch(P p, T v) { T* q = ::simt::atomic_target(p); T o = *q; *q = v; return o; }
template <typename P, typename T>
inline T atomicCAS(P p, T cmp, T v) { T* q = ::simt::atomic_target(p); T o = *q; if (o == cmp) *q = v; return o; }

// --------------------------------------------------- bf16 / fp16 host shims
// cuda_bf16.h / cuda_fp16.h cannot be used on the host; these carry the bits
// and convert exactly (bf16 -> fp32 is a shift; fp16 -> fp32 handles
// subnormals, infinities and NaN).
struct __nv_bfloat16 { uint16_t x; };
struct __half { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half2 { __half x, y; };
inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return __nv_bfloat16{x}; }
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t b = static_cast<uint32_t>(h.x) << 16;
  return __uint_as_float(b);
}
inline float __half2float(__half h) {
  const uint32_t s = (h.x & 0x8000u) << 16, e = (h.x >> 10) & 0x1f, m = h.x & 0x3ffu;
  uint32_t b;
  if (e == 0) {
    if (m == 0) {
      b = s;
    } else {  // subnormal: normalise
      int sh = 0;
      uint32_t mm = m;
      while (!(mm & 0x400u)) { mm <<= 1; ++sh; }
      b = s | ((127 - 15 - sh + 1) << 23) | ((mm & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    b = s | 0x7f800000u | (m << 13);
  } else {
    b = s | ((e + 127 - 15) << 23) | (m << 13);
  }
  return __uint_as_float(b);
}

// ------------------------------------------------------ kernel-facing macros
namespace dspark {
namespace dev {
template <typename T>
using sptr = ::simt::sptr<T>;
template <typename T>
inline T gld(const T* p) {
  ::simt::maybe_preempt();
  ::simt::global_access(p, sizeof(T), false, false);
  return *p;
}
template <typename T>
inline T gld_volatile(const T* p) {
  ::simt::maybe_preempt();
  ::simt::global_access(p, sizeof(T), false, true);
  return *p;
}
template <typename T>
inline void gst(T* p, T v) {
  ::simt::maybe_preempt();
  ::simt::global_access(p, sizeof(T), true, false);
  *p = v;
}
template <typename T>
inline void gst_volatile(T* p, T v) {
  ::simt::maybe_preempt();
  ::simt::global_access(p, sizeof(T), true, true);
  *p = v;
}
template <typename T, typename U>
inline sptr<T> smem_cast(sptr<U> p) { return ::simt::sptr_cast<T>(p); }
inline void prefetch_l2(const void* p, size_t bytes) { ::simt::global_prefetch(p, bytes); }
}  // namespace dev
}  // namespace dspark

#define DSPARK_SMEM_ARRAY(T, name, n)                                                    \
  ::simt::sptr<T> name(reinterpret_cast<T*>(::simt::smem_static_alloc(                    \
      [] { static const char tag = 0; return &tag; }(), sizeof(T) * (n), alignof(T))))
#define DSPARK_DYN_SMEM(name) ::simt::sptr<unsigned char> name(::simt::smem_dynamic())
// `kfn` is a plain identifier (a pointer to the kernel instantiation): macro
// arguments cannot carry template argument lists.
#define DSPARK_LAUNCH(kfn, grid, block, smem, stream, ...)                               \
  ::simt::launch(#kfn, grid, block, smem, [&] { kfn(__VA_ARGS__); })
#define DSPARK_GET_LAST_ERROR() ::simt::last_error()
