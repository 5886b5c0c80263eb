// Chunked causal prefill against the double-precision reference (reference.hpp: the causal
// attention of the last n tokens of a sequence), and the identities it must keep: any chunking
// equals one-shot prefill, decode after prefill equals the prefill's last row, paged equals
// contiguous. Shapes: group sizes 1, 3, 4, 8 and groups = heads; head sizes 64, 128, 256 and odd
// ones; page sizes 1, 7, 16; prompts of 1 token to several hundred; fp32, fp16, bf16, int8_row,
// fp8_e4m3_row, fp8_e4m3_layer and q4_block storage; the scalar and the native path. Same element-wise bound as decode:
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
#include "isa_tags.hpp"
#include "policy_checks.hpp"
#include "reference.hpp"

namespace {

using kvattn::GqaShape;

using checks::expect_close;
using checks::expect_lse_close;
using checks::expect_out_close;
using checks::Prompt;
using checks::random_prompt;

/// Prefills one sequence in the given chunks (a plan per chunk, on two threads) with policy
/// `policy`; returns out and lse of every prompt token.
template <class T, class Isa, class P = kvattn::Plain>
void run_chunks(kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, const GqaShape& s, const Prompt& pr,
                const std::vector<std::int64_t>& chunks, std::vector<float>& out, std::vector<float>& lse,
                const kvattn::PrefillParams& params = {}, const P& policy = P{}) {
  std::int64_t total = 0;
  for (auto c : chunks) total += c;
  out.assign(static_cast<std::size_t>(total) * s.q_heads * s.head_dim, 7.0f);
  lse.assign(static_cast<std::size_t>(total) * s.q_heads, 7.0f);
  kvattn::PrefillPlan plan;
  kvattn::ThreadPool pool(2);
  std::int64_t done = 0;
  for (auto n : chunks) {
    cache.append(seq, n);
    plan.make(cache, kvattn::ChunkBatch{{seq, n}}, s, params, pool);
    const std::size_t qo = static_cast<std::size_t>(done) * s.q_heads * s.head_dim;
    const std::size_t kv = static_cast<std::size_t>(done) * s.kv_heads * s.head_dim;
    kvattn::prefill(cache, 0, pr.q.data() + qo, pr.k.data() + kv, pr.v.data() + kv, out.data() + qo,
                    lse.data() + static_cast<std::size_t>(done) * s.q_heads, plan, pool, policy, Isa{});
    done += n;
  }
}

/// e_s above, for keys in [-1, 1].
double score_error(const GqaShape& s, double q_max) { return std::ldexp(1.0, -23) * q_max * std::sqrt(double(s.head_dim)); }


/// Prefills one prompt in `chunks` with policy P (window and cap: its values, if it uses them)
/// and checks every token against the reference (the whole prompt as one call's queries).
template <class T, class Isa, class P = kvattn::Plain>
void check_against_reference(const GqaShape& s, int page, std::vector<std::int64_t> chunks, kvattn::PrefillParams params = {},
                             float q_scale = 1.0f, std::int64_t window = 0, float soft_cap = 0.0f) {
  SCOPED_TRACE(kvattn::detail::concat("q_heads=", s.q_heads, " kv_heads=", s.kv_heads, " head_dim=", s.head_dim, " page=", page,
                                      " storage=", kvattn::format_traits<T>::name, " isa=", Isa::name, " block=", params.query_block));
  std::int64_t total = 0;
  for (auto c : chunks) total += c;
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, page, (total + page - 1) / page + 1, s}, checks::test_scales<T>());
  const auto seq = cache.add_sequence();
  const Prompt pr = random_prompt(s, total, static_cast<unsigned>(total * 7 + s.head_dim), q_scale);
  std::vector<float> out, lse;
  const policy_checks::Values values(s.q_heads, {0, total}, window, soft_cap, static_cast<unsigned>(total));
  run_chunks<T, Isa>(cache, seq, s, pr, chunks, out, lse, params, policy_checks::make<P>(values));
  const reference::Options o = policy_checks::options<P>(values, 0);
  std::vector<double> ref, ref_lse;
  reference::decode(cache, seq, 0, s, pr.q.data(), o, ref, ref_lse);
  const double e_s = score_error(s, q_scale);
  expect_out_close(out, ref, "out", e_s);
  expect_lse_close(lse, ref_lse, "lse", e_s);
}

