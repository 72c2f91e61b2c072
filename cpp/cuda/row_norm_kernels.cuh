// CUDA kernels for the row norms, RMSNorm (centered = false) and LayerNorm
// (centered = true), forward and backward, with the launch planning. The FFI
// handlers are in row_norm.cu; benchmarks/kernels/ times the plans directly.
// The forward runs here only where row_norm_block.cuh's one-block-a-row
// kernel does not serve; the backward, for all but few rows.
//
// Register path: a row is split over `tpr` threads that each hold NV 16-byte
// vectors of it in registers, packed in the input dtype (bf16 stays bf16: half
// the registers of fp32), so x and dy are read from DRAM exactly once. Rows of
// up to 4 vectors a thread stream through a cp.async ring in shared memory, so
// that the next row's loads are in flight while a row is reduced; the
// forward stages scale and bias in shared memory once per block, the backward
// keeps a staged row in the ring and the thread's scale in registers
// (bwd_scale_in_regs). Short rows pack several
// rows into one block. Rows too long for registers take the long path: one
// block per row, re-reading the row (mostly from L2) for each pass.
//
// Backward: a persistent grid. Each thread owns the same columns for every row
// it visits, so it accumulates dscale/dbias for them in fp32 in its own slice
// of shared memory or in registers (no atomics), and loads its scale once.
// Each block then writes one partial row, and a second kernel sums the
// partials in a fixed order: gradients are bitwise reproducible. A grid of
// one block writes the gradients itself.
#pragma once

#include "cuda/common.cuh"

namespace jaxnorm::cuda {

constexpr int kMaxRowThreads = 512;  // register path, per row and per block
constexpr int kLongThreads = 1024;   // long path
constexpr int kBlockTarget = 256;    // threads per block when rows are short
constexpr int kMaxNv = 8;            // vectors per thread, register path
constexpr int kMaxBwdNv = 4;         // (the backward holds x and dy)
constexpr size_t kTwoBlocksSmem = 110 * 1024;  // two blocks per SM still fit
// Blocks of the backward that hold dscale/dbias in registers (bwd_regs) have
// at most this many threads (12288 bf16 a row, or a cluster's slice of a
// longer one), so that ptxas may give them 168 registers.
constexpr int kAccRegsThreads = 384;
constexpr int kMaxSliceThreads = 256;  // the backward's cluster split, first plan
// Scale and bias are staged in shared memory up to this size.
constexpr size_t kMaxStagedParams = 32 * 1024;

struct FwdArgs {
  const void* x;
  const void* scale;
  const void* bias;
  void* y;
  void* mean;
  void* rstd;
  int64_t rows, hidden;
  int tpr, rows_per_block;
  double epsilon;
  bool centered, has_scale, has_bias, write_y;
  bool stage_params;  // scale/bias staged in shared memory
  // The fused residual add (row_norm_args.h): nullptr without one.
  // new_residual may alias residual.
  const void* residual = nullptr;
  void* new_residual = nullptr;
  float scale_offset = 0;  // 1 with zero-centered scale: y = xhat * (1 + scale)
};

struct BwdArgs {
  const void* x;
  const void* scale;
  const void* mean;
  const void* rstd;
  const void* dy;
  void* dx;
  void* partial;  // [regions][gridDim.x][hidden] fp32 (fp64) partial rows
                  // (none with one block); few rows: [rows] RowTerms
  void* dscale;
  void* dbias;
  int64_t rows, hidden;
  int tpr, rows_per_block;
  bool centered, has_scale, has_bias;
  bool stage_params;  // scale staged in shared memory, after the accumulators
  const void* dres = nullptr;  // added to dx: the cotangent of new_residual
  float scale_offset = 0;
  int parts = 1;  // blocks (a cluster) sharing each row, a slice of it each
  // mean and rstd null: the register path computes each row's statistics from
  // the x it holds, with the forward's epsilon (row_norm_args.h).
  double epsilon = 0;
};
// 128 bytes. A pointer more (136) made ptxas spill in bwd_regs' one-block
// kernel with its accumulators in registers, 4-6% slower on an H200
// (benchmarks/NOTES.md v68), which is why the backward's residual
// (row_norm_args.h) is an argument of its own where a kernel takes one.
static_assert(sizeof(BwdArgs) == 128);

// How a launch covers the rows. nv = 0 means the long path.
struct RowPlan {
  int nv = 0;           // 16-byte vectors per thread
  int tpr = 0;          // threads per row
  int rows_per_block = 1;
  int parts = 1;        // blocks a row (backward: a cluster), one row a block
  int64_t groups = 0;   // blocks' worth of rows (clusters' with parts > 1)
  bool held = false;    // backward split: bwd_regs' kHold, planned (full_held_split)
  int threads() const { return nv ? tpr * rows_per_block : kLongThreads; }
};

// Threads for a row of `nvec` vectors at `nv` per thread: a power of two up to
// a warp, then whole warps.
inline int threads_per_row(int64_t nvec, int nv) {
  const int64_t need = (nvec + nv - 1) / nv;
  if (need > 32) return int((need + 31) / 32 * 32);
  int tpr = 1;
  while (tpr < need) tpr *= 2;
  return tpr;
}

// The plan for a given nv (0: long path). Blocks hold about kBlockTarget
// threads; with few rows, fewer rows per block so that more SMs take part.
inline RowPlan plan_with_nv(int64_t rows, int64_t nvec, int nv, int sms) {
  RowPlan p;
  p.nv = nv;
  if (nv == 0) {
    p.groups = rows;
    return p;
  }
  p.tpr = threads_per_row(nvec, nv);
  int rpb = p.tpr >= kBlockTarget ? 1 : kBlockTarget / p.tpr;
  while (rpb > 1 && (rows + rpb - 1) / rpb < 2 * int64_t(sms)) rpb /= 2;
  p.rows_per_block = rpb;
  p.groups = (rows + rpb - 1) / rpb;
  return p;
}

// The plans below were chosen from benchmarks/kernels/row_norm_plans.cu on an
// H200 (results in benchmarks/NOTES.md); nvec counts 16-byte vectors, so the
// same rules serve every dtype.

inline RowPlan one_row_per_block(RowPlan p, int64_t rows) {
  p.rows_per_block = 1;
  p.groups = rows;
  return p;
}

// The element-wise path (VEC = 1), forward and backward: 4 elements a thread,
// else the long path.
inline RowPlan elementwise_plan(int64_t rows, int64_t nvec, int sms) {
  return plan_with_nv(rows, nvec, nvec <= kMaxRowThreads * 4 ? 4 : 0, sms);
}

// Forward (and the statistics-only forward) where row_norm_block.cuh's
// kernel does not serve (the handler asks it first), which leaves: rows of up
// to 128 vectors, 4 per thread, several rows per block, staged; statistics of
// rows up to 504 vectors (under two warps at 8 a thread), 8 per thread
// straight to registers, one row per (small) block; rows too long for a
// block (more than 8192 vectors with y, 16 a thread), the long path. 16
// vectors a thread here spilled registers (ptxas, bf16: 28-48 bytes).
inline RowPlan plan_fwd(int64_t rows, int64_t nvec, int vec, int sms) {
  if (vec == 1) return elementwise_plan(rows, nvec, sms);
  if (nvec <= 128) return plan_with_nv(rows, nvec, 4, sms);
  if (nvec <= 1024) return one_row_per_block(plan_with_nv(rows, nvec, 8, sms), rows);
  return plan_with_nv(rows, nvec, nvec <= kMaxNv * kMaxRowThreads ? kMaxNv : 0, sms);
}

// A kernel instantiation: NV vectors a thread.
template <int NV>
struct Variant {
  static constexpr int nv = NV;
};

// Calls f(Variant<NV>{}) for the instantiation that serves the plan: 4 or 8
// vectors a thread (at most kMax), 4 elements when VEC = 1.
template <int VEC, int kMax = kMaxNv, typename F>
auto with_variant(const RowPlan& p, F&& f) {
  static_assert(kMax == 4 || kMax == 8);
  if constexpr (VEC > 1 && kMax == 8) {
    if (p.nv > 4) return f(Variant<8>{});
  }
  return f(Variant<4>{});
}

// Calls f(std::bool_constant<flag>{}), for kernels that take the flag as a
// template parameter (with_centered: LayerNorm or RMSNorm).
template <typename F>
auto with_flag(bool flag, F&& f) {
  return flag ? f(std::true_type{}) : f(std::false_type{});
}
template <typename F>
auto with_centered(bool centered, F&& f) {
  return with_flag(centered, f);
}

// Writes VEC outputs (x - mean) * rstd [* w] [+ b] of one vector to dst.
// kFoldMean (LayerNorm's fwd_block_row): for 16-bit x, xhat as one FMA,
// x * rstd + (-mean * rstd), up to 3.5% off that forward (notes v41). Its extra
// rounding, of mean * rstd, is 2^-24 |mean| / std, far below what x itself
// carries, 2^-8 (bf16) or 2^-11 (f16) of |mean| / std.
template <int VEC, bool kFoldMean = false, typename Y, typename X, typename A>
__device__ __forceinline__ void normalize_store(Y* dst, const RegVec<X, VEC>& x, A mean,
                                                A rstd, const A (&w)[VEC], bool use_w,
                                                const A (&b)[VEC], bool use_b) {
  constexpr bool kFold = kFoldMean && sizeof(X) == 2;
  A o[VEC];
  if constexpr (kFold) {
    // All of xhat before the affine step: in one loop with it, the 8-vector
    // kernel takes 72 registers instead of 64.
    const A shift = -mean * rstd;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = fmaf(x.get(e), rstd, shift);
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    if constexpr (!kFold) o[e] = (x.get(e) - mean) * rstd;
    if (use_w) o[e] *= w[e];
    if (use_b) o[e] += b[e];
  }
  store_vec(dst, o);
}

// Vector c of a row when it is in the row, else zeros.
template <int VEC, typename T>
__device__ __forceinline__ RegVec<T, VEC> load_or_zero(const T* row, int64_t c,
                                                       bool in) {
  RegVec<T, VEC> v;
  v.zero();
  if (in) v.load(row + c * VEC);
  return v;
}

// VEC elements of scale (as the kernels apply it: 1 + scale when
// zero-centered) at p.
template <int VEC, typename A, typename W>
__device__ __forceinline__ void load_scale(A (&w)[VEC], const W* p, float offset) {
  load_vec(w, p);
#pragma unroll
  for (int e = 0; e < VEC; ++e) w[e] += A(offset);
}

// The fused residual add of one vector: x becomes h = x + r, rounded to X as
// the unfused sum would be.
template <int VEC, typename X>
__device__ __forceinline__ void add_vec(RegVec<X, VEC>& x, const RegVec<X, VEC>& r) {
  acc_t<X> h[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) h[e] = x.get(e) + r.get(e);
  x.pack(h);
}

// add_vec, then h stored to `out` (new_residual).
template <int VEC, typename X>
__device__ __forceinline__ void add_store(RegVec<X, VEC>& x, const RegVec<X, VEC>& r, X* out) {
  add_vec(x, r);
  x.store_global(out);
}

// The fused residual add of vectors in(i) of a thread's NV (add_store). at(i)
// is vector i's index in the row. A thread reads each element of residual
// before it writes the same element of new_residual, and no other thread
// touches it, so the two may alias.
// kAhead vectors are loaded before the first of them is stored: the compiler
// moves no load past a store (inline PTX), so in the decode kernels loading
// vector i + 1 after storing vector i cost a memory round trip
// (benchmarks/NOTES.md, v12). The generic kernels keep kAhead = 1: more
// would cost them registers. fwd_block with 4 or more vectors a thread has a
// way of its own (LateLoads in row_norm_block.cuh).
template <int kAhead, int VEC, int NV, typename X, typename In, typename At>
__device__ __forceinline__ void add_residual(RegVec<X, VEC> (&xv)[NV], const FwdArgs& a,
                                             int64_t row_start, In&& in, At&& at) {
  static_assert(kAhead == 1 || kAhead == NV);
  const X* res = static_cast<const X*>(a.residual) + row_start;
  X* out = static_cast<X*>(a.new_residual) + row_start;
  if constexpr (kAhead == 1) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (!in(i)) continue;
      RegVec<X, VEC> r;
      r.load(res + int64_t(at(i)) * VEC);
      add_store(xv[i], r, out + int64_t(at(i)) * VEC);
    }
  } else {
    RegVec<X, VEC> r[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (in(i)) r[i].load(res + int64_t(at(i)) * VEC);
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (in(i)) add_store(xv[i], r[i], out + int64_t(at(i)) * VEC);
    }
  }
}

