// Argument checks for the channel ops, shared by the CPU and CUDA handlers so
// both reject the same inconsistent buffers with the same messages.
//
// GroupNorm, InstanceNorm and BatchNorm share one pair of targets. x is
// viewed as (N, A, C, B): N the independent leading dims (samples for
// GroupNorm; none, N = 1, for BatchNorm), C the channels, A and B the dims
// before and after C. Statistics are per (n, g), g = c / group_size, over
// (A, the group's channels, B):
//
//   channel_norm_fwd(x[N,A,C,B], scale[C|0], bias[C|0], mean[N,G|0], var[N,G|0])
//       -> y[N,A,C,B|0], mean_out[N,G|0], var_out[N,G|0]
//   channel_norm_bwd(x, scale[C|0], bias[C|0], mean[N,G], var[N,G],
//                    dy[N,A,C,B], means[N,G,2|0])
//       -> dx[N,A,C,B|0], dscale[C|0], dbias[C|0], sums_out[N,G,2|N,C,3|0]
//
// The forward either computes the statistics (mean and biased variance,
// written to mean_out and var_out; y [0] for the statistics alone) or, given
// them, normalizes with them and writes none. It returns act(xhat * scale +
// bias), `activation` an Activation (common/activation.h: none, SiLU, ReLU).
// The backward's per-group terms are the means over the group of g and of
// g * xhat, g = dy' * scale (dy' = dy through act's derivative). It computes
// them and dx, dscale, dbias (means [0], sums_out [0]); or only their sums
// (sums_out [N,G,2]) and dscale, dbias, with dx [0]; or dx's per-channel
// terms about the mean (sums_out [N,C,3]: a = rstd * scale, k_x, k_0, with
// act's input (x - mean) a + bias and dx = a dy' + k_x (x - mean) + k_0) and
// dscale, dbias, with dx [0], for XLA to write dx; or, given the means
// (summed across devices; zero for statistics taken as constants), dx, with
// dscale and dbias or neither, and sums_out [0]. Without an activation, the
// first of these (dx, dscale, dbias) may take mean [0] and var [0]: it then
// computes the statistics itself in the pass over x that its sums make (so
// the forward of jax.grad, whose y is dead, has nothing left to do).
//
// Local response normalization and the channel softmax work along C at each
// position of x viewed as (M, C, B):
//
//   local_response_norm_fwd(x[M,C,B]) -> y[M,C,B]
//   local_response_norm_bwd(x[M,C,B], dy[M,C,B]) -> dx[M,C,B]
//   channel_softmax_fwd(x[M,C,B]) -> y[M,C,B]
//   channel_softmax_bwd(x[M,C,B], dy[M,C,B]) -> dx[M,C,B]  (y recomputed)
#pragma once

#include "common/activation.h"
#include "common/row_norm_args.h"

