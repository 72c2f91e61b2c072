// The forward with a cluster of blocks a row (fwd_cluster in
// cpp/cuda/row_norm_block.cuh) alone, launched `launches` times in a row and
// y checked against a float64 host reference: a small target for
// compute-sanitizer (sm_90). Racecheck needs a second block on an SM after
// the first to see what benchmarks/NOTES.md (v27) describes: several
// launches, or more rows than a launch's blocks fill the SMs with.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/cluster_fwd_check.cu -o cluster_fwd_check
//   compute-sanitizer --tool racecheck ./cluster_fwd_check f32 300 20000 4 rms 3
//
// Arguments: f32 or bf16, rows, hidden, blocks a row (2 or 4), rms, ln or
// add_rms (RMSNorm with the residual add), launches.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/row_norm_block.cuh"
#include "cuda_check.h"

using namespace jaxnorm::cuda;
using bf16 = __nv_bfloat16;

float hashed(int64_t i, uint32_t seed) {  // in [-0.75, 1.25)
  uint32_t h = uint32_t(i) * 2654435761u ^ seed * 40503u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return 0.25f + (h % 20001) / 10000.0f - 1.0f;
}

template <typename T>
T* device_copy(const std::vector<T>& h) {
  T* d;
  CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename X, bool kCentered, int kParts>
int run(int64_t rows, int64_t hidden, bool residual, int launches) {
  constexpr int VEC = 16 / sizeof(X);
  const int64_t n = rows * hidden;
  std::vector<X> x(n), res(n), w(hidden), b(hidden);
  for (int64_t i = 0; i < n; ++i) x[i] = X(hashed(i, 1)), res[i] = X(hashed(i, 2));
  for (int64_t i = 0; i < hidden; ++i) w[i] = X(hashed(i, 3)), b[i] = X(hashed(i, 4));
  FwdArgs a{};
  a.x = device_copy(x);
  a.scale = device_copy(w);
  a.bias = device_copy(b);
  X* y = device_copy(std::vector<X>(n));
  a.y = y;
  a.mean = device_copy(std::vector<float>(rows));
  a.rstd = device_copy(std::vector<float>(rows));
  a.rows = rows;
  a.hidden = hidden;
  a.epsilon = 1e-6;
  a.centered = kCentered;
  a.has_scale = true;
  a.has_bias = kCentered;
  a.write_y = true;
  if (residual) {
    a.residual = device_copy(res);
    a.new_residual = device_copy(std::vector<X>(n));
  }
  const DeviceInfo dev = query_device(0);
  for (int k = 0; k < launches; ++k) {
    CHECK(launch_fwd_cluster<X, X, X, VEC, kCentered, kParts>(nullptr, dev, a));
  }
  std::vector<X> got(n);
  CHECK(cudaMemcpy(got.data(), y, n * sizeof(X), cudaMemcpyDeviceToHost));
  double worst = 0;  // largest |y - y_ref| / (1 + |y_ref|)
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> h(hidden);
    double sum = 0, sq = 0;
    for (int64_t c = 0; c < hidden; ++c) {
      const int64_t i = r * hidden + c;
      h[c] = double(float(x[i])) + (residual ? double(float(res[i])) : 0.0);
      sum += h[c];
    }
    const double mean = kCentered ? sum / hidden : 0.0;
    for (double v : h) sq += (v - mean) * (v - mean);
    const double rstd = 1 / std::sqrt(sq / hidden + 1e-6);
    for (int64_t c = 0; c < hidden; ++c) {
      double want = (h[c] - mean) * rstd * double(float(w[c]));
      if (kCentered) want += double(float(b[c]));
      const double d = std::abs(double(float(got[r * hidden + c])) - want) / (1 + std::abs(want));
      worst = std::max(worst, d);
    }
  }
  const double tol = sizeof(X) == 4 ? 1e-5 : 1e-2;
  std::printf("%s %lldx%lld, clusters of %d, %s, %d launches: largest error %.1e (%s)\n",
              sizeof(X) == 4 ? "f32" : "bf16", (long long)rows, (long long)hidden, kParts,
              residual ? "add_rms" : kCentered ? "ln" : "rms", launches, worst,
              worst <= tol ? "ok" : "too large");
  return worst <= tol ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s f32|bf16 rows hidden 2|4 rms|ln|add_rms launches\n", argv[0]);
    return 2;
  }
  const bool f32 = !std::strcmp(argv[1], "f32");
  const int64_t rows = std::atoll(argv[2]), hidden = std::atoll(argv[3]);
  const int parts = std::atoi(argv[4]), launches = std::atoi(argv[6]);
  const bool ln = !std::strcmp(argv[5], "ln"), residual = !std::strcmp(argv[5], "add_rms");
  auto with_type = [&](auto x, auto centered, auto parts_c) {
    using X = decltype(x);
    return run<X, decltype(centered)::value, decltype(parts_c)::value>(rows, hidden, residual,
                                                                       launches);
  };
  auto with_parts = [&](auto x, auto centered) {
    return parts == 2 ? with_type(x, centered, std::integral_constant<int, 2>{})
                      : with_type(x, centered, std::integral_constant<int, 4>{});
  };
  auto with_op = [&](auto x) {
    return ln ? with_parts(x, std::true_type{}) : with_parts(x, std::false_type{});
  };
  return f32 ? with_op(float{}) : with_op(bf16{});
}
