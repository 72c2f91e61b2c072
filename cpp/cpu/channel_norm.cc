// CPU handlers for GroupNorm, InstanceNorm and BatchNorm (channel_args.h):
// statistics per (n, group) of x viewed as (N, A, C, B), in two exact passes
// accumulated in double (the variance sums squares about the mean, so it does
// not cancel when |mean| >> std). Elementwise arithmetic in float (double for
// float64 x), as the row norms'. Every loop runs over one row x[n, a] of C
// channels of B elements with per-channel terms in arrays, so that the
// compiler vectorizes it; groups are summed from the channels' totals.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/channel_args.h"
#include "cpu/float_types.h"

namespace jaxnorm::cpu {
namespace {

// acc[c] += sum over the B elements of channel c of row `row` of f(i, c),
// i the element's flat index, for every row of sample n.
template <typename F>
void add_per_channel(const ChannelNormShape& s, int64_t n, std::vector<double>& acc, F&& f) {
  for (int64_t a = 0; a < s.a; ++a) {
    const int64_t row = (n * s.a + a) * s.c * s.b;
    if (s.b == 1) {
      for (int64_t c = 0; c < s.c; ++c) acc[c] += f(row + c, c);
    } else {
      for (int64_t c = 0; c < s.c; ++c) {
        double total = 0;
        for (int64_t b = 0; b < s.b; ++b) total += f(row + c * s.b + b, c);
        acc[c] += total;
      }
    }
  }
}

// f(i, c) for every element of sample n.
template <typename F>
void each_element(const ChannelNormShape& s, int64_t n, F&& f) {
  for (int64_t a = 0; a < s.a; ++a) {
    const int64_t row = (n * s.a + a) * s.c * s.b;
    for (int64_t c = 0; c < s.c; ++c) {
      for (int64_t b = 0; b < s.b; ++b) f(row + c * s.b + b, c);
    }
  }
}

// Each group's total of per-channel totals.
std::vector<double> group_totals(const ChannelNormShape& s, const std::vector<double>& per_c) {
  std::vector<double> out(s.groups, 0.0);
  for (int64_t c = 0; c < s.c; ++c) out[c / s.group_size] += per_c[c];
  return out;
}

// What the kernels need of the parameters and of one sample's statistics,
// per channel.
template <typename A>
struct Affine {
  std::vector<A> w, b;        // scale (1 without) and bias (0 without)
  std::vector<A> mean, rstd;  // of the channel's group in the current sample

