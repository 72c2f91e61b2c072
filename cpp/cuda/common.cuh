// Device-side building blocks shared by the CUDA kernels: the DataType -> CUDA
// type map, packed 16-byte vectors, conversions, row reductions and the launch
// error check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <limits>

#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "common/ffi_util.h"

namespace jaxnorm::cuda {

template <DataType T> struct Native;
template <> struct Native<DataType::F32> { using type = float; };
template <> struct Native<DataType::F64> { using type = double; };
template <> struct Native<DataType::BF16> { using type = __nv_bfloat16; };
template <> struct Native<DataType::F16> { using type = __half; };
template <typename D> using native_t = typename Native<D::value>::type;

// The DataType of a native type: native_t's inverse.
template <typename T>
constexpr DataType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DataType::F32;
  else if constexpr (std::is_same_v<T, double>) return DataType::F64;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return DataType::BF16;
  else return DataType::F16;
}

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

// N elements of T with the alignment of one wide access (at most 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Packed {
  T v[N];
};

// A global access's last use of its data (kLastUse): loaded or stored with
// .cs, evict-first in L1 and L2, so that it does not push out of L2 what a
// later pass reads again (the channel norms' second pass over x, notes v47).
template <bool kLastUse, typename V>
__device__ __forceinline__ V load_global(const V* p) {
  if constexpr (kLastUse) return __ldcs(p);
  else return *p;
}

// Loads kWords 32-bit words as the widest native vector accesses (uint4,
// uint2) that p's alignment (that of kWords words, up to 16 bytes) allows.
template <int kWords, bool kLastUse = false>
__device__ __forceinline__ void load_words(uint32_t (&w)[kWords], const void* p) {
  if constexpr (kWords % 4 == 0) {
#pragma unroll
    for (int k = 0; k < kWords / 4; ++k) {
      const uint4 u = load_global<kLastUse>(static_cast<const uint4*>(p) + k);
      w[4 * k] = u.x, w[4 * k + 1] = u.y, w[4 * k + 2] = u.z, w[4 * k + 3] = u.w;
    }
  } else if constexpr (kWords == 2) {
    const uint2 u = load_global<kLastUse>(static_cast<const uint2*>(p));
    w[0] = u.x, w[1] = u.y;
  } else {
    static_assert(kWords == 1);
    w[0] = load_global<kLastUse>(static_cast<const unsigned int*>(p));
  }
}

// Stores kWords 32-bit words to global memory, 16 (or 8) bytes at a time. In
// PTX because the compiler splits the wide stores of a long unrolled loop
// (past its first iterations) into 4- and 2-byte pieces: Nsight Compute then
// counted half of the forward's L2 store sectors as excess (the kernel time
// on an H100 did not change: L2 merged the pieces). Volatile, so these stores
// keep their order among themselves; the kernels never read back what they
// store this way.
template <int kWords, bool kLastUse = false>
__device__ __forceinline__ void store_global_words(void* ptr, const uint32_t (&w)[kWords]) {
  auto* p = reinterpret_cast<void*>(__cvta_generic_to_global(ptr));
  if constexpr (kWords % 4 == 0) {
#pragma unroll
    for (int k = 0; k < kWords / 4; ++k) {
      if constexpr (kLastUse) {
        asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n"
                     ::"l"(static_cast<uint4*>(p) + k), "r"(w[4 * k]), "r"(w[4 * k + 1]),
                     "r"(w[4 * k + 2]), "r"(w[4 * k + 3]));
      } else {
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n"
                     ::"l"(static_cast<uint4*>(p) + k), "r"(w[4 * k]), "r"(w[4 * k + 1]),
                     "r"(w[4 * k + 2]), "r"(w[4 * k + 3]));
      }
    }
  } else if constexpr (kWords == 2) {
    if constexpr (kLastUse) {
      asm volatile("st.global.cs.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(w[0]), "r"(w[1]));
    } else {
      asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(w[0]), "r"(w[1]));
    }
  } else {
    static_assert(kWords == 1);
    if constexpr (kLastUse) {
      asm volatile("st.global.cs.b32 [%0], %1;\n" ::"l"(p), "r"(w[0]));
    } else {
      asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(w[0]));
    }
  }
}

