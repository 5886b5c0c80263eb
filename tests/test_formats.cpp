// KV formats (format.hpp) and the cache that stores them: int8_row's, fp8_e4m3_row's,
// fp8_e4m3_layer's and q4_block's quantization against their definitions (zeros, constant rows,
// saturation, non-finite values included); the page layout with its scale block; write / read / fork /
// copy-on-write / truncate carrying the scales with their pages; the per-layer scales; the
// cases rejected when a cache is made or written; and the quantization error of attention on realistic keys
// (Gaussian with a few outlier channels 20-50x larger, as real key caches have), as the
// normalized mean squared error of decode's output against the double reference on the
// unquantized keys and values (and, for q4_block, why its grid has an offset); the MLA formats'
// blocks, rows (FlashMLA's byte order) and attention error likewise.
//
// The kernels themselves are checked on the quantized caches by every decode and prefill test (decode_check.hpp,
// test_prefill.cpp): there the reference reads the cache's dequantized keys and values, so the
// bounds are those of the 16-bit types.
#include <kvattn/decode.hpp>
#include <kvattn/format.hpp>
#include <kvattn/paged_cache.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cache_snapshot.hpp"
#include "mla_reference.hpp"
#include "reference.hpp"

namespace {

using kvattn::CacheConfig;
using kvattn::GqaShape;
using kvattn::int8_row;
using Int8 = kvattn::format_traits<int8_row>;

/// int8_row's definition, in double: scale = max|x| / 127, q = round-half-even(x · 127 / max|x|).
void expect_matches_definition(const std::vector<float>& x, const std::vector<int8_row>& q, float scale) {
  float amax = 0;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  ASSERT_EQ(scale, amax / 127.0f);
  const float inv = 127.0f / amax;
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(q[i].q, static_cast<int>(std::nearbyint(x[i] * inv))) << "element " << i << " of " << x.size();
    EXPECT_LE(std::fabs(Int8::dequantize(q[i], scale) - x[i]), 0.5f * scale * (1 + 1e-6f)) << "element " << i;
  }
}

TEST(Int8Row, QuantizesAsDefined) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t n : {1u, 7u, 64u, 128u, 129u}) {
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng) * 3.0f;
    std::vector<int8_row> q(n);
    const float scale = Int8::quantize_row(x.data(), q.data(), n);
    SCOPED_TRACE(n);
    expect_matches_definition(x, q, scale);
    const auto top = std::max_element(x.begin(), x.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); });
    EXPECT_EQ(std::abs(q[static_cast<std::size_t>(top - x.begin())].q), 127);  // the largest value is exact
  }
}

TEST(Int8Row, ZerosConstantsAndSixteenBitSources) {
  std::vector<int8_row> q(5);
  const std::vector<float> zeros(5, 0.0f);
  EXPECT_EQ(Int8::quantize_row(zeros.data(), q.data(), 5), 0.0f);
  for (auto v : q) EXPECT_EQ(v.q, 0);
  EXPECT_EQ(Int8::dequantize(q[0], 0.0f), 0.0f);

  const std::vector<float> constant(5, -0.3f);  // every value the extreme: -127 each, read back as -0.3
  const float s = Int8::quantize_row(constant.data(), q.data(), 5);
  for (auto v : q) EXPECT_EQ(v.q, -127);
  EXPECT_NEAR(Int8::dequantize(q[0], s), -0.3f, 1e-7f);

  const std::vector<kvattn::bf16> b = {kvattn::bf16(1.0f), kvattn::bf16(-0.5f), kvattn::bf16(0.25f)};
  std::vector<int8_row> qb(3);
  EXPECT_EQ(Int8::quantize_row(b.data(), qb.data(), 3), 1.0f / 127.0f);
  EXPECT_EQ(qb[0].q, 127);
  EXPECT_EQ(qb[1].q, -64);  // -63.5 rounds to the even -64
  EXPECT_EQ(qb[2].q, 32);   // 31.75
}

TEST(Int8Row, NonFiniteValuesMakeTheWholeRowNaN) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    const std::vector<float> x = {1.0f, bad, -2.0f};
    std::vector<int8_row> q(3);
    const float s = Int8::quantize_row(x.data(), q.data(), 3);
    EXPECT_TRUE(std::isnan(s)) << bad;
    for (auto v : q) EXPECT_TRUE(std::isnan(Int8::dequantize(v, s))) << bad;
  }
}

// ---- fp8 e4m3 ------------------------------------------------------------------------------

using kvattn::fp8_e4m3_row;
using Fp8 = kvattn::format_traits<fp8_e4m3_row>;

/// e4m3's definition, in double: (-1)^s · 2^(e-7) · (1 + m/8), or 2^-6 · m/8 when e = 0.
double e4m3_value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double mag = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return (code & 0x80) ? -mag : mag;
}

/// The code nearest |x| among 0 .. 0x7E (0x7F is NaN), ties to the even code, with x's sign.
int nearest_e4m3(float x) {
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(e4m3_value(c) - a), db = std::fabs(e4m3_value(best) - a);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return best | (std::signbit(x) ? 0x80 : 0);
}

TEST(Fp8E4m3, DecodesEveryCodeAsDefined) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN: never written
    EXPECT_EQ(static_cast<double>(kvattn::fp8_e4m3_decode_scaled(static_cast<std::uint8_t>(code))) * 256.0, e4m3_value(code))
        << "code " << code;
    EXPECT_EQ(kvattn::fp8_e4m3_encode(static_cast<float>(e4m3_value(code))), code == 0x80 ? 0x80 : code) << "code " << code;
  }
  EXPECT_EQ(e4m3_value(0x7E), 448.0);
  EXPECT_EQ(e4m3_value(0x01), std::ldexp(1.0, -9));  // the smallest subnormal
}

TEST(Fp8E4m3, EncodesToTheNearestCodeTiesToEvenAndSaturates) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> magnitude(-12.0f, 9.2f);  // log2 of |x|: subnormals to past 448
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(magnitude(rng)) * (rng() % 2 ? 1.0f : -1.0f);
    ASSERT_EQ(kvattn::fp8_e4m3_encode(x), nearest_e4m3(std::min(std::fabs(x), 448.0f) * (x < 0 ? -1.0f : 1.0f))) << x;
  }
  // Ties, exactly halfway between two codes: to the even one.
  EXPECT_EQ(kvattn::fp8_e4m3_encode(std::ldexp(1.0f, -10)), 0x00);       // 0 and 2^-9
  EXPECT_EQ(kvattn::fp8_e4m3_encode(3 * std::ldexp(1.0f, -10)), 0x02);   // 2^-9 and 2^-8
  EXPECT_EQ(kvattn::fp8_e4m3_encode(15 * std::ldexp(1.0f, -10)), 0x08);  // 7·2^-9 and 2^-6, the smallest normal
  EXPECT_EQ(kvattn::fp8_e4m3_encode(1.0625f), 0x38);                     // 1 and 1.125
  EXPECT_EQ(kvattn::fp8_e4m3_encode(1.1875f), 0x3A);                     // 1.125 and 1.25
  // Past 448: saturates, never a NaN code.
  for (float big : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::max()}) {
    EXPECT_EQ(kvattn::fp8_e4m3_encode(big), 0x7E) << big;
    EXPECT_EQ(kvattn::fp8_e4m3_encode(-big), 0xFE) << big;
  }
}

TEST(Fp8E4m3, VectorLoadsEqualTheScalarDecoding) {
  using Vec = kvattn::simd::Vec<kvattn::isa::native>;
  constexpr int W = Vec::lanes;
  static_assert(!Vec::interleaves_pairs<fp8_e4m3_row>, "load_pair gives fp8 values in order");
  std::vector<fp8_e4m3_row> bytes(256 + 2 * W);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i].bits = static_cast<std::uint8_t>(i % 256 == 0x7F ? 0 : i % 256);
  std::vector<float> got(2 * W);
  for (std::size_t i = 0; i < 256; ++i) {
    Vec a, b;
    Vec::load_pair(bytes.data() + i, a, b);  // in order: fp8 pairs are not interleaved
    a.store(got.data());
    b.store(got.data() + W);
    for (int j = 0; j < 2 * W; ++j) ASSERT_EQ(got[static_cast<std::size_t>(j)], kvattn::to_float(bytes[i + static_cast<std::size_t>(j)])) << i << " + " << j;
    Vec::load(bytes.data() + i).store(got.data());
    for (int j = 0; j < W; ++j) ASSERT_EQ(got[static_cast<std::size_t>(j)], kvattn::to_float(bytes[i + static_cast<std::size_t>(j)])) << i << " + " << j;
    const int n = static_cast<int>(i % W);
    std::fill(got.begin(), got.end(), -1.0f);
    Vec::load_partial(bytes.data() + i, n).store(got.data());
    for (int j = 0; j < W; ++j)
      ASSERT_EQ(got[static_cast<std::size_t>(j)], j < n ? kvattn::to_float(bytes[i + static_cast<std::size_t>(j)]) : 0.0f) << i << " + " << j;
  }
}

