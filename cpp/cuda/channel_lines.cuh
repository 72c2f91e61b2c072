// What the CUDA kernels of the ops along the channels (local response
// normalization, the channel softmax) share: a line, one position's C channels
// of channels-last x, held in registers by a team of lanes.
//
// A team of L lanes (a power of two up to a warp) takes a line of `vecs`
// vectors of V channels; lane i holds the line's vectors j * L + i, j < M, so
// that each load instruction of a team reads contiguous memory and a warp's
// teams read neighbouring lines. Reductions over the line are shuffles within
// the team. One read and one write of x (two reads for a backward) is all the
// memory traffic: XLA's fusions of these ops read x again for each reduction
// or window (notes v47, v50, v60).
#pragma once

#include <algorithm>
#include <cmath>

#include "common/channel_args.h"
#include "cuda/common.cuh"

namespace jaxnorm::cuda {

constexpr int kLineThreads = 256;
// Vectors a lane holds (M) at most in a team of 32 lanes, which bounds the
// lines the kernels take, and in any team but where an op allows more
// (Op::max_vecs, up to kMaxLaneVecs). On an H100 (notes v61) 4 lost: LRN's
// backward of 256 bf16 channels in teams of 8 lanes took 92 µs against 58-65
// in teams of 16-32 at 1-2 vectors, and the softmax of 1000 bf16 channels
// (32 lanes of 4 vectors) ran at 0.89x XLA's fusion (1.02-1.04x in notes
// v63's harness, after v62's loads).
constexpr int kMaxLineVecs = 3;

// Lanes a line: the fewest for at most kMaxLineVecs vectors a lane, at most a
// warp (the LRN harness on an H100, notes v61: 96 bf16 channels ran at 96% of
// copy in teams of 4 lanes of 3 vectors, 46-70% with 2 lanes of 6); false
// where a warp's lanes would need more (the lines the kernels take:
// cuda_line_fits in jaxnorm/_channels.py). A line that needs the whole warp
// takes half of it where the op holds up to max_m vectors a lane (the
// softmax's lines of 4-byte vectors, notes v63: 150 bf16 classes ran 22-24%
// faster in 16 lanes of 5 than in 32 of 3; shorter lines kept their teams,
// which ran fastest at 3 vectors a lane in 16-byte vectors).
struct LinePlan {
  int lanes = 1, log_lanes = 0, m = 1;
};

constexpr int kMaxLaneVecs = 5;

inline bool plan_line(int64_t vecs, LinePlan* p, int max_m = kMaxLineVecs) {
  if (vecs > 32 * kMaxLineVecs) return false;
  *p = LinePlan{};
  while (p->lanes < 32 && p->lanes * kMaxLineVecs < vecs) p->lanes *= 2, ++p->log_lanes;
  if (p->lanes == 32 && vecs <= 16 * max_m) p->lanes = 16, p->log_lanes = 4;
  p->m = int((vecs + p->lanes - 1) / p->lanes);
  return true;
}

// This thread's place: its team's line and its lane in the team.
// 32-bit vector indices (a line has at most 96 vectors), so that a lane's
// addresses are one 64-bit base and 32-bit offsets.
struct LineLane {
  int lanes, log_lanes, lane;
  int vecs;
  __device__ int vec(int j) const { return j * lanes + lane; }
  __device__ bool holds(int j) const { return vec(j) < vecs; }
};

// M vectors of V channels of a line, in float.
template <int M, int V>
using LineVals = float[M][V];

// Loads the lane's vectors of the line at `line` (absent ones, and all of an
// invalid line's, as `fill`). kEvery: first every load, unconditionally (an
// absent vector's from the line's first, which is in bounds: an invalid
// line's `line` is x's first), then the conversions and the fill: no load
// waits behind a branch. A load under its own branch waited for the loads
// before it (SASS: LRN's backward at 3 vectors a lane issued its x and dy as
// 4 loads, then 1, then 1, and ran 27-30% behind the harness kernel, which
// issues them together; notes v61-v62). Otherwise (lines with many absent
// vectors, whose loads kEvery would add) the fill first and each load with
// its conversion under its condition.
template <typename X, int M, int V, bool kEvery>
__device__ __forceinline__ void load_line(const LineLane& t, const X* line, bool valid,
                                          float fill, LineVals<M, V>& out) {
  RegVec<X, V> raw[M];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const bool here = valid && t.holds(j);
    if constexpr (kEvery) {
      raw[j].load(line + (here ? t.vec(j) * V : 0));
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) out[j][e] = fill;
      if (here) {
        raw[j].load(line + t.vec(j) * V);
#pragma unroll
        for (int e = 0; e < V; ++e) out[j][e] = raw[j].get(e);
      }
    }
  }
  if constexpr (kEvery) {
#pragma unroll
    for (int j = 0; j < M; ++j) {
      const bool here = valid && t.holds(j);
#pragma unroll
      for (int e = 0; e < V; ++e) out[j][e] = here ? float(raw[j].get(e)) : fill;
    }
  }
}

