// kvattn/format.hpp — KV formats: how a cache stores a row of keys or values.
//
// A row is one token's head_dim values of one KV head. A format is a type that the cache and
// the kernels are templated on; format_traits<F> says what it is:
//   unit        the type a page is an array of (one element of fp32 / fp16 / bf16; one byte
//               of the 8-bit formats): every offset of PageLayout counts units;
//   bits        bits per value, scales excluded;
//   values_per_unit  values one unit holds (2 for the 4-bit format, 1 for the others): a row
//               is head_dim / values_per_unit units (PageLayout::row_units);
//   row_scale   true when every row carries one fp32 scale, kept in the page's scale block
//               (PageLayout::scale_offset), not beside the row: each head's run of values stays
//               contiguous and starts on a cache line;
//   block_scale true when every block of `block` values of a row carries its own scale and
//               minimum (BlockScale, 4 bytes), kept in the page's scale block as a row scale is;
//   layer_scale true when one key scale and one value scale serve a whole layer (the cache holds
//               them: PagedKvCache's KvScales); the page then holds values only;
//   latent_block  for the MLA formats, the latent values per scale (0 for the others, which hold
//               GQA-family pages; fp32, fp16 and bf16 hold either);
//   quantize_row(src, dst, n) -> scale (row_scale), quantize_row(src, dst, n, scale)
//               (layer_scale), quantize_row(src, dst, n, scales) (block_scale), and
//               dequantize: the way in and the way out.
//
// Formats:
//   fp32, fp16, bf16   plain elements (storage.hpp), no scale: a value is its element.
//   int8_row           int8, symmetric, one fp32 scale per (token, KV head):
//                        scale = max_i |x_i| / 127,  q_i = round(x_i / scale) in [-127, 127],
//                        x_i ≈ q_i · scale   (round: to nearest, ties to even).
//                      A row of zeros has scale 0 (and reads as zeros). A row holding a NaN or
//                      an infinity stores scale = NaN and q = 0: every value of it reads as NaN,
//                      so a non-finite input is never hidden.
//   fp8_e4m3_row       fp8 e4m3 (OCP "e4m3fn": 1 sign, 4 exponent bits of bias 7, 3 mantissa
//                      bits; largest 448, no infinity), one fp32 scale per (token, KV head):
//                        s = max_i |x_i| / 448,  q_i = e4m3(x_i / s)  (to nearest, ties to even),
//                        x_i ≈ q_i · s.
//                      The encoder never rounds past 448: a value beyond it (only rounding can
//                      make one) saturates to ±448, and the NaN codes (0x7F, 0xFF) are never
//                      written. A row of zeros and a row holding NaN or an infinity are stored
//                      as int8_row's are: scale 0, and scale NaN with q = 0 (every value NaN).
//                      Kernels convert a byte b to the fp16 whose bits are ((b & 0x80) << 8) |
//                      ((b & 0x7F) << 7): e4m3's exponent and mantissa fields placed in fp16's,
//                      which is exactly q · 2^-8 (subnormals included: F16C's and NEON's fp16
//                      conversions, one instruction); the page's scale block therefore holds
//                      s · 2^8, and to_float(fp8_e4m3_row) gives q · 2^-8 (both exact).
//   fp8_e4m3_layer     the same bytes with one key scale and one value scale per layer, fixed when
//                      the cache is made, as a checkpoint gives them (k_scale, v_scale; 1 when
//                      it gives none): q_i = e4m3(x_i · (1 / s)), x_i ≈ q_i · s. A value beyond
//                      448 · s saturates to ±448 · s. A NaN or an infinity cannot be carried by
//                      a byte the kernels read as a number, so writing one is refused (the write
//                      throws kvattn::invalid_argument naming the row, and writes nothing).
//                      The kernels fold the scales out of the loop: the key scale (times 2^8)
//                      into the softmax scale, the value scale (times 2^8) into the output.
//   q4_block           4-bit unsigned codes in blocks of 32 values, each block with an fp16 scale d
//                      and an fp16 minimum m (BlockScale), 5 bits per value:
//                        m = fp16(min_i x_i),  d = fp16((max_i x_i - m) / 15),
//                        q_i = round((x_i - m) / d) clamped to [0, 15]  (0 when d = 0),
//                        x_i ≈ q_i · d + m   (computed as one fused multiply-add),
//                      over the block's 32 values (round: to nearest, ties to even; fp16(): to
//                      nearest even). A byte holds two values of a row: the even column in its low
//                      four bits, the odd one in its high four. Values beyond fp16's range
//                      (±65504) saturate to it. A constant block of an fp16 number has d = 0 and
//                      reads back exactly (of another number, within fp16's rounding of it). A row
//                      holding a NaN or an infinity stores d = m = NaN in every block and q = 0:
//                      every value of it reads as NaN. head_dim must be a multiple of 32, up to
//                      kMaxBlockScaledDim (1024).
//                      Why an offset grid (q4_1-like) and not a symmetric one (q4_0-like, q · d,
//                      q in [-8, 7]): on Gaussian rows its attention error is lower (values
//                      alone and keys and values alike, README); on keys with outlier channels it
//                      is worse (its grid has no zero: the small values of a block holding an
//                      outlier all move together), and hadamard<q4_block> spreads the outliers.
//   fp8_e4m3_latent    MLA rows: the latent in fp8 e4m3 in blocks of 128 values with one fp32
//                      scale each, then the rotary key in bf16; a token's row in a page is
//                        [latent_dim codes][latent_dim / 128 fp32 scales][rope_dim bf16]
//                      (656 bytes at 512 + 64: FlashMLA's fp8 token layout), per block
//                        s = max_i |x_i| / 448,  q_i = e4m3(x_i / s),  x_i ≈ q_i · s
//                      (the scale is s itself, as FlashMLA's layout holds it). A block of zeros
//                      has s = 0; a block holding a NaN or an infinity stores s = NaN and q = 0
//                      (its values read as NaN); the rotary key is rounded to bf16 as a bf16
//                      cache rounds it. latent_dim must be a multiple of 128.
//   int8_latent        the same row with int8 latent codes: s = max_i |x_i| / 127,
//                      q_i = round(x_i / s) in [-127, 127] (int8_row's rule, per block of 128).
//   hadamard<F>        F (int8_row, fp8_e4m3_row or q4_block) of the row rotated by the orthonormal Walsh–Hadamard transform
//                      H (H = Hᵀ = H⁻¹, head_dim a power of two, up to kMaxRotatedDim): keys and
//                      values are stored as Q(H·x); decode and prefill rotate the query by the
//                      same H, so scores are unchanged in exact arithmetic ((Hq)·(Hk) = q·k), and
//                      rotate the output back (Σ p Hv = H Σ p v); read() rotates back. A few
//                      outlier channels (real key caches have them, 20-50x the rest) then no
//                      longer set the whole row's scale: their energy is spread over the row.
//
// Kernels read a row through simd::Vec::load (simd.hpp: the stored values as floats, to_float
// below) and apply the row's scale once per token: to the score of its key and to the
// probability of its value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
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

