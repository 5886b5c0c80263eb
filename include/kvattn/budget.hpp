// kvattn/budget.hpp — how many bytes a KV cache holds, and how many tokens fit in memory.
//
// Elements cached per token per layer (DESIGN.md):
//   MHA, GQA, MQA   2 · kv_heads · head_dim        (a key and a value per KV head)
//   MLA             latent_dim + rope_dim          (one latent and one rotary key, all heads)
// Bytes are counted one of two ways:
//  - a uniform width (ElementBits): bytes multiply by bits per element / 8, a sequence by layers
//    and tokens, a batch by its sequences. Widths may be fractional (4.5 bits: 4-bit values plus
//    a scale per 32), for formats the cache does not have; byte counts of widths that do not
//    fill whole bytes round up once, at the level asked for (the cache as one packed stream),
//    never per element;
//  - a KV format of the cache (KvFormat: fp32, fp16, bf16, int8, int8_hadamard, fp8,
//    fp8_hadamard, fp8_layer, q4, q4_hadamard, fp8_latent, int8_latent; format.hpp),
//    exactly: its values plus its scales, one per row for the 8-bit GQA formats, one per block
//    of 32 values of a row for the 4-bit ones (a row: head_dim values), and one per block of
//    128 latent values for the MLA formats (fp8_latent, int8_latent: their rotary key in bf16),
//      MHA, GQA, MQA   2 · kv_heads · (head_dim · bits / 8 + scale_bytes
//                                      + head_dim / block · block_scale_bytes)
//      MLA             latent_dim · bits / 8 + latent_dim / latent_block · latent_scale_bytes
//                        + rope_dim · rope_bits / 8
//    (head_dim · bits / 8 is whole: a 4-bit format's head_dim is a multiple of its block). An
//    MLA row is (latent_dim + rope_dim) · bits / 8 in fp32, fp16 and bf16, and
//    latent_dim + latent_dim / 128 · 4 + rope_dim · 2 in fp8_latent and int8_latent (656 bytes
//    at 512 + 64); the GQA formats with scales or rotation hold no MLA model, and the MLA
//    formats no GQA-family one. For the capacity plan, pages are counted as PageLayout lays them
//    out, padding included.
//
// Everything but parsing and the design comparison is constexpr: a configuration can be
// checked by static_assert. Integer arithmetic is exact and checked: a count that does not fit
// in 64 bits is an error, never a wrapped number.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"
#include "memory.hpp"
#include "model.hpp"
#include "shape.hpp"

namespace kvattn {

namespace detail {
constexpr std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a)
    raise<invalid_argument>(concat("size overflow: ", a, " * ", b, " does not fit in 64 bits"));
  return a * b;
}
constexpr std::uint64_t checked_add(std::uint64_t a, std::uint64_t b) {
  if (b > std::numeric_limits<std::uint64_t>::max() - a)
    raise<invalid_argument>(concat("size overflow: ", a, " + ", b, " does not fit in 64 bits"));
  return a + b;
}
constexpr std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) noexcept { return a / b + (a % b != 0); }
}  // namespace detail

/// Bits per element as an exact fraction: 16, 8, 6, 4.5 (= 9/2), 4.25 (= 17/4).
class ElementBits {
 public:
  constexpr ElementBits(unsigned bits = 16) : num_(bits), den_(1) {  // NOLINT: 16 reads as a width
    if (bits == 0) raise<invalid_argument>("bits per element must be positive, got 0");
  }
  constexpr ElementBits(std::uint32_t num, std::uint32_t den) : num_(num), den_(den) {
    if (num == 0 || den == 0)
      raise<invalid_argument>(detail::concat("bits per element ", num, "/", den, " must be positive"));
    const std::uint32_t g = std::gcd(num_, den_);
    num_ /= g;
    den_ /= g;
  }

  /// Parses a positive decimal: "16", "4.5", "6.25". Throws kvattn::invalid_argument otherwise.
  static ElementBits parse(std::string_view text) {
    const auto bad = [&] {
      raise<invalid_argument>("bits per element '" + std::string(text) + "': expected a positive decimal such as 16 or 4.5");
    };
    std::uint64_t num = 0, den = 1;
    bool digits = false, point = false;
    for (char c : text) {
      if (c == '.' && !point) {
        point = true;
      } else if (c >= '0' && c <= '9') {
        digits = true;
        num = num * 10 + static_cast<std::uint64_t>(c - '0');
        if (point) den *= 10;
        if (num > 1'000'000 || den > 1'000'000) bad();
      } else {
        bad();
      }
    }
    if (!digits || num == 0) bad();
    return ElementBits(static_cast<std::uint32_t>(num), static_cast<std::uint32_t>(den));
  }

  constexpr std::uint32_t numerator() const noexcept { return num_; }
  constexpr std::uint32_t denominator() const noexcept { return den_; }
  constexpr double value() const noexcept { return static_cast<double>(num_) / den_; }

