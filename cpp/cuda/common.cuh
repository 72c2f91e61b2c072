// Device-side building blocks shared by the CUDA kernels: the DataType -> CUDA
// type map, packed 16-byte vectors, conversions, row reductions and the launch
// error check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "common/ffi_util.h"

namespace jaxnorm::cuda {

template <DataType T> struct Native;
template <> struct Native<DataType::F32> { using type = float; };
template <> struct Native<DataType::F64> { using type = double; };
template <> struct Native<DataType::BF16> { using type = __nv_bfloat16; };
template <> struct Native<DataType::F16> { using type = __half; };
template <typename D> using native_t = typename Native<D::value>::type;

// Accumulation type: double for double, float for everything else.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <typename T, typename A>
__device__ __forceinline__ T from_acc(A v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return T(v);
}

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return 1.0 / sqrt(v); }

// N elements of T with the alignment of one wide access (at most 16 bytes), so
// that a load or store of it compiles to LDG.128/STG.128 (two for 32 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Packed {
  T v[N];
};

template <int N, typename A, typename T>
__device__ __forceinline__ void load_vec(A (&out)[N], const T* p) {
  Packed<T, N> pk = *reinterpret_cast<const Packed<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_acc(pk.v[i]);
}

template <int N, typename T, typename A>
__device__ __forceinline__ void store_vec(T* p, const A (&in)[N]) {
  Packed<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_acc<T>(in[i]);
  *reinterpret_cast<Packed<T, N>*>(p) = pk;
}

// Sums K values over the `tpr` consecutive threads that share a row. tpr is a
// power of two up to 32, or a multiple of 32; `smem` holds K values per warp of
// the block. Every thread of the block must call it (it may synchronize), and
// every thread gets the row's totals, summed in a fixed order.
template <int K, typename A>
__device__ __forceinline__ void row_sum(A (&v)[K], int tpr, A* smem) {
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int off = width / 2; off > 0; off /= 2) {
      v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
    }
  }
  if (tpr <= 32) return;
  const int warp = threadIdx.x / 32;
  const int warps_per_row = tpr / 32;
  const int first = warp - warp % warps_per_row;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) smem[warp * K + k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    A s = 0;
    for (int w = 0; w < warps_per_row; ++w) s += smem[(first + w) * K + k];
    v[k] = s;
  }
  __syncthreads();  // the next call may overwrite smem
}

inline ffi::Error last_launch_error(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxnorm: launching ") + what +
                              " failed: " + cudaGetErrorString(err));
}

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

inline int multiprocessor_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) !=
      cudaSuccess) {
    cudaGetLastError();  // clear it; fall back to a guess
    n = 132;
  }
  return n;
}

}  // namespace jaxnorm::cuda