namespace jaxnorm {

// x of a channel norm as (N, A, C, B), and the groups.
struct ChannelNormShape {
  int64_t n = 0, a = 0, c = 0, b = 0;
  int64_t group_size = 1, groups = 0;
  bool has_scale = false, has_bias = false;
  int64_t count() const { return a * group_size * b; }  // elements a statistic covers
  int64_t size() const { return n * a * c * b; }
};

// An optional buffer: absent as (0,), else exactly `want`, of dtype `dt`.
inline ffi::Error expect_optional_dims(const AnyBuffer& buf, const char* what,
                                       std::initializer_list<int64_t> want, DataType dt,
                                       bool* present) {
  auto dims = buf.dimensions();
  *present = !(dims.size() == 1 && dims[0] == 0);
  if (!*present) return ffi::Error::Success();
  JAXNORM_RETURN_IF_ERROR(expect_dims(buf, what, want));
  return expect_dtype(buf, what, dt);
}

inline ffi::Error check_channel_x(const AnyBuffer& x, int64_t group_size, ChannelNormShape* s) {
  auto dims = x.dimensions();
  if (dims.size() != 4) {
    return ffi::Error::InvalidArgument("jaxnorm: x must have rank 4 (N, A, C, B), got shape " +
                                       shape_str(dims));
  }
  s->n = dims[0], s->a = dims[1], s->c = dims[2], s->b = dims[3];
  if (group_size < 1 || s->c % group_size != 0) {
    return ffi::Error::InvalidArgument("jaxnorm: group_size " + std::to_string(group_size) +
                                       " does not divide the " + std::to_string(s->c) +
                                       " channels");
  }
  s->group_size = group_size;
  s->groups = s->c / group_size;
  return ffi::Error::Success();
}

// scale and bias: (C,) or absent; of one dtype when both are given.
inline ffi::Error check_channel_params(const AnyBuffer& scale, const AnyBuffer& bias,
                                       ChannelNormShape* s) {
  JAXNORM_RETURN_IF_ERROR(expect_optional(scale, "scale", s->c, &s->has_scale));
  JAXNORM_RETURN_IF_ERROR(expect_optional(bias, "bias", s->c, &s->has_bias));
  if (s->has_scale && s->has_bias) {
    JAXNORM_RETURN_IF_ERROR(expect_dtype(bias, "bias", scale.element_type()));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_activation(int32_t activation) {
  if (valid_activation(activation)) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      "jaxnorm: activation must be 0 (none), 1 (SiLU) or 2 (ReLU), got " +
      std::to_string(activation));
}

inline ffi::Error check_channel_norm_fwd(const AnyBuffer& x, const AnyBuffer& scale,
                                         const AnyBuffer& bias, const AnyBuffer& mean,
                                         const AnyBuffer& var, const AnyBuffer& y,
                                         const AnyBuffer& mean_out, const AnyBuffer& var_out,
                                         int64_t group_size, double epsilon,
                                         int32_t activation, ChannelNormShape* s, bool* given,
                                         bool* write_y) {
  JAXNORM_RETURN_IF_ERROR(check_activation(activation));
  JAXNORM_RETURN_IF_ERROR(check_channel_x(x, group_size, s));
  JAXNORM_RETURN_IF_ERROR(check_channel_params(scale, bias, s));
  const DataType st = stats_dtype(x.element_type());
  bool has_var = false, has_mean_out = false, has_var_out = false;
  JAXNORM_RETURN_IF_ERROR(expect_optional_dims(mean, "mean", {s->n, s->groups}, st, given));
  JAXNORM_RETURN_IF_ERROR(expect_optional_dims(var, "var", {s->n, s->groups}, st, &has_var));
  JAXNORM_RETURN_IF_ERROR(
      expect_optional_dims(mean_out, "mean_out", {s->n, s->groups}, st, &has_mean_out));
  JAXNORM_RETURN_IF_ERROR(
      expect_optional_dims(var_out, "var_out", {s->n, s->groups}, st, &has_var_out));
  const bool empty_stats = s->n * s->groups == 0;  // (0, G) and (0,) look alike
  if (!empty_stats && (has_var != *given || has_mean_out != !*given ||
                       has_var_out != !*given)) {
    return ffi::Error::InvalidArgument(
        "jaxnorm: channel_norm_fwd takes mean and var, or returns mean_out and var_out");
  }
  auto ydims = y.dimensions();
  *write_y = !(ydims.size() == 1 && ydims[0] == 0) || s->size() == 0;
  if (*write_y) JAXNORM_RETURN_IF_ERROR(expect_dims(y, "y", {s->n, s->a, s->c, s->b}));
  if (!*write_y && *given && !empty_stats) {
    return ffi::Error::InvalidArgument("jaxnorm: channel_norm_fwd given statistics writes y");
  }
  return check_epsilon(epsilon);
}

// The backward's mode: what it is given and what it returns.
enum class ChannelBwdMode { kFull, kSums, kTerms, kDx };
constexpr int64_t kDxTerms = 3;  // dx's terms a channel (kTerms)

inline ffi::Error check_channel_norm_bwd(const AnyBuffer& x, const AnyBuffer& scale,
                                         const AnyBuffer& bias, const AnyBuffer& mean,
                                         const AnyBuffer& var, const AnyBuffer& dy,
                                         const AnyBuffer& means, const AnyBuffer& dx,
                                         const AnyBuffer& dscale, const AnyBuffer& dbias,
                                         const AnyBuffer& sums_out, int64_t group_size,
                                         double epsilon, int32_t activation,
                                         ChannelNormShape* s, ChannelBwdMode* mode,
                                         bool* param_grads, bool* own_stats) {
  JAXNORM_RETURN_IF_ERROR(check_activation(activation));
  JAXNORM_RETURN_IF_ERROR(check_channel_x(x, group_size, s));
  JAXNORM_RETURN_IF_ERROR(check_channel_params(scale, bias, s));
  const DataType st = stats_dtype(x.element_type());
  bool has_mean = false, has_var = false;
  JAXNORM_RETURN_IF_ERROR(expect_optional_dims(mean, "mean", {s->n, s->groups}, st, &has_mean));
  JAXNORM_RETURN_IF_ERROR(expect_optional_dims(var, "var", {s->n, s->groups}, st, &has_var));
  const bool no_stats = s->n * s->groups == 0;  // (0, G) and (0,) look alike
  if (!no_stats && has_mean != has_var) {
    return ffi::Error::InvalidArgument("jaxnorm: channel_norm_bwd takes mean and var, or neither");
  }
  *own_stats = !no_stats && !has_mean;
  JAXNORM_RETURN_IF_ERROR(expect_dims(dy, "dy", {s->n, s->a, s->c, s->b}));
  // dy: x's dtype, or float32 for 16-bit x (the cotangent of a float32 y); the dispatch checks.
  bool has_means = false, has_dx = false, has_sums = false, has_terms = false,
       has_dscale = false, has_dbias = false;
  JAXNORM_RETURN_IF_ERROR(
      expect_optional_dims(means, "means", {s->n, s->groups, 2}, st, &has_means));
  auto sums_dims = sums_out.dimensions();
  if (sums_dims.size() == 3 && sums_dims[2] == kDxTerms) {
    JAXNORM_RETURN_IF_ERROR(
        expect_optional_dims(sums_out, "sums_out", {s->n, s->c, kDxTerms}, st, &has_terms));
  } else {
    JAXNORM_RETURN_IF_ERROR(
        expect_optional_dims(sums_out, "sums_out", {s->n, s->groups, 2}, st, &has_sums));
  }
  JAXNORM_RETURN_IF_ERROR(expect_optional_dims(dx, "dx", {s->n, s->a, s->c, s->b},
                                               x.element_type(), &has_dx));
  const DataType wt = s->has_scale ? scale.element_type() : bias.element_type();
  JAXNORM_RETURN_IF_ERROR(expect_optional_dims(dscale, "dscale", {s->c}, wt, &has_dscale));
  JAXNORM_RETURN_IF_ERROR(expect_optional_dims(dbias, "dbias", {s->c}, wt, &has_dbias));
  const bool params_out = has_dscale == s->has_scale && has_dbias == s->has_bias;
  const bool no_params_out = !has_dscale && !has_dbias;
  const bool no_sums = !has_sums && !has_terms;
  if (s->size() == 0) {
    *mode = has_means ? ChannelBwdMode::kDx : has_sums ? ChannelBwdMode::kSums
          : has_terms ? ChannelBwdMode::kTerms : ChannelBwdMode::kFull;
  } else if (!has_means && has_dx && no_sums && params_out) {
    *mode = ChannelBwdMode::kFull;
  } else if (!has_means && !has_dx && has_sums && params_out) {
    *mode = ChannelBwdMode::kSums;
  } else if (!has_means && !has_dx && has_terms && params_out) {
    *mode = ChannelBwdMode::kTerms;
  } else if (has_means && has_dx && no_sums && (params_out || no_params_out)) {
    *mode = ChannelBwdMode::kDx;
  } else {
    return ffi::Error::InvalidArgument(
        "jaxnorm: channel_norm_bwd returns dx, dscale and dbias; or sums_out (sums or dx's "
        "terms), dscale and dbias; or, given means, dx (and dscale and dbias, or neither)");
  }
  *param_grads = has_dscale || has_dbias;
  if (*own_stats && (*mode != ChannelBwdMode::kFull || activation != 0)) {
    return ffi::Error::InvalidArgument(
        "jaxnorm: channel_norm_bwd computes its statistics (mean and var empty) only without an "
        "activation, returning dx, dscale and dbias");
  }
  return check_epsilon(epsilon);
}

// x of local response normalization or the channel softmax as (M, C, B).
struct ChannelShape {
  int64_t m = 0, c = 0, b = 0;
  int64_t size() const { return m * c * b; }
};

// x and every other (M, C, B) operand of x's dtype and shape.
inline ffi::Error check_channel_op(const AnyBuffer& x,
                                   std::initializer_list<std::pair<const AnyBuffer*, const char*>>
                                       like_x,
                                   ChannelShape* s) {
  auto dims = x.dimensions();
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument("jaxnorm: x must have rank 3 (M, C, B), got shape " +
                                       shape_str(dims));
  }
  s->m = dims[0], s->c = dims[1], s->b = dims[2];
  for (auto [buf, what] : like_x) {
    JAXNORM_RETURN_IF_ERROR(expect_dims(*buf, what, {s->m, s->c, s->b}));
    JAXNORM_RETURN_IF_ERROR(expect_dtype(*buf, what, x.element_type()));
  }
  return ffi::Error::Success();
}

// The FFI signatures, appended to a platform's binding (which may first add
// context such as the CUDA stream).
template <typename B>
auto bind_channel_norm_fwd(B binding) {
  return std::move(binding).template Arg<AnyBuffer>()  // x
      .template Arg<AnyBuffer>()                        // scale
      .template Arg<AnyBuffer>()                        // bias
      .template Arg<AnyBuffer>()                        // mean
      .template Arg<AnyBuffer>()                        // var
      .template Ret<AnyBuffer>()                        // y
      .template Ret<AnyBuffer>()                        // mean_out
      .template Ret<AnyBuffer>()                        // var_out
      .template Attr<int64_t>("group_size")
      .template Attr<double>("epsilon")
      .template Attr<int32_t>("activation");
}

template <typename B>
auto bind_channel_norm_bwd(B binding) {
  return std::move(binding).template Arg<AnyBuffer>()  // x
      .template Arg<AnyBuffer>()                        // scale
      .template Arg<AnyBuffer>()                        // bias
      .template Arg<AnyBuffer>()                        // mean
      .template Arg<AnyBuffer>()                        // var
      .template Arg<AnyBuffer>()                        // dy
      .template Arg<AnyBuffer>()                        // means
      .template Ret<AnyBuffer>()                        // dx
      .template Ret<AnyBuffer>()                        // dscale
      .template Ret<AnyBuffer>()                        // dbias
      .template Ret<AnyBuffer>()                        // sums_out
      .template Attr<int64_t>("group_size")
      .template Attr<double>("epsilon")
      .template Attr<int32_t>("activation");
}

// Local response normalization's window: `size` channels, size / 2 before
// the channel and (size - 1) / 2 after it, as PyTorch's.
struct LrnParams {
  int64_t size;
  double alpha, beta, k;
};

inline ffi::Error check_lrn(const LrnParams& p) {
  if (p.size < 1) {
    return ffi::Error::InvalidArgument("jaxnorm: size must be >= 1, got " +
                                       std::to_string(p.size));
  }
  return ffi::Error::Success();
}

template <typename B>
auto with_lrn_attrs(B binding) {
  return std::move(binding)
      .template Attr<int64_t>("size")
      .template Attr<double>("alpha")
      .template Attr<double>("beta")
      .template Attr<double>("k");
}

template <typename B>
auto bind_lrn_fwd(B binding) {
  return with_lrn_attrs(std::move(binding).template Arg<AnyBuffer>().template Ret<AnyBuffer>());
}

// (x, dy) -> dx for the softmax.
template <typename B>
auto bind_channel_softmax_bwd(B binding) {
  return std::move(binding).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>();
}

template <typename B>
auto bind_lrn_bwd(B binding) {
  return with_lrn_attrs(std::move(binding).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
                            .template Ret<AnyBuffer>());
}

template <typename B>
auto bind_channel_softmax_fwd(B binding) {
  return std::move(binding).template Arg<AnyBuffer>().template Ret<AnyBuffer>();
}

}  // namespace jaxnorm
