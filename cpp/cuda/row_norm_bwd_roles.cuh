// The backward in two warp roles (sm_90), for rows of 4097-8192 16-bit
// elements that compute their own statistics (the path jax.grad takes when
// the forward's output is dead).
//
// bwd_regs runs a row in one block through two passes with a block reduction
// between them: while the block sums a row, no warp has other work, and with
// one block an SM (LayerNorm's accumulators in registers) the row's serial
// steps, not DRAM, set the pace (benchmarks/NOTES.md, v20-v21). Here the two
// passes run in different warps, on different rows at once:
// - the statistics warps sum row j + 1 (sum_rows) while
// - the gradient warps finish row j (grad_rows: dx, and dscale/dbias held in
//   their registers).
// A row reaches shared memory with two bulk copies (TMA, one thread) into a
// ring of stages (roles_stages). mbarriers hand each stage from the copy to the
// statistics warps (full), their sums to the gradient warps (summed), and the
// stage back to the copy (empty: both roles arrive when done reading it); no
// warp waits on a block barrier.
// LayerNorm 4096x8192 bf16 on an H200: 71 -> 57 us (benchmarks/NOTES.md, v43).
// The handlers take it wherever roles_serve() says it serves, with
// roles_stages() stages.
#pragma once

#include "cuda/row_norm_kernels.cuh"

namespace jaxnorm::cuda {

constexpr int kRoleStatThreads = 128;  // statistics warps, 8 vectors a thread
constexpr int kRoleGradThreads = 256;  // gradient warps, 4 vectors a thread
constexpr int kRoleThreads = kRoleStatThreads + kRoleGradThreads;
constexpr int kRoleStatNv = 8, kRoleGradNv = 4;
constexpr int kRoleMaxVecs = kRoleGradThreads * kRoleGradNv;  // 16-byte vectors a row
// Three stages: two rows in flight while the statistics warps sum one; on an
// H200 four, five and six were 2-5% slower at 8192 wide (v43). Where DRAM is
// slow (an H100), a ring over kRoleRingBytes lost up to 10% to two stages
// (v53).
constexpr int kRoleStages = 3;
constexpr size_t kRoleRingBytes = 80 * 1024;

// The ring and its barriers. A block's row j (rows blockIdx.x + j * gridDim.x)
// takes stage j % kStages, in the (j / kStages)-th phase of that stage's
// barriers.
template <int kStages>
struct RoleRing {
  static constexpr int kStatWarps = kRoleStatThreads / 32;
  struct Shared {
    Packed<float, 4> sums[kStages][kStatWarps];
    uint64_t full[kStages], summed[kStages], empty[kStages];
  };
  Shared& sh;
  unsigned char* rows;  // [stage][x, dy][row_bytes]
  int64_t nvec;         // 16-byte vectors a row
  uint32_t row_bytes;

  __device__ const uint4* x(int s) const {
    return reinterpret_cast<const uint4*>(rows + size_t(2 * s) * row_bytes);
  }
  __device__ const uint4* dy(int s) const {
    return reinterpret_cast<const uint4*>(rows + size_t(2 * s + 1) * row_bytes);
  }
  __device__ void init() const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        mbar_init(&sh.full[s], 1);
        mbar_init(&sh.summed[s], kStatWarps);
        // Every thread arrives, not a lane a warp after __syncwarp: an arrive
        // releases its own thread's reads, and racecheck reported the
        // one-lane form (benchmarks/kernels/mbarrier_racecheck.cu).
        mbar_init(&sh.empty[s], kRoleThreads);
      }
      fence_mbar_init();
    }
    __syncthreads();
  }
  // One thread: starts the copies of a row into stage s.
  template <typename X>
  __device__ void issue(int s, const BwdArgs& a, int64_t row) const {
    mbar_expect(&sh.full[s], 2 * row_bytes);
    bulk_load(rows + size_t(2 * s) * row_bytes, static_cast<const X*>(a.x) + row * a.hidden,
              row_bytes, &sh.full[s]);
    bulk_load(rows + size_t(2 * s + 1) * row_bytes, static_cast<const X*>(a.dy) + row * a.hidden,
              row_bytes, &sh.full[s]);
  }
  // Vector c of the row in stage s, of x and of dy.
  template <typename X>
  __device__ void read(int s, int64_t c, RegVec<X, 8>& xv, RegVec<X, 8>& dv) const {
    xv.load_shared(x(s) + c);
    dv.load_shared(dy(s) + c);
  }
  // f(i, c, xv, dv) for each vector c = t + i * kThreads (i < NV) of the row
  // in stage s, with xv and dv that vector of x and of dy.
  template <typename X, int NV, int kThreads, typename F>
  __device__ void each_vec(int s, int t, F&& f) const {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = t + int64_t(i) * kThreads;
      if (c >= nvec) continue;
      RegVec<X, 8> xv, dv;
      read(s, c, xv, dv);
      f(i, c, xv, dv);
    }
  }
  // LayerNorm's shift (RowDots::kOwnLn): the row's first element.
  template <typename X>
  __device__ float shift(int s) const {
    return to_acc(reinterpret_cast<const X*>(x(s))[0]);
  }
};

