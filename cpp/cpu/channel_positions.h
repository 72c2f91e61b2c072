// What the CPU's along-channel ops (local response normalization, the
// channel softmax) share: x viewed as (M, C, B), one position (m, b) at a
// time, its C channels B elements apart.
#pragma once

#include <vector>

#include "common/channel_args.h"
#include "cpu/float_types.h"

namespace jaxnorm::cpu {

// Calls f(base) for every position: its channel c is element base + c * B.
template <typename F>
void each_position(const ChannelShape& s, F&& f) {
  for (int64_t m = 0; m < s.m; ++m) {
    for (int64_t b = 0; b < s.b; ++b) f(m * s.c * s.b + b);
  }
}

template <typename A, typename X>
void load_channels(const ChannelShape& s, const X* x, int64_t base, std::vector<A>& v) {
  v.resize(s.c);
  for (int64_t c = 0; c < s.c; ++c) v[c] = load<A>(x, base + c * s.b);
}

template <typename A, typename X>
void store_channels(const ChannelShape& s, X* y, int64_t base, const std::vector<A>& v) {
  for (int64_t c = 0; c < s.c; ++c) store(y, base + c * s.b, v[c]);
}

}  // namespace jaxnorm::cpu
