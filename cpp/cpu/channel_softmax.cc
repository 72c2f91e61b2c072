// CPU handlers for the softmax over channels at each position:
// y = exp(x - max) / sum exp(x - max); dx = y * (dy - sum dy * y), the
// backward recomputing y from x (the forward's y is often dead under grad).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/channel_positions.h"

namespace jaxnorm::cpu {
namespace {

// v: a position's channels, replaced by their softmax.
template <typename A>
void softmax_in_place(std::vector<A>& v) {
  const A top = *std::max_element(v.begin(), v.end());
  double total = 0.0;
  for (auto& e : v) total += (e = std::exp(e - top));
  for (auto& e : v) e = A(e / total);
}

template <typename X>
void fwd(const ChannelShape& s, const X* x, X* y) {
  std::vector<acc_t<X>> v;
  each_position(s, [&](int64_t base) {
    load_channels(s, x, base, v);
    softmax_in_place(v);
    store_channels(s, y, base, v);
  });
}

template <typename X>
void bwd(const ChannelShape& s, const X* x, const X* dy, X* dx) {
  using A = acc_t<X>;
  std::vector<A> v, g;
  each_position(s, [&](int64_t base) {
    load_channels(s, x, base, v);
    softmax_in_place(v);
    load_channels(s, dy, base, g);
    double dot = 0.0;
    for (int64_t c = 0; c < s.c; ++c) dot += double(g[c]) * v[c];
    for (int64_t c = 0; c < s.c; ++c) g[c] = v[c] * (g[c] - A(dot));
    store_channels(s, dx, base, g);
  });
}

ffi::Error softmax_fwd_impl(AnyBuffer x, ffi::Result<AnyBuffer> y) {
  ChannelShape s;
  JAXNORM_RETURN_IF_ERROR(check_channel_op(x, {{&*y, "y"}}, &s));
  if (s.c == 0) return ffi::Error::Success();  // no channels, nothing to write
  return dispatch_x_type(x.element_type(), [&](auto xt) {
    using X = native_t<decltype(xt)>;
    fwd<X>(s, static_cast<const X*>(x.untyped_data()), static_cast<X*>(y->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error softmax_bwd_impl(AnyBuffer x, AnyBuffer dy, ffi::Result<AnyBuffer> dx) {
  ChannelShape s;
  JAXNORM_RETURN_IF_ERROR(check_channel_op(x, {{&dy, "dy"}, {&*dx, "dx"}}, &s));
  if (s.c == 0) return ffi::Error::Success();
  return dispatch_x_type(x.element_type(), [&](auto xt) {
    using X = native_t<decltype(xt)>;
    bwd<X>(s, static_cast<const X*>(x.untyped_data()), static_cast<const X*>(dy.untyped_data()),
           static_cast<X*>(dx->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxnorm::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(cpu_channel_softmax_fwd, jaxnorm::cpu::softmax_fwd_impl,
                              jaxnorm::bind_channel_softmax_fwd(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cpu_channel_softmax_bwd, jaxnorm::cpu::softmax_bwd_impl,
                              jaxnorm::bind_channel_softmax_bwd(xla::ffi::Ffi::Bind()));
