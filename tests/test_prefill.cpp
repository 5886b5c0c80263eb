// Chunked causal prefill against the double-precision reference (reference.hpp: the causal
// attention of the last n tokens of a sequence), and the identities it must keep: any chunking
// equals one-shot prefill, decode after prefill equals the prefill's last row, paged equals
// contiguous. Shapes: group sizes 1, 3, 4, 8 and groups = heads; head sizes 64, 128, 256 and odd
// ones; page sizes 1, 7, 16; prompts of 1 token to several hundred; fp32, fp16 and bf16 storage;
// the scalar and the native path. Same element-wise bound as decode:
// |out - ref| <= (2e-5 + 2·e_s) · max|v| + 2e-5 · |ref|, |lse - ref| <= 2e-5 · (1 + |ref|) + e_s,
// where e_s = 2^-23 · scale · head_dim · max|q| · max|k| is the rounding of one fp32 score (it
// matters only for the huge logits of the overflow test).
#include <kvattn/decode.hpp>
#include <kvattn/prefill.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "cache_snapshot.hpp"
#include "reference.hpp"

namespace {

using kvattn::GqaShape;

using checks::expect_close;
using checks::expect_lse_close;
using checks::expect_out_close;
using checks::Prompt;
using checks::random_prompt;

/// Prefills one sequence in the given chunks; returns out and lse of every prompt token.
template <class T, class Isa, class V = kvattn::Plain>
void run_chunks(kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, const GqaShape& s, const Prompt& pr,
                const std::vector<std::int64_t>& chunks, std::vector<float>& out, std::vector<float>& lse,
                const kvattn::PrefillParams& params = {}) {
  std::int64_t total = 0;
  for (auto c : chunks) total += c;
  out.assign(static_cast<std::size_t>(total) * s.q_heads * s.head_dim, 7.0f);
  lse.assign(static_cast<std::size_t>(total) * s.q_heads, 7.0f);
  kvattn::PrefillWorkspace ws;
  kvattn::ThreadPool pool(2);
  std::int64_t done = 0;
  for (auto n : chunks) {
    cache.append(seq, n);
    const std::int64_t indptr[2] = {0, n};
    const std::size_t qo = static_cast<std::size_t>(done) * s.q_heads * s.head_dim;
    const std::size_t kv = static_cast<std::size_t>(done) * s.kv_heads * s.head_dim;
    kvattn::prefill<V>(cache, 0, {seq}, indptr, s, pr.q.data() + qo, pr.k.data() + kv, pr.v.data() + kv,
                       out.data() + qo, lse.data() + static_cast<std::size_t>(done) * s.q_heads, params, ws, pool, Isa{});
    done += n;
  }
}

/// e_s above, for keys in [-1, 1].
double score_error(const GqaShape& s, double q_max) { return std::ldexp(1.0, -23) * q_max * std::sqrt(double(s.head_dim)); }


template <class T, class Isa, class V = kvattn::Plain>
void check_against_reference(const GqaShape& s, int page, std::vector<std::int64_t> chunks, kvattn::PrefillParams params = {},
                             float q_scale = 1.0f) {
  SCOPED_TRACE(kvattn::detail::concat("q_heads=", s.q_heads, " kv_heads=", s.kv_heads, " head_dim=", s.head_dim, " page=", page,
                                      " storage=", kvattn::storage_traits<T>::name, " isa=", Isa::name, " block=", params.query_block));
  std::int64_t total = 0;
  for (auto c : chunks) total += c;
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, page, (total + page - 1) / page + 1, s});
  const auto seq = cache.add_sequence();
  const Prompt pr = random_prompt(s, total, static_cast<unsigned>(total * 7 + s.head_dim), q_scale);
  std::vector<float> out, lse;
  run_chunks<T, Isa, V>(cache, seq, s, pr, chunks, out, lse, params);
  reference::Options o;
  o.queries_per_seq = static_cast<int>(total);
  o.window = V::sliding_window ? params.window : 0;
  o.soft_cap = V::soft_cap ? params.soft_cap : 0;
  std::vector<double> ref, ref_lse;
  reference::decode(cache, seq, 0, s, pr.q.data(), o, ref, ref_lse);
  const double e_s = score_error(s, q_scale);
  expect_out_close(out, ref, "out", e_s);
  expect_lse_close(lse, ref_lse, "lse", e_s);
}