// N elements of T held in registers as raw 32-bit words: two bf16/f16 share a
// register (the compiler would give each 16-bit element a register of its own),
// so a row held in registers costs its size in the input dtype. Converted to
// the accumulation type at each use.
template <typename T, int N, bool kPacked = (N * sizeof(T)) % 4 == 0>
struct RegVec {
  static constexpr int kWords = int(N * sizeof(T) / 4);
  uint32_t w[kWords];

  template <bool kLastUse = false>
  __device__ __forceinline__ void load(const T* p) { load_words<kWords, kLastUse>(w, p); }
  template <bool kLastUse = false>
  __device__ __forceinline__ void store_global(T* p) const {
    store_global_words<kWords, kLastUse>(p, w);
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = 0;  // +0.0 in every float format
  }
  // Rounds N accumulation-type values to T into the words.
  template <typename A>
  __device__ __forceinline__ void pack(const A (&in)[N]) {
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        w[k] = __bfloat16_as_ushort(from_acc<T>(in[2 * k])) |
               uint32_t(__bfloat16_as_ushort(from_acc<T>(in[2 * k + 1]))) << 16;
      } else if constexpr (std::is_same_v<T, __half>) {
        w[k] = __half_as_ushort(from_acc<T>(in[2 * k])) |
               uint32_t(__half_as_ushort(from_acc<T>(in[2 * k + 1]))) << 16;
      } else if constexpr (std::is_same_v<T, float>) {
        w[k] = __float_as_uint(float(in[k]));
      } else {
        const double d = double(in[k / 2]);
        w[k] = uint32_t(k % 2 ? __double2hiint(d) : __double2loint(d));
      }
    }
  }
  __device__ __forceinline__ void load_shared(const uint4* p) {
    if constexpr (kWords == 4) {
      const uint4 u = *p;
      w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    } else {
      const auto* q = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
      for (int k = 0; k < kWords; ++k) w[k] = q[k];
    }
  }
  // Tells the compiler the words may have changed, so that it converts them
  // at their next use rather than early, holding every converted value in
  // registers meanwhile (scale and bias loaded with x wait through the
  // reductions as packed words). No instruction.
  __device__ __forceinline__ void forget_converted() {
#pragma unroll
    for (int k = 0; k < kWords; ++k) asm volatile("" : "+r"(w[k]));
  }
  __device__ __forceinline__ acc_t<T> get(int e) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const uint32_t word = w[e / 2];
      return __uint_as_float(e % 2 ? word & 0xffff0000u : word << 16);
    } else if constexpr (std::is_same_v<T, __half>) {
      const uint32_t word = w[e / 2];
      return __half2float(__ushort_as_half((unsigned short)(e % 2 ? word >> 16 : word)));
    } else if constexpr (std::is_same_v<T, float>) {
      return __uint_as_float(w[e]);
    } else {
      return __hiloint2double(int(w[2 * e + 1]), int(w[2 * e]));
    }
  }
};

// Asks L2 for `bytes` (a multiple of 16) from p (16-byte aligned) with one
// instruction (sm_90; nothing before): a kernel that can only load them late,
// behind its stores, then waits on L2 rather than DRAM.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
#endif
}

// Asynchronous copies from global to shared memory that bypass registers
// (cp.async, sm_80+): a thread issues copies, closes them into a group with
// cp_async_commit(), and cp_async_wait<N>() waits until at most N of its groups
// are still in flight. A copy is visible to the thread that issued it after the
// wait, and to other threads after a barrier that follows it.
// The 32-bit shared-memory address of p (a generic pointer into it), as PTX's
// shared-memory instructions take it.
__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
  const uint32_t s = shared_addr(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem)
               : "memory");
#else
  *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
#endif
}

// Same, for one 4- or 8-byte value.
template <typename T>
__device__ __forceinline__ void cp_async_scalar(T* smem, const T* gmem) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8);
#if __CUDA_ARCH__ >= 800
  const uint32_t s = shared_addr(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem),
               "n"(int(sizeof(T)))
               : "memory");
#else
  *smem = *gmem;
#endif
}

