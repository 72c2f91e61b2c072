// Host-side storage types for the 16-bit floats and their conversions to and
// from float (round to nearest even, NaN kept NaN), plus the DataType -> C++
// type map the CPU handlers dispatch through.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/ffi_util.h"

namespace jaxnorm::cpu {

struct bfloat16 { uint16_t bits; };
struct float16 { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(bfloat16 v) { return bits_float(uint32_t(v.bits) << 16); }

inline float to_float(float16 v) {
  uint32_t sign = uint32_t(v.bits & 0x8000) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1f;
  uint32_t mant = v.bits & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
    float mag = float(mant) * 5.9604644775390625e-08f;
    return bits_float(sign | float_bits(mag));
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

template <typename T> T from_float(float f);

template <> inline bfloat16 from_float<bfloat16>(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1);
  return {uint16_t(u >> 16)};
}

template <> inline float16 from_float<float16>(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  u &= 0x7fffffffu;
  if (u >= 0x47800000u) {  // |f| >= 65536, Inf or NaN
    return {uint16_t(sign | (u > 0x7f800000u ? 0x7e00 : 0x7c00))};
  }
  if (u < 0x38800000u) {  // below the smallest normal half: let float add round
    const uint32_t magic = 126u << 23;  // 0.5: aligns the half ulp (2^-24)
    uint32_t r = float_bits(bits_float(u) + bits_float(magic)) - magic;
    return {uint16_t(sign | r)};
  }
  uint32_t odd = (u >> 13) & 1;
  u += (uint32_t(15 - 127) << 23) + 0xfffu + odd;  // rebias and round
  return {uint16_t(sign | (u >> 13))};  // carries into Inf past 65504
}

template <> inline float from_float<float>(float f) { return f; }

inline float to_float(float v) { return v; }
inline double to_double(double v) { return v; }

template <DataType T> struct Native;
template <> struct Native<DataType::F32> { using type = float; };
template <> struct Native<DataType::F64> { using type = double; };
template <> struct Native<DataType::BF16> { using type = bfloat16; };
template <> struct Native<DataType::F16> { using type = float16; };

template <typename D> using native_t = typename Native<D::value>::type;

// Accumulation type: double for double, float for everything else.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using acc_t = typename AccOf<T>::type;

template <typename A, typename T> inline A load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, double>) return A(p[i]);
  else return A(to_float(p[i]));
}

template <typename T, typename A> inline void store(T* p, int64_t i, A v) {
  if constexpr (std::is_same_v<T, double>) p[i] = double(v);
  else if constexpr (std::is_same_v<T, float>) p[i] = float(v);
  else p[i] = from_float<T>(float(v));
}

}  // namespace jaxnorm::cpu