template <class Isa> struct IsaTag {
  using type = Isa;
};
using Isas = ::testing::Types<IsaTag<kvattn::isa::scalar>, IsaTag<kvattn::isa::native>>;
template <class P> class Prefill : public ::testing::Test {};
TYPED_TEST_SUITE(Prefill, Isas);

TYPED_TEST(Prefill, MatchesReferenceOverShapes) {
  using Isa = typename TypeParam::type;
  for (int group : {1, 3, 4, 8})
    for (int dim : {64, 128, 7}) {
      check_against_reference<float, Isa>(GqaShape::gqa(2 * group, 2, dim), 16, {45});
      check_against_reference<kvattn::bf16, Isa>(GqaShape::gqa(2 * group, 2, dim), 7, {20, 1, 30});
    }
  check_against_reference<kvattn::fp16, Isa>(GqaShape::gqa(4, 2, 256), 16, {40, 9});
  check_against_reference<kvattn::fp16, Isa>(GqaShape::mha(5, 80), 1, {33});
  check_against_reference<kvattn::bf16, Isa>(GqaShape::mqa(8, 64), 16, {1});
}

TYPED_TEST(Prefill, LongPromptAndBlocks) {
  using Isa = typename TypeParam::type;
  kvattn::PrefillParams p;
  check_against_reference<kvattn::bf16, Isa>(GqaShape::gqa(8, 2, 128), 16, {300, 200}, p);
  p.query_block = 5;
  check_against_reference<kvattn::fp16, Isa>(GqaShape::gqa(6, 2, 64), 7, {100, 77}, p);
  p.query_block = 1;
  check_against_reference<float, Isa>(GqaShape::gqa(4, 4, 64), 3, {50}, p);
  p.query_block = kvattn::PrefillParams::kMaxQueryBlock;  // longer than every chunk: one block per chunk
  check_against_reference<kvattn::bf16, Isa>(GqaShape::gqa(16, 2, 64), 16, {300, 1, 45}, p);
}

TYPED_TEST(Prefill, VariantsAndLargeLogits) {
  using Isa = typename TypeParam::type;
  kvattn::PrefillParams p;
  p.window = 17;
  check_against_reference<float, Isa, kvattn::Variant<true, false>>(GqaShape::gqa(8, 2, 64), 16, {60, 40}, p);
  p.window = 1;
  check_against_reference<kvattn::bf16, Isa, kvattn::Variant<true, false>>(GqaShape::gqa(4, 2, 64), 7, {30}, p);
  p.soft_cap = 20.0f;
  p.window = 40;
  check_against_reference<float, Isa, kvattn::Variant<true, true>>(GqaShape::gqa(8, 2, 64), 16, {90}, p, 10.0f);
  check_against_reference<float, Isa>(GqaShape::gqa(4, 2, 64), 16, {70}, {}, 1e4f);  // scores ~1e5
}

TYPED_TEST(Prefill, ChunkingDoesNotChangeTheResult) {
  using Isa = typename TypeParam::type;
  const GqaShape s = GqaShape::gqa(8, 2, 64);
  const Prompt pr = random_prompt(s, 120, 5);
  std::vector<float> one, one_lse;
  kvattn::PagedKvCache<kvattn::bf16> a(kvattn::CacheConfig{1, 16, 16, s});
  run_chunks<kvattn::bf16, Isa>(a, a.add_sequence(), s, pr, {120}, one, one_lse);
  for (const std::vector<std::int64_t>& chunks : {std::vector<std::int64_t>{1, 119}, {60, 60}, {17, 33, 1, 69}, {119, 1}}) {
    kvattn::PagedKvCache<kvattn::bf16> b(kvattn::CacheConfig{1, 7, 32, s});  // paged differently, too
    std::vector<float> out, lse;
    run_chunks<kvattn::bf16, Isa>(b, b.add_sequence(), s, pr, chunks, out, lse);
    std::vector<double> ref(one.begin(), one.end()), ref_lse(one_lse.begin(), one_lse.end());
    expect_out_close(out, ref, "chunked out");
    expect_lse_close(lse, ref_lse, "chunked lse");
  }
}

