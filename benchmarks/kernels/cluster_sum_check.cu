// ClusterSum (cpp/cuda/common.cuh) alone: clusters of 2, 4 and 8 blocks sum
// per-block totals row after row, as the backward's cluster split does, and
// every block's sums are checked exactly (small integers). A small target for
// compute-sanitizer (sm_90):
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/cluster_sum_check.cu -o cluster_sum_check
//   compute-sanitizer --tool racecheck ./cluster_sum_check
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cuda/common.cuh"
using namespace jaxnorm::cuda;

__global__ void sum_rows_over_clusters(float* out, int rows, int parts) {
  __shared__ __align__(16) float smem[2 * 32 * 4];
  __shared__ __align__(16) ClusterSum<float, 4>::Shared cluster_shared;
  RowSumTurns<float, 4> row_sums{smem, int(blockDim.x)};
  ClusterSum<float, 4> cluster_sum(cluster_shared);
  cluster_sum.init();
  const int cluster = blockIdx.x / parts, rank = blockIdx.x % parts;
  const int clusters = gridDim.x / parts;
  for (int r = cluster; r < rows; r += clusters) {
    float v[4];
    for (int k = 0; k < 4; ++k) v[k] = float((r * 7 + rank * 3 + k + threadIdx.x) % 5);
    row_sums(v, blockDim.x);
    cluster_sum(v, parts);
    if (threadIdx.x == 0) {
      for (int k = 0; k < 4; ++k) out[(int64_t(r) * parts + rank) * 4 + k] = v[k];
    }
  }
}

int main() {
  int bad = 0;
  for (int parts : {2, 4, 8}) {
    const int rows = 200, threads = 128, grid = 8 * parts;
    float* out;
    cudaMalloc(&out, sizeof(float) * rows * parts * 4);
    const cudaError_t e = launch_clusters(sum_rows_over_clusters, grid, threads, 0, parts,
                                          nullptr, out, rows, parts);
    const cudaError_t s = cudaDeviceSynchronize();
    std::vector<float> h(rows * parts * 4);
    cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost);
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < 4; ++k) {
        double want = 0;
        for (int q = 0; q < parts; ++q) {
          for (int t = 0; t < threads; ++t) want += (r * 7 + q * 3 + k + t) % 5;
        }
        for (int q = 0; q < parts; ++q) bad += h[(r * parts + q) * 4 + k] != float(want);
      }
    }
    std::printf("parts %d: launch %s, sync %s\n", parts, cudaGetErrorString(e),
                cudaGetErrorString(s));
    cudaFree(out);
  }
  std::printf("%d mismatches\n", bad);
  return bad != 0;
}