using isa_tags::Isas;
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
  // int8 with a scale per row: the chunk's own keys are read back quantized, as decode reads them.
  for (int group : {1, 3, 8}) check_against_reference<kvattn::int8_row, Isa>(GqaShape::gqa(2 * group, 2, 64), 7, {20, 1, 30});
  check_against_reference<kvattn::int8_row, Isa>(GqaShape::gqa(8, 2, 128), 1, {33, 12});
  check_against_reference<kvattn::int8_row, Isa>(GqaShape::mha(3, 80), 16, {45});
  check_against_reference<kvattn::hadamard<kvattn::int8_row>, Isa>(GqaShape::gqa(6, 2, 64), 7, {20, 1, 30});
  check_against_reference<kvattn::hadamard<kvattn::int8_row>, Isa>(GqaShape::gqa(4, 1, 128), 16, {40});
  for (int group : {1, 3, 8}) check_against_reference<kvattn::fp8_e4m3_row, Isa>(GqaShape::gqa(2 * group, 2, 64), 7, {20, 1, 30});
  check_against_reference<kvattn::fp8_e4m3_row, Isa>(GqaShape::mha(3, 80), 16, {45});
  check_against_reference<kvattn::hadamard<kvattn::fp8_e4m3_row>, Isa>(GqaShape::gqa(6, 2, 64), 7, {20, 1, 30});
  for (int group : {1, 3}) check_against_reference<kvattn::fp8_e4m3_layer, Isa>(GqaShape::gqa(2 * group, 2, 64), 7, {20, 1, 30});
  check_against_reference<kvattn::fp8_e4m3_layer, Isa>(GqaShape::mha(3, 80), 1, {45});
  // 4-bit blocks with a scale and a minimum each (head sizes of whole blocks of 32).
  for (int group : {1, 3}) check_against_reference<kvattn::q4_block, Isa>(GqaShape::gqa(2 * group, 2, 64), 7, {20, 1, 30});
  check_against_reference<kvattn::q4_block, Isa>(GqaShape::mha(3, 96), 1, {45});
  check_against_reference<kvattn::hadamard<kvattn::q4_block>, Isa>(GqaShape::gqa(4, 1, 128), 16, {40});
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

TYPED_TEST(Prefill, PoliciesAndLargeLogits) {
  using Isa = typename TypeParam::type;
  using kvattn::Compose;
  check_against_reference<float, Isa, kvattn::SlidingWindow>(GqaShape::gqa(8, 2, 64), 16, {60, 40}, {}, 1.0f, 17);
  check_against_reference<kvattn::bf16, Isa, kvattn::SlidingWindow>(GqaShape::gqa(4, 2, 64), 7, {30}, {}, 1.0f, 1);
  check_against_reference<float, Isa, Compose<kvattn::SlidingWindow, kvattn::SoftCap>>(GqaShape::gqa(8, 2, 64), 16, {90}, {},
                                                                                       10.0f, 40, 20.0f);
  check_against_reference<float, Isa>(GqaShape::gqa(4, 2, 64), 16, {70}, {}, 1e4f);  // scores ~1e5
  // Sinks (counted once per row), ALiBi for group sizes 1, 3 and 8, and gpt-oss's composition.
  check_against_reference<float, Isa, kvattn::Sinks>(GqaShape::gqa(6, 2, 80), 7, {50, 1, 30});
  check_against_reference<kvattn::bf16, Isa, kvattn::Sinks>(GqaShape::gqa(8, 8, 64), 1, {1});
  for (int group : {1, 3, 8}) check_against_reference<float, Isa, kvattn::Alibi>(GqaShape::gqa(2 * group, 2, 64), 16, {40, 33});
  check_against_reference<kvattn::bf16, Isa, kvattn::Alibi>(GqaShape::gqa(12, 4, 128), 16, {100});
  using Gpt = Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;
  check_against_reference<kvattn::bf16, Isa, Gpt>(GqaShape::gqa(8, 2, 64), 7, {70, 50}, {}, 4.0f, 32, 20.0f);
  check_against_reference<kvattn::int8_row, Isa, Gpt>(GqaShape::gqa(8, 2, 64), 7, {70, 50}, {}, 4.0f, 32, 20.0f);
  check_against_reference<kvattn::hadamard<kvattn::int8_row>, Isa, Gpt>(GqaShape::gqa(8, 2, 64), 7, {70, 50}, {}, 4.0f, 32, 20.0f);
}

