// MLA: the folded decode kernel (mla_decode) and the whole layer (mla_append, mla_prefill, fold,
// mla_decode_layer) against plain double-precision references written from the equations at
// the top of mla.hpp, on the same rounded inputs (the latents are read back from the cache).
//
// Bounds, element-wise:
//  - mla_decode (absorbed queries given): as the GQA decode tests (mla_reference.hpp).
//  - The whole layer: hidden states pass through up to five fp32 matrix products (inner widths
//    up to 512 here) before and after attention; with entries scaled so every product is O(1),
//    each contributes a relative error below about 2^-24 · sqrt(width) · a few. The bound is
//    kLayerRel · (max|ref| + |ref|), kLayerRel = 2e-5: twelve times the largest error seen
//    over these tests (1.6e-6), and far below what a wrong position, head or token produces (> 1e-2).
//  - Cached latents and rotary keys: within one rounding to the storage type of the double
//    value, plus the fp32 product's error (2^-24 · hidden · max|W| · max|h| · 4).
//
// Shapes: DeepSeek-V2's and V2-Lite's head layouts (128 and 16 heads, latent 512, rotary 64,
// heads of 128; hidden sizes and query latents kept small so the double reference stays quick)
// and small awkward ones (latent widths not a multiple of any SIMD width, 1, 3 and 5 heads);
// pages of 1, 7, 16 and 64 tokens; contexts 0, 1, around a tile (31, 32, 33) and a few hundred;
// fp32, fp16 and bf16 latents, and the MLA formats' fp8 and int8 ones; the scalar and the native
// path.
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports -Wmaybe-uninitialized inside Eigen's AVX-512 GEMM code once it is inlined
// into the layer functions (GCC bug 105593, a false positive; as in bench/prefill.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, as -O1 and -O2 report it
#endif

#include <kvattn/eigen.hpp>
#include <kvattn/mla.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cache_snapshot.hpp"
#include "isa_tags.hpp"
#include "mla_reference.hpp"
#include "rope_reference.hpp"

