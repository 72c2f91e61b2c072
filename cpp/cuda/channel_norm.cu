// FFI handlers for GroupNorm, InstanceNorm and BatchNorm on CUDA
// (channel_args.h): argument checks, dtype dispatch, the tiling of x and the
// scratch the kernels (channel_norm_kernels.cuh) pass their partial results
// through. They take channels-last x (B == 1); jaxnorm/channel_norm.py lowers
// other layouts to jax.numpy on GPUs.
#include "common/channel_args.h"
#include "cuda/channel_norm_cluster_bwd.cuh"

namespace jaxnorm::cuda {
namespace {

// Scratch of `count` values of A, in one allocation per call (kept in order).
template <typename A>
ffi::Error scratch_of(ffi::ScratchAllocator& scratch, int64_t count, A** out) {
  if (count == 0) {
    *out = nullptr;
    return ffi::Error::Success();
  }
  auto mem = scratch.Allocate(size_t(count) * sizeof(A), 16);
  if (!mem.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxnorm: cannot allocate " + std::to_string(count * sizeof(A)) +
                          " bytes of scratch for channel_norm");
  }
  *out = static_cast<A*>(*mem);
  return ffi::Error::Success();
}

template <typename W>
ChannelParams<W> params_of(const ChannelNormShape& s, const AnyBuffer& scale,
                           const AnyBuffer& bias) {
  return {s.has_scale ? static_cast<const W*>(scale.untyped_data()) : nullptr,
          s.has_bias ? static_cast<const W*>(bias.untyped_data()) : nullptr};
}

ffi::Error zero_outputs(cudaStream_t stream, std::initializer_list<ffi::Result<AnyBuffer>*> outs) {
  for (auto* out : outs) {
    if ((*out)->size_bytes() == 0) continue;
    if (cudaMemsetAsync((*out)->untyped_data(), 0, (*out)->size_bytes(), stream) !=
        cudaSuccess) {
      return last_launch_error("channel_norm (memset)");
    }
  }
  return ffi::Error::Success();
}

// A plan whose indices TileThread's 32-bit math cannot hold (2^34 or more
// rows a sample: more bytes than any GPU has).
ffi::Error check_tiles(std::initializer_list<const Tiles*> plans) {
  for (const Tiles* t : plans) {
    if (!t->fits_index_math()) {
      return ffi::Error::InvalidArgument("jaxnorm: channel_norm on CUDA: x has " +
                                         std::to_string(t->rows) + " rows a sample, too many");
    }
  }
  return ffi::Error::Success();
}

ffi::Error layout_error(const ChannelNormShape& s) {
  return ffi::Error::InvalidArgument(
      "jaxnorm: channel_norm on CUDA takes channels-last x (B == 1), got B = " +
      std::to_string(s.b));
}

// A cluster plan's meetings where it spreads a sample, or where its grid
// meets (`grid_meets`): the counters and the clusters' sums (scratch);
// without counters the plan is dropped (parts 0: the passes instead).
ffi::Error cluster_meeting(cudaStream_t stream, const DeviceInfo& dev,
                           ffi::ScratchAllocator& scratch, int64_t n, ClusterGnPlan& plan,
                           float** sums, unsigned** counters, bool grid_meets = false) {
  *counters = nullptr;
  if (plan.parts > 0 && (plan.args.clusters_per_sample > 1 || grid_meets)) {
    *counters = meeting_counters(dev, stream);
    if (*counters == nullptr) plan = {};
  }
  return scratch_of(scratch, int64_t(plan.exchange_bytes(n)) / 4, sums);
}

// The statistics (tile_stats, then group_stats' merge), unless given, and y
// from them (apply_affine), where asked for; both in one launch where a
// sample fits a cluster's shared memory (channel_norm_cluster.cuh).
template <typename X, typename Y, typename W, int V>
ffi::Error launch_fwd(cudaStream_t stream, const DeviceInfo& dev, ffi::ScratchAllocator& scratch,
                      const ChannelNormShape& s, double epsilon, Activation act, bool given,
                      bool write_y, const X* x, ChannelParams<W> p, acc_t<X>* mean,
                      acc_t<X>* var, Y* y) {
  using A = acc_t<X>;
  // The cluster forward where it was measured: 16-byte vectors of x, y in x's dtype.
  if constexpr (sizeof(A) == 4 && V * sizeof(X) == 16 && std::is_same_v<Y, X>) {
    ClusterGnPlan plan;
    if (!given && write_y) plan = plan_cluster_gn<X, Y, W, V>(s.n, s.a, s.c, s.group_size, dev);
    float* sums = nullptr;
    unsigned* counters = nullptr;
    JAXNORM_RETURN_IF_ERROR(cluster_meeting(stream, dev, scratch, s.n, plan, &sums, &counters));
    if (plan.parts > 0) {
      plan.args.epsilon = epsilon;
      plan.args.act = act;
      return cuda_error(launch_cluster_gn<X, Y, W, V>(stream, plan, s.n, x, p, sums, counters,
                                                      dev, mean, var, y),
                        "channel_norm_fwd (clusters)");
    }
  }
  if (!given) {
    const Tiles t =
        plan_tiles(s.n, s.a, s.c, V, sizeof(X), 3 * sizeof(A), dev, tile_stats<X, V>);
    const GroupChunks chunks = plan_group_chunks(s.n, s.c, s.group_size, dev);
    const size_t smem = merge_smem_bytes<A>(chunks, 3);
    JAXNORM_RETURN_IF_ERROR(check_tiles({&t}));
    A *partial = nullptr, *chan = nullptr;
    JAXNORM_RETURN_IF_ERROR(scratch_of(scratch, t.blocks() / t.slabs * s.c * 3, &partial));
    if (s.group_size > 1 && smem == 0) {
      JAXNORM_RETURN_IF_ERROR(scratch_of(scratch, s.n * s.c * 3, &chan));
    }
    tile_stats<X, V><<<t.blocks(), kChannelThreads, 0, stream>>>(x, t, partial);
    group_stats<X><<<chunks.blocks(s.n), kChannelThreads, smem, stream>>>(partial, chan, t,
                                                                         chunks, mean, var);
  }
  if (write_y) {
    const Tiles ty = plan_tiles(s.n, s.a, s.c, V, sizeof(X), 0, dev, apply_affine<X, Y, W, V>);
    JAXNORM_RETURN_IF_ERROR(check_tiles({&ty}));
    apply_affine<X, Y, W, V><<<ty.blocks(), kChannelThreads, 0, stream>>>(
        x, mean, var, p, FastDiv(uint32_t(s.group_size)), epsilon, act, ty, y);
  }
  return last_launch_error("channel_norm_fwd");
}

ffi::Error channel_norm_fwd_impl(cudaStream_t stream, int32_t device,
                                 ffi::ScratchAllocator scratch, AnyBuffer x, AnyBuffer scale,
                                 AnyBuffer bias, AnyBuffer mean, AnyBuffer var,
                                 ffi::Result<AnyBuffer> y, ffi::Result<AnyBuffer> mean_out,
                                 ffi::Result<AnyBuffer> var_out, int64_t group_size,
                                 double epsilon, int32_t activation) {
  ChannelNormShape s;
  bool given = false, write_y = true;
  JAXNORM_RETURN_IF_ERROR(check_channel_norm_fwd(x, scale, bias, mean, var, *y, *mean_out,
                                                 *var_out, group_size, epsilon, activation, &s,
                                                 &given, &write_y));
  if (s.b != 1) return layout_error(s);
  if (s.size() == 0) return zero_outputs(stream, {&mean_out, &var_out});
  const DeviceInfo& dev = device_info(device);
  const DataType ydt = write_y ? y->element_type() : x.element_type();
  const DataType wdt = s.has_scale ? scale.element_type() : s.has_bias ? bias.element_type()
                                                                       : x.element_type();
  void* mean_p = given ? mean.untyped_data() : mean_out->untyped_data();
  void* var_p = given ? var.untyped_data() : var_out->untyped_data();
  return dispatch_row_types(x.element_type(), ydt, wdt, [&](auto xt, auto yt, auto wt) {
    using X = native_t<decltype(xt)>;
    using Y = native_t<decltype(yt)>;
    using W = native_t<decltype(wt)>;
    using A = acc_t<X>;
    const ChannelParams<W> p = params_of<W>(s, scale, bias);
    const void* y_p = write_y ? y->untyped_data() : nullptr;
    return with_vec_or_one<X, 16 / sizeof(X)>(s.c, {x.untyped_data(), y_p}, [&](auto v) {
      return launch_fwd<X, Y, W, decltype(v)::value>(
          stream, dev, scratch, s, epsilon, Activation(activation), given, write_y,
          static_cast<const X*>(x.untyped_data()), p, static_cast<A*>(mean_p),
          static_cast<A*>(var_p), static_cast<Y*>(y->untyped_data()));
    });
  });
}

// Where the cluster backward runs (H200, bf16, benchmarks/NOTES.md): it beat
// the passes at 320 and 1280 channels (v92), and at 64 and 128 once the grid
// wrote dscale and dbias itself (v93: 1x512x512x64 50.0 -> 46.8 us,
// 4x128x128x128 27.2 -> 25.4); fewer channels were not measured.
constexpr int64_t kClusterBwdMinChannels = 64;

// The backward without an activation in one launch of the cluster kernel
// (channel_norm_cluster_bwd.cuh), where plan_clusters finds a plan for it:
// `done` says whether it ran. kOwn: the statistics computed.
template <typename X, typename W, int V, bool kOwn>
ffi::Error cluster_bwd(cudaStream_t stream, const DeviceInfo& dev, ffi::ScratchAllocator& scratch,
                       const ChannelNormShape& s, double epsilon, const X* x,
                       const X* dy, ChannelParams<W> p, const float* mean, const float* var,
                       X* dx, W* dscale, W* dbias, bool* done) {
  ClusterGnPlan plan =
      plan_clusters<ClusterGnBwd<X, W, V, kOwn>, V>(s.n, s.a, s.c, s.group_size, dev);
  const bool grads = dscale || dbias;
  float* sums = nullptr;
  unsigned* counters = nullptr;
  JAXNORM_RETURN_IF_ERROR(
      cluster_meeting(stream, dev, scratch, s.n, plan, &sums, &counters, grads));
  *done = plan.parts > 0;
  if (!*done) return ffi::Error::Success();
  plan.args.epsilon = epsilon;
  // Each cluster's sums of its channels' dscale and dbias, added over the
  // clusters by the grid.
  float* chan = nullptr;
  if (grads) {
    const int64_t clusters = s.n * plan.args.clusters_per_sample;
    JAXNORM_RETURN_IF_ERROR(scratch_of(scratch, clusters * s.c * 2, &chan));
  }
  return cuda_error(launch_cluster_gn_bwd<X, W, V, kOwn>(stream, plan, s.n, x, dy, p, mean, var,
                                                         sums, counters, dev, chan, dscale,
                                                         dbias, dx),
                    "channel_norm_bwd (clusters)");
}

// The backward's passes (channel_norm_kernels.cuh): the tiles' sums (with
// x's moments where it computes its statistics, own_stats), their merge per
// group (group_sums), dscale/dbias over the samples and dx (apply_dx, or
// param_grads alone), as `mode` asks.
template <typename X, typename G, typename W, int V>
ffi::Error launch_bwd(cudaStream_t stream, const DeviceInfo& dev, ffi::ScratchAllocator& scratch,
                      const ChannelNormShape& s, double epsilon, Activation act,
                      ChannelBwdMode mode, bool params_out, bool own_stats, const X* x,
                      const G* dy, ChannelParams<W> p, const acc_t<X>* mean,
                      const acc_t<X>* var, const acc_t<X>* means, X* dx, W* dscale, W* dbias,
                      acc_t<X>* sums_out) {
  using A = acc_t<X>;
  // The cluster kernel where it was measured: 16-byte vectors of x, dy in x's
  // dtype, dx and the parameters' gradients asked for.
  if constexpr (sizeof(A) == 4 && V * sizeof(X) == 16 && std::is_same_v<G, X>) {
    if (mode == ChannelBwdMode::kFull && act == Activation::kNone &&
        s.c >= kClusterBwdMinChannels) {
      bool done = false;
      const ffi::Error err =
          own_stats ? cluster_bwd<X, W, V, true>(stream, dev, scratch, s, epsilon, x, dy, p, mean,
                                                 var, dx, dscale, dbias, &done)
                    : cluster_bwd<X, W, V, false>(stream, dev, scratch, s, epsilon, x, dy, p,
                                                  mean, var, dx, dscale, dbias, &done);
      if (err.failure() || done) return err;
    }
  }
  const int sums = own_stats ? 5 : 2;  // values a tile and channel
  const Tiles t = own_stats ? plan_tiles(s.n, s.a, s.c, V, sizeof(X) + sizeof(G),
                                         sums * sizeof(A), dev, tile_moments_sums<X, G, V>)
                            : plan_tiles(s.n, s.a, s.c, V, sizeof(X) + sizeof(G),
                                         sums * sizeof(A), dev, tile_sums<X, G, W, V>);
  const Tiles tx =
      plan_tiles(s.n, s.a, s.c, V, sizeof(X) + sizeof(G), 0, dev, apply_dx<X, G, W, V>);
  JAXNORM_RETURN_IF_ERROR(check_tiles({&t, &tx}));
  const bool from_tiles = mode != ChannelBwdMode::kDx || params_out;
  const bool dx_out = mode == ChannelBwdMode::kFull || mode == ChannelBwdMode::kDx;
  const bool terms_out = mode == ChannelBwdMode::kTerms;  // group_sums' coef, returned
  const GroupChunks chunks = plan_group_chunks(s.n, s.c, s.group_size, dev);
  // for_groups_merged's buffer of the channels' merged tiles (groups of
  // several, with own_stats): shared memory where it fits, else own.
  const size_t smem = own_stats ? merge_smem_bytes<A>(chunks, 5) : 0;
  A *partial = nullptr, *chan = nullptr, *coef = terms_out ? sums_out : nullptr, *own = nullptr;
  if (from_tiles) {
    JAXNORM_RETURN_IF_ERROR(scratch_of(scratch, t.blocks() / t.slabs * s.c * sums, &partial));
    JAXNORM_RETURN_IF_ERROR(scratch_of(scratch, s.n * s.c * 2, &chan));
  }
  if (own_stats) {
    if (s.group_size > 1 && smem == 0) {
      JAXNORM_RETURN_IF_ERROR(scratch_of(scratch, s.n * s.c * 5, &own));
    }
    tile_moments_sums<X, G, V><<<t.blocks(), kChannelThreads, 0, stream>>>(x, dy, t, partial);
  } else if (from_tiles) {
    tile_sums<X, G, W, V><<<t.blocks(), kChannelThreads, 0, stream>>>(
        x, dy, p, mean, var, FastDiv(uint32_t(s.group_size)), epsilon, act, t, partial);
  }
  if (dx_out) JAXNORM_RETURN_IF_ERROR(scratch_of(scratch, s.n * s.c * 5, &coef));
  const GroupSumsMode gmode{from_tiles, mode == ChannelBwdMode::kSums, dx_out || terms_out,
                            terms_out, own_stats};
  const bool grads_here = params_out && s.n == 1;  // group_sums writes them
  group_sums<X, W><<<chunks.blocks(s.n), kChannelThreads, smem, stream>>>(
      partial, chan, p, mean, var, mode == ChannelBwdMode::kDx ? means : nullptr, t, chunks,
      epsilon, gmode, sums_out, coef, grads_here ? dscale : nullptr,
      grads_here ? dbias : nullptr, own);
  ParamGrads<A, W> grads;
  if (params_out && !grads_here) grads = {chan, s.n, s.c, dscale, dbias};
  if (dx_out) {
    apply_dx<X, G, W, V><<<tx.blocks(), kChannelThreads, 0, stream>>>(x, dy, coef, act, tx,
                                                                      dx, grads);
  } else if (grads.dscale || grads.dbias) {
    param_grads<A, W><<<(s.c + kChannelThreads - 1) / kChannelThreads, kChannelThreads, 0,
                        stream>>>(grads);
  }
  return last_launch_error("channel_norm_bwd");
}

ffi::Error channel_norm_bwd_impl(cudaStream_t stream, int32_t device,
                                 ffi::ScratchAllocator scratch, AnyBuffer x, AnyBuffer scale,
                                 AnyBuffer bias, AnyBuffer mean, AnyBuffer var, AnyBuffer dy,
                                 AnyBuffer means, ffi::Result<AnyBuffer> dx,
                                 ffi::Result<AnyBuffer> dscale, ffi::Result<AnyBuffer> dbias,
                                 ffi::Result<AnyBuffer> sums_out, int64_t group_size,
                                 double epsilon, int32_t activation) {
  ChannelNormShape s;
  ChannelBwdMode mode;
  bool params_out = false, own_stats = false;
  JAXNORM_RETURN_IF_ERROR(check_channel_norm_bwd(x, scale, bias, mean, var, dy, means, *dx,
                                                 *dscale, *dbias, *sums_out, group_size,
                                                 epsilon, activation, &s, &mode, &params_out,
                                                 &own_stats));
  if (s.b != 1) return layout_error(s);
  if (s.size() == 0) return zero_outputs(stream, {&dscale, &dbias, &sums_out});
  const DeviceInfo& dev = device_info(device);
  const DataType wdt = s.has_scale ? scale.element_type() : s.has_bias ? bias.element_type()
                                                                       : x.element_type();
  return dispatch_row_types(x.element_type(), dy.element_type(), wdt,
                            [&](auto xt, auto gt, auto wt) {
    using X = native_t<decltype(xt)>;
    using G = native_t<decltype(gt)>;
    using W = native_t<decltype(wt)>;
    using A = acc_t<X>;
    const ChannelParams<W> p = params_of<W>(s, scale, bias);
    W* ds = params_out && s.has_scale ? static_cast<W*>(dscale->untyped_data()) : nullptr;
    W* db = params_out && s.has_bias ? static_cast<W*>(dbias->untyped_data()) : nullptr;
    const void* dx_p = mode == ChannelBwdMode::kSums ? nullptr : dx->untyped_data();
    const std::initializer_list<const void*> ptrs{x.untyped_data(), dy.untyped_data(), dx_p};
    return with_vec_or_one<X, 16 / sizeof(X)>(s.c, ptrs, [&](auto v) {
      return launch_bwd<X, G, W, decltype(v)::value>(
          stream, dev, scratch, s, epsilon, Activation(activation), mode, params_out, own_stats,
          static_cast<const X*>(x.untyped_data()), static_cast<const G*>(dy.untyped_data()), p,
          static_cast<const A*>(mean.untyped_data()), static_cast<const A*>(var.untyped_data()),
          static_cast<const A*>(means.untyped_data()), static_cast<X*>(dx->untyped_data()), ds,
          db, static_cast<A*>(sums_out->untyped_data()));
    });
  });
}

}  // namespace
}  // namespace jaxnorm::cuda

// Not command-buffer compatible: they allocate scratch for the partial results.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_channel_norm_fwd, jaxnorm::cuda::channel_norm_fwd_impl,
    jaxnorm::bind_channel_norm_fwd(jaxnorm::cuda::cuda_bind().Ctx<xla::ffi::ScratchAllocator>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_channel_norm_bwd, jaxnorm::cuda::channel_norm_bwd_impl,
    jaxnorm::bind_channel_norm_bwd(jaxnorm::cuda::cuda_bind().Ctx<xla::ffi::ScratchAllocator>()));
