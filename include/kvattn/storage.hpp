// kvattn/storage.hpp — storage element types (fp32, fp16, bf16) and bulk row conversion.
//
// Types: kvattn::fp32 = float; kvattn::fp16 (IEEE 754 binary16) and kvattn::bf16 (bfloat16),
// 16-bit values with conversions only (kvattn/eigen.hpp converts Eigen::half / Eigen::bfloat16).
// storage_traits<T> gives each one's name, bits and bytes.
//
// convert_row(tag, src, dst, n) converts n elements between any two of them. The tag is an
// instruction set (config.hpp); an overload exists for a tag only where this translation unit is
// compiled for it, and a richer tag falls back to the nearest base (avx512 -> avx2 -> scalar).
// SIMD overloads: fp16 <-> fp32 and bf16 <-> fp32 for avx2 (F16C), avx512 (F, BW, VL) and neon.
// Every other pair goes through the scalar template. convert_row(src, dst, n) uses isa::native.
//
// Contract, the same for every path (scalar element-wise, scalar bulk, every SIMD bulk):
//  - widening (fp16 -> fp32, bf16 -> fp32) is exact;
//  - narrowing (fp32 -> fp16, fp32 -> bf16) rounds to nearest, ties to even; a value that
//    rounds past the largest finite value becomes +-infinity; results below the smallest
//    normal are produced as subnormals and subnormal inputs are read as their values, as
//    IEEE 754 says (in the default floating-point environment: no flush-to-zero or
//    denormals-are-zero; the bf16 paths are integer arithmetic and do not depend on it);
//  - NaN stays NaN with its sign. fp16: the payload is not guaranteed. bf16: a NaN becomes the
//    canonical quiet NaN of its sign (0x7FC0 / 0xFFC0);
//  - between fp16 and bf16 the value goes through fp32 (exact) and is rounded once; converting
//    a type to itself copies the bits;
//  - bulk and element-wise (to_float / from_float) results are identical bit for bit, except
//    for fp16 NaN payloads.
// Rows may be unaligned and of any length (0 included); src and dst must not overlap. Nothing
// allocates or throws, and nothing outside src[0, n) is read or outside dst[0, n) written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "config.hpp"

#if KVATTN_HAS_AVX2 || KVATTN_HAS_AVX512 || defined(__F16C__)
#include <immintrin.h>
#endif
#if KVATTN_HAS_NEON
#include <arm_neon.h>
#endif