// Copies kBytes (8, or a multiple of 16) from global to shared memory with
// cp.async; both addresses aligned to 16 bytes (8 for 8).
template <int kBytes>
__device__ __forceinline__ void cp_async_bytes(void* smem, const void* gmem) {
  if constexpr (kBytes == 8) {
    cp_async_scalar(static_cast<uint2*>(smem), static_cast<const uint2*>(gmem));
  } else {
    static_assert(kBytes % 16 == 0);
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) {
      cp_async16(static_cast<uint4*>(smem) + c, static_cast<const uint4*>(gmem) + c);
    }
  }
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// The order of a thread's cp.async copies through a ring of kStages stages:
// while it works on item g, items g + 1 ... g + kStages - 1 are in flight.
// Items are numbered first, first + stride, ...; issue(stage, g) starts the
// copies of item g into `stage` (nothing past the last item).
template <int kStages>
struct CpAsyncStages {
  // Starts the first kStages - 1 items.
  template <typename F>
  __device__ static void prime(F&& issue, int64_t first, int64_t stride) {
#pragma unroll
    for (int s = 0; s + 1 < kStages; ++s) {
      issue(s, first + s * stride);
      cp_async_commit();
    }
  }
  // Before the thread works on item g (in `stage`): starts the item
  // kStages - 1 ahead into the stage it read last, and waits for g's copies.
  template <typename F>
  __device__ static void advance(int stage, int64_t g, int64_t stride, F&& issue) {
    issue((stage + kStages - 1) % kStages, g + (kStages - 1) * stride);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
  }
};

// A single 16-bit element: nothing to pack.
template <typename T, int N>
struct RegVec<T, N, false> {
  T v[N];
  template <bool kLastUse = false>  // no cache hint on 2-byte accesses
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = p[k];
  }
  template <bool kLastUse = false>
  __device__ __forceinline__ void store_global(T* p) const {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = v[k];
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = from_acc<T>(0.0f);
  }
  template <typename A>
  __device__ __forceinline__ void pack(const A (&in)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = from_acc<T>(in[k]);
  }
  __device__ __forceinline__ void forget_converted() {}
  __device__ __forceinline__ acc_t<T> get(int e) const { return to_acc(v[e]); }
};

template <int N, typename A, typename T>
__device__ __forceinline__ void unpack(A (&out)[N], const RegVec<T, N>& r) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = r.get(i);
}

template <int N, typename A, typename T>
__device__ __forceinline__ void load_vec(A (&out)[N], const T* p) {
  // Not through load_words: loaded as words, the compiler hoists every
  // vector's parameter loads ahead of their use, which took the forward from
  // 64 to 85 registers (NV = 4) and cost a third of its speed at 384 threads
  // a block (8192x12288 on an H200).
  const Packed<T, N> pk = *reinterpret_cast<const Packed<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_acc(pk.v[i]);
}

// load_vec through load_words: the compiler then schedules the loads early,
// which made the backward's scale loads faster (bf16 16384x4096 on an H200:
// 116.3 against 127.4 µs) while it cost the forward its occupancy (load_vec).
template <int N, typename A, typename T>
__device__ __forceinline__ void load_vec_early(A (&out)[N], const T* p) {
  RegVec<T, N> r;
  r.load(p);
  unpack(out, r);
}

// Stores N values to global memory in T (kLastUse: evict-first, as load_global).
template <int N, bool kLastUse = false, typename T, typename A>
__device__ __forceinline__ void store_vec(T* p, const A (&in)[N]) {
  RegVec<T, N> r;
  r.pack(in);
  r.template store_global<kLastUse>(p);
}

// The first warp of the row that thread threadIdx.x works on, with `tpr`
// threads a row (a multiple of 32).
__device__ __forceinline__ int row_first_warp(int tpr) {
  const int warp = threadIdx.x / 32;
  return tpr >= 32 ? warp - warp % (tpr / 32) : warp;
}

// Division of n < 2^31 by a divisor d >= 1 fixed at launch, by a multiply-high
// and a shift (Granlund and Montgomery's method, the divisor's multiplier
// worked out on the host). A 64-bit division in a kernel is ~25 instructions
// and three long-latency conversions on its 32-bit fast path; a block's
// index math took six of them in turn before its first load (notes v77).
struct FastDiv {
  uint32_t d = 1, mul = 1, shift = 0;
  FastDiv() = default;
  __host__ explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((uint64_t(1) << shift) < d) ++shift;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  __host__ __device__ uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = uint32_t((uint64_t(n) * mul) >> 32);
#endif
    return (hi + n) >> shift;  // hi <= n < 2^31: no overflow
  }
};

// Sums K values over a warp with an xor butterfly, which leaves the same bits
// in every lane (each adds the same two halves, a + b = b + a).
template <int K, typename A>
__device__ __forceinline__ void warp_sum(A (&v)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
  }
}

