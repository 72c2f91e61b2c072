// The FFI targets jaxnorm exports, one X(name) per target. Each platform
// defines a handler symbol `<platform>_<name>` for every entry; module.cc turns
// the list into the capsules that jaxnorm/_ffi.py registers with XLA.
#pragma once

#define JAXNORM_FFI_TARGETS(X) \
  X(row_norm_fwd)              \
  X(row_norm_bwd)
