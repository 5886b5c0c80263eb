// cuda::write_kv and cuda::write_latent into the 8-bit formats (int8_row, fp8_e4m3_row,
// fp8_e4m3_layer, fp8_e4m3_latent, int8_latent) against the host cache's writes, byte for byte
// over the whole pool (codes, scale blocks, latent scales, rotary keys): the same steps on a host
// and a device cache (page sizes 1 and 7, writes spanning pages, a write into a forked page,
// copy-on-write), from fp32, fp16 and bf16 sources. The rows: Gaussian of scales from 2^-20 to
// 2^20, zeros, one huge value among small ones (fp8 saturation, subnormal codes), values on the
// codes' ties and among fp8's subnormals, subnormal inputs, and for the row and latent formats rows
// holding NaN or an infinity (scale NaN, codes 0). fp8_e4m3_layer's device writes of NaN and
// infinities (refused by the host) store what append.hpp says and are counted.
// Every test here runs a kernel: each needs a CUDA device and says so when it skips (a device
// cache's pool is device memory from its construction on).
#include <kvattn/core.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "append_kernels.hpp"
#include "device.hpp"

namespace {

using cuda_tests::QuantStep;
using cuda_tests::Source;
using kvattn::GqaShape;
using kvattn::MlaShape;

const char* name(Source s) { return s == Source::fp16 ? "fp16" : s == Source::bf16 ? "bf16" : "fp32"; }

/// Fills x [n] (n a multiple of `chunk`) chunk by chunk, each a pattern of the list above chosen
/// by the chunk's index; `kmax` is the format's largest code (127 or 448), `non_finite` whether
/// NaN and infinities may appear.
void fill(std::vector<float>& x, std::size_t chunk, float kmax, bool non_finite, Source source, std::mt19937& rng) {
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20), pick(0, 63);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // The smallest normal of the source type, and a value well inside its subnormals.
  const float tiny = source == Source::fp16 ? 0x1p-20f : 0x1p-140f;
  for (std::size_t c0 = 0, c = 0; c0 < x.size(); c0 += chunk, ++c) {
    float* r = x.data() + c0;
    switch (c % 9) {
      case 3:  // zeros
        for (std::size_t i = 0; i < chunk; ++i) r[i] = 0.0f;
        break;
      case 4:  // one huge value: the rest falls to fp8's subnormal codes (or 0)
        for (std::size_t i = 0; i < chunk; ++i) r[i] = gauss(rng) * 0.01f;
        r[pick(rng) % chunk] = (pick(rng) % 2 ? 1.0f : -1.0f) * (source == Source::fp16 ? 60000.0f : 1e30f);
        break;
      case 5:  // amax = kmax: the codes are of x itself; ties of the int8 and e4m3 grids and fp8 subnormals
        for (std::size_t i = 0; i < chunk; ++i) {
          const int k = pick(rng);
          const float sign = k % 2 ? -1.0f : 1.0f;
          if (kmax == 127.0f)
            r[i] = sign * (static_cast<float>(k) + 0.5f);  // halves: ties to even
          else if (k < 32)
            r[i] = sign * static_cast<float>(2 * k + 1) * 0x1p-10f;  // between subnormal codes (steps of 2^-9)
          else
            r[i] = sign * (1.0f + static_cast<float>(2 * (k % 8) + 1) / 16.0f) * std::ldexp(1.0f, k % 12 - 4);  // normal ties
        }
        r[0] = kmax;
        break;
      case 6:  // NaN or an infinity (the row and latent formats); else Gaussian
        for (std::size_t i = 0; i < chunk; ++i) r[i] = gauss(rng);
        if (non_finite) r[pick(rng) % chunk] = c % 27 == 6 ? nan : c % 27 == 15 ? inf : -inf;
        break;
      case 7:  // subnormal inputs of the source type
        for (std::size_t i = 0; i < chunk; ++i) r[i] = gauss(rng) * tiny;
        break;
      default: {  // Gaussian of a random scale
        const float s = std::ldexp(1.0f, exponent(rng));
        for (std::size_t i = 0; i < chunk; ++i) r[i] = gauss(rng) * s;
      }
    }
  }
}