/// fp8 e4m3 with one fp32 scale per row (see the top of this file): the byte of one value of a
/// row; the row's scale (times 2^8) is in its page's scale block.
struct fp8_e4m3_row {
  std::uint8_t bits = 0;
};
static_assert(sizeof(fp8_e4m3_row) == 1, "kvattn: fp8_e4m3_row must be one byte");

/// fp8 e4m3 with one key scale and one value scale per layer (see the top of this file): the byte
/// of one value; the scales are the cache's (PagedKvCache::scales). It reads as fp8_e4m3_row's
/// byte does (the same loads, q · 2^-8).
struct fp8_e4m3_layer : fp8_e4m3_row {};
static_assert(sizeof(fp8_e4m3_layer) == 1, "kvattn: fp8_e4m3_layer must be one byte");

/// 4-bit values in blocks of 32 with an fp16 scale and minimum (see the top of this file): one
/// byte of a row, two values (the even column in the low four bits, the odd one in the high
/// four); the blocks' scales are in the page's scale block.
struct q4_block {
  std::uint8_t bits = 0;
};
static_assert(sizeof(q4_block) == 1, "kvattn: q4_block must be one byte");

/// MLA rows with an fp8 e4m3 latent in blocks of 128, each with an fp32 scale, and a bf16 rotary
/// key (see the top of this file): one byte of a row.
struct fp8_e4m3_latent : fp8_e4m3_row {};
static_assert(sizeof(fp8_e4m3_latent) == 1, "kvattn: fp8_e4m3_latent must be one byte");