TEST(Fp8Row, QuantizesAsDefined) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t n : {1u, 7u, 64u, 128u, 129u}) {
    SCOPED_TRACE(n);
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng) * 3.0f;
    x[n / 2] *= 1000.0f;  // some values fall to the subnormals
    std::vector<fp8_e4m3_row> q(n);
    const float stored = Fp8::quantize_row(x.data(), q.data(), n);
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    ASSERT_EQ(stored, amax / 448.0f * 256.0f);  // the page holds s · 2^8
    const float s = amax / 448.0f, inv = 448.0f / amax;
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_EQ(q[i].bits, kvattn::fp8_e4m3_encode(x[i] * inv)) << "element " << i;
      EXPECT_EQ(static_cast<double>(Fp8::dequantize(q[i], stored)), static_cast<double>(static_cast<float>(e4m3_value(q[i].bits) * s)))
          << "element " << i;
      // Half a step: 2^-4 of the value for normals, 2^-10 · s below 2^-6 · s.
      EXPECT_LE(std::fabs(Fp8::dequantize(q[i], stored) - x[i]), std::max(std::fabs(x[i]) / 16, std::ldexp(s, -10)) * (1 + 1e-6f)) << i;
    }
    const auto top = std::max_element(x.begin(), x.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); });
    EXPECT_EQ(q[static_cast<std::size_t>(top - x.begin())].bits & 0x7F, 0x7E);  // the largest value: ±448 · s
  }
}

TEST(Fp8Row, ZerosConstantsAndNonFiniteValues) {
  std::vector<fp8_e4m3_row> q(5);
  const std::vector<float> zeros(5, 0.0f);
  EXPECT_EQ(Fp8::quantize_row(zeros.data(), q.data(), 5), 0.0f);
  for (auto v : q) EXPECT_EQ(v.bits, 0);
  const std::vector<float> constant(5, -0.3f);  // every value the extreme, read back as -0.3
  const float s = Fp8::quantize_row(constant.data(), q.data(), 5);
  for (auto v : q) EXPECT_EQ(v.bits, 0xFE);
  EXPECT_NEAR(Fp8::dequantize(q[0], s), -0.3f, 1e-7f);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    const std::vector<float> x = {1.0f, bad, -2.0f};
    const float sn = Fp8::quantize_row(x.data(), q.data(), 3);
    EXPECT_TRUE(std::isnan(sn)) << bad;
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(Fp8::dequantize(q[static_cast<std::size_t>(i)], sn))) << bad;
  }
}

TEST(Int8Cache, PagesEndInAnAlignedScaleBlock) {
  for (int page : {1, 7, 16, 64})
    for (const GqaShape& shape : {GqaShape::gqa(8, 2, 128), GqaShape::gqa(3, 3, 7), GqaShape::mqa(4, 80)}) {
      SCOPED_TRACE(kvattn::detail::concat("page=", page, " kv_heads=", shape.kv_heads, " head_dim=", shape.head_dim));
      kvattn::PagedKvCache<int8_row> cache(CacheConfig{2, page, 3, shape});
      const kvattn::PageLayout& l = cache.layout();
      EXPECT_EQ(l.unit_bytes, 1);
      EXPECT_EQ(l.head_stride % 64, 0);
      EXPECT_GE(l.head_stride, std::int64_t{page} * shape.head_dim);
      EXPECT_EQ(l.scale_offset, 2 * shape.kv_heads * l.head_stride);  // after every head block
      EXPECT_EQ(l.page_stride % 64, 0);
      EXPECT_GE(l.page_stride - l.scale_offset, 2 * std::int64_t{shape.kv_heads} * page * 4);
      EXPECT_EQ(l.value_scale(0, 0), std::int64_t{shape.kv_heads} * page);
      EXPECT_EQ(l.token_bytes(), 2 * std::int64_t{shape.kv_heads} * (shape.head_dim + 4));
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(cache.layer_data(1)) % 64, 0u);
      const auto s = cache.add_sequence();
      cache.append(s, page + 1);
      const kvattn::CacheStats st = cache.stats();
      EXPECT_EQ(st.bytes_per_page, 2 * l.page_stride);
      EXPECT_EQ(st.bytes_stored, (page + 1) * l.token_bytes() * 2);
    }
}

/// Token t's keys and values in layer `layer` [kv_heads][head_dim]: distinct per token and layer.
std::vector<float> row_values(const GqaShape& s, int t, int layer, float sign) {
  std::vector<float> x(static_cast<std::size_t>(s.kv_heads) * s.head_dim);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = sign * std::sin(0.37f * static_cast<float>(i) + 1.3f * t + 0.7f * layer) * (1 + t);
  return x;
}

/// What read() must return for those values in a cache of format F (int8_row, q4_block or
/// hadamard<q4_block>): each row quantized by its definition and dequantized.
template <class F> std::vector<float> dequantized(const GqaShape& s, const std::vector<float>& x) {
  using Tr = kvattn::format_traits<F>;
  std::vector<float> out(x.size());
  std::vector<F> q(static_cast<std::size_t>(s.head_dim) / Tr::values_per_unit);
  std::vector<kvattn::BlockScale> blocks(Tr::block_scale ? static_cast<std::size_t>(s.head_dim / 32) : 0);
  for (int h = 0; h < s.kv_heads; ++h) {
    const float* row = x.data() + std::int64_t{h} * s.head_dim;
    float* o = out.data() + std::int64_t{h} * s.head_dim;
    if constexpr (Tr::block_scale) {
      Tr::quantize_row(row, q.data(), static_cast<std::size_t>(s.head_dim), blocks.data());
      for (int c = 0; c < s.head_dim; ++c) o[c] = Tr::dequantize(q.data(), static_cast<std::size_t>(c), blocks.data());
    } else {
      const float scale = Tr::quantize_row(row, q.data(), q.size());
      for (int c = 0; c < s.head_dim; ++c) o[c] = Tr::dequantize(q[static_cast<std::size_t>(c)], scale);
    }
    if constexpr (Tr::rotated) kvattn::hadamard_rotate(o, s.head_dim);
  }
  return out;
}

template <class F> void expect_token(const kvattn::PagedKvCache<F>& cache, kvattn::SeqId seq, int layer, int t, float sign) {
  const GqaShape& s = std::get<GqaShape>(cache.config().shape);
  std::vector<float> k(static_cast<std::size_t>(s.kv_heads) * s.head_dim), v(k.size());
  cache.read(seq, layer, t, k.data(), v.data());
  EXPECT_EQ(k, dequantized<F>(s, row_values(s, t, layer, sign))) << "seq " << seq << " layer " << layer << " token " << t;
  EXPECT_EQ(v, dequantized<F>(s, row_values(s, t, layer, -sign))) << "seq " << seq << " layer " << layer << " token " << t;
}

/// A cache of format F: fork, copy-on-write and truncate carry the scales with their pages.
template <class F> void scales_travel_with_their_pages(const GqaShape& shape) {
  for (int page : {1, 7, 16}) {
    SCOPED_TRACE(page);
    kvattn::PagedKvCache<F> cache(CacheConfig{2, page, 40, shape});
    const auto parent = cache.add_sequence();
    const int n = 2 * page + 3;
    cache.append(parent, n);
    for (int layer = 0; layer < 2; ++layer)
      for (int t = 0; t < n; ++t)
        cache.write(parent, layer, t, row_values(shape, t, layer, 1).data(), row_values(shape, t, layer, -1).data());
    const auto child = cache.fork(parent);
    // The child overwrites a token in its (shared) first page: that page is copied, scales too.
    cache.write(child, 1, 0, row_values(shape, 0, 1, 2).data(), row_values(shape, 0, 1, -2).data());
    expect_token(cache, child, 1, 0, 2);
    expect_token(cache, parent, 1, 0, 1);
    for (int layer = 0; layer < 2; ++layer)
      for (int t = 1; t < n; ++t) {
        expect_token(cache, parent, layer, t, 1);
        expect_token(cache, child, layer, t, 1);
      }
    expect_token(cache, child, 0, 0, 1);  // the copy holds the other layer's rows and scales as well
    // Truncate into a page and write again: the new rows' scales replace the old ones.
    cache.truncate(child, page + 1);
    cache.append(child, 1);
    cache.write(child, 0, page + 1, row_values(shape, 99, 0, 3).data(), row_values(shape, 99, 0, -3).data());
    std::vector<float> k(static_cast<std::size_t>(shape.kv_heads) * shape.head_dim), v(k.size());
    cache.read(child, 0, page + 1, k.data(), v.data());
    EXPECT_EQ(k, dequantized<F>(shape, row_values(shape, 99, 0, 3)));
    expect_token(cache, parent, 0, page + 1, 1);
    cache.check_invariants();
  }
}

