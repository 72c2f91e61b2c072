// Row-norm kernels that give each row a block of its own and hold it in
// registers, issuing every load they need (x, dy, the row's statistics, scale
// and bias) before the first reduction, indexing within a row in 32 bits.
//
// The forward takes them for any number of rows that fit a block: for few
// rows (decode: 1 to a few hundred), where each block has one row to do and
// nothing hides latency, the generic kernels (row_norm_kernels.cuh) ran about
// three times the instructions and loaded the parameters only after the
// reduction; for many rows they also move more bytes a second than the
// generic kernels' ring and staged parameters (benchmarks/NOTES.md, v6).
//
// The backward takes them for few rows only: one row a block. Up to 16 rows,
// it finishes dscale/dbias in the same launch: its blocks form one
// thread-block cluster (sm_90), and each block sums one slice of the columns
// over the cluster's blocks through distributed shared memory, in block
// order. More rows write one partial row each, summed in order by
// sum_partials. No atomics: the same bits on every run.
#pragma once

#include <cooperative_groups.h>

#include "cuda/row_norm_kernels.cuh"

namespace jaxnorm::cuda {

constexpr int kFewNv = 2;            // 16-byte vectors a thread, few rows
constexpr int kBlockThreads = 1024;  // forward block, at most
constexpr int kFewBwdThreads = 512;  // backward block, at most
constexpr int kFewPortableCluster = 8;
constexpr int kFewMaxCluster = 16;   // non-portable, where the device has it

// Loads a thread's NV vectors of a row (zeros past its end).
template <int VEC, int NV, typename T>
__device__ __forceinline__ void load_row(RegVec<T, VEC> (&v)[NV], const T* row,
                                         int lane, int nvec) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = lane + i * int(blockDim.x);
    v[i] = load_or_zero<VEC>(row, c, c < nvec);
  }
}

// Sums K values over the block in a fixed order; every thread gets the
// totals. Unlike row_sum (common.cuh), the whole block is one row, and there
// is no barrier at the end: `smem` (32 * K values) must not be written again
// before every thread has returned. Measured 0.1-0.3 µs faster than row_sum
// per decode kernel (benchmarks/NOTES.md, v5).
template <int K, typename A>
__device__ __forceinline__ void block_sum(A (&v)[K], A* smem) {
  if (blockDim.x < 32) {  // a power of two: shuffle among those lanes only
    const unsigned lanes = (1u << blockDim.x) - 1;
#pragma unroll
    for (int k = 0; k < K; ++k)
      for (int off = blockDim.x / 2; off > 0; off /= 2)
        v[k] += __shfl_xor_sync(lanes, v[k], off);
    return;
  }
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
  const int warps = blockDim.x / 32;
  if (warps == 1) return;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) smem[k * 32 + threadIdx.x / 32] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    A s = 0;
    for (int w = 0; w < warps; ++w) s += smem[k * 32 + w];
    v[k] = s;
  }
}

// ----------------------------------------------------------------- forward

// Largest block of fwd_block: with y written, 4 or more vectors of x, scale
// and bias need more than the 64 registers a 1024-thread block leaves.
constexpr int fwd_block_threads(int nv, bool write_y) {
  return write_y && nv > kFewNv ? 512 : kBlockThreads;
}

// One block a row, grid = rows. kWriteY = false writes the statistics only
// (the forward of a gradient, whose output is unused). kEarlyParams loads
// scale and bias with x, before the reduction, rather than at their use: one
// memory round trip fewer, for more registers.
template <typename X, typename Y, typename W, int VEC, int NV, bool kWriteY,
          bool kEarlyParams>
