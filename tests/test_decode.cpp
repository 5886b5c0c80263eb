// Decode attention against the double-precision reference, over a matrix of shapes: group sizes
// 1, 2, 3, 4, 8 and groups = heads; head sizes 64, 128, 256 and odd ones; page sizes 1, 7, 16,
// 64; contexts 0, 1, page size ± 1 and thousands; mixed batches; 1 and 3 queries per sequence;
// fp32, fp16 and bf16 storage on the scalar path and the native SIMD path in the same binary, and
// int8_row, fp8_e4m3_row, fp8_e4m3_layer, hadamard<int8_row> and q4_block on the native one
// (decode_check.hpp says why);
// serial and threaded, with and without split-KV. The score policies are tested in files of their
// own (test_decode_window.cpp, test_decode_soft_cap.cpp, test_decode_window_soft_cap.cpp,
// test_decode_policies.cpp; see decode_check.hpp).
//
// Bound, element-wise, the same for every storage type (the reference reads the same rounded
// keys and values): |out - ref| <= (2e-5 + 2·e_s) · max|v| + 2e-5 · |ref| and
// |lse - ref| <= 2e-5 · (1 + |ref|) + e_s, where e_s = 2^-23 · scale · head_dim · max|q| · max|k|
// is the rounding of one fp32 score (it matters only for the huge logits of the overflow test).
#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "decode_check.hpp"

