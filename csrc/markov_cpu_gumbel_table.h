// Table bounds of the Gumbel noise for the CPU twin's pruning pass (host
// only, no torch: tests/ops/test_markov_common_math.py compiles it directly
// and checks the bounds against gumbel_exact over sampled and boundary hashes).
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "markov_common.h"

namespace dspark {

// ---------------------------------------------------------------------------
// Gumbel bound tables. gumbel_exact(h) is increasing in h. For h < 2^31 the
// buckets are uniform in h (h >> 20); for h >= 2^31 they follow c = ~h, the
// distance of u from 1, on a log scale (the exponent and top 7 mantissa bits of
// fp32(c | 1)), because there g = -log(-log(u)) ~ -log(1 - u) changes fastest.
// Both maps are monotone, so each bucket is an interval of h; the table holds
// the exact noise at the interval's ends, widened by 1e-6 relative. The tables
// are built from the very bucket map used to read them (binary search of the
// interval ends), so a rounding quirk of the int -> float conversion cannot
// leave a hash outside its bucket's bounds.
// ---------------------------------------------------------------------------
constexpr int kLowBuckets = 2048;
// fp32(c | 1) for c < 2^31 has exponent 0..31 (c near 2^31 rounds up to 2^31).
constexpr int kHighBuckets = 31 * 128 + 1;

inline int high_bucket(uint32_t c) {  // c = ~h < 2^31; monotone in c
  const float f = static_cast<float>(static_cast<int32_t>(c | 1u));
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<int>(bits >> 16) - (127 << 7);  // [0, 31 * 128]
}

inline int bucket_of(uint32_t h) {  // branch-free, vectorisable
  const int low = static_cast<int>(h >> 20);
  const int high = kLowBuckets + high_bucket(~h);
  const int mask = static_cast<int32_t>(h) >> 31;  // -1 for the high half
  return (low & ~mask) | (high & mask);
}

struct GumbelTables {
  float lo[kLowBuckets + kHighBuckets];
  float hi[kLowBuckets + kHighBuckets];

  static float widen(float g, float dir) { return g + dir * 1e-6f * (1.0f + std::fabs(g)); }

  GumbelTables() {
    for (int b = 0; b < kLowBuckets; ++b) {
      const uint32_t h0 = static_cast<uint32_t>(b) << 20;
      const uint32_t h1 = h0 + ((1u << 20) - 1u);
      lo[b] = widen(gumbel_exact(h0), -1.f);
      hi[b] = widen(gumbel_exact(h1), +1.f);
    }
    // High half: bucket k holds c in [first(k), first(k + 1)), g decreasing in c.
    auto first = [](int k) -> uint64_t {  // smallest c < 2^31 with high_bucket(c) >= k
      uint64_t lo_c = 0, hi_c = 0x80000000ull;
      while (lo_c < hi_c) {
        const uint64_t mid = (lo_c + hi_c) / 2;
        if (high_bucket(static_cast<uint32_t>(mid)) >= k) hi_c = mid; else lo_c = mid + 1;
      }
      return lo_c;
    };
    uint64_t c0 = first(0);
    for (int k = 0; k < kHighBuckets; ++k) {
      const uint64_t c1 = first(k + 1);
      if (c1 > c0) {
        hi[kLowBuckets + k] = widen(gumbel_exact(~static_cast<uint32_t>(c0)), +1.f);
        lo[kLowBuckets + k] = widen(gumbel_exact(~static_cast<uint32_t>(c1 - 1)), -1.f);
      } else {  // empty bucket, never read
        hi[kLowBuckets + k] = std::numeric_limits<float>::infinity();
        lo[kLowBuckets + k] = -std::numeric_limits<float>::infinity();
      }
      c0 = c1;
    }
  }

  inline int bucket(uint32_t h) const { return bucket_of(h); }
};

inline const GumbelTables& gumbel_tables() {
  static const GumbelTables tables;
  return tables;
}

}  // namespace dspark