TYPED_TEST(Prefill, DecodeAfterPrefillEqualsLastRow) {
  using Isa = typename TypeParam::type;
  const GqaShape s = GqaShape::gqa(8, 2, 128);
  const Prompt pr = random_prompt(s, 77, 9);
  kvattn::PagedKvCache<kvattn::fp16> cache(kvattn::CacheConfig{1, 16, 8, s});
  const auto seq = cache.add_sequence();
  std::vector<float> out, lse;
  run_chunks<kvattn::fp16, Isa>(cache, seq, s, pr, {77}, out, lse);
  // The same last token as a decode step over the cache the prefill wrote.
  const auto table = cache.page_table({seq});
  std::vector<float> dout(static_cast<std::size_t>(s.q_heads) * s.head_dim), dlse(static_cast<std::size_t>(s.q_heads));
  kvattn::DecodeWorkspace ws;
  kvattn::decode(cache.view(table, 0), s, pr.q.data() + 76 * s.q_heads * s.head_dim, dout.data(), dlse.data(), {}, ws,
                 kvattn::SerialFor{}, Isa{});
  std::vector<double> last(out.end() - static_cast<std::ptrdiff_t>(dout.size()), out.end());
  std::vector<double> last_lse(lse.end() - static_cast<std::ptrdiff_t>(dlse.size()), lse.end());
  expect_out_close(dout, last, "decode vs prefill");
  expect_lse_close(dlse, last_lse, "decode lse vs prefill");
}

TEST(PrefillErrors, InconsistentArgumentsLeaveTheCacheAlone) {
  const GqaShape s = GqaShape::gqa(4, 2, 64);
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{2, 16, 4, s});
  const auto seq = cache.add_sequence();
  cache.append(seq, 10);
  std::vector<float> q(10 * 4 * 64), kv(10 * 2 * 64), out(q.size());
  kvattn::PrefillWorkspace ws;
  const std::int64_t too_many[2] = {0, 11}, fine[2] = {0, 10};
  EXPECT_THROW(kvattn::prefill(cache, 0, {seq}, too_many, s, q.data(), kv.data(), kv.data(), out.data(), nullptr, {}, ws),
               kvattn::invalid_argument);
  EXPECT_THROW(kvattn::prefill(cache, 2, {seq}, fine, s, q.data(), kv.data(), kv.data(), out.data(), nullptr, {}, ws),
               kvattn::invalid_argument);
  EXPECT_THROW(kvattn::prefill(cache, 0, {seq}, fine, GqaShape::gqa(4, 4, 64), q.data(), kv.data(), kv.data(), out.data(), nullptr, {}, ws),
               kvattn::shape_error);
  EXPECT_THROW(kvattn::prefill(cache, 0, {seq + 1}, fine, s, q.data(), kv.data(), kv.data(), out.data(), nullptr, {}, ws),
               kvattn::invalid_argument);
  kvattn::PrefillParams p;
  // Blocks whose scratch size would overflow (INT_MAX, or 2^30 + 1 tokens of 4 rows each) are
  // rejected before anything is sized or written.
  for (int block : {0, -1, kvattn::PrefillParams::kMaxQueryBlock + 1, (1 << 30) + 1, std::numeric_limits<int>::max()}) {
    p.query_block = block;
    EXPECT_THROW(kvattn::prefill(cache, 0, {seq}, fine, s, q.data(), kv.data(), kv.data(), out.data(), nullptr, p, ws),
                 kvattn::invalid_argument) << "query_block=" << block;
  }
  std::vector<float> k(64 * 2), v(k.size());
  for (std::int64_t t = 0; t < 10; ++t) {  // nothing was written by the rejected calls
    cache.read(seq, 0, t, k.data(), v.data());
    for (float x : k) ASSERT_EQ(x, 0.0f);
  }
}

