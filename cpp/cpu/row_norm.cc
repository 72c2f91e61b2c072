// CPU handlers for the row norms: RMSNorm (centered = false) and LayerNorm
// (centered = true), with the optional fused residual add and zero-centered
// scale (row_norm_args.h). One row at a time, accumulating in float (double
// for float64 inputs), exact two-pass statistics.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/row_norm_args.h"
#include "cpu/float_types.h"

namespace jaxnorm::cpu {
namespace {

// Sums f(j) for j < n a block at a time, so rounding error grows with the
// block length and the number of blocks rather than with n.
template <typename A, typename F>
A blocked_sum(int64_t n, F f) {
  constexpr int64_t kBlock = 256;
  A total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    A part = 0;
    for (int64_t j = j0, end = std::min(n, j0 + kBlock); j < end; ++j) part += f(j);
    total += part;
  }
  return total;
}

// Exact two-pass statistics: the variance sums squares of centered values, so
// it does not cancel when |mean| >> std.
template <typename A, typename X>
void row_stats(const X* x, int64_t hidden, bool centered, double epsilon,
               A* mean, A* rstd) {
  A m = centered ? blocked_sum<A>(hidden, [&](int64_t j) { return load<A>(x, j); }) /
                       A(hidden)
                 : A(0);
  A ss = blocked_sum<A>(hidden, [&](int64_t j) {
    A d = load<A>(x, j) - m;
    return d * d;
  });
  *mean = m;
  *rstd = A(1) / std::sqrt(ss / A(hidden) + A(epsilon));
}

// h = x + residual over one row of `hidden`, rounded to X as the unfused sum
// would be. Each element of residual is read before the same element of out
// is written, so the two may alias.
template <typename X>
void add_row(const X* x, const X* residual, X* out, int64_t hidden) {
  using A = acc_t<X>;
  for (int64_t j = 0; j < hidden; ++j) store(out, j, load<A>(x, j) + load<A>(residual, j));
}

// The row the norm reads: x's, or h written to new_residual first.
template <typename X>
const X* input_row(const RowNormShape& s, int64_t r, const X* x, const X* residual,
                   X* new_residual) {
  const int64_t base = r * s.hidden;
  if (!s.has_residual) return x + base;
  add_row(x + base, residual + base, new_residual + base, s.hidden);
  return new_residual + base;
}

template <typename X, typename Y, typename W>
void fwd(const RowNormShape& s, bool centered, double epsilon, bool zero_centered,
         bool write_y, const X* x, const W* scale, const W* bias,
         const X* residual, Y* y, void* mean_out, void* rstd_out, X* new_residual) {
  using A = acc_t<X>;
  auto* mean_p = static_cast<A*>(mean_out);
  auto* rstd_p = static_cast<A*>(rstd_out);
  const A offset = zero_centered ? A(1) : A(0);
  for (int64_t r = 0; r < s.rows; ++r) {
    const X* xr = input_row(s, r, x, residual, new_residual);
    A mean, rstd;
    row_stats(xr, s.hidden, centered, epsilon, &mean, &rstd);
    if (centered) mean_p[r] = mean;
    rstd_p[r] = rstd;
    if (!write_y) continue;
    for (int64_t j = 0; j < s.hidden; ++j) {
      A v = (load<A>(xr, j) - mean) * rstd;
      if (s.has_scale) v *= load<A>(scale, j) + offset;
      if (s.has_bias) v += load<A>(bias, j);
      store(y, r * s.hidden + j, v);
    }
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ dres], g = dy * scale,
// with the mean(g) term only for LayerNorm; dscale = sum_rows dy * xhat,
// dbias = sum dy. Without saved statistics (mean_in, rstd_in null), each row's
// are computed from x as the forward does; given a residual, from h = x +
// residual, which then stands for x.
template <typename X, typename G, typename W>
void bwd(const RowNormShape& s, bool centered, double epsilon, bool zero_centered, const X* x,
         const W* scale, const void* mean_in, const void* rstd_in, const G* dy,
         const X* dres, const X* residual, X* dx, W* dscale, W* dbias) {
  using A = acc_t<X>;
  const A offset = zero_centered ? A(1) : A(0);
  auto* mean_p = static_cast<const A*>(mean_in);
  auto* rstd_p = static_cast<const A*>(rstd_in);
  std::vector<A> dscale_acc(s.has_scale ? s.hidden : 0, A(0));
  std::vector<A> dbias_acc(s.has_bias ? s.hidden : 0, A(0));
  std::vector<A> g(s.hidden), xhat(s.hidden);
  std::vector<X> h(s.forms_h ? s.hidden : 0);
  for (int64_t r = 0; r < s.rows; ++r) {
    int64_t base = r * s.hidden;
    const X* xr = x + base;
    if (s.forms_h) {
      add_row(xr, residual + base, h.data(), s.hidden);
      xr = h.data();
    }
    A mean, rstd;
    if (s.has_stats) {
      mean = centered ? mean_p[r] : A(0);
      rstd = rstd_p[r];
    } else {
      row_stats(xr, s.hidden, centered, epsilon, &mean, &rstd);
    }
    for (int64_t j = 0; j < s.hidden; ++j) {
      A d = load<A>(dy, base + j);
      xhat[j] = (load<A>(xr, j) - mean) * rstd;
      g[j] = s.has_scale ? d * (load<A>(scale, j) + offset) : d;
      if (s.has_scale) dscale_acc[j] += d * xhat[j];
      if (s.has_bias) dbias_acc[j] += d;
    }
    A sum_g = blocked_sum<A>(s.hidden, [&](int64_t j) { return g[j]; });
    A sum_gx = blocked_sum<A>(s.hidden, [&](int64_t j) { return g[j] * xhat[j]; });
    A c_g = centered ? sum_g / A(s.hidden) : A(0);
    A c_gx = sum_gx / A(s.hidden);
    for (int64_t j = 0; j < s.hidden; ++j) {
      A v = rstd * (g[j] - c_g - xhat[j] * c_gx);
      if (s.has_residual) v += load<A>(dres, base + j);
      store(dx, base + j, v);
    }
  }
  for (int64_t j = 0; j < (s.has_scale ? s.hidden : 0); ++j) {
    store(dscale, j, dscale_acc[j]);
  }
  for (int64_t j = 0; j < (s.has_bias ? s.hidden : 0); ++j) {
    store(dbias, j, dbias_acc[j]);
  }
}

ffi::Error row_norm_fwd_impl(AnyBuffer x, AnyBuffer scale, AnyBuffer bias,
                             AnyBuffer residual, ffi::Result<AnyBuffer> y,
                             ffi::Result<AnyBuffer> mean,
                             ffi::Result<AnyBuffer> rstd,
                             ffi::Result<AnyBuffer> new_residual, double epsilon,
                             bool centered, bool zero_centered) {
  RowNormShape s;
  bool write_y = true;
  JAXNORM_RETURN_IF_ERROR(check_row_norm_fwd(x, scale, bias, residual, *y, *mean,
                                             *rstd, *new_residual, epsilon,
                                             centered, &s, &write_y));
  DataType ydt = write_y ? y->element_type() : x.element_type();
  return dispatch_row_types(
      x.element_type(), ydt, param_dtype(x, scale, bias, s),
      [&](auto xt, auto yt, auto wt) {
        using X = native_t<decltype(xt)>;
        using Y = native_t<decltype(yt)>;
        using W = native_t<decltype(wt)>;
        fwd<X, Y, W>(s, centered, epsilon, zero_centered, write_y,
                     static_cast<const X*>(x.untyped_data()),
                     static_cast<const W*>(scale.untyped_data()),
                     static_cast<const W*>(bias.untyped_data()),
                     static_cast<const X*>(residual.untyped_data()),
                     static_cast<Y*>(y->untyped_data()), mean->untyped_data(),
                     rstd->untyped_data(),
                     static_cast<X*>(new_residual->untyped_data()));
        return ffi::Error::Success();
      });
}

ffi::Error row_norm_bwd_impl(AnyBuffer x, AnyBuffer scale, AnyBuffer mean,
                             AnyBuffer rstd, AnyBuffer dy, AnyBuffer dres,
                             AnyBuffer residual, ffi::Result<AnyBuffer> dx,
                             ffi::Result<AnyBuffer> dscale,
                             ffi::Result<AnyBuffer> dbias, double epsilon,
                             bool centered, bool zero_centered) {
  RowNormShape s;
  JAXNORM_RETURN_IF_ERROR(check_row_norm_bwd(x, scale, mean, rstd, dy, dres, residual, *dx,
                                             *dscale, *dbias, epsilon, centered, &s));
  return dispatch_row_types(
      x.element_type(), dy.element_type(), param_dtype(x, scale, *dbias, s),
      [&](auto xt, auto gt, auto wt) {
        using X = native_t<decltype(xt)>;
        using G = native_t<decltype(gt)>;
        using W = native_t<decltype(wt)>;
        bwd<X, G, W>(s, centered, epsilon, zero_centered,
                     static_cast<const X*>(x.untyped_data()),
                     static_cast<const W*>(scale.untyped_data()),
                     mean.untyped_data(), rstd.untyped_data(),
                     static_cast<const G*>(dy.untyped_data()),
                     static_cast<const X*>(dres.untyped_data()),
                     static_cast<const X*>(residual.untyped_data()),
                     static_cast<X*>(dx->untyped_data()),
                     static_cast<W*>(dscale->untyped_data()),
                     static_cast<W*>(dbias->untyped_data()));
        return ffi::Error::Success();
      });
}

}  // namespace
}  // namespace jaxnorm::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cpu_row_norm_fwd, jaxnorm::cpu::row_norm_fwd_impl,
    jaxnorm::bind_row_norm_fwd(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cpu_row_norm_bwd, jaxnorm::cpu::row_norm_bwd_impl,
    jaxnorm::bind_row_norm_bwd(xla::ffi::Ffi::Bind()));