  template <typename W>
  Affine(const ChannelNormShape& s, const W* scale, const W* bias)
      : w(s.c, A(1)), b(s.c, A(0)), mean(s.c), rstd(s.c) {
    for (int64_t c = 0; c < s.c; ++c) {
      if (s.has_scale) w[c] = load<A>(scale, c);
      if (s.has_bias) b[c] = load<A>(bias, c);
    }
  }
  // Sample n's statistics, from the (N, G) mean and variance.
  void set_stats(const ChannelNormShape& s, int64_t n, const A* m, const A* var, double eps) {
    for (int64_t c = 0; c < s.c; ++c) {
      const int64_t g = n * s.groups + c / s.group_size;
      mean[c] = m[g];
      rstd[c] = A(1) / std::sqrt(var[g] + A(eps));
    }
  }
};

// Each group's mean and biased variance over sample n, into the (N, G) outputs.
template <typename X, typename A>
void group_stats(const ChannelNormShape& s, int64_t n, const X* x, A* mean, A* var) {
  const double count = double(s.count());
  std::vector<double> acc(s.c, 0.0);
  add_per_channel(s, n, acc, [&](int64_t i, int64_t) { return load<double>(x, i); });
  std::vector<double> group_mean = group_totals(s, acc);
  for (auto& v : group_mean) v = count > 0 ? v / count : 0.0;
  std::vector<double> channel_mean(s.c);
  for (int64_t c = 0; c < s.c; ++c) channel_mean[c] = group_mean[c / s.group_size];
  std::fill(acc.begin(), acc.end(), 0.0);
  add_per_channel(s, n, acc, [&](int64_t i, int64_t c) {
    const double d = load<double>(x, i) - channel_mean[c];
    return d * d;
  });
  const std::vector<double> m2 = group_totals(s, acc);
  for (int64_t g = 0; g < s.groups; ++g) {
    mean[n * s.groups + g] = A(group_mean[g]);
    var[n * s.groups + g] = A(count > 0 ? m2[g] / count : 0.0);
  }
}

template <typename X, typename Y, typename W>
void fwd(const ChannelNormShape& s, double eps, Activation act, bool given, bool write_y,
         const X* x, const W* scale, const W* bias, const void* mean_in, const void* var_in,
         Y* y, void* mean_out, void* var_out) {
  using A = acc_t<X>;
  Affine<A> p(s, scale, bias);
  const A* mean = static_cast<const A*>(given ? mean_in : mean_out);
  const A* var = static_cast<const A*>(given ? var_in : var_out);
  for (int64_t n = 0; n < s.n; ++n) {
    if (!given) group_stats(s, n, x, static_cast<A*>(mean_out), static_cast<A*>(var_out));
    if (!write_y) continue;
    p.set_stats(s, n, mean, var, eps);
    each_element(s, n, [&](int64_t i, int64_t c) {
      const A z = (load<A>(x, i) - p.mean[c]) * p.rstd[c] * p.w[c] + p.b[c];
      store(y, i, activate(act, z));
    });
  }
}

// One sample's dx terms a channel (channel_args.h): a = rstd scale, k_x,
// k_0 with dx = a dy' + k_x (x - mean) + k_0, from
// rstd (g - mean(g) - xhat mean(g xhat)).
template <typename A>
void write_dx_terms(const ChannelNormShape& s, const Affine<A>& p,
                    const std::vector<double>& mean_g, const std::vector<double>& mean_gx,
                    A* out) {
  for (int64_t c = 0; c < s.c; ++c) {
    const int64_t g = c / s.group_size;
    const double rstd = p.rstd[c];
    A* t = out + c * kDxTerms;
    t[0] = A(rstd * p.w[c]), t[1] = A(-rstd * rstd * mean_gx[g]), t[2] = A(-rstd * mean_g[g]);
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy' * scale, the
// means over each group of a sample; dscale = sum dy' * xhat, dbias = sum dy'
// over all but the channels. dy' is dy through the activation's derivative.
template <typename X, typename G, typename W>
void bwd(const ChannelNormShape& s, double eps, Activation act, ChannelBwdMode mode,
         bool param_grads, const X* x, const W* scale, const W* bias, const void* mean_in,
         const void* var_in, const G* dy, const void* means_in, X* dx, W* dscale, W* dbias,
         void* sums_out) {
  using A = acc_t<X>;
  Affine<A> p(s, scale, bias);
  std::vector<double> dw(s.c, 0.0), db(s.c, 0.0), sum_d(s.c), sum_dx(s.c);
  // xhat and dy' of element i (channel c).
  auto xhat = [&](int64_t i, int64_t c) { return (load<A>(x, i) - p.mean[c]) * p.rstd[c]; };
  auto grad = [&](int64_t i, int64_t c, A xh) {
    const A d = load<A>(dy, i);
    return activation_backward(act, d, xh * p.w[c] + p.b[c]);
  };
  const double count = double(s.count());
  const bool sums_pass = mode != ChannelBwdMode::kDx || param_grads;
  std::vector<double> mean_g(s.groups), mean_gx(s.groups);
  for (int64_t n = 0; n < s.n; ++n) {
    p.set_stats(s, n, static_cast<const A*>(mean_in), static_cast<const A*>(var_in), eps);
    if (sums_pass) {
      std::fill(sum_d.begin(), sum_d.end(), 0.0);
      std::fill(sum_dx.begin(), sum_dx.end(), 0.0);
      add_per_channel(s, n, sum_d, [&](int64_t i, int64_t c) {
        const A xh = xhat(i, c), d = grad(i, c, xh);
        sum_dx[c] += double(d) * xh;  // the same channel as the return's
        return double(d);
      });
      for (int64_t c = 0; c < s.c; ++c) dw[c] += sum_dx[c], db[c] += sum_d[c];
    }
    if (mode == ChannelBwdMode::kDx) {
      const A* m = static_cast<const A*>(means_in) + 2 * n * s.groups;
      for (int64_t g = 0; g < s.groups; ++g) mean_g[g] = m[2 * g], mean_gx[g] = m[2 * g + 1];
    } else {
      // sums of g = dy' * scale and g * xhat: scale times the channel sums
      std::vector<double> wd(s.c), wdx(s.c);
      for (int64_t c = 0; c < s.c; ++c) wd[c] = p.w[c] * sum_d[c], wdx[c] = p.w[c] * sum_dx[c];
      mean_g = group_totals(s, wd);
      mean_gx = group_totals(s, wdx);
      if (mode == ChannelBwdMode::kSums) {
        A* out = static_cast<A*>(sums_out) + 2 * n * s.groups;
        for (int64_t g = 0; g < s.groups; ++g) {
          out[2 * g] = A(mean_g[g]);
          out[2 * g + 1] = A(mean_gx[g]);
        }
        continue;
      }
      for (int64_t g = 0; g < s.groups; ++g) {
        mean_g[g] = count > 0 ? mean_g[g] / count : 0.0;
        mean_gx[g] = count > 0 ? mean_gx[g] / count : 0.0;
      }
    }
    if (mode == ChannelBwdMode::kTerms) {
      write_dx_terms(s, p, mean_g, mean_gx, static_cast<A*>(sums_out) + n * s.c * kDxTerms);
      continue;
    }
    each_element(s, n, [&](int64_t i, int64_t c) {
      const A xh = xhat(i, c), d = grad(i, c, xh);
      const int64_t g = c / s.group_size;
      store(dx, i, p.rstd[c] * (d * p.w[c] - A(mean_g[g]) - xh * A(mean_gx[g])));
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
                                 int64_t group_size, double epsilon, int32_t activation) {
  ChannelNormShape s;
  bool given = false, write_y = true;
  JAXNORM_RETURN_IF_ERROR(check_channel_norm_fwd(x, scale, bias, mean, var, *y, *mean_out,
                                                 *var_out, group_size, epsilon, activation, &s,
                                                 &given, &write_y));
  const DataType ydt = write_y ? y->element_type() : x.element_type();
  return dispatch_row_types(
      x.element_type(), ydt, channel_param_dtype(x, scale, bias, s),
      [&](auto xt, auto yt, auto wt) {
        using X = native_t<decltype(xt)>;
        using Y = native_t<decltype(yt)>;
        using W = native_t<decltype(wt)>;
        fwd<X, Y, W>(s, epsilon, Activation(activation), given, write_y,
                     static_cast<const X*>(x.untyped_data()),
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
                                 int64_t group_size, double epsilon, int32_t activation) {
  ChannelNormShape s;
  ChannelBwdMode mode;
  bool param_grads = false, own_stats = false;
  JAXNORM_RETURN_IF_ERROR(check_channel_norm_bwd(x, scale, bias, mean, var, dy, means, *dx,
                                                 *dscale, *dbias, *sums_out, group_size,
                                                 epsilon, activation, &s, &mode, &param_grads,
                                                 &own_stats));
  return dispatch_row_types(
      x.element_type(), dy.element_type(), channel_param_dtype(x, scale, bias, s),
      [&](auto xt, auto gt, auto wt) {
        using X = native_t<decltype(xt)>;
        using G = native_t<decltype(gt)>;
        using W = native_t<decltype(wt)>;
        using A = acc_t<X>;
        const X* xp = static_cast<const X*>(x.untyped_data());
        // Without statistics given, the forward's (group_stats), per sample.
        std::vector<A> own(own_stats ? 2 * s.n * s.groups : 0);
        for (int64_t n = 0; n < s.n && own_stats; ++n) {
          group_stats(s, n, xp, own.data(), own.data() + s.n * s.groups);
        }
        bwd<X, G, W>(s, epsilon, Activation(activation), mode, param_grads, xp,
                     static_cast<const W*>(scale.untyped_data()),
                     static_cast<const W*>(bias.untyped_data()),
                     own_stats ? own.data() : mean.untyped_data(),
                     own_stats ? own.data() + s.n * s.groups : var.untyped_data(),
                     static_cast<const G*>(dy.untyped_data()),
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