// Sums K values over the `tpr` consecutive threads that share a row. tpr is a
// power of two up to 32, or a multiple of 32; `smem` holds K values per warp of
// the block (16-byte aligned). Every thread of the block must call it (it may
// synchronize), and every thread gets the row's totals, summed in a fixed
// order. `reuse_sync`: synchronize again before returning, so that the next
// call may write `smem`. `first_warp`: the first warp of the thread's row
// (row_first_warp), where the caller has it at hand.
template <int K, typename A>
__device__ __forceinline__ void row_sum(A (&v)[K], int tpr, A* smem, bool reuse_sync = true,
                                        int first_warp = -1) {
  if (tpr >= 32) {  // the common case, unrolled: no loop counter
    warp_sum(v);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      for (int off = tpr / 2; off > 0; off /= 2) {
        v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
      }
    }
  }
  if (tpr <= 32) return;
  const int warp = threadIdx.x / 32;
  if (first_warp < 0) first_warp = row_first_warp(tpr);
  using P = Packed<A, K>;
  P* slots = reinterpret_cast<P*>(smem);
  if (threadIdx.x % 32 == 0) {
    P mine;
#pragma unroll
    for (int k = 0; k < K; ++k) mine.v[k] = v[k];
    slots[warp] = mine;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = 0;
  for (int w = 0; w < tpr / 32; ++w) {
    const P p = slots[first_warp + w];
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += p.v[k];
  }
  if (reuse_sync) __syncthreads();
}

// Shared memory for row_sum of up to kMaxK values in two sets that calls take
// by turns, so each call synchronizes once: a set is written again only two
// calls later, past a barrier that every thread reaches only after reading it.
// All row_sum calls on the memory must go through it.
template <typename A, int kMaxK>
struct RowSumTurns {
  A* smem;  // 2 * 32 * kMaxK values, 16-byte aligned
  int first_warp;
  int turn = 0;
  __device__ RowSumTurns(A* smem, int tpr) : smem(smem), first_warp(row_first_warp(tpr)) {}
  template <int K>
  __device__ __forceinline__ void operator()(A (&v)[K], int tpr) {
    static_assert(K <= kMaxK);
    row_sum(v, tpr, smem + turn * 32 * kMaxK, false, first_warp);
    turn ^= 1;
  }
};

inline ffi::Error cuda_error(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxnorm: launching ") + what +
                              " failed: " + cudaGetErrorString(err));
}

// A launch of `grid` blocks in clusters of `cluster` along x (grid a
// multiple of it); the configuration points at `attr`.
inline cudaLaunchConfig_t cluster_config(unsigned grid, int threads, size_t smem, int cluster,
                                         cudaStream_t stream, cudaLaunchAttribute& attr) {
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return config;
}

// kernel<<<grid, threads, smem>>>(args...), in clusters of `cluster` blocks
// when cluster > 1.
template <typename... Args>
cudaError_t launch_clusters(void (*kernel)(Args...), unsigned grid, int threads, size_t smem,
                            int cluster, cudaStream_t stream, Args... args) {
  if (cluster <= 1) {
    kernel<<<grid, threads, smem, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = cluster_config(grid, threads, smem, cluster, stream, attr);
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
  // A failed call is also the runtime's last error, which the next launch's
  // check would report as its own: reported here, it is cleared.
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

constexpr int kMaxClusterParts = 8;  // blocks in a cluster (the portable limit)
// sm_90 runs clusters of up to 16 blocks for a kernel that opts in
// (allow_cluster_size); whether they fit a GPC is the runtime's to say.
constexpr int kMaxWideClusterParts = 16;

// Lets `kernel` run in clusters of `cluster` blocks: beyond the portable
// limit it must opt in first.
template <typename K>
cudaError_t allow_cluster_size(K kernel, int cluster) {
  if (cluster <= kMaxClusterParts) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}

// The address of the same shared-memory location in the cluster's block of
// rank r (sm_90).
__device__ __forceinline__ uint32_t cluster_addr(uint32_t local, uint32_t r) {
  uint32_t out = local;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(r));
#endif
  return out;
}

// mbarriers (sm_90): a phase completes when its expected arrivals have come
// and the bytes announced to it (mbar_expect) have landed. Waits take the
// parity of the phase waited for.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_addr(bar)), "r"(count)
               : "memory");
#endif
}

// Arrives, releasing the thread's earlier shared-memory writes to the block.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_addr(bar)) : "memory");
#endif
}

