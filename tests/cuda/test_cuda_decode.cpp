// The CUDA GQA-family decode and append against the same double-precision reference and bounds
// as the CPU tests (test_decode.cpp): group sizes 1, 2, 3, 4, 8 and groups = heads; head sizes
// 64, 128, 256 and odd ones; page sizes 1, 7, 16, 64; contexts 0, 1, page size ± 1 and
// thousands; mixed batches; several queries per sequence; split-KV chunks; sliding window and
// soft-cap; large logits; fp32, fp16 and bf16 storage. The append kernel and the device cache's
// copy-on-write are checked bit for bit against the host cache doing the same steps.
// Every test needs a CUDA device and says so when it skips.
#include <kvattn/decode.hpp>

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
#include "../reference.hpp"
#include "device.hpp"
#include "gqa_kernels.hpp"

namespace {

using kvattn::GqaShape;

using Case = checks::DecodeCase;

template <class T, class V = kvattn::Plain> void check(const Case& c) {
  SCOPED_TRACE(describe(c) + " storage=" + std::string(kvattn::storage_traits<T>::name));
  const checks::DecodeInputs<T> in(c);
  std::vector<float> out = in.out(), lse = in.lse(c);
  cuda_tests::run_decode<T, V>(in.cache, in.seqs, c.shape, in.q, checks::decode_params(c), out, lse);
  checks::expect_decode_case_matches(in, c, out, lse);
}

void check_all_storage(const Case& c) {
  check<float>(c);
  check<kvattn::fp16>(c);
  check<kvattn::bf16>(c);
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
}

TEST(CudaDecode, SeveralQueriesPerSequenceAreCausal) {
  KVATTN_REQUIRE_GPU();
  check_all_storage(Case{GqaShape::gqa(6, 2, 64), 7, {40, 3, 2, 16}, 3});
  check_all_storage(Case{GqaShape::gqa(6, 3, 80), 16, {500, 64}, 4, 0, 0, 50});
  check_all_storage(Case{GqaShape::gqa(16, 2, 128), 16, {300, 9}, 2});  // 16 rows: two row blocks
}

TEST(CudaDecode, SlidingWindowAndSoftCap) {
  KVATTN_REQUIRE_GPU();
  using Window = kvattn::Variant<true, false>;
  using Cap = kvattn::Variant<false, true>;
  using Both = kvattn::Variant<true, true>;
  check<kvattn::fp16, Window>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5, 33}, 1, 20});
  check<kvattn::fp16, Window>(Case{GqaShape::gqa(8, 2, 64), 7, {100, 5, 33}, 3, 1});
  check<kvattn::fp16, Cap>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5}, 1, 0, 5.0f, 0, 40.0f});
  check<kvattn::fp16, Both>(Case{GqaShape::gqa(8, 4, 128), 16, {300, 5}, 2, 64, 30.0f, 70, 40.0f});
}

TEST(CudaDecode, LargeLogitsDoNotOverflow) {
  KVATTN_REQUIRE_GPU();
  check<float>(Case{GqaShape::gqa(4, 2, 64), 16, {200, 3}, 1, 0, 0, 50, 1e4f});
}

// Runs without a GPU: every argument check comes before any device call.
TEST(CudaDecodeErrors, InconsistentArgumentsAreRejectedBeforeAnyDeviceCall) {
  const GqaShape cache_shape = GqaShape::gqa(8, 2, 64);
  kvattn::DecodeParams p;
  EXPECT_EQ(cuda_tests::decode_error(cache_shape, cache_shape, p, 0), "");  // an empty batch: nothing to do
  const std::string wrong_heads = cuda_tests::decode_error(cache_shape, GqaShape::gqa(8, 4, 64), p, 0);
  EXPECT_NE(wrong_heads.find("kv_heads=4"), std::string::npos) << wrong_heads;
  EXPECT_NE(cuda_tests::decode_error(cache_shape, GqaShape::gqa(8, 3, 64), p, 0), "");
  p.queries_per_seq = 0;
  EXPECT_NE(cuda_tests::decode_error(cache_shape, cache_shape, p, 0).find("queries_per_seq=0"), std::string::npos);
  p = {};
  p.chunk_tokens = -1;
  EXPECT_NE(cuda_tests::decode_error(cache_shape, cache_shape, p, 0).find("chunk_tokens=-1"), std::string::npos);
  p = {};
  p.scale = std::nanf("");
  EXPECT_NE(cuda_tests::decode_error(cache_shape, cache_shape, p, 0), "");
  p = {};
  EXPECT_NE(cuda_tests::decode_error(cache_shape, cache_shape, p, 1).find("window=0"), std::string::npos);
  EXPECT_NE(cuda_tests::decode_error(cache_shape, cache_shape, p, 2).find("soft_cap=0"), std::string::npos);
  const GqaShape wide = GqaShape::gqa(2, 1, 640);
  EXPECT_NE(cuda_tests::decode_error(wide, wide, p, 0).find("head_dim=640"), std::string::npos);
  EXPECT_NE(cuda_tests::decode_error(cache_shape, cache_shape, p, 0, true).find("not a view"), std::string::npos);
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