__global__ void __launch_bounds__(fwd_block_threads(NV, kWriteY)) fwd_block(FwdArgs a) {
  using A = acc_t<X>;
  constexpr int kHeld = kWriteY && kEarlyParams ? NV : 1;  // parameter vectors held
  __shared__ A smem[2][32];  // block_sum's, one for each sum
  const int nvec = int(a.hidden / VEC), lane = threadIdx.x;
  const int64_t row = blockIdx.x;
  const bool use_w = kWriteY && a.has_scale, use_b = kWriteY && a.has_bias;
  const W* scale = static_cast<const W*>(a.scale);
  const W* bias = static_cast<const W*>(a.bias);
  RegVec<X, VEC> xv[NV];
  RegVec<W, VEC> wv[kHeld], bv[kHeld];
  load_row(xv, static_cast<const X*>(a.x) + row * a.hidden, lane, nvec);
  if constexpr (kHeld == NV) {
    if (use_w) load_row(wv, scale, lane, nvec);
    if (use_b) load_row(bv, bias, lane, nvec);
  }
  A mean, rstd;
  row_stats(xv, lane, blockDim.x, nvec, a, A(1) / A(a.hidden), mean, rstd,
            [&](A (&v)[1], int k) { block_sum(v, smem[k]); });
  if (lane == 0) {
    if (a.centered) static_cast<A*>(a.mean)[row] = mean;
    static_cast<A*>(a.rstd)[row] = rstd;
  }
  if constexpr (kWriteY) {
    Y* yr = static_cast<Y*>(a.y) + row * a.hidden;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = lane + i * blockDim.x;
      if (c >= nvec) continue;
      A w[VEC], b[VEC];
      if constexpr (kHeld == NV) {
        unpack(w, wv[i]);
        unpack(b, bv[i]);
      } else {
        if (use_w) load_vec(w, scale + c * VEC);
        if (use_b) load_vec(b, bias + c * VEC);
      }
      normalize_store(yr + c * VEC, xv[i], mean, rstd, w, use_w, b, use_b);
    }
  }
}

// Vectors a thread with which fwd_block serves a launch, or 0 where it does
// not. Few rows (at most 4 an SM): 2, where a row fits a block that way.
// Otherwise 4 with y written, 8 for statistics only, when a row fills at
// least a warp (two warps for statistics): on shorter rows the generic
// kernels' several rows a block are faster. Measured on an H200
// (benchmarks/NOTES.md, v6).
inline int block_fwd_nv(int64_t rows, int64_t nvec, bool write_y, int sms) {
  if (rows > (int64_t(1) << 30)) return 0;
  if (rows <= 4 * int64_t(sms) && threads_per_row(nvec, kFewNv) <= kBlockThreads) {
    return kFewNv;
  }
  const int nv = write_y ? 4 : 8;
  const int tpr = threads_per_row(nvec, nv);
  return tpr >= (write_y ? 32 : 64) && tpr <= fwd_block_threads(nv, write_y) ? nv : 0;
}

// Launches fwd_block with nv vectors a thread (an answer of block_fwd_nv).
// Scale and bias are loaded with x for few rows, where nothing else would
// hide a second memory round trip; for many rows, where that costs the SM no
// block (with float32 parameters and 4 vectors a thread it takes 106
// registers instead of 54; at 384 threads a block, 64 instead of 52 cost a
// block and 7% at 8192x12288 on an H200, while at 256 threads it was 7%
// faster: benchmarks/NOTES.md, v6).
template <typename X, typename Y, typename W, int VEC>
cudaError_t launch_fwd_block(cudaStream_t stream, const DeviceInfo& dev, int nv,
                             const FwdArgs& a) {
  const int threads = threads_per_row(a.hidden / VEC, nv);
  auto launch = [&](void (*kernel)(FwdArgs)) {
    kernel<<<unsigned(a.rows), threads, 0, stream>>>(a);
    return cudaGetLastError();
  };
  if (!a.write_y) {
    return launch(nv == kFewNv ? fwd_block<X, Y, W, VEC, kFewNv, false, false>
                               : fwd_block<X, Y, W, VEC, 8, false, false>);
  }
  if (nv == kFewNv) return launch(fwd_block<X, Y, W, VEC, kFewNv, true, true>);
  auto early = fwd_block<X, Y, W, VEC, 4, true, true>;
  auto late = fwd_block<X, Y, W, VEC, 4, true, false>;
  const bool no_cost =
      blocks_per_sm(early, threads, 0, dev) >= blocks_per_sm(late, threads, 0, dev);
  return launch(no_cost ? early : late);
}

// ---------------------------------------------------------------- backward

// Block `rank` of the cluster sums its slice of the columns of every block's
// `sums` ([region][hidden] in shared memory) in block order, 16 bytes at a
// time, and writes dscale (region 0) and dbias.
template <typename W, typename A>
__device__ void write_cluster_sums(A* sums, int regions, const BwdArgs& a) {
#if __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int K = int(16 / sizeof(A));
  cg::cluster_group cluster = cg::this_cluster();
  const int blocks = gridDim.x;
  const int64_t h = a.hidden, chunks = h / K, per = (chunks + blocks - 1) / blocks;
  const int64_t lo = per * blockIdx.x;
  const int64_t n = (lo + per < chunks ? per : chunks - lo > 0 ? chunks - lo : 0);
  cluster.sync();  // every block's sums are in its shared memory
  for (int64_t t = threadIdx.x; t < regions * n; t += blockDim.x) {
    const int r = int(t / n);
    const int64_t col = (lo + t % n) * K;
    Packed<A, K> part[kFewMaxCluster];
#pragma unroll
    for (int b = 0; b < kFewMaxCluster; ++b) {  // all loads first
      if (b < blocks) {
        part[b] = *reinterpret_cast<const Packed<A, K>*>(
            cluster.map_shared_rank(sums + r * h + col, b));
      }
    }
    Packed<W, K> out;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      A s = 0;
#pragma unroll
      for (int b = 0; b < kFewMaxCluster; ++b) s += b < blocks ? part[b].v[k] : A(0);
      out.v[k] = from_acc<W>(s);
    }
    W* dst = static_cast<W*>(r == 1 || !a.has_scale ? a.dbias : a.dscale);
    *reinterpret_cast<Packed<W, K>*>(dst + col) = out;
  }
  cluster.sync();  // no block leaves while others read its shared memory