namespace kvattn {

using fp32 = float;

namespace detail {
/// fp32 -> IEEE 754 binary16 bits: round to nearest, ties to even, in integers (no dependence
/// on the floating-point environment). Past the largest finite value: +-infinity. A NaN stays a
/// NaN of its sign, made quiet, with the top bits of its payload (as F16C and Arm convert).
constexpr std::uint16_t fp16_bits_from_fp32_bits(std::uint32_t x) noexcept {
  const std::uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: rounds to infinity
  if (a >= 0x38800000u) {                                                   // >= 2^-14: a normal result
    const std::uint32_t r = a - 0x38000000u;                                // exponent bias 127 -> 15
    return static_cast<std::uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  // A subnormal result: k * 2^-24, k = (1.m * 2^(e - 127)) / 2^-24 = mant >> (126 - e), rounded.
  const int shift = 126 - static_cast<int>(a >> 23);  // 14 or more
  if (shift > 24) return static_cast<std::uint16_t>(sign);  // below 2^-25: rounds to zero
  const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u, half = 1u << (shift - 1);
  const std::uint32_t k = mant >> shift, rest = mant & ((half << 1) - 1u);
  return static_cast<std::uint16_t>(sign | (k + (rest > half || (rest == half && (k & 1u)) ? 1u : 0u)));
}
/// IEEE 754 binary16 bits -> fp32 bits (exact; a NaN keeps its sign and payload).
constexpr std::uint32_t fp32_bits_from_fp16_bits(std::uint16_t h) noexcept {
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return sign | 0x7f800000u | (m << 13);
  if (e != 0) return sign | ((e + 112u) << 23) | (m << 13);
  if (m == 0) return sign;
  int shift = 0;  // a subnormal: normalize m * 2^-24
  std::uint32_t n = m;
  while ((n & 0x400u) == 0) n <<= 1, ++shift;
  return sign | ((113u - static_cast<std::uint32_t>(shift)) << 23) | ((n & 0x3ffu) << 13);
}
/// fp32 bits -> bfloat16 bits: round to nearest, ties to even; a NaN becomes 0x7FC0 | sign.
constexpr std::uint16_t bf16_bits_from_fp32_bits(std::uint32_t x) noexcept {
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>(((x >> 16) & 0x8000u) | 0x7fc0u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline std::uint32_t float_bits(float x) noexcept {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline float bits_float(std::uint32_t b) noexcept {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
}  // namespace detail

/// IEEE 754 binary16: 16 bits and nothing else, so an array of fp16 has the layout of an array
/// of _Float16, __half, Eigen::half or ggml_fp16_t (kvattn/eigen.hpp converts Eigen's types).
/// Only conversions, no arithmetic: fp16(x) rounds a float to nearest, ties to even, and
/// static_cast<float>(h) is exact (the contract at the top of this file).
struct fp16 {
  std::uint16_t bits;
  fp16() = default;
  explicit fp16(float x) noexcept : bits(detail::fp16_bits_from_fp32_bits(detail::float_bits(x))) {}
  explicit operator float() const noexcept { return detail::bits_float(detail::fp32_bits_from_fp16_bits(bits)); }
  static constexpr fp16 from_bits(std::uint16_t b) noexcept {
    fp16 h{};
    h.bits = b;
    return h;
  }
};

/// bfloat16 (fp32's top 16 bits), with the same layout promise and conversions as fp16.
struct bf16 {
  std::uint16_t bits;
  bf16() = default;
  explicit bf16(float x) noexcept : bits(detail::bf16_bits_from_fp32_bits(detail::float_bits(x))) {}
  explicit operator float() const noexcept { return detail::bits_float(std::uint32_t{bits} << 16); }
  static constexpr bf16 from_bits(std::uint16_t b) noexcept {
    bf16 h{};
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(fp16) == 2 && sizeof(bf16) == 2 && sizeof(fp32) == 4,
              "kvattn: fp16/bf16 must be 2 bytes and float 4 bytes");
static_assert(std::is_trivially_copyable_v<fp16> && std::is_trivially_copyable_v<bf16> &&
                  std::is_standard_layout_v<fp16> && std::is_standard_layout_v<bf16>,
              "kvattn: fp16/bf16 must be plain 16-bit values");

/// Name, width in bits and size in bytes of a storage element type.
template <class T> struct storage_traits;
template <> struct storage_traits<fp32> {
  static constexpr std::string_view name = "fp32";
  static constexpr int bits = 32;
  static constexpr std::size_t bytes = 4;
};
template <> struct storage_traits<fp16> {
  static constexpr std::string_view name = "fp16";
  static constexpr int bits = 16;
  static constexpr std::size_t bytes = 2;
};
template <> struct storage_traits<bf16> {
  static constexpr std::string_view name = "bf16";
  static constexpr int bits = 16;
  static constexpr std::size_t bytes = 2;
};

/// True for fp32, fp16 and bf16 (unqualified).
template <class T>
inline constexpr bool is_storage_type_v =
    std::is_same_v<T, fp32> || std::is_same_v<T, fp16> || std::is_same_v<T, bf16>;

KVATTN_BEGIN_TARGET_NAMESPACE

/// One element to fp32 (exact). The F16C instruction where this unit is compiled for it.
inline float to_float(fp16 x) noexcept {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  return static_cast<float>(x);
#endif
}
inline float to_float(bf16 x) noexcept { return static_cast<float>(x); }
inline float to_float(float x) noexcept { return x; }

/// One fp32 value to T (round to nearest even; see the contract above).
template <class T> T from_float(float x) noexcept {
  static_assert(is_storage_type_v<T>, "kvattn::from_float: T must be fp32, fp16 or bf16");
  if constexpr (std::is_same_v<T, float>) {
    return x;
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<T, fp16>) {
    // (_mm_cvtps_ph, not the _cvtss_sh macro: clang's expands to a compound literal.)
    return fp16::from_bits(static_cast<std::uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT), 0)));
#endif
  } else {
    return T(x);
  }
}

/// Scalar bulk conversion, every pair: src [n] -> dst [n]. Same type: bit copy.
template <class Src, class Dst>
void convert_row(isa::scalar, const Src* src, Dst* dst, std::size_t n) noexcept {
  static_assert(is_storage_type_v<Src> && is_storage_type_v<Dst>,
                "kvattn::convert_row: element types must be fp32, fp16 or bf16");
  if constexpr (std::is_same_v<Src, Dst>) {
    if (n != 0) std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), n * sizeof(Src));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = from_float<Dst>(to_float(src[i]));
  }
}

#if KVATTN_HAS_AVX2
/// AVX2 + F16C: fp16 [n] -> fp32 [n], 8 per step, scalar tail.
inline void convert_row(isa::avx2, const fp16* src, float* dst, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  convert_row<fp16, float>(isa::scalar{}, src + i, dst + i, n - i);
}

/// AVX2 + F16C: fp32 [n] -> fp16 [n], round to nearest even, 8 per step, scalar tail.
inline void convert_row(isa::avx2, const float* src, fp16* dst, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  convert_row<float, fp16>(isa::scalar{}, src + i, dst + i, n - i);
}

/// AVX2: bf16 [n] -> fp32 [n] (zero-extend, shift left 16), 8 per step, scalar tail.
inline void convert_row(isa::avx2, const bf16* src, float* dst, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  convert_row<bf16, float>(isa::scalar{}, src + i, dst + i, n - i);
}

/// AVX2: fp32 [n] -> bf16 [n], round to nearest even in integers, NaN -> 0x7FC0 | sign,
/// 8 per step, scalar tail.
inline void convert_row(isa::avx2, const float* src, bf16* dst, std::size_t n) noexcept {
  const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7fff);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i sign16 = _mm256_set1_epi32(0x8000), qnan = _mm256_set1_epi32(0x7fc0);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i hi = _mm256_srli_epi32(b, 16);
    const __m256i bias = _mm256_add_epi32(half_ulp, _mm256_and_si256(hi, one));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
    // |b| > inf as signed integers (both below 2^31) is exactly "b is a NaN".
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, abs_mask), inf);
    const __m256i nan16 = _mm256_or_si256(_mm256_and_si256(hi, sign16), qnan);
    const __m256i r = _mm256_blendv_epi8(rounded, nan16, is_nan);  // 8 x u32, each <= 0xffff
    // Narrow within 128-bit halves so that no lane interleaving happens: [r0..r3, r4..r7].
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  convert_row<float, bf16>(isa::scalar{}, src + i, dst + i, n - i);
}
#endif  // KVATTN_HAS_AVX2

