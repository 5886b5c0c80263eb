// Decode with int8 queries (DecodeParams::int8_queries) over the int8 key formats: each query row
// is quantized like a key row (int8_row's definition, after the rotation of a rotated format) and
// scored by exact integer dot products times the two scales. Checked against the double
// reference run on the cache's dequantized keys and values and on the quantized query (brought
// back to the keys' basis), so within the same fp32 bounds as every decode test (test_decode.cpp):
// the integer sums are exact (|k · q| < 2^24 for head_dim <= 1024), what remains is fp32 rounding
// of the scales' product, the softmax and the values. Shapes: group sizes 1, 3, 4, 8; head sizes
// 128, 64 and ones that leave a partial step of the integer dot product (7, 72, 200); page sizes 1,
// 7, 16; contexts 0, 1 and thousands; 1 and 3 queries; split-KV; a composed policy; the scalar
// path (fp32 multiply-adds of the same integers) and the native one (AVX-512 VNNI, AVX-VNNI,
// AVX2's vpmaddubsw or NEON's dot product, as the build has them). What the quantized query costs against the exact fp32
// path on realistic keys is in test_formats.cpp (FormatAccuracy).
#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "decode_check.hpp"

namespace {

using kvattn::GqaShape;
using Case = decode_check::Case;

/// x [n] <- H x / sqrt(n) in double (H the Walsh–Hadamard matrix, its own inverse).
void rotate(std::vector<double>& x) {
  const std::size_t n = x.size();
  for (std::size_t h = 1; h < n; h *= 2)
    for (std::size_t i = 0; i < n; i += 2 * h)
      for (std::size_t j = i; j < i + h; ++j) {
        const double a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  for (double& v : x) v /= std::sqrt(static_cast<double>(n));
}

/// The queries decode scores with int8 queries, in the keys' own (unrotated) basis: each row
/// rotated by kvattn::hadamard_rotate when `rotated`, then q_i = round-half-even(x_i · 127 / max|x|)
/// · max|x| / 127, then rotated back.
std::vector<float> quantized_queries(const std::vector<float>& q, int dim, bool rotated) {
  std::vector<float> out(q.size());
  for (std::size_t r = 0; r * static_cast<std::size_t>(dim) < q.size(); ++r) {
    std::vector<float> x(q.begin() + static_cast<std::ptrdiff_t>(r * dim), q.begin() + static_cast<std::ptrdiff_t>((r + 1) * dim));
    if (rotated) kvattn::hadamard_rotate(x.data(), dim);
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    std::vector<double> y(x.size(), 0.0);
    if (amax > 0)
      for (std::size_t i = 0; i < x.size(); ++i) y[i] = std::nearbyint(x[i] * (127.0f / amax)) * (static_cast<double>(amax) / 127.0);
    if (rotated) rotate(y);
    for (std::size_t i = 0; i < y.size(); ++i) out[r * dim + i] = static_cast<float>(y[i]);
  }
  return out;
}

template <class P, class T, class Isa, class PF> void check(const Case& c, PF&& pf) {
  SCOPED_TRACE(describe(c) + " format=" + std::string(kvattn::format_traits<T>::name) + " isa=" + std::string(Isa::name));
  checks::DecodeInputs<T> in(c);
  std::vector<float> out = in.out(), lse = in.lse(c);
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  const policy_checks::Values values = checks::policy_values(c);
  kvattn::DecodeParams params = checks::decode_params(c);
  params.int8_queries = true;
  kvattn::DecodePlan plan;
  plan.make(in.cache.view(table, 0), c.shape, params, pf);
  kvattn::decode(in.cache.view(table, 0), in.q.data(), out.data(), lse.data(), plan, pf, policy_checks::make<P>(values), Isa{});
  in.q = quantized_queries(in.q, c.shape.head_dim, kvattn::format_traits<T>::rotated);
  checks::expect_decode_case_matches<P>(in, c, values, out, lse);
}

template <class P, class Isa, class PF = kvattn::SerialFor> void check_formats(const Case& c, PF&& pf = PF{}) {
  check<P, kvattn::int8_row, Isa>(c, pf);
  if ((c.shape.head_dim & (c.shape.head_dim - 1)) == 0) check<P, kvattn::hadamard<kvattn::int8_row>, Isa>(c, pf);
}

// The native path (and the scalar one beside it: isa_tags.hpp); an AVX-512 build runs its AVX2
// kernels too (AVX-VNNI's integer dot product where the build has it, else vpmaddubsw's).
#if KVATTN_HAS_AVX512 && KVATTN_TEST_SCALAR_PATH
using Isas = ::testing::Types<decode_check::IsaTag<kvattn::isa::scalar>, decode_check::IsaTag<kvattn::isa::avx2>,
                              decode_check::IsaTag<kvattn::isa::avx512>>;
#elif KVATTN_HAS_AVX512
using Isas = ::testing::Types<decode_check::IsaTag<kvattn::isa::avx2>, decode_check::IsaTag<kvattn::isa::avx512>>;
#else
using Isas = decode_check::Isas;
#endif
template <class P> class Int8Queries : public ::testing::Test {};
TYPED_TEST_SUITE(Int8Queries, Isas);

TYPED_TEST(Int8Queries, MatchTheReferenceOnTheQuantizedQuery) {
  using Isa = typename TypeParam::type;
  using kvattn::Plain;
  check_formats<Plain, Isa>(Case{GqaShape::gqa(32, 8, 128), 16, {1000, 0, 1, 17}});
  check_formats<Plain, Isa>(Case{GqaShape::mha(3, 64), 1, {40, 1}, 3});
  check_formats<Plain, Isa>(Case{GqaShape::gqa(24, 3, 64), 7, {300, 6}, 1, 0, 0.0f, 0, 4.0f});  // groups of 8, large logits
  check_formats<Plain, Isa>(Case{GqaShape::gqa(9, 3, 7), 7, {50, 8}, 3});                       // a partial step only
  check_formats<Plain, Isa>(Case{GqaShape::gqa(6, 2, 72), 16, {129, 64}});                      // one whole step and a partial one
  check_formats<Plain, Isa>(Case{GqaShape::gqa(8, 8, 200), 16, {257}});
  check_formats<Plain, Isa>(Case{GqaShape::gqa(4, 1, 256), 16, {33}, 1});                       // MQA
  kvattn::ThreadPool pool(3);
  check_formats<Plain, Isa>(Case{GqaShape::gqa(16, 4, 128), 16, {3000, 70}, 2, 0, 0.0f, 256}, pool);  // split-KV
  using Gpt = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;
  // The hooks act on the integer scores the same way for both formats (the rotation is applied to
  // the query and the output, outside them): the rotated one, with every hook at once.
  check<Gpt, kvattn::hadamard<kvattn::int8_row>, Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {200, 5, 0}, 1, 40, 20.0f, 0, 4.0f},
                                                      kvattn::SerialFor{});
}