#endif
}

// Where the backward's blocks put their rows' dscale/dbias terms.
enum class FewSums {
  kGradient,  // one block: the gradients themselves (W)
  kCluster,   // its shared memory (A), summed over the cluster
  kPartial,   // a row of a.partial (A), summed by sum_partials
};

// Writes VEC column sums at column c * VEC of `row` (16 bytes at a time).
template <typename W, int VEC, typename A>
__device__ __forceinline__ void store_sums(void* row, int c, const A (&v)[VEC], FewSums to) {
  if (to == FewSums::kGradient) {
    store_vec(static_cast<W*>(row) + c * VEC, v);
  } else if (to == FewSums::kPartial) {
    store_vec(static_cast<A*>(row) + c * VEC, v);
  } else {
    constexpr int K = int(16 / sizeof(A));
#pragma unroll
    for (int h = 0; h < VEC / K; ++h) {
      Packed<A, K> p;
#pragma unroll
      for (int k = 0; k < K; ++k) p.v[k] = v[h * K + k];
      reinterpret_cast<Packed<A, K>*>(static_cast<A*>(row) + c * VEC)[h] = p;
    }
  }
}

// One block a row; with kCluster the grid is one cluster.
template <typename X, typename G, typename W, int VEC>
__global__ void __launch_bounds__(kFewBwdThreads) bwd_few(BwdArgs a) {
  using A = acc_t<X>;
  constexpr int NV = kFewNv;
  __shared__ A red[32 * 2];
  extern __shared__ __align__(16) unsigned char dyn[];
  const int lane = threadIdx.x, nvec = int(a.hidden / VEC);
  const int64_t row = blockIdx.x;
  RegVec<W, VEC> wv[NV];
  RegVec<X, VEC> xv[NV];
  RegVec<G, VEC> gv[NV];
  if (a.has_scale) load_row(wv, static_cast<const W*>(a.scale), lane, nvec);
  load_row(xv, static_cast<const X*>(a.x) + row * a.hidden, lane, nvec);
  load_row(gv, static_cast<const G*>(a.dy) + row * a.hidden, lane, nvec);
  const A mean = a.centered ? static_cast<const A*>(a.mean)[row] : A(0);
  const A rstd = static_cast<const A*>(a.rstd)[row];
  // xhat, dy and g = dy * scale of vector i (zeros past the row's end).
  auto xhat_g = [&](int i, A (&xh)[VEC], A (&d)[VEC], A (&g)[VEC]) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      d[e] = gv[i].get(e);
      xh[e] = (xv[i].get(e) - mean) * rstd;
      g[e] = a.has_scale ? d[e] * wv[i].get(e) : d[e];
    }
  };
  A s[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    A xh[VEC], d[VEC], g[VEC];
    xhat_g(i, xh, d, g);
    add_row_dots(s, g, xh);
  }
  block_sum(s, red);
  const A inv_n = A(1) / A(a.hidden);
  const A c_gx = s[0] * inv_n, c_g = a.centered ? s[1] * inv_n : A(0);
  // dscale and dbias: this row's terms, to where FewSums says.
  const FewSums to = gridDim.x == 1 ? FewSums::kGradient
                     : a.partial ? FewSums::kPartial : FewSums::kCluster;
  A* sums = reinterpret_cast<A*>(dyn);  // [region][hidden]
  void* dw = a.dscale;
  void* db = a.dbias;
  if (to == FewSums::kCluster) {
    dw = sums;
    db = sums + (a.has_scale ? a.hidden : 0);
  } else if (to == FewSums::kPartial) {  // [region][row][hidden]
    dw = static_cast<A*>(a.partial) + row * a.hidden;
    db = static_cast<A*>(dw) + (a.has_scale ? a.rows * a.hidden : 0);
  }
  X* dxr = static_cast<X*>(a.dx) + row * a.hidden;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = lane + i * int(blockDim.x);
    if (c >= nvec) continue;
    A xh[VEC], d[VEC], g[VEC], o[VEC];
    xhat_g(i, xh, d, g);
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = rstd * (g[e] - c_g - xh[e] * c_gx);
    store_vec(dxr + c * VEC, o);
    if (a.has_bias) store_sums<W>(db, c, d, to);
    if (a.has_scale) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) d[e] *= xh[e];
      store_sums<W>(dw, c, d, to);
    }
  }
  if (to == FewSums::kCluster) write_cluster_sums<W>(sums, int(a.has_scale) + int(a.has_bias), a);
}

