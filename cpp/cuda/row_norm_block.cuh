// Row-norm kernels that give each row a block of its own and hold it in
// registers, issuing every load they need (x, dy, the row's statistics, scale
// and bias) before the first barrier, indexing within a row in 32 bits.
//
// The forward takes them for any number of rows that fit a block. For few
// rows (decode: 1 to a few hundred) each SM has one block and nothing hides
// latency: a launch takes about as long as its warps' instruction streams
// (Nsight Compute: 7 cycles an instruction), so these kernels are specialized
// for RMSNorm or LayerNorm at compile time, and for the common row lengths
// (with_row_vecs, v9), and keep their reductions short.
// With so few rows that half the SMs would idle, two blocks share each row
// (v8). For many rows they move more bytes a second than the generic
// kernels' ring and staged parameters (benchmarks/NOTES.md, v6 and v7).
//
// The backward takes them for few rows only. One row: one block writes dx,
// dscale and dbias. More rows: the column plan, two launches. The first, one
// block a row, writes each row's two dot products and statistics (computed
// there where none are given); the second gives each
// block a slice of the columns of every row, so that it writes dx there and
// sums dscale/dbias of its columns itself. No atomics and no partial rows:
// the same bits on every run.
#pragma once

#include "cuda/row_norm_kernels.cuh"

namespace jaxnorm::cuda {

constexpr int kFewNv = 2;            // 16-byte vectors a thread, few rows
constexpr int kBlockThreads = 1024;  // forward block, at most
constexpr int kFewBwdThreads = 512;  // backward block, at most

// Where a thread's NV vectors lie in its row: register i holds vector
// lane + (i ^ flip) * step. kVecs = 0: the row's length is known at run time,
// the block has blockDim.x threads, and vectors past the row's end are zeros.
// kVecs > 0: the row has exactly kVecs vectors, NV for each of kVecs / NV
// threads, all known to the compiler, which then drops the bounds checks and
// addresses the row with immediate offsets.
template <int kVecs, int NV>
struct RowSpan {
  static_assert(kVecs % NV == 0 && (kVecs == 0 || kVecs / NV % 32 == 0));
  static constexpr int kWarps = kVecs / NV / 32;  // of the block (0: known at run time)
  int nvec, lane, step, flip;

  __device__ __forceinline__ explicit RowSpan(int64_t row_vecs, int flip_ = 0)
      : nvec(kVecs > 0 ? kVecs : int(row_vecs)),
        lane(threadIdx.x),
        step(kVecs > 0 ? kVecs / NV : int(blockDim.x)),
        flip(flip_) {}
  __device__ __forceinline__ int at(int i) const { return lane + (i ^ flip) * step; }
  __device__ __forceinline__ bool in(int i) const { return kVecs > 0 || at(i) < nvec; }
};

// Loads a thread's first N (at most NV) vectors of a row, as `span` places
// them.
template <int VEC, int N, int kVecs, int NV, typename T>
__device__ __forceinline__ void load_row(RegVec<T, VEC> (&v)[N], const T* row,
                                         const RowSpan<kVecs, NV>& span) {
  static_assert(N <= NV);
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = load_or_zero<VEC>(row, span.at(i), span.in(i));
}

// Element k of the NV * VEC a thread holds, in the accumulation type.
template <int VEC, int NV, typename T>
__device__ __forceinline__ acc_t<T> element(const RegVec<T, VEC> (&v)[NV], int k) {
  return v[k / VEC].get(k % VEC);
}

// term(I) + ... + term(I + N - 1) as a balanced tree: dependency chains of
// log2(N) adds rather than N, each term computed where the tree needs it.
template <int N, int I = 0, typename F>
__device__ __forceinline__ auto tree_sum(F&& term) {
  if constexpr (N == 1) {
    return term(I);
  } else {
    return tree_sum<N / 2, I>(term) + tree_sum<N - N / 2, I + N / 2>(term);
  }
}

// Sums v over aligned groups of kLanes lanes (a power of two), as a butterfly.
template <int kLanes = 32, typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// K sums for each warp of a block that holds one row (blockDim.x a multiple
// of 32).
template <int K, typename A>
struct WarpSlots {
  Packed<A, K> v[32];
};

// Sums K values over the block (one row); every thread gets the totals. Each
// warp's sums go to `slots`; then lane w of every warp reads warp w's, and a
// butterfly adds them up: a fixed order, the same bits in every thread. One
// barrier; `slots` must not be written again by this block. A loop over the
// warps instead (its trip count known at run time only) compiled to 8% more
// instructions in RMSNorm's decode forward (benchmarks/NOTES.md, v7). With
// the block's warps known at compile time (kWarps > 0, a power of two), each
// group of kWarps lanes reads all the warps' sums and adds them in log2(kWarps)
// steps rather than 5: the same tree, so the same bits. On an H200 that took
// the LayerNorm forward at 64x4096 from 1.66 to 1.57 µs (v9).
template <int kWarps = 0, int K, typename A>
__device__ __forceinline__ void block_sum(A (&v)[K], WarpSlots<K, A>& slots) {
  static_assert(kWarps >= 0 && kWarps <= 32 && (kWarps & (kWarps - 1)) == 0);
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) slots.v[threadIdx.x / 32].v[k] = v[k];
  }
  __syncthreads();
  Packed<A, K> p = {};
  constexpr int kLanes = kWarps > 0 ? kWarps : 32;
  if constexpr (kWarps > 0) {
    p = slots.v[lane % kWarps];
  } else if (lane < int(blockDim.x / 32)) {
    p = slots.v[lane];
  }
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum<kLanes>(p.v[k]);
}

