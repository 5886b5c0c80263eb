// The CUDA GQA-family decode and append against the same double-precision reference and bounds
// as the CPU tests (test_decode.cpp): group sizes 1, 2, 3, 4, 8 and groups = heads; head sizes
// 64, 128, 256 and odd ones; page sizes 1, 7, 16, 64; contexts 0, 1, page size ± 1 and
// thousands; mixed batches; several queries per sequence; split-KV chunks; large logits; fp32,
// fp16 and bf16 storage and the 8-bit formats int8_row, fp8_e4m3_row and fp8_e4m3_layer (against
// the reference on the dequantized cache, as on the CPU). The score policies (kvattn/policy.hpp) as the CPU tests run them
// (test_decode_policies.cpp): the window and the soft-cap, attention sinks (counted once however
// the keys are split), ALiBi, tree masks (Q up to 16) and gpt-oss's window + soft-cap + sinks,
// with sequences split into many chunks and sequences of one. A whole step of several layers
// (and an MLA layer) captured into a CUDA graph and replayed gives the direct calls' results bit
// for bit. The append kernel and the device cache's copy-on-write are checked bit for bit
// against the host cache doing the same steps.
// Every test that runs a kernel needs a CUDA device and says so when it skips; the argument
// checks run anywhere (they throw before the device is touched).
#include <kvattn/core.hpp>
#include <kvattn/policy.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "../attention_checks.hpp"
#include "../policy_checks.hpp"
#include "../reference.hpp"
#include "device.hpp"
#include "gqa_kernels.hpp"
#include "graph_kernels.hpp"

namespace {

using kvattn::GqaShape;

using Case = checks::DecodeCase;

/// Runs cuda::decode with policy P (its values from the case: checks::policy_values, copied to
/// the device) and checks it against the reference.
template <class T, class P = kvattn::Plain> void check(const Case& c) {
  SCOPED_TRACE(describe(c) + " format=" + std::string(kvattn::format_traits<T>::name));
  const checks::DecodeInputs<T> in(c);
  const policy_checks::Values values = checks::policy_values(c);
  std::vector<float> out = in.out(), lse = in.lse(c);
  cuda_tests::run_decode<T, P>(in.cache, in.seqs, c.shape, in.q, checks::decode_params(c), policy_checks::make<P>(values), out, lse);
  checks::expect_decode_case_matches<P>(in, c, values, out, lse);
}

void check_all_storage(const Case& c) {
  check<float>(c);
  check<kvattn::fp16>(c);
  check<kvattn::bf16>(c);
  check<kvattn::int8_row>(c);
  check<kvattn::fp8_e4m3_row>(c);
  check<kvattn::fp8_e4m3_layer>(c);
}

TEST(CudaDecode, GroupSizesAndHeadSizes) {
  KVATTN_REQUIRE_GPU();
  for (int group : {1, 2, 3, 4, 8})
    for (int dim : {64, 128, 256, 7, 80, 200})
      check_all_storage(Case{GqaShape::gqa(2 * group, 2, dim), 16, {37, 1, 100}});
  check_all_storage(Case{GqaShape::mha(6, 64), 16, {50, 9}});     // groups = heads (MHA)
  check_all_storage(Case{GqaShape::mqa(12, 128), 16, {50, 9}});    // one group of 12: two row blocks (MQA)
  check_all_storage(Case{GqaShape::gqa(32, 8, 128), 16, {1000}});  // the benchmark's shape
}

TEST(CudaDecode, PageSizesAndAwkwardContexts) {
  KVATTN_REQUIRE_GPU();
  for (int page : {1, 7, 16, 64})
    check_all_storage(Case{GqaShape::gqa(8, 2, 64), page, {0, 1, page - 1 > 0 ? page - 1 : 2, page + 1, 3 * page, 5}});
  check_all_storage(Case{GqaShape::gqa(8, 2, 128), 16, {0}});  // a batch of one empty sequence
}

TEST(CudaDecode, LongContextsSplit) {
  KVATTN_REQUIRE_GPU();
  check_all_storage(Case{GqaShape::gqa(8, 2, 128), 16, {3000}});                              // chunks chosen
  check_all_storage(Case{GqaShape::gqa(4, 4, 64), 7, {2500, 17, 0, 1200}, 1, 0, 0, 100});     // chunks of 100
  check<kvattn::bf16>(Case{GqaShape::gqa(4, 1, 128), 64, {20000}, 1, 0, 0, 333});
  check<kvattn::fp16>(Case{GqaShape::gqa(32, 8, 128), 16, {9000, 3, 4100}});
  check<float>(Case{GqaShape::gqa(4, 2, 80), 16, {300, 2}, 2, 0, 0, 1});  // chunks of one token: most parts empty
}

TEST(CudaDecode, SeveralQueriesPerSequenceAreCausal) {
  KVATTN_REQUIRE_GPU();
  check_all_storage(Case{GqaShape::gqa(6, 2, 64), 7, {40, 3, 2, 16}, 3});
  check_all_storage(Case{GqaShape::gqa(6, 3, 80), 16, {500, 64}, 4, 0, 0, 50});
  check_all_storage(Case{GqaShape::gqa(16, 2, 128), 16, {300, 9}, 2});  // 16 rows: two row blocks
}

TEST(CudaDecode, LargeLogitsDoNotOverflow) {
  KVATTN_REQUIRE_GPU();
  check<float>(Case{GqaShape::gqa(4, 2, 64), 16, {200, 3}, 1, 0, 0, 50, 1e4f});
}

// ---- score policies ----------------------------------------------------------------------------

TEST(CudaDecodePolicies, SlidingWindowAndSoftCap) {
  KVATTN_REQUIRE_GPU();
  using kvattn::SlidingWindow;
  using kvattn::SoftCap;
  using Both = kvattn::Compose<SlidingWindow, SoftCap>;
  check<kvattn::fp16, SlidingWindow>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5, 33}, 1, 20});
  check<kvattn::fp16, SlidingWindow>(Case{GqaShape::gqa(8, 2, 64), 7, {100, 5, 33}, 3, 1});  // window 1: the row's own token
  check<kvattn::fp16, SlidingWindow>(Case{GqaShape::gqa(4, 1, 128), 16, {2000, 7}, 2, 300, 0.0f, 128});  // chunks outside the window
  check<kvattn::fp16, SoftCap>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5}, 1, 0, 5.0f, 0, 40.0f});
  check<kvattn::fp16, Both>(Case{GqaShape::gqa(8, 4, 128), 16, {300, 5}, 2, 64, 30.0f, 70, 40.0f});
}

