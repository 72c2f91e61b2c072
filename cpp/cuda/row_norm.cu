// FFI handlers for the row norms on CUDA: argument checks and the dispatch on
// x's dtype. The rest, from the other dtypes to the kernels, is in
// row_norm_launch.cuh, compiled in units of their own.
#include "common/row_norm_args.h"
#include "cuda/row_norm_launch.cuh"

namespace jaxnorm::cuda {
namespace {

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
  return dispatch_x_type(x.element_type(), [&](auto xt) {
    return row_norm_fwd_for<native_t<decltype(xt)>>(stream, dev, ydt,
                                                    param_dtype(x, scale, bias, s), a);
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
  const void* h_residual = s.forms_h ? residual.untyped_data() : nullptr;
  if (!s.has_stats) a.mean = a.rstd = nullptr;
  a.epsilon = epsilon;
  a.scale_offset = zero_centered ? 1.0f : 0.0f;
  const DeviceInfo& dev = device_info(device);
  return dispatch_x_type(x.element_type(), [&](auto xt) {
    return row_norm_bwd_for<native_t<decltype(xt)>>(
        stream, dev, scratch, dy.element_type(), param_dtype(x, scale, *dbias, s), a,
        h_residual);
  });
}

}  // namespace
}  // namespace jaxnorm::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_row_norm_fwd, jaxnorm::cuda::row_norm_fwd_impl,
    jaxnorm::bind_row_norm_fwd(jaxnorm::cuda::cuda_bind()),
    {xla::ffi::Traits::kCmdBufferCompatible});

// Not command-buffer compatible: it allocates scratch for the partial sums.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    cuda_row_norm_bwd, jaxnorm::cuda::row_norm_bwd_impl,
    jaxnorm::bind_row_norm_bwd(jaxnorm::cuda::cuda_bind().Ctx<xla::ffi::ScratchAllocator>()));