// The scale of a thread's vectors (1 without one), in float.
template <typename W, int NV>
__device__ void load_scale(float (&w)[NV][8], const BwdArgs& a, int64_t nvec, int t,
                           int threads) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = t + int64_t(i) * threads;
#pragma unroll
    for (int e = 0; e < 8; ++e) w[i][e] = 1.0f;
    if (a.has_scale && c < nvec) load_vec_early(w[i], static_cast<const W*>(a.scale) + c * 8);
  }
}

// The statistics warps: each row's sums (RowDots kOwnLn or kOwnRms), one
// slot a warp.
template <typename X, typename W, RowDots kMode, int kStages>
__device__ void sum_rows(const BwdArgs& a, const RoleRing<kStages>& ring) {
  using A = float;
  constexpr int VEC = 8, K = row_dot_count(kMode);
  const int t = threadIdx.x;
  A w[kRoleStatNv][VEC];
  load_scale<W>(w, a, ring.nvec, t, kRoleStatThreads);
  int64_t j = 0;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x, ++j) {
    const int s = int(j % kStages);
    mbar_wait(&ring.sh.full[s], uint32_t(j / kStages) & 1);
    const A shift = kMode == RowDots::kOwnLn ? ring.template shift<X>(s) : A(0);
    A sums[K] = {};
    auto sum_vec = [&](int i, int64_t, auto& xv, auto& dv) {
      A xh[VEC], g[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        xh[e] = kMode == RowDots::kOwnLn ? xv.get(e) - shift : xv.get(e);
        g[e] = dv.get(e) * w[i][e];
      }
      add_row_dots<kMode>(sums, g, xh);
    };
    ring.template each_vec<X, kRoleStatNv, kRoleStatThreads>(s, t, sum_vec);
    mbar_arrive(&ring.sh.empty[s]);  // done reading the stage
    warp_sum(sums);
    if (t % 32 == 0) {
      // The stage's previous row's sums were read before its empty phase
      // completed (it has, or this row's copy would not have been issued):
      // waiting on it is immediate, and tells compute-sanitizer's racecheck.
      if (j >= kStages) mbar_wait(&ring.sh.empty[s], uint32_t(j / kStages - 1) & 1);
      Packed<A, 4> p{};
#pragma unroll
      for (int k = 0; k < K; ++k) p.v[k] = sums[k];
      ring.sh.sums[s][t / 32] = p;
      mbar_arrive(&ring.sh.summed[s]);
    }
  }
}