TEST(CudaDecodePolicies, SinksJoinTheDenominatorOnce) {
  KVATTN_REQUIRE_GPU();
  using kvattn::Sinks;
  check<kvattn::bf16, Sinks>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 0, 1, 33}});             // context 0: out 0, lse = sink
  check<kvattn::bf16, Sinks>(Case{GqaShape::gqa(6, 2, 80), 7, {40, 3, 2}, 3});                 // group 3, odd head size, Q = 3
  check<kvattn::bf16, Sinks>(Case{GqaShape::gqa(3, 3, 128), 1, {20, 1}, 1, 0, 0.0f, 0, 8.0f});  // page 1, large logits
  // Split: 15 chunks of one sequence merged with one sink, beside a sequence of one chunk.
  check<kvattn::bf16, Sinks>(Case{GqaShape::gqa(8, 1, 128), 16, {1500, 7}, 2, 0, 0.0f, 100});
  check<kvattn::bf16, Sinks>(Case{GqaShape::gqa(4, 2, 256), 16, {3000, 0, 1}, 2});            // chunks chosen by the plan
  check<kvattn::bf16, Sinks>(Case{GqaShape::gqa(4, 2, 64), 7, {40, 2}, 4, 0, 0.0f, 1});        // chunks of one token, rows that see nothing
}

TEST(CudaDecodePolicies, AlibiForEveryGroupSize) {
  KVATTN_REQUIRE_GPU();
  using kvattn::Alibi;
  for (int group : {1, 3, 8}) check<kvattn::bf16, Alibi>(Case{GqaShape::gqa(2 * group, 2, 64), 7, {90, 1, 0}, 2});
  check<kvattn::bf16, Alibi>(Case{GqaShape::gqa(12, 4, 80), 16, {300, 64}, 1});  // 12 heads: slopes of 8 and of 16
  check<kvattn::bf16, Alibi>(Case{GqaShape::mha(5, 128), 16, {2000, 3}, 1, 0, 0.0f, 256});
}

