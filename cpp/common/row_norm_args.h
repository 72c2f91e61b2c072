// Argument checks for the row-norm handlers (RMSNorm when `centered` is false,
// LayerNorm when true), shared by the CPU and CUDA handlers so both reject the
// same inconsistent buffers with the same messages.
//
//   row_norm_fwd(x[R,H], scale[H|0], bias[H|0], residual[R,H|0])
//       -> y[R,H] (or [R,0]: statistics only), mean[R|0], rstd[R],
//          new_residual[R,H|0]
//   row_norm_bwd(x[R,H], scale[H|0], mean[R|0], rstd[R|0], dy[R,H], dres[R,H|0],
//                residual[R,H|0])
//       -> dx[R,H], dscale[H|0], dbias[H|0]
//
// A backward without statistics (rstd and mean both [0]) computes them from x
// itself, with the forward's epsilon: the lowering passes none where the
// forward ran only to compute them (its output dead, as under jax.grad).
// Given a residual (and then no statistics), the backward normalizes
// h = x + residual, formed as the forward forms it, so that a forward whose
// outputs are all dead need not run to write h.
//
// With a residual the forward normalizes h = x + residual (rounded to x's
// dtype) and writes h to new_residual, which may alias residual; the backward
// then takes h as x and adds dres, the cotangent of new_residual, to dx.
// zero_centered: the scale is applied as (1 + scale).
#pragma once

#include <cmath>

#include "common/ffi_util.h"

