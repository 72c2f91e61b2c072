// What a launch shaped as GroupNorm's cluster forward costs with nothing in
// it: 128 blocks of 512 threads that do no work, timed per call in CUDA
// graphs of 20 (graph_timing.h), adding one at a time what the forward's
// launch asks for: 190 KB of dynamic shared memory a block, clusters of 2
// or 16 blocks, the cooperative attribute, and a cluster barrier at the end
// (the forward's last step). The difference between the forward's time per
// call and its blocks' span (its phase stamps) is what this bounds.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/launch_cost.cu -o launch_cost && ./launch_cost
#include <cstdio>

#include "cuda/common.cuh"
#include "graph_timing.h"

using namespace jaxnorm::cuda;

// Nothing but a store no launch skips; with kClusterBarrier, the cluster
// barrier the forward ends with.
template <bool kClusterBarrier>
__global__ void __launch_bounds__(512, 1) empty(unsigned* sink) {
  if constexpr (kClusterBarrier) {
    cluster_arrive_relaxed();
    cluster_wait();
  }
  if (threadIdx.x == 0 && blockIdx.x == 0) sink[0] = 1;
}

struct Shape {
  const char* name;
  size_t smem;
  int cluster;
  bool cooperative, barrier;
};

int main() {
  constexpr unsigned kBlocks = 128;
  constexpr size_t kSmem = 190 << 10;
  const Shape shapes[] = {
      {"plain", 0, 1, false, false},
      {"190 KB", kSmem, 1, false, false},
      {"190 KB, clusters of 2", kSmem, 2, false, false},
      {"190 KB, clusters of 16", kSmem, 16, false, false},
      {"190 KB, clusters of 2, cooperative", kSmem, 2, true, false},
      {"190 KB, clusters of 16, cooperative", kSmem, 16, true, false},
      {"190 KB, clusters of 16, cooperative, cluster barrier", kSmem, 16, true, true},
      {"190 KB, clusters of 2, cooperative, cluster barrier", kSmem, 2, true, true},
  };
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %s. µs a call (median of 7 graphs of 20 calls), %u blocks of 512 "
              "threads, no work\n", prop.name, utc_date().c_str(), kBlocks);
  unsigned* sink;
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  for (auto kernel : {empty<false>, empty<true>}) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    CHECK(allow_cluster_size(kernel, 16));
  }
  for (const Shape& sh : shapes) {
    auto kernel = sh.barrier ? empty<true> : empty<false>;
    auto launch = [&] {
      cudaLaunchAttribute attrs[2];
      cudaLaunchConfig_t config = cluster_config(kBlocks, 512, sh.smem, sh.cluster, s, attrs[0]);
      if (sh.cooperative) {
        attrs[1].id = cudaLaunchAttributeCooperative;
        attrs[1].val.cooperative = 1;
        config.numAttrs = 2;
      }
      CHECK(cudaLaunchKernelEx(&config, kernel, sink));
    };
    launch();
    CHECK(cudaStreamSynchronize(s));
    std::printf("%-55s %6.2f\n", sh.name, time_us(s, launch));
  }
  return 0;
}
