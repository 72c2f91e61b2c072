// CUDA handlers for the softmax over the channels of channels-last x:
// y = exp(x - max) / sum exp(x - max); dx = y * (dy - sum dy * y), y
// recomputed from x. A line in registers (channel_lines.cuh), its max and sums
// reduced by shuffles within its team: each pass reads x once. Lines of up to
// 3 vectors of 4-16 bytes a lane of a warp (768 bf16 channels, 384 float32);
// others, other layouts and float64 lower to jax.numpy (channel_softmax.py).
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

// Lines of the softmax load under their conditions, at ptxas's own register
// count: loading every vector (load_line's kEvery) took the forward over 150
// bf16 classes, whose lines leave 21 of 96 slots absent, from 19.9 to 21.0 us
// on an H200, 21.0-21.3 with 4 blocks an SM as well; the backward moved by 1-2%
// (notes v62).
struct SoftmaxFwdLine {
  static constexpr int kMinBlocks = 0;  // each_line
  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X*, X* y,
                                        bool valid) const {
    float v[M][V];
    load_line<X, M, V, false>(t, x, valid, -INFINITY, v);  // absent channels: exp gives 0
    softmax_line<M, V>(t, v);
    store_line<X, M, V>(t, y, valid, v);
  }
};

// dx = y * (dy - sum dy * y), y recomputed from x in float32 (XLA's fusion of
// the same math does too; the saved y would be rounded to x's dtype).
struct SoftmaxBwdLine {
  static constexpr int kMinBlocks = 0;  // each_line
  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X* dy, X* dx,
                                        bool valid) const {
    float v[M][V], g[M][V];
    load_line<X, M, V, false>(t, x, valid, -INFINITY, v);
    load_line<X, M, V, false>(t, dy, valid, 0.0f, g);
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
    jaxnorm::bind_channel_softmax_fwd(xla::ffi::Ffi::Bind()
                                          .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                          .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_channel_softmax_bwd, jaxnorm::cuda::softmax_bwd_impl,
    jaxnorm::bind_channel_softmax_bwd(xla::ffi::Ffi::Bind()
                                          .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                          .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