// Stored as 32-bit words by store_global_words: with plain stores of Packed
// vectors the compiler split one of a line's three 16-byte stores into four
// (SASS); storing words took the softmax over 150 bf16 classes from 24.7 to
// 21.8 µs on an H100 (notes v61).
template <typename X, int M, int V>
__device__ __forceinline__ void store_line(const LineLane& t, X* line, bool valid,
                                           const LineVals<M, V>& in) {
  static_assert(V * sizeof(X) % 4 == 0, "vectors of whole 32-bit words");
#pragma unroll
  for (int j = 0; j < M; ++j) {
    if (valid && t.holds(j)) {
      RegVec<X, V> words;
      words.pack(in[j]);
      words.store_global(line + t.vec(j) * V);
    }
  }
}

// op over the team's lanes of each lane's v: every lane gets the result.
template <typename Op>
__device__ __forceinline__ float team_reduce(const LineLane& t, float v, Op op) {
  for (int offset = t.lanes / 2; offset > 0; offset /= 2) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset, t.lanes));
  }
  return v;
}

// The kernel every op along the channels runs: each team applies
// `op(lane, in0, in1, out, valid)` to its line (in1 may be null), the block's
// teams taking consecutive lines and the grid striding over them. Every
// thread takes every round (a team's shuffles need all of its lanes); lanes
// of lines past the end load fill values and store nothing. Op::kMinBlocks
// (0: ptxas's choice) bounds the registers ptxas may give a thread: LRN's
// forward at 4 blocks an SM (64 registers) and its backward at 2 (128) ran
// 2-6% faster on an H200 than at ptxas's choice (notes v62).
template <typename X, int M, int V, typename Op>
__global__ void __launch_bounds__(kLineThreads, Op::kMinBlocks)
    each_line(int64_t lines, int64_t c, LinePlan plan, const X* in0, const X* in1, X* out,
              Op op) {
  const LineLane t{plan.lanes, plan.log_lanes, int(threadIdx.x) & (plan.lanes - 1),
                   int(c / V)};
  const int teams = kLineThreads >> plan.log_lanes;
  for (int64_t first = int64_t(blockIdx.x) * teams; first < lines;
       first += int64_t(gridDim.x) * teams) {
    const int64_t line = first + (threadIdx.x >> plan.log_lanes);
    const bool valid = line < lines;
    const int64_t at = valid ? line * c : 0;
    op.template apply<X, M, V>(t, in0 + at, in1 ? in1 + at : nullptr, out + at, valid);
  }
}

// Calls f(integral_constant<V>) for the widest vector of V channels (16 bytes
// at most, at least kMinVec channels) that C and every pointer allow.
// XLA's buffers are aligned to at least 16 bytes, so C decides.
template <typename X, int kMinVec, typename F>
ffi::Error with_line_vec(int64_t c, std::initializer_list<const void*> ptrs, F&& f) {
  auto fits = [&](int v) { return vec_fits<X>(c, v, ptrs); };
  constexpr int kWide = int(16 / sizeof(X));
  if (fits(kWide)) return f(std::integral_constant<int, kWide>{});
  if constexpr (kWide / 2 >= kMinVec) {
    if (fits(kWide / 2)) return f(std::integral_constant<int, kWide / 2>{});
  }
  if constexpr (kWide / 4 >= kMinVec) {
    if (fits(kWide / 4)) return f(std::integral_constant<int, kWide / 4>{});
  }
  if constexpr (kWide / 8 >= kMinVec) {
    if (fits(kWide / 8)) return f(std::integral_constant<int, kWide / 8>{});
  }
  return ffi::Error::InvalidArgument(
      "jaxnorm: CUDA kernels along the channels take lines of a multiple of " +
      std::to_string(kMinVec) + " channels on aligned buffers, got " + std::to_string(c) +
      " channels");
}

// Blocks of kLineThreads for `blocks`' worth of work, at most one wave: the
// line kernels stride over the rest.
inline int line_grid(int64_t blocks, int device) {
  const int64_t wave = int64_t(device_info(device).sms) * (2048 / kLineThreads);
  return int(std::min<int64_t>(blocks, wave));
}

