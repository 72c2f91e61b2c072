// CUDA handlers for local response normalization across the channels of
// channels-last x, as PyTorch's: y = x * den^-beta, den = k + alpha / size *
// (sum of x^2 over the window of size channels, size / 2 before the channel
// and (size - 1) / 2 after, clipped at the line's ends). A line in registers
// (channel_lines.cuh); a window reaches into the neighbouring lanes' vectors
// by shuffles. Windows of 3, 5 and 7 channels (others, other layouts and
// float64 lower to jax.numpy: local_response_norm.py's _supports).
#include "cuda/channel_lines.cuh"

namespace jaxnorm::cuda {
namespace {

// out[j][e] = sum of s over channels [c - kLo, c + kHi] of the line, c the
// channel of the lane's vector j, element e; s is zero past the line's end.
// The channels before a vector come from the lane before it in the team (for
// lane 0, the last lane's previous vector), those after from the next lane
// (for the last lane, lane 0's next vector).
template <int kLo, int kHi, int M, int V>
__device__ __forceinline__ void window_sums(const LineLane& t, const LineVals<M, V>& s,
                                            LineVals<M, V>& out) {
  constexpr int kHalf = kLo > kHi ? kLo : kHi;
  static_assert(kHalf <= V, "a window reaches one vector each way");
  const int before = (t.lane + t.lanes - 1) & (t.lanes - 1);
  const int after = (t.lane + 1) & (t.lanes - 1);
  float left[M][kHalf], right[M][kHalf];  // the tail of lane-1's vector, the head of lane+1's
#pragma unroll
  for (int j = 0; j < M; ++j) {
#pragma unroll
    for (int q = 0; q < kHalf; ++q) {
      left[j][q] = __shfl_sync(0xffffffffu, s[j][V - kHalf + q], before, t.lanes);
      right[j][q] = __shfl_sync(0xffffffffu, s[j][q], after, t.lanes);
    }
  }
  const bool first = t.lane == 0, last = t.lane == t.lanes - 1;
#pragma unroll
  for (int j = 0; j < M; ++j) {
    float ext[kHalf + V + kHalf];
#pragma unroll
    for (int q = 0; q < kHalf; ++q) {
      ext[q] = !first ? left[j][q] : j > 0 ? left[j - 1][q] : 0.0f;
      ext[kHalf + V + q] = !last ? right[j][q] : j + 1 < M ? right[j + 1][q] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < V; ++e) ext[kHalf + e] = s[j][e];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float sum = 0.0f;
#pragma unroll
      for (int d = -kLo; d <= kHi; ++d) sum += ext[kHalf + e + d];
      out[j][e] = sum;
    }
  }
}

// den^-beta as exp2(-beta log2 den): the fast log2 for 16-bit x, where its
// 2^-22 error does not show.
template <typename X>
__device__ __forceinline__ float pow_neg(float den, float beta) {
  const float lg = std::is_same_v<X, float> ? log2f(den) : __log2f(den);
  return exp2f(-beta * lg);
}

struct LrnConsts {
  float alpha_over_size, beta, k;
};

// The forward (kBwd false: out = y) or the backward (out = dx) of one line.
//   dx_j = dy_j den_j^-beta - 2 alpha beta / size * x_j * sum over the c
//          whose window holds j of dy_c x_c den_c^(-beta - 1),
// j in c's window when c is in [j - (size - 1) / 2, j + size / 2].
template <int kSize, bool kBwd>
struct LrnLine {
  static constexpr int kMinBlocks = kBwd ? 2 : 4;  // each_line
  LrnConsts p;

  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X* dy, X* out,
                                        bool valid) const {
    constexpr int kLo = kSize / 2, kHi = (kSize - 1) / 2;
    float v[M][V], g[M][V], s[M][V], w[M][V];
    load_line<X, M, V, true>(t, x, valid, 0.0f, v);
    if constexpr (kBwd) load_line<X, M, V, true>(t, dy, valid, 0.0f, g);
#pragma unroll
    for (int j = 0; j < M; ++j) {
#pragma unroll
      for (int e = 0; e < V; ++e) s[j][e] = v[j][e] * v[j][e];
    }
    window_sums<kLo, kHi, M, V>(t, s, w);
    // s: den^-beta; w: the backward's dy_c x_c den_c^(-beta - 1).
#pragma unroll
    for (int j = 0; j < M; ++j) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float den = p.k + p.alpha_over_size * w[j][e];
        s[j][e] = pow_neg<X>(den, p.beta);
        if constexpr (kBwd) w[j][e] = g[j][e] * v[j][e] * s[j][e] / den;
      }
    }
    if constexpr (kBwd) {
      float around[M][V];
      window_sums<kHi, kLo, M, V>(t, w, around);
      const float coef = 2.0f * p.alpha_over_size * p.beta;
#pragma unroll
      for (int j = 0; j < M; ++j) {
#pragma unroll
        for (int e = 0; e < V; ++e) v[j][e] = g[j][e] * s[j][e] - coef * v[j][e] * around[j][e];
      }
    } else {
#pragma unroll
      for (int j = 0; j < M; ++j) {
#pragma unroll
        for (int e = 0; e < V; ++e) v[j][e] *= s[j][e];
      }
    }
    store_line<X, M, V>(t, out, valid, v);
  }
};

template <bool kBwd>
ffi::Error run(cudaStream_t stream, int32_t device, const AnyBuffer& x, const AnyBuffer* dy,
               AnyBuffer& out, int64_t size, double alpha, double beta, double k) {
  const char* what = kBwd ? "local_response_norm_bwd" : "local_response_norm_fwd";
  JAXNORM_RETURN_IF_ERROR(check_lrn({size, alpha, beta, k}));
  const LrnConsts p{float(alpha / double(size)), float(beta), float(k)};
  ChannelShape s;
  // A window reaches 3 channels each way at most: one vector of 4 or more.
  return with_line_buffers<4, 1>(x, dy, out, &s, [&](auto vt, auto in0, auto in1, auto o) {
    using X = std::remove_const_t<std::remove_pointer_t<decltype(in0)>>;
    constexpr int V = decltype(vt)::value;
    auto go = [&](auto op) { return launch_lines<X, V>(stream, device, s, in0, in1, o, op, what); };
    switch (size) {
      case 3: return go(LrnLine<3, kBwd>{p});
      case 5: return go(LrnLine<5, kBwd>{p});
      case 7: return go(LrnLine<7, kBwd>{p});
      default:
        return ffi::Error::InvalidArgument(
            std::string("jaxnorm: ") + what + " on CUDA takes windows of 3, 5 or 7 channels, "
            "got " + std::to_string(size));
    }
  });
}

ffi::Error lrn_fwd_impl(cudaStream_t stream, int32_t device, AnyBuffer x,
                        ffi::Result<AnyBuffer> y, int64_t size, double alpha, double beta,
                        double k) {
  return run<false>(stream, device, x, nullptr, *y, size, alpha, beta, k);
}

ffi::Error lrn_bwd_impl(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer dy,
                        ffi::Result<AnyBuffer> dx, int64_t size, double alpha, double beta,
                        double k) {
  return run<true>(stream, device, x, &dy, *dx, size, alpha, beta, k);
}

}  // namespace
}  // namespace jaxnorm::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_local_response_norm_fwd, jaxnorm::cuda::lrn_fwd_impl,
    jaxnorm::bind_lrn_fwd(xla::ffi::Ffi::Bind()
                              .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                              .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_local_response_norm_bwd, jaxnorm::cuda::lrn_bwd_impl,
    jaxnorm::bind_lrn_bwd(xla::ffi::Ffi::Bind()
                              .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                              .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
