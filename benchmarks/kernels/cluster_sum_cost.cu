// What the backward's cluster exchange costs a row by itself: clusters of
// PARTS blocks of 256 threads (one an SM, as LayerNorm's held split) sum each
// warp's four totals over the cluster (ClusterSum::warps, as bwd_regs does)
// row after row, every resident cluster at once. Between exchanges each
// thread runs a dependent chain of WORK float32 FMAs a row (WORK=0: the
// exchange alone). Prints the time a row a cluster takes, for 2, 3, 4 and 8
// blocks a cluster (PARTS=2,8 picks), and checks the sums (small integers).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/cluster_sum_cost.cu -o cluster_sum_cost
//   WORK=0,512 ./cluster_sum_cost
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/common.cuh"
#include "graph_timing.h"
using namespace jaxnorm::cuda;

constexpr int kThreads = 256;
using Sum = ClusterSum<float, 4, kThreads / 32>;  // (a slot a warp)

__global__ void __launch_bounds__(kThreads, 1)
    exchange_rows(float* out, int rows, int parts, int work) {
  __shared__ __align__(16) Sum::Shared cluster_shared;
  Sum cluster_sum(cluster_shared);
  cluster_sum.init();
  const int cluster = blockIdx.x / parts, clusters = gridDim.x / parts;
  float carry = 0;
  for (int r = cluster; r < rows; r += clusters) {
    // The row's own work, fed by the last row's sums (as the next row's
    // first pass follows the last one's dx).
    float w = carry * 1e-30f + 1.0f;
    for (int i = 0; i < work; ++i) w = fmaf(w, 0.999f, 1e-3f);
    float v[4];
    for (int k = 0; k < 4; ++k) v[k] = float((r + k) % 3) + (w < 0 ? 1.0f : 0.0f);
    warp_sum(v);
    cluster_sum.warps(v, parts);
    carry = v[0];
    if (threadIdx.x == 0 && blockIdx.x % parts == 0) out[r] = v[0] + v[1] + v[2] + v[3];
  }
}

int main() {
  std::vector<int> all_parts = {2, 3, 4, 8}, works = {0, 512};
  auto list = [](const char* name, std::vector<int>& into) {
    if (const char* t = std::getenv(name)) {
      into.clear();
      for (const char* p = t; *p;) {
        into.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p) ++p;
      }
    }
  };
  list("PARTS", all_parts);
  list("WORK", works);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  const int rows = 4096;
  float* out;
  CHECK(cudaMalloc(&out, sizeof(float) * rows));
  int bad = 0;
  std::printf("%5s %5s %8s %9s %11s\n", "parts", "work", "clusters", "us", "us a row");
  for (int parts : all_parts) {
    cudaLaunchAttribute attr;
    // Dynamic shared memory (unused) that leaves one block an SM, as the held
    // split's ring does.
    const size_t smem = 120 * 1024;
    CHECK(cudaFuncSetAttribute(exchange_rows, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(smem)));
    const cudaLaunchConfig_t config =
        cluster_config(unsigned(parts), kThreads, smem, parts, s, attr);
    int clusters = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&clusters, exchange_rows, &config));
    for (int work : works) {
      const unsigned grid = unsigned(clusters * parts);
      const float us = time_us(s, [&] {
        CHECK(launch_clusters(exchange_rows, grid, kThreads, smem, parts, s, out, rows, parts, work));
      });
      std::vector<float> h(rows);
      CHECK(cudaMemcpy(h.data(), out, sizeof(float) * rows, cudaMemcpyDeviceToHost));
      for (int r = 0; r < rows; ++r) {
        float want = 0;
        for (int k = 0; k < 4; ++k) want += float((r + k) % 3) * kThreads * parts;
        bad += h[r] != want;
      }
      const int per_cluster = (rows + clusters - 1) / clusters;
      std::printf("%5d %5d %8d %9.1f %11.3f\n", parts, work, clusters, us, us / per_cluster);
    }
  }
  std::printf("%d mismatches\n", bad);
  return bad != 0;
}