// The cotangent of new_residual (dres), added to dx in the backward of the
// fused residual add. Loaded ahead of the stores of dx, not where it is
// added: there, behind earlier stores, each vector cost a memory round trip
// of its own (benchmarks/NOTES.md, v12).
template <typename X, int VEC>
struct Dres {
  RegVec<X, VEC> v;
  __device__ __forceinline__ void load(const BwdArgs& a, int64_t at, bool in = true) {
    if (a.dres != nullptr && in) v.load(static_cast<const X*>(a.dres) + at);
  }
  template <typename A>
  __device__ __forceinline__ void add_to(A (&o)[VEC], const BwdArgs& a) const {
    if (a.dres == nullptr) return;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] += v.get(e);
  }
};

// Starts copying scale and bias into shared memory, 16 bytes at a time, and
// points `scale` and `bias` at the copies. They complete with the thread's next
// cp.async group.
template <typename W>
__device__ __forceinline__ void stage_params(const W*& scale, const W*& bias,
                                             int64_t hidden, W* smem) {
  W* staged_bias = smem + (scale ? hidden : 0);
  const int64_t chunks = hidden * int64_t(sizeof(W)) / 16;
  for (int64_t k = threadIdx.x; k < chunks; k += blockDim.x) {
    if (scale) cp_async16(reinterpret_cast<uint4*>(smem) + k,
                          reinterpret_cast<const uint4*>(scale) + k);
    if (bias) cp_async16(reinterpret_cast<uint4*>(staged_bias) + k,
                         reinterpret_cast<const uint4*>(bias) + k);
  }
  if (scale) scale = smem;
  if (bias) bias = staged_bias;
}

// Shared memory for staged scale and bias, or 0 when they are read from global
// memory (the element-wise path, rows not a whole number of 16-byte chunks,
// or parameters too large to stage).
template <typename W, int VEC>
size_t staged_param_bytes(int64_t hidden, int params) {
  const size_t bytes = size_t(params) * hidden * sizeof(W);
  const bool whole = hidden * sizeof(W) % 16 == 0;
  return VEC > 1 && whole && bytes <= kMaxStagedParams ? bytes : 0;
}

// The register path streams rows through a ring of shared-memory stages:
// while a thread works on one row, the cp.async copies of its next rows are in
// flight, so the bytes in flight do not cost registers. Each thread copies and
// reads only its own vectors (vector i of thread t of tensor k in stage s at
// ((s * kTensors + k) * NV + i) * blockDim + t: a warp reads 512 consecutive
// bytes), so a stage needs no barrier. The element-wise path (VEC = 1) loads
// straight into registers, as does kUnstaged (a tensor wider than x, whose VEC
// elements exceed a slot's 16 bytes: a float32 dy with bfloat16 x).
template <int VEC, int NV, int kTensors, bool kUnstaged = false, int kDepth = 2>
struct Ring {
  // Long rows (8+ vectors a thread) have enough bytes in flight per thread
  // without staging; their stages would not fit in shared memory either.
  static constexpr bool kStaged = VEC > 1 && NV <= 4 && !kUnstaged;
  // kDepth - 1 rows in flight while the thread works on another.
  static constexpr int kStages = kStaged ? kDepth : 1;
  using Stages = CpAsyncStages<kStages>;
  uint4* base;

  static constexpr __host__ __device__ size_t bytes(int threads) {
    return kStaged ? size_t(kStages) * kTensors * NV * threads * sizeof(uint4) : 0;
  }
  __device__ uint4* at(int stage, int k, int i) const {
    return base + ((stage * kTensors + k) * NV + i) * blockDim.x + threadIdx.x;
  }
  // Starts the copies of the thread's vectors of `row` (nullptr: none).
  // kNarrow: the row's vectors are counted in 32 bits (nvec < 2^31).
  template <bool kNarrow = false, typename T>
  __device__ void issue(int stage, int k, const T* row, int lane, int tpr,
                        int64_t nvec) const {
    if constexpr (kStaged) {
      if (row == nullptr) return;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if constexpr (kNarrow) {
          const int c = lane + i * tpr;
          if (c < int(nvec)) cp_async16(at(stage, k, i), row + c * VEC);
        } else {
          const int64_t c = lane + int64_t(i) * tpr;
          if (c < nvec) cp_async16(at(stage, k, i), row + c * VEC);
        }
      }
    }
  }
  // The thread's vectors of `row`, zeros where there are none.
  template <typename T>
  __device__ void read(RegVec<T, VEC> (&v)[NV], int stage, int k, const T* row,
                       bool valid, int lane, int tpr, int64_t nvec) const {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = lane + int64_t(i) * tpr;
      if constexpr (kStaged) {
        v[i].zero();
        if (valid && c < nvec) v[i].load_shared(at(stage, k, i));
      } else {
        v[i] = load_or_zero<VEC>(row, c, valid && c < nvec);
      }
    }
  }
};

// bwd_regs' kBulk (a BulkFill ring, common.cuh): a split block's x and dy
// reach a stage of the ring as one bulk copy (TMA) each, issued by thread 0,
// in place of each thread's cp.async of its own vectors (~140 of the ~1060
// instructions a thread spent on a row of RMSNorm's split at 65536 wide,
// sm_90 SASS). With one row a block and tpr == blockDim, a block's slice of a
// row and its place in a stage (Ring::at) are both contiguous. Thread 0
// refills the stage of the row before after the current row's cluster sums,
// which every warp sends only after reading that row: the wait on empty[s]
// then never holds warp 0. Refilled at the row's start instead, as the
// cp.async ring does, the wait held warp 0, and with it the cluster's sums
// (LayerNorm 8192x12288 2.3x as long); refilled there only where the stage
// was empty already, RMSNorm 512x65536 gained 1% where the refill after the
// sums gained 7% (benchmarks/NOTES.md v58).

// A thread's place on the register path: its lane within its row, its row's
// slot within the block, and the row length in vectors.
// With `parts` blocks a row, block part p of its cluster takes the row's
// slice of vectors [p * span, (p + 1) * span): nvec is the slice's length and
// col0 its first element.
template <typename A>
struct RowThread {
  int lane, slot;
  int64_t nvec, col0 = 0;
  A inv_n;  // 1 / hidden
  __device__ RowThread(int tpr, int64_t hidden, int vec, int parts = 1)
      : lane(threadIdx.x % tpr), slot(threadIdx.x / tpr), nvec(hidden / vec),
        inv_n(A(1) / A(hidden)) {
    if (parts > 1) {
      const int64_t span = (nvec + parts - 1) / parts, first = blockIdx.x % parts * span;
      nvec = nvec - first < span ? nvec - first : span;
      col0 = first * vec;
    }
  }
};

// ----------------------------------------------------------------- forward

// The mean (0 for RMSNorm) and rstd of a row whose thread holds NV vectors of
// it in xv (vector lane + i * tpr of the row when that is below nvec, zeros
// past the end). sum(v, k) sums v over the row's threads, k = 0 for the mean,
// 1 for the variance; every thread must call row_stats.
template <typename A, int VEC, int NV, typename T, typename Sum>
__device__ __forceinline__ void row_stats(const RegVec<T, VEC> (&xv)[NV], int lane, int tpr,
                                          int64_t nvec, bool centered, A epsilon, A inv_n,
                                          A& mean, A& rstd, Sum&& sum) {
  mean = 0;
  if (centered) {
    A s[1] = {0};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) s[0] += xv[i].get(e);
    }
    sum(s, 0);
    mean = s[0] * inv_n;
  }
  A ss[1] = {0};
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (lane + int64_t(i) * tpr >= nvec) continue;
#pragma unroll
    for (int e = 0; e < VEC; ++e) ss[0] += (xv[i].get(e) - mean) * (xv[i].get(e) - mean);
  }
  sum(ss, 1);
  rstd = rsqrt_acc(ss[0] * inv_n + epsilon);
}

template <typename X, typename Y, typename W, int VEC, int NV>
__global__ void __launch_bounds__(kMaxRowThreads) fwd_regs(FwdArgs a) {
  using A = acc_t<X>;
  using R = Ring<VEC, NV, 1>;
  __shared__ A smem[32];
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  const R ring{reinterpret_cast<uint4*>(dyn)};
  const RowThread<A> t(a.tpr, a.hidden, VEC);
  const bool use_w = a.write_y && a.has_scale, use_b = a.write_y && a.has_bias;
  const W* w_src = use_w ? static_cast<const W*>(a.scale) : nullptr;
  const W* b_src = use_b ? static_cast<const W*>(a.bias) : nullptr;
  if (a.stage_params && a.write_y) {
    stage_params(w_src, b_src, a.hidden, reinterpret_cast<W*>(dyn + R::bytes(blockDim.x)));
  }
  auto row_ptr = [&](int64_t g) -> const X* {  // this thread's row of group g
    const int64_t row = g * a.rows_per_block + t.slot;
    return row < a.rows ? static_cast<const X*>(a.x) + row * a.hidden : nullptr;
  };
  auto issue = [&](int stage, int64_t g) {
    ring.issue(stage, 0, row_ptr(g), t.lane, a.tpr, t.nvec);
  };
  // The ring loop is written out here and in bwd_regs: behind a shared helper
  // taking the body as a lambda, ptxas gave this kernel 13-16 more registers
  // (benchmarks/NOTES.md, v5).
  R::Stages::prime(issue, blockIdx.x, gridDim.x);
  int stage = 0;
  for (int64_t g = blockIdx.x; g * a.rows_per_block < a.rows; g += gridDim.x) {
    R::Stages::advance(stage, g, gridDim.x, issue);
    const int64_t row = g * a.rows_per_block + t.slot;
    const bool valid = row < a.rows;
    RegVec<X, VEC> xv[NV];
    ring.read(xv, stage, 0, row_ptr(g), valid, t.lane, a.tpr, t.nvec);
    stage = (stage + 1) % R::kStages;
    if (a.residual) {
      auto at = [&](int i) { return t.lane + int64_t(i) * a.tpr; };
      add_residual<1>(xv, a, row * a.hidden, [&](int i) { return valid && at(i) < t.nvec; }, at);
    }
    A mean, rstd;
    row_stats(xv, t.lane, a.tpr, t.nvec, a.centered, A(a.epsilon), t.inv_n, mean, rstd,
              [&](A (&v)[1], int) { row_sum(v, a.tpr, smem); });
    if (valid && t.lane == 0) {
      if (a.centered) static_cast<A*>(a.mean)[row] = mean;
      static_cast<A*>(a.rstd)[row] = rstd;
    }
    if (!a.write_y) continue;
    if (a.stage_params) __syncthreads();  // every thread's parameter copies
    if (!valid) continue;
    Y* yr = static_cast<Y*>(a.y) + row * a.hidden;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = t.lane + int64_t(i) * a.tpr;
      if (c >= t.nvec) continue;
      A w[VEC], b[VEC];
      if (use_w) load_scale(w, w_src + c * VEC, a.scale_offset);
      if (use_b) load_vec(b, b_src + c * VEC);
      normalize_store(yr + c * VEC, xv[i], mean, rstd, w, use_w, b, use_b);
    }
  }
  cp_async_wait<0>();  // no copy may outlive the block
}

// Sum over a row of f(x_vector) on the long path (one block per row).
template <int VEC, typename A, typename T, typename F>
__device__ __forceinline__ A long_row_sum(const T* row, int64_t nvec, A* smem,
                                          F f) {
  A s[1] = {0};
  for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
    A v[VEC];
    load_vec(v, row + c * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) s[0] += f(v[e]);
  }
  row_sum(s, blockDim.x, smem);
  return s[0];
}