// The rows of an item (group size × the block used) are bounded too: 512 heads per group in
// blocks of 4,096 tokens would be 2^21 rows of scratch per item.
TEST(PrefillErrors, ItemsOfTooManyRowsAreRejected) {
  const GqaShape s = GqaShape::gqa(512, 1, 1);
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{1, 64, 64, s});
  const auto seq = cache.add_sequence();
  cache.append(seq, 4096);
  std::vector<float> q(4096 * 512), kv(4096), out(q.size());
  kvattn::PrefillWorkspace ws;
  const std::int64_t indptr[2] = {0, 4096};
  kvattn::PrefillParams p;
  p.query_block = 4096;
  try {
    kvattn::prefill(cache, 0, {seq}, indptr, s, q.data(), kv.data(), kv.data(), out.data(), nullptr, p, ws);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2097152 query rows"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ws.scratch.size(), 0u);
}

// A batch is one request: when the pool cannot hold the copy-on-write copies of every chunk's
// shared pages, nothing is written, not even the chunks of the sequences that could be copied.
TEST(PrefillErrors, ABatchThatCannotCopyItsSharedPagesChangesNothing) {
  const GqaShape s = GqaShape::gqa(4, 2, 64);
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{2, 16, 7, s});
  const auto a = cache.add_sequence();
  cache.append(a, 20);  // 2 pages
  const auto a_beam = cache.fork(a);
  const auto c = cache.add_sequence();
  cache.append(c, 20);
  const auto c_beam = cache.fork(c);
  ASSERT_EQ(cache.free_pages(), 3);  // the chunks of a and c need 4 copies
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> q(40 * 4 * 64), k(40 * 2 * 64), v(k.size()), out(q.size());
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) e = dist(rng);
  kvattn::PrefillWorkspace ws;
  const std::int64_t both[3] = {0, 20, 40};
  const auto before = cache_snapshot::snapshot(cache);
  EXPECT_THROW(kvattn::prefill(cache, 1, {a, c}, both, s, q.data(), k.data(), v.data(), out.data(), nullptr, {}, ws),
               kvattn::capacity_error);
  EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));
  EXPECT_THROW(kvattn::prefill(cache, 1, {a, a}, both, s, q.data(), k.data(), v.data(), out.data(), nullptr, {}, ws),
               kvattn::invalid_argument);
  EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));

  // Without c's beam, c's pages are its own: a's 2 copies fit, and the batch is written.
  cache.remove(c_beam);
  kvattn::prefill(cache, 1, {a, c}, both, s, q.data(), k.data(), v.data(), out.data(), nullptr, {}, ws);
  EXPECT_EQ(cache.free_pages(), 1);
  std::vector<float> kr(2 * 64), vr(kr.size());
  for (std::int64_t t = 0; t < 20; ++t) {
    cache.read(a, 1, t, kr.data(), vr.data());
    EXPECT_TRUE(std::equal(kr.begin(), kr.end(), k.begin() + t * 2 * 64)) << "a, token " << t;
    cache.read(c, 1, t, kr.data(), vr.data());
    EXPECT_TRUE(std::equal(vr.begin(), vr.end(), v.begin() + (20 + t) * 2 * 64)) << "c, token " << t;
    cache.read(a_beam, 1, t, kr.data(), vr.data());  // the beam keeps what it shared: zeros
    EXPECT_TRUE(std::all_of(kr.begin(), kr.end(), [](float x) { return x == 0.0f; })) << "a's beam, token " << t;
  }
  EXPECT_NO_THROW(cache.check_invariants());
}

}  // namespace
