// What the timing harnesses in this directory share: bf16 test data, reading
// results back, and the median time of a launch sequence captured in a CUDA
// graph.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <cstdio>
#include <ctime>
#include <string>

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

// Reads n vectors, 8 a thread in flight, and writes nothing unless their sum
// is an impossible value: the read-only ceiling.
__global__ void read_only(const uint4* in, int64_t n, uint4* sink) {
  uint32_t acc = 0;
  for (int64_t base = (blockIdx.x * int64_t(blockDim.x)) * 8 + threadIdx.x; base < n;
       base += int64_t(gridDim.x) * blockDim.x * 8) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = base + int64_t(k) * blockDim.x;
      v[k] = i < n ? in[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x7fc0ffeeu) sink[0] = make_uint4(acc, acc, acc, acc);
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

// Today's date (UTC), YYYY-MM-DD, for a harness's output.
inline std::string utc_date() {
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  return date;
}

// Lines of channels-last x for the along-channel harnesses: `lines` lines of
// c channels.
struct LineCase {
  int64_t lines;
  int c;
  const char* name;
};

// The largest |got - want| over the values added, relative to the largest
// |want|.
struct RelativeError {
  double err = 0, peak = 0;
  void add(double got, double want) {
    err = std::fmax(err, std::fabs(got - want));
    peak = std::fmax(peak, std::fabs(want));
  }
  double value() const { return err / peak; }
};

// One LineCase's bf16 x and dy (filled), an output and a copy's target on the
// device; the copy bandwidth of x there (GB/s, read + write; printed with the
// device's name); x and dy on the host.
struct LineData {
  int64_t n;
  __nv_bfloat16 *x, *dy, *out, *copy_to;
  float copy;
  std::vector<float> hx, hdy;

  LineData(cudaStream_t s, const cudaDeviceProp& prop, const LineCase& k) : n(k.lines * k.c) {
    for (__nv_bfloat16** q : {&x, &dy, &out, &copy_to}) CHECK(cudaMalloc(q, n * 2));
    fill<<<1024, 256, 0, s>>>(x, n, 1, 0.0f);
    fill<<<1024, 256, 0, s>>>(dy, n, 2, 0.0f);
    const float us = time_us(s, [&] {
      CHECK(cudaMemcpyAsync(copy_to, x, n * 2, cudaMemcpyDeviceToDevice, s));
    });
    copy = 2.0f * n * 2 / us / 1e3f;
    std::printf("device %s, %d SMs, %s: copy %.0f GB/s (%.1f us)\n", prop.name,
                prop.multiProcessorCount, k.name, copy, us);
    hx = to_host(x, n, true), hdy = to_host(dy, n, true);
  }
  ~LineData() {
    for (__nv_bfloat16* q : {x, dy, out, copy_to}) cudaFree(q);
  }
};