template <typename X, typename Y, typename W, int VEC>
__global__ void __launch_bounds__(kLongThreads) fwd_long(FwdArgs a) {
  using A = acc_t<X>;
  __shared__ A smem[32];
  const int64_t nvec = a.hidden / VEC;
  const A inv_n = A(1) / A(a.hidden);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const X* xr = static_cast<const X*>(a.x) + row * a.hidden;
    if (a.residual) {  // one pass writes h; the others read it back (each thread its own)
      for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
        RegVec<X, VEC> v[1];
        v[0].load(xr + c * VEC);
        add_residual<1>(v, a, row * a.hidden, [](int) { return true; }, [c](int) { return c; });
      }
      xr = static_cast<const X*>(a.new_residual) + row * a.hidden;
    }
    A mean = 0;
    if (a.centered) {
      mean = long_row_sum<VEC>(xr, nvec, smem, [](A v) { return v; }) * inv_n;
    }
    const A var = long_row_sum<VEC>(xr, nvec, smem, [mean](A v) {
                    return (v - mean) * (v - mean);
                  }) * inv_n;
    const A rstd = rsqrt_acc(var + A(a.epsilon));
    if (threadIdx.x == 0) {
      if (a.centered) static_cast<A*>(a.mean)[row] = mean;
      static_cast<A*>(a.rstd)[row] = rstd;
    }
    if (!a.write_y) continue;
    Y* yr = static_cast<Y*>(a.y) + row * a.hidden;
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      A o[VEC], w[VEC], b[VEC];
      load_vec(o, xr + c * VEC);
      if (a.has_scale) load_scale(w, static_cast<const W*>(a.scale) + c * VEC, a.scale_offset);
      if (a.has_bias) load_vec(b, static_cast<const W*>(a.bias) + c * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        o[e] = (o[e] - mean) * rstd;
        if (a.has_scale) o[e] *= w[e];
        if (a.has_bias) o[e] += b[e];
      }
      store_vec(yr + c * VEC, o);
    }
  }
}

// ---------------------------------------------------------------- backward
//
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale, with the
// mean(g) term only for LayerNorm; dscale = sum_rows dy * xhat, dbias = sum dy.

// The backward's shared-memory accumulators are chunks of at most 16 bytes;
// thread (slot, lane) keeps element chunk h of its vector i at chunk index
// (i * kChunks + h) * tpr + lane of its slot's region, so that a warp's
// accesses are consecutive (no bank conflicts).
template <typename A, int VEC>
struct AccLayout {
  static constexpr int K = VEC * sizeof(A) > 16 ? int(16 / sizeof(A)) : VEC;
  static constexpr int kChunks = VEC / K;
  using Chunk = Packed<A, K>;
};

// What the backward's first pass sums over a row, g = dy * scale:
enum class RowDots {
  kSaved,   // with the forward's statistics: sum g * xhat, sum g
  kOwnRms,  // RMSNorm computing rstd: sum g * x, sum x * x
  // LayerNorm computing mean and rstd, about a shift k, the row's first
  // element: sum g * (x - k), sum (x - k)^2, sum (x - k), sum g. One
  // reduction instead of three (the mean, then the variance about it, then the
  // dots: 25-50% on the kernel, v15). The shift is what keeps the variance
  // from cancelling: x - k is of the order of the row's spread, not its
  // mean. What cancels, (mean - k)^2 / var, is at most n even where k is the
  // row's outlier (its own square alone makes var >= (k - mean)^2 / n).
  kOwnLn,
};

constexpr int row_dot_count(RowDots mode) { return mode == RowDots::kOwnLn ? 4 : 2; }

// Term j of the row sums for one element; xh is xhat (kSaved) or x - k.
template <RowDots kMode, typename A>
__device__ __forceinline__ A row_dot_term(int j, A g, A xh) {
  switch (j) {
    case 0: return g * xh;
    case 1: return kMode == RowDots::kSaved ? g : xh * xh;
    case 2: return xh;
    default: return g;
  }
}

// Adds one vector to the row sums.
template <RowDots kMode, int VEC, typename A>
__device__ __forceinline__ void add_row_dots(A (&s)[row_dot_count(kMode)], const A (&g)[VEC],
                                             const A (&xh)[VEC]) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
#pragma unroll
    for (int j = 0; j < row_dot_count(kMode); ++j) s[j] += row_dot_term<kMode>(j, g[e], xh[e]);
  }
}

// From a row's sums: the dx terms c_gx = mean(g * xhat) and c_g = mean(g)
// (LayerNorm), and, computing them, the statistics. mean holds the saved
// mean or the shift k, rstd the saved rstd.
template <RowDots kMode, typename A>
__device__ __forceinline__ void row_dx_terms(const A (&s)[row_dot_count(kMode)], bool centered,
                                             A epsilon, A inv_n, A& mean, A& rstd, A& c_gx,
                                             A& c_g) {
  if constexpr (kMode == RowDots::kSaved) {
    c_gx = s[0] * inv_n;
    c_g = centered ? s[1] * inv_n : A(0);
  } else if constexpr (kMode == RowDots::kOwnRms) {
    rstd = rsqrt_acc(s[1] * inv_n + epsilon);
    c_gx = s[0] * rstd * inv_n;  // sum g * xhat = rstd * sum g * x
    c_g = 0;
  } else {
    const A shifted_mean = s[2] * inv_n;
    const A var = s[1] * inv_n - shifted_mean * shifted_mean;
    mean += shifted_mean;
    rstd = rsqrt_acc((var > A(0) ? var : A(0)) + epsilon);
    // sum g * (x - mean) = sum g * (x - k) - (mean - k) * sum g
    c_gx = (s[0] - shifted_mean * s[3]) * rstd * inv_n;
    c_g = s[3] * inv_n;
  }
}

// The backward's arithmetic, in a long form and (kLean) a short one. The
// cluster split's kernels, with few warps an SM, are short of issue slots,
// and the short form took RMSNorm's 2048x32768 backward from 121 to 114 us
// and 512x65536's from 68 to 65 (H200, benchmarks/NOTES.md v37). The other
// kernels, at 86-100% of copy, measured 2-11% slower with it for RMSNorm (and
// LayerNorm 65536x1024 5%; as with v20's cuts) and keep the long form.
//
// What a pass knows of xhat = (x - mean) * rstd: all of it (the saved
// statistics, or the second pass), or, in a first pass that computes them,
// x - shift (LayerNorm, rstd still 1) or x (RMSNorm), which saves the short
// form a multiply by 1 and a subtraction of 0 an element.
enum class Xhat { kScaled, kShifted, kRaw };

constexpr Xhat first_pass_xhat(RowDots mode, bool lean) {
  return !lean || mode == RowDots::kSaved ? Xhat::kScaled
         : mode == RowDots::kOwnLn       ? Xhat::kShifted
                                         : Xhat::kRaw;
}

// xhat of one element of x. The short form for 16-bit x is one FMA (mean *
// rstd is computed once a row): x * rstd is exact in it, and the rounding of
// mean * rstd, an error of |mean| * rstd * 2^-24, stays under 16-bit precision
// while the mean is within 2^12 standard deviations of 0. Wider x keeps the
// subtraction first, which is exact where x is near the mean.
template <Xhat kForm, bool kLean, typename X, typename A>
__device__ __forceinline__ A xhat_of(A x, A mean, A rstd) {
  if constexpr (kForm == Xhat::kRaw) {
    return x;
  } else if constexpr (kForm == Xhat::kShifted) {
    return x - mean;
  } else if constexpr (kLean && sizeof(X) == 2) {
    return x * rstd - mean * rstd;
  } else {
    return (x - mean) * rstd;
  }
}

// dx = rstd * (g - c_g - xhat * c_gx); the short form is two FMAs, with
// -rstd * c_gx and -rstd * c_g computed once a row.
template <bool kLean, typename A>
__device__ __forceinline__ A dx_of(A g, A xh, A rstd, A c_g, A c_gx) {
  if constexpr (kLean) return g * rstd + (xh * (-rstd * c_gx) + (-rstd * c_g));
  return rstd * (g - c_g - xh * c_gx);
}

// acc[j] += v, chunk by chunk.
template <typename A, int VEC>
__device__ __forceinline__ void accumulate(typename AccLayout<A, VEC>::Chunk* acc,
                                           int stride, const A (&v)[VEC]) {
  using L = AccLayout<A, VEC>;
#pragma unroll
  for (int h = 0; h < L::kChunks; ++h) {
    typename L::Chunk ch = acc[h * stride];
#pragma unroll
    for (int k = 0; k < L::K; ++k) ch.v[k] += v[h * L::K + k];
    acc[h * stride] = ch;
  }
}

// Sums the block's slots in slot order and writes the block's partial row (or,
// with a grid of one block, the gradient itself in W). All threads must call it.
template <typename W, int VEC, typename A>
__device__ void write_block_sums(const typename AccLayout<A, VEC>::Chunk* acc,
                                 int regions, int nv, const BwdArgs& a,
                                 const RowThread<A>& t, int parts) {
  using L = AccLayout<A, VEC>;
  const int per_slot = nv * L::kChunks * a.tpr;
  const int64_t nvec = t.nvec;
  // With a cluster a row, the cluster's blocks write one partial row.
  const int64_t blocks = gridDim.x / parts, block = blockIdx.x / parts;
  __syncthreads();
  for (int r = 0; r < regions; ++r) {
    const auto* region = acc + int64_t(r) * a.rows_per_block * per_slot;
    for (int j = threadIdx.x; j < per_slot; j += blockDim.x) {
      const int lane = j % a.tpr, ih = j / a.tpr;
      const int64_t c = lane + int64_t(ih / L::kChunks) * a.tpr;
      if (c >= nvec) continue;
      const int64_t col = t.col0 + c * VEC + (ih % L::kChunks) * L::K;
      typename L::Chunk sum = region[j];
      for (int s = 1; s < a.rows_per_block; ++s) {
#pragma unroll
        for (int k = 0; k < L::K; ++k) sum.v[k] += region[s * per_slot + j].v[k];
      }
      if (blocks == 1) {
        bool dbias = r == 1 || !a.has_scale;
        W* out = static_cast<W*>(dbias ? a.dbias : a.dscale) + col;
#pragma unroll
        for (int k = 0; k < L::K; ++k) out[k] = from_acc<W>(sum.v[k]);
      } else {
        A* out = static_cast<A*>(a.partial) + (r * blocks + block) * a.hidden + col;
        store_vec(out, sum.v);
      }
    }
  }
}

// Shared memory of the backward, in order: the ring (x, dy), the per-thread
// statistics of each stage (mean, rstd; or, computing them, LayerNorm's shift),
// the dscale/dbias accumulators, and the staged scale.
// Accumulators held in registers (kAccInRegs) are stored here only once the
// rows are done, over the ring.
template <typename A, int VEC, int NV, bool kWideDy, bool kAccInRegs = false>
struct BwdSmem {
  // Two stages, one row in flight, where several blocks share an SM (three
  // took them a block, v20). Kernels with their accumulators in registers run
  // one block an SM whatever their stages: a third, two rows in flight, makes
  // up for the warps they lack (LayerNorm 4096x8192 78 -> 71 us; four no
  // faster, v23).
  using R = Ring<VEC, NV, 2, kWideDy, kAccInRegs ? 3 : 2>;
  static constexpr __host__ __device__ size_t stats(int threads) {
    return R::bytes(threads);
  }
  static constexpr __host__ __device__ size_t stats_end(int threads) {
    return stats(threads) + (R::kStaged ? size_t(R::kStages) * 2 * threads * sizeof(A) : 0);
  }
  static constexpr __host__ __device__ size_t acc(int threads) {
    return kAccInRegs ? 0 : stats_end(threads);
  }
  static constexpr __host__ __device__ size_t scale(int threads, int regions) {
    const size_t acc_end = acc(threads) + size_t(regions) * threads * NV * VEC * sizeof(A);
    return acc_end > stats_end(threads) ? acc_end : stats_end(threads);
  }
};