/// MLA rows with an int8 latent in blocks of 128, each with an fp32 scale, and a bf16 rotary key
/// (see the top of this file): one byte of a row.
struct int8_latent : int8_row {};
static_assert(sizeof(int8_latent) == 1, "kvattn: int8_latent must be one byte");

/// One block's scale and minimum (q4_block): a value is q · d + m.
struct BlockScale {
  fp16 d, m;
};
static_assert(sizeof(BlockScale) == 4, "kvattn: BlockScale must be 4 bytes");

/// The e4m3 code nearest |x| (ties to the even code), for 0 <= |x|; codes past 0x7E (448)
/// saturate to it, and NaN gives 0x7E too (callers never pass one). Sign: bit 7, from x's.
inline std::uint8_t fp8_e4m3_encode(float x) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  u &= 0x7FFFFFFFu;
  float a;
  std::memcpy(&a, &u, sizeof a);
  std::uint32_t code;
  if (!(a < 464.0f)) {  // at or past the midpoint of 448 and the next step (480), or NaN
    code = 0x7E;
  } else if (a < 0.015625f) {  // below the smallest normal, 2^-6: subnormal steps of 2^-9
    code = static_cast<std::uint32_t>(std::nearbyint(a * 512.0f));  // 8 is the smallest normal's code
  } else {  // round fp32's 23 mantissa bits to 3, to nearest even, and rebias 127 -> 7
    u += 0x7FFFFu + ((u >> 20) & 1u);
    code = (u >> 20) - ((127u - 7u) << 3);
    code = std::min(code, 0x7Eu);
  }
  return static_cast<std::uint8_t>(sign | code);
}

/// The value of an e4m3 code times 2^-8, exactly: what the SIMD loads compute by reading the
/// code's fields as fp16's.
inline float fp8_e4m3_decode_scaled(std::uint8_t b) noexcept {
  float v;
  if (b & 0x78u) {  // normal: exponent e - 7 - 8, rebiased to fp32's 127; mantissa in the top bits
    const std::uint32_t u = ((b & 0x80u) << 24) | (((b & 0x7Fu) << 20) + (112u << 23));
    std::memcpy(&v, &u, sizeof v);
  } else {  // subnormal: m · 2^-9 · 2^-8
    v = static_cast<float>(b & 0x7u) * 0x1p-17f;
    if (b & 0x80u) v = -v;
  }
  return v;
}

/// F stored rotated by the Walsh–Hadamard transform (see the top of this file): one value of a row.
template <class F> struct hadamard : F {};

/// The largest head size of a rotated format.
inline constexpr int kMaxRotatedDim = 1024;
/// The largest head size of a format with block scales (q4_block).
inline constexpr int kMaxBlockScaledDim = 1024;

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
  static constexpr bool layer_scale = false;
  static constexpr bool rotated = false;
  static constexpr bool block_scale = false;
  static constexpr int values_per_unit = 1, block = 0, latent_block = 0;
};
template <> struct format_traits<fp32> : plain_format_traits<fp32> {};
template <> struct format_traits<fp16> : plain_format_traits<fp16> {};
template <> struct format_traits<bf16> : plain_format_traits<bf16> {};

/// The quantization of the 8-bit formats: s = max_i |src_i| / kmax, dst_i = encode(src_i / s);
/// returns s. A row of zeros gets s = 0 and a row holding NaN or an infinity s = NaN, both with
/// every dst_i = U{} (zero bits).
template <class Src, class U, class Encode>
float quantize_by_row_max(const Src* src, U* dst, std::size_t n, float kmax, Encode encode) noexcept {
  float amax = 0.0f;
  bool finite = true;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = to_float(src[i]);
    finite = finite && std::isfinite(x);
    amax = std::max(amax, std::fabs(x));
  }
  if (!finite || amax == 0.0f) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = U{};
    return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = kmax / amax;
  for (std::size_t i = 0; i < n; ++i) dst[i] = encode(to_float(src[i]) * inv);
  return amax / kmax;
}