TEST(Int8Cache, ScalesTravelWithTheirPages) { scales_travel_with_their_pages<int8_row>(GqaShape::gqa(6, 3, 24)); }

TEST(HadamardInt8, RowsReadBackRotatedBackWithinTheQuantizationStep) {
  const GqaShape shape = GqaShape::gqa(4, 2, 64);
  kvattn::PagedKvCache<kvattn::hadamard<int8_row>> cache(CacheConfig{1, 7, 4, shape});
  const auto s = cache.add_sequence();
  cache.append(s, 9);
  std::vector<float> k = row_values(shape, 3, 0, 1), v = row_values(shape, 3, 0, -1);
  k[5] = 40.0f;  // an outlier channel
  cache.write(s, 0, 8, k.data(), v.data());
  std::vector<float> kr(k.size()), vr(v.size());
  cache.read(s, 0, 8, kr.data(), vr.data());
  for (int h = 0; h < shape.kv_heads; ++h) {
    // The rotation is orthonormal: the row's error (L2) is the rotated row's, at most half a
    // step per value, the step being the rotated row's max |value| / 127.
    std::vector<float> rotated(k.begin() + h * 64, k.begin() + (h + 1) * 64);
    kvattn::hadamard_rotate(rotated.data(), 64);
    float amax = 0;
    for (float x : rotated) amax = std::max(amax, std::fabs(x));
    double err = 0;
    for (int c = 0; c < 64; ++c) err += std::pow(kr[static_cast<std::size_t>(h * 64 + c)] - k[static_cast<std::size_t>(h * 64 + c)], 2);
    EXPECT_LE(std::sqrt(err), std::sqrt(64.0) * 0.5 * amax / 127 * (1 + 1e-5)) << "head " << h;
    EXPECT_GT(err, 0.0);  // quantized, not stored exactly
  }
  // H is its own inverse.
  std::vector<float> x = row_values(shape, 1, 0, 1), y = x;
  kvattn::hadamard_rotate(y.data(), 64);
  kvattn::hadamard_rotate(y.data(), 64);
  for (int c = 0; c < 64; ++c) EXPECT_NEAR(y[static_cast<std::size_t>(c)], x[static_cast<std::size_t>(c)], 1e-5f);
}

TEST(HadamardInt8, HeadSizesThatAreNotPowersOfTwoAreRejected) {
  for (int d : {80, 7, 2048}) {
    try {
      kvattn::PagedKvCache<kvattn::hadamard<int8_row>> cache(CacheConfig{1, 16, 4, GqaShape::gqa(4, 2, d)});
      FAIL() << "head_dim " << d << " accepted";
    } catch (const kvattn::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("head_dim=" + std::to_string(d)), std::string::npos) << e.what();
    }
  }
}

TEST(Int8Cache, MlaPagesAreRejectedNamingTheFormat) {
  const kvattn::MlaShape mla{4, 64, 16, 32, 32, 0};
  try {
    kvattn::PagedKvCache<int8_row> cache(CacheConfig{1, 16, 4, mla});
    FAIL() << "an int8 MLA cache was made";
  } catch (const kvattn::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("int8"), std::string::npos) << what;
    EXPECT_NE(what.find("MLA"), std::string::npos) << what;
  }
}

// ---- fp8 e4m3 with one scale per layer --------------------------------------------------------

using kvattn::fp8_e4m3_layer;
using Fp8Layer = kvattn::format_traits<fp8_e4m3_layer>;

TEST(Fp8Layer, QuantizesAsDefinedAndSaturates) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float scale : {1.0f, 0.0123f, 3.5f, 0x1p-126f}) {
    SCOPED_TRACE(scale);
    std::vector<float> x(300);
    for (float& v : x) v = normal(rng) * 100.0f * scale;  // some past 448 · scale, some subnormal
    x[0] = 0.0f;
    x[1] = 448.0f * scale;
    x[2] = -1e4f * scale;
    x[3] = std::numeric_limits<float>::max();  // finite: saturates like the rest
    std::vector<fp8_e4m3_layer> q(x.size());
    Fp8Layer::quantize_row(x.data(), q.data(), x.size(), scale);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float y = x[i] / scale;  // as the format divides: by one multiplication by 1 / scale
      const float clamped = std::min(std::fabs(x[i] * (1.0f / scale)), 448.0f) * (x[i] < 0 ? -1.0f : 1.0f);
      ASSERT_EQ(q[i].bits, nearest_e4m3(clamped)) << "element " << i << " = " << x[i] << " (x / scale = " << y << ")";
      EXPECT_EQ(static_cast<double>(Fp8Layer::dequantize(q[i], scale)), static_cast<double>(static_cast<float>(e4m3_value(q[i].bits)) * scale))
          << "element " << i;
    }
    EXPECT_EQ(q[0].bits, 0);
    EXPECT_EQ(q[1].bits, 0x7E);  // 448 · scale: the largest code, exactly
    EXPECT_EQ(q[2].bits, 0xFE);  // saturated
    EXPECT_EQ(q[3].bits, 0x7E);
    EXPECT_EQ(Fp8Layer::dequantize(q[2], scale), -448.0f * scale);
  }
  // The kernels' factor: loads give q · 2^-8.
  EXPECT_EQ(Fp8Layer::kernel_scale(0.5f), 128.0f);
  EXPECT_EQ(kvattn::to_float(fp8_e4m3_layer{{0x38}}), 1.0f / 256);  // code 0x38 is 1
}

TEST(Fp8Layer, OnlyNormalScalesUpTo2To100AreValid) {
  for (float ok : {0x1p-126f, 1e-20f, 0.003f, 1.0f, 1e20f, 0x1p100f}) EXPECT_TRUE(Fp8Layer::valid_scale(ok)) << ok;
  for (float bad : {0.0f, -0.0f, -1.0f, 0x1p-127f, 0x1p101f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()})
    EXPECT_FALSE(Fp8Layer::valid_scale(bad)) << bad;
}

/// Every key and value of token t in `layer` for fp8_e4m3_layer caches: row_values, times 10.
std::vector<float> layer_row(const GqaShape& s, int t, int layer, float sign) {
  std::vector<float> x = row_values(s, t, layer, sign);
  for (float& v : x) v *= 10.0f;
  return x;
}

/// What read() returns for x in a layer of scale `scale`: each value through the definition.
std::vector<float> through_layer_format(const std::vector<float>& x, float scale) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const int code = nearest_e4m3(std::min(std::fabs(x[i] * (1.0f / scale)), 448.0f) * (x[i] < 0 ? -1.0f : 1.0f));
    out[i] = static_cast<float>(e4m3_value(code)) * scale;
  }
  return out;
}

