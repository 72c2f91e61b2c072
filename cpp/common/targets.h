// The FFI targets jaxnorm exports, one X(name) per target. The CPU defines a
// handler symbol `cpu_<name>` for every entry of JAXNORM_FFI_TARGETS, CUDA
// `cuda_<name>` for those of JAXNORM_CUDA_FFI_TARGETS; module.cc turns the
// lists into the capsules that jaxnorm/_ffi.py registers with XLA. A target
// without a handler on a platform lowers to jax.numpy there.
#pragma once

#define JAXNORM_CUDA_FFI_TARGETS(X) \
  X(row_norm_fwd)                   \
  X(row_norm_bwd)                   \
  X(channel_norm_fwd)               \
  X(channel_norm_bwd)               \
  X(local_response_norm_fwd)        \
  X(local_response_norm_bwd)        \
  X(channel_softmax_fwd)            \
  X(channel_softmax_bwd)

#define JAXNORM_FFI_TARGETS(X) \
  X(row_norm_fwd)              \
  X(row_norm_bwd)              \
  X(channel_norm_fwd)          \
  X(channel_norm_bwd)          \
  X(local_response_norm_fwd)   \
  X(local_response_norm_bwd)   \
  X(channel_softmax_fwd)       \
  X(channel_softmax_bwd)
