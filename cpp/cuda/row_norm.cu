// CUDA kernels for the row norms: RMSNorm (centered = false) and LayerNorm
// (centered = true), forward and backward.
//
// Register path: a row is split over `tpr` threads that each hold a few
// 16-byte vectors of it in registers, so x (and dy) are read from DRAM exactly
// once; short rows pack several rows into one block. Rows too long for
// registers take the long path: one block per row, re-reading the row (mostly
// from L2) for each pass.
//
// Backward: a persistent grid; each block accumulates its rows' dscale/dbias
// contributions in fp32 registers and writes one partial row; a second kernel
// sums the partials in a fixed order, so results are bitwise reproducible.
#include "common/row_norm_args.h"
#include "cuda/common.cuh"

namespace jaxnorm::cuda {
namespace {

// Elements of a row each thread keeps in registers on the register path. The
// element-wise (VEC = 1) fallback keeps fewer: each element costs its own
// bounds check and load there.
template <typename A, int VEC>
constexpr int kFwdElems = VEC == 1 ? 4 : std::is_same_v<A, double> ? 16 : 32;
template <typename A, int VEC>
constexpr int kBwdElems = VEC == 1 ? 4 : std::is_same_v<A, double> ? 8 : 24;
constexpr int kMaxRowThreads = 512;   // register path; bounds registers/thread
constexpr int kLongThreads = 1024;    // long path
constexpr int kBlockTarget = 256;     // threads per block when rows are short

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
};

struct BwdArgs {
  const void* x;
  const void* scale;
  const void* mean;
  const void* rstd;
  const void* dy;
  void* dx;
  void* partial;  // [regions][gridDim.x][hidden] accumulation type
  int64_t rows, hidden;
  int tpr, rows_per_block;
  bool centered, has_scale, has_bias;
};

// ----------------------------------------------------------------- forward

template <typename X, typename Y, typename W, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads) fwd_regs(FwdArgs a) {
  using A = acc_t<X>;
  constexpr int NV = kFwdElems<A, VEC> / VEC;
  __shared__ A smem[32];
  const int lane = threadIdx.x % a.tpr;
  const int slot = threadIdx.x / a.tpr;
  const int64_t nvec = a.hidden / VEC;
  const A inv_n = A(1) / A(a.hidden);
  for (int64_t g = blockIdx.x; g * a.rows_per_block < a.rows; g += gridDim.x) {
    const int64_t row = g * a.rows_per_block + slot;
    const bool valid = row < a.rows;
    const X* xr = static_cast<const X*>(a.x) + row * a.hidden;
    A v[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = lane + int64_t(i) * a.tpr;
      if (valid && c < nvec) {
        load_vec(v[i], xr + c * VEC);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[i][e] = 0;
      }
    }
    A mean = 0;
    if (a.centered) {
      A s[1] = {0};
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) s[0] += v[i][e];
      row_sum(s, a.tpr, smem);
      mean = s[0] * inv_n;
    }
    A ss[1] = {0};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const bool in_row = lane + int64_t(i) * a.tpr < nvec;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        v[i][e] = in_row ? v[i][e] - mean : A(0);
        ss[0] += v[i][e] * v[i][e];
      }
    }
    row_sum(ss, a.tpr, smem);
    const A rstd = rsqrt_acc(ss[0] * inv_n + A(a.epsilon));
    if (valid && lane == 0) {
      if (a.centered) static_cast<A*>(a.mean)[row] = mean;
      static_cast<A*>(a.rstd)[row] = rstd;
    }
    if (!a.write_y || !valid) continue;
    Y* yr = static_cast<Y*>(a.y) + row * a.hidden;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = lane + int64_t(i) * a.tpr;
      if (c >= nvec) continue;
      A o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] = v[i][e] * rstd;
      if (a.has_scale) {
        A w[VEC];
        load_vec(w, static_cast<const W*>(a.scale) + c * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] *= w[e];
      }
      if (a.has_bias) {
        A b[VEC];
        load_vec(b, static_cast<const W*>(a.bias) + c * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] += b[e];
      }
      store_vec(yr + c * VEC, o);
    }
  }
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
      if (a.has_scale) load_vec(w, static_cast<const W*>(a.scale) + c * VEC);
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