// A launch of `blocks` blocks as one cluster (none when `cluster` is false).
// Not copyable: the config points at the attribute.
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr = {};
  ClusterLaunch(int blocks, int threads, size_t smem, cudaStream_t stream, bool cluster) {
    cfg.gridDim = dim3(unsigned(blocks));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = unsigned(blocks);
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = cluster ? 1 : 0;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// Largest cluster `kernel` can run with: 16 blocks where the device allows
// it, else the portable 8.
template <typename K>
int max_cluster(K kernel, int threads, size_t smem, const DeviceInfo& dev) {
  return per_launch_shape(dev, kernel, threads, smem, [&] {
    ClusterLaunch l(kFewMaxCluster, threads, smem, nullptr, true);
    int clusters = 0;
    const bool large =
        allow_dynamic_smem(kernel, smem, dev) == cudaSuccess &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
            cudaSuccess &&
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &l.cfg) == cudaSuccess &&
        clusters >= 1;
    cudaGetLastError();
    return large ? kFewMaxCluster : kFewPortableCluster;
  });
}

// How the few-rows backward runs: `blocks` blocks (one cluster) of `threads`.
struct FewBwdPlan {
  int threads = 0, blocks = 0;
  FewSums sums = FewSums::kGradient;
  size_t smem = 0;  // each block's dscale/dbias sums, with a cluster
  size_t partial_bytes = 0;
};

// The few-rows backward plan, or blocks = 0 where it does not serve: a row
// must fit one block, and there be at most 4 rows an SM. Up to 16 rows (8
// where the device has no larger clusters, 1 before sm_90) finish dscale in
// the launch; more write partial rows for sum_partials. Blocks that took
// several rows in turn were slower (benchmarks/NOTES.md).
template <typename X, typename G, typename W, int VEC>
FewBwdPlan plan_bwd_few(int64_t rows, int64_t hidden, int regions, const DeviceInfo& dev,
                        bool allow_cluster = true) {
  static_assert(VEC > 1, "16-byte vectors only");
  using A = acc_t<X>;
  FewBwdPlan p;
  const int tpr = threads_per_row(hidden / VEC, kFewNv);
  const size_t smem = size_t(regions) * hidden * sizeof(A);
  if (tpr > kFewBwdThreads || rows > 4 * int64_t(dev.sms)) return p;
  p.threads = tpr;
  p.blocks = int(rows);
  if (rows == 1) return p;
  const bool cluster = allow_cluster && dev.cc_major >= 9 && smem <= dev.max_dynamic_smem &&
                       rows <= max_cluster(bwd_few<X, G, W, VEC>, tpr, smem, dev);
  p.sums = cluster ? FewSums::kCluster : FewSums::kPartial;
  p.smem = cluster ? smem : 0;
  p.partial_bytes = cluster ? 0 : size_t(regions) * rows * hidden * sizeof(A);
  return p;
}

// Runs the plan, with a.partial pointing at partial_bytes of scratch.
template <typename X, typename G, typename W, int VEC>
cudaError_t launch_bwd_few(cudaStream_t stream, const FewBwdPlan& p, const DeviceInfo& dev,
                           BwdArgs a) {
  using A = acc_t<X>;
  auto kernel = bwd_few<X, G, W, VEC>;
  cudaError_t err = allow_dynamic_smem(kernel, p.smem, dev);
  if (err != cudaSuccess) return err;
  if (p.sums != FewSums::kPartial) a.partial = nullptr;
  ClusterLaunch l(p.blocks, p.threads, p.smem, stream, p.sums == FewSums::kCluster);
  err = cudaLaunchKernelEx(&l.cfg, kernel, a);
  if (err != cudaSuccess || p.sums != FewSums::kPartial) return err;
  return launch_sum_partials<W, A>(stream, a, a.rows);
}

}  // namespace jaxnorm::cuda