namespace {

using kvattn::bf16;
using kvattn::fp16;
using kvattn::MlaShape;
using kvattn::PagedKvCache;
using kvattn::RopeStyle;
using kvattn::SeqId;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

using checks::uniform;

// ---- the kernel: mla_decode against double attention over the cached rows ----------------------

using KernelCase = checks::MlaCase;

/// Runs mla_decode with policy P (its values from the case) on a cache filled with random rows
/// and checks it against the reference; returns the output (for comparisons between runs).
template <class Isa, class T, class P = kvattn::Plain, class PF = kvattn::SerialFor>
std::vector<float> check_kernel(const KernelCase& c, unsigned seed = 1, PF&& pf = PF{}) {
  SCOPED_TRACE(describe(c));
  return checks::check_mla_case<T, P>(c, seed, pf, [](const auto& kv, const float* q, float* out, float* lse,
                                                      kvattn::DecodePlan& plan, auto& parallel_for, const P& policy) {
    kvattn::mla_decode(kv, q, out, lse, plan, parallel_for, policy, Isa{});
  });
}

template <class P> class MlaKernel : public ::testing::Test {};
using isa_tags::Isas;
TYPED_TEST_SUITE(MlaKernel, Isas);

const MlaShape kV2{128, 512, 64, 128, 128, 1536};
const MlaShape kV2Lite{16, 512, 64, 128, 128, 0};
const MlaShape kOdd{3, 40, 6, 16, 12, 0};   // latent + rope = 46: no SIMD width divides it
const MlaShape kOne{1, 17, 2, 8, 8, 0};
const MlaShape kFive{5, 64, 8, 24, 16, 32};

TYPED_TEST(MlaKernel, MatchesReferenceOverShapesPagesAndContexts) {
  using Isa = typename TypeParam::type;
  const std::vector<std::int64_t> mixed{0, 1, 2, 31, 32, 33, 100, 300};
  for (const MlaShape& s : {kOdd, kOne, kFive, kV2Lite})
    for (int page : {1, 7, 16, 64})
      for (int Q : {1, 3}) check_kernel<Isa, float>({s, page, mixed, Q});
}

TYPED_TEST(MlaKernel, DeepSeekV2HeadLayout) {
  using Isa = typename TypeParam::type;
  check_kernel<Isa, bf16>({kV2, 16, {1, 77, 513}, 1});
  check_kernel<Isa, bf16>({kV2, 7, {40, 0, 65}, 2});
}

TYPED_TEST(MlaKernel, StorageTypes) {
  using Isa = typename TypeParam::type;
  for (const MlaShape& s : {kOdd, kV2Lite}) {
    check_kernel<Isa, fp16>({s, 7, {0, 1, 33, 250}, 1});
    check_kernel<Isa, bf16>({s, 16, {0, 1, 33, 250}, 2});
  }
}

TYPED_TEST(MlaKernel, QuantizedLatentFormats) {
  using Isa = typename TypeParam::type;
  // fp8_e4m3_latent and int8_latent (format.hpp: the latent in blocks of 128 with an fp32 scale
  // each, the rotary key in bf16), against the reference on the rows read_latent dequantizes:
  // the same bounds. Latents of one, three and four blocks; pages of 1, 7 and 16; contexts 0, 1,
  // around a tile and split into chunks; one policy.
  using kvattn::fp8_e4m3_latent;
  using kvattn::int8_latent;
  const MlaShape one_block{3, 128, 6, 16, 12, 0}, three_blocks{5, 384, 8, 24, 16, 32};
  for (int page : {1, 7, 16}) {
    check_kernel<Isa, fp8_e4m3_latent>({one_block, page, {0, 1, 33, 250}, 1});
    check_kernel<Isa, int8_latent>({three_blocks, page, {0, 1, 33, 250}, 2});
  }
  check_kernel<Isa, fp8_e4m3_latent>({kV2Lite, 7, {1000, 1, 0, 64}, 2, 1.0f, 64});
  check_kernel<Isa, int8_latent>({kV2Lite, 16, {300, 31}, 1});
  check_kernel<Isa, int8_latent, kvattn::Sinks>({kV2, 16, {77, 2}, 1}, 3);
}

TYPED_TEST(MlaKernel, SplitIntoChunksAndMerged) {
  using Isa = typename TypeParam::type;
  for (std::int64_t chunk : {32, 64, 96})
    for (const MlaShape& s : {kOdd, kV2Lite}) check_kernel<Isa, float>({s, 7, {1000, 1, 0, 64}, 2, 1.0f, chunk});
}

TYPED_TEST(MlaKernel, HugeLogitsNeitherOverflowNorNaN) {
  using Isa = typename TypeParam::type;
  const auto out = check_kernel<Isa, float>({kOdd, 16, {1, 200, 33}, 2, 300.0f});
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
}

TYPED_TEST(MlaKernel, RowsThatSeeNoKeyAreZeroWithLseMinusInfinity) {
  using Isa = typename TypeParam::type;
  // Q = 4 queries on sequences of 0, 1 and 2 tokens: the early queries have no position.
  check_kernel<Isa, float>({kOdd, 7, {0, 1, 2}, 4});
}

TYPED_TEST(MlaKernel, PagedEqualsContiguousBitForBit) {
  using Isa = typename TypeParam::type;
  const std::vector<std::int64_t> lengths{300, 1, 77};
  const auto contiguous = check_kernel<Isa, bf16>({kFive, 512, lengths, 2, 1.0f, 64}, 5);
  for (int page : {1, 7, 16}) {
    const auto paged = check_kernel<Isa, bf16>({kFive, page, lengths, 2, 1.0f, 64}, 5);
    EXPECT_EQ(paged, contiguous) << "page size " << page;
  }
}

TYPED_TEST(MlaKernel, ScorePolicies) {
  using Isa = typename TypeParam::type;
  using namespace kvattn;
  kvattn::ThreadPool pool(3);
  // Sinks counted once over split chunks; ALiBi over 3 and 16 heads; a tree over Q = 16 (and over
  // sequences shorter than Q); gpt-oss's window, cap and sinks; each with padded rows (3 heads).
  check_kernel<Isa, float, Sinks>({kOdd, 7, {300, 0, 1, 64}, 2, 1.0f, 32}, 1, pool);
  check_kernel<Isa, bf16, Sinks>({kV2Lite, 16, {100, 3}, 1}, 2);
  check_kernel<Isa, float, Alibi>({kOdd, 16, {200, 2}, 3, 1.0f, 64}, 3, pool);
  check_kernel<Isa, bf16, Alibi>({kV2Lite, 7, {90}, 1}, 4);
  check_kernel<Isa, float, TreeMask>({kOdd, 7, {100, 16, 5}, 16}, 5);
  check_kernel<Isa, bf16, TreeMask>({kFive, 1, {40, 2}, 4}, 6);
  using Gpt = Compose<SlidingWindow, SoftCap, Sinks>;
  check_kernel<Isa, float, Gpt>({kOdd, 16, {500, 7, 0}, 2, 4.0f, 64, 70, 10.0f}, 7, pool);
  check_kernel<Isa, bf16, Gpt>({kFive, 7, {80, 1}, 3, 1.0f, 0, 1, 3.0f}, 8);  // window 1: the row's own token
}

TEST(MlaKernelArguments, BadInputIsRejectedBeforeAnyWork) {
  PagedKvCache<float> mla(kvattn::CacheConfig{1, 4, 4, kOdd});
  PagedKvCache<float> gqa(kvattn::CacheConfig{1, 4, 4, kvattn::GqaShape::gqa(4, 2, 8)});
  const auto t = mla.page_table({});
  std::vector<float> q(1), out(1);
  kvattn::DecodePlan plan;
  kvattn::DecodeParams p;
  EXPECT_THROW(plan.make(gqa.view(gqa.page_table({}), 0), kOdd, p, 1), kvattn::shape_error);
  MlaShape other = kOdd;
  other.latent_dim = 41;
  try {
    plan.make(mla.view(t, 0), other, p, 1);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("latent_dim=41"), std::string::npos) << e.what();
  }
  p.queries_per_seq = 0;
  EXPECT_THROW(plan.make(mla.view(t, 0), kOdd, p, 1), kvattn::invalid_argument);
  p.queries_per_seq = 1;
  p.scale = -1.0f;
  EXPECT_THROW(plan.make(mla.view(t, 0), kOdd, p, 1), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::mla_decode(mla.view(t, 0), q.data(), out.data(), nullptr, plan), kvattn::invalid_argument);  // never made
  plan.make(mla.view(t, 0), kOdd, {}, 1);
  const std::vector<float> sinks(2, 0.0f);  // kOdd has 3 heads
  EXPECT_THROW(kvattn::mla_decode(mla.view(t, 0), q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::Sinks{sinks.data(), 2}),
               kvattn::invalid_argument);
}