template <> struct format_traits<int8_row> {
  using unit = int8_row;
  static constexpr std::string_view name = "int8";
  static constexpr std::string_view rotated_name = "int8_hadamard";
  static constexpr int bits = 8;
  static constexpr bool row_scale = true;
  static constexpr bool layer_scale = false;
  static constexpr bool rotated = false;
  static constexpr bool block_scale = false;
  static constexpr int values_per_unit = 1, block = 0, latent_block = 0;
  static constexpr float kMax = 127.0f;

  /// src [n] (fp32, fp16 or bf16) -> dst [n]; returns the row's scale (0 for a row of zeros, NaN
  /// for a row holding a non-finite value).
  template <class Src> static float quantize_row(const Src* src, int8_row* dst, std::size_t n) noexcept {
    return quantize_by_row_max(src, dst, n, kMax, [](float x) {
      return int8_row{static_cast<std::int8_t>(std::min(kMax, std::max(-kMax, std::nearbyint(x))))};
    });
  }
  static float dequantize(int8_row x, float scale) noexcept { return static_cast<float>(x.q) * scale; }
};

template <> struct format_traits<fp8_e4m3_row> {
  using unit = fp8_e4m3_row;
  static constexpr std::string_view name = "fp8";
  static constexpr std::string_view rotated_name = "fp8_hadamard";
  static constexpr int bits = 8;
  static constexpr bool row_scale = true;
  static constexpr bool layer_scale = false;
  static constexpr bool rotated = false;
  static constexpr bool block_scale = false;
  static constexpr int values_per_unit = 1, block = 0, latent_block = 0;
  static constexpr float kMax = 448.0f;

  /// src [n] (fp32, fp16 or bf16) -> dst [n]; returns the row's scale times 2^8 (0 for a row of
  /// zeros, NaN for a row holding a non-finite value).
  template <class Src> static float quantize_row(const Src* src, fp8_e4m3_row* dst, std::size_t n) noexcept {
    return quantize_by_row_max(src, dst, n, kMax, [](float x) { return fp8_e4m3_row{fp8_e4m3_encode(x)}; }) * 256.0f;
  }
  /// `scale` as the page holds it (s · 2^8).
  static float dequantize(fp8_e4m3_row x, float scale) noexcept { return fp8_e4m3_decode_scaled(x.bits) * scale; }
};

template <> struct format_traits<fp8_e4m3_layer> {
  using unit = fp8_e4m3_layer;
  static constexpr std::string_view name = "fp8_layer";
  static constexpr int bits = 8;
  static constexpr bool row_scale = false;
  static constexpr bool layer_scale = true;
  static constexpr bool rotated = false;
  static constexpr bool block_scale = false;
  static constexpr int values_per_unit = 1, block = 0, latent_block = 0;

  /// Whether src [n] can be stored: every value finite (a byte cannot carry NaN or ±infinity to
  /// the kernels). Returns the index of the first value that is not, or n.
  template <class Src> static std::size_t first_non_finite(const Src* src, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i)
      if (!std::isfinite(to_float(src[i]))) return i;
    return n;
  }
  /// src [n] (fp32, fp16 or bf16, every value finite) -> dst [n], q_i = e4m3(src_i · (1 / scale)),
  /// saturating at ±448; `scale` is the layer's (valid_scale).
  template <class Src> static void quantize_row(const Src* src, fp8_e4m3_layer* dst, std::size_t n, float scale) noexcept {
    const float inv = 1.0f / scale;
    for (std::size_t i = 0; i < n; ++i) dst[i].bits = fp8_e4m3_encode(to_float(src[i]) * inv);
  }
  static float dequantize(fp8_e4m3_layer x, float scale) noexcept { return fp8_e4m3_decode_scaled(x.bits) * 256.0f * scale; }
  /// What a kernel multiplies the loaded values (q · 2^-8) by: the layer's scale times 2^8.
  static float kernel_scale(float scale) noexcept { return scale * 256.0f; }
  /// The scales a layer may have: from 2^-126 (the smallest normal float: 1 / scale stays
  /// finite) to 2^100 (448 · scale · 2^8 stays finite), NaN excluded.
  static constexpr float kMinScale = 0x1p-126f, kMaxScale = 0x1p100f;
  static bool valid_scale(float scale) noexcept { return scale >= kMinScale && scale <= kMaxScale; }
};