TEST(Fp8LayerCache, EachLayerReadsWithItsOwnScalesAndPagesHoldValuesOnly) {
  const GqaShape shape = GqaShape::gqa(6, 3, 24);
  const std::vector<kvattn::KvScales> scales = {{0.05f, 0.3f}, {1.5f, 0.01f}};  // layer 1's values saturate
  for (int page : {1, 7, 16}) {
    SCOPED_TRACE(page);
    kvattn::PagedKvCache<fp8_e4m3_layer> cache(CacheConfig{2, page, 40, shape}, scales);
    const kvattn::PageLayout& l = cache.layout();
    EXPECT_EQ(l.unit_bytes, 1);
    EXPECT_EQ(l.scale_offset, 0);  // no scale block
    EXPECT_EQ(l.page_stride, 2 * shape.kv_heads * l.head_stride);
    EXPECT_EQ(l.token_bytes(), 2 * std::int64_t{shape.kv_heads} * shape.head_dim);
    for (int layer = 0; layer < 2; ++layer) {
      EXPECT_EQ(cache.scales(layer).k, scales[static_cast<std::size_t>(layer)].k);
      EXPECT_EQ(cache.scales(layer).v, scales[static_cast<std::size_t>(layer)].v);
    }
    EXPECT_THROW(cache.scales(2), kvattn::invalid_argument);
    const auto parent = cache.add_sequence();
    const int n = 2 * page + 3;
    cache.append(parent, n);
    for (int layer = 0; layer < 2; ++layer)
      for (int t = 0; t < n; ++t) cache.write(parent, layer, t, layer_row(shape, t, layer, 1).data(), layer_row(shape, t, layer, -1).data());
    const kvattn::BatchPageTable table = cache.page_table({parent});
    EXPECT_EQ(cache.view(table, 1).scales.k, 1.5f);
    EXPECT_EQ(cache.view(table, 1).scales.v, 0.01f);
    const auto child = cache.fork(parent);
    cache.write(child, 1, 0, layer_row(shape, 0, 1, 2).data(), layer_row(shape, 0, 1, -2).data());  // copy-on-write
    std::vector<float> k(static_cast<std::size_t>(shape.kv_heads) * shape.head_dim), v(k.size());
    const auto expect_token = [&](kvattn::SeqId seq, int layer, int t, float sign) {
      cache.read(seq, layer, t, k.data(), v.data());
      const kvattn::KvScales& ls = scales[static_cast<std::size_t>(layer)];
      EXPECT_EQ(k, through_layer_format(layer_row(shape, t, layer, sign), ls.k)) << "seq " << seq << " layer " << layer << " token " << t;
      EXPECT_EQ(v, through_layer_format(layer_row(shape, t, layer, -sign), ls.v)) << "seq " << seq << " layer " << layer << " token " << t;
    };
    expect_token(child, 1, 0, 2);
    expect_token(parent, 1, 0, 1);
    for (int layer = 0; layer < 2; ++layer)
      for (int t = 1; t < n; ++t) {
        expect_token(parent, layer, t, 1);
        expect_token(child, layer, t, 1);
      }
    cache.truncate(child, page + 1);
    cache.append(child, 1);
    cache.write(child, 0, page + 1, layer_row(shape, 7, 0, 3).data(), layer_row(shape, 7, 0, -3).data());
    cache.read(child, 0, page + 1, k.data(), v.data());
    EXPECT_EQ(k, through_layer_format(layer_row(shape, 7, 0, 3), scales[0].k));
    expect_token(parent, 0, page + 1, 1);
    cache.check_invariants();
    // Moved, the scales go with the pages.
    kvattn::PagedKvCache<fp8_e4m3_layer> moved(std::move(cache));
    EXPECT_EQ(moved.scales(1).v, 0.01f);
  }
  // Without scales every layer's are 1.
  kvattn::PagedKvCache<fp8_e4m3_layer> ones(CacheConfig{3, 16, 2, shape});
  for (int layer = 0; layer < 3; ++layer) EXPECT_EQ(ones.scales(layer).k * ones.scales(layer).v, 1.0f);
  kvattn::PagedKvCache<kvattn::bf16> plain(CacheConfig{2, 16, 2, shape});
  EXPECT_EQ(plain.scales(1).k, 1.0f);  // formats without per-layer scales: 1
}

/// The message of the invalid_argument that `f` throws ("" and a failure when it throws none).
template <class F> std::string error_of(F&& f) {
  try {
    f();
  } catch (const kvattn::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no invalid_argument";
  return {};
}

TEST(Fp8LayerCache, BadScalesAreRejectedWhenTheCacheIsMade) {
  const GqaShape shape = GqaShape::gqa(4, 2, 16);
  const auto make = [&](std::vector<kvattn::KvScales> scales) {
    return [&shape, scales] { kvattn::PagedKvCache<fp8_e4m3_layer> c(CacheConfig{2, 16, 2, shape}, scales); };
  };
  std::string what = error_of(make({{1.0f, 1.0f}}));
  EXPECT_NE(what.find("1 layer scales for layers=2"), std::string::npos) << what;
  for (float bad : {0.0f, -2.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 0x1p-130f}) {
    what = error_of(make({{1.0f, 1.0f}, {1.0f, bad}}));
    EXPECT_NE(what.find("layer 1's v scale="), std::string::npos) << what;
    what = error_of(make({{bad, 1.0f}, {1.0f, 1.0f}}));
    EXPECT_NE(what.find("layer 0's k scale="), std::string::npos) << what;
  }
  what = error_of([&] { kvattn::PagedKvCache<int8_row> c(CacheConfig{2, 16, 2, shape}, {{1.0f, 1.0f}, {1.0f, 1.0f}}); });
  EXPECT_NE(what.find("the int8 format has none"), std::string::npos) << what;
  what = error_of([] { kvattn::PagedKvCache<fp8_e4m3_layer> c(CacheConfig{1, 16, 4, kvattn::MlaShape{4, 64, 16, 32, 32, 0}}); });
  EXPECT_NE(what.find("fp8_layer"), std::string::npos) << what;
  EXPECT_NE(what.find("MLA"), std::string::npos) << what;
}

TEST(Fp8LayerCache, NonFiniteValuesAreRefusedAndNothingIsWritten) {
  const GqaShape shape = GqaShape::gqa(4, 2, 16);
  kvattn::PagedKvCache<fp8_e4m3_layer> cache(CacheConfig{2, 4, 8, shape}, {{0.1f, 0.1f}, {0.2f, 0.2f}});
  const auto parent = cache.add_sequence();
  cache.append(parent, 6);
  std::vector<float> k(6 * 2 * 16, 0.5f), v(k.size(), -0.5f);
  cache.write(parent, 0, 0, 6, k.data(), v.data());
  const auto child = cache.fork(parent);  // every page shared: a write would copy them
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    std::vector<float> kb = k, vb = v;
    vb[(5 * 2 + 1) * 16 + 9] = bad;  // token 5, KV head 1, column 9 of the values
    const cache_snapshot::Snapshot before = cache_snapshot::snapshot(cache);
    const std::uint64_t generation = cache.generation();
    const std::string what = error_of([&] { cache.write(child, 1, 0, 6, kb.data(), vb.data()); });
    EXPECT_NE(what.find("write(seq=1, layer=1, position=5)"), std::string::npos) << what;
    EXPECT_NE(what.find("value of KV head 1"), std::string::npos) << what;
    EXPECT_NE(what.find("column 9"), std::string::npos) << what;
    EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));
    EXPECT_EQ(cache.generation(), generation);  // no copy-on-write either
    std::vector<kvattn::bf16> kh(k.size(), kvattn::bf16(0.5f));
    kh[3] = kvattn::bf16(bad);  // 16-bit sources likewise
    EXPECT_THROW(cache.write(child, 0, 0, 6, kh.data(), kh.data()), kvattn::invalid_argument);
    EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));
  }
  // The call's own errors come first: a range past the end is named as such.
  const std::string what = error_of([&] { cache.write(child, 0, 4, 6, k.data(), v.data()); });
  EXPECT_NE(what.find("holds 6 tokens"), std::string::npos) << what;
}

// ---- q4_block: 4-bit codes in blocks of 32, a scale and a minimum per block ------------------

using kvattn::BlockScale;
using kvattn::q4_block;
using Q4 = kvattn::format_traits<q4_block>;

/// q4_block's definition, block by block (format.hpp), in the fp32 arithmetic it states:
/// m = fp16(min), d = fp16((max − m) / 15), q = round-half-even((x − m) / d) clamped to [0, 15]
/// (0 when d = 0), x beyond ±65504 saturated first; a value reads as fma(q, d, m).
void expect_q4_matches_definition(const std::vector<float>& x, const std::vector<q4_block>& q, const std::vector<BlockScale>& s) {
  for (std::size_t b = 0; b < x.size() / 32; ++b) {
    float lo = 65504.0f, hi = -65504.0f, y[32];
    for (int i = 0; i < 32; ++i) {
      y[i] = std::min(65504.0f, std::max(-65504.0f, x[b * 32 + static_cast<std::size_t>(i)]));
      lo = std::min(lo, y[i]);
      hi = std::max(hi, y[i]);
    }
    const kvattn::fp16 m(lo), d((hi - static_cast<float>(m)) / 15.0f);
    EXPECT_EQ(static_cast<float>(s[b].m), static_cast<float>(m)) << "block " << b;
    EXPECT_EQ(static_cast<float>(s[b].d), static_cast<float>(d)) << "block " << b;
    for (int i = 0; i < 32; ++i) {
      const std::size_t c = b * 32 + static_cast<std::size_t>(i);
      const float df = static_cast<float>(d), mf = static_cast<float>(m);
      const float want = df > 0 ? std::min(15.0f, std::max(0.0f, std::nearbyint((y[i] - mf) / df))) : 0.0f;
      ASSERT_EQ(Q4::code(q.data(), c), static_cast<unsigned>(want)) << "column " << c << " x=" << x[c];
      EXPECT_EQ(Q4::dequantize(q.data(), c, s.data()), std::fma(want, df, mf)) << "column " << c;
    }
  }
}

