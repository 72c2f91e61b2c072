// Helpers shared by every handler on every platform: shape checks that turn
// inconsistent buffers into ffi::Error, and the dtype dispatch.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxnorm {

namespace ffi = xla::ffi;
using ffi::AnyBuffer;
using ffi::DataType;

inline const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::F16: return "float16";
    case DataType::BF16: return "bfloat16";
    case DataType::F32: return "float32";
    case DataType::F64: return "float64";
    default: return "an unsupported dtype";
  }
}

inline std::string shape_str(AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return s + (dims.size() == 1 ? ",)" : ")");
}

// Error unless `buf` has exactly the dimensions `want`.
inline ffi::Error expect_dims(const AnyBuffer& buf, const char* what,
                              std::initializer_list<int64_t> want) {
  auto dims = buf.dimensions();
  bool ok = dims.size() == want.size();
  size_t i = 0;
  for (int64_t d : want) ok = ok && dims[i++] == d;
  if (ok) return ffi::Error::Success();
  std::string expected = "(";
  i = 0;
  for (int64_t d : want) expected += (i++ ? ", " : "") + std::to_string(d);
  expected += want.size() == 1 ? ",)" : ")";
  return ffi::Error::InvalidArgument(std::string("jaxnorm: ") + what +
                                     " has shape " + shape_str(dims) +
                                     ", expected " + expected);
}

inline ffi::Error expect_dtype(const AnyBuffer& buf, const char* what,
                               DataType want) {
  if (buf.element_type() == want) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("jaxnorm: ") + what + " has dtype " +
      dtype_name(buf.element_type()) + ", expected " + dtype_name(want));
}

// Optional operands (scale, bias, and the outputs that belong to them) travel
// as zero-size buffers when absent, since FFI signatures have fixed arity.
inline ffi::Error expect_optional(const AnyBuffer& buf, const char* what,
                                  int64_t n, bool* present) {
  *present = buf.element_count() != 0;
  if (!*present && n != 0) return ffi::Error::Success();
  return expect_dims(buf, what, {n});
}

#define JAXNORM_RETURN_IF_ERROR(expr)             \
  do {                                            \
    ::xla::ffi::Error jaxnorm_err_ = (expr);      \
    if (jaxnorm_err_.failure()) return jaxnorm_err_; \
  } while (0)

template <DataType T>
using DT = std::integral_constant<DataType, T>;

// Calls f(DT<X>{}) for x in {f32, bf16, f16, f64}.
template <typename F>
ffi::Error dispatch_x_type(DataType x, F&& f) {
  switch (x) {
    case DataType::F32: return f(DT<DataType::F32>{});
    case DataType::BF16: return f(DT<DataType::BF16>{});
    case DataType::F16: return f(DT<DataType::F16>{});
    case DataType::F64: return f(DT<DataType::F64>{});
    default:
      return ffi::Error::InvalidArgument(
          std::string("jaxnorm: x has dtype ") + dtype_name(x) +
          ", expected float16, bfloat16, float32 or float64");
  }
}

// Calls f(DT<Y>{}, DT<W>{}) for the output y and the parameters w of a
// norm whose x is X: each in x's dtype, or in f32 where x is 16-bit. Python
// casts every other combination to one of these (float64 x computes in
// float64 throughout), which keeps the number of kernel instantiations small.
template <DataType X, typename F>
ffi::Error dispatch_y_w_types(DataType y, DataType w, F&& f) {
  constexpr bool kWide = X == DataType::BF16 || X == DataType::F16;
  auto with_y = [&](auto yt) -> ffi::Error {
    if (w == X) return f(yt, DT<X>{});
    if constexpr (kWide) {
      if (w == DataType::F32) return f(yt, DT<DataType::F32>{});
    }
    return ffi::Error::InvalidArgument(
        std::string("jaxnorm: parameters of dtype ") + dtype_name(w) +
        " are not supported with x of dtype " + dtype_name(X));
  };
  if (y == X) return with_y(DT<X>{});
  if constexpr (kWide) {
    if (y == DataType::F32) return with_y(DT<DataType::F32>{});
  }
  return ffi::Error::InvalidArgument(
      std::string("jaxnorm: output dtype ") + dtype_name(y) +
      " is not supported with x of dtype " + dtype_name(X));
}

// Calls f(DT<X>{}, DT<Y>{}, DT<W>{}): both dispatches above.
template <typename F>
ffi::Error dispatch_row_types(DataType x, DataType y, DataType w, F&& f) {
  return dispatch_x_type(x, [&](auto xt) {
    return dispatch_y_w_types<decltype(xt)::value>(
        y, w, [&](auto yt, auto wt) { return f(xt, yt, wt); });
  });
}

// Statistics are float32, or float64 when x is float64.
inline DataType stats_dtype(DataType x) {
  return x == DataType::F64 ? DataType::F64 : DataType::F32;
}

}  // namespace jaxnorm
