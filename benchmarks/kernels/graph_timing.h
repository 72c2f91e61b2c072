// What the timing harnesses in this directory share: bf16 test data, reading
// results back, and the median time of a launch sequence captured in a CUDA
// graph.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <cuda_bf16.h>

#include "cuda_check.h"

// p[i] = offset + a value in [-1, 1] hashed from i and seed.
__global__ void fill(__nv_bfloat16* p, int64_t n, uint32_t seed, float offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed * 40503u;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = __float2bfloat16(offset + (h % 20001) / 10000.0f - 1.0f);
  }
}

// n values from the device, bf16 (is_bf16) or float32, as float32.
inline std::vector<float> to_host(const void* p, size_t n, bool is_bf16) {
  std::vector<float> out(n);
  if (is_bf16) {
    std::vector<__nv_bfloat16> h(n);
    CHECK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) out[i] = __bfloat162float(h[i]);
  } else {
    CHECK(cudaMemcpy(out.data(), p, n * 4, cudaMemcpyDeviceToHost));
  }
  return out;
}

// Median over `reps` of the time per call of `calls` launches in a graph
// (µs). PROBE=1 in the environment: three plain launches instead, for a
// profiler, and 1 returned.
template <typename F>
float time_us(cudaStream_t s, F launch, int calls = 20, int reps = 7) {
  if (std::getenv("PROBE")) {
    for (int i = 0; i < 3; ++i) launch();
    CHECK(cudaStreamSynchronize(s));
    return 1.0f;
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) launch();
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<float> ms;
  CHECK(cudaGraphLaunch(exec, s));
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(t0, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(t1, s));
    CHECK(cudaEventSynchronize(t1));
    float m;
    CHECK(cudaEventElapsedTime(&m, t0, t1));
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return ms[ms.size() / 2] * 1e3f / calls;
}