// u8_probabilities rounds each weight p · (value scale) to 8 bits of its tile's largest, an
// error of at most 1/510 of that: the output moves by at most (1/510) · max|v| · Σ_tiles n ·
// max p / Σ p, which is at most 32/510 · max|v| where the probabilities of a tile are unequal and
// about max|v| / 510 where they are nearly equal (these inputs). The tests below hold the error to
// 32/510 · max|v| against the reference (the case's keys and values), the native path to the
// portable one to fp32 rounding (the same integers), and the error on realistic inputs to its
// NMSE (test_formats.cpp).
template <class T, class Isa, class PF> void check_u8(const Case& c, PF&& pf) {
  SCOPED_TRACE(describe(c) + " format=" + std::string(kvattn::format_traits<T>::name) + " isa=" + std::string(Isa::name));
  checks::DecodeInputs<T> in(c);
  std::vector<float> out = in.out(), lse = in.lse(c), exact = in.out();
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  kvattn::DecodeParams params = checks::decode_params(c);
  params.int8_queries = true;
  kvattn::DecodePlan plan, exact_plan;
  exact_plan.make(in.cache.view(table, 0), c.shape, params, pf);
  kvattn::decode(in.cache.view(table, 0), in.q.data(), exact.data(), nullptr, exact_plan, pf, kvattn::Plain{}, Isa{});
  params.u8_probabilities = true;
  plan.make(in.cache.view(table, 0), c.shape, params, pf);
  kvattn::decode(in.cache.view(table, 0), in.q.data(), out.data(), lse.data(), plan, pf, kvattn::Plain{}, Isa{});
  in.q = quantized_queries(in.q, c.shape.head_dim, kvattn::format_traits<T>::rotated);
  // The reference on the same query: the output within the rounding bound, lse exact (the
  // softmax's denominator sums the unrounded probabilities).
  const std::size_t H = static_cast<std::size_t>(c.shape.q_heads), D = static_cast<std::size_t>(c.shape.head_dim);
  const double bound = 32.0 / 510.0 * in.vmax + 1e-5;
  double worst = 0, worst_exact = 0;
  for (std::size_t b = 0; b < in.seqs.size(); ++b) {
    std::vector<double> ref, ref_lse;
    reference::Options o;
    o.queries_per_seq = c.queries;
    const std::size_t Q = static_cast<std::size_t>(c.queries);
    reference::decode(in.cache, in.seqs[b], 0, c.shape, in.q.data() + b * Q * H * D, o, ref, ref_lse);
    for (std::size_t j = 0; j < ref.size(); ++j) {
      worst = std::max(worst, std::abs(out[b * Q * H * D + j] - ref[j]));
      worst_exact = std::max(worst_exact, std::abs(exact[b * Q * H * D + j] - ref[j]));
    }
    for (std::size_t j = 0; j < ref_lse.size(); ++j) {
      const double r = ref_lse[j];
      const float got = lse[b * Q * H + j];
      if (std::isinf(r))
        EXPECT_EQ(got, -std::numeric_limits<float>::infinity()) << "lse " << j;
      else
        EXPECT_NEAR(got, r, 2e-5 * (1 + std::abs(r))) << "lse " << j;
    }
  }
  EXPECT_LE(worst, bound) << "max|v| = " << in.vmax;
  EXPECT_GT(worst, worst_exact) << "the 8-bit probabilities changed nothing";  // it ran
}