// A row's mean (0 unless kCentered) and 1 / sqrt(variance + epsilon) in the
// decode kernels, from the NV vectors each thread holds as load_row(..., span)
// left them (zeros past the row's end): exact two passes over the registers,
// one block_sum each. A flip permutes the registers in pairs of tree_sum's
// halves, so the sums, and the statistics, keep their bits. Merging
// (mean, M2) pairs instead, per warp (v7) or per lane (v8), measured no
// faster (benchmarks/NOTES.md).
template <bool kCentered, typename A, int VEC, int NV, int kVecs, typename X>
__device__ __forceinline__ void block_row_stats(const RegVec<X, VEC> (&xv)[NV],
                                                const RowSpan<kVecs, NV>& span, A inv_n,
                                                A epsilon, WarpSlots<1, A> (&slots)[2],
                                                A& mean, A& rstd) {
  auto x = [&](int k) { return element(xv, k); };
  mean = 0;
  if constexpr (kCentered) {
    A s[1] = {tree_sum<NV * VEC>(x)};
    block_sum<RowSpan<kVecs, NV>::kWarps>(s, slots[0]);
    mean = s[0] * inv_n;
  }
  A ss[1] = {tree_sum<NV * VEC>([&](int k) {
    const A d = x(k) - mean;  // x is 0 past the row's end: d * d is 0 there for RMSNorm only
    return kCentered && !span.in(k / VEC) ? A(0) : d * d;
  })};
  block_sum<RowSpan<kVecs, NV>::kWarps>(ss, slots[1]);
  rstd = rsqrt_acc(ss[0] * inv_n + epsilon);
}

// ----------------------------------------------------------------- forward

// The long-row forward (8 or 16 vectors a thread at up to 512 threads with y,
// 8 at up to 1024 for the statistics: one or two blocks an SM) loads the
// residual after x, each vector just before its h is stored, and scale and
// bias at their use, after the reduction: its registers hold the row. Loaded
// from global memory there, each vector waited behind the thread's previous
// store (the compiler moves no load past one), a memory round trip a vector
// with no other block on the SM to fill the wait (benchmarks/NOTES.md, v18).
// So each thread copies its own vectors of them into shared memory (cp.async)
// kSlots - 1 vectors ahead of their use: no registers, no barrier (no thread
// reads another's cells). The 4-vector forward copies its residual the same
// way, all of it in flight with x: one vector at a time, the round trips
// left its SM short of bytes in flight even with four blocks on it (v39).
// kTensors: 2 for scale and bias, else 1 (the scale, or the residual alone).
// kBudget: bytes a thread, for up to 8 slots, at least 2.
template <typename W, int VEC, int kTensors, int kBudget = 128>
struct LateLoads {
  static constexpr int kCell = int(sizeof(W)) * VEC;  // bytes of one vector
  static constexpr int kCellPad = kCell < 16 ? 16 : kCell;
  static constexpr int kFit = kBudget / (kCellPad * kTensors);
  static constexpr int kSlots = kFit < 2 ? 2 : kFit > 8 ? 8 : kFit;
  using Stages = CpAsyncStages<kSlots>;
  unsigned char* base;

  static constexpr __host__ __device__ size_t bytes(int threads) {
    return size_t(kSlots) * kTensors * kCellPad * threads;
  }
  __device__ __forceinline__ unsigned char* at(int slot, int k) const {
    return base + ((slot * kTensors + k) * int(blockDim.x) + int(threadIdx.x)) * kCellPad;
  }
  template <typename T>
  __device__ __forceinline__ const T* cell(int slot, int k) const {
    return reinterpret_cast<const T*>(at(slot, k));
  }
  // Starts copying the vector at src (a vector of W, or of X for the residual:
  // 16 bytes, at most a cell) into tensor k's cell of `slot`.
  template <typename T>
  __device__ __forceinline__ void issue(int slot, int k, const T* src) const {
    static_assert(int(sizeof(T)) * VEC <= kCellPad);
    cp_async_bytes<int(sizeof(T)) * VEC>(at(slot, k), src);
  }
  template <typename T>
  __device__ __forceinline__ void read(RegVec<T, VEC>& v, int slot, int k) const {
    v.load_shared(reinterpret_cast<const uint4*>(at(slot, k)));
  }
};

// The fused residual add (add_store) of fwd_block with 4 or more vectors a
// thread, its residual through `late`'s first cells, up to 8 vectors in flight
// with x. before_stores() runs once the copies are under way: loads placed
// after the first store of h would wait for the residual to arrive.
template <int VEC, int NV, typename X, int kVecs, typename Late, typename F>
__device__ __forceinline__ void add_residual_late(RegVec<X, VEC> (&xv)[NV], const FwdArgs& a,
                                                  int64_t row_start,
                                                  const RowSpan<kVecs, NV>& span,
                                                  const Late& late, F&& before_stores) {
  const X* res = static_cast<const X*>(a.residual) + row_start;
  X* out = static_cast<X*>(a.new_residual) + row_start;
  auto issue = [&](int slot, int64_t i) {
    if (i < NV && span.in(int(i))) late.issue(slot, 0, res + span.at(int(i)) * VEC);
  };
  Late::Stages::prime(issue, 0, 1);
  before_stores();
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    Late::Stages::advance(i % Late::kSlots, i, 1, issue);
    if (!span.in(i)) continue;
    RegVec<X, VEC> r;
    late.read(r, i % Late::kSlots, 0);
    add_store(xv[i], r, out + span.at(i) * VEC);
  }
}

// fwd_block's LateLoads: scale and bias (LayerNorm with y), else one tensor.
// 128 bytes a thread: 64 KB for 512 threads, two blocks an SM.
template <typename W, int VEC, bool kCentered, bool kWriteY>
using FwdLateLoads = LateLoads<W, VEC, kCentered && kWriteY ? 2 : 1, 128>;

// Whether fwd_block loads scale and bias late (LateLoads): with y, 8 or more
// vectors a thread, and not early.
template <int NV, bool kWriteY, bool kEarlyParams>
constexpr bool fwd_late_params() {
  return kWriteY && !kEarlyParams && NV >= 8;
}

// The residual's LateLoads where the parameters have none: a cell for each
// of up to 8 vectors of x a thread.
template <typename X, int VEC, int NV>
using ResidualLateLoads = LateLoads<X, VEC, 1, 16 * (NV < 8 ? NV : 8)>;

// Dynamic shared memory of fwd_block: its LateLoads, where it has them.
template <typename X, typename W, int VEC, int NV, bool kCentered, bool kWriteY,
          bool kEarlyParams>
