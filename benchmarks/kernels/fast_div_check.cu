// FastDiv (cpp/cuda/common.cuh) against the `/` operator, on the host (the
// device's __umulhi path computes the same product): every divisor below
// 5000, 2000 random ones up to 2^31 and the powers of two with their
// neighbours; for each, n from 0 to 2999, 3000 random n below 2^31, the
// multiples of d and one below them, and 2^31 - 1. Prints the mismatches.
//
//   nvcc -std=c++17 -O2 -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/fast_div_check.cu -o fast_div_check && ./fast_div_check
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/common.cuh"
using jaxnorm::cuda::FastDiv;

int main() {
  std::mt19937_64 rng(1);
  constexpr uint32_t kLimit = 1u << 31;  // FastDiv's range: n < 2^31, 1 <= d <= 2^31
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d < 5000; ++d) divisors.push_back(d);
  for (int i = 0; i < 2000; ++i) divisors.push_back(uint32_t(rng() % kLimit) + 1);
  for (int k = 1; k <= 31; ++k) {
    for (uint32_t d : {(1u << k) - 1, 1u << k, (1u << k) + 1}) {
      if (d <= kLimit) divisors.push_back(d);
    }
  }
  long checks = 0, bad = 0;
  for (uint32_t d : divisors) {
    const FastDiv f(d);
    auto check = [&](uint32_t n) {
      ++checks;
      if (f.div(n) != n / d && bad++ < 10) std::printf("mismatch: %u / %u\n", n, d);
    };
    for (uint32_t n = 0; n < 3000; ++n) check(n);
    for (int i = 0; i < 3000; ++i) check(uint32_t(rng() % kLimit));
    for (uint64_t m = 1; m < 50 && m * d < kLimit; ++m) {
      check(uint32_t(m * d));
      check(uint32_t(m * d - 1));
    }
    check(kLimit - 1);
  }
  std::printf("%ld divisions checked, %ld mismatches\n", checks, bad);
  return bad == 0 ? 0 : 1;
}