// ---- the layer -----------------------------------------------------------------------------------

/// Random weights, entries uniform in [-1, 1] / sqrt(fan-in), so every projection is O(1).
struct RandomLayer {
  MlaShape shape;
  int hidden;
  kvattn::RopeConfig rope;
  std::vector<float> dq, uq, dkv, kr, uk, uv, o;

  RandomLayer(const MlaShape& s, int hid, RopeStyle style, unsigned seed)
      : shape(s), hidden(hid), rope{style, s.rope_dim, 0, 10000.0} {
    const int qin = s.has_q_latent() ? s.q_latent_dim : hid;
    const auto make = [&](std::size_t rows, int fan_in) {
      return uniform(rows * std::size_t(fan_in), ++seed, 1.0f / std::sqrt(float(fan_in)));
    };
    if (s.has_q_latent()) dq = make(s.q_latent_dim, hid);
    uq = make(std::size_t(s.heads) * s.qk_head_dim(), qin);
    dkv = make(s.latent_dim, hid);
    kr = make(s.rope_dim, hid);
    uk = make(std::size_t(s.heads) * s.nope_dim, s.latent_dim);
    uv = make(std::size_t(s.heads) * s.v_head_dim, s.latent_dim);
    o = make(hid, s.heads * s.v_head_dim);
  }
  kvattn::MlaWeights weights() const {
    return kvattn::MlaWeights(shape, hidden, kvattn::MlaWeightArrays<float>{dq.empty() ? nullptr : dq.data(), uq.data(),
                                                                         dkv.data(), kr.data(), uk.data(), uv.data(), o.data()},
                              rope);
  }
};

/// y = W x in double, W [rows][cols] row-major.
std::vector<double> matvec(const std::vector<float>& w, int rows, int cols, const double* x) {
  std::vector<double> y(static_cast<std::size_t>(rows), 0.0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) y[r] += double(w[std::size_t(r) * cols + c]) * x[c];
  return y;
}

/// Exact RoPE of x [R] at position p, in double.
void rotate(RopeStyle style, double base, std::vector<double>& x, std::int64_t p) {
  const int R = static_cast<int>(x.size());
  for (int i = 0; i < R / 2; ++i) {
    const double theta = double(p) / std::pow(base, 2.0 * i / R);
    int f, s;
    reference::pair_members(style, R, i, f, s);
    const double a = x[f], b = x[s];
    x[f] = a * std::cos(theta) - b * std::sin(theta);
    x[s] = a * std::sin(theta) + b * std::cos(theta);
  }
}

/// The layer's outputs [n][hidden] for the last n tokens of `seq`, whose hidden states are
/// h [n][hidden], from the cached (rounded) latents and rotary keys, in double.
template <class T>
std::vector<double> reference_layer(const RandomLayer& l, const PagedKvCache<T>& cache, SeqId seq, int layer,
                                    const float* h, std::int64_t n) {
  const MlaShape& s = l.shape;
  const int H = s.heads, Dc = s.latent_dim, Dr = s.rope_dim, nope = s.nope_dim, Dv = s.v_head_dim, hid = l.hidden;
  const int qin = s.has_q_latent() ? s.q_latent_dim : hid;
  const std::int64_t L = cache.length(seq);
  std::vector<float> lat(std::size_t(L) * Dc), kr(std::size_t(L) * Dr);
  for (std::int64_t t = 0; t < L; ++t) cache.read_latent(seq, layer, t, &lat[t * Dc], &kr[t * Dr]);
  // Per head, the rebuilt keys and values of every token: k [L][H][nope], v [L][H][Dv].
  std::vector<double> k(std::size_t(L) * H * nope), v(std::size_t(L) * H * Dv);
  for (std::int64_t t = 0; t < L; ++t) {
    const std::vector<double> c(lat.begin() + t * Dc, lat.begin() + (t + 1) * Dc);
    const auto kt = matvec(l.uk, H * nope, Dc, c.data()), vt = matvec(l.uv, H * Dv, Dc, c.data());
    std::copy(kt.begin(), kt.end(), k.begin() + t * H * nope);
    std::copy(vt.begin(), vt.end(), v.begin() + t * H * Dv);
  }
  const double scale = 1.0 / std::sqrt(double(nope + Dr));
  std::vector<double> out(std::size_t(n) * hid);
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t pos = L - n + j;
    const std::vector<double> x(h + j * hid, h + (j + 1) * hid);
    const std::vector<double> cq = s.has_q_latent() ? matvec(l.dq, qin, hid, x.data()) : x;
    const auto q = matvec(l.uq, H * (nope + Dr), qin, cq.data());
    std::vector<double> o(std::size_t(H) * Dv, 0.0), sc(std::size_t(pos) + 1);
    for (int i = 0; i < H; ++i) {
      const double* qc = &q[std::size_t(i) * (nope + Dr)];
      std::vector<double> qr(qc + nope, qc + nope + Dr);
      rotate(l.rope.style, l.rope.base, qr, pos);
      double m = kNegInf;
      for (std::int64_t t = 0; t <= pos; ++t) {
        double dot = 0;
        for (int d = 0; d < nope; ++d) dot += qc[d] * k[(t * H + i) * nope + d];
        for (int d = 0; d < Dr; ++d) dot += qr[d] * kr[t * Dr + d];
        sc[t] = dot * scale;
        m = std::max(m, sc[t]);
      }
      double sum = 0;
      for (std::int64_t t = 0; t <= pos; ++t) sum += (sc[t] = std::exp(sc[t] - m));
      for (std::int64_t t = 0; t <= pos; ++t)
        for (int d = 0; d < Dv; ++d) o[std::size_t(i) * Dv + d] += sc[t] / sum * v[(t * H + i) * Dv + d];
    }
    const auto y = matvec(l.o, hid, H * Dv, o.data());
    std::copy(y.begin(), y.end(), out.begin() + j * hid);
  }
  return out;
}