constexpr size_t fwd_block_smem(int threads, bool residual) {
  if (fwd_late_params<NV, kWriteY, kEarlyParams>()) {
    return FwdLateLoads<W, VEC, kCentered, true>::bytes(threads);
  }
  return residual && NV >= 4 ? ResidualLateLoads<X, VEC, NV>::bytes(threads) : 0;
}

// Largest block of fwd_block: with y written, 4 or more vectors of x, scale
// and bias need more than the 64 registers a 1024-thread block leaves.
constexpr int fwd_block_threads(int nv, bool write_y) {
  return write_y && nv > kFewNv ? 512 : kBlockThreads;
}

// One block a row, grid = rows * kSplit. kCentered: LayerNorm (else
// RMSNorm). kWriteY = false writes the statistics only (the forward of a
// gradient, whose output is unused). kEarlyParams loads scale and bias with x,
// before the reduction, rather than at their use: one memory round trip
// fewer, for more registers; otherwise, with 8 or more vectors a thread, they
// come through shared memory (LateLoads). kSplit > 1 (decode only): kSplit
// blocks share a row; each reduces all of it (with the same bits:
// block_row_stats) and normalizes and writes NV / kSplit of its vectors, the
// registers its flip brings first. kRowVecs > 0 (decode only): rows of
// exactly that many vectors, kRowVecs / NV threads a block (RowSpan).
template <typename X, typename Y, typename W, int VEC, int NV, bool kCentered, bool kWriteY,
          bool kEarlyParams, int kSplit = 1, int kRowVecs = 0, int kParts = 1>
__device__ __forceinline__ void fwd_block_row(const FwdArgs& a) {
  using A = acc_t<X>;
  static_assert(kSplit == 1 || (NV == kFewNv && NV % kSplit == 0 && kWriteY));
  static_assert(kRowVecs == 0 || NV == kFewNv);
  static_assert(kParts == 1 || (kSplit == 1 && NV > kFewNv && kWriteY));
  constexpr int kOwn = NV / kSplit;  // vectors this block writes
  constexpr bool kHold = kWriteY && kEarlyParams;
  constexpr int kHeld = kHold ? kOwn : 1;  // parameter vectors held
  __shared__ WarpSlots<1, A> slots[2];  // the statistics' two sums
  const int hidden = kRowVecs > 0 ? kRowVecs * VEC : int(a.hidden);
  const int64_t row = blockIdx.x / (kSplit * kParts);
  const int part = blockIdx.x % kSplit;
  // With a cluster a row (kParts > 1), the block of rank r takes the row's
  // slice of vectors [r * slice, (r + 1) * slice): the pointers below start
  // there, and the row's sums are added over the cluster (ClusterSum).
  const int rank = kParts > 1 ? int(blockIdx.x % kParts) : 0;
  const int row_vecs = hidden / VEC, slice = (row_vecs + kParts - 1) / kParts;
  const int first = rank * slice * VEC;  // the slice's first element
  const RowSpan<kRowVecs, NV> span(kParts > 1 ? max(0, min(slice, row_vecs - rank * slice))
                                              : row_vecs,
                                   part * kOwn);
  const bool use_w = kWriteY && a.has_scale, use_b = kWriteY && kCentered && a.has_bias;
  const W* scale = static_cast<const W*>(a.scale) + (use_w ? first : 0);
  const W* bias = static_cast<const W*>(a.bias) + (use_b ? first : 0);
  const X* xr = static_cast<const X*>(a.x) + row * hidden + first;
  RegVec<X, VEC> xv[NV];
  RegVec<W, VEC> wv[kHeld], bv[kHeld];
  load_row(xv, xr, span);
  __shared__ __align__(16) typename ClusterSum<A, 4>::Shared cluster_shared;
  ClusterSum<A, 4> cluster(cluster_shared);
  if constexpr (kParts > 1) cluster.init();  // x in flight; before any cp.async
  // LateLoads: the residual, and with y and 8 or more vectors, scale and bias
  // (the residual's cells then are theirs: its add is done before their
  // first copy).
  constexpr bool kLateResidual = NV >= 4;
  constexpr bool kLate = fwd_late_params<NV, kWriteY, kEarlyParams>();
  using Late = FwdLateLoads<W, VEC, kCentered, kWriteY>;
  using ResidualLate = std::conditional_t<kLate, Late, ResidualLateLoads<X, VEC, NV>>;
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  const Late late{dyn};
  auto issue_params = [&](int slot, int64_t i) {  // vector i's scale and bias, into slot
    if (i >= kOwn || !span.in(int(i))) return;
    if (use_w) late.issue(slot, 0, scale + span.at(int(i)) * VEC);
    if (use_b) late.issue(slot, 1, bias + span.at(int(i)) * VEC);
  };
  auto load_params = [&] {
    if constexpr (kHold) {
      if (use_w) load_row(wv, scale, span);
      if (use_b) load_row(bv, bias, span);
    } else if constexpr (kLate) {
      Late::Stages::prime(issue_params, 0, 1);  // in flight through the reduction
    }
  };
  const bool residual = kSplit == 1 && a.residual;  // never split (launch_fwd_block)
  if constexpr (kLateResidual) {
    // Parameters held in registers are loaded before the residual add's
    // stores, which no load passes; late ones after it, in its cells.
    if (residual) {
      add_residual_late(xv, a, row * hidden + first, span, ResidualLate{dyn}, [&] {
        if constexpr (kHold) load_params();
      });
    }
    if (!(kHold && residual)) load_params();
  } else if (residual) {
    load_params();  // before the residual add's stores, which no load passes
    add_residual<NV == kFewNv ? NV : 1>(xv, a, row * hidden + first,
                                        [&](int i) { return span.in(i); },
                                        [&](int i) { return span.at(i); });
  } else {
    load_params();  // where ptxas places it: after the first sum (v9)
  }
  A mean, rstd;
  const A inv_n = A(1) / A(hidden);
  if constexpr (NV == kFewNv) {
    block_row_stats<kCentered>(xv, span, inv_n, A(a.epsilon), slots, mean, rstd);
  } else {
    // Many rows: the generic kernels' statistics, centered or not at run
    // time. With block_row_stats, ptxas gave LayerNorm's 4-vector kernels
    // 64-83 registers instead of 52-64, which cost the SM a block and up to
    // 9% at 8192x12288 (benchmarks/NOTES.md, v7).
    auto row_sum = [&](auto& v, auto& warp_slots) {
      block_sum(v, warp_slots);
      if constexpr (kParts > 1) cluster(v, kParts);
    };
    row_stats<A, VEC, NV>(xv, span.lane, span.step, span.nvec, a.centered, A(a.epsilon), inv_n,
                          mean, rstd, [&](A (&v)[1], int k) { row_sum(v, slots[k]); });
  }
  if (span.lane == 0 && part == 0 && rank == 0) {
    if (kCentered) static_cast<A*>(a.mean)[row] = mean;
    static_cast<A*>(a.rstd)[row] = rstd;
  }
  if constexpr (kWriteY) {
    if constexpr (kHold) {
      for (auto& v : wv) v.forget_converted();
      for (auto& v : bv) v.forget_converted();
    }
    Y* yr = static_cast<Y*>(a.y) + row * hidden + first;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      if constexpr (kLate) Late::Stages::advance(i % Late::kSlots, i, 1, issue_params);
      if (!span.in(i)) continue;
      const int c = span.at(i);
      A w[VEC], b[VEC];
      if constexpr (kHold) {
        unpack(w, wv[i]);
        unpack(b, bv[i]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) w[e] += A(a.scale_offset);
      } else if constexpr (kLate) {
        // As plain loads (load_vec): read as RegVec words, LayerNorm's
        // 8-vector kernel took 78 registers instead of 64 and lost its second
        // block on the SM (v18).
        if (use_w) load_scale(w, late.template cell<W>(i % Late::kSlots, 0), a.scale_offset);
        if (use_b) load_vec(b, late.template cell<W>(i % Late::kSlots, 1));
      } else {
        if (use_w) load_scale(w, scale + c * VEC, a.scale_offset);
        if (use_b) load_vec(b, bias + c * VEC);
      }
      normalize_store<VEC, kCentered>(yr + c * VEC, xv[i], mean, rstd, w, use_w, b, use_b);
    }
  }
}

