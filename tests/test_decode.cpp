// Decode attention against the double-precision reference, over a matrix of shapes: group sizes
// 1, 2, 3, 4, 8 and groups = heads; head sizes 64, 128, 256 and odd ones; page sizes 1, 7, 16,
// 64; contexts 0, 1, page size ± 1 and thousands; mixed batches; 1 and 3 queries per sequence;
// fp32, fp16 and bf16 storage; the scalar path and the native SIMD path in the same binary;
// serial and threaded, with and without split-KV. The sliding window and the soft-cap, each a
// compile-time variant, are tested in files of their own (test_decode_window.cpp,
// test_decode_soft_cap.cpp, test_decode_window_soft_cap.cpp; see decode_check.hpp).
//
// Bound, element-wise, the same for every storage type (the reference reads the same rounded
// keys and values): |out - ref| <= (2e-5 + 2·e_s) · max|v| + 2e-5 · |ref| and
// |lse - ref| <= 2e-5 · (1 + |ref|) + e_s, where e_s = 2^-23 · scale · head_dim · max|q| · max|k|
// is the rounding of one fp32 score (it matters only for the huge logits of the overflow test).
#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include <cmath>
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

template <class T, class Isa, class PF> void check(const Case& c, PF&& pf, int threads) {
  decode_check::check<Plain, T, Isa>(c, pf, threads);
}
template <class Isa, class PF = kvattn::SerialFor> void check_all_storage(const Case& c, PF&& pf = PF{}, int threads = 1) {
  decode_check::check_all_storage<Plain, Isa>(c, pf, threads);
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
  check_all_storage<Isa>(Case{GqaShape::gqa(8, 2, 128), 16, {3000}}, pool, 3);                    // chunks chosen
  check_all_storage<Isa>(Case{GqaShape::gqa(4, 4, 64), 7, {2500, 17, 0, 1200}, 1, 0, 0, 100}, pool, 3);  // chunks of 100
  check<kvattn::bf16, Isa>(Case{GqaShape::gqa(4, 1, 128), 64, {5000}, 1, 0, 0, 333}, kvattn::SerialFor{}, 1);
}

TYPED_TEST(Decode, SeveralQueriesPerSequenceAreCausal) {
  using Isa = typename TypeParam::type;
  check_all_storage<Isa>(Case{GqaShape::gqa(6, 2, 64), 7, {40, 3, 2, 16}, 3});
  check_all_storage<Isa>(Case{GqaShape::gqa(6, 3, 80), 16, {500, 64}, 4, 0, 0, 50});
}

TYPED_TEST(Decode, LargeLogitsDoNotOverflow) {
  using Isa = typename TypeParam::type;
  // Queries of size ~1e4 make scores ~1e5: a naive exp overflows, the online softmax does not.
  check<float, Isa>(Case{GqaShape::gqa(4, 2, 64), 16, {200, 3}, 1, 0, 0, 50, 1e4f}, kvattn::SerialFor{}, 1);
}

TEST(DecodeErrors, InconsistentArgumentsAreRejected) {
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{1, 16, 4, GqaShape::gqa(8, 2, 64)});
  const auto s = cache.add_sequence();
  cache.append(s, 3);
  const auto table = cache.page_table({s});
  std::vector<float> q(8 * 64), out(8 * 64);
  kvattn::DecodeWorkspace ws;
  const auto view = cache.view(table, 0);
  EXPECT_THROW(kvattn::decode(view, GqaShape::gqa(8, 4, 64), q.data(), out.data(), nullptr, {}, ws), kvattn::shape_error);
  EXPECT_THROW(kvattn::decode(view, GqaShape::gqa(8, 3, 64), q.data(), out.data(), nullptr, {}, ws), kvattn::shape_error);
  kvattn::DecodeParams p;
  p.queries_per_seq = 0;
  EXPECT_THROW(kvattn::decode(view, GqaShape::gqa(8, 2, 64), q.data(), out.data(), nullptr, p, ws), kvattn::invalid_argument);
  p = {};
  p.window = 0;
  using Window = kvattn::Variant<true, false>;
  using Cap = kvattn::Variant<false, true>;
  EXPECT_THROW(kvattn::decode<Window>(view, GqaShape::gqa(8, 2, 64), q.data(), out.data(), nullptr, p, ws),
               kvattn::invalid_argument);
  p = {};
  p.soft_cap = -1;
  EXPECT_THROW(kvattn::decode<Cap>(view, GqaShape::gqa(8, 2, 64), q.data(), out.data(), nullptr, p, ws),
               kvattn::invalid_argument);
  p = {};
  p.scale = std::nanf("");
  EXPECT_THROW(kvattn::decode(view, GqaShape::gqa(8, 2, 64), q.data(), out.data(), nullptr, p, ws), kvattn::invalid_argument);
}

}  // namespace