constexpr double kLayerRel = 2e-5;

void expect_layer_close(const std::vector<float>& got, const std::vector<double>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double max_ref = 0;
  for (double r : ref) max_ref = std::max(max_ref, std::abs(r));
  int bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (!(std::abs(got[i] - ref[i]) <= kLayerRel * (max_ref + std::abs(ref[i]))) && bad++ < 5)
      ADD_FAILURE() << what << " element " << i << ": got " << got[i] << ", reference " << ref[i] << " (max|ref| "
                    << max_ref << ")";
}
void expect_layer_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  expect_layer_close(got, std::vector<double>(want.begin(), want.end()), what);
}

struct LayerCase {
  MlaShape shape;
  int hidden;
  int page_size;
  std::int64_t tokens;
  RopeStyle style = RopeStyle::gptj;
};

template <class P> class MlaLayer : public ::testing::Test {};
TYPED_TEST_SUITE(MlaLayer, Isas);

/// Prefill of `tokens` tokens in the given chunks; returns every token's output [tokens][hidden].
template <class Isa, class T>
std::vector<float> prefill_in_chunks(const kvattn::MlaWeights& w, PagedKvCache<T>& cache, SeqId seq, int layer,
                                     const std::vector<float>& h, const std::vector<std::int64_t>& chunks) {
  const int hid = w.hidden();
  std::vector<float> out(h.size());
  kvattn::MlaWorkspace ws;
  std::int64_t done = 0;
  for (std::int64_t n : chunks) {
    cache.append(seq, n);
    kvattn::mla_prefill(w, cache, layer, {{seq, n}}, h.data() + done * hid, out.data() + done * hid, ws, Isa{});
    done += n;
  }
  return out;
}

template <class Isa, class T> void check_layer(const LayerCase& c) {
  SCOPED_TRACE(kvattn::detail::concat("heads=", c.shape.heads, " latent=", c.shape.latent_dim, " q_latent=",
                                      c.shape.q_latent_dim, " hidden=", c.hidden, " page=", c.page_size,
                                      " tokens=", c.tokens, " style=", kvattn::to_string(c.style)));
  const RandomLayer l(c.shape, c.hidden, c.style, 11);
  const kvattn::MlaWeights w = l.weights();
  const int hid = c.hidden;
  const auto h = uniform(std::size_t(c.tokens) * hid, 99);
  const std::int64_t pages = (c.tokens + c.page_size - 1) / c.page_size + 1;
  PagedKvCache<T> cache(kvattn::CacheConfig{2, c.page_size, pages, c.shape});
  const SeqId seq = cache.add_sequence();

  // 1. One-shot prefill (layer 1) against the reference; layer 0 untouched.
  const auto one_shot = prefill_in_chunks<Isa>(w, cache, seq, 1, h, {c.tokens});
  expect_layer_close(one_shot, reference_layer(l, cache, seq, 1, h.data(), c.tokens), "one-shot prefill");
  std::vector<float> latent(c.shape.latent_dim), rope(c.shape.rope_dim);
  cache.read_latent(seq, 0, c.tokens - 1, latent.data(), rope.data());
  for (float x : latent) ASSERT_EQ(x, 0.0f) << "prefill wrote into layer 0";

  // 2. Folded decode of the last token after a prefill of the others equals prefill's last row,
  //    and the unfolded decode (mla_prefill of one token) gives the same.
  for (kvattn::MlaFoldChoice choice :
       {kvattn::MlaFoldChoice::cheapest, kvattn::MlaFoldChoice::fused, kvattn::MlaFoldChoice::separate}) {
    const kvattn::MlaFolded f = kvattn::fold<Isa>(w, choice);
    PagedKvCache<T> step(kvattn::CacheConfig{1, c.page_size, pages, c.shape});
    const SeqId s2 = step.add_sequence();
    const std::vector<float> prompt(h.begin(), h.end() - hid);
    if (c.tokens > 1) prefill_in_chunks<Isa>(w, step, s2, 0, prompt, {c.tokens - 1});
    step.append(s2, 1);
    kvattn::MlaWorkspace ws;
    const float* last = h.data() + (c.tokens - 1) * hid;
    kvattn::mla_append<Isa>(w, step, s2, 0, c.tokens - 1, 1, last, ws);
    const kvattn::BatchPageTable table = step.page_table({s2});
    std::vector<float> folded(hid);
    kvattn::DecodePlan plan;
    plan.make(step.view(table, 0), c.shape, {}, 1);
    kvattn::mla_decode_layer(f, step.view(table, 0), last, folded.data(), plan, ws, kvattn::SerialFor{}, kvattn::Plain{}, Isa{});
    const std::vector<float> last_row(one_shot.end() - hid, one_shot.end());
    expect_layer_close(folded, reference_layer(l, step, s2, 0, last, 1), "folded decode vs reference");
    expect_layer_close(folded, last_row, "folded decode vs prefill's last row");
  }
  {
    PagedKvCache<T> step(kvattn::CacheConfig{1, c.page_size, pages, c.shape});
    const SeqId s2 = step.add_sequence();
    std::vector<std::int64_t> chunks(std::size_t(c.tokens), 1);  // every token decoded the unfolded way
    const auto unfolded = prefill_in_chunks<Isa>(w, step, s2, 0, h, chunks);
    expect_layer_close(unfolded, one_shot, "token-by-token unfolded decode vs one-shot prefill");
  }
}

