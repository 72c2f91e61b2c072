// The activations the channel norms fuse into their output: y = act(z), z =
// xhat * scale + bias, and its derivative for the backward (dy' = dy act'(z)).
// Host and device code (the CPU handlers and the CUDA kernels) share them.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define JAXNORM_HOST_DEVICE __host__ __device__
#else
#define JAXNORM_HOST_DEVICE
#endif

namespace jaxnorm {

// The values of the FFI attribute `activation` (jaxnorm/channel_norm.py).
enum class Activation : int32_t { kNone = 0, kSilu = 1, kRelu = 2 };

inline bool valid_activation(int32_t a) { return a >= 0 && a <= int32_t(Activation::kRelu); }

template <typename A>
JAXNORM_HOST_DEVICE inline A sigmoid(A z) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) {
    // The MUFU exp2 and reciprocal, within 2 ulp of float32. expf and an IEEE
    // division took ~30 instructions an element, which made the elementwise
    // passes with SiLU compute-bound (benchmarks/NOTES.md v48, v65). For
    // z < -87, 1 + exp(-z) is past 2^126 and the quotient 0 (the true one is
    // below 2^-125); exp(-z) = inf gives 0 too.
    return __fdividef(1.0f, 1.0f + __expf(-z));
  }
#endif
  using std::exp;
  return A(1) / (A(1) + exp(-z));
}

template <typename A>
JAXNORM_HOST_DEVICE inline A activate(Activation act, A z) {
  switch (act) {
    case Activation::kSilu: return z * sigmoid(z);
    case Activation::kRelu: return z < A(0) ? A(0) : z;  // NaN stays NaN
    default: return z;
  }
}

// dy' = dy act'(z), the cotangent of act's input; ReLU's passes dy where z >
// 0 and is 0 elsewhere (as jax.nn.relu's: 0 at z = 0 and at NaN, whatever dy).
template <typename A>
JAXNORM_HOST_DEVICE inline A activation_backward(Activation act, A dy, A z) {
  switch (act) {
    case Activation::kSilu: {
      const A s = sigmoid(z);
      return dy * (s * (A(1) + z * (A(1) - s)));
    }
    case Activation::kRelu: return z > A(0) ? dy : A(0);
    default: return dy;
  }
}

}  // namespace jaxnorm