// Whether bwd_regs reads a staged row's x and dy from the ring at each use
// (both passes) rather than holding them in registers across the row's
// reductions. Its scale, the same columns for every row a thread visits, then
// takes those registers, loaded once: loaded for each row at its use (from
// global memory where staging it cost the SM a block) it was where the kernel
// stalled most (Nsight Compute, benchmarks/NOTES.md v16).
template <int VEC, int NV, bool kWideDy>
constexpr bool bwd_scale_in_regs() {
  return Ring<VEC, NV, 2, kWideDy>::kStaged;
}

// kPlain: no dres to add and the scale applied as it is (not zero-centered),
// as in every plain RMSNorm and LayerNorm backward: with those compiled in the
// kernel executed 8% more instructions and took 9-13% longer than without
// (benchmarks/NOTES.md, v13).
// The cluster split's sums: a slot for each warp of its blocks
// (ClusterSum::warps), which bounds parts * warps (split_fits_slots).
template <typename A, bool kSplit>
using SplitClusterSum = ClusterSum<A, 4, kSplit ? kMaxRowThreads / 32 : 1>;
inline bool split_fits_slots(int parts, int threads) {
  return parts * ((threads + 31) / 32) <= SplitClusterSum<float, true>::kSlots;
}

// kSplit: a cluster of a.parts blocks a row (plan_bwd_split), compiled apart
// so that the other launches keep their registers; it takes the short
// arithmetic (xhat_of), as kLean does outside a split (lean_for_layer_norm).
// kAccInRegs: dscale/dbias accumulated in registers, not shared memory, for
// LayerNorm's rows of 7K-12K 16-bit elements (or a cluster's slices of
// longer ones), where the two shared accumulators left the SM one block
// (plan_bwd).
// At least one block an SM: the bound lets ptxas take up to 128 registers
// (more with kAccInRegs), where by itself it gave some instantiations 64 and
// spilled (float32 with a cluster a row: 16 bytes).
// kHold: a split's slices of at most kMaxSliceThreads threads, its
// accumulators in registers, hold each vector's dy and first-pass xhat in
// registers across the row's sums, where the second pass would read x and dy
// from the ring and convert them again; the bound lets ptxas take the 255
// registers that needs (plan_bwd).
template <typename X, typename G, typename W, int VEC, int NV, bool kPlain, bool kSplit,
          bool kAccInRegs, bool kBulk = false, bool kHold = false, bool kLean = kSplit>
__global__ void __launch_bounds__(kHold ? kMaxSliceThreads
                                  : !kAccInRegs ? kMaxRowThreads
                                                : kAccRegsThreads, 1)
    bwd_regs(BwdArgs a) {
  using A = acc_t<X>;
  using L = AccLayout<A, VEC>;
  constexpr bool kWideDy = sizeof(G) > sizeof(X);
  using M = BwdSmem<A, VEC, NV, kWideDy, kAccInRegs>;
  using R = typename M::R;
  constexpr bool kReread = bwd_scale_in_regs<VEC, NV, kWideDy>();
  static_assert(!kHold || (kSplit && kAccInRegs && kReread && !kBulk));
  __shared__ __align__(16) A smem[2 * 32 * 4];
  RowSumTurns<A, 4> row_sums{smem, a.tpr};
  // Slots for each warp of a split's blocks (ClusterSum::warps).
  using Cluster = SplitClusterSum<A, kSplit>;
  __shared__ __align__(16) typename Cluster::Shared cluster_shared;
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  const R ring{reinterpret_cast<uint4*>(dyn)};
  const int parts = kSplit ? a.parts : 1;
  const RowThread<A> t(a.tpr, a.hidden, VEC, parts);
  Cluster cluster_sum(cluster_shared);
  static_assert(!kBulk || (kSplit && R::kStaged && sizeof(G) == sizeof(X)));
  __shared__ typename BulkFill<R::kStages>::Shared bulk_shared;
  BulkFill<R::kStages> bulk{bulk_shared};
  if constexpr (kBulk) bulk.init();
  if constexpr (kSplit) cluster_sum.init();
  const bool has_stats = a.rstd != nullptr;
  const int regions = int(a.has_scale) + int(a.has_bias);
  const int per_slot = NV * L::kChunks * a.tpr;
  A* stats = reinterpret_cast<A*>(dyn + M::stats(blockDim.x));  // [stage][2][thread]
  auto* acc = reinterpret_cast<typename L::Chunk*>(dyn + M::acc(blockDim.x));
  auto* dw = acc + t.slot * per_slot + t.lane;  // this thread's dscale chunks
  auto* db = dw + (a.has_scale ? a.rows_per_block * per_slot : 0);
  A reg_dw[kAccInRegs ? NV : 1][VEC] = {}, reg_db[kAccInRegs ? NV : 1][VEC] = {};
  if constexpr (!kAccInRegs) {
    for (int j = 0; j < NV * L::kChunks; ++j) {
      if (a.has_scale) dw[j * a.tpr] = typename L::Chunk{};
      if (a.has_bias) db[j * a.tpr] = typename L::Chunk{};
    }
  }
  // A held split's slice is at most kMaxSliceThreads * NV vectors: its
  // indices in 32 bits, a compare a vector instead of a 64-bit add and two.
  auto in_row = [&](int i) {
    if constexpr (kHold) return t.lane + i * a.tpr < int(t.nvec);
    return t.lane + int64_t(i) * a.tpr < t.nvec;
  };
  const W* w_src = a.has_scale ? static_cast<const W*>(a.scale) + t.col0 : nullptr;
  // The scale as applied (1 without one), in registers (kReread).
  RegVec<W, VEC> wv[kReread ? NV : 1];
  if constexpr (kReread) {
    A ones[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) ones[e] = A(1);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (a.has_scale && in_row(i)) {
        wv[i].load(w_src + (t.lane + int64_t(i) * a.tpr) * VEC);
      } else {
        wv[i].pack(ones);
      }
    }
  } else if (a.stage_params) {  // never with a cluster a row
    const W* no_bias = nullptr;
    stage_params(w_src, no_bias, a.hidden,
                 reinterpret_cast<W*>(dyn + M::scale(blockDim.x, regions)));
  }
  const A scale_offset = a.has_scale ? A(a.scale_offset) : A(0);
  // Thread 0's fill of group g's row into `stage` (BulkFill).
  auto fill = [&](int stage, int64_t g) {
    const int64_t row = g * a.rows_per_block + t.slot;
    if (threadIdx.x != 0 || row >= a.rows) return;
    const int64_t base = row * a.hidden + t.col0;
    bulk.fill(stage, ring.at(stage, 0, 0), static_cast<const X*>(a.x) + base,
              ring.at(stage, 1, 0), static_cast<const G*>(a.dy) + base,
              uint32_t(t.nvec * VEC * sizeof(X)));
  };
  bool priming = true;  // (BulkFill: the first stages are filled at once)
  // Starts the copies of group g's row: x, dy and the row's statistics (or
  // LayerNorm's shift: sizeof(A) bytes from the row's start, whole elements).
  auto issue = [&](int stage, int64_t g) {
    const int64_t row = g * a.rows_per_block + t.slot;
    if constexpr (R::kStaged) {
      if (row >= a.rows) return;
      const int64_t base = row * a.hidden + t.col0;
      if constexpr (kBulk) {
        if (priming) fill(stage, g);
      } else {
        ring.template issue<kHold>(stage, 0, static_cast<const X*>(a.x) + base, t.lane, a.tpr,
                                   t.nvec);
        ring.template issue<kHold>(stage, 1, static_cast<const G*>(a.dy) + base, t.lane, a.tpr,
                                   t.nvec);
      }
      if (!kPlain && a.dres != nullptr && t.lane == 0) {  // dres, a row ahead of its use
        prefetch_l2(static_cast<const X*>(a.dres) + base, uint32_t(t.nvec * VEC * sizeof(X)));
      }
      A* st = stats + (stage * 2) * blockDim.x + threadIdx.x;
      if (!has_stats) {
        const X* row_start = static_cast<const X*>(a.x) + row * a.hidden;
        if (a.centered) cp_async_scalar(st, reinterpret_cast<const A*>(row_start));
        return;
      }
      if (a.centered) cp_async_scalar(st, static_cast<const A*>(a.mean) + row);
      cp_async_scalar(st + blockDim.x, static_cast<const A*>(a.rstd) + row);
    }
  };
  const int64_t first_grp = blockIdx.x / parts, grp_stride = gridDim.x / parts;
  R::Stages::prime(issue, first_grp, grp_stride);
  priming = false;
  int stage = 0;
  for (int64_t grp = first_grp; grp * a.rows_per_block < a.rows; grp += grp_stride) {
    R::Stages::advance(stage, grp, grp_stride, issue);
    const int cur = stage;
    stage = (stage + 1) % R::kStages;
    if constexpr (kBulk) bulk.wait(cur);
    const int64_t row = grp * a.rows_per_block + t.slot;
    const bool valid = row < a.rows;
    const int64_t base = row * a.hidden + t.col0;
    // x and dy: in registers, or (kReread) in the ring's stage `cur`, which
    // the next advance leaves alone (it fills the other).
    RegVec<X, VEC> xv[kReread ? 1 : NV];
    RegVec<G, VEC> gv[kReread ? 1 : NV];
    if constexpr (!kReread) {
      ring.read(xv, cur, 0, static_cast<const X*>(a.x) + base, valid, t.lane, a.tpr, t.nvec);
      ring.read(gv, cur, 1, static_cast<const G*>(a.dy) + base, valid, t.lane, a.tpr, t.nvec);
    }
    // Vector i of x or dy. From the ring, a row past the end (a block's last
    // group) or a vector past the row's end is stale: nothing uses it but the
    // row's own sums, which then go unused too.
    auto vec_at = [&](const auto& held, int k, int i) {  // k: 0 x, 1 dy
      auto v = held[0];
      if constexpr (kReread) {
        v.load_shared(ring.at(cur, k, i));
      } else {
        v = held[i];
      }
      return v;
    };
    auto x_at = [&](int i) { return vec_at(xv, 0, i); };
    auto dy_at = [&](int i) { return vec_at(gv, 1, i); };
    // The saved statistics; or, computing them (the statistics-only forward
    // this replaces would read x once more), LayerNorm's shift and rstd 1, so
    // that the first pass sees x - shift as xhat.
    A mean = 0, rstd = 1;
    if (valid && (has_stats || a.centered)) {
      if constexpr (R::kStaged) {
        const A* st = stats + (cur * 2) * blockDim.x + threadIdx.x;
        if (has_stats) {
          mean = a.centered ? st[0] : A(0);
          rstd = st[blockDim.x];
        } else {
          mean = to_acc(reinterpret_cast<const X*>(st)[0]);
        }
      } else if (has_stats) {
        mean = a.centered ? static_cast<const A*>(a.mean)[row] : A(0);
        rstd = static_cast<const A*>(a.rstd)[row];
      } else {
        mean = to_acc(static_cast<const X*>(a.x)[row * a.hidden]);
      }
    }
    if (!kReread && a.stage_params) __syncthreads();  // every thread's scale copies
    // g = dy * scale for vector i, d holding dy (kReread), as xhat_g forms it
    // in its loop. (xhat_g calling this instead changed ptxas's schedule of
    // the one-block kernels, which move by a few percent with it: v68.)
    auto g_of = [&](int i, const A (&d)[VEC], A (&g)[VEC]) {
      A w[VEC];
      unpack(w, wv[i]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) g[e] = d[e] * (kPlain ? w[e] : w[e] + scale_offset);
    };
    // kHold: the first pass's xhat (as far as it knows it) and dy.
    A held_xh[kHold ? NV : 1][VEC], held_d[kHold ? NV : 1][VEC];
    // xhat (as far as kForm knows it) and g = dy * scale for vector i.
    auto xhat_g = [&](auto form, int i, A (&xh)[VEC], A (&d)[VEC], A (&g)[VEC]) {
      constexpr Xhat kForm = decltype(form)::value;
      A w[VEC];
      unpack(xh, x_at(i));
      unpack(d, dy_at(i));
      if constexpr (kReread) {
        unpack(w, wv[i]);
      } else if (a.has_scale) {
        load_vec_early(w, w_src + (t.lane + int64_t(i) * a.tpr) * VEC);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        xh[e] = xhat_of<kForm, kLean, X>(xh[e], mean, rstd);
        if constexpr (kReread) {
          g[e] = d[e] * (kPlain ? w[e] : w[e] + scale_offset);
        } else {
          g[e] = a.has_scale ? d[e] * (kPlain ? w[e] : w[e] + scale_offset) : d[e];
        }
      }
    };
    auto accumulate_params = [&](int i, A (&d)[VEC], const A (&xh)[VEC]) {
      if constexpr (kAccInRegs) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          if (a.has_bias) reg_db[i][e] += d[e];
          if (a.has_scale) reg_dw[i][e] += d[e] * xh[e];
        }
        return;
      }
      if (a.has_bias) accumulate<A, VEC>(db + i * L::kChunks * a.tpr, a.tpr, d);
      if (a.has_scale) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) d[e] *= xh[e];
        accumulate<A, VEC>(dw + i * L::kChunks * a.tpr, a.tpr, d);
      }
    };
    // The first pass: the row's sums, reduced over the row (and its cluster),
    // then the dx terms. dscale and dbias are accumulated here where xhat is
    // known, else in the second pass.
    A c_gx, c_g;
    // kHold: xhat = held_xh * held_rstd - held_shift, which is held_xh
    // itself (times 1, less 0: exact) where the first pass knew all of xhat,
    // and otherwise xhat from x less the shift (or x): one FMA either way,
    // not both forms and a select on the mode.
    A held_rstd = 1, held_shift = 0;
    auto first_pass = [&](auto mode) {
      constexpr RowDots kMode = decltype(mode)::value;
      constexpr bool kHeldScaled = first_pass_xhat(kMode, kLean) == Xhat::kScaled;
      A s[row_dot_count(kMode)] = {};
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (!in_row(i)) continue;
        A xh[VEC], d[VEC], g[VEC];
        xhat_g(std::integral_constant<Xhat, first_pass_xhat(kMode, kLean)>{}, i, xh, d, g);
        if constexpr (kHold) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) held_xh[i][e] = xh[e], held_d[i][e] = d[e];
        }
        add_row_dots<kMode>(s, g, xh);
        if (kMode == RowDots::kSaved && valid) accumulate_params(i, d, xh);
      }
      // A split's warps send their sums to the cluster's blocks themselves
      // (ClusterSum::warps), except LayerNorm computing the statistics of
      // rows other than bf16. Its sums about the shift cancel, by up to n
      // (row_dx_terms): n float32 roundings in the variance, half of them in
      // rstd, below bf16's own rounding up to 65536 elements a row but not
      // below float16's or float32's; for float32 the large-mean test holds
      // in the block-then-cluster order with little margin
      // (benchmarks/NOTES.md, v38).
      constexpr bool kWarpSums = kMode != RowDots::kOwnLn || std::is_same_v<X, __nv_bfloat16>;
      if constexpr (kSplit && kWarpSums) {
        warp_sum(s);
        cluster_sum.warps(s, parts);
      } else {
        row_sums(s, a.tpr);
        if constexpr (kSplit) cluster_sum(s, parts);
      }
      // The stage of the row before, refilled (BulkFill).
      if constexpr (kBulk) {
        fill((cur + R::kStages - 1) % R::kStages, grp + (R::kStages - 1) * grp_stride);
      }
      [[maybe_unused]] const A shift = mean;
      row_dx_terms<kMode>(s, a.centered, A(a.epsilon), t.inv_n, mean, rstd, c_gx, c_g);
      if constexpr (kHold && !kHeldScaled) held_rstd = rstd, held_shift = (mean - shift) * rstd;
    };
    using Mode = RowDots;
    if (has_stats) {
      first_pass(std::integral_constant<Mode, Mode::kSaved>{});
    } else if (a.centered) {
      first_pass(std::integral_constant<Mode, Mode::kOwnLn>{});
    } else {
      first_pass(std::integral_constant<Mode, Mode::kOwnRms>{});
    }
    if (!valid) continue;
    X* dxr = static_cast<X*>(a.dx) + base;
    // dres: each vector loaded at its use waited for the previous vector's
    // store (v12), so all of the row's are loaded before the first store
    // (from L2 where the ring prefetched the row with its x and dy). Loaded
    // with x and dy instead, they took registers across the reductions (v12,
    // 27 more).
    Dres<X, VEC> dres[kPlain ? 1 : NV];
    if constexpr (!kPlain) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        dres[i].load(a, base + (t.lane + int64_t(i) * a.tpr) * VEC, in_row(i));
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (!in_row(i)) continue;
      const int64_t c = kHold ? int64_t(t.lane + i * a.tpr) : t.lane + int64_t(i) * a.tpr;
      A xh[VEC], d[VEC], g[VEC], o[VEC];
      if constexpr (kHold) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          d[e] = held_d[i][e];
          xh[e] = held_xh[i][e] * held_rstd - held_shift;
        }
        g_of(i, d, g);
      } else {
        xhat_g(std::integral_constant<Xhat, Xhat::kScaled>{}, i, xh, d, g);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] = dx_of<kLean>(g[e], xh[e], rstd, c_g, c_gx);
      if (!has_stats) accumulate_params(i, d, xh);
      if constexpr (!kPlain) dres[i].add_to(o, a);
      store_vec(dxr + c * VEC, o);
    }
    // (A split's rows are all valid: one a block, launch_bwd.)
    if constexpr (kBulk) bulk.release(cur);
  }
  cp_async_wait<0>();
  if constexpr (kAccInRegs) {
    __syncthreads();  // every thread is done with the ring the sums now take
#pragma unroll
    for (int j = 0; j < NV * L::kChunks; ++j) {
      typename L::Chunk w, b;
#pragma unroll
      for (int k = 0; k < L::K; ++k) {
        w.v[k] = reg_dw[j / L::kChunks][j % L::kChunks * L::K + k];
        b.v[k] = reg_db[j / L::kChunks][j % L::kChunks * L::K + k];
      }
      if (a.has_scale) dw[j * a.tpr] = w;
      if (a.has_bias) db[j * a.tpr] = b;
    }
  }
  write_block_sums<W, VEC, A>(acc, regions, NV, a, t, parts);
}