// Adds the block's per-slot accumulators in slot order through shared memory
// and writes the block's partial row. All threads must call it.
template <int NV, int VEC, typename A>
__device__ void write_block_partial(const A (&acc)[NV][VEC], A* out,
                                    const BwdArgs& a, A* buf) {
  const int lane = threadIdx.x % a.tpr;
  const int slot = threadIdx.x / a.tpr;
  const int64_t nvec = a.hidden / VEC;
  for (int s = 0; s < a.rows_per_block; ++s) {
    if (slot == s) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t c = lane + int64_t(i) * a.tpr;
        if (c >= nvec) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          A prev = s == 0 ? A(0) : buf[c * VEC + e];
          A sum = prev + acc[i][e];
          if (s + 1 == a.rows_per_block) out[c * VEC + e] = sum;
          else buf[c * VEC + e] = sum;
        }
      }
    }
    __syncthreads();
  }
}

template <typename X, typename G, typename W, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads) bwd_regs(BwdArgs a) {
  using A = acc_t<X>;
  constexpr int NV = kBwdElems<A, VEC> / VEC;
  __shared__ A smem[32 * 2];
  extern __shared__ __align__(16) unsigned char slot_buf_raw[];
  A* slot_buf = reinterpret_cast<A*>(slot_buf_raw);
  const int lane = threadIdx.x % a.tpr;
  const int slot = threadIdx.x / a.tpr;
  const int64_t nvec = a.hidden / VEC;
  const A inv_n = A(1) / A(a.hidden);
  A dw[NV][VEC], db[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) dw[i][e] = db[i][e] = 0;

  for (int64_t grp = blockIdx.x; grp * a.rows_per_block < a.rows;
       grp += gridDim.x) {
    const int64_t row = grp * a.rows_per_block + slot;
    const bool valid = row < a.rows;
    const int64_t base = row * a.hidden;
    A xh[NV][VEC], g[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = lane + int64_t(i) * a.tpr;
      if (valid && c < nvec) {
        load_vec(xh[i], static_cast<const X*>(a.x) + base + c * VEC);
        load_vec(g[i], static_cast<const G*>(a.dy) + base + c * VEC);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) xh[i][e] = g[i][e] = 0;
      }
    }
    const A mean = valid && a.centered ? static_cast<const A*>(a.mean)[row] : A(0);
    const A rstd = valid ? static_cast<const A*>(a.rstd)[row] : A(0);
    A s[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = lane + int64_t(i) * a.tpr;
      if (c >= nvec) continue;
      A w[VEC];
      if (a.has_scale) load_vec(w, static_cast<const W*>(a.scale) + c * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A d = g[i][e];
        xh[i][e] = (xh[i][e] - mean) * rstd;  // 0 on invalid rows (rstd = 0)
        dw[i][e] += d * xh[i][e];
        db[i][e] += d;
        if (a.has_scale) g[i][e] = d * w[e];
        s[0] += g[i][e] * xh[i][e];
        s[1] += g[i][e];
      }
    }
    row_sum(s, a.tpr, smem);
    const A c_gx = s[0] * inv_n;
    const A c_g = a.centered ? s[1] * inv_n : A(0);
    if (!valid) continue;
    X* dxr = static_cast<X*>(a.dx) + base;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = lane + int64_t(i) * a.tpr;
      if (c >= nvec) continue;
      A o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] = rstd * (g[i][e] - c_g - xh[i][e] * c_gx);
      store_vec(dxr + c * VEC, o);
    }
  }
  A* partial = static_cast<A*>(a.partial);
  const int64_t region = int64_t(gridDim.x) * a.hidden;
  A* mine = partial + int64_t(blockIdx.x) * a.hidden;
  if (a.has_scale) {
    write_block_partial(dw, mine, a, slot_buf);
    mine += region;
  }
  if (a.has_bias) write_block_partial(db, mine, a, slot_buf);
}