// The gradient warps: dx of each row from its sums, dscale/dbias accumulated
// in registers and written as the block's partial rows. Their first thread
// also refills the ring.
template <typename X, typename W, RowDots kMode, int kStages>
__device__ void grad_rows(const BwdArgs& a, const RoleRing<kStages>& ring) {
  using A = float;
  constexpr int VEC = 8;
  constexpr bool kCentered = kMode == RowDots::kOwnLn;
  const int t = int(threadIdx.x) - kRoleStatThreads;
  A w[kRoleGradNv][VEC], dw[kRoleGradNv][VEC] = {}, db[kRoleGradNv][VEC] = {};
  load_scale<W>(w, a, ring.nvec, t, kRoleGradThreads);
  const A inv_n = A(1) / A(a.hidden);
  int64_t j = 0;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x, ++j) {
    const int s = int(j % kStages);
    const uint32_t phase = uint32_t(j / kStages) & 1;
    mbar_wait(&ring.sh.summed[s], phase);
    A sums[row_dot_count(kMode)] = {};
#pragma unroll
    for (int k = 0; k < RoleRing<kStages>::kStatWarps; ++k) {
      const Packed<A, 4> p = ring.sh.sums[s][k];
#pragma unroll
      for (int m = 0; m < row_dot_count(kMode); ++m) sums[m] += p.v[m];
    }
    A mean = kCentered ? ring.template shift<X>(s) : A(0), rstd = 1, c_gx, c_g;
    row_dx_terms<kMode>(sums, kCentered, A(a.epsilon), inv_n, mean, rstd, c_gx, c_g);
    // xhat_of's and dx_of's short forms: xhat = x rstd - mean rstd, dx =
    // rstd g + (xhat * -rstd c_gx - rstd c_g).
    const A mr = mean * rstd, kx = -rstd * c_gx, k0 = -rstd * c_g;
    X* dxr = static_cast<X*>(a.dx) + row * a.hidden;
    auto grad_vec = [&](int i, int64_t c, auto& xv, auto& dv) {
      A o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A d = dv.get(e);
        const A xh = kCentered ? xv.get(e) * rstd - mr : xv.get(e) * rstd;
        o[e] = (d * w[i][e]) * rstd + (kCentered ? xh * kx + k0 : xh * kx);
        dw[i][e] += d * xh;
        if constexpr (kCentered) db[i][e] += d;
      }
      store_vec(dxr + c * VEC, o);
    };
    ring.template each_vec<X, kRoleGradNv, kRoleGradThreads>(s, t, grad_vec);
    mbar_arrive(&ring.sh.empty[s]);  // done reading the stage and the sums
    const int64_t next = row + int64_t(kStages) * gridDim.x;
    if (t == 0 && next < a.rows) {
      mbar_wait(&ring.sh.empty[s], phase);
      fence_proxy_async();  // the warps' reads of the stage before the copy's writes
      ring.template issue<X>(s, a, next);
    }
  }
  // The block's partial rows (dscale if given, then dbias), or with one block
  // the gradients themselves.
  auto write = [&](int region, void* out, const A(&v)[VEC], int64_t c) {
    if (gridDim.x == 1) {
      store_vec(static_cast<W*>(out) + c * VEC, v);
    } else {
      const int64_t part = region * int64_t(gridDim.x) + blockIdx.x;
      store_vec(static_cast<A*>(a.partial) + part * a.hidden + c * VEC, v);
    }
  };
#pragma unroll
  for (int i = 0; i < kRoleGradNv; ++i) {
    const int64_t c = t + int64_t(i) * kRoleGradThreads;
    if (c >= ring.nvec) continue;
    if (a.has_scale) write(0, a.dscale, dw[i], c);
    if (a.has_bias) write(int(a.has_scale), a.dbias, db[i], c);
  }
}

template <typename X, typename W, bool kCentered, int kStages>
__global__ void __launch_bounds__(kRoleThreads, 1) bwd_roles(BwdArgs a) {
  constexpr RowDots kMode = kCentered ? RowDots::kOwnLn : RowDots::kOwnRms;
  using Ring = RoleRing<kStages>;
  __shared__ __align__(16) typename Ring::Shared sh;
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  const int64_t nvec = a.hidden / 8;
  const Ring ring{sh, dyn, nvec, uint32_t(nvec * 16)};
  ring.init();
  if (threadIdx.x == kRoleStatThreads) {  // the gradient warps' first thread
    for (int s = 0; s < kStages; ++s) {
      const int64_t row = blockIdx.x + int64_t(s) * gridDim.x;
      if (row < a.rows) ring.template issue<X>(s, a, row);
    }
  }
  if (threadIdx.x < kRoleStatThreads) {
    sum_rows<X, W, kMode, kStages>(a, ring);
  } else {
    grad_rows<X, W, kMode, kStages>(a, ring);
  }
}

