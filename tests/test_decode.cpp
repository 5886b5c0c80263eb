// Decode attention against the double-precision reference, over a matrix of shapes: group sizes
// 1, 2, 3, 4, 8 and groups = heads; head sizes 64, 128, 256 and odd ones; page sizes 1, 7, 16,
// 64; contexts 0, 1, page size ± 1 and thousands; mixed batches; 1 and 3 queries per sequence;
// sliding window and soft-cap; fp32, fp16 and bf16 storage; the scalar path and the native SIMD
// path in the same binary; serial and threaded, with and without split-KV.
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

#include "attention_checks.hpp"
#include "reference.hpp"

namespace {

using kvattn::GqaShape;

struct Case {
  GqaShape shape;
  int page_size;
  std::vector<std::int64_t> lengths;
  int queries = 1;
  std::int64_t window = 0;
  float soft_cap = 0.0f;
  std::int64_t chunk = 0;
  float q_scale = 1.0f;  // multiplies the queries: large values make large logits
};

std::string describe(const Case& c) {
  std::string s = kvattn::detail::concat("q_heads=", c.shape.q_heads, " kv_heads=", c.shape.kv_heads,
                                         " head_dim=", c.shape.head_dim, " page=", c.page_size, " Q=", c.queries,
                                         " window=", c.window, " cap=", c.soft_cap, " chunk=", c.chunk, " lengths=");
  for (auto l : c.lengths) s += std::to_string(l) + ",";
  return s;
}

template <class T, class Isa, class PF>
void check(const Case& c, PF&& pf, int threads) {
  SCOPED_TRACE(describe(c) + " storage=" + std::string(kvattn::storage_traits<T>::name) + " isa=" + std::string(Isa::name));
  std::int64_t total = 0;
  for (auto l : c.lengths) total += (l + c.page_size - 1) / c.page_size;
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, c.page_size, std::max<std::int64_t>(1, total), c.shape});
  std::mt19937 rng(static_cast<unsigned>(c.lengths.size() * 131 + c.shape.head_dim));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const int G = c.shape.kv_heads, D = c.shape.head_dim, H = c.shape.q_heads;
  std::vector<kvattn::SeqId> seqs;
  float vmax = 0;
  for (auto L : c.lengths) {
    const kvattn::SeqId s = cache.add_sequence();
    seqs.push_back(s);
    if (L == 0) continue;
    cache.append(s, L);
    std::vector<float> k(static_cast<std::size_t>(L) * G * D), v(k.size());
    for (auto& x : k) x = dist(rng);
    for (auto& x : v) x = dist(rng), vmax = std::max(vmax, std::abs(x));
    cache.write(s, 0, 0, L, k.data(), v.data());
  }
  const int B = static_cast<int>(seqs.size()), Q = c.queries;
  std::vector<float> q(static_cast<std::size_t>(B) * Q * H * D);
  for (auto& x : q) x = dist(rng) * c.q_scale;
  std::vector<float> out(q.size(), 123.0f), lse(static_cast<std::size_t>(B) * Q * H, 123.0f);

  const kvattn::BatchPageTable table = cache.page_table(seqs);
  kvattn::DecodeParams p;
  p.queries_per_seq = Q;
  p.window = c.window;
  p.soft_cap = c.soft_cap;
  p.chunk_tokens = c.chunk;
  p.threads = threads;
  kvattn::DecodeWorkspace ws;
  const auto view = cache.view(table, 0);
  if (c.window > 0 && c.soft_cap > 0)
    kvattn::decode<kvattn::Variant<true, true>>(view, c.shape, q.data(), out.data(), lse.data(), p, ws, pf, Isa{});
  else if (c.window > 0)
    kvattn::decode<kvattn::Variant<true, false>>(view, c.shape, q.data(), out.data(), lse.data(), p, ws, pf, Isa{});
  else if (c.soft_cap > 0)
    kvattn::decode<kvattn::Variant<false, true>>(view, c.shape, q.data(), out.data(), lse.data(), p, ws, pf, Isa{});
  else
    kvattn::decode(view, c.shape, q.data(), out.data(), lse.data(), p, ws, pf, Isa{});

  reference::Options o;
  o.queries_per_seq = Q;
  o.window = c.window;
  o.soft_cap = c.soft_cap;
  const double e_s = std::ldexp(1.0, -23) * c.q_scale * std::sqrt(double(D));  // scale · D = sqrt(D)
  checks::expect_decode_matches(cache, seqs, c.shape, q, out, lse, o, vmax, e_s);
}

template <class Isa> struct IsaTag {
  using type = Isa;
};
using Isas = ::testing::Types<IsaTag<kvattn::isa::scalar>, IsaTag<kvattn::isa::native>>;
template <class P> class Decode : public ::testing::Test {};
TYPED_TEST_SUITE(Decode, Isas);

template <class Isa, class PF = kvattn::SerialFor>
void check_all_storage(const Case& c, PF&& pf = PF{}, int threads = 1) {
  check<float, Isa>(c, pf, threads);
  check<kvattn::fp16, Isa>(c, pf, threads);
  check<kvattn::bf16, Isa>(c, pf, threads);
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

TYPED_TEST(Decode, SlidingWindowAndSoftCap) {
  using Isa = typename TypeParam::type;
  check_all_storage<Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5, 33}, 1, 20});
  check_all_storage<Isa>(Case{GqaShape::gqa(8, 2, 64), 7, {100, 5, 33}, 3, 1});
  check_all_storage<Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5}, 1, 0, 5.0f, 0, 40.0f});
  check_all_storage<Isa>(Case{GqaShape::gqa(8, 4, 128), 16, {300, 5}, 2, 64, 30.0f, 70, 40.0f});
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