template <typename X, typename G, typename W, int VEC>
__global__ void __launch_bounds__(kLongThreads) bwd_long(BwdArgs a) {
  using A = acc_t<X>;
  __shared__ A smem[32 * 2];
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
    if (a.has_scale) load_vec(w, static_cast<const W*>(a.scale) + c * VEC);
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
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        s[0] += g[e] * xh[e];
        s[1] += g[e];
      }
    }
    row_sum(s, blockDim.x, smem);
    const A c_gx = s[0] * inv_n;
    const A c_g = a.centered ? s[1] * inv_n : A(0);
    X* dxr = static_cast<X*>(a.dx) + base;
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      A xh[VEC], d[VEC], g[VEC], o[VEC];
      load(base, c, mean, rstd, xh, d, g);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        o[e] = rstd * (g[e] - c_g - xh[e] * c_gx);
        if (a.has_scale) pw[c * VEC + e] += d[e] * xh[e];
        if (a.has_bias) pb[c * VEC + e] += d[e];
      }
      store_vec(dxr + c * VEC, o);
    }
  }
}

// out[j] = sum over p of partial[p][j], p in increasing order. blockIdx.y picks
// the region (dscale, then dbias).
template <typename W, typename A>
__global__ void sum_partials(const A* partial, int64_t parts, int64_t hidden,
                             W* out0, W* out1) {
  __shared__ A tile[8][33];
  const A* p = partial + int64_t(blockIdx.y) * parts * hidden;
  W* out = blockIdx.y == 0 ? out0 : out1;
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A s = 0;
  if (col < hidden) {
    for (int64_t r = threadIdx.y; r < parts; r += 8) s += p[r * hidden + col];
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= hidden) return;
  A t = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) t += tile[k][threadIdx.x];
  out[col] = from_acc<W>(t);
}

// ------------------------------------------------------------------ launch

struct RowPlan {
  bool regs;           // row held in registers (else the long path)
  int tpr;             // threads per row
  int rows_per_block;
  int64_t groups;      // blocks' worth of rows
};

RowPlan plan_rows(int64_t rows, int64_t nvec, int per_thread, int sms) {
  RowPlan p{};
  const int64_t need = (nvec + per_thread - 1) / per_thread;
  if (need > kMaxRowThreads) {
    p.regs = false;
    p.tpr = kLongThreads;
    p.rows_per_block = 1;
    p.groups = rows;
    return p;
  }
  p.regs = true;
  int tpr = 1;
  while (tpr < need && tpr < 32) tpr *= 2;
  if (need > 32) tpr = int((need + 31) / 32 * 32);
  // Few rows: spread each over more threads, so that each waits on fewer loads.
  while (rows * tpr < int64_t(sms) * 1024 && tpr * 2 <= kMaxRowThreads &&
         tpr < nvec) {
    tpr *= 2;
  }
  int rpb = tpr >= kBlockTarget ? 1 : kBlockTarget / tpr;
  while (rpb > 1 && (rows + rpb - 1) / rpb < 2 * int64_t(sms)) rpb /= 2;
  p.tpr = tpr;
  p.rows_per_block = rpb;
  p.groups = (rows + rpb - 1) / rpb;
  return p;
}

int grid_size(int64_t groups, int64_t cap) {
  return int(groups < cap ? groups : cap);
}