template <class Src> std::vector<Src> converted(const std::vector<float>& x) {
  std::vector<Src> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = kvattn::from_float<Src>(x[i]);
  return y;
}

/// The first byte where the pools differ, or -1.
std::int64_t first_difference(const unsigned char* a, const unsigned char* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<std::int64_t>(i);
  return -1;
}

/// The steps of every format's test: writes spanning pages, a fork written into (copy-on-write of
/// the shared pages), a rewrite of a shared page by the parent, a second layer.
std::vector<QuantStep> common_steps() {
  using S = QuantStep;
  return {
      {S::add},                                                       // seq 0
      {S::append, 0, 0, 30}, {S::write, 0, 0, 30, 0}, {S::write, 0, 0, 30, 1},
      {S::fork, 0},                                                   // seq 1 shares seq 0's pages
      {S::append, 1, 0, 5},  {S::write, 1, 26, 9, 0},                 // copy-on-write of shared pages
      {S::write, 0, 3, 2, 1},                                         // seq 0 rewrites a shared page in layer 1
      {S::add},                                                       // seq 2
      {S::append, 2, 0, 1},  {S::write, 2, 0, 1, 1},
  };
}

std::int64_t rows_written(const std::vector<QuantStep>& steps) {
  std::int64_t rows = 0;
  for (const auto& s : steps) rows += s.kind == QuantStep::write ? s.count : 0;
  return rows;
}

/// The steps on a host PagedKvCache<T> (writes from Src) and on a device one; the page tables and
/// the pools must be the same, byte for byte. Counts the pool's 4-byte words holding the host's
/// quiet NaN in *nan_scales.
template <class T, class Src>
void compare_with_host(const kvattn::CacheConfig& config, const std::vector<kvattn::KvScales>& scales,
                       const std::vector<QuantStep>& steps, Source source, const std::vector<float>& a, const std::vector<float>& b,
                       std::size_t wa, std::size_t wb, int* nan_scales) {
  const std::vector<Src> ha = converted<Src>(a), hb = converted<Src>(b);
  kvattn::PagedKvCache<T> host(config, scales);
  std::vector<kvattn::SeqId> seqs;
  const std::string host_error = cuda_tests::replay(host, steps, seqs, [&](kvattn::SeqId seq, const QuantStep& s, std::size_t row) {
    if constexpr (kvattn::format_traits<T>::latent_block > 0)
      host.write_latent(seq, s.layer, s.first, s.count, ha.data() + row * wa, hb.data() + row * wb);
    else
      host.write(seq, s.layer, s.first, s.count, ha.data() + row * wa, hb.data() + row * wb);
  });
  const cuda_tests::DeviceReplay d = cuda_tests::replay_on_device_quantized<T>(config, scales, steps, source, a, b);
  EXPECT_EQ(host_error, "");
  EXPECT_EQ(d.error, "");
  EXPECT_EQ(d.non_finite, 0u);
  ASSERT_EQ(d.tables.size(), seqs.size());
  for (std::size_t s = 0; s < seqs.size(); ++s) EXPECT_EQ(d.tables[s], host.pages(seqs[s])) << "sequence " << s;
  ASSERT_EQ(d.pool.size(), host.pool_bytes());
  const auto* h = reinterpret_cast<const unsigned char*>(host.data());
  const std::int64_t at = first_difference(d.pool.data(), h, d.pool.size());
  EXPECT_EQ(at, -1) << "the pools differ first at byte " << at << " (layer stride " << host.pool_bytes() / config.layers
                    << ", page stride " << host.layout().page_stride << "): device " << int{d.pool[static_cast<std::size_t>(at < 0 ? 0 : at)]}
                    << ", host " << int{h[at < 0 ? 0 : at]};
  // The NaN scales the inputs made (a row or block holding NaN or an infinity), read as floats.
  for (std::size_t i = 0; i + 4 <= d.pool.size(); i += 4) {
    float f;
    std::memcpy(&f, d.pool.data() + i, 4);
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if (u == 0x7FC00000u && std::isnan(f)) ++*nan_scales;
  }
}