TYPED_TEST(MlaLayer, SmallAwkwardShapes) {
  using Isa = typename TypeParam::type;
  for (RopeStyle style : {RopeStyle::gptj, RopeStyle::neox}) {
    check_layer<Isa, float>({kOdd, 24, 7, 40, style});
    check_layer<Isa, bf16>({kOne, 9, 1, 35, style});
    check_layer<Isa, fp16>({kFive, 33, 16, 37, style});
  }
  check_layer<Isa, float>({kOdd, 24, 7, 1});  // a context of one token
}

TYPED_TEST(MlaLayer, DeepSeekHeadLayouts) {
  using Isa = typename TypeParam::type;
  MlaShape v2 = kV2;
  v2.q_latent_dim = 48;  // (the head layout is V2's; a narrower query latent keeps the test quick)
  check_layer<Isa, bf16>({v2, 64, 16, 6});
  check_layer<Isa, bf16>({kV2Lite, 96, 7, 12});
}

TYPED_TEST(MlaLayer, ChunkedPrefillEqualsOneShot) {
  using Isa = typename TypeParam::type;
  const RandomLayer l(kFive, 33, RopeStyle::gptj, 3);
  const kvattn::MlaWeights w = l.weights();
  const std::int64_t T = 90;
  const auto h = uniform(std::size_t(T) * 33, 5);
  std::vector<float> one_shot;
  for (const std::vector<std::int64_t>& chunks : {std::vector<std::int64_t>{90}, {1, 89}, {64, 26}, {17, 33, 1, 39}}) {
    PagedKvCache<bf16> cache(kvattn::CacheConfig{1, 7, 20, kFive});
    const SeqId seq = cache.add_sequence();
    const auto out = prefill_in_chunks<Isa>(w, cache, seq, 0, h, chunks);
    if (one_shot.empty()) {
      one_shot = out;
      expect_layer_close(out, reference_layer(l, cache, seq, 0, h.data(), T), "one-shot prefill");
    } else {
      expect_layer_close(out, one_shot, "chunked prefill vs one-shot");
    }
  }
}

TYPED_TEST(MlaLayer, BatchedFoldedDecodeOfSequencesOfDifferentLengths) {
  using Isa = typename TypeParam::type;
  const RandomLayer l(kOdd, 24, RopeStyle::gptj, 4);
  const kvattn::MlaWeights w = l.weights();
  const kvattn::MlaFolded f = kvattn::fold<Isa>(w);
  for (int Q : {1, 2}) {
    PagedKvCache<fp16> cache(kvattn::CacheConfig{1, 7, 64, kOdd});
    const std::vector<std::int64_t> prompts{0, 1, 50, 8};
    std::vector<SeqId> seqs;
    kvattn::MlaWorkspace ws;
    for (std::size_t b = 0; b < prompts.size(); ++b) {
      seqs.push_back(cache.add_sequence());
      if (prompts[b] > 0) prefill_in_chunks<Isa>(w, cache, seqs[b], 0, uniform(std::size_t(prompts[b]) * 24, 40 + b), {prompts[b]});
    }
    const auto h = uniform(prompts.size() * Q * 24, 77);
    for (std::size_t b = 0; b < prompts.size(); ++b) {
      cache.append(seqs[b], Q);
      kvattn::mla_append<Isa>(w, cache, seqs[b], 0, prompts[b], Q, h.data() + b * Q * 24, ws);
    }
    const kvattn::BatchPageTable table = cache.page_table(seqs);
    std::vector<float> out(h.size());
    kvattn::DecodeParams p;
    p.queries_per_seq = Q;
    p.chunk_tokens = 32;
    kvattn::ThreadPool pool(2);
    kvattn::DecodePlan plan;
    plan.make(cache.view(table, 0), kOdd, p, pool);
    kvattn::mla_decode_layer(f, cache.view(table, 0), h.data(), out.data(), plan, ws, pool, kvattn::Plain{}, Isa{});
    for (std::size_t b = 0; b < prompts.size(); ++b) {
      const std::vector<float> got(out.begin() + b * Q * 24, out.begin() + (b + 1) * Q * 24);
      expect_layer_close(got, reference_layer(l, cache, seqs[b], 0, h.data() + b * Q * 24, Q),
                         "sequence " + std::to_string(b) + " Q=" + std::to_string(Q));
    }
  }
}