template <typename X, typename Y, typename W, int VEC>
ffi::Error launch_fwd_vec(cudaStream_t stream, int sms, FwdArgs a) {
  using A = acc_t<X>;
  RowPlan p = plan_rows(a.rows, a.hidden / VEC, kFwdElems<A, VEC> / VEC, sms);
  a.tpr = p.tpr;
  a.rows_per_block = p.rows_per_block;
  if (p.regs) {
    fwd_regs<X, Y, W, VEC><<<grid_size(p.groups, 1 << 20),
                             p.tpr * p.rows_per_block, 0, stream>>>(a);
  } else {
    fwd_long<X, Y, W, VEC>
        <<<grid_size(p.groups, 1 << 20), kLongThreads, 0, stream>>>(a);
  }
  return last_launch_error("row_norm_fwd");
}

template <typename X, typename Y, typename W, int VEC>
ffi::Error launch_bwd_vec(cudaStream_t stream, int sms,
                          ffi::ScratchAllocator& scratch, BwdArgs a,
                          W* dscale, W* dbias) {
  using A = acc_t<X>;
  RowPlan p = plan_rows(a.rows, a.hidden / VEC, kBwdElems<A, VEC> / VEC, sms);
  a.tpr = p.tpr;
  a.rows_per_block = p.rows_per_block;
  const int threads = p.regs ? p.tpr * p.rows_per_block : kLongThreads;
  const size_t slot_bytes =
      p.regs && p.rows_per_block > 1
          ? size_t(p.tpr) * (kBwdElems<A, VEC> / VEC) * VEC * sizeof(A)
          : 0;
  auto kernel = p.regs ? bwd_regs<X, Y, W, VEC> : bwd_long<X, Y, W, VEC>;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads,
                                                    slot_bytes) != cudaSuccess ||
      per_sm < 1) {
    cudaGetLastError();
    per_sm = 1;
  }
  const int grid = grid_size(p.groups, int64_t(per_sm) * sms);
  const int regions = int(a.has_scale) + int(a.has_bias);
  const size_t partial_bytes = size_t(regions) * grid * a.hidden * sizeof(A);
  if (regions > 0) {
    auto mem = scratch.Allocate(partial_bytes, 16);
    if (!mem.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jaxnorm: cannot allocate " +
                            std::to_string(partial_bytes) +
                            " bytes of scratch for row_norm_bwd");
    }
    a.partial = *mem;
    if (!p.regs && cudaMemsetAsync(a.partial, 0, partial_bytes, stream) != cudaSuccess) {
      return last_launch_error("row_norm_bwd (memset)");
    }
  }
  kernel<<<grid, threads, slot_bytes, stream>>>(a);
  JAXNORM_RETURN_IF_ERROR(last_launch_error("row_norm_bwd"));
  if (regions == 0) return ffi::Error::Success();
  W* out0 = a.has_scale ? dscale : dbias;
  dim3 sum_grid(unsigned((a.hidden + 31) / 32), unsigned(regions));
  sum_partials<W, A><<<sum_grid, dim3(32, 8), 0, stream>>>(
      static_cast<const A*>(a.partial), grid, a.hidden, out0, dbias);
  return last_launch_error("row_norm_bwd (parameter gradients)");
}

// Runs launch<VEC>() with 16-byte vectors when the row length and every
// pointer allow them, else element by element.
template <typename X, typename F>
ffi::Error with_vec(int64_t hidden, std::initializer_list<const void*> ptrs,
                    F&& launch) {
  constexpr int kVec = 16 / sizeof(X);
  bool ok = hidden % kVec == 0;
  for (const void* q : ptrs) ok = ok && aligned16(q);
  if (ok) return launch(std::integral_constant<int, kVec>{});
  return launch(std::integral_constant<int, 1>{});
}