TEST(Q4, QuantizeMatchesTheDefinition) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t n : {32, 64, 128, 256}) {
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng) * 3.0f;
    x[5 % n] = 40.0f;  // an outlier channel
    std::vector<q4_block> q(n / 2);
    std::vector<BlockScale> s(n / 32);
    Q4::quantize_row(x.data(), q.data(), n, s.data());
    expect_q4_matches_definition(x, q, s);
    // Every value within half a step (plus the scale's and minimum's fp16 rounding) of its input.
    for (std::size_t c = 0; c < n; ++c) {
      const float d = static_cast<float>(s[c / 32].d);
      EXPECT_LE(std::fabs(Q4::dequantize(q.data(), c, s.data()) - x[c]), 0.5f * d * 1.01f + 0.01f) << c;
    }
  }
  // Half-way points round to the even code; 16-bit sources quantize as their float values do.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[static_cast<std::size_t>(i)] = static_cast<float>(i % 16) + (i >= 16 ? 0.5f : 0.0f);
  x[31] = 15.0f;  // range [0, 15]: d = 1, m = 0
  std::vector<q4_block> q(16);
  std::vector<BlockScale> s(1);
  Q4::quantize_row(x.data(), q.data(), 32, s.data());
  EXPECT_EQ(static_cast<float>(s[0].d), 1.0f);
  EXPECT_EQ(static_cast<float>(s[0].m), 0.0f);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(Q4::code(q.data(), static_cast<std::size_t>(i)), static_cast<unsigned>(i));
  EXPECT_EQ(Q4::code(q.data(), 16), 0u);   // 0.5 -> 0
  EXPECT_EQ(Q4::code(q.data(), 17), 2u);   // 1.5 -> 2
  EXPECT_EQ(Q4::code(q.data(), 18), 2u);   // 2.5 -> 2
  EXPECT_EQ(Q4::code(q.data(), 19), 4u);   // 3.5 -> 4
  // The byte layout: the even column in the low four bits, the odd one in the high four.
  EXPECT_EQ(q[0].bits, 0x10);  // columns 0 and 1: codes 0 and 1
  EXPECT_EQ(q[7].bits, 0xFE);  // columns 14 and 15: codes 14 and 15
  std::vector<kvattn::bf16> xb(x.begin(), x.end());
  std::vector<q4_block> qb(16);
  std::vector<BlockScale> sb(1);
  Q4::quantize_row(xb.data(), qb.data(), 32, sb.data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(qb[static_cast<std::size_t>(i)].bits, q[static_cast<std::size_t>(i)].bits);
}

TEST(Q4, ZerosConstantsSaturationAndNonFinite) {
  std::vector<q4_block> q(32);
  std::vector<BlockScale> s(2);
  const std::vector<float> zeros(64, 0.0f);
  Q4::quantize_row(zeros.data(), q.data(), 64, s.data());
  for (std::size_t c = 0; c < 64; ++c) EXPECT_EQ(Q4::dequantize(q.data(), c, s.data()), 0.0f);
  // Constant blocks: one of an fp16 number has d = 0 and reads back exactly; one of -0.3 (not an
  // fp16 number) has m = fp16(-0.3) below it and a tiny d that brings it back closer still.
  std::vector<float> constant(64, -0.3f);
  for (std::size_t c = 32; c < 64; ++c) constant[c] = 7.0f;
  Q4::quantize_row(constant.data(), q.data(), 64, s.data());
  expect_q4_matches_definition(constant, q, s);
  EXPECT_EQ(static_cast<float>(s[1].d), 0.0f);
  for (std::size_t c = 0; c < 32; ++c)
    EXPECT_LE(std::fabs(Q4::dequantize(q.data(), c, s.data()) + 0.3f), std::fabs(static_cast<float>(kvattn::fp16(-0.3f)) + 0.3f));
  for (std::size_t c = 32; c < 64; ++c) EXPECT_EQ(Q4::dequantize(q.data(), c, s.data()), 7.0f);
  // Beyond fp16's range: saturated to ±65504 (the largest magnitudes read back exactly there).
  std::vector<float> big(32, 1.0f);
  big[0] = 1e30f;
  big[1] = -std::numeric_limits<float>::max();
  Q4::quantize_row(big.data(), q.data(), 32, s.data());
  expect_q4_matches_definition(big, q, s);
  EXPECT_EQ(Q4::dequantize(q.data(), 1, s.data()), -65504.0f);
  EXPECT_NEAR(Q4::dequantize(q.data(), 0, s.data()), 65504.0f, 65504.0f * 1e-3f);
  // A NaN or an infinity anywhere in the row: every value of the row reads as NaN.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(64, 0.25f);
    x[40] = bad;
    Q4::quantize_row(x.data(), q.data(), 64, s.data());
    for (std::size_t c = 0; c < 64; ++c) EXPECT_TRUE(std::isnan(Q4::dequantize(q.data(), c, s.data()))) << bad << " column " << c;
  }
}

TEST(Q4Cache, LayoutAndRejectedShapes) {
  for (int page : {1, 7, 16})
    for (const GqaShape& shape : {GqaShape::gqa(8, 2, 128), GqaShape::gqa(3, 3, 32), GqaShape::mqa(4, 96)}) {
      SCOPED_TRACE(kvattn::detail::concat("page=", page, " kv_heads=", shape.kv_heads, " head_dim=", shape.head_dim));
      kvattn::PagedKvCache<q4_block> cache(CacheConfig{2, page, 3, shape});
      const kvattn::PageLayout& l = cache.layout();
      EXPECT_EQ(l.row_units, shape.head_dim / 2);
      EXPECT_EQ(l.scale_slots, shape.head_dim / 32);
      EXPECT_EQ(l.head_stride % 64, 0);
      EXPECT_GE(l.head_stride, std::int64_t{page} * shape.head_dim / 2);
      EXPECT_EQ(l.scale_offset, 2 * shape.kv_heads * l.head_stride);
      EXPECT_EQ(l.page_stride % 64, 0);
      EXPECT_GE(l.page_stride - l.scale_offset, 2 * std::int64_t{shape.kv_heads} * page * (shape.head_dim / 32) * 4);
      EXPECT_EQ(l.token_bytes(), 2 * std::int64_t{shape.kv_heads} * (shape.head_dim / 2 + shape.head_dim / 32 * 4));
    }
  const auto what_of = [](const kvattn::AttentionShape& shape) {
    return error_of([&] { kvattn::PagedKvCache<q4_block> c(CacheConfig{1, 16, 2, shape}); });
  };
  for (int d : {16, 48, 80, 1056}) {
    const std::string what = what_of(GqaShape::gqa(4, 2, d));
    EXPECT_NE(what.find("head_dim=" + std::to_string(d) + " must be a multiple of 32 up to 1024"), std::string::npos) << what;
  }
  EXPECT_NE(what_of(kvattn::MlaShape{4, 64, 16, 32, 32, 0}).find("GQA-family pages"), std::string::npos);
  const std::string what = error_of([] { kvattn::PagedKvCache<kvattn::hadamard<q4_block>> c(CacheConfig{1, 16, 2, GqaShape::gqa(4, 2, 96)}); });
  EXPECT_NE(what.find("head_dim=96: head_dim must be a power of two"), std::string::npos) << what;
}

TEST(Q4Cache, ScalesTravelWithTheirPages) {
  scales_travel_with_their_pages<q4_block>(GqaShape::gqa(6, 3, 64));
  scales_travel_with_their_pages<kvattn::hadamard<q4_block>>(GqaShape::gqa(6, 3, 64));
}

// ---- the MLA formats: the latent in blocks of 128 with an fp32 scale each, the rotary key in bf16 --

using kvattn::fp8_e4m3_latent;
using kvattn::int8_latent;
using kvattn::MlaShape;
using Fp8Latent = kvattn::format_traits<fp8_e4m3_latent>;
using Int8Latent = kvattn::format_traits<int8_latent>;

/// n latent values: normal times 3, with one value 1000 times larger in every other block (its
/// block's small values fall to fp8's subnormals and to int8's zero).
std::vector<float> latent_values(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  for (std::size_t b = 0; b < n; b += 256) x[b + rng() % 128] *= 1000.0f;
  return x;
}

/// Each block's scale and codes against the definition (format.hpp): fp8, s = max|x| / 448 and
/// q = e4m3(x · (448 / max|x|)); int8, s = max|x| / 127 and q = round-half-even(x · (127 / max|x|));
/// a value reads as q · s, rounded once.
void expect_latent_matches_definition(const std::vector<float>& x, const std::vector<fp8_e4m3_latent>& f8,
                                      const std::vector<float>& s8, const std::vector<int8_latent>& i8, const std::vector<float>& si) {
  for (std::size_t b = 0; b < x.size() / 128; ++b) {
    float amax = 0;
    for (std::size_t i = b * 128; i < (b + 1) * 128; ++i) amax = std::max(amax, std::fabs(x[i]));
    ASSERT_EQ(s8[b], amax / 448.0f) << "block " << b;
    ASSERT_EQ(si[b], amax / 127.0f) << "block " << b;
    for (std::size_t i = b * 128; i < (b + 1) * 128; ++i) {
      EXPECT_EQ(f8[i].bits, kvattn::fp8_e4m3_encode(x[i] * (448.0f / amax))) << "element " << i;
      EXPECT_EQ(i8[i].q, static_cast<std::int8_t>(std::nearbyint(x[i] * (127.0f / amax)))) << "element " << i;
      EXPECT_EQ(Fp8Latent::dequantize(f8.data(), i, s8.data()), static_cast<float>(e4m3_value(f8[i].bits) * s8[b])) << i;
      EXPECT_EQ(Int8Latent::dequantize(i8.data(), i, si.data()), static_cast<float>(i8[i].q * double(si[b]))) << i;
    }
  }
}