template <typename X, typename Y, typename W, int VEC, int NV, bool kCentered, bool kWriteY,
          bool kEarlyParams, int kSplit = 1, int kRowVecs = 0>
__global__ void __launch_bounds__(fwd_block_threads(NV, kWriteY)) fwd_block(FwdArgs a) {
  fwd_block_row<X, Y, W, VEC, NV, kCentered, kWriteY, kEarlyParams, kSplit, kRowVecs>(a);
}

constexpr int kLongNv = 16;  // vectors a thread of fwd_block on the longest rows
// Rows of 4097-8192 vectors with y (up to 65536 16-bit elements) split over
// a cluster of kParts blocks of 8 vectors a thread (fwd_block_row's kParts):
// more SMs for a row where few rows would leave SMs idle, and smaller blocks
// than one a row for LayerNorm, which holds all 16 vectors in registers, one
// block an SM. Two blocks of 512 threads an SM: 64 registers, except for
// LayerNorm with y wider than x, which spilled under that bound (ptxas: 8
// bytes with bf16 x and float32 y and scale).
template <typename X, typename Y, typename W, bool kCentered>
constexpr int fwd_cluster_min_blocks() {
  return kCentered && sizeof(Y) > sizeof(X) ? 1 : 2;
}
template <typename X, typename Y, typename W, int VEC, bool kCentered, int kParts>
__global__ void __launch_bounds__(512, (fwd_cluster_min_blocks<X, Y, W, kCentered>()))
    fwd_cluster(FwdArgs a) {
  fwd_block_row<X, Y, W, VEC, 8, kCentered, true, false, 1, 0, kParts>(a);
}
template <typename X, typename Y, typename W, int VEC, bool kCentered, int kParts>
cudaError_t launch_fwd_cluster(cudaStream_t stream, const DeviceInfo& dev, const FwdArgs& a) {
  const int threads = threads_per_row((a.hidden / VEC + kParts - 1) / kParts, 8);
  auto kernel = fwd_cluster<X, Y, W, VEC, kCentered, kParts>;
  const size_t smem = FwdLateLoads<W, VEC, kCentered, true>::bytes(threads);
  if (const cudaError_t e = allow_dynamic_smem_once(kernel, smem, dev); e != cudaSuccess) {
    return e;
  }
  return launch_clusters(kernel, unsigned(a.rows * kParts), threads, smem, kParts, stream, a);
}
// Blocks a row of fwd_cluster for the rows fwd_block would give 16 vectors a
// thread (0: fwd_block, the only choice without clusters, before sm_90). On
// an H200 (bf16, rows of 65536, benchmarks/NOTES.md, v26 and v30): 4 up to
// about a block an SM (1 to 34 rows; RMSNorm 1 row 7.8 -> 3.8 us), 2 up to a
// row an SM (128 rows, against one block: RMSNorm 9.2 -> 8.1, LayerNorm
// 12.4 -> 10.8), 4 beyond (512 rows: RMSNorm 44.5 -> 35.2, LayerNorm 54.8 ->
// 41.3). 8 in place of 4 where each of the 8 blocks still holds 4 warps
// (rows of 6145-8192 vectors): on H100s (v55) 512x65536 RMSNorm 47.3 ->
// 46.7, LayerNorm 50.3 -> 49.3, 1024x57344 80.8 -> 80.0 and 83.5 -> 82.6,
// 34x65536 5.0 -> 4.5 and 6.2 -> 5.6; on an H200 (v77) 512x65536 RMSNorm
// 35.4 -> 35.1, LayerNorm 41.1 -> 40.3, 34x65536 4.8 -> 4.3 and 6.2 -> 5.6,
// but LayerNorm 2048x65536 149.2 -> 150.1. With blocks of 3 warps (40960
// and 49152 wide) it tied or lost up to 3%, and 2 stays best at 128 rows
// (8 blocks: 8.7 -> 9.3).
inline int fwd_cluster_parts(int64_t rows, int64_t row_vecs, const DeviceInfo& dev) {
  const int64_t sms = dev.sms;
  if (!dev.clusters) return 0;
  if (4 * rows > sms + sms / 4 && rows <= sms) return 2;
  const int64_t slice = (row_vecs + kMaxClusterParts - 1) / kMaxClusterParts;
  const bool four_warps = threads_per_row(slice, 8) == 4 * 32;
  return four_warps ? kMaxClusterParts : 4;
}