#if KVATTN_HAS_AVX512
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the unused merge source, which
// -Wmaybe-uninitialized reports once they are inlined here (a false positive, GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/// AVX-512: fp16 [n] -> fp32 [n], 16 per step, masked tail.
inline void convert_row(isa::avx512, const fp16* src, float* dst, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
  }
}

/// AVX-512: fp32 [n] -> fp16 [n], round to nearest even, 16 per step, masked tail.
inline void convert_row(isa::avx512, const float* src, fp16* dst, std::size_t n) noexcept {
  const __mmask16 all = 0xffff;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // The maskz form with an all-ones mask: GCC's -O0 macro for the plain form trips -Wsign-conversion.
    const __m256i h = _mm512_maskz_cvtps_ph(all, _mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m256i h = _mm512_maskz_cvtps_ph(m, _mm512_maskz_loadu_ps(m, src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_mask_storeu_epi16(dst + i, m, h);
  }
}

/// AVX-512: bf16 [n] -> fp32 [n] (zero-extend, shift left 16), 16 per step, masked tail.
inline void convert_row(isa::avx512, const bf16* src, float* dst, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src + i));
    _mm512_mask_storeu_ps(dst + i, m, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
}

/// AVX-512: fp32 [n] -> bf16 [n], round to nearest even in integers, NaN -> 0x7FC0 | sign,
/// 16 per step, masked tail. (Not vcvtneps2bf16: it flushes subnormals.)
inline void convert_row(isa::avx512, const float* src, bf16* dst, std::size_t n) noexcept {
  const auto to_bf16_bits = [](__m512i b) noexcept {  // 16 x fp32 bits -> 16 x u32, each <= 0xffff
    const __m512i hi = _mm512_srli_epi32(b, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
    const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                                      _mm512_set1_epi32(0x7f800000));
    const __m512i nan16 = _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
    return _mm512_mask_blend_epi32(is_nan, rounded, nan16);
  };
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = to_bf16_bits(_mm512_castps_si512(_mm512_loadu_ps(src + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_cvtepi32_storeu_epi16(dst + i, m, to_bf16_bits(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + i))));
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // KVATTN_HAS_AVX512

#if KVATTN_HAS_NEON
/// NEON: fp16 [n] -> fp32 [n] (vcvt_f32_f16), 8 per step, scalar tail.
inline void convert_row(isa::neon, const fp16* src, float* dst, std::size_t n) noexcept {
  const auto* s = reinterpret_cast<const std::uint16_t*>(src);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint16x8_t h = vld1q_u16(s + i);
    vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))));
    vst1q_f32(dst + i + 4, vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h))));
  }
  convert_row<fp16, float>(isa::scalar{}, src + i, dst + i, n - i);
}

