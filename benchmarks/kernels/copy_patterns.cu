// How fast x (rows, 1024) bf16 can be read and written back in the ways a
// forward over short rows could take it, with no arithmetic: a row a warp in
// blocks of one warp (fwd_block's pattern at 4 vectors a thread), in blocks
// of several warps, in a persistent grid (a warp a row at a time, or two rows
// in flight), with streaming cache hints, against cudaMemcpyAsync. The
// question (notes v88): whether any pattern of a warp a row reaches the rate
// of torch.compile's RMSNorm at 65536x1024 (4.2 TB/s on an H200, against
// fwd_block's 4.09 and copy8's 4.08).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icpp benchmarks/kernels/copy_patterns.cu
#include <cstdio>

#include "graph_timing.h"

constexpr int kVecs = 4;  // 16-byte vectors a lane: 1024 bf16 a warp

template <bool kHints>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  if constexpr (kHints) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else {
    return *p;
  }
}
template <bool kHints>
__device__ __forceinline__ void store16(uint4* p, uint4 v) {
  if constexpr (kHints) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
  } else {
    *p = v;
  }
}

// Row `row` of 128 vectors by one warp: kVecs loads a lane, then the stores.
template <bool kHints>
__device__ __forceinline__ void copy_row(const uint4* x, uint4* y, int64_t row, int lane) {
  const uint4* src = x + row * (32 * kVecs) + lane;
  uint4* dst = y + row * (32 * kVecs) + lane;
  uint4 v[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) v[k] = load16<kHints>(src + 32 * k);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) store16<kHints>(dst + 32 * k, v[k]);
}

// A warp a row, blockDim.x / 32 rows a block.
template <bool kHints>
__global__ void rows_in_blocks(const uint4* x, uint4* y, int64_t rows) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row < rows) copy_row<kHints>(x, y, row, threadIdx.x % 32);
}

// A persistent grid: each warp takes rows warp, warp + warps, ...; kAhead
// rows' loads in flight a warp.
template <bool kHints, int kAhead>
__global__ void rows_persistent(const uint4* x, uint4* y, int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += warps * kAhead) {
    uint4 v[kAhead][kVecs];
#pragma unroll
    for (int a = 0; a < kAhead; ++a) {
      const int64_t r = row + a * warps;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        if (r < rows) v[a][k] = load16<kHints>(x + r * (32 * kVecs) + lane + 32 * k);
      }
    }
#pragma unroll
    for (int a = 0; a < kAhead; ++a) {
      const int64_t r = row + a * warps;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        if (r < rows) store16<kHints>(y + r * (32 * kVecs) + lane + 32 * k, v[a][k]);
      }
    }
  }
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs, %s; x (rows, 1024) bf16 read and written; µs a call (median of 7 "
              "graphs of 20 calls), GB/s counting both\n",
              prop.name, sms, utc_date().c_str());
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  {
    const int64_t rows = 65536;
    const int64_t n = rows * 1024;
    const size_t bytes = size_t(n) * 2;
    __nv_bfloat16 *x, *y;
    CHECK(cudaMalloc(&x, bytes));
    CHECK(cudaMalloc(&y, bytes));
    fill<<<sms * 8, 256, 0, s>>>(x, n, 7u, 1.0f);
    const auto* xv = reinterpret_cast<const uint4*>(x);
    auto* yv = reinterpret_cast<uint4*>(y);
    auto report = [&](const char* name, float us) {
      std::printf("%-40s %8.1f us %7.0f GB/s\n", name, us, 2.0 * bytes / (us * 1e3));
    };
    report("cudaMemcpyAsync", time_us(s, [&] {
             CHECK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, s));
           }));
    for (int warps : {1, 2, 4, 8}) {
      char name[64];
      const unsigned grid = unsigned((rows + warps - 1) / warps);
      const unsigned threads = 32u * unsigned(warps);
      std::snprintf(name, sizeof name, "blocks of %d warps", warps);
      report(name,
             time_us(s, [&] { rows_in_blocks<false><<<grid, threads, 0, s>>>(xv, yv, rows); }));
      std::snprintf(name, sizeof name, "blocks of %d warps, hints", warps);
      report(name,
             time_us(s, [&] { rows_in_blocks<true><<<grid, threads, 0, s>>>(xv, yv, rows); }));
    }
    {  // 8 blocks of 256 threads an SM: every warp resident at once
      const unsigned grid = unsigned(sms * 8);
      report("persistent 8 x 256, 1 row",
             time_us(s, [&] { rows_persistent<false, 1><<<grid, 256, 0, s>>>(xv, yv, rows); }));
      report("persistent 8 x 256, 2 rows",
             time_us(s, [&] { rows_persistent<false, 2><<<grid, 256, 0, s>>>(xv, yv, rows); }));
      report("persistent 8 x 256, 2 rows, hints",
             time_us(s, [&] { rows_persistent<true, 2><<<grid, 256, 0, s>>>(xv, yv, rows); }));
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
  }
  return 0;
}