ffi::Error row_norm_fwd_impl(cudaStream_t stream, int32_t device, AnyBuffer x,
                             AnyBuffer scale, AnyBuffer bias,
                             ffi::Result<AnyBuffer> y,
                             ffi::Result<AnyBuffer> mean,
                             ffi::Result<AnyBuffer> rstd, double epsilon,
                             bool centered) {
  RowNormShape s;
  bool write_y = true;
  JAXNORM_RETURN_IF_ERROR(check_row_norm_fwd(x, scale, bias, *y, *mean, *rstd,
                                             epsilon, centered, &s, &write_y));
  if (s.rows == 0 || s.hidden == 0) return ffi::Error::Success();
  FwdArgs a{x.untyped_data(), scale.untyped_data(), bias.untyped_data(),
            y->untyped_data(), mean->untyped_data(), rstd->untyped_data(),
            s.rows, s.hidden, 0, 0, epsilon, centered, s.has_scale, s.has_bias,
            write_y};
  const int sms = multiprocessor_count(device);
  DataType ydt = write_y ? y->element_type() : x.element_type();
  return dispatch_row_types(
      x.element_type(), ydt, param_dtype(x, scale, bias, s),
      [&](auto xt, auto yt, auto wt) {
        using X = native_t<decltype(xt)>;
        using Y = native_t<decltype(yt)>;
        using W = native_t<decltype(wt)>;
        return with_vec<X>(s.hidden, {a.x, a.y, a.scale, a.bias}, [&](auto v) {
          return launch_fwd_vec<X, Y, W, decltype(v)::value>(stream, sms, a);
        });
      });
}

ffi::Error row_norm_bwd_impl(cudaStream_t stream, int32_t device,
                             ffi::ScratchAllocator scratch, AnyBuffer x,
                             AnyBuffer scale, AnyBuffer mean, AnyBuffer rstd,
                             AnyBuffer dy, ffi::Result<AnyBuffer> dx,
                             ffi::Result<AnyBuffer> dscale,
                             ffi::Result<AnyBuffer> dbias, bool centered) {
  RowNormShape s;
  JAXNORM_RETURN_IF_ERROR(check_row_norm_bwd(x, scale, mean, rstd, dy, *dx,
                                             *dscale, *dbias, centered, &s));
  if (s.hidden == 0) return ffi::Error::Success();
  if (s.rows == 0) {  // empty batch: parameter gradients are zero
    for (auto* out : {&dscale, &dbias}) {
      if ((*out)->size_bytes() == 0) continue;
      if (cudaMemsetAsync((*out)->untyped_data(), 0, (*out)->size_bytes(),
                          stream) != cudaSuccess) {
        return last_launch_error("row_norm_bwd (memset)");
      }
    }
    return ffi::Error::Success();
  }
  BwdArgs a{x.untyped_data(), scale.untyped_data(), mean.untyped_data(),
            rstd.untyped_data(), dy.untyped_data(), dx->untyped_data(),
            nullptr, s.rows, s.hidden, 0, 0, centered, s.has_scale,
            s.has_bias};
  const int sms = multiprocessor_count(device);
  return dispatch_row_types(
      x.element_type(), dy.element_type(), param_dtype(x, scale, *dbias, s),
      [&](auto xt, auto gt, auto wt) {
        using X = native_t<decltype(xt)>;
        using G = native_t<decltype(gt)>;
        using W = native_t<decltype(wt)>;
        return with_vec<X>(s.hidden, {a.x, a.dy, a.dx, a.scale}, [&](auto v) {
          return launch_bwd_vec<X, G, W, decltype(v)::value>(
              stream, sms, scratch, a, static_cast<W*>(dscale->untyped_data()),
              static_cast<W*>(dbias->untyped_data()));
        });
      });
}

}  // namespace
}  // namespace jaxnorm::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_row_norm_fwd, jaxnorm::cuda::row_norm_fwd_impl,
    jaxnorm::bind_row_norm_fwd(
        xla::ffi::Ffi::Bind()
            .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
            .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

// Not command-buffer compatible: it allocates scratch for the partial sums.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_row_norm_bwd, jaxnorm::cuda::row_norm_bwd_impl,
    jaxnorm::bind_row_norm_bwd(
        xla::ffi::Ffi::Bind()
            .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
            .Ctx<xla::ffi::DeviceOrdinal>()
            .Ctx<xla::ffi::ScratchAllocator>()));