// Arrives and announces `bytes` more to land in the current phase.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Waits for the phase of `parity` to complete; kCluster: acquiring what
// other blocks of the cluster wrote (st.async).
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(const uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kCluster) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}" ::"r"(shared_addr(bar)),
        "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}" ::"r"(shared_addr(bar)),
        "r"(parity)
        : "memory");
  }
#endif
}

// Orders the thread's (and, after an mbarrier wait, the block's) earlier
// shared-memory accesses before its later bulk copies (the async proxy).
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from
// global to shared memory with one bulk copy (TMA); they count towards bar's
// current phase (announced with mbar_expect).
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes,
                                          uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(shared_addr(bar))
      : "memory");
#endif
}

// bulk_load with an L2 policy (l2_policy) for the lines it reads.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes,
                                          uint64_t* bar, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;" ::"r"(shared_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(shared_addr(bar)), "l"(policy)
      : "memory");
#endif
}

// An L2 policy for all of an access's lines: evict-last (kLast: kept for a
// later read) or evict-first.
template <bool kLast>
__device__ __forceinline__ uint64_t l2_policy() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kLast) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  }
#endif
  return policy;
}

// Publishes the mbarriers the thread initialized to the cluster, so that the
// cluster barrier after it may be relaxed: a release would first wait for
// every earlier memory access of the thread (MEMBAR.ALL.GPU), loads included.
__device__ __forceinline__ void fence_mbar_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// A ring of kStages stages of shared memory that thread 0 fills by bulk
// copies: full[s] completes as stage s's bytes land; empty[s] once every
// thread of the block is done reading it (every thread arrives: an arrive
// releases only its own thread's reads, benchmarks/NOTES.md v48), after which
// thread 0 may fill it again. Each thread tracks the phases it has seen.
template <int kStages>
struct BulkFill {
  struct Shared {
    uint64_t full[kStages], empty[kStages];
  };
  Shared& sh;
  uint32_t full_phase = 0, empty_phase = 0, filled = 0;  // a bit a stage

  // Thread 0; visible to the block after a barrier (or the cluster's, with
  // ClusterSum::init).
  __device__ void init() const {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sh.full[s], 1);
      mbar_init(&sh.empty[s], blockDim.x);
    }
    fence_mbar_init();
  }
  // Thread 0: copies `bytes` from each of x and dy into their places in
  // stage s, once it is empty.
  __device__ void fill(int s, void* x_at, const void* x, void* dy_at, const void* dy,
                       uint32_t bytes) {
    claim(s, 2 * bytes);
    bulk_load(x_at, x, bytes, &sh.full[s]);
    bulk_load(dy_at, dy, bytes, &sh.full[s]);
  }
  // The same with an L2 policy (l2_policy); none of the bytes: the phase
  // completes empty.
  __device__ void fill(int s, void* x_at, const void* x, void* dy_at, const void* dy,
                       uint32_t bytes, uint64_t policy) {
    claim(s, 2 * bytes);
    if (bytes == 0) return;
    bulk_load(x_at, x, bytes, &sh.full[s], policy);
    bulk_load(dy_at, dy, bytes, &sh.full[s], policy);
  }
  // Thread 0: copies `bytes` (none: the phase completes empty) from src to
  // `at` in stage s, once it is empty, with an L2 policy (l2_policy).
  __device__ void fill(int s, void* at, const void* src, uint32_t bytes, uint64_t policy) {
    claim(s, bytes);
    if (bytes > 0) bulk_load(at, src, bytes, &sh.full[s], policy);
  }
  __device__ void wait(int s) {
    mbar_wait(&sh.full[s], full_phase >> s & 1);
    full_phase ^= 1u << s;
  }
  __device__ void release(int s) const { mbar_arrive(&sh.empty[s]); }

 private:
  // Waits until stage s is empty (if filled before), then announces `bytes`.
  __device__ void claim(int s, uint32_t bytes) {
    if (filled >> s & 1) {
      mbar_wait(&sh.empty[s], empty_phase >> s & 1);
      empty_phase ^= 1u << s;
    }
    filled |= 1u << s;
    mbar_expect(&sh.full[s], bytes);
  }
};