  /// Bytes that `elements` elements fill, rounded up to a whole byte.
  constexpr std::uint64_t bytes_for(std::uint64_t elements) const {
    return detail::ceil_div(detail::checked_mul(elements, num_), std::uint64_t{8} * den_);
  }
  /// "16", "4.5", "17/3" (a fraction when it has no short decimal form).
  std::string to_string() const {
    std::uint64_t scale = 1;
    while (scale < 1'000'000 && (scale * num_) % den_ != 0) scale *= 10;
    if ((scale * num_) % den_ != 0) return detail::concat(num_, "/", den_);
    std::string digits = std::to_string(scale * num_ / den_);
    std::size_t decimals = 0;
    for (std::uint64_t s = scale; s > 1; s /= 10) ++decimals;
    if (decimals == 0) return digits;
    if (digits.size() <= decimals) digits.insert(0, decimals + 1 - digits.size(), '0');
    digits.insert(digits.size() - decimals, ".");
    return digits;
  }

  friend constexpr bool operator==(ElementBits a, ElementBits b) noexcept {
    return a.num_ == b.num_ && a.den_ == b.den_;
  }
  friend constexpr bool operator!=(ElementBits a, ElementBits b) noexcept { return !(a == b); }

 private:
  std::uint32_t num_;
  std::uint32_t den_;
};

// ---------------------------------------------------------------------------------------------
// KV formats: what a cache of each element type (format.hpp) holds, to the byte.

template <class F> struct format_traits;  // format.hpp: name, bits, values_per_unit, row_scale, block_scale, block, layer_scale, rotated, latent_block

/// A KV format as the arithmetic sees it: `bits` per value (4, or whole bytes: 8, 16, 32 or
/// 64), its scales, and whether rows are rotated (head_dim then a power of two up to
/// kMaxRotatedDim). A row is one token's head_dim values of one KV head. Its scales are
/// `scale_bytes` per row (0: none), and/or `block_scale_bytes` per block of `block` values of a
/// row (Blocks; 0, 0: none; the cache's: a BlockScale, an fp16 scale and an fp16 minimum, 4
/// bytes per 32 values), both kept in the page's scale block; or one key and one value scale per
/// layer (layer_scale: kept by the cache, not in its pages: no bytes). Values narrower than a
/// byte (4 bits: two to a byte) come in blocks of whole bytes, and a cache of such a format
/// holds head sizes that are a multiple of its block, so a row's values fill whole bytes. An MLA
/// format (Latent) quantizes an MLA row's latent in blocks of `latent_block` values, each with
/// `latent_scale_bytes` of scale kept in the row after the latent, and stores the rotary key at
/// `rope_bits` per value. The shipped formats are kv_formats::fp32, fp16, bf16, int8,
/// int8_hadamard, fp8, fp8_hadamard, fp8_layer, q4, q4_hadamard, fp8_latent and int8_latent;
/// KvFormat::of<F>() reads format_traits<F> (format.hpp must then be included), KvFormat::parse
/// finds one by name.
///
/// A format with scales (per row, per block or per layer), or a rotated one, holds GQA-family
/// caches only (its scales and its rotation are per KV head): a cache of it cannot hold an MLA
/// model. An MLA format holds MLA caches only, of a latent_dim that is a multiple of its
/// latent block. fp32, fp16 and bf16 hold either (holds(), check()).
class KvFormat {
 public:
  /// The largest head_dim of a rotated format (format.hpp's kMaxRotatedDim, which it equals).
  static constexpr int kMaxRotatedDim = 1024;
  /// Bytes of one block's scales in the cache (format.hpp's BlockScale: an fp16 scale and an
  /// fp16 minimum, whose size it equals).
  static constexpr int kBlockScaleBytes = 4;
  /// The largest head_dim of a format with block scales (format.hpp's kMaxBlockScaledDim).
  static constexpr int kMaxBlockScaledDim = 1024;
  /// Bytes of one latent block's scale in an MLA format's row (format.hpp: an fp32).
  static constexpr int kLatentScaleBytes = 4;
  /// Bits of one rotary-key value in an MLA format's row (format.hpp: a bf16).
  static constexpr int kLatentRopeBits = 16;

  /// Scales per block of a row: `scale_bytes` for every `values` values; {0, 0}: no blocks.
  struct Blocks {
    int values;
    int scale_bytes;
  };
  /// An MLA format's row: `scale_bytes` of scale for every `block` latent values (`bits` each),
  /// and a rotary key of `rope_bits` per value.
  struct Latent {
    int block;
    int scale_bytes;
    int rope_bits;
  };

