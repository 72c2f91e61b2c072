// CUDA handlers for local response normalization across the channels of x,
// as PyTorch's: y = x * den^-beta, den = k + alpha / size *
// (sum of x^2 over the window of size channels, size / 2 before the channel
// and (size - 1) / 2 after, clipped at the line's ends). Channels-last x: a
// line in registers (channel_lines.cuh), a window reaching into the
// neighbouring lanes' vectors by shuffles. Channels-first x (NCHW): a thread
// walks each position's channels (lrn_positions). Windows of 3, 5 and 7
// channels (others and float64 lower to jax.numpy: local_response_norm.py's
// _supports).
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

// log2 den: the fast log2 for 16-bit x, where its 2^-22 error does not show.
template <typename X>
__device__ __forceinline__ float log2_den(float den) {
  return std::is_same_v<X, float> ? log2f(den) : __log2f(den);
}

// den^-beta as exp2(-beta log2 den).
template <typename X>
__device__ __forceinline__ float pow_neg(float den, float beta) {
  return exp2f(-beta * log2_den<X>(den));
}

// The backward's den^-beta and den^(-beta - 1), from one log2: a division of
// the first by den took ~10 instructions an element (IEEE, without fast
// math; benchmarks/NOTES.md v65).
template <typename X>
__device__ __forceinline__ void pow_neg_pair(float den, float beta, float& pw, float& pw1) {
  const float lg = log2_den<X>(den);
  pw = exp2f(-beta * lg), pw1 = exp2f((-beta - 1.0f) * lg);
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
  static constexpr int max_vecs(int) { return kMaxLineVecs; }  // launch_lines
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
        if constexpr (kBwd) {
          float pw1;
          pow_neg_pair<X>(den, p.beta, s[j][e], pw1);
          w[j][e] = g[j][e] * v[j][e] * pw1;
        } else {
          s[j][e] = pow_neg<X>(den, p.beta);
        }
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

// Channels-first x (B > 1, NCHW): a thread takes a position of one of the M
// lines and walks its C channels in order, the last kSize channels' values in
// registers, so that a warp's load of a channel is 32 consecutive positions
// and x is read once. Each window is summed whole (a running sum's
// subtractions would leave a large channel's rounding in its neighbours'
// windows). Step i loads channel i and finishes channel ch = i - kHi, whose
// window ends at i; the backward's dx of channel ch - kLo, whose transposed
// window of t ends at ch, follows kLo steps behind. kChunk channels' loads
// are in flight together: on an H100 (kernels/lrn_lines.cu, notes v63) 8
// channels ran bf16 128x96x55x55 in 85.1 µs forward and 204.0 backward, 16 in
// 87.7 and 304.0, 24 in 95.1 and 295.5.
// kMinBlocks: the launch bound's blocks an SM (0: ptxas's own registers,
// what the handlers take; kernels/lrn_lines.cu compares more, notes v65).
template <typename X, int kSize, bool kBwd, int kChunk = 8, int kMinBlocks = 0>
__global__ void __launch_bounds__(kLineThreads, kMinBlocks)
    lrn_positions(ChannelShape s, const X* x, const X* dy, X* out, LrnConsts p) {
  constexpr int kLo = kSize / 2, kHi = (kSize - 1) / 2;
  const float coef = 2.0f * p.alpha_over_size * p.beta;
  // Within a line, 32-bit offsets (C * B < 2^31: with_position_operands): with
  // 64-bit ones the forward spent ~70 instructions an element, 28 of them
  // integer (SASS), against ~15 of arithmetic.
  const int c = int(s.c), stride = int(s.b);
  const int steps = c + kHi + (kBwd ? kLo : 0);
  for (int64_t pos = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; pos < s.m * s.b;
       pos += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = pos / s.b * s.c * s.b + pos % s.b;  // its channel 0
    const X* xl = x + at;
    const X* gl = kBwd ? dy + at : nullptr;
    X* ol = out + at;
    // x, x^2 and dy of channels i - kSize + 1 .. i; t of channels
    // ch - kSize + 1 .. ch; den^-beta of channels ch - kLo .. ch.
    float xs[kSize] = {}, sq[kSize] = {}, gs[kSize] = {}, ts[kSize] = {}, us[kLo + 1] = {};
    for (int i0 = 0; i0 < steps; i0 += kChunk) {
      float xn[kChunk], gn[kChunk];
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        const bool in = i0 + u < c;
        xn[u] = in ? to_acc(xl[(i0 + u) * stride]) : 0.0f;
        if constexpr (kBwd) gn[u] = in ? to_acc(gl[(i0 + u) * stride]) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        const int ch = i0 + u - kHi;
#pragma unroll
        for (int d = 0; d + 1 < kSize; ++d) {
          xs[d] = xs[d + 1], sq[d] = sq[d + 1], gs[d] = gs[d + 1];
        }
        xs[kSize - 1] = xn[u], sq[kSize - 1] = xn[u] * xn[u];
        if constexpr (kBwd) gs[kSize - 1] = gn[u];
        float sum = 0.0f;
#pragma unroll
        for (int d = 0; d < kSize; ++d) sum += sq[d];
        const float den = p.k + p.alpha_over_size * sum;
        const bool here = unsigned(ch) < unsigned(c);
        if constexpr (!kBwd) {
          if (here) ol[ch * stride] = from_acc<X>(xs[kLo] * pow_neg<X>(den, p.beta));
        } else {
          float pw, pw1;
          pow_neg_pair<X>(den, p.beta, pw, pw1);
#pragma unroll
          for (int d = 0; d + 1 < kSize; ++d) ts[d] = ts[d + 1];
#pragma unroll
          for (int d = 0; d < kLo; ++d) us[d] = us[d + 1];
          ts[kSize - 1] = here ? gs[kLo] * xs[kLo] * pw1 : 0.0f;
          us[kLo] = pw;
          const int j = ch - kLo;  // x_j, dy_j: xs[0], gs[0]
          if (unsigned(j) < unsigned(c)) {
            float around = 0.0f;
#pragma unroll
            for (int d = 0; d < kSize; ++d) around += ts[d];
            ol[j * stride] = from_acc<X>(gs[0] * us[0] - coef * xs[0] * around);
          }
        }
      }
    }
  }
}