template <class T>
void check_format(const kvattn::CacheConfig& config, const std::vector<kvattn::KvScales>& scales, float kmax, bool non_finite) {
  const std::vector<QuantStep> steps = common_steps();
  const std::int64_t rows = rows_written(steps);
  std::size_t wa, wb, chunk;
  if constexpr (kvattn::format_traits<T>::latent_block > 0) {
    const auto& m = std::get<MlaShape>(config.shape);
    wa = static_cast<std::size_t>(m.latent_dim);
    wb = static_cast<std::size_t>(m.rope_dim);
    chunk = 128;
  } else {
    const auto& g = std::get<GqaShape>(config.shape);
    wa = wb = static_cast<std::size_t>(g.kv_heads) * g.head_dim;
    chunk = static_cast<std::size_t>(g.head_dim);
  }
  for (Source source : {Source::fp32, Source::fp16, Source::bf16}) {
    SCOPED_TRACE(std::string("format=") + std::string(kvattn::format_traits<T>::name) + " source=" + name(source) +
                 " page_size=" + std::to_string(config.page_size));
    std::mt19937 rng(11);
    std::vector<float> a(static_cast<std::size_t>(rows) * wa), b(static_cast<std::size_t>(rows) * wb);
    fill(a, chunk, kmax, non_finite, source, rng);
    if constexpr (kvattn::format_traits<T>::latent_block > 0) {
      std::normal_distribution<float> gauss(0.0f, 2.0f);  // the rotary key: rounded to bf16
      for (float& x : b) x = gauss(rng);
    } else {
      fill(b, chunk, kmax, non_finite, source, rng);
    }
    int nan_scales = 0;
    switch (source) {
      case Source::fp16: compare_with_host<T, kvattn::fp16>(config, scales, steps, source, a, b, wa, wb, &nan_scales); break;
      case Source::bf16: compare_with_host<T, kvattn::bf16>(config, scales, steps, source, a, b, wa, wb, &nan_scales); break;
      default: compare_with_host<T, float>(config, scales, steps, source, a, b, wa, wb, &nan_scales); break;
    }
    if (non_finite) {
      EXPECT_GT(nan_scales, 0) << "no row or block of the inputs stored a NaN scale";
    }
  }
}

TEST(CudaAppendQuantized, RowFormatsMatchTheHostCacheByteForByte) {
  KVATTN_REQUIRE_GPU();
  for (int page : {1, 7}) {
    const kvattn::CacheConfig config{2, page, 64, GqaShape::gqa(8, 2, 80)};
    check_format<kvattn::int8_row>(config, {}, 127.0f, true);
    check_format<kvattn::fp8_e4m3_row>(config, {}, 448.0f, true);
  }
  // A head size that is not a multiple of the warp's 32 lanes.
  const kvattn::CacheConfig odd{2, 7, 64, GqaShape::gqa(3, 3, 45)};
  check_format<kvattn::int8_row>(odd, {}, 127.0f, true);
  check_format<kvattn::fp8_e4m3_row>(odd, {}, 448.0f, true);
}

TEST(CudaAppendQuantized, LayerScaleFormatMatchesTheHostCacheByteForByte) {
  KVATTN_REQUIRE_GPU();
  for (int page : {1, 7}) {
    const kvattn::CacheConfig config{2, page, 64, GqaShape::gqa(8, 2, 80)};
    // Powers of two (x · (1 / s) exact: the ties stay ties) and others; 448 · s below the rows'
    // huge values (saturation).
    check_format<kvattn::fp8_e4m3_layer>(config, {{1.0f, 0.25f}, {0.0371f, 3.3f}}, 448.0f, false);
    check_format<kvattn::fp8_e4m3_layer>(config, {{0x1p-126f, 0x1p100f}, {1.7f, 0x1p-20f}}, 448.0f, false);
  }
}

