// CPU handlers for GroupNorm, InstanceNorm and BatchNorm (channel_args.h):
// statistics per (n, group) of x viewed as (N, A, C, B), in two exact passes
// accumulated in double (the variance sums squares about the mean, so it does
// not cancel when |mean| >> std). Elementwise arithmetic in float (double for
// float64 x), as the row norms'.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/channel_args.h"
#include "cpu/float_types.h"

namespace jaxnorm::cpu {
namespace {

// Calls f(i, c) for every element of sample n: i its flat index, c its channel.
template <typename F>
void each_element(const ChannelNormShape& s, int64_t n, F&& f) {
  int64_t i = n * s.a * s.c * s.b;
  for (int64_t a = 0; a < s.a; ++a) {
    for (int64_t c = 0; c < s.c; ++c) {
      for (int64_t b = 0; b < s.b; ++b) f(i++, c);
    }
  }
}

// What the kernels need of the parameters and one sample's statistics.
template <typename A>
struct Affine {
  std::vector<A> w, b;  // per channel: scale (1 without) and bias (0 without)
  std::vector<A> mean, rstd;  // per group of the current sample
  int64_t group_size;

  template <typename W>
  Affine(const ChannelNormShape& s, const W* scale, const W* bias)
      : w(s.c, A(1)), b(s.c, A(0)), mean(s.groups), rstd(s.groups), group_size(s.group_size) {
    for (int64_t c = 0; c < s.c; ++c) {
      if (s.has_scale) w[c] = load<A>(scale, c);
      if (s.has_bias) b[c] = load<A>(bias, c);
    }
  }
  // Sample n's statistics, from the (N, G) mean and variance.
  void set_stats(const ChannelNormShape& s, int64_t n, const A* m, const A* var, double eps) {
    for (int64_t g = 0; g < s.groups; ++g) {
      mean[g] = m[n * s.groups + g];
      rstd[g] = A(1) / std::sqrt(var[n * s.groups + g] + A(eps));
    }
  }
  template <typename X>
  A xhat(const X* x, int64_t i, int64_t c) const {
    const int64_t g = c / group_size;
    return (load<A>(x, i) - mean[g]) * rstd[g];
  }
};

template <typename A>
A sigmoid(A z) {
  return A(1) / (A(1) + std::exp(-z));
}

// Each group's mean and biased variance over sample n, into the (N, G) outputs.
template <typename X, typename A>
void group_stats(const ChannelNormShape& s, int64_t n, const X* x, A* mean, A* var) {
  std::vector<double> sum(s.groups, 0.0), sq(s.groups, 0.0);
  each_element(s, n, [&](int64_t i, int64_t c) { sum[c / s.group_size] += load<double>(x, i); });
  const double count = double(s.count());
  for (auto& v : sum) v = count > 0 ? v / count : 0.0;  // now the means
  each_element(s, n, [&](int64_t i, int64_t c) {
    const double d = load<double>(x, i) - sum[c / s.group_size];
    sq[c / s.group_size] += d * d;
  });
  for (int64_t g = 0; g < s.groups; ++g) {
    mean[n * s.groups + g] = A(sum[g]);
    var[n * s.groups + g] = A(count > 0 ? sq[g] / count : 0.0);
  }
}

template <typename X, typename Y, typename W>
void fwd(const ChannelNormShape& s, double eps, bool silu, bool given, bool write_y, const X* x,
         const W* scale, const W* bias, const void* mean_in, const void* var_in, Y* y,
         void* mean_out, void* var_out) {
  using A = acc_t<X>;
  Affine<A> p(s, scale, bias);
  const A* mean = static_cast<const A*>(given ? mean_in : mean_out);
  const A* var = static_cast<const A*>(given ? var_in : var_out);
  for (int64_t n = 0; n < s.n; ++n) {
    if (!given) group_stats(s, n, x, static_cast<A*>(mean_out), static_cast<A*>(var_out));
    if (!write_y) continue;
    p.set_stats(s, n, mean, var, eps);
    each_element(s, n, [&](int64_t i, int64_t c) {
      const A z = p.xhat(x, i, c) * p.w[c] + p.b[c];
      store(y, i, silu ? z * sigmoid(z) : z);
    });
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy' * scale, the
// means over each group of a sample; dscale = sum dy' * xhat, dbias = sum dy'
// over all but the channels. dy' is dy through SiLU's derivative with `silu`.
template <typename X, typename G, typename W>
void bwd(const ChannelNormShape& s, double eps, bool silu, ChannelBwdMode mode,
         bool param_grads, const X* x,
         const W* scale, const W* bias, const void* mean_in, const void* var_in, const G* dy,
         const void* means_in, X* dx, W* dscale, W* dbias, void* sums_out) {
  using A = acc_t<X>;
  Affine<A> p(s, scale, bias);
  std::vector<double> dw(s.c, 0.0), db(s.c, 0.0);
  std::vector<double> sums(2 * s.groups);
  // xhat and dy' of element i (channel c).
  auto terms = [&](int64_t i, int64_t c, A* xh, A* d) {
    *xh = p.xhat(x, i, c);
    *d = load<A>(dy, i);
    if (silu) {
      const A z = *xh * p.w[c] + p.b[c], sg = sigmoid(z);
      *d *= sg * (A(1) + z * (A(1) - sg));
    }
  };
  const double count = double(s.count());
  for (int64_t n = 0; n < s.n; ++n) {
    p.set_stats(s, n, static_cast<const A*>(mean_in), static_cast<const A*>(var_in), eps);
    if (mode == ChannelBwdMode::kDx) {
      const A* m = static_cast<const A*>(means_in) + 2 * n * s.groups;
      sums.assign(m, m + 2 * s.groups);
    } else {
      std::fill(sums.begin(), sums.end(), 0.0);
      each_element(s, n, [&](int64_t i, int64_t c) {
        A xh, d;
        terms(i, c, &xh, &d);
        const double g = double(d) * p.w[c];
        sums[2 * (c / s.group_size)] += g;
        sums[2 * (c / s.group_size) + 1] += g * xh;
        dw[c] += double(d) * xh;
        db[c] += d;
      });
      if (mode == ChannelBwdMode::kSums) {
        A* out = static_cast<A*>(sums_out) + 2 * n * s.groups;
        for (int64_t k = 0; k < 2 * s.groups; ++k) out[k] = A(sums[k]);
        continue;
      }
      for (auto& v : sums) v = count > 0 ? v / count : 0.0;
    }
    const bool accumulate = mode == ChannelBwdMode::kDx && param_grads;
    each_element(s, n, [&](int64_t i, int64_t c) {
      A xh, d;
      terms(i, c, &xh, &d);
      const int64_t g = c / s.group_size;
      store(dx, i, p.rstd[g] * (d * p.w[c] - A(sums[2 * g]) - xh * A(sums[2 * g + 1])));
      if (accumulate) {
        dw[c] += double(d) * xh;
        db[c] += d;
      }
    });
  }
  if (!param_grads) return;
  for (int64_t c = 0; c < s.c; ++c) {
    if (s.has_scale) store(dscale, c, dw[c]);
    if (s.has_bias) store(dbias, c, db[c]);
  }
}

// The parameters' dtype: scale's, else bias's, else x's.
DataType channel_param_dtype(const AnyBuffer& x, const AnyBuffer& scale, const AnyBuffer& bias,
                             const ChannelNormShape& s) {
  return s.has_scale ? scale.element_type() : s.has_bias ? bias.element_type()
                                                         : x.element_type();
}

ffi::Error channel_norm_fwd_impl(AnyBuffer x, AnyBuffer scale, AnyBuffer bias, AnyBuffer mean,
                                 AnyBuffer var, ffi::Result<AnyBuffer> y,
                                 ffi::Result<AnyBuffer> mean_out, ffi::Result<AnyBuffer> var_out,
                                 int64_t group_size, double epsilon, bool silu) {
  ChannelNormShape s;
  bool given = false, write_y = true;
  JAXNORM_RETURN_IF_ERROR(check_channel_norm_fwd(x, scale, bias, mean, var, *y, *mean_out,
                                                 *var_out, group_size, epsilon, &s, &given,
                                                 &write_y));
  const DataType ydt = write_y ? y->element_type() : x.element_type();
  return dispatch_row_types(
      x.element_type(), ydt, channel_param_dtype(x, scale, bias, s),
      [&](auto xt, auto yt, auto wt) {
        using X = native_t<decltype(xt)>;
        using Y = native_t<decltype(yt)>;
        using W = native_t<decltype(wt)>;
        fwd<X, Y, W>(s, epsilon, silu, given, write_y, static_cast<const X*>(x.untyped_data()),
                     static_cast<const W*>(scale.untyped_data()),
                     static_cast<const W*>(bias.untyped_data()), mean.untyped_data(),
                     var.untyped_data(), static_cast<Y*>(y->untyped_data()),
                     mean_out->untyped_data(), var_out->untyped_data());
        return ffi::Error::Success();
      });
}

ffi::Error channel_norm_bwd_impl(AnyBuffer x, AnyBuffer scale, AnyBuffer bias, AnyBuffer mean,
                                 AnyBuffer var, AnyBuffer dy, AnyBuffer means,
                                 ffi::Result<AnyBuffer> dx, ffi::Result<AnyBuffer> dscale,
                                 ffi::Result<AnyBuffer> dbias, ffi::Result<AnyBuffer> sums_out,
                                 int64_t group_size, double epsilon, bool silu) {
  ChannelNormShape s;
  ChannelBwdMode mode;
  bool param_grads = false;
  JAXNORM_RETURN_IF_ERROR(check_channel_norm_bwd(x, scale, bias, mean, var, dy, means, *dx,
                                                 *dscale, *dbias, *sums_out, group_size,
                                                 epsilon, &s, &mode, &param_grads));
  return dispatch_row_types(
      x.element_type(), dy.element_type(), channel_param_dtype(x, scale, bias, s),
      [&](auto xt, auto gt, auto wt) {
        using X = native_t<decltype(xt)>;
        using G = native_t<decltype(gt)>;
        using W = native_t<decltype(wt)>;
        bwd<X, G, W>(s, epsilon, silu, mode, param_grads,
                     static_cast<const X*>(x.untyped_data()),
                     static_cast<const W*>(scale.untyped_data()),
                     static_cast<const W*>(bias.untyped_data()), mean.untyped_data(),
                     var.untyped_data(), static_cast<const G*>(dy.untyped_data()),
                     means.untyped_data(), static_cast<X*>(dx->untyped_data()),
                     static_cast<W*>(dscale->untyped_data()),
                     static_cast<W*>(dbias->untyped_data()), sums_out->untyped_data());
        return ffi::Error::Success();
      });
}

}  // namespace
}  // namespace jaxnorm::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(cpu_channel_norm_fwd, jaxnorm::cpu::channel_norm_fwd_impl,
                              jaxnorm::bind_channel_norm_fwd(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cpu_channel_norm_bwd, jaxnorm::cpu::channel_norm_bwd_impl,
                              jaxnorm::bind_channel_norm_bwd(xla::ffi::Ffi::Bind()));