// Calls f(LrnWindow<kSize>{}) for the window sizes the kernels take.
template <int kSize>
using LrnWindow = std::integral_constant<int, kSize>;
template <typename F>
ffi::Error with_window(int64_t size, const char* what, F&& f) {
  switch (size) {
    case 3: return f(LrnWindow<3>{});
    case 5: return f(LrnWindow<5>{});
    case 7: return f(LrnWindow<7>{});
    default:
      return ffi::Error::InvalidArgument(std::string("jaxnorm: ") + what +
                                         " on CUDA takes windows of 3, 5 or 7 channels, got " +
                                         std::to_string(size));
  }
}

template <bool kBwd>
ffi::Error run_positions(cudaStream_t stream, int32_t device, const AnyBuffer& x,
                         const AnyBuffer* dy, AnyBuffer& out, int64_t size, LrnConsts p,
                         const char* what) {
  ChannelShape s;
  const int64_t any = std::numeric_limits<int64_t>::max();  // channels
  return with_position_operands(x, dy, out, &s, what, any, [&](auto in0, auto in1, auto o) {
    using X = std::remove_const_t<std::remove_pointer_t<decltype(in0)>>;
    // A block for every kLineThreads positions, not one wave of blocks
    // (line_grid) whose threads take a second position: 2.6% faster forward
    // at 128x96x55x55 on an H100 (benchmarks/NOTES.md v65).
    const int64_t blocks = (s.m * s.b + kLineThreads - 1) / kLineThreads;
    const int grid = int(std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max()));
    return with_window(size, what, [&](auto w) {
      lrn_positions<X, decltype(w)::value, kBwd><<<grid, kLineThreads, 0, stream>>>(s, in0, in1,
                                                                                  o, p);
      return last_launch_error(what);
    });
  });
}

template <bool kBwd>
ffi::Error run(cudaStream_t stream, int32_t device, const AnyBuffer& x, const AnyBuffer* dy,
               AnyBuffer& out, int64_t size, double alpha, double beta, double k) {
  const char* what = kBwd ? "local_response_norm_bwd" : "local_response_norm_fwd";
  JAXNORM_RETURN_IF_ERROR(check_lrn({size, alpha, beta, k}));
  const LrnConsts p{float(alpha / double(size)), float(beta), float(k)};
  if (x.dimensions().size() == 3 && x.dimensions()[2] > 1) {
    return run_positions<kBwd>(stream, device, x, dy, out, size, p, what);
  }
  ChannelShape s;
  // A window reaches 3 channels each way at most: one vector of 4 or more.
  return with_line_buffers<4, 1>(x, dy, out, &s, [&](auto vt, auto in0, auto in1, auto o) {
    using X = std::remove_const_t<std::remove_pointer_t<decltype(in0)>>;
    constexpr int V = decltype(vt)::value;
    return with_window(size, what, [&](auto w) {
      return launch_lines<X, V>(stream, device, s, in0, in1, o,
                                LrnLine<decltype(w)::value, kBwd>{p}, what);
    });
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
    jaxnorm::bind_lrn_fwd(jaxnorm::cuda::cuda_bind()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_local_response_norm_bwd, jaxnorm::cuda::lrn_bwd_impl,
    jaxnorm::bind_lrn_bwd(jaxnorm::cuda::cuda_bind()),
    {xla::ffi::Traits::kCmdBufferCompatible});