TEST(CudaAppendQuantized, LatentFormatsMatchTheHostCacheByteForByte) {
  KVATTN_REQUIRE_GPU();
  for (int page : {1, 7}) {
    const kvattn::CacheConfig config{2, page, 64, MlaShape{4, 384, 64, 32, 32, 0}};
    check_format<kvattn::fp8_e4m3_latent>(config, {}, 448.0f, true);
    check_format<kvattn::int8_latent>(config, {}, 127.0f, true);
  }
  const kvattn::CacheConfig narrow{1, 7, 16, MlaShape{2, 128, 2, 16, 16, 0}};  // one block, a 2-wide rotary key
  check_format<kvattn::fp8_e4m3_latent>(narrow, {}, 448.0f, true);
  check_format<kvattn::int8_latent>(narrow, {}, 127.0f, true);
}

TEST(CudaAppendQuantized, LayerScaleFormatStoresNonFiniteValuesAsDocumentedAndCountsThem) {
  KVATTN_REQUIRE_GPU();
  const GqaShape shape = GqaShape::gqa(2, 1, 40);
  const kvattn::CacheConfig config{1, 7, 8, shape};
  const std::vector<kvattn::KvScales> scales = {{0.5f, 3.0f}};
  using S = QuantStep;
  const std::vector<QuantStep> steps = {{S::add}, {S::append, 0, 0, 9}, {S::write, 0, 0, 9}};
  std::mt19937 rng(5);
  std::normal_distribution<float> gauss(0.0f, 4.0f);
  std::vector<float> k(9 * 40), v(k.size());
  for (float& x : k) x = gauss(rng);
  for (float& x : v) x = gauss(rng);
  const float inf = std::numeric_limits<float>::infinity();
  k[3] = inf, k[50] = -inf, k[100] = std::numeric_limits<float>::quiet_NaN(), v[300] = -std::numeric_limits<float>::quiet_NaN();
  v[7] = inf;
  for (Source source : {Source::fp32, Source::fp16, Source::bf16}) {
    SCOPED_TRACE(std::string("source=") + name(source));
    const cuda_tests::DeviceReplay d = cuda_tests::replay_on_device_quantized<kvattn::fp8_e4m3_layer>(config, scales, steps, source, k, v);
    EXPECT_EQ(d.error, "");
    EXPECT_EQ(d.non_finite, 5u);
    // Expected: every finite value as the host encodes it (e4m3(x · (1 / s))), ±infinity 0x7E with
    // its sign, NaN 0. The sources' values as the device reads them: the conversion to Src is exact
    // for infinities and NaN, and rounds the rest, which the host's to_float reads back.
    const kvattn::PageLayout l = kvattn::PageLayout::of<kvattn::fp8_e4m3_layer>(config.shape, config.page_size);
    ASSERT_EQ(d.tables.size(), 1u);
    for (int side = 0; side < 2; ++side) {
      const std::vector<float>& src = side == 0 ? k : v;
      const float inv = 1.0f / (side == 0 ? scales[0].k : scales[0].v);
      for (int t = 0; t < 9; ++t)
        for (int c = 0; c < shape.head_dim; ++c) {
          float x = src[static_cast<std::size_t>(t * shape.head_dim + c)];
          if (source == Source::fp16) x = kvattn::to_float(kvattn::from_float<kvattn::fp16>(x));
          if (source == Source::bf16) x = kvattn::to_float(kvattn::from_float<kvattn::bf16>(x));
          const std::uint8_t want = std::isnan(x) ? 0 : kvattn::fp8_e4m3_encode(x * inv);
          const std::int64_t page = d.tables[0][static_cast<std::size_t>(t / config.page_size)];
          const int slot = t % config.page_size;
          const std::int64_t at = page * l.page_stride + (side == 0 ? l.key(0, slot) : l.value(0, slot)) + c;
          EXPECT_EQ(int{d.pool[static_cast<std::size_t>(at)]}, int{want}) << "side " << side << " token " << t << " column " << c;
        }
    }
  }
}

}  // namespace