template <typename X, typename G, typename W, int VEC>
__global__ void __launch_bounds__(kLongThreads) bwd_long(BwdArgs a) {
  using A = acc_t<X>;
  __shared__ __align__(16) A smem[32 * 2];
  const int64_t nvec = a.hidden / VEC;
  const A inv_n = A(1) / A(a.hidden);
  A* pw = static_cast<A*>(a.partial) + int64_t(blockIdx.x) * a.hidden;
  A* pb = pw + (a.has_scale ? int64_t(gridDim.x) * a.hidden : 0);
  // Reads x, dy (and scale) at vector c of a row: returns xhat and g.
  auto load = [&](int64_t base, int64_t c, A mean, A rstd, A (&xh)[VEC],
                  A (&d)[VEC], A (&g)[VEC]) {
    load_vec(xh, static_cast<const X*>(a.x) + base + c * VEC);
    load_vec(d, static_cast<const G*>(a.dy) + base + c * VEC);
    A w[VEC];
    if (a.has_scale) load_scale(w, static_cast<const W*>(a.scale) + c * VEC, a.scale_offset);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      xh[e] = (xh[e] - mean) * rstd;
      g[e] = a.has_scale ? d[e] * w[e] : d[e];
    }
  };
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t base = row * a.hidden;
    const A mean = a.centered ? static_cast<const A*>(a.mean)[row] : A(0);
    const A rstd = static_cast<const A*>(a.rstd)[row];
    A s[2] = {0, 0};
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      A xh[VEC], d[VEC], g[VEC];
      load(base, c, mean, rstd, xh, d, g);
      add_row_dots<RowDots::kSaved>(s, g, xh);
    }
    row_sum(s, blockDim.x, smem);
    const A c_gx = s[0] * inv_n;
    const A c_g = a.centered ? s[1] * inv_n : A(0);
    X* dxr = static_cast<X*>(a.dx) + base;
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      A xh[VEC], d[VEC], g[VEC], o[VEC];
      Dres<X, VEC> dres;
      dres.load(a, base + c * VEC);
      load(base, c, mean, rstd, xh, d, g);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        o[e] = dx_of<false>(g[e], xh[e], rstd, c_g, c_gx);
        if (a.has_scale) pw[c * VEC + e] += d[e] * xh[e];
        if (a.has_bias) pb[c * VEC + e] += d[e];
      }
      dres.add_to(o, a);
      store_vec(dxr + c * VEC, o);
    }
  }
}

// out[j] = sum over p of partial[p][j] in a fixed order: thread row y adds
// the partial rows y, y + 8, ..., then the 8 sums are added in turn.
// blockIdx.y picks the region (dscale, then dbias). A thread takes kCols
// adjacent columns, one 16-byte load a row where the rows allow it: with one
// column a thread (4-byte loads), 30 float32 rows of 65536 took 7.4 us, 31%
// of DRAM's bandwidth, under Nsight Compute with the caches flushed (RMSNorm
// 512x65536 on an H100, benchmarks/NOTES.md v55).
template <typename W, typename A, int kCols>
__global__ void __launch_bounds__(256) sum_partials(const A* partial, int64_t parts,
                                                   int64_t hidden, W* out0, W* out1) {
  using Cols = Packed<A, kCols>;
  __shared__ Cols tile[8][32];
  const A* p = partial + int64_t(blockIdx.y) * parts * hidden;
  W* out = blockIdx.y == 0 ? out0 : out1;
  const int64_t col = (int64_t(blockIdx.x) * 32 + threadIdx.x) * kCols;
  Cols s{};
  if (col < hidden) {
#pragma unroll 4
    for (int64_t r = threadIdx.y; r < parts; r += 8) {
      const Cols v = *reinterpret_cast<const Cols*>(p + r * hidden + col);
#pragma unroll
      for (int k = 0; k < kCols; ++k) s.v[k] += v.v[k];
    }
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= hidden) return;
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    A t = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) t += tile[j][threadIdx.x].v[k];
    out[col + k] = from_acc<W>(t);
  }
}

// ------------------------------------------------------------------ launch

// Sums the `parts` partial rows in a.partial into dscale and dbias: 16 bytes
// of a row a thread where rows are whole 16-byte chunks and that still
// leaves kSumVecBlocks blocks, else one element. On an H100 (v55), 16 bytes
// took LayerNorm 512x65536 87.2-87.3 -> 84.8-85.3 us; with 32 blocks of them
// RMSNorm 16384x4096 lost 144.0 -> 145.2-145.6 (one element: 128 blocks).
constexpr int64_t kSumVecBlocks = 256;

template <typename W, typename A>
cudaError_t launch_sum_partials(cudaStream_t stream, const BwdArgs& a, int64_t parts) {
  constexpr int kVec = 16 / sizeof(A);
  const int regions = int(a.has_scale) + int(a.has_bias);
  const int64_t vec_blocks = (a.hidden + 32 * kVec - 1) / (32 * kVec) * regions;
  const auto* partial = static_cast<const A*>(a.partial);
  W* out0 = static_cast<W*>(a.has_scale ? a.dscale : a.dbias);
  W* out1 = static_cast<W*>(a.dbias);
  auto launch = [&](auto cols) {
    constexpr int kCols = decltype(cols)::value;
    const dim3 grid(unsigned((a.hidden + 32 * kCols - 1) / (32 * kCols)), unsigned(regions));
    sum_partials<W, A, kCols><<<grid, dim3(32, 8), 0, stream>>>(partial, parts, a.hidden,
                                                                 out0, out1);
    return cudaGetLastError();
  };
  if (a.hidden % kVec == 0 && aligned16(partial) && vec_blocks >= kSumVecBlocks) {
    return launch(std::integral_constant<int, kVec>{});
  }
  return launch(std::integral_constant<int, 1>{});
}

inline int grid_size(int64_t groups, int64_t cap) {
  return int(groups < cap ? groups : cap);
}