// Launches each_line over x's (M, C, 1) lines for x of 16- or 32-bit floats,
// at up to Op::max_vecs(V * sizeof(X)) vectors a lane (at most kMaxLaneVecs).
template <typename X, int V, typename Op>
ffi::Error launch_lines(cudaStream_t stream, int device, const ChannelShape& s, const X* in0,
                        const X* in1, X* out, Op op, const char* what) {
  constexpr int kMaxM = Op::max_vecs(V * int(sizeof(X)));
  static_assert(kMaxM >= kMaxLineVecs && kMaxM <= kMaxLaneVecs);
  if (s.b != 1) {
    return ffi::Error::InvalidArgument(std::string("jaxnorm: ") + what +
                                       " on CUDA takes channels-last x (B == 1), got B = " +
                                       std::to_string(s.b));
  }
  LinePlan plan;
  if (!plan_line(s.c / V, &plan, kMaxM)) {
    return ffi::Error::InvalidArgument(std::string("jaxnorm: ") + what + " on CUDA takes at most " +
                                       std::to_string(32 * kMaxLineVecs * V) +
                                       " channels of this dtype, got " + std::to_string(s.c));
  }
  if (s.size() == 0) return ffi::Error::Success();
  const int teams = kLineThreads >> plan.log_lanes;
  const int grid = line_grid((s.m + teams - 1) / teams, device);
  auto go = [&](auto m) {
    each_line<X, decltype(m)::value, V><<<grid, kLineThreads, 0, stream>>>(s.m, s.c, plan, in0,
                                                                          in1, out, op);
  };
  switch (plan.m) {
    case 1: go(std::integral_constant<int, 1>{}); break;
    case 2: go(std::integral_constant<int, 2>{}); break;
    case 3: go(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (kMaxM >= 4) go(std::integral_constant<int, 4>{}); break;
    default: if constexpr (kMaxM >= 5) go(std::integral_constant<int, 5>{}); break;
  }
  return last_launch_error(what);
}

// Calls f(DT<X>{}) for x of float32, bfloat16 or float16: the lines run in
// float32 (float64 x lowers to jax.numpy on CUDA).
template <typename F>
ffi::Error dispatch_line_type(DataType x, F&& f) {
  return dispatch_x_type(x, [&](auto xt) -> ffi::Error {
    if constexpr (decltype(xt)::value == DataType::F64) {
      return ffi::Error::InvalidArgument(
          "jaxnorm: CUDA kernels along the channels take float32, bfloat16 or float16 x, "
          "got float64");
    } else {
      return f(xt);
    }
  });
}

// What every handler along the channels does first: checks x (and dy, for a
// backward) against out, then calls f(in0, in1, out) with x's type. Empty
// arrays launch nothing.
template <typename F>
ffi::Error with_line_operands(const AnyBuffer& x, const AnyBuffer* dy, AnyBuffer& out,
                              ChannelShape* s, F&& f) {
  if (dy) {
    JAXNORM_RETURN_IF_ERROR(check_channel_op(x, {{dy, "dy"}, {&out, "dx"}}, s));
  } else {
    JAXNORM_RETURN_IF_ERROR(check_channel_op(x, {{&out, "y"}}, s));
  }
  if (s->size() == 0) return ffi::Error::Success();
  return dispatch_line_type(x.element_type(), [&](auto xt) -> ffi::Error {
    using X = native_t<decltype(xt)>;
    return f(static_cast<const X*>(x.untyped_data()),
             dy ? static_cast<const X*>(dy->untyped_data()) : nullptr,
             static_cast<X*>(out.untyped_data()));
  });
}

// with_line_operands for channels-first x (B > 1), whose kernels walk a line
// in 32-bit offsets: lines (C * B) of fewer than 2^31 elements and at most
// `max_channels` channels, else an error.
template <typename F>
ffi::Error with_position_operands(const AnyBuffer& x, const AnyBuffer* dy, AnyBuffer& out,
                                  ChannelShape* s, const char* what, int64_t max_channels,
                                  F&& f) {
  return with_line_operands(x, dy, out, s, [&](auto in0, auto in1, auto o) -> ffi::Error {
    if (s->c > max_channels || s->c * s->b >= (int64_t(1) << 31)) {
      return ffi::Error::InvalidArgument(
          std::string("jaxnorm: ") + what + " on CUDA takes channels-first x in lines (C * B) " +
          "of fewer than 2^31 elements and of at most " + std::to_string(max_channels) +
          " channels, got " + std::to_string(s->c) + " channels in lines of " +
          std::to_string(s->c * s->b));
    }
    return f(in0, in1, o);
  });
}

// with_line_operands, then f(integral_constant<V>, in0, in1, out) with the
// widest vector of at least kMinVec channels and kMinBytes bytes
// (with_line_vec): the channels-last kernels' entry.
template <int kMinVec, int kMinBytes, typename F>
ffi::Error with_line_buffers(const AnyBuffer& x, const AnyBuffer* dy, AnyBuffer& out,
                             ChannelShape* s, F&& f) {
  return with_line_operands(x, dy, out, s, [&](auto in0, auto in1, auto o) {
    using X = std::remove_const_t<std::remove_pointer_t<decltype(in0)>>;
    constexpr int kMin = std::max<int>(kMinVec, kMinBytes / int(sizeof(X)));
    return with_line_vec<X, kMin>(s->c, {in0, in1, o},
                                  [&](auto vt) { return f(vt, in0, in1, o); });
  });
}

}  // namespace jaxnorm::cuda