TEST(LatentFormats, QuantizeEachBlockAsDefined) {
  for (std::size_t n : {128u, 256u, 512u}) {
    SCOPED_TRACE(n);
    const std::vector<float> x = latent_values(n, static_cast<unsigned>(n));
    std::vector<fp8_e4m3_latent> f8(n);
    std::vector<int8_latent> i8(n);
    std::vector<float> s8(n / 128), si(n / 128);
    Fp8Latent::quantize_latent(x.data(), f8.data(), s8.data(), n);
    Int8Latent::quantize_latent(x.data(), i8.data(), si.data(), n);
    expect_latent_matches_definition(x, f8, s8, i8, si);
  }
}

TEST(LatentFormats, ZerosAndNonFiniteValuesAreTheirBlocksOwn) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(384, 0.0f);  // block 0 zeros, block 1 holds a non-finite value, block 2 ordinary
    x[130] = bad;
    for (std::size_t i = 256; i < 384; ++i) x[i] = static_cast<float>(i % 7) - 3.0f;
    std::vector<fp8_e4m3_latent> f8(384);
    std::vector<int8_latent> i8(384);
    std::vector<float> s8(3), si(3);
    Fp8Latent::quantize_latent(x.data(), f8.data(), s8.data(), 384);
    Int8Latent::quantize_latent(x.data(), i8.data(), si.data(), 384);
    EXPECT_EQ(s8[0], 0.0f);
    EXPECT_EQ(si[0], 0.0f);
    EXPECT_TRUE(std::isnan(s8[1]));
    EXPECT_TRUE(std::isnan(si[1]));
    for (std::size_t i = 0; i < 128; ++i) {
      EXPECT_EQ(Fp8Latent::dequantize(f8.data(), i, s8.data()), 0.0f);
      EXPECT_EQ(Int8Latent::dequantize(i8.data(), i, si.data()), 0.0f);
      EXPECT_TRUE(std::isnan(Fp8Latent::dequantize(f8.data(), 128 + i, s8.data()))) << i;
      EXPECT_TRUE(std::isnan(Int8Latent::dequantize(i8.data(), 128 + i, si.data()))) << i;
      // The ordinary block, within half a step of its values: fp8's 2^-4 of the value, int8's s / 2.
      EXPECT_LE(std::fabs(Fp8Latent::dequantize(f8.data(), 256 + i, s8.data()) - x[256 + i]), std::fabs(x[256 + i]) / 16) << i;
      EXPECT_LE(std::fabs(Int8Latent::dequantize(i8.data(), 256 + i, si.data()) - x[256 + i]), si[2] / 2 * (1 + 1e-6f)) << i;
    }
  }
}

/// A cache of format F: its rows hold the codes, the scales and the rotary key's bf16 elements
/// in FlashMLA's order; read_latent returns the definition's values; fork, copy-on-write and
/// truncate carry the rows (scales included) with their pages.
template <class F> void latent_cache_rows(const MlaShape& shape) {
  const int Dc = shape.latent_dim, Dr = shape.rope_dim;
  const std::int64_t row = Dc + Dc / 128 * 4 + 2 * Dr;
  for (int page : {1, 7, 16}) {
    SCOPED_TRACE(kvattn::detail::concat("page=", page, " latent=", Dc, " rope=", Dr));
    kvattn::PagedKvCache<F> cache(CacheConfig{2, page, 8, shape});
    const kvattn::PageLayout& l = cache.layout();
    EXPECT_EQ(l.row_stride, row);
    EXPECT_EQ(l.rope_offset, Dc + Dc / 128 * 4);
    EXPECT_EQ(l.latent_block, 128);
    EXPECT_EQ(l.token_bytes(), row);
    EXPECT_EQ(l.page_stride % 64, 0);
    EXPECT_GE(l.page_stride, page * row);
    EXPECT_LT(l.page_stride, page * row + 64);
    const auto seq = cache.add_sequence();
    const std::int64_t n = std::min<std::int64_t>(2 * page + 1, 8 * page);
    cache.append(seq, n);
    std::vector<std::vector<float>> lat, rope;
    for (std::int64_t t = 0; t < n; ++t) {
      lat.push_back(latent_values(static_cast<std::size_t>(Dc), static_cast<unsigned>(t + 1)));
      rope.push_back(latent_values(static_cast<std::size_t>(Dr) * 128, static_cast<unsigned>(t + 100)));
      rope.back().resize(static_cast<std::size_t>(Dr));
      cache.write_latent(seq, 1, t, lat.back().data(), rope.back().data());
    }
    const auto expect_token = [&](kvattn::SeqId s, std::int64_t t, const std::vector<float>& x, const std::vector<float>& r) {
      std::vector<F> codes(static_cast<std::size_t>(Dc));
      std::vector<float> scales(static_cast<std::size_t>(Dc / 128)), got(static_cast<std::size_t>(Dc)), got_rope(static_cast<std::size_t>(Dr));
      kvattn::format_traits<F>::quantize_latent(x.data(), codes.data(), scales.data(), static_cast<std::size_t>(Dc));
      cache.read_latent(s, 1, t, got.data(), got_rope.data());
      for (int c = 0; c < Dc; ++c)
        ASSERT_EQ(got[static_cast<std::size_t>(c)], kvattn::format_traits<F>::dequantize(codes.data(), static_cast<std::size_t>(c), scales.data()))
            << "token " << t << " column " << c;
      for (int c = 0; c < Dr; ++c) ASSERT_EQ(got_rope[static_cast<std::size_t>(c)], static_cast<float>(kvattn::bf16(r[static_cast<std::size_t>(c)])));
      // The bytes, in FlashMLA's order: codes, scales, bf16 rotary key.
      const kvattn::BatchPageTable table = cache.page_table({s});
      const auto* bytes = reinterpret_cast<const unsigned char*>(cache.view(table, 1).page(cache.pages(s)[static_cast<std::size_t>(t / page)]) +
                                                                 (t % page) * row);
      ASSERT_EQ(std::memcmp(bytes, codes.data(), static_cast<std::size_t>(Dc)), 0);
      ASSERT_EQ(std::memcmp(bytes + Dc, scales.data(), scales.size() * 4), 0);
      std::vector<kvattn::bf16> r16(r.begin(), r.end());
      ASSERT_EQ(std::memcmp(bytes + Dc + Dc / 128 * 4, r16.data(), r16.size() * 2), 0);
    };
    for (std::int64_t t = 0; t < n; ++t) expect_token(seq, t, lat[static_cast<std::size_t>(t)], rope[static_cast<std::size_t>(t)]);
    // A fork shares the pages; writing its last token copies that page, and the parent keeps its rows.
    const auto child = cache.fork(seq);
    const std::vector<float> other = latent_values(static_cast<std::size_t>(Dc), 999), other_rope(static_cast<std::size_t>(Dr), 0.25f);
    cache.write_latent(child, 1, n - 1, other.data(), other_rope.data());
    expect_token(child, n - 1, other, other_rope);
    for (std::int64_t t = 0; t < n; ++t) expect_token(seq, t, lat[static_cast<std::size_t>(t)], rope[static_cast<std::size_t>(t)]);
    cache.truncate(seq, 1);
    expect_token(seq, 0, lat[0], rope[0]);
  }
}

TEST(LatentCache, RowsHoldCodesScalesAndTheRotaryKeyAndTravelWithTheirPages) {
  latent_cache_rows<fp8_e4m3_latent>(MlaShape{16, 512, 64, 128, 128, 0});  // 656 bytes a token
  latent_cache_rows<int8_latent>(MlaShape{4, 256, 6, 32, 32, 0});
  EXPECT_EQ((kvattn::PageLayout::of<fp8_e4m3_latent>(MlaShape{128, 512, 64, 128, 128, 1536}, 64).token_bytes()), 656);
}

TEST(LatentCache, ShapesTheFormatsCannotHoldAreRejectedNamingTheValues) {
  for (int latent : {64, 100, 192, 520}) {
    const std::string what = error_of([&] { kvattn::PagedKvCache<fp8_e4m3_latent> c(CacheConfig{1, 16, 2, MlaShape{4, latent, 16, 32, 32, 0}}); });
    EXPECT_NE(what.find("fp8_latent format quantizes the latent in blocks of 128 values: latent_dim=" + std::to_string(latent) +
                        " must be a multiple of 128"),
              std::string::npos)
        << what;
  }
  const std::string gqa = error_of([] { kvattn::PagedKvCache<int8_latent> c(CacheConfig{1, 16, 2, GqaShape::gqa(4, 2, 128)}); });
  EXPECT_NE(gqa.find("int8_latent format holds MLA rows"), std::string::npos) << gqa;
  const std::string row = error_of([] { kvattn::PagedKvCache<int8_row> c(CacheConfig{1, 16, 2, MlaShape{4, 128, 16, 32, 32, 0}}); });
  EXPECT_NE(row.find("an MLA cache is fp32, fp16, bf16, fp8_e4m3_latent or int8_latent"), std::string::npos) << row;
}