namespace jaxnorm {

struct RowNormShape {
  int64_t rows = 0;
  int64_t hidden = 0;
  bool has_scale = false;
  bool has_bias = false;
  bool has_residual = false;  // forward: residual; backward: dres
  bool has_stats = true;      // backward: false to compute them from x
  bool forms_h = false;       // backward: given residual, it normalizes x + residual
};

inline ffi::Error check_rows(const AnyBuffer& x, RowNormShape* s) {
  auto dims = x.dimensions();
  if (dims.size() != 2) {
    return ffi::Error::InvalidArgument(
        "jaxnorm: x must have rank 2 (rows, hidden), got shape " +
        shape_str(dims));
  }
  s->rows = dims[0];
  s->hidden = dims[1];
  return ffi::Error::Success();
}

inline ffi::Error check_params(const AnyBuffer& scale, const AnyBuffer& bias,
                               RowNormShape* s) {
  JAXNORM_RETURN_IF_ERROR(
      expect_optional(scale, "scale", s->hidden, &s->has_scale));
  JAXNORM_RETURN_IF_ERROR(expect_optional(bias, "bias", s->hidden, &s->has_bias));
  if (s->has_scale && s->has_bias) {
    JAXNORM_RETURN_IF_ERROR(
        expect_dtype(bias, "bias", scale.element_type()));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_stats(const AnyBuffer& x, const AnyBuffer& mean,
                              const AnyBuffer& rstd, bool centered,
                              const RowNormShape& s) {
  if (!s.has_stats) {
    JAXNORM_RETURN_IF_ERROR(expect_dims(rstd, "rstd", {0}));
    return expect_dims(mean, "mean", {0});
  }
  DataType st = stats_dtype(x.element_type());
  JAXNORM_RETURN_IF_ERROR(expect_dims(rstd, "rstd", {s.rows}));
  JAXNORM_RETURN_IF_ERROR(expect_dtype(rstd, "rstd", st));
  JAXNORM_RETURN_IF_ERROR(expect_dims(mean, "mean", {centered ? s.rows : 0}));
  return expect_dtype(mean, "mean", st);
}

// The dtype of scale/bias, or x's when there are none.
inline DataType param_dtype(const AnyBuffer& x, const AnyBuffer& scale,
                            const AnyBuffer& bias, const RowNormShape& s) {
  if (s.has_scale) return scale.element_type();
  if (s.has_bias) return bias.element_type();
  return x.element_type();
}

// An optional (rows, hidden) operand of x's dtype, absent as a (0,) buffer.
inline ffi::Error check_optional_rows(const AnyBuffer& x, const AnyBuffer& buf,
                                      const char* what, const RowNormShape& s,
                                      bool* present) {
  auto dims = buf.dimensions();
  *present = !(dims.size() == 1 && dims[0] == 0);
  if (!*present) return ffi::Error::Success();
  JAXNORM_RETURN_IF_ERROR(expect_dims(buf, what, {s.rows, s.hidden}));
  return expect_dtype(buf, what, x.element_type());
}

inline ffi::Error check_epsilon(double epsilon) {
  if (!(epsilon >= 0.0) || !std::isfinite(epsilon)) {
    return ffi::Error::InvalidArgument(
        "jaxnorm: epsilon must be finite and >= 0, got " +
        std::to_string(epsilon));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_row_norm_fwd(const AnyBuffer& x, const AnyBuffer& scale,
                                     const AnyBuffer& bias,
                                     const AnyBuffer& residual, const AnyBuffer& y,
                                     const AnyBuffer& mean, const AnyBuffer& rstd,
                                     const AnyBuffer& new_residual, double epsilon,
                                     bool centered, RowNormShape* s,
                                     bool* write_y) {
  JAXNORM_RETURN_IF_ERROR(check_rows(x, s));
  JAXNORM_RETURN_IF_ERROR(check_params(scale, bias, s));
  JAXNORM_RETURN_IF_ERROR(
      check_optional_rows(x, residual, "residual", *s, &s->has_residual));
  bool has_new = false;
  JAXNORM_RETURN_IF_ERROR(
      check_optional_rows(x, new_residual, "new_residual", *s, &has_new));
  if (has_new != s->has_residual) {
    return ffi::Error::InvalidArgument(
        "jaxnorm: new_residual must be present exactly when residual is");
  }
  auto ydims = y.dimensions();
  *write_y = !(ydims.size() == 2 && ydims[0] == s->rows && ydims[1] == 0) ||
             s->hidden == 0;
  if (*write_y) JAXNORM_RETURN_IF_ERROR(expect_dims(y, "y", {s->rows, s->hidden}));
  JAXNORM_RETURN_IF_ERROR(check_stats(x, mean, rstd, centered, *s));
  return check_epsilon(epsilon);
}

inline ffi::Error check_row_norm_bwd(const AnyBuffer& x, const AnyBuffer& scale,
                                     const AnyBuffer& mean,
                                     const AnyBuffer& rstd, const AnyBuffer& dy,
                                     const AnyBuffer& dres, const AnyBuffer& residual,
                                     const AnyBuffer& dx, const AnyBuffer& dscale,
                                     const AnyBuffer& dbias, double epsilon,
                                     bool centered, RowNormShape* s) {
  JAXNORM_RETURN_IF_ERROR(check_rows(x, s));
  auto rdims = rstd.dimensions();
  s->has_stats = !(rdims.size() == 1 && rdims[0] == 0 && s->rows != 0);
  // dscale mirrors scale; dbias says whether the forward had a bias.
  JAXNORM_RETURN_IF_ERROR(check_params(scale, dbias, s));
  bool has_dscale = false;
  JAXNORM_RETURN_IF_ERROR(
      expect_optional(dscale, "dscale", s->hidden, &has_dscale));
  if (has_dscale != s->has_scale) {
    return ffi::Error::InvalidArgument(
        "jaxnorm: dscale must be present exactly when scale is");
  }
  if (s->has_scale) {
    JAXNORM_RETURN_IF_ERROR(
        expect_dtype(dscale, "dscale", scale.element_type()));
  }
  JAXNORM_RETURN_IF_ERROR(check_stats(x, mean, rstd, centered, *s));
  JAXNORM_RETURN_IF_ERROR(expect_dims(dy, "dy", {s->rows, s->hidden}));
  JAXNORM_RETURN_IF_ERROR(check_optional_rows(x, dres, "dres", *s, &s->has_residual));
  JAXNORM_RETURN_IF_ERROR(check_optional_rows(x, residual, "residual", *s, &s->forms_h));
  if (s->forms_h && s->has_stats && s->rows != 0) {
    return ffi::Error::InvalidArgument(
        "jaxnorm: a backward given residual takes no mean or rstd: it computes "
        "the statistics of x + residual");
  }
  JAXNORM_RETURN_IF_ERROR(expect_dims(dx, "dx", {s->rows, s->hidden}));
  JAXNORM_RETURN_IF_ERROR(expect_dtype(dx, "dx", x.element_type()));
  return check_epsilon(epsilon);
}

// The FFI signatures, appended to a platform's binding (which may first add
// context such as the CUDA stream).
template <typename B>
auto bind_row_norm_fwd(B binding) {
  return std::move(binding).template Arg<AnyBuffer>()  // x
      .template Arg<AnyBuffer>()            // scale
      .template Arg<AnyBuffer>()            // bias
      .template Arg<AnyBuffer>()            // residual
      .template Ret<AnyBuffer>()            // y
      .template Ret<AnyBuffer>()            // mean
      .template Ret<AnyBuffer>()            // rstd
      .template Ret<AnyBuffer>()            // new_residual
      .template Attr<double>("epsilon")
      .template Attr<bool>("centered")
      .template Attr<bool>("zero_centered");
}

template <typename B>
auto bind_row_norm_bwd(B binding) {
  return std::move(binding).template Arg<AnyBuffer>()  // x
      .template Arg<AnyBuffer>()            // scale
      .template Arg<AnyBuffer>()            // mean
      .template Arg<AnyBuffer>()            // rstd
      .template Arg<AnyBuffer>()            // dy
      .template Arg<AnyBuffer>()            // dres
      .template Arg<AnyBuffer>()            // residual
      .template Ret<AnyBuffer>()            // dx
      .template Ret<AnyBuffer>()            // dscale
      .template Ret<AnyBuffer>()            // dbias
      .template Attr<double>("epsilon")     // with no statistics given
      .template Attr<bool>("centered")
      .template Attr<bool>("zero_centered");
}

}  // namespace jaxnorm