// The forward: one block per row group up to a full persistent grid.
template <typename X, typename Y, typename W, int VEC>
cudaError_t launch_fwd(cudaStream_t stream, const DeviceInfo& dev, const RowPlan& p,
                       FwdArgs a) {
  a.tpr = p.tpr;
  a.rows_per_block = p.rows_per_block;
  if (p.nv == 0) {
    fwd_long<X, Y, W, VEC><<<grid_size(p.groups, 1 << 30), kLongThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  const size_t staged = a.write_y
      ? staged_param_bytes<W, VEC>(a.hidden, int(a.has_scale) + int(a.has_bias)) : 0;
  a.stage_params = staged > 0;
  return with_variant<VEC>(p, [&](auto v) {
    using V = decltype(v);
    auto kernel = fwd_regs<X, Y, W, VEC, V::nv>;
    const size_t smem = Ring<VEC, V::nv, 1>::bytes(p.threads()) + staged;
    const int per_sm = blocks_per_sm(kernel, p.threads(), smem, dev);
    const int grid = grid_size(p.groups, int64_t(per_sm) * dev.sms);
    kernel<<<grid, p.threads(), smem, stream>>>(a);
    return cudaGetLastError();
  });
}

// A backward launch: its plan, its kernel and how many blocks it runs.
template <typename X, typename G, typename W, int VEC>
struct BwdLaunch {
  using A = acc_t<X>;
  using Kernel = void (*)(BwdArgs);
  RowPlan plan;
  Kernel kernel = nullptr;
  size_t smem = 0;
  int grid = 0;
  int regions = 0;
  bool stage_scale = false;

  // Partial rows: one a block (a cluster with plan.parts > 1).
  int64_t partial_rows() const { return grid / plan.parts; }
  size_t partial_bytes(int64_t hidden) const {
    const int64_t n = partial_rows();
    return n > 1 || plan.nv == 0 ? size_t(regions) * n * hidden * sizeof(A) : 0;
  }
};

// Shared memory the backward's register path needs under `plan`.
template <typename X, typename G, typename W, int VEC>
size_t bwd_smem_bytes(const RowPlan& plan, int64_t hidden, bool has_scale, int regions,
                      bool acc_in_regs = false) {
  return with_variant<VEC, kMaxBwdNv>(plan, [&](auto v) {
    using V = decltype(v);
    constexpr bool kWideDy = sizeof(G) > sizeof(X);
    using A = acc_t<X>;
    const bool stage = has_scale && !bwd_scale_in_regs<VEC, V::nv, kWideDy>();
    const size_t staged = stage ? staged_param_bytes<W, VEC>(hidden, 1) : 0;
    return (acc_in_regs ? BwdSmem<A, VEC, V::nv, kWideDy, true>::scale(plan.threads(), regions)
                        : BwdSmem<A, VEC, V::nv, kWideDy>::scale(plan.threads(), regions)) +
           staged;
  });
}

// Whether some plan of the backward may hold its accumulators in registers:
// where two of them in shared memory, at kAccRegsThreads, leave the SM one
// block. Measured, and compiled, for 16-bit x only.
template <typename X, typename G, int VEC>
constexpr bool may_hold_acc_in_regs() {
  using M = BwdSmem<acc_t<X>, VEC, kMaxBwdNv, (sizeof(G) > sizeof(X))>;
  return VEC > 1 && sizeof(X) == 2 && M::scale(kAccRegsThreads, 2) > kTwoBlocksSmem;
}

// The register path's kernel: kPlain, kSplit, kAccInRegs, kBulk, kHold and
// kLean as the launch needs (kBulk: 16-bit x and dy, plain, split,
// accumulators shared; kHold: split, accumulators in registers; kLean: one
// block a row, accumulators in registers).
template <typename X, typename G, typename W, int VEC>
void (*bwd_regs_kernel(bool plain, bool split, bool acc_in_regs, bool bulk = false,
                       bool hold = false, bool lean = false))(BwdArgs) {
  constexpr int NV = kMaxBwdNv;
  if constexpr (sizeof(X) == 2 && sizeof(G) == 2 && Ring<VEC, NV, 2>::kStaged) {
    if (bulk && plain && split && !acc_in_regs) {
      return &bwd_regs<X, G, W, VEC, NV, true, true, false, true>;
    }
  }
  if constexpr (may_hold_acc_in_regs<X, G, VEC>()) {
    if (acc_in_regs) {
      if (hold && split) return &bwd_regs<X, G, W, VEC, NV, true, true, true, false, true>;
      if (lean && !split) {
        return &bwd_regs<X, G, W, VEC, NV, true, false, true, false, false, true>;
      }
      return split ? &bwd_regs<X, G, W, VEC, NV, true, true, true>
                   : &bwd_regs<X, G, W, VEC, NV, true, false, true>;
    }
  }
  if (split) {
    return plain ? &bwd_regs<X, G, W, VEC, NV, true, true, false>
                 : &bwd_regs<X, G, W, VEC, NV, false, true, false>;
  }
  return plain ? &bwd_regs<X, G, W, VEC, NV, true, false, false>
               : &bwd_regs<X, G, W, VEC, NV, false, false, false>;
}

// Rows too long for a block: a cluster of blocks a row (sm_90), each a slice
// of at most 1024 vectors (8192 bf16: with the scale unstaged, two blocks an
// SM, v14), up to 8 blocks of 2048 vectors; beyond, or without clusters, the
// long path. fewer_parts may then take bigger slices.
inline RowPlan plan_bwd_split(int64_t rows, int64_t nvec, const DeviceInfo& dev) {
  RowPlan p = plan_with_nv(rows, nvec, 0, dev.sms);
  if (!dev.clusters) return p;
  int parts = 2;
  while (parts < kMaxClusterParts &&
         (nvec + parts - 1) / parts > kMaxSliceThreads * kMaxBwdNv) {
    parts *= 2;
  }
  const int64_t span = (nvec + parts - 1) / parts;
  if (span > kMaxBwdNv * kMaxRowThreads) return p;
  p.nv = kMaxBwdNv;
  p.parts = parts;
  p.tpr = threads_per_row(span, kMaxBwdNv);
  return p;
}

// Where DRAM feeds an SM less than kFastDramGbpsPerSm (an H100: 3.35 TB/s
// peak, 25 GB/s an SM; an H200's 4.8 TB/s is 36), some backward plans
// measured faster than where it is fast.
constexpr double kFastDramGbpsPerSm = 30;
inline bool dram_is_slow(const DeviceInfo& dev) {
  return dev.dram_gbps > 0 && dev.dram_gbps < kFastDramGbpsPerSm * dev.sms;
}

// Whether a split's blocks may load their slices by bulk copies (bwd_regs'
// kBulk): RMSNorm's, in blocks of at least two warps at 3-4 vectors a
// thread. Every block needs a slice: its threads wait for their stage's
// bytes.
inline bool split_may_load_in_bulk(const RowPlan& p, int64_t nvec, int regions) {
  if (p.parts < 2 || regions > 1 || p.tpr < 64) return false;
  const int64_t span = (nvec + p.parts - 1) / p.parts;
  return span > 2 * int64_t(p.tpr) && nvec > (p.parts - 1) * span;
}

// Whether they do: where DRAM is slow. On an H100 (bf16, computing the
// statistics, benchmarks/NOTES.md v58; GB/s): 512x65536 2390 -> 2568,
// 1024x49152 2555 -> 2574, 2048x16392 2375 -> 2412, 4096x12288 2499 -> 2549,
// 8192x12288 2596 -> 2633; at 2 vectors a thread (2048x32768) 15% slower, in
// blocks of a warp (16384x4096) 14%, and LayerNorm's splits by up to 4%. On
// an H200 each thread's cp.async ran faster (v68): 512x65536 64.6 -> 61.4 us,
// 2048x32768 112.9 -> 109.3.
inline bool split_loads_in_bulk(const RowPlan& p, int64_t nvec, int regions,
                                const DeviceInfo& dev) {
  return dram_is_slow(dev) && split_may_load_in_bulk(p, nvec, regions);
}

// Whether a backward launch of `plan` holds dscale/dbias in registers:
// where the two of them in shared memory leave the SM one block anyway
// (LayerNorm bf16 4096x8192 88 -> 78 us, 8192x12288 208 -> 181 on an H200,
// benchmarks/NOTES.md, v21). Only plain launches (neither the fused add's nor
// a zero-centered scale's), which spares the build two kernels a type.
template <typename X, typename G, typename W, int VEC>
bool bwd_acc_in_regs(const RowPlan& plan, int64_t hidden, int regions, bool plain) {
  return may_hold_acc_in_regs<X, G, VEC>() && plain && plan.threads() <= kAccRegsThreads &&
         bwd_smem_bytes<X, G, W, VEC>(plan, hidden, false, regions) > kTwoBlocksSmem;
}

template <typename X, typename G, typename W, int VEC>
BwdLaunch<X, G, W, VEC> plan_bwd(const RowPlan& plan, int64_t hidden, bool has_scale,
                                 int regions, bool plain, const DeviceInfo& dev) {
  BwdLaunch<X, G, W, VEC> l;
  l.plan = plan;
  l.regions = regions;
  if (plan.nv == 0) {
    l.kernel = bwd_long<X, G, W, VEC>;
  } else {
    // A planned hold (plan.held) also holds the accumulators in registers.
    const bool held = plan.held && plain && plan.parts > 1 &&
                      plan.threads() <= kMaxSliceThreads && may_hold_acc_in_regs<X, G, VEC>();
    const bool acc_in_regs = held || bwd_acc_in_regs<X, G, W, VEC>(plan, hidden, regions, plain);
    l.kernel = bwd_regs_kernel<X, G, W, VEC>(plain, plan.parts > 1, acc_in_regs,
                                             split_loads_in_bulk(plan, hidden / VEC, regions, dev),
                                             held);
    // Kernels that hold the scale in registers stage nothing (staged ==
    // unstaged). Otherwise a staged scale saves the loads at its use, but not
    // at the cost of a second block on the SM (v14).
    const size_t staged =
        bwd_smem_bytes<X, G, W, VEC>(plan, hidden, has_scale, regions, acc_in_regs);
    const size_t unstaged =
        bwd_smem_bytes<X, G, W, VEC>(plan, hidden, false, regions, acc_in_regs);
    l.stage_scale = plan.parts == 1 && staged > unstaged && staged <= dev.max_dynamic_smem &&
                    (staged <= kTwoBlocksSmem || unstaged > kTwoBlocksSmem);
    l.smem = l.stage_scale ? staged : unstaged;
  }
  if (plan.parts > 1) {
    int clusters = resident_clusters(l.kernel, plan.threads(), l.smem, plan.parts, dev);
    // A split of slices of at most kMaxSliceThreads threads, its accumulators
    // in registers, holds its first pass's values for the second (kHold)
    // where the registers that takes cost it no cluster. On H100s (bf16,
    // benchmarks/NOTES.md v69) LayerNorm's 512x65536 85.2-86.2 -> 80.7-81.8
    // us and 1024x65536 156.9-159.2 -> 146.7-148.2, computing the statistics
    // or given them; 256x65536 computing them won 4% in one run, lost 4% in
    // another.
    const auto hold = bwd_regs_kernel<X, G, W, VEC>(true, true, true, false, true);
    if (l.kernel == bwd_regs_kernel<X, G, W, VEC>(true, true, true) && hold != l.kernel &&
        plan.threads() <= kMaxSliceThreads) {
      const int with_hold = resident_clusters(hold, plan.threads(), l.smem, plan.parts, dev);
      if (with_hold >= clusters) {
        l.kernel = hold;
        clusters = with_hold;
      }
    }
    l.grid = grid_size(plan.groups, clusters) * plan.parts;
  } else {
    const int per_sm = blocks_per_sm(l.kernel, plan.threads(), l.smem, dev);
    l.grid = grid_size(plan.groups, int64_t(per_sm) * dev.sms);
  }
  return l;
}

// LayerNorm's one-block launches with the accumulators in registers take the
// short arithmetic (kLean), but for rows of a warp. On an H200 (bf16,
// computing the statistics, benchmarks/NOTES.md v95), full -> short, us:
// 8192x12288 169.0 -> 164.2-164.5, 8192x10240 163.0-163.2 -> 158.4-158.5,
// 16384x4096 108.7-109.6 -> 105.2-106.3, 32768x2048 105.8-106.7 ->
// 103.2-103.4, 131072x512 115.1-115.3 -> 112.4-112.6; but 65536x1024 (32
// threads a row) 110.1-110.6 -> 113.5-113.9 (v37 saw the same). RMSNorm's
// lost 9-13% at 512, 2048, 4096 and 12288 wide (and gained 7% at 10240), so
// its launches keep the full form.
template <typename X, typename G, typename W, int VEC>
void lean_for_layer_norm(BwdLaunch<X, G, W, VEC>& l, bool centered, const DeviceInfo& dev) {
  if (!centered || l.plan.tpr == 32 ||
      l.kernel != bwd_regs_kernel<X, G, W, VEC>(true, false, true)) {
    return;
  }
  l.kernel = bwd_regs_kernel<X, G, W, VEC>(true, false, true, false, false, true);
  const int per_sm = blocks_per_sm(l.kernel, l.plan.threads(), l.smem, dev);
  l.grid = grid_size(l.plan.groups, int64_t(per_sm) * dev.sms);
}

// Whether split a (on a_clusters resident clusters) leaves each SM fewer of
// a row's vectors to take than split b: rows a cluster x vectors a slice.
// Where DRAM is fast (an H200), a held block and LayerNorm's bigger unheld
// ones (fewer_parts) took about the same time a vector of their rows, ~2
// ns (bf16, computing the statistics, benchmarks/NOTES.md v84), so their
// times follow that count: held in 4 blocks (30 clusters) against 3 of 352
// threads (39), 1024x32768 76.8 against 81.9-82.0 us, 2048x32768
// 141.2-142.2 against 148.2-148.6, 4096x32768 271.7-272.0 against
// 282.4-283.8, 2048x30720 (slices of 960 vectors) 140.0-141.8 against
// 143.9-144.6; and the other way, 2048x24576 in 3 held (39 clusters, 53
// rows) 110.8-112.9 against 2 of 384's (66, 32) 94.1-96.4.
inline bool fewer_vectors_a_sm(const RowPlan& a, int a_clusters, const RowPlan& b,
                               int b_clusters, int64_t rows, int64_t nvec) {
  auto per_sm = [&](const RowPlan& p, int clusters) {
    return (rows + clusters - 1) / clusters * ((nvec + p.parts - 1) / p.parts);
  };
  return per_sm(a, a_clusters) < per_sm(b, b_clusters);
}

// Whether a split's resident blocks cover 7/8 of the SMs, the most LayerNorm's
// split planning gives up for bigger or held blocks (fewer_parts,
// full_held_split).
inline bool covers_most_sms(int blocks, const DeviceInfo& dev) {
  return 8 * int64_t(blocks) >= 7 * int64_t(dev.sms);
}

// Sets q to a split in slices of at most kMaxSliceThreads threads at
// kMaxBwdNv vectors (1024 16-byte vectors), held (bwd_regs' kHold), and
// returns the clusters resident at once where the slices are nearly full and
// those clusters fill 7/8 of the SMs; else 0. Fewer rows than that leave
// SMs idle in any split, and held still ran faster (on an H200, 32x24576
// LayerNorm in 3 held blocks 11.6 against 4 of 192 12.8 us, v85). A split
// with one accumulator (regions 1: RMSNorm's, or LayerNorm's with one
// parameter) is planned held (RowPlan::held): that accumulator in shared
// memory leaves room for two unheld blocks an SM, so plan_bwd would not
// hold it.
// A held block spends about the same on its slice of a row at any width up
// to that (2.1-2.3 us on H100s), so full slices move the most bytes an SM.
// On H100s (bf16, computing the statistics, benchmarks/NOTES.md v70), against
// LayerNorm's bigger blocks (fewer_parts), not held: 2048x24576 in 3 blocks of
// 256 threads 130.8-131.7 -> 112.2-113.0 us (not 2 of 384), 2048x32768 in 4
// of 256 152.0-152.4 -> 144.4-144.8 (not 3 of 352). Slices 83% full lost
// (2048x20480 in 3 of 224: 104.6 -> 111.7), and so did clusters on 102 SMs
// (1024x49152 in 6 of 256: 128 -> 131). Where DRAM is fast, see fewer_parts.
template <typename X, typename G, typename W, int VEC>
int full_held_split(RowPlan& q, int64_t hidden, int regions, bool plain, const DeviceInfo& dev) {
  constexpr int64_t kFull = int64_t(kMaxSliceThreads) * kMaxBwdNv;
  const int64_t nvec = hidden / VEC;
  const int64_t parts = (nvec + kFull - 1) / kFull, span = (nvec + parts - 1) / parts;
  q.parts = int(parts);
  q.tpr = threads_per_row(span, kMaxBwdNv);
  q.held = regions == 1;
  if (parts < 2 || parts > kMaxClusterParts || 16 * span < 15 * kFull ||
      !split_fits_slots(q.parts, q.tpr)) {
    return 0;
  }
  const auto l = plan_bwd<X, G, W, VEC>(q, hidden, false, regions, plain, dev);
  if (l.kernel != bwd_regs_kernel<X, G, W, VEC>(true, true, true, false, true)) return 0;
  const int clusters = resident_clusters(l.kernel, q.threads(), l.smem, q.parts, dev);
  return covers_most_sms(clusters * q.parts, dev) ? clusters : 0;
}

// LayerNorm's cluster split (two accumulators): the fewest blocks a row of up
// to kAccRegsThreads threads, one an SM with dscale/dbias in registers, where
// the clusters resident at once still cover 7/8 of the SMs. On an H200
// (bf16, computing the statistics, benchmarks/NOTES.md v35), against 2-8
// smaller blocks, two an SM with the accumulators in shared memory or one
// with them in registers: 2048x16392 110 -> 93 us (2 blocks a row, not 4),
// 2048x24576 122 -> 103 (2, not 4), 2048x32768 169 -> 158 (3, not 4),
// 1024x49152 133 -> 118 (4, not 8); at 65536 wide 6 blocks a row cover 102
// SMs and lost 10% to 8. RMSNorm's one accumulator in shared memory kept its
// split faster at 16392, 20480 and 32768 wide.
//
// Full held slices (full_held_split) come first where DRAM is slow, and
// where it is fast if they leave each SM fewer of a row's vectors to take
// (fewer_vectors_a_sm) or their clusters take at most kFewHeldRows rows
// each: there the bigger blocks' launch costs more than their rows save.
// On an H200 (bf16, computing the statistics, benchmarks/NOTES.md v84) 3
// held blocks against 2 of 384 threads at 24576 wide: 32 rows 11.2 against
// 13.7 us, 64 12.9 against 16.7-16.8, 300 (8 rows a cluster) 25.2-25.3
// against 27.4; 512 (14) 36.3-36.5 against 35.5-35.7; ~4.7 us more a
// launch and ~13% less a vector for the bigger blocks.
constexpr int64_t kFewHeldRows = 8;
template <typename X, typename G, typename W, int VEC>
RowPlan fewer_parts(const RowPlan& p, int64_t rows, int64_t hidden, int regions, bool plain,
                    const DeviceInfo& dev) {
  if (regions < 2) return p;
  RowPlan held = p;
  const int held_clusters = full_held_split<X, G, W, VEC>(held, hidden, regions, plain, dev);
  if (held_clusters > 0 && dram_is_slow(dev)) return held;
  const int64_t nvec = hidden / VEC;
  RowPlan q = p;
  for (int parts = 2; parts < p.parts; ++parts) {
    RowPlan r = p;
    r.parts = parts;
    r.tpr = threads_per_row((nvec + parts - 1) / parts, kMaxBwdNv);
    if (r.tpr > kAccRegsThreads || !bwd_acc_in_regs<X, G, W, VEC>(r, hidden, regions, plain) ||
        bwd_smem_bytes<X, G, W, VEC>(r, hidden, false, regions, true) > dev.max_dynamic_smem) {
      continue;
    }
    if (covers_most_sms(plan_bwd<X, G, W, VEC>(r, hidden, false, regions, plain, dev).grid, dev)) {
      q = r;
      break;
    }
  }
  if (held_clusters == 0) return q;
  const int clusters = plan_bwd<X, G, W, VEC>(q, hidden, false, regions, plain, dev).grid / q.parts;
  const bool few_rows = rows <= kFewHeldRows * held_clusters;
  return few_rows || fewer_vectors_a_sm(held, held_clusters, q, clusters, rows, nvec) ? held : q;
}

// Whether a plan of the backward runs one block an SM: its accumulators in
// registers (bwd_acc_in_regs), or RMSNorm's 16-bit rows of 1537-2048
// vectors, a block of more threads than those allow (512 at 2048).
template <typename X, typename G, typename W, int VEC>
bool one_block_an_sm(const RowPlan& p, int64_t hidden, int regions, bool plain) {
  return bwd_acc_in_regs<X, G, W, VEC>(p, hidden, regions, plain) ||
         (sizeof(X) == 2 && regions == 1 && plain && p.threads() > kAccRegsThreads);
}

// Blocks a row of the split below, or 1: where DRAM is slow, a backward
// that would take one block an SM (one_block_an_sm) runs over a cluster of
// blocks a row instead (bf16, computing the statistics, on H100s;
// benchmarks/NOTES.md):
// - LayerNorm (v52), with at least 24 rows an SM: slices of at most 640
//   vectors, at least two. 16384x4096 165 -> 153-157 us, 8192x10240 202 ->
//   187-189, 4096x12288 131 -> 117-120, 8192x12288 246-248 -> 223-230; given
//   the statistics 7-10% faster at 10240-12288 wide. Not rows of 513-1024
//   vectors: given the statistics the split lost 2-4% at 4096x8192. Nor
//   slices of a warp (v53: 16384x4096 in 4 blocks 168.4 against 153.8 in 2).
// - RMSNorm (v53), with at least 30 rows an SM: a warp a block, 128 vectors
//   each, for rows of 256, 384 or 512 vectors (32768x2048 157.7 -> 148.7,
//   16384x3072 119.3 -> 110.5, 16384x4096 159.4-159.9 -> 143.9-144.1, 8192x4096
//   82.9 -> 76.7; 4096x4096 43.0 / 43.4 and 2048x4096 24.3 / 26.7, hence
//   the rows an SM); slices not of 128 vectors lost (16384x4096 in 5 or 6
//   blocks 176-182). Rows of 1025-2048 vectors in 8 blocks: 8192x10240 201.8
//   -> 187.6, 8192x12288 238.1 -> 232.5, 4096x12288 123.1 -> 120.7; v72
//   (a block of 512 threads a row before): 4096x16384 160.8-160.9 ->
//   143.6-144.1, 8192x16384 308.3-309.0 -> 277.9-278.7 (4 blocks: 152.5,
//   291.2-291.7).
constexpr int kSplitMinRowsPerSm = 24, kRmsSplitMinRowsPerSm = 30;
constexpr int64_t kSplitSliceVecs = 640;
constexpr int64_t kWarpSliceVecs = 32 * kMaxBwdNv;  // a slice one warp holds

inline int split_parts_where_dram_is_slow(int64_t rows, int64_t nvec, int regions,
                                          const DeviceInfo& dev) {
  if (regions == 2) {
    if (rows < int64_t(kSplitMinRowsPerSm) * dev.sms || nvec <= 2 * kWarpSliceVecs ||
        (nvec > 512 && nvec <= 1024)) {
      return 1;
    }
    const int parts = int((nvec + kSplitSliceVecs - 1) / kSplitSliceVecs);
    return parts < 2 ? 2 : parts;
  }
  if (regions != 1 || rows < int64_t(kRmsSplitMinRowsPerSm) * dev.sms) return 1;
  if (nvec % kWarpSliceVecs == 0 && nvec >= 2 * kWarpSliceVecs && nvec <= 4 * kWarpSliceVecs) {
    return int(nvec / kWarpSliceVecs);
  }
  return nvec > 1024 && nvec <= 2048 ? 8 : 1;
}

template <typename X, typename G, typename W, int VEC>
RowPlan split_where_dram_is_slow(const RowPlan& p, int64_t rows, int64_t hidden, int regions,
                                 bool plain, const DeviceInfo& dev) {
  if (!dev.clusters) return p;
  const int64_t nvec = hidden / VEC;
  RowPlan q = p;
  q.parts = split_parts_where_dram_is_slow(rows, nvec, regions, dev);
  if (q.parts == 1) return p;
  q.rows_per_block = 1;
  q.groups = rows;
  q.tpr = threads_per_row((nvec + q.parts - 1) / q.parts, kMaxBwdNv);
  const bool in_regs = bwd_acc_in_regs<X, G, W, VEC>(q, hidden, regions, plain);
  if (q.parts > kMaxClusterParts || q.tpr > kAccRegsThreads ||
      bwd_smem_bytes<X, G, W, VEC>(q, hidden, false, regions, in_regs) > dev.max_dynamic_smem) {
    return p;
  }
  return q;
}

// Rows of 128, 192 or 256 vectors (1024-2048 bf16), at least
// kTwoVecMinRowsPerSm an SM, at 2 vectors a thread, not 4: twice the threads
// a row, half the rows a block, the same block. On H100s (v54; planned ->
// 2 vectors a thread, computing the statistics): 65536x1024 RMSNorm 154.9-155.7
// -> 137.6-137.7 us, LayerNorm 160.6-161.5 -> 146.2-146.5; 65536x1536 238.4 ->
// 203.7 and 241.9 -> 216.1; LayerNorm 32768x2048 163.4 -> 149.8; 16384x1024
// 41.9 -> 39.8 and 43.6 -> 42.6; but 8192x1024 (62 rows an SM) 23.5 -> 23.5
// and 24.7 -> 25.7. (On an H200, v28 measured only 3% at RMSNorm 65536x1024.)
constexpr int kTwoVecMinRowsPerSm = 100;

template <typename X, typename G, typename W, int VEC>
RowPlan two_vectors_a_thread(const RowPlan& p, int64_t rows, int64_t hidden, int regions,
                             bool plain, const DeviceInfo& dev) {
  const int64_t nvec = hidden / VEC;
  if (nvec % 64 != 0 || nvec < 128 || nvec > 256 ||
      rows < int64_t(kTwoVecMinRowsPerSm) * dev.sms) {
    return p;
  }
  RowPlan q = p;
  q.tpr = int(nvec / 2);
  q.rows_per_block = kAccRegsThreads / q.tpr;
  q.groups = (rows + q.rows_per_block - 1) / q.rows_per_block;
  return bwd_acc_in_regs<X, G, W, VEC>(q, hidden, regions, plain) ? q : p;
}

// RMSNorm's cluster split of rows of 3585-4096 vectors (28680-32768 bf16):
// 8 blocks a row of 256 threads at 2 vectors a thread, in place of 4 blocks
// at 4: the same blocks, half the bytes in flight in each. On an H100 (v55,
// computing the statistics): 2048x32768 157.9-158.0 -> 150.6-151.1 us,
// 256-4096 rows of 32768 1-5% faster, 30720 wide 1%; with fewer threads a
// block it lost (28672 wide 3.5%, 24576 7%, 26624 10%), and so did
// LayerNorm's (3 blocks of 352 threads with its accumulators in registers:
// 2048x32768 152.9 -> 242.1).
template <int VEC>
RowPlan split_at_two_vectors(const RowPlan& p, int64_t hidden, int regions) {
  if (regions != 1 || p.parts != 4) return p;
  RowPlan q = p;
  q.parts = 2 * p.parts;
  q.tpr = threads_per_row((hidden / VEC + q.parts - 1) / q.parts, kMaxBwdNv / 2);
  return q.tpr == kMaxSliceThreads ? q : p;
}

// RMSNorm's split (any with one accumulator) in full held slices
// (full_held_split) where each of its clusters takes at most
// `rows_per_cluster` rows: kHeldRowsPerCluster where DRAM is slow,
// kFewHeldRows where it is fast. Held, one block an SM
// takes a cluster's rows in fewer rounds, and its launch starts and ends
// sooner, than the unheld splits' two blocks an SM; over more rows their
// steadier rate wins. On an H100 (bf16, computing the statistics,
// benchmarks/NOTES.md v71; us, against split_at_two_vectors or the bulk
// copies), by rows a cluster: 17-34 5-15% faster (256x65536 46.2-49.5 ->
// 41.9-42.1, 512x65536 78.7-79.5 -> 75.0-75.2, 768x32768 61.7-62.1 ->
// 58.5-58.7, 1024x32768 79.8-80.0 -> 75.7-75.8, 1024x24576 63.6 -> 59.0);
// 39-53 2-5% faster at 24576 and 65536 wide, 1% slower at 1280x32768 (97.3-97.6
// -> 98.2-99.0); 60-137 2-4% slower. On an H200 (v85; us, against the
// split of 192-256 threads, two blocks an SM) by rows a cluster: 0.2-0.5
// 0-4% faster, 0.8-2.1 8-16% (32x24576 9.0 -> 8.3, 64x24576 11.4 -> 9.9,
// 64x32768 13.4 -> 11.3, 32x65536 13.2 -> 11.4), 3.3-6.6 1-10% (128x24576
// 13.8 -> 13.3, 256x24576 19.1 -> 18.9, 128x32768 16.6 -> 14.9, 64x65536
// 15.9 -> 15.1); at 8.2-8.5 3% slower at 320x24576, 4-5% faster at
// 256x32768 and 128x65536; 17 5% slower (256x65536 37.6 -> 39.5).
constexpr int kHeldRowsPerCluster = 40;

template <typename X, typename G, typename W, int VEC>
RowPlan rms_held_split(const RowPlan& p, int64_t rows, int64_t hidden, bool plain,
                       int64_t rows_per_cluster, const DeviceInfo& dev) {
  RowPlan q = p;
  const int clusters = full_held_split<X, G, W, VEC>(q, hidden, 1, plain, dev);
  return clusters > 0 && rows <= rows_per_cluster * clusters ? q : p;
}

// Where DRAM is slow (dy as wide as x): a plain cluster split of 16-bit rows
// that computes its statistics takes RMSNorm's held split (rms_held_split)
// where that serves, else split_at_two_vectors (given the statistics it ran
// 2% slower: 2048x32768 160.5 -> 163.3 us); a plan of one block an SM
// (one_block_an_sm) takes one of the two below, if either serves. Each
// measured for 16-bit x only.
template <typename X, typename G, typename W, int VEC>
RowPlan plan_where_dram_is_slow(const RowPlan& p, int64_t rows, int64_t hidden, int regions,
                                bool plain, bool own_stats, const DeviceInfo& dev) {
  if (!dram_is_slow(dev) || sizeof(G) != sizeof(X)) return p;
  if (p.parts > 1) {
    if (!plain || !own_stats || sizeof(X) != 2) return p;
    const RowPlan q =
        regions == 1
            ? rms_held_split<X, G, W, VEC>(p, rows, hidden, plain, kHeldRowsPerCluster, dev)
            : p;
    return q.held ? q : split_at_two_vectors<VEC>(p, hidden, regions);
  }
  if (!one_block_an_sm<X, G, W, VEC>(p, hidden, regions, plain)) return p;
  const RowPlan q = split_where_dram_is_slow<X, G, W, VEC>(p, rows, hidden, regions, plain, dev);
  return q.parts > 1 ? q : two_vectors_a_thread<X, G, W, VEC>(p, rows, hidden, regions, plain, dev);
}

// Backward rows: the element-wise plan; else 4 vectors a thread (the ring
// stages no more, and 8 held in registers spilled), with as many rows per
// block as keep two blocks on an SM, or the long path when a row does not
// fit. A block that holds its accumulators in registers (bwd_acc_in_regs)
// runs alone on its SM; where that serves, it takes as many rows as
// kAccRegsThreads allows while every SM still gets a group of them. On an
// H200 (bf16, computing the statistics, benchmarks/NOTES.md v32) one block
// of 384 threads beat two or three smaller ones with their accumulators in
// shared memory: LayerNorm 16384x4096 134 -> 109 us, 131072x512 140 -> 116;
// RMSNorm 16384x4096 109 -> 102, 32768x2048 110 -> 104. own_stats: the
// launch computes the rows' statistics (none saved, as under jax.grad).
template <typename X, typename G, typename W, int VEC>
RowPlan plan_bwd_rows(int64_t rows, int64_t hidden, int regions, bool plain, bool own_stats,
                      const DeviceInfo& dev) {
  const int sms = dev.sms;
  const int64_t nvec = hidden / VEC;
  RowPlan p = VEC == 1 ? elementwise_plan(rows, nvec, sms)
      : nvec > kMaxBwdNv * kMaxRowThreads ? plan_bwd_split(rows, nvec, dev)
      : plan_with_nv(rows, nvec, kMaxBwdNv, sms);
  if (p.nv == 0) return p;
  if (p.parts > 1) p = fewer_parts<X, G, W, VEC>(p, rows, hidden, regions, plain, dev);
  if (p.parts > 1 && regions == 1 && !dram_is_slow(dev)) {  // (slow: plan_where_dram_is_slow)
    p = rms_held_split<X, G, W, VEC>(p, rows, hidden, plain, kFewHeldRows, dev);
  }
  RowPlan wide = p;  // (a cluster's blocks take one row)
  if (p.parts == 1 && kAccRegsThreads / p.tpr > p.rows_per_block) {
    wide.rows_per_block = kAccRegsThreads / p.tpr;
  }
  wide.groups = (rows + wide.rows_per_block - 1) / wide.rows_per_block;
  if (wide.groups >= sms && bwd_acc_in_regs<X, G, W, VEC>(wide, hidden, regions, plain)) {
    p = wide;
  } else {
    // The sizes without a staged scale (plan_bwd stages it where that costs
    // the SM no block).
    while (p.rows_per_block > 1 &&
           bwd_smem_bytes<X, G, W, VEC>(p, hidden, false, regions) > kTwoBlocksSmem) {
      p.rows_per_block /= 2;
      p.groups = (rows + p.rows_per_block - 1) / p.rows_per_block;
    }
  }
  const bool in_regs = bwd_acc_in_regs<X, G, W, VEC>(p, hidden, regions, plain);
  if (bwd_smem_bytes<X, G, W, VEC>(p, hidden, false, regions, in_regs) > dev.max_dynamic_smem) {
    return plan_with_nv(rows, nvec, 0, sms);
  }
  return plan_where_dram_is_slow<X, G, W, VEC>(p, rows, hidden, regions, plain, own_stats, dev);
}

// Runs the backward with `a.partial` pointing at partial_bytes() of scratch.
template <typename X, typename G, typename W, int VEC>
cudaError_t launch_bwd(cudaStream_t stream, const BwdLaunch<X, G, W, VEC>& l,
                       BwdArgs a) {
  using A = acc_t<X>;
  a.tpr = l.plan.tpr;
  a.rows_per_block = l.plan.rows_per_block;
  a.parts = l.plan.parts;
  a.stage_params = l.stage_scale;
  const size_t partial = l.partial_bytes(a.hidden);
  if (l.plan.parts > 1 &&
      (!split_fits_slots(l.plan.parts, l.plan.threads()) || l.plan.rows_per_block != 1)) {
    // The cluster's sums would overrun their slots; a row past the end
    // would leave its stage unreleased (BulkFill).
    return cudaErrorInvalidConfiguration;
  }
  if (l.plan.nv == 0 && partial > 0) {
    cudaError_t err = cudaMemsetAsync(a.partial, 0, partial, stream);
    if (err != cudaSuccess) return err;
  }
  cudaError_t err = launch_clusters(l.kernel, unsigned(l.grid), l.plan.threads(), l.smem,
                                    l.plan.parts, stream, a);
  if (err != cudaSuccess || partial == 0) return err;
  return launch_sum_partials<W, A>(stream, a, l.partial_rows());
}

}  // namespace jaxnorm::cuda