// ---- quantization error of attention ----------------------------------------------------------

/// Σ (got − ref)² / Σ ref².
double nmse(const std::vector<double>& got, const std::vector<double>& ref) {
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    err += (got[i] - ref[i]) * (got[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return err / norm;
}

/// Keys: standard normal with `outliers` channels per KV head scaled by 20-50 (the same channels
/// for every token, as in real key caches); values and queries standard normal.
struct RealisticInputs {
  std::vector<float> k, v, q;
};
RealisticInputs realistic(const GqaShape& s, std::int64_t L, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> big(20.0f, 50.0f);
  std::vector<float> channel_scale(static_cast<std::size_t>(s.kv_heads) * s.head_dim, 1.0f);
  for (int h = 0; h < s.kv_heads; ++h)
    for (int i = 0; i < 3; ++i) channel_scale[static_cast<std::size_t>(h * s.head_dim) + rng() % static_cast<unsigned>(s.head_dim)] = big(rng);
  RealisticInputs in;
  in.k.resize(static_cast<std::size_t>(L) * s.kv_heads * s.head_dim);
  in.v.resize(in.k.size());
  in.q.resize(static_cast<std::size_t>(s.q_heads) * s.head_dim);
  for (std::size_t i = 0; i < in.k.size(); ++i) in.k[i] = normal(rng) * channel_scale[i % channel_scale.size()];
  for (float& x : in.v) x = normal(rng);
  for (float& x : in.q) x = normal(rng);
  return in;
}

/// Σ (out − ref)² / Σ ref² of one decode step on a cache of format T holding `in`, against the
/// double reference on the fp32 inputs; int8_queries, u8_probabilities: DecodeParams' (int8
/// formats only).
/// A format with one scale per layer gets the scales a checkpoint's calibration gives: the
/// layer's largest |key| (|value|) over 448.
template <class T>
double decode_nmse(const GqaShape& s, std::int64_t L, const RealisticInputs& in, bool int8_queries = false,
                   bool u8_probabilities = false) {
  std::vector<kvattn::KvScales> scales;
  if constexpr (kvattn::format_traits<T>::layer_scale) {
    const auto amax = [](const std::vector<float>& x) {
      float m = 0;
      for (float v : x) m = std::max(m, std::fabs(v));
      return m;
    };
    scales.push_back(kvattn::KvScales{amax(in.k) / 448, amax(in.v) / 448});
  }
  kvattn::PagedKvCache<T> cache(CacheConfig{1, 16, (L + 15) / 16, s}, scales);
  kvattn::PagedKvCache<float> exact(CacheConfig{1, 16, (L + 15) / 16, s});
  const auto seq = cache.add_sequence(), eseq = exact.add_sequence();
  cache.append(seq, L);
  exact.append(eseq, L);
  cache.write(seq, 0, 0, L, in.k.data(), in.v.data());
  exact.write(eseq, 0, 0, L, in.k.data(), in.v.data());
  // The int8 formats through the kernel (int8 queries and 8-bit probabilities are the kernel's
  // arithmetic); the others through the reference on the cache's dequantized keys and values,
  // which the kernels equal within fp32 rounding (test_decode, test_prefill): the error here is
  // the format's, and this file compiles no kernel of theirs.
  std::vector<double> out;
  if constexpr (kvattn::is_int8_format_v<T>) {
    const kvattn::BatchPageTable table = cache.page_table({seq});
    kvattn::DecodePlan plan;
    kvattn::DecodeParams params;
    params.int8_queries = int8_queries;
    params.u8_probabilities = u8_probabilities;
    plan.make(cache.view(table, 0), s, params, kvattn::SerialFor{});
    std::vector<float> got(in.q.size());
    kvattn::decode(cache.view(table, 0), in.q.data(), got.data(), nullptr, plan);
    out.assign(got.begin(), got.end());
  } else {
    std::vector<double> out_lse;
    reference::decode(cache, seq, 0, s, in.q.data(), reference::Options{}, out, out_lse);
  }
  std::vector<double> ref, ref_lse;
  reference::decode(exact, eseq, 0, s, in.q.data(), reference::Options{}, ref, ref_lse);
  return nmse(out, ref);
}

TEST(FormatAccuracy, AttentionErrorOnKeysWithOutlierChannels) {
  // For comparison: ggml bounds every format's flash attention at NMSE <= 5e-4 in its own test.
  const GqaShape shape = GqaShape::gqa(32, 8, 128);
  double worst_int8 = 0, worst_rotated = 0, worst_bf16 = 0, worst_int8_q = 0, worst_rotated_q = 0, worst_rotated_qp = 0;
  double worst_fp8 = 0, worst_fp8_rotated = 0, worst_fp8_layer = 0, worst_q4 = 0, worst_q4_rotated = 0;
  for (std::int64_t L : {256, 2048}) {
    const RealisticInputs in = realistic(shape, L, static_cast<unsigned>(L));
    const double bf16 = decode_nmse<kvattn::bf16>(shape, L, in), fp16 = decode_nmse<kvattn::fp16>(shape, L, in);
    const double int8 = decode_nmse<int8_row>(shape, L, in), rotated = decode_nmse<kvattn::hadamard<int8_row>>(shape, L, in);
    const double int8_q = decode_nmse<int8_row>(shape, L, in, true);
    const double rotated_q = decode_nmse<kvattn::hadamard<int8_row>>(shape, L, in, true);
    const double int8_qp = decode_nmse<int8_row>(shape, L, in, true, true);
    const double rotated_qp = decode_nmse<kvattn::hadamard<int8_row>>(shape, L, in, true, true);
    const double fp8 = decode_nmse<fp8_e4m3_row>(shape, L, in), fp8_rotated = decode_nmse<kvattn::hadamard<fp8_e4m3_row>>(shape, L, in);
    const double fp8_layer = decode_nmse<fp8_e4m3_layer>(shape, L, in);
    const double q4 = decode_nmse<kvattn::q4_block>(shape, L, in), q4_rotated = decode_nmse<kvattn::hadamard<kvattn::q4_block>>(shape, L, in);
    std::printf("context %lld: NMSE of decode's output: q4 %.2e, q4_hadamard %.2e\n", static_cast<long long>(L), q4, q4_rotated);
    worst_q4 = std::max(worst_q4, q4);
    worst_q4_rotated = std::max(worst_q4_rotated, q4_rotated);
    std::printf("context %lld: NMSE of decode's output: bf16 %.2e, fp16 %.2e, int8 %.2e, int8_hadamard %.2e, fp8 %.2e, "
                "fp8_hadamard %.2e, fp8_layer %.2e; int8 queries: int8 %.2e, int8_hadamard %.2e; and u8 probabilities: "
                "int8 %.2e, int8_hadamard %.2e\n",
                static_cast<long long>(L), bf16, fp16, int8, rotated, fp8, fp8_rotated, fp8_layer, int8_q, rotated_q, int8_qp,
                rotated_qp);
    worst_fp8_layer = std::max(worst_fp8_layer, fp8_layer);
    worst_fp8 = std::max(worst_fp8, fp8);
    worst_fp8_rotated = std::max(worst_fp8_rotated, fp8_rotated);
    worst_rotated_qp = std::max(worst_rotated_qp, rotated_qp);
    worst_int8_q = std::max(worst_int8_q, int8_qp);
    worst_int8_q = std::max(worst_int8_q, int8_q);
    worst_rotated_q = std::max(worst_rotated_q, rotated_q);
    worst_int8 = std::max(worst_int8, int8);
    worst_rotated = std::max(worst_rotated, rotated);
    worst_bf16 = std::max(worst_bf16, bf16);
  }
  // Bounds about twice what these inputs give (the README's table): int8 with one scale per
  // row loses most of its precision to the outlier channels; rotated, it stays within about
  // ggml's bound for its own (uniform, outlier-free) inputs.
  EXPECT_LT(worst_bf16, 5e-4);
  EXPECT_LT(worst_int8, 6e-2);
  EXPECT_LT(worst_rotated, 1e-3);
  EXPECT_LT(worst_rotated, worst_int8 / 20);  // what the rotation buys on such keys
  // int8 queries (DecodeParams::int8_queries) add the query's rounding: about twice the rotated
  // format's error, nothing visible beside int8's own.
  EXPECT_LT(worst_int8_q, 6e-2);
  EXPECT_LT(worst_rotated_q, 2e-3);
  // 8-bit probabilities too (DecodeParams::u8_probabilities) add almost nothing (9.8e-4).
  EXPECT_LT(worst_rotated_qp, 2e-3);
  // fp8 e4m3 (4.5e-3 here): a step relative to each value (3 mantissa bits), not one step for the
  // whole row as int8's, so the outlier channels cost it little, and the largest value is exact.
  // Rotated, every value is about the same size and none is exact: its keys' error is a
  // Gaussian row's (about 3x the unrotated one's on these keys) and the output's about 4x worse
  // (2.1e-2). The rotation buys fp8 nothing; it is there for completeness.
  EXPECT_LT(worst_fp8, 1e-2);
  EXPECT_LT(worst_fp8, worst_int8 / 3);
  EXPECT_LT(worst_fp8_rotated, 5e-2);
  // fp8 with one scale per layer (3.5e-2 here, scales from the layer's largest values): the
  // same relative step, but the row's largest value is no longer exact, and on these keys that
  // value is an outlier channel that dominates the scores.
  EXPECT_LT(worst_fp8_layer, 7e-2);
  // 4 bits in blocks of 32 with a scale and a minimum (q4_block): 16 levels from the block's
  // smallest to its largest value. On these keys neither form is usable (2.3e-1 unrotated,
  // 7.5e-2 and 1.5e-1 rotated): a block holding an outlier channel spends its levels on it and
  // moves the block's small values together (the grid has no zero), and rotated, every value
  // carries a share of the outliers, so the whole row's step is large against the scores'
  // differences. 4-bit keys need an 8-bit format for the keys (K and V in different formats).
  EXPECT_LT(worst_q4, 0.4);
  EXPECT_LT(worst_q4_rotated, 0.25);
  EXPECT_LT(worst_q4_rotated, worst_q4 / 1.3);  // what the rotation buys: 3x at 256 tokens, 1.6x at 2048
}


/// K and V rounded through a 4-bit grid per block of 32 (`round_block` maps a block in place),
/// attended in double by the reference: Σ (out − ref)² / Σ ref² against the unrounded inputs.
template <class Round>
double rounded_nmse(const GqaShape& s, std::int64_t L, const RealisticInputs& in, bool keys, bool values, Round round_block) {
  RealisticInputs r = in;
  for (auto [on, x] : {std::pair{keys, &r.k}, std::pair{values, &r.v}})
    if (on)
      for (std::size_t b = 0; b < x->size(); b += 32) round_block(x->data() + b);
  const auto attend = [&](const RealisticInputs& kv) {
    kvattn::PagedKvCache<float> cache(CacheConfig{1, 16, (L + 15) / 16, s});
    const auto seq = cache.add_sequence();
    cache.append(seq, L);
    cache.write(seq, 0, 0, L, kv.k.data(), kv.v.data());
    std::vector<double> out, lse;
    reference::decode(cache, seq, 0, s, in.q.data(), reference::Options{}, out, lse);
    return out;
  };
  const std::vector<double> ref = attend(in), got = attend(r);
  return nmse(got, ref);
}

TEST(FormatAccuracy, WhyQ4HasAnOffsetGrid) {
  // q4_block's grid (16 levels from the block's minimum to its maximum, q4_1-like) against a
  // symmetric one (q4_0-like: d = the block's largest-magnitude value / -8, q in [-8, 7], x ≈ q · d,
  // d in fp16), on keys and values rounded through each and attended in double.
  const auto offset_grid = [](float* x) {
    q4_block q[16];
    BlockScale sc[1];
    Q4::quantize_row(x, q, 32, sc);
    for (std::size_t c = 0; c < 32; ++c) x[c] = Q4::dequantize(q, c, sc);
  };
  const auto symmetric_grid = [](float* x) {
    float top = 0;
    for (int i = 0; i < 32; ++i)
      if (std::fabs(x[i]) > std::fabs(top)) top = x[i];
    const float d = static_cast<float>(kvattn::fp16(top / -8.0f)), inv = d != 0 ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; ++i) x[i] = (std::min(15.0f, std::max(0.0f, std::nearbyint(x[i] * inv) + 8.0f)) - 8.0f) * d;
  };
  const GqaShape shape = GqaShape::gqa(32, 8, 128);
  const std::int64_t L = 2048;
  RealisticInputs gaussian = realistic(shape, L, 5);
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : gaussian.k) x = normal(rng);  // no outlier channels
  const RealisticInputs outliers = realistic(shape, L, 7);
  const double g_offset = rounded_nmse(shape, L, gaussian, true, true, offset_grid);
  const double g_symmetric = rounded_nmse(shape, L, gaussian, true, true, symmetric_grid);
  const double v_offset = rounded_nmse(shape, L, gaussian, false, true, offset_grid);
  const double v_symmetric = rounded_nmse(shape, L, gaussian, false, true, symmetric_grid);
  const double k_offset = rounded_nmse(shape, L, outliers, true, false, offset_grid);
  const double k_symmetric = rounded_nmse(shape, L, outliers, true, false, symmetric_grid);
  std::printf("NMSE of attention over K/V rounded to 4 bits, offset (q4_block) / symmetric grid: standard normal K and V "
              "%.2e / %.2e, values alone %.2e / %.2e, keys with outlier channels alone %.2e / %.2e\n",
              g_offset, g_symmetric, v_offset, v_symmetric, k_offset, k_symmetric);
  EXPECT_LT(g_offset, g_symmetric);  // ordinary rows: the offset grid spends no level outside the block's range
  EXPECT_LT(v_offset, v_symmetric);
  EXPECT_GT(k_offset, k_symmetric);  // keys with outliers: the symmetric grid keeps a zero
}