  constexpr KvFormat(std::string_view name, int bits, int scale_bytes = 0, bool rotated = false, bool layer_scale = false,
                     Blocks blocks = Blocks{0, 0})
      : name_(name),
        bits_(bits),
        scale_bytes_(scale_bytes),
        rotated_(rotated),
        layer_scale_(layer_scale),
        block_(blocks.values),
        block_scale_bytes_(blocks.scale_bytes),
        latent_block_(0),
        latent_scale_bytes_(0),
        rope_bits_(bits) {
    if (bits != 4 && bits != 8 && bits != 16 && bits != 32 && bits != 64)
      raise<invalid_argument>(detail::concat("format '", name, "': bits=", bits, ": a value must be 4 bits, or 1, 2, 4 or 8 whole bytes"));
    if (scale_bytes < 0)
      raise<invalid_argument>(detail::concat("format '", name, "': scale_bytes=", scale_bytes, ": must not be negative"));
    if (blocks.values < 0 || blocks.scale_bytes < 0 || (blocks.values == 0) != (blocks.scale_bytes == 0))
      raise<invalid_argument>(detail::concat("format '", name, "': blocks of ", blocks.values, " values with ", blocks.scale_bytes,
                                             " scale bytes each: both must be positive (or both 0: no blocks)"));
    if (static_cast<long long>(blocks.values) * bits % 8 != 0)
      raise<invalid_argument>(detail::concat("format '", name, "': blocks of ", blocks.values, " values of ", bits,
                                             " bits: a block's values must fill whole bytes"));
    if (bits < 8 && blocks.values == 0)
      raise<invalid_argument>(detail::concat("format '", name, "': bits=", bits,
                                             ": values narrower than a byte come in blocks of whole bytes, each with its scales"));
  }
  /// A format with scales per block of a row: KvFormat("q4", 4, Blocks{32, 4}).
  constexpr KvFormat(std::string_view name, int bits, Blocks blocks, bool rotated = false)
      : KvFormat(name, bits, 0, rotated, false, blocks) {}
  /// An MLA format: KvFormat("fp8_latent", 8, Latent{128, 4, 16}).
  constexpr KvFormat(std::string_view name, int bits, Latent latent) : KvFormat(name, bits) {
    if (latent.block <= 0 || latent.scale_bytes < 0)
      raise<invalid_argument>(detail::concat("format '", name, "': latent blocks of ", latent.block, " values with ", latent.scale_bytes,
                                             " scale bytes each: the block must be positive, the scale bytes not negative"));
    if (latent.rope_bits != 8 && latent.rope_bits != 16 && latent.rope_bits != 32 && latent.rope_bits != 64)
      raise<invalid_argument>(detail::concat("format '", name, "': rope_bits=", latent.rope_bits,
                                             ": a rotary-key value must be 1, 2, 4 or 8 whole bytes"));
    if (static_cast<long long>(latent.block) * bits % 8 != 0)
      raise<invalid_argument>(detail::concat("format '", name, "': latent blocks of ", latent.block, " values of ", bits,
                                             " bits: a block's values must fill whole bytes"));
    latent_block_ = latent.block;
    latent_scale_bytes_ = latent.scale_bytes;
    rope_bits_ = latent.rope_bits;
  }

  /// The format of the cache element type F: format_traits<F>'s name, bits, scales (one fp32 per
  /// row where row_scale; one BlockScale, kBlockScaleBytes, per `block` values where
  /// block_scale; one fp32, kLatentScaleBytes, per `latent_block` latent values of an MLA
  /// format, whose rotary key is bf16), rotation and per-layer scales.
  template <class F> static constexpr KvFormat of() {
    using T = format_traits<F>;
    static_assert(sizeof(typename T::unit) * 8 == T::bits * T::values_per_unit,
                  "kvattn::KvFormat: a format's unit must hold values_per_unit values");
    static_assert(T::block_scale == (T::block > 0), "kvattn::KvFormat: a format has a block size exactly when it has block scales");
    if constexpr (T::latent_block > 0) {
      static_assert(!T::row_scale && !T::block_scale && !T::layer_scale && !T::rotated,
                    "kvattn::KvFormat: an MLA format's only scales are its latent blocks'");
      return KvFormat(T::name, T::bits, Latent{T::latent_block, kLatentScaleBytes, kLatentRopeBits});
    } else {
      return KvFormat(T::name, T::bits, T::row_scale ? static_cast<int>(sizeof(float)) : 0, T::rotated, T::layer_scale,
                      T::block_scale ? Blocks{T::block, kBlockScaleBytes} : Blocks{0, 0});
    }
  }

  /// The shipped format called `name`: "fp32", "fp16", "bf16", "int8", "int8_hadamard", "fp8",
  /// "fp8_hadamard", "fp8_layer", "q4", "q4_hadamard", "fp8_latent" or "int8_latent".
  /// Throws kvattn::invalid_argument naming `name` and the valid names otherwise.
  static KvFormat parse(std::string_view name);
  /// The shipped formats' names: "fp32, fp16, bf16, int8, int8_hadamard, fp8, fp8_hadamard,
  /// fp8_layer, q4, q4_hadamard, fp8_latent, int8_latent".
  static std::string names();