// Rows of 3841-4096 vectors (32768 bf16: fwd_block's 512 threads at 8) with y,
// no residual and at least 2 rows an SM, where DRAM is fast: a cluster of 2
// blocks a row (fwd_cluster) in place of one block. H200, 2048x32768 (the
// plans harness, benchmarks/NOTES.md v79): LayerNorm 75.2-75.6 -> 71.6-72.0
// us, RMSNorm 68.0-68.3 -> 67.1. Not timed where DRAM is slow.
inline bool fwd_row_halves(int64_t rows, int64_t row_vecs, bool residual,
                           const DeviceInfo& dev) {
  return dev.clusters && !residual && !dram_is_slow(dev) && rows >= 2 * int64_t(dev.sms) &&
         threads_per_row(row_vecs, 8) == 512;
}

// Vectors a thread with which fwd_block serves a launch, or 0 where it does
// not. Few rows (at most 4 an SM): 2, where a row fits a block that way.
// Otherwise 4 with y written, 8 for statistics only, when a row fills at
// least a warp (two warps for statistics): on shorter rows the generic
// kernels' several rows a block are faster. Measured on an H200
// (benchmarks/NOTES.md, v6). A block is at least a warp. The fused residual
// add holds more registers: 4 for statistics only too. Rows too long for
// 512 threads at 4 take 8 or 16 a thread with y (up to 8192 vectors, 65536
// bf16), 8 for the statistics with the residual (at up to 1024 threads),
// with scale, bias and residual loaded late (v14) through shared memory
// (LateLoads, v18). Rows of one warp at 4 (1024 bf16) take 2 for RMSNorm
// and for the residual add: 0.5-8% faster at 4096-262144 rows on an H200;
// LayerNorm alone ran 0-8% slower that way there (v42), but 1.2-2.6% faster
// at 16384-262144 rows on H100s, where DRAM is slow (v56).
inline int block_fwd_nv(int64_t rows, int64_t nvec, bool write_y, bool residual, bool centered,
                        const DeviceInfo& dev) {
  const int sms = dev.sms;
  if (rows > (int64_t(1) << 30)) return 0;
  const int few_tpr = threads_per_row(nvec, kFewNv);
  if (rows <= 4 * int64_t(sms) && few_tpr >= 32 && few_tpr <= kBlockThreads) return kFewNv;
  const int nv = write_y || residual ? 4 : 8;
  const int tpr = threads_per_row(nvec, nv);
  if (tpr < (nv == 4 ? 32 : 64)) return 0;
  // A row of one warp at 4 vectors (1024 bf16) makes blocks of 32 threads,
  // of which an SM holds 1024; at 2 vectors, 64 threads, 2048 an SM.
  if (write_y && tpr == 32 && (!centered || residual || dram_is_slow(dev))) return kFewNv;
  if (tpr <= fwd_block_threads(nv, write_y || residual)) return nv;
  if (write_y) {
    for (int long_nv : {8, 16}) {  // no spills at 512 threads (ptxas)
      if (threads_per_row(nvec, long_nv) <= fwd_block_threads(long_nv, true)) return long_nv;
    }
  } else if (residual && threads_per_row(nvec, 8) <= fwd_block_threads(8, false)) {
    return 8;
  }
  return 0;
}

// Whether the decode forward gives each row two blocks: for LayerNorm where
// no SM gets two, for RMSNorm up to two rows an SM. On an H200 (bf16), two
// blocks a row took 3-8% less time at 1 to 32 rows; at 64 rows, 2% less for
// LayerNorm 4096 wide and 8% at 8192 (v8, v9). RMSNorm with its row length
// fixed (v9) gained at every decode shape measured, 1 to 256 rows of 4096 and
// 8192: 0.1-0.3 µs, 256x8192 3.1 -> 2.9 (benchmarks/NOTES.md, v13); LayerNorm
// at 256x8192 lost (3.5 -> 4.4).
inline bool split_rows(int64_t rows, int sms, bool centered) {
  return centered ? 2 * rows <= sms : rows <= 2 * int64_t(sms);
}