TYPED_TEST(Int8Queries, U8ProbabilitiesStayWithinTheirRounding) {
  using Isa = typename TypeParam::type;
  check_u8<kvattn::int8_row, Isa>(Case{GqaShape::gqa(32, 8, 128), 16, {1000, 0, 1, 17}}, kvattn::SerialFor{});
  check_u8<kvattn::hadamard<kvattn::int8_row>, Isa>(Case{GqaShape::gqa(16, 2, 64), 7, {300, 6}, 3}, kvattn::SerialFor{});
  check_u8<kvattn::int8_row, Isa>(Case{GqaShape::gqa(6, 3, 72), 1, {129, 64}}, kvattn::SerialFor{});  // no 64-column passes
  check_u8<kvattn::int8_row, Isa>(Case{GqaShape::gqa(24, 3, 256), 16, {70, 33}, 1, 0, 0.0f, 0, 4.0f}, kvattn::SerialFor{});
  kvattn::ThreadPool pool(3);
  check_u8<kvattn::int8_row, Isa>(Case{GqaShape::gqa(16, 4, 128), 16, {3000, 70}, 2, 0, 0.0f, 256}, pool);  // split-KV
}

TEST(Int8Queries, NativeAndPortablePathsAgree) {
  // The same integers on both paths (the int8 queries' scores, the 8-bit probabilities and their
  // products with the values): what differs is the order of fp32 rounding after the sums.
  struct Flags {
    bool int8_queries, u8_probabilities;
    float bound;
  };
  for (const Flags f : {Flags{true, false, 1e-6f}, Flags{true, true, 1e-5f}}) {
    SCOPED_TRACE(std::to_string(f.int8_queries) + " " + std::to_string(f.u8_probabilities));
    const Case c{GqaShape::gqa(16, 2, 128), 16, {700, 45}};
    checks::DecodeInputs<kvattn::int8_row> in(c);
    const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
    kvattn::DecodeParams params;
    params.int8_queries = f.int8_queries;
    params.u8_probabilities = f.u8_probabilities;
    kvattn::DecodePlan plan;
    plan.make(in.cache.view(table, 0), c.shape, params, 1);
    std::vector<float> scalar = in.out(), native = in.out();
    kvattn::decode(in.cache.view(table, 0), in.q.data(), scalar.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::Plain{}, kvattn::isa::scalar{});
    kvattn::decode(in.cache.view(table, 0), in.q.data(), native.data(), nullptr, plan);
    for (std::size_t k = 0; k < scalar.size(); ++k) EXPECT_NEAR(native[k], scalar[k], f.bound) << "element " << k;
  }
}