  constexpr std::string_view name() const noexcept { return name_; }
  constexpr int bits() const noexcept { return bits_; }  ///< per value, scales excluded
  /// Bytes of a page's unit: one value, or for a 4-bit format one byte of two values.
  constexpr int unit_bytes() const noexcept { return bits_ < 8 ? 1 : bits_ / 8; }
  constexpr int values_per_unit() const noexcept { return bits_ < 8 ? 8 / bits_ : 1; }
  constexpr int scale_bytes() const noexcept { return scale_bytes_; }  ///< per row; 0: none
  constexpr bool row_scale() const noexcept { return scale_bytes_ != 0; }
  constexpr int block() const noexcept { return block_; }  ///< values per block scale; 0: none
  constexpr int block_scale_bytes() const noexcept { return block_scale_bytes_; }  ///< per block; 0: none
  constexpr bool block_scale() const noexcept { return block_ != 0; }
  constexpr bool rotated() const noexcept { return rotated_; }
  constexpr bool layer_scale() const noexcept { return layer_scale_; }  ///< one key and one value scale per layer
  /// MLA formats: latent values per scale; 0: not an MLA format.
  constexpr int latent_block() const noexcept { return latent_block_; }
  constexpr int latent_scale_bytes() const noexcept { return latent_scale_bytes_; }  ///< per latent block; 0: none
  constexpr bool latent_scale() const noexcept { return latent_block_ != 0; }  ///< an MLA format
  /// Bits of one rotary-key value of an MLA row: an MLA format's own, else `bits`.
  constexpr int rope_bits() const noexcept { return rope_bits_; }

  /// Whether a cache of this format can hold a layer of `shape`: a GQA-family shape when the
  /// format is not an MLA format (of a head_dim that is a multiple of the block, up to
  /// kMaxBlockScaledDim, with block scales, and a power of two up to kMaxRotatedDim when
  /// rotated), or an MLA shape when the format is an MLA format (of a latent_dim that is a
  /// multiple of its latent block) or has neither scales (per row, per block or per layer) nor
  /// rotation.
  constexpr bool holds(const AttentionShape& shape) const noexcept {
    // holds_alternative and get, not get_if: GCC's constant evaluation under -fsanitize rejects
    // get_if's null test of the address of a static object.
    if (std::holds_alternative<GqaShape>(shape)) {
      const int d = std::get<GqaShape>(shape).head_dim;
      return !latent_scale() && (!block_scale() || (d % block_ == 0 && d <= kMaxBlockScaledDim)) &&
             (!rotated_ || (d > 0 && d <= kMaxRotatedDim && (d & (d - 1)) == 0));
    }
    if (latent_scale()) return std::get<MlaShape>(shape).latent_dim % latent_block_ == 0;
    return !gqa_only();
  }
  /// Why a cache of this format cannot hold `model`, naming both; "" when it can.
  std::string check(const Model& model) const;
  /// Throws kvattn::invalid_argument with check()'s message when the format cannot hold `model`.
  constexpr void require(const Model& model) const {
    if (!holds(model.attention)) raise<invalid_argument>(check(model));
  }

  /// Bytes one token holds in one layer of `shape`: its values and its rows' scales, no padding
  /// (PageLayout::token_bytes). `shape` must be one the format holds.
  ///   MHA, GQA, MQA   2 · kv_heads · (head_dim · bits / 8 + scale_bytes + head_dim / block · block_scale_bytes)
  ///   MLA             latent_dim · bits / 8 + latent_dim / latent_block · latent_scale_bytes + rope_dim · rope_bits / 8
  constexpr std::uint64_t bytes_per_token_layer(const AttentionShape& shape) const {
    if (std::holds_alternative<GqaShape>(shape)) {
      const GqaShape& g = std::get<GqaShape>(shape);
      return detail::checked_mul(2 * static_cast<std::uint64_t>(g.kv_heads),
                                 detail::checked_add(row_value_bytes(g.head_dim), row_scale_bytes(g.head_dim)));
    }
    return mla_row_bytes(std::get<MlaShape>(shape));
  }
  /// Bytes of one page of `page_size` tokens of one layer of `shape`, as PageLayout lays it out,
  /// padding included: a GQA page is 2 · kv_heads head blocks of page_size rows of
  /// head_dim · bits / 8 bytes, each rounded up to a whole cache line (kAlignment, 64 bytes),
  /// then, with scales, a scale block of 2 · kv_heads · page_size rows' scales (scale_bytes +
  /// head_dim / block · block_scale_bytes each) rounded up the same way; an MLA page is
  /// page_size rows (bytes_per_token_layer each, an MLA format's latent scales in its rows),
  /// rounded up once.
  constexpr std::uint64_t page_bytes(const AttentionShape& shape, int page_size) const {
    const auto tokens = static_cast<std::uint64_t>(page_size);
    if (std::holds_alternative<GqaShape>(shape)) {
      const GqaShape& g = std::get<GqaShape>(shape);
      const std::uint64_t blocks = 2 * static_cast<std::uint64_t>(g.kv_heads);
      const std::uint64_t head_block = whole_lines(detail::checked_mul(tokens, row_value_bytes(g.head_dim)));
      const std::uint64_t scales = whole_lines(detail::checked_mul(detail::checked_mul(blocks, tokens), row_scale_bytes(g.head_dim)));
      return detail::checked_add(detail::checked_mul(blocks, head_block), scales);
    }
    return whole_lines(detail::checked_mul(tokens, mla_row_bytes(std::get<MlaShape>(shape))));
  }