TYPED_TEST(MlaLayer, CachedLatentsAndRotaryKeysAreTheRoundedProjections) {
  using Isa = typename TypeParam::type;
  const RandomLayer l(kFive, 33, RopeStyle::gptj, 8);
  const kvattn::MlaWeights w = l.weights();
  PagedKvCache<bf16> cache(kvattn::CacheConfig{1, 7, 8, kFive});
  const SeqId seq = cache.add_sequence();
  const std::int64_t T = 30;
  cache.append(seq, T);
  const auto h = uniform(std::size_t(T) * 33, 6);
  kvattn::MlaWorkspace ws;
  kvattn::mla_append<Isa>(w, cache, seq, 0, 0, T, h.data(), ws);
  const double product = std::ldexp(1.0, -24) * 33 * 4 / std::sqrt(33.0);  // max|W| = 1/sqrt(33), max|h| = 1
  std::vector<float> lat(64), kr(16);  // (16: GCC 12 -Warray-bounds flags the unreachable vector store into 8)
  for (std::int64_t t = 0; t < T; ++t) {
    cache.read_latent(seq, 0, t, lat.data(), kr.data());
    const std::vector<double> x(h.begin() + t * 33, h.begin() + (t + 1) * 33);
    const auto c = matvec(l.dkv, 64, 33, x.data());
    auto k = matvec(l.kr, 8, 33, x.data());
    rotate(RopeStyle::gptj, 10000.0, k, t);
    for (int i = 0; i < 64; ++i) EXPECT_NEAR(lat[i], c[i], std::ldexp(std::abs(c[i]), -8) + product) << t << " " << i;
    for (int i = 0; i < 8; ++i) EXPECT_NEAR(kr[i], k[i], std::ldexp(std::abs(k[i]), -8) + 2 * product) << t << " " << i;
  }
}

TYPED_TEST(MlaLayer, LatentFormatsQuantizeWhatTheLayerWrites) {
  using Isa = typename TypeParam::type;
  // mla_append and mla_prefill into a cache of an MLA format (format.hpp) store the latent each
  // computes (after RoPE, for the rotary key) quantized by the format's definition: exactly what
  // an fp32 cache holds, quantized per block of 128, and its rotary key rounded to bf16. Then the
  // whole layer over such a cache against the reference on its rows.
  const MlaShape shape{5, 256, 8, 24, 16, 32};
  const RandomLayer l(shape, 33, RopeStyle::neox, 9);
  const kvattn::MlaWeights w = l.weights();
  const std::int64_t T = 20;
  const auto h = uniform(std::size_t(T) * 33, 7);
  const auto fill = [&](auto& cache) {  // tokens [0, 12) by mla_prefill, the rest by mla_append
    const SeqId seq = cache.add_sequence();
    prefill_in_chunks<Isa>(w, cache, seq, 0, h, {12});
    cache.append(seq, T - 12);
    kvattn::MlaWorkspace ws;
    kvattn::mla_append<Isa>(w, cache, seq, 0, 12, T - 12, h.data() + 12 * 33, ws);
    return seq;
  };
  PagedKvCache<float> exact(kvattn::CacheConfig{1, 7, 4, shape});
  PagedKvCache<kvattn::fp8_e4m3_latent> fp8(kvattn::CacheConfig{1, 7, 4, shape});
  PagedKvCache<kvattn::int8_latent> int8(kvattn::CacheConfig{1, 7, 4, shape});
  const SeqId e = fill(exact), f = fill(fp8), i = fill(int8);
  const auto expect_quantized = [&](const auto& cache, SeqId seq, auto format) {
    using Tr = kvattn::format_traits<decltype(format)>;
    std::vector<float> lat(256), kr(8), got(256), got_kr(8), scales(2);
    std::vector<decltype(format)> codes(256);
    for (std::int64_t t = 0; t < T; ++t) {
      exact.read_latent(e, 0, t, lat.data(), kr.data());
      cache.read_latent(seq, 0, t, got.data(), got_kr.data());
      Tr::quantize_latent(lat.data(), codes.data(), scales.data(), 256);
      for (std::size_t c = 0; c < 256; ++c) ASSERT_EQ(got[c], Tr::dequantize(codes.data(), c, scales.data())) << t << " " << c;
      for (std::size_t c = 0; c < 8; ++c) ASSERT_EQ(got_kr[c], static_cast<float>(bf16(kr[c]))) << t << " " << c;
    }
  };
  expect_quantized(fp8, f, kvattn::fp8_e4m3_latent{});
  expect_quantized(int8, i, kvattn::int8_latent{});
  check_layer<Isa, kvattn::fp8_e4m3_latent>({shape, 33, 7, 40, RopeStyle::neox});
  check_layer<Isa, kvattn::int8_latent>({MlaShape{3, 128, 6, 16, 12, 0}, 20, 16, 35});
}

