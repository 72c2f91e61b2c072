// CPU handlers for local response normalization across channels, as
// PyTorch's: y = x / (k + alpha / size * sum of x^2 over the window)^beta,
// the window size channels (size / 2 before the channel, (size - 1) / 2
// after), clipped at the ends but still divided by size. Window sums come
// from prefix sums in double.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/channel_positions.h"

namespace jaxnorm::cpu {
namespace {

// prefix[c] = sum of v[0..c), in double.
template <typename A>
void prefix_sums(const std::vector<A>& v, std::vector<double>& prefix) {
  prefix.assign(v.size() + 1, 0.0);
  for (size_t c = 0; c < v.size(); ++c) prefix[c + 1] = prefix[c] + double(v[c]);
}

// Sum of v[lo..hi] (inclusive, clipped to the channels) from its prefix sums.
inline double window_sum(const std::vector<double>& prefix, int64_t lo, int64_t hi) {
  const int64_t c = int64_t(prefix.size()) - 1;
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, c - 1);
  return hi < lo ? 0.0 : prefix[hi + 1] - prefix[lo];
}

// den[c] = k + alpha / size * (sum of x^2 over c's window).
template <typename A>
void denominators(const LrnParams& p, const std::vector<A>& x, std::vector<A>& den,
                  std::vector<A>& sq, std::vector<double>& prefix) {
  const int64_t before = p.size / 2, after = (p.size - 1) / 2;
  sq.resize(x.size());
  for (size_t c = 0; c < x.size(); ++c) sq[c] = x[c] * x[c];
  prefix_sums(sq, prefix);
  den.resize(x.size());
  for (int64_t c = 0; c < int64_t(x.size()); ++c) {
    den[c] = A(p.k + p.alpha / double(p.size) * window_sum(prefix, c - before, c + after));
  }
}

template <typename X>
void fwd(const ChannelShape& s, const LrnParams& p, const X* x, X* y) {
  using A = acc_t<X>;
  std::vector<A> v, den, sq;
  std::vector<double> prefix;
  each_position(s, [&](int64_t base) {
    load_channels(s, x, base, v);
    denominators(p, v, den, sq, prefix);
    for (int64_t c = 0; c < s.c; ++c) v[c] *= std::pow(den[c], A(-p.beta));
    store_channels(s, y, base, v);
  });
}

// dx_j = dy_j den_j^-beta
//        - 2 alpha beta / size * x_j * sum over the c whose window holds j of
//          dy_c x_c den_c^(-beta - 1);
// j is in c's window when c is in [j - (size - 1) / 2, j + size / 2].
template <typename X>
void bwd(const ChannelShape& s, const LrnParams& p, const X* x, const X* dy, X* dx) {
  using A = acc_t<X>;
  const int64_t before = p.size / 2, after = (p.size - 1) / 2;
  const double coef = 2.0 * p.alpha * p.beta / double(p.size);
  std::vector<A> v, g, den, t;
  std::vector<double> prefix;
  each_position(s, [&](int64_t base) {
    load_channels(s, x, base, v);
    load_channels(s, dy, base, g);
    denominators(p, v, den, t, prefix);
    for (int64_t c = 0; c < s.c; ++c) t[c] = g[c] * v[c] * std::pow(den[c], A(-p.beta - 1));
    prefix_sums(t, prefix);
    for (int64_t j = 0; j < s.c; ++j) {
      const double around = window_sum(prefix, j - after, j + before);
      g[j] = g[j] * std::pow(den[j], A(-p.beta)) - A(coef * around) * v[j];
    }
    store_channels(s, dx, base, g);
  });
}

ffi::Error lrn_fwd_impl(AnyBuffer x, ffi::Result<AnyBuffer> y, int64_t size, double alpha,
                        double beta, double k) {
  const LrnParams p{size, alpha, beta, k};
  ChannelShape s;
  JAXNORM_RETURN_IF_ERROR(check_channel_op(x, {{&*y, "y"}}, &s));
  JAXNORM_RETURN_IF_ERROR(check_lrn(p));
  return dispatch_x_type(x.element_type(), [&](auto xt) {
    using X = native_t<decltype(xt)>;
    fwd<X>(s, p, static_cast<const X*>(x.untyped_data()), static_cast<X*>(y->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error lrn_bwd_impl(AnyBuffer x, AnyBuffer dy, ffi::Result<AnyBuffer> dx, int64_t size,
                        double alpha, double beta, double k) {
  const LrnParams p{size, alpha, beta, k};
  ChannelShape s;
  JAXNORM_RETURN_IF_ERROR(check_channel_op(x, {{&dy, "dy"}, {&*dx, "dx"}}, &s));
  JAXNORM_RETURN_IF_ERROR(check_lrn(p));
  return dispatch_x_type(x.element_type(), [&](auto xt) {
    using X = native_t<decltype(xt)>;
    bwd<X>(s, p, static_cast<const X*>(x.untyped_data()), static_cast<const X*>(dy.untyped_data()),
           static_cast<X*>(dx->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxnorm::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(cpu_local_response_norm_fwd, jaxnorm::cpu::lrn_fwd_impl,
                              jaxnorm::bind_lrn_fwd(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cpu_local_response_norm_bwd, jaxnorm::cpu::lrn_bwd_impl,
                              jaxnorm::bind_lrn_bwd(xla::ffi::Ffi::Bind()));