template <> struct format_traits<q4_block> {
  using unit = q4_block;
  static constexpr std::string_view name = "q4";
  static constexpr std::string_view rotated_name = "q4_hadamard";
  static constexpr int bits = 4;
  static constexpr bool row_scale = false;
  static constexpr bool layer_scale = false;
  static constexpr bool rotated = false;
  static constexpr bool block_scale = true;
  static constexpr int values_per_unit = 2, block = 32, latent_block = 0;
  static constexpr float kLevels = 15.0f, kFp16Max = 65504.0f;

  /// src [n] (fp32, fp16 or bf16; n a multiple of 32) -> dst [n / 2] and scales [n / 32].
  template <class Src> static void quantize_row(const Src* src, q4_block* dst, std::size_t n, BlockScale* scales) noexcept {
    bool finite = true;
    for (std::size_t i = 0; i < n; ++i) finite = finite && std::isfinite(to_float(src[i]));
    if (!finite) {
      const fp16 nan(std::numeric_limits<float>::quiet_NaN());
      for (std::size_t i = 0; i < n / 2; ++i) dst[i] = q4_block{};
      for (std::size_t b = 0; b < n / block; ++b) scales[b] = BlockScale{nan, nan};
      return;
    }
    for (std::size_t b0 = 0; b0 < n; b0 += block) {
      float x[block];
      float lo = kFp16Max, hi = -kFp16Max;
      for (int i = 0; i < block; ++i) {
        x[i] = std::min(kFp16Max, std::max(-kFp16Max, to_float(src[b0 + static_cast<std::size_t>(i)])));
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
      }
      const fp16 m(lo), d((hi - static_cast<float>(m)) / kLevels);
      const float mf = static_cast<float>(m), df = static_cast<float>(d);
      scales[b0 / block] = BlockScale{d, m};
      for (int i = 0; i < block; i += 2) {
        const auto code = [&](float v) {
          return df > 0.0f ? static_cast<unsigned>(std::min(kLevels, std::max(0.0f, std::nearbyint((v - mf) / df)))) : 0u;
        };
        dst[(b0 + static_cast<std::size_t>(i)) / 2].bits = static_cast<std::uint8_t>(code(x[i]) | (code(x[i + 1]) << 4));
      }
    }
  }
  /// Value `column` of a row: its code in the row's unit column / 2, read with its block's scale.
  static float dequantize(const q4_block* row, std::size_t column, const BlockScale* scales) noexcept {
    return value(code(row, column), scales[column / block]);
  }
  /// The code of value `column` of a row, from 0 to 15.
  static unsigned code(const q4_block* row, std::size_t column) noexcept {
    return (row[column / 2].bits >> (column % 2 * 4)) & 0xFu;
  }
  /// q · d + m, as one fused multiply-add (as the kernels compute it).
  static float value(unsigned q, BlockScale s) noexcept {
    return std::fma(static_cast<float>(q), static_cast<float>(s.d), static_cast<float>(s.m));
  }
};

/// The MLA formats (see the top of this file): Code is the latent's value type as the kernels
/// load it (int8_row's or fp8_e4m3_row's byte), quantized by format_traits<Code>'s rule per block.
template <class F, class Code> struct latent_format_traits {
  using unit = F;
  using code = Code;
  static constexpr int bits = 8;
  static constexpr bool row_scale = false;
  static constexpr bool layer_scale = false;
  static constexpr bool rotated = false;
  static constexpr bool block_scale = false;
  static constexpr int values_per_unit = 1, block = 0;
  static constexpr int latent_block = 128;
  /// Bytes of one token's row: codes, scales, rotary key.
  static constexpr std::int64_t row_bytes(int latent_dim, int rope_dim) noexcept {
    return std::int64_t{latent_dim} + std::int64_t{latent_dim} / latent_block * 4 + std::int64_t{rope_dim} * 2;
  }
  /// The row's latent codes [n] (n a multiple of 128) and scales [n / 128] from src [n] (fp32,
  /// fp16 or bf16): format_traits<Code>'s quantization, per block.
  template <class Src> static void quantize_latent(const Src* src, F* codes, float* scales, std::size_t n) noexcept {
    for (std::size_t b = 0; b < n; b += latent_block) {
      const float s = format_traits<Code>::quantize_row(src + b, static_cast<Code*>(codes + b), latent_block);
      scales[b / latent_block] = s * (std::is_same_v<Code, fp8_e4m3_row> ? 1.0f / 256.0f : 1.0f);
    }
  }
  /// Latent value `column` of a row whose scales are `scales`.
  static float dequantize(const F* codes, std::size_t column, const float* scales) noexcept {
    return to_float(static_cast<const Code&>(codes[column])) * kernel_scale(scales[column / latent_block]);
  }
  /// What a kernel multiplies the loaded codes (simd::Vec::load of Code: q, or q · 2^-8 for fp8) by.
  static float kernel_scale(float s) noexcept { return std::is_same_v<Code, fp8_e4m3_row> ? s * 256.0f : s; }
};

