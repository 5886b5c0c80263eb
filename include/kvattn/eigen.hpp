// kvattn/eigen.hpp — kvattn's 16-bit types and Eigen's: values and buffers.
//
// kvattn::fp16 and Eigen::half are both IEEE 754 binary16, kvattn::bf16 and Eigen::bfloat16 both
// bfloat16, each 16 bits and nothing else (checked below). to_eigen / from_eigen convert one
// value without changing a bit; as_kvattn / as_eigen view a buffer of one as a buffer of the
// other, so that rows held as Eigen::half can be appended to a cache or read from one in place.
// With mla.hpp (which includes this one), the only kvattn header that includes Eigen; the
// kernels' headers do not.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__NVCC__)
// nvcc warns (20012) that Eigen's defaulted constructors carry __host__ __device__; harmless,
// and it would stop a CUDA translation unit built with warnings as errors.
#pragma nv_diagnostic push
#pragma nv_diag_suppress 20012
#endif
#include <Eigen/Core>
#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif

#include "storage.hpp"

namespace kvattn {

static_assert(sizeof(Eigen::half) == sizeof(fp16) && sizeof(Eigen::bfloat16) == sizeof(bf16) &&
                  std::is_trivially_copyable_v<Eigen::half> && std::is_trivially_copyable_v<Eigen::bfloat16>,
              "kvattn/eigen.hpp: Eigen's 16-bit types must be plain 16-bit values");

/// Eigen's value to kvattn's, and back, bit for bit.
inline fp16 from_eigen(Eigen::half x) noexcept {
  std::uint16_t b;
  std::memcpy(&b, &x, sizeof b);
  return fp16::from_bits(b);
}
inline bf16 from_eigen(Eigen::bfloat16 x) noexcept {
  std::uint16_t b;
  std::memcpy(&b, &x, sizeof b);
  return bf16::from_bits(b);
}
inline Eigen::half to_eigen(fp16 x) noexcept {
  Eigen::half h;
  std::memcpy(static_cast<void*>(&h), &x.bits, sizeof h);
  return h;
}
inline Eigen::bfloat16 to_eigen(bf16 x) noexcept {
  Eigen::bfloat16 h;
  std::memcpy(static_cast<void*>(&h), &x.bits, sizeof h);
  return h;
}

/// A buffer of Eigen's type seen as kvattn's (the same bytes), and back.
inline fp16* as_kvattn(Eigen::half* p) noexcept { return reinterpret_cast<fp16*>(p); }
inline const fp16* as_kvattn(const Eigen::half* p) noexcept { return reinterpret_cast<const fp16*>(p); }
inline bf16* as_kvattn(Eigen::bfloat16* p) noexcept { return reinterpret_cast<bf16*>(p); }
inline const bf16* as_kvattn(const Eigen::bfloat16* p) noexcept { return reinterpret_cast<const bf16*>(p); }
inline Eigen::half* as_eigen(fp16* p) noexcept { return reinterpret_cast<Eigen::half*>(p); }
inline const Eigen::half* as_eigen(const fp16* p) noexcept { return reinterpret_cast<const Eigen::half*>(p); }
inline Eigen::bfloat16* as_eigen(bf16* p) noexcept { return reinterpret_cast<Eigen::bfloat16*>(p); }
inline const Eigen::bfloat16* as_eigen(const bf16* p) noexcept { return reinterpret_cast<const Eigen::bfloat16*>(p); }
/// fp32 is float on both sides: the same pointer, so that code generic over the storage type
/// can call as_kvattn / as_eigen for every one.
inline float* as_kvattn(float* p) noexcept { return p; }
inline const float* as_kvattn(const float* p) noexcept { return p; }
inline float* as_eigen(float* p) noexcept { return p; }
inline const float* as_eigen(const float* p) noexcept { return p; }

}  // namespace kvattn