TEST(CudaDecodePolicies, TreeMasksOverTheNewTokens) {
  KVATTN_REQUIRE_GPU();
  using kvattn::TreeMask;
  check<kvattn::bf16, TreeMask>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 40, 16}, 16});  // Q = 16: a draft tree of 16
  check<kvattn::bf16, TreeMask>(Case{GqaShape::gqa(6, 2, 7), 7, {50, 5, 3}, 5});        // sequences shorter than Q
  check<kvattn::bf16, TreeMask>(Case{GqaShape::gqa(4, 4, 128), 1, {30, 9}, 1});         // Q = 1: the mask is its own token
  check<kvattn::bf16, TreeMask>(Case{GqaShape::gqa(8, 8, 64), 16, {1200}, 12, 0, 0.0f, 64});  // split, the tree in the last chunk
  check<kvattn::bf16, TreeMask>(Case{GqaShape::gqa(4, 2, 64), 16, {300, 20}, 16, 0, 0.0f, 5});  // the tree across chunks
}

TEST(CudaDecodePolicies, GptOssWindowSoftCapAndSinks) {
  KVATTN_REQUIRE_GPU();
  using Gpt = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;
  check<kvattn::bf16, Gpt>(Case{GqaShape::gqa(8, 2, 64), 16, {200, 5, 0}, 1, 40, 20.0f, 0, 4.0f});
  check<kvattn::bf16, Gpt>(Case{GqaShape::gqa(9, 3, 7), 7, {0, 1, 60}, 3, 1, 5.0f});  // window 1: the row's own token
  check<kvattn::bf16, Gpt>(Case{GqaShape::gqa(8, 1, 128), 16, {1500, 3}, 2, 150, 30.0f, 100, 10.0f});  // chunks outside the window
  check<kvattn::bf16, Gpt>(Case{GqaShape::gqa(64, 8, 64), 16, {4000, 100}, 1, 128, 30.0f});  // gpt-oss's heads, chunks chosen
}

// ---- a step captured into a CUDA graph ---------------------------------------------------------

TEST(CudaDecodeGraph, AStepOfSeveralLayersReplaysAsTheDirectCalls) {
  KVATTN_REQUIRE_GPU();
  const cuda_tests::GraphStep step = cuda_tests::graph_step(2);
  ASSERT_EQ(step.error, "");
  ASSERT_EQ(step.direct.size(), 2u);
  ASSERT_EQ(step.graph.size(), 2u);
  for (std::size_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("replay " + std::to_string(r));
    for (float x : step.direct[r]) ASSERT_TRUE(std::isfinite(x));  // (every row has a sink: no -inf)
    EXPECT_TRUE(step.graph[r] == step.direct[r]) << "the graph's results differ from the direct calls'";
  }
  EXPECT_FALSE(step.direct[0] == step.direct[1]) << "the new queries changed nothing";
}

// ---- argument checks (no GPU needed) -----------------------------------------------------------

