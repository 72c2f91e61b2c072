// CUDA handlers for the softmax over the channels of x:
// y = exp(x - max) / sum exp(x - max); dx = y * (dy - sum dy * y), y
// recomputed from x. Channels-last x: a line in registers (channel_lines.cuh),
// its max and sums reduced by shuffles within its team: each pass reads x
// once. Lines that a warp holds in vectors of 4-16 bytes, at most 3 a lane
// (768 bf16 channels, 384 float32). Channels-first x: tiles of positions
// (softmax_tiles), up to kTileChannels channels. Others and float64 lower to
// jax.numpy (channel_softmax.py).
#include "cuda/channel_lines.cuh"

namespace jaxnorm::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// v: the lane's vectors of a line (absent channels -inf), replaced by their
// softmax over the team's line.
template <int M, int V>
__device__ __forceinline__ void softmax_line(const LineLane& t, LineVals<M, V>& v) {
  float top = -INFINITY;
#pragma unroll
  for (int j = 0; j < M; ++j) {
#pragma unroll
    for (int e = 0; e < V; ++e) top = fmaxf(top, v[j][e]);
  }
  top = team_reduce(t, top, [](float a, float b) { return fmaxf(a, b); });
  // exp(x - top) as exp2(x log2e - top log2e): one FMA and one MUFU.EX2.
  const float shift = top * kLog2e;
  float total = 0.0f;
#pragma unroll
  for (int j = 0; j < M; ++j) {
#pragma unroll
    for (int e = 0; e < V; ++e) total += (v[j][e] = exp2f(fmaf(v[j][e], kLog2e, -shift)));
  }
  const float inv = 1.0f / team_reduce(t, total, [](float a, float b) { return a + b; });
#pragma unroll
  for (int j = 0; j < M; ++j) {
#pragma unroll
    for (int e = 0; e < V; ++e) v[j][e] *= inv;
  }
}

// The forward of one line (kEvery: load_line's).
template <typename X, int M, int V, bool kEvery>
__device__ __forceinline__ void softmax_fwd_line(const LineLane& t, const X* x, X* y,
                                                 bool valid) {
  float v[M][V];
  load_line<X, M, V, kEvery>(t, x, valid, -INFINITY, v);  // absent channels: exp gives 0
  softmax_line<M, V>(t, v);
  store_line<X, M, V>(t, y, valid, v);
}

// dx = y * (dy - sum dy * y), y recomputed from x in float32 (XLA's fusion of
// the same math does too; the saved y would be rounded to x's dtype).
template <typename X, int M, int V, bool kEvery>
__device__ __forceinline__ void softmax_bwd_line(const LineLane& t, const X* x, const X* dy,
                                                 X* dx, bool valid) {
  float v[M][V], g[M][V];
  load_line<X, M, V, kEvery>(t, x, valid, -INFINITY, v);
  load_line<X, M, V, kEvery>(t, dy, valid, 0.0f, g);
  softmax_line<M, V>(t, v);
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < M; ++j) {
#pragma unroll
    for (int e = 0; e < V; ++e) dot = fmaf(g[j][e], v[j][e], dot);
  }
  dot = team_reduce(t, dot, [](float a, float b) { return a + b; });
#pragma unroll
  for (int j = 0; j < M; ++j) {
#pragma unroll
    for (int e = 0; e < V; ++e) g[j][e] = v[j][e] * (g[j][e] - dot);
  }
  store_line<X, M, V>(t, dx, valid, g);
}

// The softmax's teams and loads (kernels/softmax_lines.cu, notes v63). Lines
// of 4-byte vectors that need a warp at 3 vectors a lane (150 bf16 classes,
// say) take 16 lanes of up to 5 vectors (plan_line), other lines keep their
// teams: on an H100, 150 bf16 classes ran forward / backward in
// 20.9 / 29.8 µs in teams of 32 lanes of 3 vectors, 16.3 / 22.8 in 16 lanes of
// 5 and 19.8 / 26.7 in 8 lanes of 10; 80 bf16 classes (16-byte vectors) ran
// fastest in the 4 lanes of 3 (6.0 µs forward against 7.7 in 2 lanes of 5).
// The loads, at ptxas's own register count: each under its condition, but
// for the forward at 4-5 vectors a lane, which loads every vector (load_line's
// kEvery). Over 150 bf16 classes in 32 lanes, whose lines leave 21 of 96
// slots absent, kEvery took the forward from 19.9 to 21.0 µs on an H200
// (notes v62); in 16 lanes of 5 (5 of 80 absent) it took the forward from
// 16.3 to 15.4 µs on an H100 and the backward from 22.8 to 24.1.
struct SoftmaxLines {
  static constexpr int kMinBlocks = 0;  // each_line
  static constexpr int max_vecs(int vec_bytes) {  // launch_lines
    return vec_bytes == 4 ? kMaxLaneVecs : kMaxLineVecs;
  }
  template <int M, bool kBwd>
  static constexpr bool every() { return !kBwd && M > kMaxLineVecs; }
};