  friend constexpr bool operator==(const KvFormat& a, const KvFormat& b) noexcept {
    return a.name_ == b.name_ && a.bits_ == b.bits_ && a.scale_bytes_ == b.scale_bytes_ && a.rotated_ == b.rotated_ &&
           a.layer_scale_ == b.layer_scale_ && a.block_ == b.block_ && a.block_scale_bytes_ == b.block_scale_bytes_ &&
           a.latent_block_ == b.latent_block_ && a.latent_scale_bytes_ == b.latent_scale_bytes_ && a.rope_bits_ == b.rope_bits_;
  }
  friend constexpr bool operator!=(const KvFormat& a, const KvFormat& b) noexcept { return !(a == b); }

 private:
  /// Bytes of `values` values: values · bits / 8 (whole for the shapes the format holds).
  constexpr std::uint64_t bits_bytes(std::uint64_t values) const {
    return detail::checked_mul(values, static_cast<std::uint64_t>(bits_)) / 8;
  }
  /// Bytes of one row's values and of its scales (per row and per block), for a head_dim held.
  constexpr std::uint64_t row_value_bytes(int head_dim) const { return bits_bytes(static_cast<std::uint64_t>(head_dim)); }
  constexpr std::uint64_t row_scale_bytes(int head_dim) const {
    const std::uint64_t blocks = block_ == 0 ? 0 : static_cast<std::uint64_t>(head_dim / block_);
    return static_cast<std::uint64_t>(scale_bytes_) + blocks * static_cast<std::uint64_t>(block_scale_bytes_);
  }
  /// Bytes of one MLA row: the latent's values, its block scales, the rotary key (whole for
  /// the shapes the format holds).
  constexpr std::uint64_t mla_row_bytes(const MlaShape& m) const {
    const auto latent = static_cast<std::uint64_t>(m.latent_dim);
    const std::uint64_t scales =
        latent_block_ == 0 ? 0 : latent / static_cast<std::uint64_t>(latent_block_) * static_cast<std::uint64_t>(latent_scale_bytes_);
    const std::uint64_t rope = detail::checked_mul(static_cast<std::uint64_t>(m.rope_dim), static_cast<std::uint64_t>(rope_bits_)) / 8;
    return detail::checked_add(detail::checked_add(bits_bytes(latent), scales), rope);
  }
  /// Whether the format's scales or rotation are per KV head: it holds GQA-family caches only.
  constexpr bool gqa_only() const noexcept { return row_scale() || block_scale() || layer_scale_ || rotated_; }
  static constexpr std::uint64_t whole_lines(std::uint64_t bytes) {
    return detail::checked_mul(detail::ceil_div(bytes, kAlignment), kAlignment);
  }

  std::string_view name_;
  int bits_;
  int scale_bytes_;
  bool rotated_;
  bool layer_scale_;
  int block_;
  int block_scale_bytes_;
  int latent_block_;
  int latent_scale_bytes_;
  int rope_bits_;
};

/// The shipped formats (format.hpp), as KvFormat::of<F>() gives them.
namespace kv_formats {
inline constexpr KvFormat fp32{"fp32", 32};
inline constexpr KvFormat fp16{"fp16", 16};
inline constexpr KvFormat bf16{"bf16", 16};
inline constexpr KvFormat int8{"int8", 8, 4};                   ///< int8_row: one fp32 scale per row
inline constexpr KvFormat int8_hadamard{"int8_hadamard", 8, 4, true};  ///< hadamard<int8_row>
inline constexpr KvFormat fp8{"fp8", 8, 4};                     ///< fp8_e4m3_row: one fp32 scale per row
inline constexpr KvFormat fp8_hadamard{"fp8_hadamard", 8, 4, true};  ///< hadamard<fp8_e4m3_row>
inline constexpr KvFormat fp8_layer{"fp8_layer", 8, 0, false, true};  ///< fp8_e4m3_layer: the scales are the layer's
/// q4_block: 4-bit values, an fp16 scale and minimum (4 bytes) per block of 32 values of a row.
inline constexpr KvFormat q4{"q4", 4, KvFormat::Blocks{32, KvFormat::kBlockScaleBytes}};
inline constexpr KvFormat q4_hadamard{"q4_hadamard", 4, KvFormat::Blocks{32, KvFormat::kBlockScaleBytes}, true};  ///< hadamard<q4_block>
/// fp8_e4m3_latent: MLA rows of an fp8 latent with an fp32 scale per block of 128 values, and a
/// bf16 rotary key.
inline constexpr KvFormat fp8_latent{"fp8_latent", 8, KvFormat::Latent{128, KvFormat::kLatentScaleBytes, KvFormat::kLatentRopeBits}};
/// int8_latent: MLA rows of an int8 latent with an fp32 scale per block of 128 values, and a
/// bf16 rotary key.
inline constexpr KvFormat int8_latent{"int8_latent", 8, KvFormat::Latent{128, KvFormat::kLatentScaleBytes, KvFormat::kLatentRopeBits}};
inline constexpr std::array<KvFormat, 12> all{fp32, fp16, bf16, int8, int8_hadamard, fp8, fp8_hadamard, fp8_layer, q4, q4_hadamard,
                                              fp8_latent, int8_latent};
}  // namespace kv_formats