TEST(MlaLayerArguments, ErrorsNameTheValuesAndLeaveTheCacheUnchanged) {
  const RandomLayer l(kOdd, 24, RopeStyle::gptj, 9);
  const kvattn::MlaWeights w = l.weights();
  PagedKvCache<float> cache(kvattn::CacheConfig{2, 7, 2, kOdd});  // full after the prefill
  const SeqId seq = cache.add_sequence();
  cache.append(seq, 10);
  const auto h = uniform(10 * 24, 1);
  std::vector<float> out(10 * 24);
  kvattn::MlaWorkspace ws;
  kvattn::mla_prefill(w, cache, 0, {{seq, 10}}, h.data(), out.data(), ws);
  const SeqId child = cache.fork(seq);  // shares every page: a write must copy one
  const auto before = cache_snapshot::snapshot(cache);
  const auto expect_unchanged = [&](const char* what) {
    EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache))) << what;
  };
  EXPECT_THROW(kvattn::mla_append(w, cache, 12345, 0, 0, 1, h.data(), ws), kvattn::invalid_argument);
  expect_unchanged("unknown sequence");
  EXPECT_THROW(kvattn::mla_append(w, cache, seq, 2, 0, 1, h.data(), ws), kvattn::invalid_argument);
  expect_unchanged("layer out of range");
  try {
    kvattn::mla_append(w, cache, seq, 0, 5, 6, h.data(), ws);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("count=6"), std::string::npos) << e.what();
  }
  expect_unchanged("range past the end");
  EXPECT_THROW(kvattn::mla_append(w, cache, seq, 0, 0, 1, nullptr, ws), kvattn::invalid_argument);
  expect_unchanged("null hidden");
  EXPECT_THROW(kvattn::mla_prefill(w, cache, 0, {{seq, 11}}, h.data(), out.data(), ws), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::mla_prefill(w, cache, 0, {{seq, 1}}, h.data(), nullptr, ws), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::mla_prefill(w, cache, 0, {{seq, 1}, {seq, 1}}, h.data(), out.data(), ws), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::mla_prefill(w, cache, 0, {{seq, 1}, {12345, 1}}, h.data(), out.data(), ws), kvattn::invalid_argument);
  expect_unchanged("bad prefill");
  // A batch whose second chunk needs a copy the pool cannot hold: the first is not written either.
  EXPECT_THROW(kvattn::mla_prefill(w, cache, 0, {{seq, 1}, {child, 1}}, h.data(), out.data(), ws), kvattn::capacity_error);
  expect_unchanged("a batch that cannot copy its shared pages");
  // The fork shares every page and the pool has no free page for the copy: capacity_error.
  EXPECT_THROW(kvattn::mla_append(w, cache, child, 0, 0, 1, h.data(), ws), kvattn::capacity_error);
  expect_unchanged("copy-on-write without a free page");

  PagedKvCache<float> gqa(kvattn::CacheConfig{1, 4, 4, kvattn::GqaShape::gqa(4, 2, 8)});
  const SeqId g = gqa.add_sequence();
  gqa.append(g, 1);
  EXPECT_THROW(kvattn::mla_append(w, gqa, g, 0, 0, 1, h.data(), ws), kvattn::shape_error);
  const kvattn::MlaFolded f = kvattn::fold(w);
  const auto gt = gqa.page_table({g});
  kvattn::DecodePlan plan;
  EXPECT_THROW(kvattn::mla_decode_layer(f, gqa.view(gt, 0), h.data(), out.data(), plan, ws), kvattn::invalid_argument);  // never made
  plan.make(gqa.view(gt, 0), kvattn::GqaShape::gqa(4, 2, 8), {}, 1);
  EXPECT_THROW(kvattn::mla_decode_layer(f, gqa.view(gt, 0), h.data(), out.data(), plan, ws), kvattn::shape_error);
  // The folded weights carry the scale: a plan with a scale of its own is rejected.
  const auto mt = cache.page_table({seq});
  kvattn::DecodeParams scaled;
  scaled.scale = 0.5f;
  plan.make(cache.view(mt, 0), kOdd, scaled, 1);
  EXPECT_THROW(kvattn::mla_decode_layer(f, cache.view(mt, 0), h.data(), out.data(), plan, ws), kvattn::invalid_argument);

  // Weights: a rotary embedding of the wrong width, a missing array.
  const kvattn::RopeConfig narrow{RopeStyle::gptj, kOdd.rope_dim - 2, 0, 10000.0};
  try {
    kvattn::MlaWeights bad(kOdd, 24, kvattn::MlaWeightArrays<float>{nullptr, l.uq.data(), l.dkv.data(), l.kr.data(), l.uk.data(), l.uv.data(), l.o.data()}, narrow);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("rope_dim=6"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kvattn::MlaWeights(kOdd, 24, kvattn::MlaWeightArrays<float>{nullptr, l.uq.data(), nullptr, l.kr.data(), l.uk.data(), l.uv.data(), l.o.data()}, l.rope),
               kvattn::invalid_argument);
  EXPECT_THROW(kvattn::MlaWeights(kOdd, 0, kvattn::MlaWeightArrays<float>{}, l.rope), kvattn::shape_error);
}

