// The row norms' launches for one dtype of x: the dispatch on the other
// dtypes and the vector width, the plans, and the kernels they launch
// (row_norm_block.cuh: a row a block; row_norm_bwd_roles.cuh: the backward of
// 16-bit rows of 4097-8192 elements that compute their statistics, on sm_90;
// row_norm_kernels.cuh: the others). row_norm_fwd_for<X> and
// row_norm_bwd_for<X> are each compiled in a unit of their own, one for each
// X and direction (CMakeLists.txt writes the eight), so that nvcc compiles
// them in parallel; the handlers in row_norm.cu only call them.
#pragma once

#include "cuda/row_norm_block.cuh"
#include "cuda/row_norm_bwd_roles.cuh"

namespace jaxnorm::cuda {

// y_type, w_type: the output's and the parameters' dtypes (x's, or float32 for 16-bit x).
template <typename X>
ffi::Error row_norm_fwd_for(cudaStream_t stream, const DeviceInfo& dev, DataType y_type,
                            DataType w_type, const FwdArgs& a);

// g_type, w_type: dy's and the parameters' dtypes (x's, or float32 for 16-bit x).
// residual: given (row_norm_args.h), the backward normalizes x + residual;
// else null.
template <typename X>
ffi::Error row_norm_bwd_for(cudaStream_t stream, const DeviceInfo& dev,
                            ffi::ScratchAllocator& scratch, DataType g_type,
                            DataType w_type, BwdArgs a, const void* residual);

// The explicit instantiation of each (SPEC empty), in the unit written for
// it; every other unit declares them extern, which keeps it from compiling
// their kernels.
#define JAXNORM_ROW_NORM_FWD_FOR(SPEC, X)                                      \
  SPEC template ffi::Error row_norm_fwd_for<X>(cudaStream_t, const DeviceInfo&, \
                                               DataType, DataType, const FwdArgs&);
#define JAXNORM_ROW_NORM_BWD_FOR(SPEC, X)                                      \
  SPEC template ffi::Error row_norm_bwd_for<X>(cudaStream_t, const DeviceInfo&, \
                                               ffi::ScratchAllocator&, DataType, \
                                               DataType, BwdArgs, const void*);
#define JAXNORM_ROW_NORM_EACH_X(M, SPEC) \
  M(SPEC, float) M(SPEC, double) M(SPEC, __nv_bfloat16) M(SPEC, __half)

JAXNORM_ROW_NORM_EACH_X(JAXNORM_ROW_NORM_FWD_FOR, extern)
JAXNORM_ROW_NORM_EACH_X(JAXNORM_ROW_NORM_BWD_FOR, extern)

namespace row_norm_detail {

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
// a.x) point there, and residual is null.
template <typename X, typename W>
ffi::Error stats_into_scratch(cudaStream_t stream, const DeviceInfo& dev,
                              ffi::ScratchAllocator& scratch, BwdArgs& a,
                              const void*& residual) {
  using A = acc_t<X>;
  if (a.rstd != nullptr) return ffi::Error::Success();
  const size_t stats_bytes = (2 * size_t(a.rows) * sizeof(A) + 15) / 16 * 16;
  const size_t h_bytes = residual ? size_t(a.rows) * size_t(a.hidden) * sizeof(X) : 0;
  auto mem = scratch.Allocate(stats_bytes + h_bytes, 16);
  if (!mem.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxnorm: cannot allocate scratch for row_norm_bwd's statistics");
  }
  A* rstd = static_cast<A*>(*mem);
  A* mean = rstd + a.rows;
  FwdArgs f{a.x, nullptr, nullptr, nullptr, mean, rstd, a.rows, a.hidden, 0, 0,
            a.epsilon, a.centered, false, false, /*write_y=*/false, false};
  if (residual != nullptr) {
    f.residual = residual;
    f.new_residual = static_cast<char*>(*mem) + stats_bytes;
  }
  // Through the forward's own unit (row_norm_fwd_for), so that this unit
  // compiles no forward kernels.
  JAXNORM_RETURN_IF_ERROR(row_norm_fwd_for<X>(stream, dev, dtype_of<X>(), dtype_of<W>(), f));
  a.mean = mean;
  a.rstd = rstd;
  if (residual != nullptr) a.x = f.new_residual;
  residual = nullptr;
  return ffi::Error::Success();
}

template <typename X, typename G, typename W, int VEC>
ffi::Error launch_bwd_vec(cudaStream_t stream, const DeviceInfo& dev,
                          ffi::ScratchAllocator& scratch, BwdArgs a,
                          const void* residual) {
  if constexpr (VEC > 1) {
    const FewBwdPlan few = plan_bwd_few<X, VEC>(a.rows, a.hidden, dev);
    if (few.blocks > 0) {  // computes missing statistics itself
      JAXNORM_RETURN_IF_ERROR(scratch_for_partials(scratch, few.partial_bytes, a));
      return cuda_error(launch_bwd_few<X, G, W, VEC>(stream, few, a, residual),
                        "row_norm_bwd");
    }
  }
  if (residual != nullptr) {  // the plans below read h
    JAXNORM_RETURN_IF_ERROR((stats_into_scratch<X, W>(stream, dev, scratch, a, residual)));
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
    JAXNORM_RETURN_IF_ERROR((stats_into_scratch<X, W>(stream, dev, scratch, a, residual)));
  }
  auto l = plan_bwd<X, G, W, VEC>(p, a.hidden, a.has_scale, regions, plain, dev);
  lean_for_layer_norm(l, a.centered, dev);
  JAXNORM_RETURN_IF_ERROR(scratch_for_partials(scratch, l.partial_bytes(a.hidden), a));
  return cuda_error(launch_bwd<X, G, W, VEC>(stream, l, a), "row_norm_bwd");
}

}  // namespace row_norm_detail

template <typename X>
ffi::Error row_norm_fwd_for(cudaStream_t stream, const DeviceInfo& dev, DataType y_type,
                            DataType w_type, const FwdArgs& a) {
  return dispatch_y_w_types<dtype_of<X>()>(y_type, w_type, [&](auto yt, auto wt) {
    using Y = native_t<decltype(yt)>;
    using W = native_t<decltype(wt)>;
    return with_vec_or_one<X, 16 / sizeof(X)>(
        a.hidden, {a.x, a.y, a.scale, a.bias, a.residual, a.new_residual}, [&](auto v) {
          return row_norm_detail::launch_fwd_vec<X, Y, W, decltype(v)::value>(stream, dev, a);
        });
  });
}

template <typename X>
ffi::Error row_norm_bwd_for(cudaStream_t stream, const DeviceInfo& dev,
                            ffi::ScratchAllocator& scratch, DataType g_type,
                            DataType w_type, BwdArgs a, const void* residual) {
  return dispatch_y_w_types<dtype_of<X>()>(g_type, w_type, [&](auto gt, auto wt) {
    using G = native_t<decltype(gt)>;
    using W = native_t<decltype(wt)>;
    return with_vec_or_one<X, 16 / sizeof(X)>(
        a.hidden, {a.x, a.dy, a.dx, a.scale, a.dscale, a.dbias, a.dres, residual},
        [&](auto v) {
          return row_norm_detail::launch_bwd_vec<X, G, W, decltype(v)::value>(
              stream, dev, scratch, a, residual);
        });
  });
}

}  // namespace jaxnorm::cuda