// Runs without a GPU: every argument check comes before any device call.
TEST(CudaDecodeErrors, InconsistentArgumentsAreRejectedBeforeAnyDeviceCall) {
  const GqaShape cache_shape = GqaShape::gqa(8, 2, 64);
  using cuda_tests::plan_error;
  kvattn::DecodeParams p;
  EXPECT_EQ(plan_error(cache_shape, cache_shape, p), "");  // an empty batch: nothing to do
  const std::string wrong_heads = plan_error(cache_shape, GqaShape::gqa(8, 4, 64), p);
  EXPECT_NE(wrong_heads.find("kv_heads=4"), std::string::npos) << wrong_heads;
  EXPECT_NE(wrong_heads.find("cuda::DecodePlan::make"), std::string::npos) << wrong_heads;
  EXPECT_NE(plan_error(cache_shape, GqaShape::gqa(8, 3, 64), p), "");
  p.queries_per_seq = 0;
  EXPECT_NE(plan_error(cache_shape, cache_shape, p).find("queries_per_seq=0"), std::string::npos);
  p = {};
  p.chunk_tokens = -1;
  EXPECT_NE(plan_error(cache_shape, cache_shape, p).find("chunk_tokens=-1"), std::string::npos);
  p = {};
  p.scale = std::nanf("");
  EXPECT_NE(plan_error(cache_shape, cache_shape, p).find("scale="), std::string::npos);
  p = {};
  const GqaShape wide = GqaShape::gqa(2, 1, 640);
  EXPECT_NE(plan_error(wide, wide, p).find("head_dim=640"), std::string::npos);
  // Page tables that do not fit the cache (4 pages of 16), rejected before the device is touched.
  kvattn::BatchPageTable bad;
  bad.indptr = {0, 1};
  bad.indices = {5};
  bad.last_page_len = {3};
  EXPECT_NE(plan_error(cache_shape, cache_shape, p, bad).find("page id 5"), std::string::npos);
  bad.indices = {0};
  bad.last_page_len = {17};
  EXPECT_NE(plan_error(cache_shape, cache_shape, p, bad).find("last_page_len=17"), std::string::npos);
  bad.last_page_len = {};
  EXPECT_NE(plan_error(cache_shape, cache_shape, p, bad).find("not one"), std::string::npos);

  using cuda_tests::decode_error;
  using M = cuda_tests::DecodeMisuse;
  EXPECT_EQ(decode_error(cache_shape, M::none), "");
  EXPECT_NE(decode_error(cache_shape, M::window_zero).find("SlidingWindow tokens=0"), std::string::npos);
  EXPECT_NE(decode_error(cache_shape, M::cap_zero).find("SoftCap cap=0"), std::string::npos);
  const std::string alibi = decode_error(cache_shape, M::alibi_heads);
  EXPECT_NE(alibi.find("Alibi slopes heads=9"), std::string::npos) << alibi;
  EXPECT_NE(alibi.find("cuda::decode"), std::string::npos) << alibi;
  EXPECT_NE(decode_error(cache_shape, M::tree_rows).find("TreeMask rows=3"), std::string::npos);
  const std::string mismatch = decode_error(cache_shape, M::batch_mismatch);
  EXPECT_NE(mismatch.find("batch=1"), std::string::npos) << mismatch;
  EXPECT_NE(mismatch.find("does not read this plan's page table"), std::string::npos) << mismatch;
  EXPECT_NE(decode_error(cache_shape, M::mla_plan).find("MLA shape"), std::string::npos);
  EXPECT_NE(decode_error(cache_shape, M::never_made).find("never made"), std::string::npos);
}

// Runs without a GPU.
TEST(CudaDecodeErrors, Int8QueriesAreTheCpuKernels) {
  const std::string e = cuda_tests::int8_queries_error(GqaShape::gqa(8, 2, 64));
  EXPECT_NE(e.find("cuda::DecodePlan::make"), std::string::npos) << e;
  EXPECT_NE(e.find("int8_queries=true"), std::string::npos) << e;
  EXPECT_NE(e.find("fp32"), std::string::npos) << e;
}

TEST(CudaDecodeErrors, PolicyArraysAreCheckedOnTheHostBeforeTheyAreCopied) {
  const std::vector<float> slopes = kvattn::alibi_slopes(4);
  std::vector<float> sinks{0.5f, std::nanf(""), 1.0f, 2.0f};
  const std::vector<std::uint64_t> tree{1, 3, 0x7};
  using cuda_tests::upload_error;
  EXPECT_NE(upload_error(kvattn::Alibi{slopes.data(), 4}, 8, 1).find("Alibi slopes heads=4"), std::string::npos);
  const std::string nan = upload_error(kvattn::Sinks{sinks.data(), 4}, 4, 1);
  EXPECT_NE(nan.find("Sinks logits[1]="), std::string::npos) << nan;
  EXPECT_NE(nan.find("cuda::PolicyArrays::upload"), std::string::npos) << nan;
  EXPECT_NE(upload_error(kvattn::TreeMask{tree.data(), 3}, 4, 2).find("rows=3"), std::string::npos);
  const std::vector<std::uint64_t> later{1, 0x5, 0x7};  // row 1 sees new token 2, after its own
  EXPECT_NE(upload_error(kvattn::TreeMask{later.data(), 3}, 4, 3).find("row 1"), std::string::npos);
  sinks[1] = 0.0f;
  const auto window_sinks = kvattn::compose(kvattn::SlidingWindow{0}, kvattn::Sinks{sinks.data(), 4});
  EXPECT_NE(upload_error(window_sinks, 4, 1).find("SlidingWindow tokens=0"), std::string::npos);
}