// Calls f(std::integral_constant<int, V>) with V = nvec for the row lengths
// (in 16-byte vectors) that have decode kernels (the forward and the
// backward's row dots) compiled for them, V = 0 for the others: 2048, 4096
// and 8192 wide in bf16/f16, 1024 to 4096 in f32.
// Fixed at compile time, the kernel drops its bounds checks and address
// arithmetic (RowSpan) and shortens its block sums (block_sum): on an H200
// the first took the LayerNorm forward at 64x4096 from 1.92 to 1.66 µs and
// RMSNorm's from 1.54 to 1.38-1.41 (benchmarks/NOTES.md, v9).
template <typename F>
cudaError_t with_row_vecs(int64_t nvec, F&& f) {
  switch (nvec) {
    case 256: return f(std::integral_constant<int, 256>{});
    case 512: return f(std::integral_constant<int, 512>{});
    case 1024: return f(std::integral_constant<int, 1024>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// Whether the 4-vector forward at `threads` a row, for many rows, loads scale
// and bias with x (early) rather than at their use: where the SM still holds
// 1024 threads that way (with float32 parameters the kernel takes 106
// registers instead of 54); with the residual, unless that costs the SM more
// than a quarter of its blocks. On an H200 (bf16) early loads were 1-14%
// faster wherever they left 1024 threads, even at a third fewer blocks
// (RMSNorm 2048x8192: 4 blocks of 256 threads, not 6, 19.3 -> 17.9 µs), and
// 9% slower where they left 768 (LayerNorm at 384 threads a block: 2 blocks,
// not 3); with the residual, RMSNorm lost 0-2.5% at 4 blocks of 6
// (benchmarks/NOTES.md, v6, v7 and v25).
template <typename X, typename Y, typename W, int VEC, bool kC>
bool fwd_loads_early(int threads, bool residual, const DeviceInfo& dev) {
  const size_t smem = fwd_block_smem<X, W, VEC, 4, kC, true, true>(threads, residual);
  auto blocks = [&](auto kernel) { return blocks_per_sm(kernel, threads, smem, dev); };
  const int early = blocks(fwd_block<X, Y, W, VEC, 4, kC, true, true>);
  if (!residual) return early * threads >= 1024;
  return 4 * early >= 3 * blocks(fwd_block<X, Y, W, VEC, 4, kC, true, false>);
}

// Launches fwd_block with nv vectors a thread (an answer of block_fwd_nv).
// Scale and bias are loaded with x for few rows, where nothing else would
// hide a second memory round trip; for many rows as fwd_loads_early says.
// Rows for 16 vectors a thread go to a cluster of blocks (fwd_cluster_parts).
template <typename X, typename Y, typename W, int VEC>
cudaError_t launch_fwd_block(cudaStream_t stream, const DeviceInfo& dev, int nv,
                             const FwdArgs& a) {
  const int threads = threads_per_row(a.hidden / VEC, nv);
  auto launch = [&](void (*kernel)(FwdArgs), int split = 1, size_t smem = 0) {
    if (smem > 0) {  // LateLoads
      if (const cudaError_t e = allow_dynamic_smem_once(kernel, smem, dev); e != cudaSuccess) {
        return e;
      }
    }
    kernel<<<unsigned(a.rows * split), threads, smem, stream>>>(a);
    return cudaGetLastError();
  };
  return with_centered(a.centered, [&](auto centered) {
    constexpr bool kC = decltype(centered)::value;
    const bool residual = a.residual != nullptr;
    if (!a.write_y) {  // neither y nor the parameters: one kernel for every Y and W
      auto stats = [&](auto vectors) {
        constexpr int N = decltype(vectors)::value;
        return launch(fwd_block<X, X, X, VEC, N, kC, false, false>, 1,
                      fwd_block_smem<X, X, VEC, N, kC, false, false>(threads, residual));
      };
      if (nv == 8) return stats(std::integral_constant<int, 8>{});
      if (nv == 4) return stats(std::integral_constant<int, 4>{});
      return with_row_vecs(a.hidden / VEC, [&](auto vecs) {
        constexpr int V = decltype(vecs)::value;
        return launch(fwd_block<X, X, X, VEC, kFewNv, kC, false, false, 1, V>);
      });
    }
    if (nv == kFewNv) {
      return with_row_vecs(a.hidden / VEC, [&](auto vecs) {
        constexpr int V = decltype(vecs)::value;
        // Blocks that share a row would race on new_residual when it aliases residual.
        if (split_rows(a.rows, dev.sms, kC) && !a.residual) {
          return launch(fwd_block<X, Y, W, VEC, kFewNv, kC, true, true, 2, V>, 2);
        }
        return launch(fwd_block<X, Y, W, VEC, kFewNv, kC, true, true, 1, V>);
      });
    }
    if (nv == kLongNv) {
      switch (fwd_cluster_parts(a.rows, a.hidden / VEC, dev)) {
        case 2: return launch_fwd_cluster<X, Y, W, VEC, kC, 2>(stream, dev, a);
        case 4: return launch_fwd_cluster<X, Y, W, VEC, kC, 4>(stream, dev, a);
        case 8: return launch_fwd_cluster<X, Y, W, VEC, kC, 8>(stream, dev, a);
      }
    }
    if (nv == 8 && fwd_row_halves(a.rows, a.hidden / VEC, residual, dev)) {
      return launch_fwd_cluster<X, Y, W, VEC, kC, 2>(stream, dev, a);
    }
    if (nv == 8 || nv == kLongNv) {
      auto kernel = nv == 8 ? fwd_block<X, Y, W, VEC, 8, kC, true, false>
                            : fwd_block<X, Y, W, VEC, kLongNv, kC, true, false>;
      return launch(kernel, 1, FwdLateLoads<W, VEC, kC, true>::bytes(threads));
    }
    // 4 vectors: the residual's cells alone, early parameters or not.
    const size_t smem = fwd_block_smem<X, W, VEC, 4, kC, true, true>(threads, residual);
    const bool early = fwd_loads_early<X, Y, W, VEC, kC>(threads, residual, dev);
    return launch(early ? fwd_block<X, Y, W, VEC, 4, kC, true, true>
                        : fwd_block<X, Y, W, VEC, 4, kC, true, false>,
                  1, smem);
  });
}

// ---------------------------------------------------------------- backward

// What the column plan's first launch leaves for its second, a row's:
// mean(g * xhat), mean(g) (LayerNorm), mean and rstd.
template <typename A>
using RowTerms = Packed<A, 4>;

// One block a row. kDots: the column plan's first launch, which writes each
// row's RowTerms to a.partial and nothing else. Otherwise the grid is one
// block (one row), which writes dx, dscale and dbias. kCentered: LayerNorm
// (else RMSNorm). kOwn: no statistics given (a.rstd null, the forward's
// output dead): the block computes them from the x it holds, in the same
// reduction as the dots (RowDots), which spares the statistics-only forward
// a launch. Given a residual (kOwn then; null without one), h = x + residual
// stands for x. kRowVecs > 0: rows of exactly that many vectors (RowSpan).
template <typename X, typename G, typename W, int VEC, bool kCentered, bool kDots, bool kOwn,
          int kRowVecs = 0>
__global__ void __launch_bounds__(kFewBwdThreads) bwd_few(BwdArgs a, const void* residual) {
  using A = acc_t<X>;
  constexpr RowDots kMode = !kOwn ? RowDots::kSaved
                            : kCentered ? RowDots::kOwnLn : RowDots::kOwnRms;
  // Row sums: with saved statistics g * xhat (and g); else as kMode.
  constexpr int NV = kFewNv, K = kOwn ? row_dot_count(kMode) : kCentered ? 2 : 1;
  __shared__ WarpSlots<K, A> slots;
  const int64_t row = blockIdx.x, hidden = kRowVecs > 0 ? kRowVecs * VEC : a.hidden;
  const RowSpan<kRowVecs, NV> span(hidden / VEC);
  RegVec<W, VEC> wv[NV];
  RegVec<X, VEC> xv[NV];
  RegVec<G, VEC> gv[NV];
  if (a.has_scale) load_row(wv, static_cast<const W*>(a.scale), span);
  load_row(xv, static_cast<const X*>(a.x) + row * hidden, span);
  load_row(gv, static_cast<const G*>(a.dy) + row * hidden, span);
  const X* res = static_cast<const X*>(residual);
  if (res != nullptr) {
    res += row * hidden;
    RegVec<X, VEC> rv[NV];
    load_row(rv, res, span);
#pragma unroll
    for (int i = 0; i < NV; ++i) add_vec(xv[i], rv[i]);
  }
  Dres<X, VEC> dres[NV];
  if constexpr (!kDots) {
#pragma unroll
    for (int i = 0; i < NV; ++i) dres[i].load(a, row * hidden + span.at(i) * VEC, span.in(i));
  }
  // The saved statistics; or LayerNorm's shift (the row's first element) and
  // rstd 1 until the sums are in.
  A mean = 0, rstd = 1;
  if constexpr (!kOwn) {
    mean = kCentered ? static_cast<const A*>(a.mean)[row] : A(0);
    rstd = static_cast<const A*>(a.rstd)[row];
  } else if constexpr (kCentered) {  // any shift near the mean will do: h's first, unrounded
    mean = to_acc(static_cast<const X*>(a.x)[row * hidden]);
    if (res != nullptr) mean += to_acc(res[0]);
  }
  // g = dy * scale and xhat of the thread's element k (g is 0 past the row's end)
  auto g = [&](int k) {
    const A d = element(gv, k);
    return a.has_scale ? d * (element(wv, k) + A(a.scale_offset)) : d;
  };
  auto xhat = [&](int k) { return (element(xv, k) - mean) * rstd; };
  A s[K];
  if constexpr (!kOwn) {  // rstd taken out of the sum: one multiply less an element
    s[0] = rstd * tree_sum<NV * VEC>([&](int k) { return g(k) * (element(xv, k) - mean); });
    if constexpr (kCentered) s[K - 1] = tree_sum<NV * VEC>(g);
  } else {
    // x - shift, 0 past the row's end (where x is 0).
    auto xs = [&](int k) { return span.in(k / VEC) ? element(xv, k) - mean : A(0); };
#pragma unroll
    for (int j = 0; j < K; ++j) {
      s[j] = tree_sum<NV * VEC>([&](int k) { return row_dot_term<kMode>(j, g(k), xs(k)); });
    }
  }
  block_sum<RowSpan<kRowVecs, NV>::kWarps>(s, slots);
  const A inv_n = A(1) / A(hidden);
  A c_gx, c_g;
  if constexpr (kOwn) {
    row_dx_terms<kMode>(s, kCentered, A(a.epsilon), inv_n, mean, rstd, c_gx, c_g);
  } else {
    c_gx = s[0] * inv_n;
    c_g = kCentered ? s[K - 1] * inv_n : A(0);
  }
  if constexpr (kDots) {
    if (span.lane == 0) static_cast<RowTerms<A>*>(a.partial)[row] = {{c_gx, c_g, mean, rstd}};
    return;
  }
  X* dxr = static_cast<X*>(a.dx) + row * hidden;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (!span.in(i)) continue;
    const int c = span.at(i);
    A d[VEC], xh[VEC], o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      d[e] = gv[i].get(e);
      xh[e] = xhat(i * VEC + e);
      o[e] = rstd * (g(i * VEC + e) - c_g - xh[e] * c_gx);
    }
    dres[i].add_to(o, a);
    store_vec(dxr + c * VEC, o);
    if (a.has_bias) store_vec(static_cast<W*>(a.dbias) + c * VEC, d);
    if (a.has_scale) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) d[e] *= xh[e];
      store_vec(static_cast<W*>(a.dscale) + c * VEC, d);
    }
  }
}