/// A batch of sequences, each with a chunk of `chunk[b]` new tokens after a cached prefix of
/// `prefix[b]`, prefilled in one call with policy P, checked against the reference sequence by
/// sequence (the chunk's tokens are its queries: a tree mask spans the chunk).
template <class T, class Isa, class P>
void check_batch(const GqaShape& s, int page, const std::vector<std::int64_t>& prefix, const std::vector<std::int64_t>& chunk,
                 std::int64_t window = 0, float soft_cap = 0.0f) {
  SCOPED_TRACE(kvattn::detail::concat("q_heads=", s.q_heads, " kv_heads=", s.kv_heads, " head_dim=", s.head_dim, " page=", page,
                                      " storage=", kvattn::format_traits<T>::name, " isa=", Isa::name));
  std::int64_t pages = 0, total = 0;
  for (std::size_t b = 0; b < prefix.size(); ++b) pages += (prefix[b] + chunk[b] + page - 1) / page;
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, page, pages + 1, s});
  std::vector<kvattn::SeqId> seqs;
  kvattn::ChunkBatch batch;
  std::vector<std::int64_t> indptr{0};
  for (std::size_t b = 0; b < prefix.size(); ++b) {
    seqs.push_back(cache.add_sequence());
    if (prefix[b] > 0) {  // the prefix, written as a plain prefill would have
      cache.append(seqs[b], prefix[b]);
      const Prompt pre = random_prompt(s, prefix[b], static_cast<unsigned>(100 + b));
      cache.write(seqs[b], 0, 0, prefix[b], pre.k.data(), pre.v.data());
    }
    if (chunk[b] > 0) cache.append(seqs[b], chunk[b]);
    batch.add(seqs[b], chunk[b]);
    total += chunk[b];
    indptr.push_back(total);
  }
  const Prompt pr = random_prompt(s, total, static_cast<unsigned>(total * 3 + 1));
  const policy_checks::Values values(s.q_heads, indptr, window, soft_cap, static_cast<unsigned>(total));
  std::vector<float> out(pr.q.size(), 7.0f), lse(static_cast<std::size_t>(total) * s.q_heads, 7.0f);
  kvattn::ThreadPool pool(3);
  kvattn::PrefillParams params;
  params.query_block = 5;  // several blocks per chunk
  kvattn::PrefillPlan plan;
  plan.make(cache, batch, s, params, pool);
  kvattn::prefill(cache, 0, pr.q.data(), pr.k.data(), pr.v.data(), out.data(), lse.data(), plan, pool,
                  policy_checks::make<P>(values), Isa{});
  const std::size_t qrow = static_cast<std::size_t>(s.q_heads) * s.head_dim;
  for (std::size_t b = 0; b < prefix.size(); ++b) {
    std::vector<double> ref, ref_lse;
    reference::decode(cache, seqs[b], 0, s, pr.q.data() + indptr[b] * qrow, policy_checks::options<P>(values, b), ref, ref_lse);
    const std::vector<float> got(out.begin() + static_cast<std::ptrdiff_t>(indptr[b] * qrow),
                                 out.begin() + static_cast<std::ptrdiff_t>(indptr[b + 1] * qrow));
    const std::vector<float> got_lse(lse.begin() + indptr[b] * s.q_heads, lse.begin() + indptr[b + 1] * s.q_heads);
    expect_out_close(got, ref, "out of sequence " + std::to_string(b));
    expect_lse_close(got_lse, ref_lse, "lse of sequence " + std::to_string(b));
  }
}