inline std::string KvFormat::names() {
  std::string list;
  for (const KvFormat& f : kv_formats::all) list += (list.empty() ? "" : ", ") + std::string(f.name());
  return list;
}

inline KvFormat KvFormat::parse(std::string_view name) {
  for (const KvFormat& f : kv_formats::all)
    if (f.name() == name) return f;
  raise<invalid_argument>("no KV format called '" + std::string(name) + "': expected one of " + names());
}

inline std::string KvFormat::check(const Model& model) const {
  if (holds(model.attention)) return {};
  // The shipped formats that hold MLA caches: "fp32, fp16, bf16, fp8_latent or int8_latent".
  const auto mla_formats = [] {
    std::vector<std::string_view> found;
    for (const KvFormat& f : kv_formats::all)
      if (!f.gqa_only()) found.push_back(f.name());
    std::string list;
    for (std::size_t i = 0; i < found.size(); ++i)
      list += (i == 0 ? "" : i + 1 == found.size() ? " or " : ", ") + std::string(found[i]);
    return list;
  };
  if (model.is_mla() && latent_scale())
    return detail::concat("the ", name_, " format quantizes the latent in blocks of ", latent_block_, " values: latent_dim=",
                          model.mla().latent_dim, " of model '", model.name, "' is not a multiple of ", latent_block_);
  if (model.is_mla())
    return detail::concat("the ", name_, " format (",
                          row_scale()     ? std::string("a scale per row of a KV head")
                          : block_scale() ? detail::concat("a scale per block of ", block_, " values of a row of a KV head")
                          : layer_scale_  ? std::string("a key and a value scale per layer")
                                          : std::string("rotated rows of a KV head"),
                          ") holds MHA/GQA/MQA caches only, and model '", model.name, "' is MLA; an MLA cache is ", mla_formats());
  if (latent_scale())
    return detail::concat("the ", name_, " format holds MLA rows (a latent and a rotary key per token) only, and model '", model.name,
                          "' is ", to_string(model.design()), " (keys and values per KV head)");
  const int d = model.gqa().head_dim;
  if (block_scale() && (d % block_ != 0 || d > kMaxBlockScaledDim))
    return detail::concat("the ", name_, " format quantizes blocks of ", block_, " values: head_dim=", d, " of model '",
                          model.name, "' is not a multiple of ", block_, " up to ", kMaxBlockScaledDim);
  return detail::concat("the ", name_, " format rotates rows of head_dim=", d, " (model '", model.name,
                        "'): head_dim must be a power of two up to ", kMaxRotatedDim);
}

// ---------------------------------------------------------------------------------------------
// Footprint: elements and bytes per token per layer, per token, per sequence, per batch.

constexpr std::uint64_t elements_per_token_layer(const GqaShape& s) noexcept {
  return 2 * static_cast<std::uint64_t>(s.kv_heads) * static_cast<std::uint64_t>(s.head_dim);
}
constexpr std::uint64_t elements_per_token_layer(const MlaShape& s) noexcept {
  return static_cast<std::uint64_t>(s.latent_dim) + static_cast<std::uint64_t>(s.rope_dim);
}
constexpr std::uint64_t elements_per_token_layer(const AttentionShape& a) noexcept {
  return std::holds_alternative<MlaShape>(a) ? elements_per_token_layer(std::get<MlaShape>(a))
                                             : elements_per_token_layer(std::get<GqaShape>(a));
}

/// What a cache holds for `batch` sequences of `context` tokens each, at a uniform width
/// (Workload{T, B, 16}, Workload{T, B, ElementBits(9, 2)}) or in a KV format of the cache
/// (Workload{T, B, kv_formats::int8}): the format's values and scales, exactly.
struct Workload {
  std::uint64_t context = 4096;                   ///< tokens per sequence, T
  std::uint64_t batch = 1;                        ///< sequences, B
  ElementBits bits = 16;                          ///< bits per cached element; with a format, its value width
  std::optional<KvFormat> format = std::nullopt;  ///< when set, the bytes are the format's; `bits` is not read

  constexpr Workload() = default;
  explicit constexpr Workload(std::uint64_t tokens) : context(tokens) {}
  constexpr Workload(std::uint64_t tokens, std::uint64_t sequences, ElementBits width = 16)
      : context(tokens), batch(sequences), bits(width) {}
  constexpr Workload(std::uint64_t tokens, std::uint64_t sequences, const KvFormat& kv_format)
      : context(tokens), batch(sequences), bits(static_cast<unsigned>(kv_format.bits())), format(kv_format) {}
};

struct Footprint {
  std::uint64_t elements_per_token_layer = 0;
  std::uint64_t elements_per_token = 0;  ///< × layers
  std::uint64_t bytes_per_token_layer = 0;
  std::uint64_t bytes_per_token = 0;     ///< all layers
  std::uint64_t bytes_per_sequence = 0;  ///< all layers, T tokens
  std::uint64_t bytes_per_batch = 0;     ///< all layers, T tokens, B sequences
};

