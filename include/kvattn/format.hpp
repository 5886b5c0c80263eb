// kvattn/format.hpp — KV formats: how a cache stores a row of keys or values.
//
// A row is one token's head_dim values of one KV head. A format is a type that the cache and
// the kernels are templated on; format_traits<F> says what it is:
//   unit        the type a page is an array of (one element of fp32 / fp16 / bf16; one byte
//               of the 8-bit formats): every offset of PageLayout counts units;
//   bits        bits per value, scales excluded;
//   row_scale   true when every row carries one fp32 scale, kept in the page's scale block
//               (PageLayout::scale_offset), not beside the row: each head's run of values stays
//               contiguous and starts on a cache line;
//   quantize_row(src, dst, n) -> scale and dequantize(x, scale): the way in and the way out.
//
// Formats:
//   fp32, fp16, bf16   plain elements (storage.hpp), no scale: a value is its element.
//   int8_row           int8, symmetric, one fp32 scale per (token, KV head):
//                        scale = max_i |x_i| / 127,  q_i = round(x_i / scale) in [-127, 127],
//                        x_i ≈ q_i · scale   (round: to nearest, ties to even).
//                      A row of zeros has scale 0 (and reads as zeros). A row holding a NaN or
//                      an infinity stores scale = NaN and q = 0: every value of it reads as NaN,
//                      so a non-finite input is never hidden.
//   hadamard<int8_row> int8_row of the row rotated by the orthonormal Walsh–Hadamard transform
//                      H (H = Hᵀ = H⁻¹, head_dim a power of two, up to kMaxRotatedDim): keys and
//                      values are stored as Q(H·x); decode and prefill rotate the query by the
//                      same H, so scores are unchanged in exact arithmetic ((Hq)·(Hk) = q·k), and
//                      rotate the output back (Σ p Hv = H Σ p v); read() rotates back. A few
//                      outlier channels (real key caches have them, 20-50x the rest) then no
//                      longer set the whole row's scale: their energy is spread over the row.
//
// Kernels read a row through simd::Vec::load (simd.hpp: the int8 values as floats) and apply the
// row's scale once per token: to the score of its key and to the probability of its value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include "config.hpp"
#include "storage.hpp"

namespace kvattn {

/// int8 with one fp32 scale per row (see the top of this file). One value of a row; the row's
/// scale is in its page's scale block.
struct int8_row {
  std::int8_t q = 0;
};
static_assert(sizeof(int8_row) == 1, "kvattn: int8_row must be one byte");

/// F stored rotated by the Walsh–Hadamard transform (see the top of this file): one value of a row.
template <class F> struct hadamard : F {};

/// The largest head size of a rotated format.
inline constexpr int kMaxRotatedDim = 1024;

/// x [n] <- H x / sqrt(n): the orthonormal Walsh–Hadamard transform, its own inverse; n a power
/// of two. In place, n · log2(n) additions and n multiplications.
inline void hadamard_rotate(float* x, int n) noexcept {
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

template <class F> struct format_traits;

/// fp32, fp16 and bf16: a value is its element; no scale.
template <class T> struct plain_format_traits {
  using unit = T;
  static constexpr std::string_view name = storage_traits<T>::name;
  static constexpr int bits = storage_traits<T>::bits;
  static constexpr bool row_scale = false;
  static constexpr bool rotated = false;
};
template <> struct format_traits<fp32> : plain_format_traits<fp32> {};
template <> struct format_traits<fp16> : plain_format_traits<fp16> {};
template <> struct format_traits<bf16> : plain_format_traits<bf16> {};

template <> struct format_traits<int8_row> {
  using unit = int8_row;
  static constexpr std::string_view name = "int8";
  static constexpr int bits = 8;
  static constexpr bool row_scale = true;
  static constexpr bool rotated = false;
  static constexpr float kMax = 127.0f;

  /// src [n] (fp32, fp16 or bf16) -> dst [n]; returns the row's scale (0 for a row of zeros, NaN
  /// for a row holding a non-finite value).
  template <class Src> static float quantize_row(const Src* src, int8_row* dst, std::size_t n) noexcept {
    float amax = 0.0f;
    bool finite = true;
    for (std::size_t i = 0; i < n; ++i) {
      const float x = to_float(src[i]);
      finite = finite && std::isfinite(x);
      amax = std::max(amax, std::fabs(x));
    }
    if (!finite || amax == 0.0f) {
      for (std::size_t i = 0; i < n; ++i) dst[i].q = 0;
      return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    }
    const float inv = kMax / amax;
    for (std::size_t i = 0; i < n; ++i) {
      const float r = std::nearbyint(to_float(src[i]) * inv);
      dst[i].q = static_cast<std::int8_t>(std::min(kMax, std::max(-kMax, r)));
    }
    return amax / kMax;
  }
  static float dequantize(int8_row x, float scale) noexcept { return static_cast<float>(x.q) * scale; }
};

template <> struct format_traits<hadamard<int8_row>> {
  using unit = hadamard<int8_row>;
  static constexpr std::string_view name = "int8_hadamard";
  static constexpr int bits = 8;
  static constexpr bool row_scale = true;
  static constexpr bool rotated = true;

  /// src [n] -> H src / sqrt(n) -> int8_row's quantization; n a power of two <= kMaxRotatedDim.
  template <class Src> static float quantize_row(const Src* src, hadamard<int8_row>* dst, std::size_t n) noexcept {
    float x[kMaxRotatedDim];
    for (std::size_t i = 0; i < n; ++i) x[i] = to_float(src[i]);
    hadamard_rotate(x, static_cast<int>(n));
    return format_traits<int8_row>::quantize_row(x, static_cast<int8_row*>(dst), n);
  }
  /// One value in the rotated basis (the row is rotated back after: hadamard_rotate).
  static float dequantize(int8_row x, float scale) noexcept { return format_traits<int8_row>::dequantize(x, scale); }
};

/// True for the types a cache can be made of: fp32, fp16, bf16 and the formats above.
template <class F>
inline constexpr bool is_kv_format_v = is_storage_type_v<F> || std::is_same_v<F, int8_row> || std::is_same_v<F, hadamard<int8_row>>;

/// True for the formats whose values are int8 with a scale per row: int8_row, hadamard<int8_row>.
template <class F>
inline constexpr bool is_int8_format_v = std::is_same_v<F, int8_row> || std::is_same_v<F, hadamard<int8_row>>;

/// The value of one stored int8 (its row's scale not applied), for simd::Vec's loads.
inline float to_float(int8_row x) noexcept { return static_cast<float>(x.q); }

}  // namespace kvattn