namespace {

using kvattn::GqaShape;

using Case = decode_check::Case;
using Plain = kvattn::Plain;

template <class P> class Decode : public ::testing::Test {};
TYPED_TEST_SUITE(Decode, decode_check::Isas);

template <class T, class Isa, class PF> void check(const Case& c, PF&& pf) { decode_check::check<Plain, T, Isa>(c, pf); }
template <class Isa, class PF = kvattn::SerialFor> void check_all_storage(const Case& c, PF&& pf = PF{}) {
  decode_check::check_all_storage<Plain, Isa>(c, pf);
}

TYPED_TEST(Decode, GroupSizesAndHeadSizes) {
  using Isa = typename TypeParam::type;
  std::printf("isa: %s\n", Isa::name.data());
  for (int group : {1, 2, 3, 4, 8})
    for (int dim : {64, 128, 256, 7, 80})
      check_all_storage<Isa>(Case{GqaShape::gqa(2 * group, 2, dim), 16, {37, 1, 100}});
  check_all_storage<Isa>(Case{GqaShape::mha(6, 64), 16, {50, 9}});   // groups = heads (MHA)
  check_all_storage<Isa>(Case{GqaShape::mqa(12, 128), 16, {50, 9}});  // one group (MQA)
}

TYPED_TEST(Decode, PageSizesAndAwkwardContexts) {
  using Isa = typename TypeParam::type;
  for (int page : {1, 7, 16, 64})
    check_all_storage<Isa>(Case{GqaShape::gqa(8, 2, 64), page, {0, 1, page - 1 > 0 ? page - 1 : 2, page + 1, 3 * page, 5}});
}

TYPED_TEST(Decode, LongContextsSplitAndThreaded) {
  using Isa = typename TypeParam::type;
  kvattn::ThreadPool pool(3);
  check_all_storage<Isa>(Case{GqaShape::gqa(8, 2, 128), 16, {3000}}, pool);                    // chunks chosen
  check_all_storage<Isa>(Case{GqaShape::gqa(4, 4, 64), 7, {2500, 17, 0, 1200}, 1, 0, 0, 100}, pool);  // chunks of 100
  check<kvattn::bf16, Isa>(Case{GqaShape::gqa(4, 1, 128), 64, {5000}, 1, 0, 0, 333}, kvattn::SerialFor{});
}

TYPED_TEST(Decode, SeveralQueriesPerSequenceAreCausal) {
  using Isa = typename TypeParam::type;
  check_all_storage<Isa>(Case{GqaShape::gqa(6, 2, 64), 7, {40, 3, 2, 16}, 3});
  check_all_storage<Isa>(Case{GqaShape::gqa(6, 3, 80), 16, {500, 64}, 4, 0, 0, 50});
}

TYPED_TEST(Decode, LargeLogitsDoNotOverflow) {
  using Isa = typename TypeParam::type;
  // Queries of size ~1e4 make scores ~1e5: a naive exp overflows, the online softmax does not.
  check<float, Isa>(Case{GqaShape::gqa(4, 2, 64), 16, {200, 3}, 1, 0, 0, 50, 1e4f}, kvattn::SerialFor{});
}

TEST(DecodeErrors, InconsistentArgumentsAreRejected) {
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{1, 16, 4, GqaShape::gqa(8, 2, 64)});
  const auto s = cache.add_sequence();
  cache.append(s, 3);
  const auto table = cache.page_table({s});
  std::vector<float> q(8 * 64), out(8 * 64);
  const auto view = cache.view(table, 0);
  kvattn::DecodePlan plan;
  // A plan that was never made, or made for a shape the cache does not hold.
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan), kvattn::invalid_argument);
  EXPECT_THROW(plan.make(view, GqaShape::gqa(8, 4, 64), {}, 1), kvattn::shape_error);
  EXPECT_THROW(plan.make(view, GqaShape::gqa(8, 3, 64), {}, 1), kvattn::shape_error);
  kvattn::DecodeParams p;
  p.queries_per_seq = 0;
  EXPECT_THROW(plan.make(view, GqaShape::gqa(8, 2, 64), p, 1), kvattn::invalid_argument);
  p = {};
  p.scale = std::nanf("");
  EXPECT_THROW(plan.make(view, GqaShape::gqa(8, 2, 64), p, 1), kvattn::invalid_argument);
  p = {};
  p.chunk_tokens = -1;
  EXPECT_THROW(plan.make(view, GqaShape::gqa(8, 2, 64), p, 1), kvattn::invalid_argument);
  EXPECT_THROW(plan.make(view, GqaShape::gqa(8, 2, 64), {}, 0), kvattn::invalid_argument);
  // group × queries_per_seq past the rows an item may hold (and past INT_MAX).
  p = {};
  p.queries_per_seq = std::numeric_limits<int>::max();
  EXPECT_THROW(plan.make(view, GqaShape::gqa(8, 2, 64), p, 1), kvattn::invalid_argument);

  plan.make(view, GqaShape::gqa(8, 2, 64), {}, 1);
  // Policies that make no sense, before any work.
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::SlidingWindow{0}),
               kvattn::invalid_argument);
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::SoftCap{-1.0f}),
               kvattn::invalid_argument);
  const std::vector<float> sinks(8, 0.5f), bad_sinks{0, 0, std::nanf(""), 0, 0, 0, 0, 0}, slopes = kvattn::alibi_slopes(8);
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::Sinks{sinks.data(), 4}),
               kvattn::invalid_argument);
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::Sinks{bad_sinks.data(), 8}),
               kvattn::invalid_argument);
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::Alibi{nullptr, 8}),
               kvattn::invalid_argument);
  const std::uint64_t tree[2] = {1, 3};
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::TreeMask{tree, 2}),
               kvattn::invalid_argument);  // 2 rows for a call of 1
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::TreeMask{tree + 1, 1}),
               kvattn::invalid_argument);  // row 0 may see new token 0 only
  EXPECT_THROW(kvattn::decode(view, q.data(), nullptr, nullptr, plan), kvattn::invalid_argument);
  try {
    kvattn::decode(view, q.data(), out.data(), nullptr, plan, kvattn::SerialFor{},
                   kvattn::compose(kvattn::SlidingWindow{4}, kvattn::Alibi{slopes.data(), 7}));
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("decode: Alibi slopes heads=7: must equal the call's q_heads=8"), std::string::npos) << e.what();
  }

  // A view of another batch, or of the same batch after the cache changed.
  cache.append(s, 1);
  const auto longer = cache.page_table({s});
  EXPECT_THROW(kvattn::decode(cache.view(longer, 0), q.data(), out.data(), nullptr, plan), kvattn::invalid_argument);
  const auto other = cache.add_sequence();
  const auto two = cache.page_table({s, other});
  std::vector<float> q2(2 * 8 * 64), out2(q2.size());
  EXPECT_THROW(kvattn::decode(cache.view(two, 0), q2.data(), out2.data(), nullptr, plan), kvattn::invalid_argument);
  // An MLA plan for a GQA call.
  kvattn::PagedKvCache<float> mla(kvattn::CacheConfig{1, 16, 4, kvattn::MlaShape{2, 32, 8, 16, 16, 0}});
  const auto m = mla.add_sequence();
  mla.append(m, 3);
  const auto mtable = mla.page_table({m});
  kvattn::DecodePlan mplan;
  mplan.make(mla.view(mtable, 0), kvattn::MlaShape{2, 32, 8, 16, 16, 0}, {}, 1);
  EXPECT_THROW(kvattn::decode(mla.view(mtable, 0), q.data(), out.data(), nullptr, mplan), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::decode(view, q.data(), out.data(), nullptr, mplan), kvattn::shape_error);
}

}  // namespace