TEST(Int8Queries, NeedAnInt8Format) {
  const GqaShape shape = GqaShape::gqa(4, 2, 64);
  kvattn::DecodeParams params;
  params.int8_queries = true;
  kvattn::PagedKvCache<kvattn::bf16> cache(kvattn::CacheConfig{1, 16, 4, shape});
  const kvattn::SeqId s = cache.add_sequence();
  cache.append(s, 3);
  const kvattn::BatchPageTable table = cache.page_table({s});
  kvattn::DecodePlan plan;
  try {
    plan.make(cache.view(table, 0), shape, params, 1);
    FAIL() << "int8_queries accepted on a bf16 cache";
  } catch (const kvattn::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("DecodePlan::make"), std::string::npos) << what;
    EXPECT_NE(what.find("int8_queries"), std::string::npos) << what;
    EXPECT_NE(what.find("bf16"), std::string::npos) << what;
  }
  // A plan made for an int8 cache, called on a bf16 view of the same batch and head layout.
  kvattn::PagedKvCache<kvattn::int8_row> int8(kvattn::CacheConfig{1, 16, 4, shape});
  const kvattn::SeqId s8 = int8.add_sequence();
  int8.append(s8, 3);
  const kvattn::BatchPageTable table8 = int8.page_table({s8});
  plan.make(int8.view(table8, 0), shape, params, 1);
  std::vector<float> q(4 * 64, 0.5f), out(q.size(), 123.0f);
  try {
    kvattn::decode(cache.view(table, 0), q.data(), out.data(), nullptr, plan);
    FAIL() << "int8_queries accepted on a bf16 view";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("decode: int8_queries"), std::string::npos) << e.what();
  }
  for (float x : out) ASSERT_EQ(x, 123.0f);  // nothing written
  kvattn::DecodeParams u8;
  u8.u8_probabilities = true;
  try {
    plan.make(cache.view(table, 0), shape, u8, 1);
    FAIL() << "u8_probabilities accepted on a bf16 cache";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("u8_probabilities=true"), std::string::npos) << e.what();
  }
  try {  // 8-bit probabilities without int8 queries
    plan.make(int8.view(table8, 0), shape, u8, 1);
    FAIL() << "u8_probabilities accepted without int8_queries";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("needs int8_queries=true"), std::string::npos) << e.what();
  }
  // MLA decode has no int8 path.
  const kvattn::MlaShape mla{4, 64, 16, 32, 32, 0};
  kvattn::PagedKvCache<kvattn::bf16> mla_cache(kvattn::CacheConfig{1, 16, 4, mla});
  const kvattn::SeqId sm = mla_cache.add_sequence();
  mla_cache.append(sm, 2);
  const kvattn::BatchPageTable tm = mla_cache.page_table({sm});
  EXPECT_THROW(plan.make(mla_cache.view(tm, 0), mla, params, 1), kvattn::invalid_argument);
  EXPECT_THROW(plan.make(mla_cache.view(tm, 0), mla, u8, 1), kvattn::invalid_argument);
}

}  // namespace