// A cluster barrier in halves: every thread of every block of the cluster
// arrives (release_shared: its earlier writes to its own block's shared
// memory visible to the other blocks after their wait; relaxed: no
// ordering), then waits for all (acquiring what the releases published).
// A full release (barrier.cluster.arrive.release) is a MEMBAR.ALL.GPU, which
// waits for the thread's global accesses too: 0.2-0.5 us where other SMs
// keep DRAM busy (notes v88). The fence restricted to the block's shared
// memory (PTX ISA 8.6: CUDA 12.8) is a MEMBAR.ALL.CTA; older nvcc gets the
// full release.
__device__ __forceinline__ void cluster_arrive_release_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ >= 1208
  asm volatile(
      "fence.release.sync_restrict::shared::cta.cluster;\n\t"
      "barrier.cluster.arrive.relaxed;" ::: "memory");
#else
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
#endif
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}

// Every thread of every block of the cluster arrives, then waits for all.
__device__ __forceinline__ void cluster_sync_relaxed() {
  cluster_arrive_relaxed();
  cluster_wait();
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

// Blocks in the thread's cluster.
__device__ __forceinline__ uint32_t cluster_blocks() {
  uint32_t n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}

// Stores 16 bytes at `at` (a cluster shared-memory address) with st.async,
// which signals the mbarrier at `bar` (in the same block) as they land.
__device__ __forceinline__ void st_async16(uint32_t at, const uint32_t* w, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(at),
      "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(bar)
      : "memory");
#endif
}

// Up to kMaxK per-block totals summed over the `parts` blocks of a
// thread-block cluster (sm_90), in the order of their ranks in every block, so
// that each block gets the same bits. Each block pushes its totals into every
// block's shared memory with st.async, which signals the receiver's mbarrier
// as the bytes land; a block waits on its own mbarrier alone. A cluster
// barrier instead (v14-v22) fenced every thread's earlier stores at GPU scope
// first (MEMBAR.ALL.GPU): each row waited for the previous row's dx to drain.
// Two sets of slots, taken by turns: a block writes a peer's set again two
// calls later, past its wait for the peer's totals of the call between, which
// the peer sends only after a block barrier (row_sum's, tpr > 32 here) that
// follows its reads of the set. With warps(), each warp's totals go straight
// to every block (kMaxWarps slots a block) with no block barrier: a warp
// writes a peer's set again past its wait for every warp's totals of the call
// between, which each warp sends only after its shuffles of what it read of
// the set. Every block receives as many totals as it waits for, so none is in
// flight to a block that has exited.
template <typename A, int kMaxK, int kMaxWarps = 1>
class ClusterSum {
  using P = Packed<A, kMaxK>;
  static_assert(sizeof(P) % 16 == 0);

 public:
  // Enough for every warp of 8 blocks, or of 16 blocks of half the warps.
  static constexpr int kSlots = kMaxClusterParts * kMaxWarps;
  struct Shared {
    P slots[2][kSlots];
    uint64_t bars[2];
  };

  __device__ explicit ClusterSum(Shared& sh) : sh_(sh) {}

  // Every thread of every block calls it before the first sum, and before
  // the block's first cp.async: with copies issued between the cluster
  // barrier's arrive and its wait, compute-sanitizer's racecheck reports the
  // next block on the SM's first shared-memory write against them
  // (benchmarks/NOTES.md, v27).
  __device__ void init() {
    if (threadIdx.x < 2) {
      mbar_init(&sh_.bars[threadIdx.x], 1);
      fence_mbar_init();
    }
    cluster_sync_relaxed();
    rank_ = cluster_rank();
  }

  // Every thread of every block calls it, v holding the block's totals.
  template <int K>
  __device__ void operator()(A (&v)[K], int parts) {
    static_assert(K <= kMaxK);
    expect(parts);
    if (int(threadIdx.x) < parts) send(v, rank_, threadIdx.x);
    wait_and_sum(v, parts);
  }

  // Every thread of every block calls it, v holding its warp's totals (the
  // same in every lane: warp_sum): sums them over the warps of the cluster's
  // blocks, slot rank * warps + warp, with one wait and no block barrier.
  // Lane l adds slots l, l + 32, ... in order, then warp_sum adds the lanes:
  // every warp of every block adds the same slots the same way, so all get
  // the same bits. The order differs from row_sum's then operator()'s (block
  // by block), and so do the last bits of the sums.
  template <int K>
  __device__ void warps(A (&v)[K], int parts) {
    static_assert(K <= kMaxK);
    const int warps = int(blockDim.x) / 32, warp = int(threadIdx.x) / 32;
    const int lane = int(threadIdx.x) % 32;
    expect(parts * warps);
    if (lane < parts) send(v, rank_ * warps + warp, lane);
    wait();
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = 0;
    for (int slot = lane; slot < parts * warps; slot += 32) {
      const P p = sh_.slots[turn_][slot];
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] += p.v[k];
    }
    turn_ ^= 1;
    warp_sum(v);
  }

 private:
  // Thread 0 announces the bytes of `slots` slots this block receives.
  __device__ void expect(int slots) {
    if (threadIdx.x == 0) mbar_expect(&sh_.bars[turn_], uint32_t(slots * sizeof(P)));
  }

  // Sends v into slot `slot` of the block of rank `peer`.
  template <int K>
  __device__ void send(const A (&v)[K], int slot, uint32_t peer) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    P mine{};