// Stages of the ring for rows of `hidden` 16-bit elements: kRoleStages, or
// two where DRAM is slow and kRoleStages would take over kRoleRingBytes. On
// an H100, computing the statistics (benchmarks/NOTES.md, v53), two against
// three stages: 4096x8192 RMSNorm 80.1-80.5 -> 74.2-74.9 us, LayerNorm
// 85.3-86.9 -> 77.2-78.1; 16384x8192 LayerNorm 316.1 -> 287.1; 4096x7168
// 70.2 / 75.2 -> 66.4 / 69.6; but 4096x6656 (78 KB in three stages) 61.6 /
// 64.6 against 62.5 / 66.1 and 4096x5120 49.2 / 50.2 against 52.7 / 55.2.
inline int roles_stages(int64_t hidden, const DeviceInfo& dev) {
  const size_t ring = size_t(kRoleStages) * 2 * hidden * 2;
  return dram_is_slow(dev) && ring > kRoleRingBytes ? 2 : kRoleStages;
}

// Whether bwd_roles serves a backward of 16-bit x, dy of its type, in 16-byte
// vectors (the caller's to know) on a device: sm_90 or later, rows of
// 513-1024 vectors, computing their statistics, no residual, the scale as it
// is. (Its split over a cluster of blocks for longer rows ran 20-60% slower
// than bwd_regs' split, v43.)
inline bool roles_serve(const BwdArgs& a, const DeviceInfo& dev) {
  const int64_t nvec = a.hidden / 8;
  return dev.clusters && a.mean == nullptr && a.rstd == nullptr && a.dres == nullptr &&
         a.scale_offset == 0 && nvec > kRoleMaxVecs / 2 && nvec <= kRoleMaxVecs &&
         size_t(roles_stages(a.hidden, dev)) * 2 * nvec * 16 <= dev.max_dynamic_smem;
}

// Blocks of a launch, and the bytes of its partial rows (none with one block).
inline int roles_grid(const BwdArgs& a, const DeviceInfo& dev) {
  return int(a.rows < dev.sms ? a.rows : dev.sms);
}
inline size_t roles_partial_bytes(const BwdArgs& a, const DeviceInfo& dev) {
  const int grid = roles_grid(a, dev);
  const int regions = int(a.has_scale) + int(a.has_bias);
  return grid > 1 ? size_t(regions) * grid * a.hidden * sizeof(float) : 0;
}

// Runs the backward with a.partial pointing at roles_partial_bytes() of
// scratch: one block an SM, each a row at a time through a ring of `stages`
// (2 or 3; 0: roles_stages()).
template <typename X, typename W>
cudaError_t launch_bwd_roles(cudaStream_t stream, const DeviceInfo& dev, const BwdArgs& a,
                             int stages = 0) {
  if (stages == 0) stages = roles_stages(a.hidden, dev);
  const size_t smem = size_t(stages) * 2 * a.hidden * sizeof(X);
  auto kernel = stages == 2 ? (a.centered ? &bwd_roles<X, W, true, 2> : &bwd_roles<X, W, false, 2>)
                            : (a.centered ? &bwd_roles<X, W, true, kRoleStages>
                                          : &bwd_roles<X, W, false, kRoleStages>);
  if (cudaError_t e = allow_dynamic_smem_once(kernel, smem, dev); e != cudaSuccess) return e;
  const int grid = roles_grid(a, dev);
  kernel<<<grid, kRoleThreads, smem, stream>>>(a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || grid == 1) return e;
  return launch_sum_partials<W, float>(stream, a, grid);
}

}  // namespace jaxnorm::cuda
