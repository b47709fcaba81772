// Host-side checks of the per-element math shared by the CPU twin and the
// CUDA kernels (csrc/markov_common.h) and of the CPU Gumbel tables
// (csrc/markov_cpu_gumbel_table.h). Built and run by
// tests/ops/test_markov_common_math.py with the host C++ compiler; no torch.
//
// Usage: check_markov_math <mode>
//   bounds : gumbel_bounds (CUDA's fp32 bounds) and the CPU tables enclose
//            gumbel_exact on boundary hashes and a stride over all 2^32;
//            prints "ok <checked> <max_width_cuda> <max_width_table_mid>"
//   hashes : prints "seed position j hash gumbel_exact_bits" lines for Python
//            to compare with vllm_dspark.ops.markov_reference
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <vector>

#include "markov_common.h"
#include "markov_cpu_gumbel_table.h"

using namespace dspark;

static uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

static int check_bounds() {
  const GumbelTables& tab = gumbel_tables();
  std::vector<uint32_t> hs;
  for (uint32_t h = 0; h < 4096; ++h) hs.push_back(h);
  for (uint32_t c = 0; c < 4096; ++c) hs.push_back(~c);
  for (int s = 0; s < 32; ++s) {  // around every power of two, from both ends
    for (int d = -3; d <= 3; ++d) {
      hs.push_back((1u << s) + static_cast<uint32_t>(d));
      hs.push_back(~((1u << s) + static_cast<uint32_t>(d)));
    }
  }
  for (int b = 0; b < kLowBuckets; ++b) {  // low-table bucket edges
    for (int d = -2; d <= 2; ++d) hs.push_back((static_cast<uint32_t>(b) << 20) + d);
  }
  for (uint64_t h = 0; h < (1ull << 32); h += 1021) hs.push_back(static_cast<uint32_t>(h));

  double max_w_cuda = 0, max_w_table = 0;
  for (uint32_t h : hs) {
    const float g = gumbel_exact(h);
    float lo, hi;
    gumbel_bounds(h, &lo, &hi);
    if (!(lo <= g && g <= hi)) {
      std::printf("FAIL cuda-bounds h=%u g=%.9g lo=%.9g hi=%.9g\n", h, g, lo, hi);
      return 1;
    }
    if (hi - lo > max_w_cuda) max_w_cuda = hi - lo;
    const int k = tab.bucket(h);
    if (k < 0 || k >= kLowBuckets + kHighBuckets) {
      std::printf("FAIL bucket h=%u k=%d\n", h, k);
      return 1;
    }
    if (!(tab.lo[k] <= g && g <= tab.hi[k])) {
      std::printf("FAIL table h=%u k=%d g=%.9g lo=%.9g hi=%.9g\n", h, k, g, tab.lo[k], tab.hi[k]);
      return 1;
    }
    // Width in the body of the distribution (u in [0.01, 0.99]): pruning power.
    const double u = (static_cast<double>(h) + 0.5) / 4294967296.0;
    if (u > 0.01 && u < 0.99 && tab.hi[k] - tab.lo[k] > max_w_table) {
      max_w_table = tab.hi[k] - tab.lo[k];
    }
  }
  std::printf("ok %zu %.3g %.3g\n", hs.size(), max_w_cuda, max_w_table);
  return 0;
}

static int print_hashes() {
  const int64_t seeds[] = {0, 1, -1, 123456789012345LL, -987654321098765LL, INT64_MAX, INT64_MIN};
  for (int64_t seed : seeds) {
    for (int pos = 0; pos < 8; pos += 3) {
      const uint32_t key = row_key(seed, pos);
      for (uint32_t j : {0u, 1u, 2u, 110u, 65535u, 163839u}) {
        const uint32_t h = token_hash(key, j);
        std::printf("%" PRId64 " %d %u %u %u\n", seed, pos, j, h, float_bits(gumbel_exact(h)));
      }
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "bounds") == 0) return check_bounds();
  if (argc == 2 && std::strcmp(argv[1], "hashes") == 0) return print_hashes();
  std::fprintf(stderr, "usage: %s bounds|hashes\n", argv[0]);
  return 2;
}