// The column plan's second launch. Block b takes vectors [b * kColVecs,
// (b + 1) * kColVecs) of every row: thread t vector t % kColVecs of rows
// t / kColVecs, + kColRows, ..., so that the block sums dscale and dbias of
// its columns over all rows itself (row slots of a warp by slot_sum_scatter,
// then the warps in order: the same bits on every run) and writes them; with each
// row's dots from a.partial it also writes dx. A warp covers 8 rows of 64
// bytes. Given a residual, it adds it to x as bwd_few does.
constexpr int kColVecs = 4, kColThreads = 256, kColRows = kColThreads / kColVecs, kColBatch = 4;

// Sums v over the lanes that share lane % kColVecs, in place. Each step
// halves the elements a lane keeps (the half its partner does not) until one
// is left; any further steps add that one (both lanes then hold the same
// sum). Lane l's v[0] ends as element (l / kColVecs) / (lanes holding it) of
// the sum. Both lanes of a pair add the same two values: the same bits on
// every run.
template <int VEC, typename A>
__device__ __forceinline__ void slot_sum_scatter(A (&v)[VEC], int lane) {
  int n = VEC;
#pragma unroll
  for (int off = 16; off >= kColVecs; off /= 2) {
    const bool upper = lane & off;
    if (n > 1) {
      n /= 2;
#pragma unroll
      for (int e = 0; e < VEC / 2; ++e) {
        if (e >= n) break;
        const A give = upper ? v[e] : v[e + n], keep = upper ? v[e + n] : v[e];
        v[e] = keep + __shfl_xor_sync(0xffffffffu, give, off);
      }
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
    }
  }
}