TEST(MlaFold, ChoosesTheCheaperSideAndFoldsTheScale) {
  // DeepSeek-V2 (hidden 5120) and V2-Lite (hidden 2048): the latent (512) is four times a head
  // (128), fusing never pays.
  for (const auto& [s, hidden] : {std::pair{kV2, 5120}, std::pair{kV2Lite, 2048}}) {
    const auto cost = kvattn::MlaFoldCost::of(s, hidden);
    EXPECT_GT(cost.query_fused, cost.query_apart) << hidden;
    EXPECT_GT(cost.output_fused, cost.output_apart) << hidden;
  }
  const auto v2 = kvattn::MlaFoldCost::of(kV2, 5120);  // 128 · 512 · 1536 and 128 · 128 · (1536 + 512)
  EXPECT_EQ(v2.query_fused, 100663296.0);
  EXPECT_EQ(v2.query_apart, 33554432.0);
  // The same proportions, small enough to fold here: both sides stay apart.
  const RandomLayer wide({2, 64, 2, 8, 8, 16}, 32, RopeStyle::gptj, 1);
  const kvattn::MlaFolded fw = kvattn::fold(wide.weights());
  EXPECT_FALSE(fw.fused_query);
  EXPECT_FALSE(fw.fused_output);
  EXPECT_TRUE(fw.q_absorb.size() == 0 && fw.out_absorb.size() == 0);
  // A latent narrower than the heads' widths: both sides fuse.
  const MlaShape narrow{2, 4, 2, 16, 16, 8};
  const RandomLayer small(narrow, 6, RopeStyle::gptj, 2);
  const kvattn::MlaWeights w = small.weights();
  const kvattn::MlaFolded fs = kvattn::fold(w);
  EXPECT_TRUE(fs.fused_query);
  EXPECT_TRUE(fs.fused_output);
  // q_absorb = scale · W_UK,iᵀ W_UQ,i^C, element by element in double.
  const double scale = 1.0 / std::sqrt(18.0);
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 4; ++c)
      for (int x = 0; x < 8; ++x) {
        double sum = 0;
        for (int d = 0; d < 16; ++d) sum += double(small.uk[(i * 16 + d) * 4 + c]) * small.uq[(i * 18 + d) * 8 + x];
        EXPECT_NEAR(fs.q_absorb(i * 4 + c, x), sum * scale, 1e-7 * (1 + std::abs(sum)));
      }
}

// kvattn/eigen.hpp: kvattn's 16-bit types against Eigen's, an implementation of its own. Every
// bit pattern goes across and back unchanged and widens to the same float; every float narrows
// to the same bits (NaNs: a NaN of the same sign, as fp16 promises no payload).
template <class K, class E> void check_against_eigen() {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const K k = K::from_bits(static_cast<std::uint16_t>(b));
    const E e = kvattn::to_eigen(k);
    ASSERT_EQ(kvattn::from_eigen(e).bits, k.bits) << b;
    const float kf = static_cast<float>(k), ef = static_cast<float>(e);
    if (std::isnan(ef)) {
      ASSERT_TRUE(std::isnan(kf)) << b;
    } else {
      ASSERT_EQ(kf, ef) << b;
      ASSERT_EQ(std::signbit(kf), std::signbit(ef)) << b;
    }
    ASSERT_EQ(kvattn::as_kvattn(kvattn::as_eigen(&k)), &k);
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 1 << 20; ++i) {
    std::uint32_t u = bits(rng);
    if (i % 4 == 0) u = (u & 0x87ffffffu) | 0x30000000u;  // near the 16-bit formats' ranges
    float x;
    std::memcpy(&x, &u, sizeof x);
    const K k(x);
    const K e = kvattn::from_eigen(E(x));
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(static_cast<float>(k)) && std::signbit(static_cast<float>(k)) == std::signbit(x)) << u;
    } else {
      ASSERT_EQ(k.bits, e.bits) << u;
    }
  }
}
TEST(EigenInterop, Fp16MatchesEigenHalf) { check_against_eigen<fp16, Eigen::half>(); }
TEST(EigenInterop, Bf16MatchesEigenBfloat16) { check_against_eigen<bf16, Eigen::bfloat16>(); }

}  // namespace
