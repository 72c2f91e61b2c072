// FFI handlers for the row norms on CUDA: argument checks, dtype dispatch and
// the choice of a plan. The kernels that give a row a block of its own (the
// forward wherever a row fits a block, the backward for few rows) are in
// row_norm_block.cuh; the backward of 16-bit rows of 4097-8192 elements
// that compute their statistics on sm_90 in row_norm_bwd_roles.cuh; the
// others in row_norm_kernels.cuh.
#include "common/row_norm_args.h"
#include "cuda/row_norm_block.cuh"
#include "cuda/row_norm_bwd_roles.cuh"

namespace jaxnorm::cuda {
namespace {

template <typename X, typename Y, typename W, int VEC>
ffi::Error launch_fwd_vec(cudaStream_t stream, const DeviceInfo& dev, const FwdArgs& a) {
  if constexpr (VEC > 1) {
    const bool residual = a.residual != nullptr;
    if (const int nv =
            block_fwd_nv(a.rows, a.hidden / VEC, a.write_y, residual, a.centered, dev)) {
      return cuda_error(launch_fwd_block<X, Y, W, VEC>(stream, dev, nv, a), "row_norm_fwd");
    }
  }
  RowPlan p = plan_fwd(a.rows, a.hidden / VEC, VEC, dev.sms);
  return cuda_error(launch_fwd<X, Y, W, VEC>(stream, dev, p, a), "row_norm_fwd");
}

// Points a.partial at `bytes` of scratch (none when 0): partial rows of
// dscale/dbias, or the RowTerms of the few-rows column plan.
inline ffi::Error scratch_for_partials(ffi::ScratchAllocator& scratch, size_t bytes,
                                       BwdArgs& a) {
  if (bytes == 0) return ffi::Error::Success();
  auto mem = scratch.Allocate(bytes, 16);
  if (!mem.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxnorm: cannot allocate " + std::to_string(bytes) +
                          " bytes of scratch for row_norm_bwd");
  }
  a.partial = *mem;
  return ffi::Error::Success();
}

// For a backward given no statistics whose kernel reads them (the long
// path), or given a residual on a plan that reads h: the statistics-only
// forward into scratch, which forms h there too; then a.mean, a.rstd (and
// a.x) point there.
template <typename X, typename W, int VEC>
ffi::Error stats_into_scratch(cudaStream_t stream, const DeviceInfo& dev,
                              ffi::ScratchAllocator& scratch, BwdArgs& a) {
  using A = acc_t<X>;
  if (a.rstd != nullptr) return ffi::Error::Success();
  const size_t stats_bytes = (2 * size_t(a.rows) * sizeof(A) + 15) / 16 * 16;
  const size_t h_bytes = a.residual ? size_t(a.rows) * size_t(a.hidden) * sizeof(X) : 0;
  auto mem = scratch.Allocate(stats_bytes + h_bytes, 16);
  if (!mem.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxnorm: cannot allocate scratch for row_norm_bwd's statistics");
  }
  A* rstd = static_cast<A*>(*mem);
  A* mean = rstd + a.rows;
  FwdArgs f{a.x, nullptr, nullptr, nullptr, mean, rstd, a.rows, a.hidden, 0, 0,
            a.epsilon, a.centered, false, false, /*write_y=*/false, false};
  if (a.residual != nullptr) {
    f.residual = a.residual;
    f.new_residual = static_cast<char*>(*mem) + stats_bytes;
  }
  JAXNORM_RETURN_IF_ERROR((launch_fwd_vec<X, X, W, VEC>(stream, dev, f)));
  a.mean = mean;
  a.rstd = rstd;
  if (a.residual != nullptr) a.x = f.new_residual;
  a.residual = nullptr;
  return ffi::Error::Success();
}

template <typename X, typename G, typename W, int VEC>
ffi::Error launch_bwd_vec(cudaStream_t stream, const DeviceInfo& dev,
                          ffi::ScratchAllocator& scratch, BwdArgs a) {
  if constexpr (VEC > 1) {
    const FewBwdPlan few = plan_bwd_few<X, VEC>(a.rows, a.hidden, dev);
    if (few.blocks > 0) {  // computes missing statistics itself
      JAXNORM_RETURN_IF_ERROR(scratch_for_partials(scratch, few.partial_bytes, a));
      return cuda_error(launch_bwd_few<X, G, W, VEC>(stream, few, a), "row_norm_bwd");
    }
  }
  if (a.residual != nullptr) {  // the plans below read h
    JAXNORM_RETURN_IF_ERROR((stats_into_scratch<X, W, VEC>(stream, dev, scratch, a)));
  }
  if constexpr (VEC > 1 && sizeof(X) == 2 && std::is_same_v<X, G>) {
    if (roles_serve(a, dev)) {
      JAXNORM_RETURN_IF_ERROR(scratch_for_partials(scratch, roles_partial_bytes(a, dev), a));
      return cuda_error(launch_bwd_roles<X, W>(stream, dev, a), "row_norm_bwd");
    }
  }
  const int regions = int(a.has_scale) + int(a.has_bias);
  const bool plain = a.dres == nullptr && a.scale_offset == 0;
  const bool own_stats = a.rstd == nullptr;
  RowPlan p = plan_bwd_rows<X, G, W, VEC>(a.rows, a.hidden, regions, plain, own_stats, dev);
  if (p.nv == 0) {  // the register path computes missing statistics itself
    JAXNORM_RETURN_IF_ERROR((stats_into_scratch<X, W, VEC>(stream, dev, scratch, a)));
  }
  auto l = plan_bwd<X, G, W, VEC>(p, a.hidden, a.has_scale, regions, plain, dev);
  JAXNORM_RETURN_IF_ERROR(scratch_for_partials(scratch, l.partial_bytes(a.hidden), a));
  return cuda_error(launch_bwd<X, G, W, VEC>(stream, l, a), "row_norm_bwd");
}

// Runs launch<VEC>() with 16-byte vectors when the row length and every
// pointer allow them, else element by element.
template <typename X, typename F>
ffi::Error with_vec(int64_t hidden, std::initializer_list<const void*> ptrs,
                    F&& launch) {
  constexpr int kVec = 16 / sizeof(X);
  bool ok = hidden % kVec == 0;
  for (const void* q : ptrs) ok = ok && aligned16(q);
  if (ok) return launch(std::integral_constant<int, kVec>{});
  return launch(std::integral_constant<int, 1>{});
}

ffi::Error row_norm_fwd_impl(cudaStream_t stream, int32_t device, AnyBuffer x,
                             AnyBuffer scale, AnyBuffer bias, AnyBuffer residual,
                             ffi::Result<AnyBuffer> y,
                             ffi::Result<AnyBuffer> mean,
                             ffi::Result<AnyBuffer> rstd,
                             ffi::Result<AnyBuffer> new_residual, double epsilon,
                             bool centered, bool zero_centered) {
  RowNormShape s;
  bool write_y = true;
  JAXNORM_RETURN_IF_ERROR(check_row_norm_fwd(x, scale, bias, residual, *y, *mean,
                                             *rstd, *new_residual, epsilon,
                                             centered, &s, &write_y));
  if (s.rows == 0 || s.hidden == 0) return ffi::Error::Success();
  FwdArgs a{x.untyped_data(), scale.untyped_data(), bias.untyped_data(),
            y->untyped_data(), mean->untyped_data(), rstd->untyped_data(),
            s.rows, s.hidden, 0, 0, epsilon, centered, s.has_scale, s.has_bias,
            write_y, false};
  if (s.has_residual) {
    a.residual = residual.untyped_data();
    a.new_residual = new_residual->untyped_data();
  }
  a.scale_offset = zero_centered ? 1.0f : 0.0f;
  const DeviceInfo& dev = device_info(device);
  DataType ydt = write_y ? y->element_type() : x.element_type();
  return dispatch_row_types(
      x.element_type(), ydt, param_dtype(x, scale, bias, s),
      [&](auto xt, auto yt, auto wt) {
        using X = native_t<decltype(xt)>;
        using Y = native_t<decltype(yt)>;
        using W = native_t<decltype(wt)>;
        return with_vec<X>(s.hidden, {a.x, a.y, a.scale, a.bias, a.residual, a.new_residual},
                           [&](auto v) {
          return launch_fwd_vec<X, Y, W, decltype(v)::value>(stream, dev, a);
        });
      });
}

ffi::Error row_norm_bwd_impl(cudaStream_t stream, int32_t device,
                             ffi::ScratchAllocator scratch, AnyBuffer x,
                             AnyBuffer scale, AnyBuffer mean, AnyBuffer rstd,
                             AnyBuffer dy, AnyBuffer dres, AnyBuffer residual,
                             ffi::Result<AnyBuffer> dx,
                             ffi::Result<AnyBuffer> dscale,
                             ffi::Result<AnyBuffer> dbias, double epsilon,
                             bool centered, bool zero_centered) {
  RowNormShape s;
  JAXNORM_RETURN_IF_ERROR(check_row_norm_bwd(x, scale, mean, rstd, dy, dres, residual, *dx,
                                             *dscale, *dbias, epsilon, centered, &s));
  if (s.hidden == 0) return ffi::Error::Success();
  if (s.rows == 0) {  // empty batch: parameter gradients are zero
    for (auto* out : {&dscale, &dbias}) {
      if ((*out)->size_bytes() == 0) continue;
      if (cudaMemsetAsync((*out)->untyped_data(), 0, (*out)->size_bytes(),
                          stream) != cudaSuccess) {
        return last_launch_error("row_norm_bwd (memset)");
      }
    }
    return ffi::Error::Success();
  }
  BwdArgs a{x.untyped_data(), scale.untyped_data(), mean.untyped_data(),
            rstd.untyped_data(), dy.untyped_data(), dx->untyped_data(),
            nullptr, dscale->untyped_data(), dbias->untyped_data(),
            s.rows, s.hidden, 0, 0, centered, s.has_scale, s.has_bias, false};
  if (s.has_residual) a.dres = dres.untyped_data();
  if (s.forms_h) a.residual = residual.untyped_data();
  if (!s.has_stats) a.mean = a.rstd = nullptr;
  a.epsilon = epsilon;
  a.scale_offset = zero_centered ? 1.0f : 0.0f;
  const DeviceInfo& dev = device_info(device);
  return dispatch_row_types(
      x.element_type(), dy.element_type(), param_dtype(x, scale, *dbias, s),
      [&](auto xt, auto gt, auto wt) {
        using X = native_t<decltype(xt)>;
        using G = native_t<decltype(gt)>;
        using W = native_t<decltype(wt)>;
        return with_vec<X>(s.hidden, {a.x, a.dy, a.dx, a.scale, a.dscale, a.dbias, a.dres,
                                        a.residual},
                           [&](auto v) {
                             return launch_bwd_vec<X, G, W, decltype(v)::value>(
                                 stream, dev, scratch, a);
                           });
      });
}

}  // namespace
}  // namespace jaxnorm::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_row_norm_fwd, jaxnorm::cuda::row_norm_fwd_impl,
    jaxnorm::bind_row_norm_fwd(
        xla::ffi::Ffi::Bind()
            .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
            .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

// Not command-buffer compatible: it allocates scratch for the partial sums.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_row_norm_bwd, jaxnorm::cuda::row_norm_bwd_impl,
    jaxnorm::bind_row_norm_bwd(
        xla::ffi::Ffi::Bind()
            .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
            .Ctx<xla::ffi::DeviceOrdinal>()
            .Ctx<xla::ffi::ScratchAllocator>()));