struct SoftmaxFwdLine : SoftmaxLines {
  static constexpr bool kBwd = false;
  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X*, X* y,
                                        bool valid) const {
    softmax_fwd_line<X, M, V, every<M, false>()>(t, x, y, valid);
  }
};

struct SoftmaxBwdLine : SoftmaxLines {
  static constexpr bool kBwd = true;
  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X* dy, X* dx,
                                        bool valid) const {
    softmax_bwd_line<X, M, V, every<M, true>()>(t, x, dy, dx, valid);
  }
};

// Channels-first x (B > 1, NCHW) as (M, C, B): a block takes a tile of 32 P
// consecutive positions of one of the M lines, warp w the channels w, w + 8,
// ..., each lane P neighbouring positions of them, so that a warp's load is
// 32 P consecutive elements (256 bytes at P = 4 for 16-bit x). A thread holds
// its K channels (C <= 8 K) in registers; the max, the sum and the
// backward's dot go over the warps through shared memory, in warp order.
// One read of x (and dy) and one write. (A thread walking all of a
// position's channels, 8 loads in flight, lost to XLA's fusion: notes v64.)
constexpr int kTileWarps = kLineThreads / 32;
constexpr int kTileChannels = 256;  // K = 32: jaxnorm/_channels.py's cuda_position_tiles_fit

// v[e] for each of the thread's P positions, combined over the block's warps
// by `op` (every thread of the block calls it).
template <int P, typename Op>
__device__ __forceinline__ void over_warps(float (&v)[P], float (*part)[32 * P], Op op) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int e = 0; e < P; ++e) part[warp][lane * P + e] = v[e];
  __syncthreads();
#pragma unroll
  for (int e = 0; e < P; ++e) {
    v[e] = part[0][lane * P + e];
#pragma unroll
    for (int w = 1; w < kTileWarps; ++w) v[e] = op(v[e], part[w][lane * P + e]);
  }
  __syncthreads();  // before part's next use
}

template <typename X, int P, int K, bool kBwd>
__global__ void __launch_bounds__(kLineThreads) softmax_tiles(ChannelShape s, const X* x,
                                                              const X* dy, X* out) {
  __shared__ float part[kTileWarps][32 * P];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = int(s.c), b = int(s.b);  // C * B < 2^31 (run_tiles)
  const int64_t tiles = (s.b + 32 * P - 1) / (32 * P);
  for (int64_t tile = blockIdx.x; tile < s.m * tiles; tile += gridDim.x) {
    const int first = int(tile % tiles) * 32 * P + lane * P;  // P divides B
    const bool valid = first < b;
    const int64_t at = tile / tiles * s.c * s.b + first;
    auto has = [&](int k) { return valid && warp + k * kTileWarps < c; };
    auto offset = [&](int k) { return at + (warp + k * kTileWarps) * b; };
    RegVec<X, P> xv[K], gv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (has(k)) {
        xv[k].load(x + offset(k));
        if (kBwd) gv[k].load(dy + offset(k));
      } else {
        xv[k].zero(), gv[k].zero();
      }
    }
    float top[P], total[P], inv[P];
#pragma unroll
    for (int e = 0; e < P; ++e) top[e] = -INFINITY, total[e] = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int e = 0; e < P; ++e) top[e] = has(k) ? fmaxf(top[e], xv[k].get(e)) : top[e];
    }
    over_warps<P>(top, part, [](float a, float b) { return fmaxf(a, b); });
    // exp(x - top) as exp2(x log2e - top log2e), as the line kernels.
    float shift[P];
#pragma unroll
    for (int e = 0; e < P; ++e) shift[e] = top[e] * kLog2e;
    auto y_of = [&](int k, int e) { return exp2f(fmaf(xv[k].get(e), kLog2e, -shift[e])); };
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int e = 0; e < P; ++e) total[e] += has(k) ? y_of(k, e) : 0.0f;
    }
    over_warps<P>(total, part, [](float a, float b) { return a + b; });
#pragma unroll
    for (int e = 0; e < P; ++e) inv[e] = 1.0f / total[e];
    float dot[P] = {};
    if constexpr (kBwd) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int e = 0; e < P; ++e) {
          dot[e] = has(k) ? fmaf(gv[k].get(e), y_of(k, e) * inv[e], dot[e]) : dot[e];
        }
      }
      over_warps<P>(dot, part, [](float a, float b) { return a + b; });
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!has(k)) continue;
      float o[P];
#pragma unroll
      for (int e = 0; e < P; ++e) {
        const float y = y_of(k, e) * inv[e];
        o[e] = kBwd ? y * (gv[k].get(e) - dot[e]) : y;
      }
      store_vec<P>(out + offset(k), o);
    }
  }
}

