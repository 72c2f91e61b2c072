// CUDA handlers for the softmax over the channels of channels-last x:
// y = exp(x - max) / sum exp(x - max); dx = y * (dy - sum dy * y), y
// recomputed from x. A line in registers (channel_lines.cuh), its max and sums
// reduced by shuffles within its team: each pass reads x once. Lines that a
// warp holds in vectors of 4-16 bytes, at most 3 a lane (768 bf16 channels,
// 384 float32); others, other layouts and float64 lower to jax.numpy
// (channel_softmax.py).
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
  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X*, X* y,
                                        bool valid) const {
    softmax_fwd_line<X, M, V, every<M, false>()>(t, x, y, valid);
  }
};

struct SoftmaxBwdLine : SoftmaxLines {
  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X* dy, X* dx,
                                        bool valid) const {
    softmax_bwd_line<X, M, V, every<M, true>()>(t, x, dy, dx, valid);
  }
};

template <typename Op>
ffi::Error run(cudaStream_t stream, int32_t device, const AnyBuffer& x, const AnyBuffer* dy,
               AnyBuffer& out, const char* what) {
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