template <typename X, typename G, typename W, int VEC, bool kCentered>
__global__ void __launch_bounds__(kColThreads) bwd_cols(BwdArgs a, const void* residual) {
  using A = acc_t<X>;
  __shared__ Packed<A, VEC> sums[2][kColThreads / 32][kColVecs];  // [region][warp][vector]
  const int j = threadIdx.x % kColVecs, slot = threadIdx.x / kColVecs;
  const int64_t c = int64_t(blockIdx.x) * kColVecs + j, nvec = a.hidden / VEC;
  const bool in = c < nvec;
  const auto* terms = static_cast<const RowTerms<A>*>(a.partial);
  A w[VEC], dw[VEC] = {}, db[VEC] = {};
#pragma unroll
  for (int e = 0; e < VEC; ++e) w[e] = A(1);
  if (a.has_scale && in) load_scale(w, static_cast<const W*>(a.scale) + c * VEC, a.scale_offset);
  // kColBatch rows' inputs loaded before any of their dx is stored: the
  // compiler moves no load past a store (inline PTX), so a row at a time cost
  // a memory round trip a row (benchmarks/NOTES.md, v12).
  for (int64_t first = slot; in && first < a.rows; first += kColBatch * kColRows) {
    RegVec<X, VEC> xv[kColBatch], rv[kColBatch];
    RegVec<G, VEC> gv[kColBatch];
    Dres<X, VEC> dres[kColBatch];
    RowTerms<A> terms_of[kColBatch];
#pragma unroll
    for (int u = 0; u < kColBatch; ++u) {
      const int64_t row = first + u * kColRows, at = row * a.hidden + c * VEC;
      if (row >= a.rows) continue;
      xv[u].load(static_cast<const X*>(a.x) + at);
      if (residual != nullptr) rv[u].load(static_cast<const X*>(residual) + at);
      gv[u].load(static_cast<const G*>(a.dy) + at);
      dres[u].load(a, at);
      terms_of[u] = terms[row];
    }
#pragma unroll
    for (int u = 0; u < kColBatch; ++u) {
      const int64_t row = first + u * kColRows, at = row * a.hidden + c * VEC;
      if (row >= a.rows) continue;
      if (residual != nullptr) add_vec(xv[u], rv[u]);
      const auto [c_gx, c_g, mean, rstd] = terms_of[u].v;
      A o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A d = gv[u].get(e), xh = (xv[u].get(e) - mean) * rstd;
        o[e] = rstd * (d * w[e] - c_g - xh * c_gx);
        dw[e] += d * xh;
        if constexpr (kCentered) db[e] += d;
      }
      dres[u].add_to(o, a);
      store_vec(static_cast<X*>(a.dx) + at, o);
    }
  }
  // Over the warp's row slots (lane bits 2-4), each lane keeping the half of
  // its sums that its partner gives away (a reduce-scatter): lane l ends with
  // element l / 4 of its vector (VEC = 8), after 7 shuffles a gradient
  // instead of 24.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  slot_sum_scatter(dw, lane);
  if constexpr (kCentered) slot_sum_scatter(db, lane);
  constexpr int kSame = 32 / kColVecs / VEC;  // lanes left holding the same element
  if ((lane / kColVecs) % kSame == 0) {
    const int e = lane / kColVecs / kSame;
    sums[0][warp][j].v[e] = dw[0];
    sums[1][warp][j].v[e] = db[0];
  }
  __syncthreads();
  const int region = threadIdx.x / kColVecs;  // of the gradients: dscale, then dbias
  if (!in || region >= int(a.has_scale) + int(a.has_bias)) return;
  const int r = a.has_scale ? region : 1;
  A total[VEC] = {};
  for (int wp = 0; wp < kColThreads / 32; ++wp) {
    const Packed<A, VEC> p = sums[r][wp][j];
#pragma unroll
    for (int e = 0; e < VEC; ++e) total[e] += p.v[e];
  }
  store_vec(static_cast<W*>(r == 0 ? a.dscale : a.dbias) + c * VEC, total);
}

// How the few-rows backward runs; blocks = 0 where it does not serve.
struct FewBwdPlan {
  int threads = 0;           // of the one-block-a-row launch
  int blocks = 0;            // rows
  bool columns = false;      // the column plan (more than one row)
  size_t partial_bytes = 0;  // scratch for its RowTerms
};

// A row must fit one block of at least a warp, and there be at most 4 rows an
// SM. One row: one block. More: the column plan, which measured faster than a
// cluster summing in distributed shared memory (up to 16 rows) and than
// partial rows summed by sum_partials, at every row count from 2 to 512
// (benchmarks/NOTES.md, v7).
template <typename X, int VEC>
FewBwdPlan plan_bwd_few(int64_t rows, int64_t hidden, const DeviceInfo& dev) {
  static_assert(VEC > 1, "16-byte vectors only");
  FewBwdPlan p;
  const int tpr = threads_per_row(hidden / VEC, kFewNv);
  if (tpr < 32 || tpr > kFewBwdThreads || rows > 4 * int64_t(dev.sms)) return p;
  p.threads = tpr;
  p.blocks = int(rows);
  p.columns = rows > 1;
  if (p.columns) p.partial_bytes = size_t(rows) * sizeof(RowTerms<acc_t<X>>);
  return p;
}

// Runs the plan, with a.partial pointing at partial_bytes of scratch. Without
// statistics (a.rstd null) the first launch computes them (kOwn), of x +
// residual where that is not null.
template <typename X, typename G, typename W, int VEC>
cudaError_t launch_bwd_few(cudaStream_t stream, const FewBwdPlan& p, const BwdArgs& a,
                           const void* residual = nullptr) {
  return with_centered(a.centered, [&](auto centered) {
    constexpr bool kC = decltype(centered)::value;
    return with_flag(a.rstd == nullptr, [&](auto own) {
      constexpr bool kOwn = decltype(own)::value;
      const cudaError_t err = with_row_vecs(a.hidden / VEC, [&](auto vecs) {
        constexpr int V = decltype(vecs)::value;
        auto first = p.columns ? bwd_few<X, G, W, VEC, kC, true, kOwn, V>
                               : bwd_few<X, G, W, VEC, kC, false, kOwn, V>;
        first<<<unsigned(p.blocks), p.threads, 0, stream>>>(a, residual);
        return cudaGetLastError();
      });
      if (err != cudaSuccess || !p.columns) return err;
      const unsigned grid = unsigned((a.hidden / VEC + kColVecs - 1) / kColVecs);
      bwd_cols<X, G, W, VEC, kC><<<grid, kColThreads, 0, stream>>>(a, residual);
      return cudaGetLastError();
    });
  });
}

}  // namespace jaxnorm::cuda