#pragma unroll
    for (int k = 0; k < K; ++k) mine.v[k] = v[k];
    const uint32_t at = cluster_addr(shared_addr(&sh_.slots[turn_][slot]), peer);
    const uint32_t peer_bar = cluster_addr(shared_addr(&sh_.bars[turn_]), peer);
    const auto* w = reinterpret_cast<const uint32_t*>(&mine);
#pragma unroll
    for (int c = 0; c < int(sizeof(P) / 16); ++c) st_async16(at + 16 * c, w + 4 * c, peer_bar);
#endif
  }

  // Waits for this turn's slots.
  __device__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mbar_wait<true>(&sh_.bars[turn_], (phases_ >> turn_) & 1);
    phases_ ^= 1u << turn_;
#else
    __trap();  // never launched in clusters before sm_90
#endif
  }

  // Waits, then sums the `parts` blocks' slots in rank order.
  template <int K>
  __device__ void wait_and_sum(A (&v)[K], int parts) {
    wait();
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = 0;
    for (int r = 0; r < parts; ++r) {
      const P p = sh_.slots[turn_][r];
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] += p.v[k];
    }
    turn_ ^= 1;
  }

  Shared& sh_;
  uint32_t rank_ = 0;
  int turn_ = 0;
  uint32_t phases_ = 0;  // bit t: the parity of the phase set t waits for
};

// The FFI binding every CUDA handler starts from: its stream and device.
inline auto cuda_bind() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

inline ffi::Error last_launch_error(const char* what) {
  return cuda_error(cudaGetLastError(), what);
}

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Whether `count` elements of X split into vectors of v and every pointer
// (null ones aside: 0 is aligned) sits on such a vector.
template <typename X>
bool vec_fits(int64_t count, int v, std::initializer_list<const void*> ptrs) {
  bool ok = count % v == 0;
  for (const void* q : ptrs) ok = ok && reinterpret_cast<uintptr_t>(q) % (v * sizeof(X)) == 0;
  return ok;
}

// Calls f(integral_constant<kWide>) where vectors of kWide elements fit
// (vec_fits), else f(integral_constant<1>).
template <typename X, int kWide, typename F>
auto with_vec_or_one(int64_t count, std::initializer_list<const void*> ptrs, F&& f) {
  if constexpr (kWide > 1) {
    if (vec_fits<X>(count, kWide, ptrs)) return f(std::integral_constant<int, kWide>{});
  }
  return f(std::integral_constant<int, 1>{});
}

// What launch planning reads of a device, asked of the runtime once.
struct DeviceInfo {
  int device = 0;
  int sms = 132;
  // Shared memory one block may opt in to (static and dynamic), and the
  // dynamic shared memory a plan may ask for: that less a margin for the
  // kernels' static shared memory.
  size_t smem_optin = 48 * 1024;
  size_t max_dynamic_smem = 44 * 1024;
  bool clusters = false;  // thread-block clusters (sm_90 and later)
  double dram_gbps = 0;   // peak DRAM bandwidth (GB/s), 0 if unknown
};

// Above the most static shared memory of any kernel, so that every plan's
// dynamic shared memory fits: the float64 backward's cluster split, whose
// warps' slots (ClusterSum::warps) take 8 KB.
constexpr size_t kStaticSmemMargin = 9 * 1024;

// Alignment of the kernels' dynamic shared memory (`extern __shared__
// __align__(kDynSmemAlign) unsigned char dyn[]`, one symbol: every
// declaration must agree). A warp's 16-byte cells cover 512 bytes; 16 bytes
// off a 128-byte line, as after ClusterSum's static shared memory (528 and
// 1296 bytes), each quarter warp's accesses straddle two lines. Nsight
// Compute counted 43% of the cluster forward's shared wavefronts excessive;
// aligned, it ran up to 21% faster and the backward's cluster split 2-8%
// (benchmarks/NOTES.md, v29).
constexpr int kDynSmemAlign = 128;