/// The cache of `model` for `w`. With a format, the model must be one the format holds
/// (KvFormat::require: kvattn::invalid_argument naming both otherwise), and every byte count is
/// exact: values and scales, padding excluded.
constexpr Footprint footprint(const Model& model, const Workload& w) {
  if (!model.valid()) raise<shape_error>("footprint of an invalid model: " + model.check());
  Footprint f;
  f.elements_per_token_layer = elements_per_token_layer(model.attention);
  f.elements_per_token = detail::checked_mul(f.elements_per_token_layer, static_cast<std::uint64_t>(model.layers));
  if (w.format) {
    w.format->require(model);
    f.bytes_per_token_layer = w.format->bytes_per_token_layer(model.attention);
    f.bytes_per_token = detail::checked_mul(f.bytes_per_token_layer, static_cast<std::uint64_t>(model.layers));
    f.bytes_per_sequence = detail::checked_mul(f.bytes_per_token, w.context);
    f.bytes_per_batch = detail::checked_mul(f.bytes_per_sequence, w.batch);
    return f;
  }
  const std::uint64_t sequence = detail::checked_mul(f.elements_per_token, w.context);
  f.bytes_per_token_layer = w.bits.bytes_for(f.elements_per_token_layer);
  f.bytes_per_token = w.bits.bytes_for(f.elements_per_token);
  f.bytes_per_sequence = w.bits.bytes_for(sequence);
  f.bytes_per_batch = w.bits.bytes_for(detail::checked_mul(sequence, w.batch));
  return f;
}

// ---------------------------------------------------------------------------------------------
// The same model cached another way.

/// The model with its keys and values cached as `design`, its query heads unchanged. An MLA
/// model as MHA, GQA or MQA uses head_dim = nope_dim (d_h), as DESIGN.md and the DeepSeek-V2
/// paper compare them. GQA needs `groups` (KV heads) dividing the query heads; MLA needs a
/// model that is MLA already (a latent width cannot be made up).
constexpr Model as_design(const Model& model, Design design, int groups = 8) {
  if (!model.valid()) raise<shape_error>("as_design of an invalid model: " + model.check());
  if (design == Design::mla) {
    if (!model.is_mla())
      raise<shape_error>("model '" + std::string(model.name) +
                         "' is not MLA: its latent and rotary widths are unknown, so it has no MLA form");
    return model;
  }
  const int heads = model.q_heads();
  const int head_dim = model.is_mla() ? model.mla().nope_dim : model.gqa().head_dim;
  GqaShape shape = design == Design::mha ? GqaShape::mha(heads, head_dim)
                 : design == Design::mqa ? GqaShape::mqa(heads, head_dim)
                                         : GqaShape::gqa(heads, groups, head_dim);
  if (!shape.valid())
    raise<shape_error>(detail::concat("model '", model.name, "' as GQA with ", groups, " groups: ", shape.check()));
  return Model{model.name, model.layers, shape};
}

/// KV heads for a model's GQA form: its own when it is GQA, else the largest divisor of its
/// query heads that is at most 8 (8 groups is the common choice).
constexpr int default_gqa_groups(const Model& model) noexcept {
  if (!model.is_mla() && model.design() == Design::gqa) return model.gqa().kv_heads;
  int g = model.q_heads() < 8 ? model.q_heads() : 8;
  while (g > 1 && model.q_heads() % g != 0) --g;
  return g;
}