TEST(CudaDecodeErrors, ViewsAreOfThePlansCacheUnchanged) {
  KVATTN_REQUIRE_GPU();
  const std::vector<std::string> errors = cuda_tests::view_errors();
  ASSERT_EQ(errors.size(), 4u);
  EXPECT_NE(errors[0].find("is not the one the plan was made for"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("layer=2"), std::string::npos) << errors[1];
  EXPECT_EQ(errors[2], "(no error)");
  EXPECT_NE(errors[3].find("the cache changed since the plan was made"), std::string::npos) << errors[3];
}

// ---- append and the device cache --------------------------------------------------------------

using cuda_tests::AppendStep;

template <class T> void check_replay(const kvattn::CacheConfig& config, const std::vector<AppendStep>& steps, bool expect_error) {
  SCOPED_TRACE(std::string("storage=") + std::string(kvattn::storage_traits<T>::name));
  const auto& shape = std::get<GqaShape>(config.shape);
  std::int64_t rows = 0;
  for (const auto& s : steps) rows += s.kind == AppendStep::write ? s.count : 0;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> k(static_cast<std::size_t>(rows) * shape.kv_heads * shape.head_dim), v(k.size());
  for (auto& x : k) x = dist(rng);
  for (auto& x : v) x = dist(rng);

  kvattn::PagedKvCache<T> host(config);  // the same steps with host writes
  std::vector<kvattn::SeqId> seqs;
  const std::size_t width = static_cast<std::size_t>(shape.kv_heads) * shape.head_dim;
  const std::string host_error = cuda_tests::replay(host, steps, seqs, [&](kvattn::SeqId seq, const AppendStep& s, std::size_t row) {
    host.write(seq, s.layer, s.first, s.count, k.data() + row * width, v.data() + row * width);
  });
  std::vector<T> pool;
  std::vector<std::vector<kvattn::PageId>> tables;
  std::string device_error;
  cuda_tests::replay_on_device<T>(config, steps, k, v, pool, tables, device_error);

  EXPECT_EQ(!host_error.empty(), expect_error) << host_error;
  EXPECT_EQ(device_error.empty(), host_error.empty()) << "host: " << host_error << " device: " << device_error;
  ASSERT_EQ(tables.size(), seqs.size());
  for (std::size_t s = 0; s < seqs.size(); ++s) EXPECT_EQ(tables[s], host.pages(seqs[s])) << "sequence " << s;
  ASSERT_EQ(pool.size() * sizeof(T), host.pool_bytes());
  // Bit for bit: both round to nearest even, and both pools start zeroed.
  EXPECT_EQ(0, std::memcmp(pool.data(), host.data(), host.pool_bytes()));
}

TEST(CudaAppend, WritesAndCopyOnWriteMatchTheHostCacheBitForBit) {
  KVATTN_REQUIRE_GPU();
  for (int page : {1, 7, 16}) {
    const kvattn::CacheConfig config{2, page, 64, GqaShape::gqa(8, 2, 80)};
    using S = AppendStep;
    const std::vector<S> steps = {
        {S::add},                                 // seq 0
        {S::append, 0, 0, 30},  {S::write, 0, 0, 30, 0}, {S::write, 0, 0, 30, 1},
        {S::fork, 0},                             // seq 1 shares seq 0's pages
        {S::append, 1, 0, 5},   {S::write, 1, 28, 7, 0},  // copy-on-write of the shared last page
        {S::write, 0, 3, 2, 1},                   // seq 0 rewrites a shared page in layer 1
        {S::add},                                 // seq 2
        {S::append, 2, 0, 1},   {S::write, 2, 0, 1, 1},
    };
    check_replay<float>(config, steps, false);
    check_replay<kvattn::fp16>(config, steps, false);
    check_replay<kvattn::bf16>(config, steps, false);
  }
}

TEST(CudaAppend, FailedWritesChangeNothing) {
  KVATTN_REQUIRE_GPU();
  using S = AppendStep;
  const kvattn::CacheConfig config{1, 4, 3, GqaShape::gqa(4, 2, 64)};
  // Past the end of the sequence: rejected before any copy.
  check_replay<kvattn::fp16>(config, {{S::add}, {S::append, 0, 0, 5}, {S::write, 0, 0, 5}, {S::write, 0, 3, 3}}, true);
  // A layer out of range.
  check_replay<kvattn::fp16>(config, {{S::add}, {S::append, 0, 0, 2}, {S::write, 0, 0, 2, 1}}, true);
  // Copy-on-write with a full pool: 3 pages, seq 0 holds 2 (8 tokens), its fork shares them, a
  // third sequence takes the last free page; writing into the shared pages needs 2 copies.
  check_replay<kvattn::fp16>(config,
                             {{S::add}, {S::append, 0, 0, 8}, {S::write, 0, 0, 8}, {S::fork, 0}, {S::add}, {S::append, 2, 0, 1},
                              {S::write, 1, 0, 8}},
                             true);
}

}  // namespace