/// Σ (out − ref)² / Σ ref² of MLA decode attention (the reference, on the rows read_latent
/// returns) over a cache of format T holding `latent` [L][latent_dim] and `rope` [L][rope_dim],
/// against the same over an fp32 cache.
template <class T>
double mla_nmse(const MlaShape& s, std::int64_t L, const std::vector<float>& latent, const std::vector<float>& rope,
                const std::vector<float>& q) {
  const auto attend = [&](auto& cache) {
    const auto seq = cache.add_sequence();
    cache.append(seq, L);
    cache.write_latent(seq, 0, 0, L, latent.data(), rope.data());
    reference::Options o;
    o.scale = 1.0 / std::sqrt(double(s.qk_head_dim()));
    std::vector<double> out, lse;
    reference::mla_attention(cache, seq, s, q.data(), o, out, lse);
    return out;
  };
  kvattn::PagedKvCache<T> cache(CacheConfig{1, 16, (L + 15) / 16, s});
  kvattn::PagedKvCache<float> exact(CacheConfig{1, 16, (L + 15) / 16, s});
  const std::vector<double> out = attend(cache), ref = attend(exact);
  return nmse(out, ref);
}

TEST(FormatAccuracy, MlaLatentFormats) {
  // DeepSeek-V2-Lite's head layout, 2,048 tokens: latents standard normal with four channels
  // 20-50x larger (the same for every token), rotary keys and absorbed queries standard normal.
  const MlaShape shape{16, 512, 64, 128, 128, 0};
  const std::int64_t L = 2048;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> big(20.0f, 50.0f);
  std::vector<float> channel(512, 1.0f);
  for (int i = 0; i < 4; ++i) channel[rng() % 512] = big(rng);
  std::vector<float> latent(static_cast<std::size_t>(L) * 512), rope(static_cast<std::size_t>(L) * 64), q(16 * 576);
  for (std::size_t i = 0; i < latent.size(); ++i) latent[i] = normal(rng) * channel[i % 512];
  for (float& x : rope) x = normal(rng);
  for (float& x : q) x = normal(rng);
  const double bf16 = mla_nmse<kvattn::bf16>(shape, L, latent, rope, q);
  const double fp8 = mla_nmse<fp8_e4m3_latent>(shape, L, latent, rope, q);
  const double int8 = mla_nmse<int8_latent>(shape, L, latent, rope, q);
  std::printf("MLA, context %lld: NMSE of decode's output: bf16 %.2e, fp8_latent %.2e, int8_latent %.2e\n", static_cast<long long>(L),
              bf16, fp8, int8);
  // Bounds about twice these inputs' (3.1e-5, 3.0e-4, 1.3e-3: the README's table). fp8's step is
  // relative to each value and each block's largest value is exact; int8's is one step for the
  // whole block, set by the block's outlier channel, so its ordinary values keep fewer bits.
  EXPECT_LT(bf16, 1e-4);
  EXPECT_LT(fp8, 6e-4);
  EXPECT_LT(int8, 3e-3);
  EXPECT_LT(fp8, int8 / 2);
}

}  // namespace