/// The model as MHA, GQA (default_gqa_groups), MQA, and MLA where it is MLA, in that order.
inline std::vector<Model> compare_designs(const Model& model) {
  std::vector<Model> rows{as_design(model, Design::mha), as_design(model, Design::gqa, default_gqa_groups(model)),
                          as_design(model, Design::mqa)};
  if (model.is_mla()) rows.push_back(model);
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Capacity under tensor parallelism.

/// How one layer's cache is split across `ranks` tensor-parallel ranks. Query heads are split
/// evenly. GQA-family KV heads are split when ranks <= kv_heads; when ranks outnumber them,
/// each rank holds one KV head and each head is replicated on ranks / kv_heads ranks. MLA's
/// latent serves every head, so every rank holds all of it (replicated `ranks` times).
struct ShardLayout {
  int ranks = 1;
  int kv_heads_per_rank = 0;  ///< GQA family: KV heads on one rank; MLA: 1 (the shared latent)
  int replication = 1;        ///< ranks holding each KV head (or the latent)
  std::uint64_t elements_per_token_layer_per_rank = 0;
};

constexpr ShardLayout shard(const Model& model, int ranks) {
  if (!model.valid()) raise<shape_error>("shard of an invalid model: " + model.check());
  if (ranks <= 0) raise<invalid_argument>(detail::concat("tensor_parallel=", ranks, ": must be positive"));
  const int heads = model.q_heads();
  if (heads % ranks != 0)
    raise<shape_error>(detail::concat("tensor_parallel=", ranks, " q_heads=", heads,
                                      ": query heads must split evenly across ranks"));
  ShardLayout s;
  s.ranks = ranks;
  if (model.is_mla()) {
    s.kv_heads_per_rank = 1;
    s.replication = ranks;
    s.elements_per_token_layer_per_rank = elements_per_token_layer(model.mla());
    return s;
  }
  const GqaShape& g = model.gqa();
  if (ranks <= g.kv_heads) {
    if (g.kv_heads % ranks != 0)
      raise<shape_error>(detail::concat("tensor_parallel=", ranks, " kv_heads=", g.kv_heads,
                                        ": KV heads must split evenly across ranks"));
    s.kv_heads_per_rank = g.kv_heads / ranks;
    s.replication = 1;
  } else {
    if (ranks % g.kv_heads != 0)
      raise<shape_error>(detail::concat("tensor_parallel=", ranks, " kv_heads=", g.kv_heads,
                                        ": with more ranks than KV heads, ranks must be a multiple of KV heads"));
    s.kv_heads_per_rank = 1;
    s.replication = ranks / g.kv_heads;
  }
  s.elements_per_token_layer_per_rank = 2 * static_cast<std::uint64_t>(s.kv_heads_per_rank) * g.head_dim;
  return s;
}

/// Memory of one device (rank) and what must share it with the cache.
struct CapacityRequest {
  std::uint64_t device_bytes = 0;  ///< memory of one device
  std::uint64_t weight_bytes = 0;  ///< weights of the whole model; each rank holds 1/tensor_parallel
  std::uint64_t context = 4096;    ///< tokens per sequence, for `sequences`
  ElementBits bits = 16;
  int tensor_parallel = 1;
  int page_size = 1;               ///< tokens per page; a sequence holds whole pages
  /// When set, the bytes are this format's (and `bits` is not read), and a page is counted as
  /// PageLayout lays it out for each rank's share, padding included, so that `pages` is what a
  /// PagedKvCache of the format holds in cache_bytes_per_rank. Without it, a page is its tokens'
  /// bytes at `bits`, unpadded.
  std::optional<KvFormat> format = std::nullopt;
};

struct CapacityPlan {
  ShardLayout layout;
  std::uint64_t weight_bytes_per_rank = 0;
  std::uint64_t cache_bytes_per_rank = 0;       ///< device − weights
  std::uint64_t bytes_per_token_per_rank = 0;   ///< all layers, padding excluded
  std::uint64_t bytes_per_token_all_ranks = 0;  ///< what the whole group spends per token
  std::uint64_t bytes_per_page_per_rank = 0;    ///< all layers; with a format, padding included
  std::uint64_t pages = 0;      ///< pages that fit on each rank
  std::uint64_t tokens = 0;     ///< tokens that fit (each rank holds its share of every token)
  std::uint64_t sequences = 0;  ///< sequences of `context` tokens that fit
};

constexpr CapacityPlan plan_capacity(const Model& model, const CapacityRequest& r) {
  if (r.page_size <= 0) raise<invalid_argument>(detail::concat("page_size=", r.page_size, ": must be positive"));
  if (r.context == 0) raise<invalid_argument>("context=0: a sequence holds at least one token");
  CapacityPlan p;
  p.layout = shard(model, r.tensor_parallel);
  const auto ranks = static_cast<std::uint64_t>(r.tensor_parallel);
  p.weight_bytes_per_rank = detail::ceil_div(r.weight_bytes, ranks);
  if (p.weight_bytes_per_rank >= r.device_bytes)
    raise<capacity_error>(detail::concat("weights of ", r.weight_bytes, " bytes over ", ranks, " ranks (",
                                         p.weight_bytes_per_rank, " per rank) leave nothing of ",
                                         r.device_bytes, " device bytes for the cache"));
  p.cache_bytes_per_rank = r.device_bytes - p.weight_bytes_per_rank;
  const auto layers = static_cast<std::uint64_t>(model.layers);
  if (r.format) {
    r.format->require(model);
    // One rank's cache: its KV heads (GQA family) or the whole latent (MLA).
    const AttentionShape rank_shape =
        model.is_mla() ? AttentionShape{model.mla()}
                       : AttentionShape{GqaShape{model.q_heads() / r.tensor_parallel, p.layout.kv_heads_per_rank, model.gqa().head_dim}};
    p.bytes_per_token_per_rank = detail::checked_mul(r.format->bytes_per_token_layer(rank_shape), layers);
    p.bytes_per_page_per_rank = detail::checked_mul(r.format->page_bytes(rank_shape, r.page_size), layers);
  } else {
    const std::uint64_t per_token = detail::checked_mul(p.layout.elements_per_token_layer_per_rank, layers);
    p.bytes_per_token_per_rank = r.bits.bytes_for(per_token);
    p.bytes_per_page_per_rank = r.bits.bytes_for(detail::checked_mul(per_token, static_cast<std::uint64_t>(r.page_size)));
  }
  p.bytes_per_token_all_ranks = detail::checked_mul(p.bytes_per_token_per_rank, ranks);
  p.pages = p.cache_bytes_per_rank / p.bytes_per_page_per_rank;
  p.tokens = p.pages * static_cast<std::uint64_t>(r.page_size);
  p.sequences = p.pages / detail::ceil_div(r.context, static_cast<std::uint64_t>(r.page_size));
  return p;
}

}  // namespace kvattn