template <> struct format_traits<fp8_e4m3_latent> : latent_format_traits<fp8_e4m3_latent, fp8_e4m3_row> {
  static constexpr std::string_view name = "fp8_latent";
};
template <> struct format_traits<int8_latent> : latent_format_traits<int8_latent, int8_row> {
  static constexpr std::string_view name = "int8_latent";
};

/// F's quantization of the row rotated by the Walsh–Hadamard transform (see the top of this file).
template <class F> struct format_traits<hadamard<F>> {
  using unit = hadamard<F>;
  static constexpr std::string_view name = format_traits<F>::rotated_name;
  static constexpr int bits = format_traits<F>::bits;
  static constexpr bool row_scale = format_traits<F>::row_scale;
  static constexpr bool layer_scale = false;
  static constexpr bool rotated = true;
  static constexpr bool block_scale = format_traits<F>::block_scale;
  static constexpr int values_per_unit = format_traits<F>::values_per_unit, block = format_traits<F>::block;
  static constexpr int latent_block = 0;

  /// src [n] -> H src / sqrt(n) -> F's quantization (its scales the same way: `scales...` is
  /// F's BlockScale array where F has block scales); n a power of two <= kMaxRotatedDim.
  template <class Src, class... Scales>
  static auto quantize_row(const Src* src, hadamard<F>* dst, std::size_t n, Scales... scales) noexcept {
    float x[kMaxRotatedDim];
    for (std::size_t i = 0; i < n; ++i) x[i] = to_float(src[i]);
    hadamard_rotate(x, static_cast<int>(n));
    return format_traits<F>::quantize_row(x, static_cast<F*>(dst), n, scales...);
  }
  /// One value in the rotated basis (the row is rotated back after: hadamard_rotate).
  template <class... A> static float dequantize(A... a) noexcept { return format_traits<F>::dequantize(a...); }
};

/// True for the types a cache can be made of: fp32, fp16, bf16 and the formats above.
template <class F>
inline constexpr bool is_kv_format_v = is_storage_type_v<F> || std::is_same_v<F, int8_row> || std::is_same_v<F, hadamard<int8_row>> ||
                                       std::is_same_v<F, fp8_e4m3_row> || std::is_same_v<F, hadamard<fp8_e4m3_row>> ||
                                       std::is_same_v<F, fp8_e4m3_layer> || std::is_same_v<F, q4_block> ||
                                       std::is_same_v<F, hadamard<q4_block>> || std::is_same_v<F, fp8_e4m3_latent> ||
                                       std::is_same_v<F, int8_latent>;

/// True for the formats whose values are int8 with a scale per row: int8_row, hadamard<int8_row>.
template <class F>
inline constexpr bool is_int8_format_v = std::is_same_v<F, int8_row> || std::is_same_v<F, hadamard<int8_row>>;

/// The value of one stored int8 (its row's scale not applied), for simd::Vec's loads.
inline float to_float(int8_row x) noexcept { return static_cast<float>(x.q); }
/// The value of one stored e4m3 byte times 2^-8 (its row's scale, which carries the 2^8, not
/// applied), for simd::Vec's loads.
inline float to_float(fp8_e4m3_row x) noexcept { return fp8_e4m3_decode_scaled(x.bits); }

}  // namespace kvattn