/// NEON: fp32 [n] -> fp16 [n] (vcvt_f16_f32, the FPCR rounding mode: nearest even by
/// default), 8 per step, scalar tail.
inline void convert_row(isa::neon, const float* src, fp16* dst, std::size_t n) noexcept {
  auto* d = reinterpret_cast<std::uint16_t*>(dst);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint16x4_t lo = vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i)));
    const uint16x4_t hi = vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i + 4)));
    vst1q_u16(d + i, vcombine_u16(lo, hi));
  }
  convert_row<float, fp16>(isa::scalar{}, src + i, dst + i, n - i);
}

/// NEON: bf16 [n] -> fp32 [n] (zero-extend, shift left 16), 8 per step, scalar tail.
inline void convert_row(isa::neon, const bf16* src, float* dst, std::size_t n) noexcept {
  const auto* s = reinterpret_cast<const std::uint16_t*>(src);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint16x8_t h = vld1q_u16(s + i);
    vst1q_f32(dst + i, vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vget_low_u16(h)), 16)));
    vst1q_f32(dst + i + 4, vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vget_high_u16(h)), 16)));
  }
  convert_row<bf16, float>(isa::scalar{}, src + i, dst + i, n - i);
}

/// NEON: fp32 [n] -> bf16 [n], round to nearest even in integers, NaN -> 0x7FC0 | sign,
/// 4 per step, scalar tail.
inline void convert_row(isa::neon, const float* src, bf16* dst, std::size_t n) noexcept {
  auto* d = reinterpret_cast<std::uint16_t*>(dst);
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint32x4_t b = vreinterpretq_u32_f32(vld1q_f32(src + i));
    const uint32x4_t hi = vshrq_n_u32(b, 16);
    const uint32x4_t bias = vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(hi, vdupq_n_u32(1)));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(b, bias), 16);
    const uint32x4_t is_nan = vcgtq_u32(vandq_u32(b, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    const uint32x4_t nan16 = vorrq_u32(vandq_u32(hi, vdupq_n_u32(0x8000)), vdupq_n_u32(0x7fc0));
    vst1_u16(d + i, vmovn_u32(vbslq_u32(is_nan, nan16, rounded)));
  }
  convert_row<float, bf16>(isa::scalar{}, src + i, dst + i, n - i);
}
#endif  // KVATTN_HAS_NEON

/// Bulk conversion with the best instruction set of this translation unit: src [n] -> dst [n].
template <class Src, class Dst>
void convert_row(const Src* src, Dst* dst, std::size_t n) noexcept {
  convert_row(isa::native{}, src, dst, n);
}

KVATTN_END_TARGET_NAMESPACE

}  // namespace kvattn