inline DeviceInfo query_device(int device) {
  DeviceInfo d;
  d.device = device;
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
    d.sms = v;
  }
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
      cudaSuccess) {
    d.smem_optin = size_t(v);
    d.max_dynamic_smem = size_t(v) - kStaticSmemMargin;
  }
  if (cudaDeviceGetAttribute(&v, cudaDevAttrClusterLaunch, device) == cudaSuccess) {
    d.clusters = v != 0;
  }
  int khz = 0, bits = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess) {
    d.dram_gbps = 2.0 * khz * 1e3 * (bits / 8) / 1e9;  // double data rate
  }
  cudaGetLastError();  // a failed query leaves the defaults
  return d;
}

// Handlers run on several threads (one per device): the cache is locked.
inline const DeviceInfo& device_info(int device) {
  static std::mutex mu;
  static std::map<int, DeviceInfo> known;  // references stay valid
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(device);
  if (it == known.end()) it = known.emplace(device, query_device(device)).first;
  return it->second;
}

// query(), asked once per device, kernel, block size, shared memory and
// cluster size of a launch and then remembered (one cache per call site: F is
// its lambda). Handlers run on several threads: the cache is locked.
template <typename K, typename F>
int per_launch_shape(const DeviceInfo& dev, K kernel, int threads, size_t smem, int cluster,
                     F&& query) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t, int>, int> known;
  const auto key = std::make_tuple(dev.device, reinterpret_cast<const void*>(kernel), threads,
                                   smem, cluster);
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(key);
  if (it == known.end()) it = known.emplace(key, query()).first;
  return it->second;
}

// Lets `kernel` take `bytes` of dynamic shared memory. Beyond 48 KB a kernel
// must opt in, to at most the device's limit less its own static shared
// memory (asking for more fails: "invalid argument"). The opt-in is raised to
// that most, not to `bytes`, so that a later launch with less does not lower
// it under an earlier one's.
template <typename K>
cudaError_t allow_dynamic_smem(K kernel, size_t bytes, const DeviceInfo& dev) {
  if (bytes <= 40 * 1024) return cudaSuccess;
  cudaFuncAttributes attr;
  if (const cudaError_t e = cudaFuncGetAttributes(&attr, kernel); e != cudaSuccess) return e;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(dev.smem_optin - attr.sharedSizeBytes));
}

// allow_dynamic_smem, asked once per device, kernel and size.
template <typename K>
cudaError_t allow_dynamic_smem_once(K kernel, size_t bytes, const DeviceInfo& dev) {
  return cudaError_t(per_launch_shape(dev, kernel, 0, bytes, 1, [&] {
    return int(allow_dynamic_smem(kernel, bytes, dev));
  }));
}

// Blocks of `kernel` that fit on one SM of `device` at once (at least 1), with
// `smem` bytes of dynamic shared memory allowed. Asked of the runtime once per
// kernel, device and shape of launch.
template <typename K>
int blocks_per_sm(K kernel, int threads, size_t smem, const DeviceInfo& dev) {
  return per_launch_shape(dev, kernel, threads, smem, 1, [&] {
    int n = 0;
    if (allow_dynamic_smem(kernel, smem, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) !=
            cudaSuccess ||
        n < 1) {
      cudaGetLastError();
      n = 1;
    }
    return n;
  });
}

// Clusters of `parts` blocks of `kernel` that the GPU holds at once, which can
// be fewer than blocks_per_sm * SMs / parts: a cluster's blocks must share a
// GPC. A persistent grid of more clusters than that leaves the last ones to
// start when others end.
template <typename K>
int resident_clusters(K kernel, int threads, size_t smem, int parts, const DeviceInfo& dev) {
  return per_launch_shape(dev, kernel, threads, smem, parts, [&] {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t config =
        cluster_config(unsigned(parts), threads, smem, parts, nullptr, attr);
    int n = 0;
    if (allow_dynamic_smem(kernel, smem, dev) != cudaSuccess ||
        allow_cluster_size(kernel, parts) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, kernel, &config) != cudaSuccess || n < 1) {
      cudaGetLastError();
      n = 1;
    }
    return n;
  });
}

}  // namespace jaxnorm::cuda