// Positions a thread of softmax_tiles takes (P): the most of 4, 2 and 1
// that B and the buffers allow (vec_fits) whose kernel, for this K, keeps two
// blocks on an SM and has a tile for every SM; else the most that keep two
// blocks; else the most that fit. ptxas gives the instantiations from 32 to
// 255 registers, not in the order of their K P, and with one block an SM a
// tile's barriers leave the SM without loads in flight. On an H100
// (benchmarks/NOTES.md v65; µs forward / forward+backward, the pick marked *):
// bf16 16x150x64x64 P4* 22.4 / 53.8, P2 27.7 / 40.6*; 4x256x64x64 P4 11.0 /
// 17.5, P2 8.1* / 20.8, P1 19.9 / 17.1*; 8x128x32x32 (128 tiles at P2) P2 4.1 /
// 5.9, P1 3.6* / 5.0*.
template <typename X, int K, bool kBwd>
int tile_positions(const ChannelShape& s, std::initializer_list<const void*> ptrs,
                   const DeviceInfo& dev) {
  int fits = 0, two_blocks = 0;
  auto consider = [&](auto pt) {
    constexpr int P = decltype(pt)::value;
    if (!vec_fits<X>(s.b, P, ptrs)) return 0;
    if (fits == 0) fits = P;
    if (blocks_per_sm(softmax_tiles<X, P, K, kBwd>, kLineThreads, 0, dev) < 2) return 0;
    if (two_blocks == 0) two_blocks = P;
    return s.m * ((s.b + 32 * P - 1) / (32 * P)) >= dev.sms ? P : 0;
  };
  for (int p : {consider(std::integral_constant<int, 4>{}),
                consider(std::integral_constant<int, 2>{}),
                consider(std::integral_constant<int, 1>{})}) {
    if (p > 0) return p;
  }
  return two_blocks > 0 ? two_blocks : fits;
}

template <bool kBwd>
ffi::Error run_tiles(cudaStream_t stream, int32_t device, const AnyBuffer& x,
                     const AnyBuffer* dy, AnyBuffer& out, const char* what) {
  ChannelShape s;
  return with_position_operands(x, dy, out, &s, what, kTileChannels, [&](auto in0, auto in1,
                                                                         auto o) {
    using X = std::remove_const_t<std::remove_pointer_t<decltype(in0)>>;
    const DeviceInfo& dev = device_info(device);
    auto go = [&](auto kt) {
      constexpr int K = decltype(kt)::value;
      auto launch = [&](auto pt) {
        constexpr int P = decltype(pt)::value;
        const int grid = line_grid(s.m * ((s.b + 32 * P - 1) / (32 * P)), device);
        softmax_tiles<X, P, K, kBwd><<<grid, kLineThreads, 0, stream>>>(s, in0, in1, o);
      };
      switch (tile_positions<X, K, kBwd>(s, {in0, in1, o}, dev)) {
        case 4: launch(std::integral_constant<int, 4>{}); break;
        case 2: launch(std::integral_constant<int, 2>{}); break;
        default: launch(std::integral_constant<int, 1>{}); break;
      }
    };
    const int64_t k = (s.c + kTileWarps - 1) / kTileWarps;
    if (k <= 4) go(std::integral_constant<int, 4>{});
    else if (k <= 8) go(std::integral_constant<int, 8>{});
    else if (k <= 16) go(std::integral_constant<int, 16>{});
    else if (k <= 24) go(std::integral_constant<int, 24>{});
    else go(std::integral_constant<int, 32>{});
    return last_launch_error(what);
  });
}

template <typename Op>
ffi::Error run(cudaStream_t stream, int32_t device, const AnyBuffer& x, const AnyBuffer* dy,
               AnyBuffer& out, const char* what) {
  if (x.dimensions().size() == 3 && x.dimensions()[2] > 1) {
    return run_tiles<Op::kBwd>(stream, device, x, dy, out, what);
  }
  ChannelShape s;
  // Vectors of 2-byte channels lost to XLA's fusion (notes v61).
  return with_line_buffers<1, 4>(x, dy, out, &s, [&](auto vt, auto in0, auto in1, auto o) {
    using X = std::remove_const_t<std::remove_pointer_t<decltype(in0)>>;
    return launch_lines<X, decltype(vt)::value>(stream, device, s, in0, in1, o, Op{}, what);
  });
}

ffi::Error softmax_fwd_impl(cudaStream_t stream, int32_t device, AnyBuffer x,
                            ffi::Result<AnyBuffer> y) {
  return run<SoftmaxFwdLine>(stream, device, x, nullptr, *y, "channel_softmax_fwd");
}

ffi::Error softmax_bwd_impl(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer dy,
                            ffi::Result<AnyBuffer> dx) {
  return run<SoftmaxBwdLine>(stream, device, x, &dy, *dx, "channel_softmax_bwd");
}

}  // namespace
}  // namespace jaxnorm::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_channel_softmax_fwd, jaxnorm::cuda::softmax_fwd_impl,
    jaxnorm::bind_channel_softmax_fwd(jaxnorm::cuda::cuda_bind()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_channel_softmax_bwd, jaxnorm::cuda::softmax_bwd_impl,
    jaxnorm::bind_channel_softmax_bwd(jaxnorm::cuda::cuda_bind()),
    {xla::ffi::Traits::kCmdBufferCompatible});