TYPED_TEST(Prefill, TreeMasksAndSinksOverABatch) {
  using Isa = typename TypeParam::type;
  // Draft trees of up to 16 tokens after cached prefixes (0, 1, a page and more), page sizes 1 and 7.
  check_batch<float, Isa, kvattn::TreeMask>(GqaShape::gqa(8, 2, 64), 7, {40, 0, 1, 7}, {16, 5, 1, 9});
  check_batch<kvattn::bf16, Isa, kvattn::TreeMask>(GqaShape::gqa(3, 1, 7), 1, {20, 3}, {12, 4});
  check_batch<float, Isa, kvattn::Compose<kvattn::SlidingWindow, kvattn::TreeMask>>(GqaShape::gqa(4, 2, 64), 16, {50, 2}, {16, 8}, 10);
  check_batch<kvattn::bf16, Isa, kvattn::Compose<kvattn::Alibi, kvattn::Sinks>>(GqaShape::gqa(12, 4, 64), 16, {30, 0}, {40, 3});
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
  kvattn::DecodePlan plan;
  plan.make(cache.view(table, 0), s, {}, 1);
  kvattn::decode(cache.view(table, 0), pr.q.data() + 76 * s.q_heads * s.head_dim, dout.data(), dlse.data(), plan,
                 kvattn::SerialFor{}, kvattn::Plain{}, Isa{});
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
  kvattn::PrefillPlan plan;
  EXPECT_THROW(kvattn::prefill(cache, 0, q.data(), kv.data(), kv.data(), out.data(), nullptr, plan), kvattn::invalid_argument);
  EXPECT_THROW(plan.make(cache, {{seq, 11}}, s, {}, 1), kvattn::invalid_argument);
  EXPECT_THROW(plan.make(cache, {{seq, 10}}, GqaShape::gqa(4, 4, 64), {}, 1), kvattn::shape_error);
  EXPECT_THROW(plan.make(cache, {{seq + 1, 10}}, s, {}, 1), kvattn::invalid_argument);
  EXPECT_THROW(plan.make(cache, {{seq, 10}}, s, {}, 0), kvattn::invalid_argument);
  kvattn::PrefillParams p;
  p.scale = -1.0f;
  EXPECT_THROW(plan.make(cache, {{seq, 10}}, s, p, 1), kvattn::invalid_argument);
  // Blocks whose scratch size would overflow (INT_MAX, or 2^30 + 1 tokens of 4 rows each) are
  // rejected before anything is sized or written.
  for (int block : {0, -1, kvattn::PrefillParams::kMaxQueryBlock + 1, (1 << 30) + 1, std::numeric_limits<int>::max()}) {
    p = {};
    p.query_block = block;
    EXPECT_THROW(plan.make(cache, {{seq, 10}}, s, p, 1), kvattn::invalid_argument) << "query_block=" << block;
  }
  plan.make(cache, {{seq, 10}}, s, {}, 1);
  EXPECT_THROW(kvattn::prefill(cache, 2, q.data(), kv.data(), kv.data(), out.data(), nullptr, plan), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::prefill(cache, 0, q.data(), nullptr, kv.data(), out.data(), nullptr, plan), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::prefill(cache, 0, q.data(), kv.data(), kv.data(), out.data(), nullptr, plan, kvattn::SerialFor{},
                               kvattn::SlidingWindow{-3}),
               kvattn::invalid_argument);
  const std::vector<std::uint64_t> tree(10, 1);  // row i > 0 does not see its own token: allowed; 9 rows: not
  EXPECT_THROW(kvattn::prefill(cache, 0, q.data(), kv.data(), kv.data(), out.data(), nullptr, plan, kvattn::SerialFor{},
                               kvattn::TreeMask{tree.data(), 9}),
               kvattn::invalid_argument);
  // The plan of another cache, or of this cache before it changed.
  kvattn::PagedKvCache<float> other(kvattn::CacheConfig{2, 16, 4, s});
  EXPECT_THROW(kvattn::prefill(other, 0, q.data(), kv.data(), kv.data(), out.data(), nullptr, plan), kvattn::invalid_argument);
  const auto beam = cache.fork(seq);
  try {
    kvattn::prefill(cache, 0, q.data(), kv.data(), kv.data(), out.data(), nullptr, plan);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("prefill: the cache has changed since the plan was made"), std::string::npos) << e.what();
  }
  cache.remove(beam);
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
  kvattn::PrefillParams p;
  p.query_block = 4096;
  kvattn::PrefillPlan plan;
  try {
    plan.make(cache, {{seq, 4096}}, s, p, 1);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2097152 query rows"), std::string::npos) << e.what();
  }
  EXPECT_EQ(plan.bytes(), 0u);
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
  kvattn::PrefillPlan plan;
  const auto before = cache_snapshot::snapshot(cache);
  EXPECT_THROW(plan.make(cache, {{a, 20}, {c, 20}}, s, {}, 1), kvattn::capacity_error);
  EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));
  EXPECT_THROW(plan.make(cache, {{a, 20}, {a, 20}}, s, {}, 1), kvattn::invalid_argument);
  EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));

  // Without c's beam, c's pages are its own: a's 2 copies fit, and the batch is written.
  cache.remove(c_beam);
  plan.make(cache, {{a, 20}, {c, 20}}, s, {}, 1);
  kvattn::prefill(cache, 1, q.data(), k.data(), v.data(), out.data(), nullptr, plan);
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
