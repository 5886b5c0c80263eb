// The KV-cache arithmetic: DESIGN.md's worked examples, the identities between designs,
// linearity, sub-byte widths, and the capacity planner under tensor parallelism.
#include <kvattn/budget.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <random>

namespace {

using kvattn::Design;
using kvattn::ElementBits;
using kvattn::GqaShape;
using kvattn::MlaShape;
using kvattn::Model;
using kvattn::Workload;
namespace presets = kvattn::presets;

constexpr std::uint64_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;

// DESIGN.md: Llama 2 7B holds 16,384 bytes per layer, 512 KiB per token, 2 GiB at 4,096 tokens.
constexpr kvattn::Footprint llama2 = kvattn::footprint(presets::llama2_7b.model, Workload{4096, 1, 16});
static_assert(llama2.bytes_per_token_layer == 16384);
static_assert(llama2.bytes_per_token == 512 * KiB);
static_assert(llama2.bytes_per_sequence == 2 * GiB);
// DESIGN.md: DeepSeek-V2 caches 576 elements per token per layer, 34,560 per token; MHA with its
// heads would hold 32,768 per layer.
constexpr kvattn::Footprint dsv2 = kvattn::footprint(presets::deepseek_v2.model, Workload{});
static_assert(dsv2.elements_per_token_layer == 576);
static_assert(dsv2.elements_per_token == 34560);
static_assert(kvattn::elements_per_token_layer(kvattn::as_design(presets::deepseek_v2.model, Design::mha).attention) == 32768);
// The planner is constexpr too.
static_assert(kvattn::plan_capacity(presets::llama3_8b.model, {80 * GiB, 0, 4096, 16, 1, 16}).layout.kv_heads_per_rank == 8);

TEST(Footprint, DesignWorkedExamples) {
  const auto f = kvattn::footprint(presets::llama2_7b.model, Workload{4096, 1, 16});
  EXPECT_EQ(f.elements_per_token_layer, 8192u);
  EXPECT_EQ(f.bytes_per_token_layer, 16384u);
  EXPECT_EQ(f.bytes_per_token, 524288u);
  EXPECT_EQ(f.bytes_per_sequence, 2 * GiB);
  const auto d = kvattn::footprint(presets::deepseek_v2.model, Workload{131072, 1, 16});
  EXPECT_EQ(d.elements_per_token_layer, 576u);
  EXPECT_EQ(d.elements_per_token, 34560u);
  EXPECT_EQ(d.bytes_per_token, 69120u);
  EXPECT_EQ(d.bytes_per_sequence, std::uint64_t{69120} * 131072);
}

std::vector<GqaShape> some_shapes() {
  std::vector<GqaShape> shapes;
  for (int heads : {1, 3, 8, 12, 32, 64, 128})
    for (int dim : {1, 7, 64, 128, 256}) shapes.push_back(GqaShape::mha(heads, dim));
  return shapes;
}

TEST(Footprint, MqaIsGqaWithOneGroupAndMhaIsGqaWithGroupsEqualHeads) {
  for (const GqaShape& s : some_shapes()) {
    SCOPED_TRACE(::testing::Message() << "heads=" << s.q_heads << " head_dim=" << s.head_dim);
    const Model mqa{"m", 5, GqaShape::mqa(s.q_heads, s.head_dim)};
    const Model gqa1{"m", 5, GqaShape::gqa(s.q_heads, 1, s.head_dim)};
    const Model mha{"m", 5, GqaShape::mha(s.q_heads, s.head_dim)};
    const Model gqah{"m", 5, GqaShape::gqa(s.q_heads, s.q_heads, s.head_dim)};
    const Workload w{1000, 3, 16};
    EXPECT_EQ(kvattn::footprint(mqa, w).bytes_per_batch, kvattn::footprint(gqa1, w).bytes_per_batch);
    EXPECT_EQ(kvattn::footprint(mha, w).bytes_per_batch, kvattn::footprint(gqah, w).bytes_per_batch);
    // And the formula: 2 · kv_heads · head_dim per token per layer.
    EXPECT_EQ(kvattn::footprint(mha, w).elements_per_token_layer, 2u * s.q_heads * s.head_dim);
    EXPECT_EQ(kvattn::footprint(mqa, w).elements_per_token_layer, 2u * s.head_dim);
  }
}

TEST(Footprint, LinearInTokensAndBatch) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::uint64_t> tokens(0, 200000), batch(0, 512);
  for (const kvattn::ModelPreset& p : presets::all) {
    for (int trial = 0; trial < 50; ++trial) {
      const std::uint64_t t1 = tokens(rng), t2 = tokens(rng), b = batch(rng);
      const auto one = kvattn::footprint(p.model, Workload{t1, 1, 16});
      const auto two = kvattn::footprint(p.model, Workload{t2, 1, 16});
      const auto sum = kvattn::footprint(p.model, Workload{t1 + t2, b, 16});
      EXPECT_EQ(sum.bytes_per_sequence, one.bytes_per_sequence + two.bytes_per_sequence) << p.model.name;
      EXPECT_EQ(sum.bytes_per_batch, b * sum.bytes_per_sequence) << p.model.name;
      EXPECT_EQ(one.bytes_per_sequence, t1 * one.bytes_per_token) << p.model.name;
      EXPECT_EQ(one.bytes_per_token, static_cast<std::uint64_t>(p.model.layers) * one.bytes_per_token_layer);
    }
  }
}

TEST(Footprint, EmptyContextOrBatchHoldsNothing) {
  EXPECT_EQ(kvattn::footprint(presets::llama3_8b.model, Workload{0, 8, 16}).bytes_per_batch, 0u);
  EXPECT_EQ(kvattn::footprint(presets::llama3_8b.model, Workload{4096, 0, 16}).bytes_per_batch, 0u);
}

TEST(Footprint, OverflowIsAnErrorNotAWrappedNumber) {
  const Workload huge{std::uint64_t{1} << 40, std::uint64_t{1} << 20, 16};
  EXPECT_THROW(kvattn::footprint(presets::deepseek_v3.model, huge), kvattn::invalid_argument);
}

TEST(Footprint, InvalidModelIsRejected) {
  EXPECT_THROW(kvattn::footprint(Model{"m", 2, GqaShape{12, 5, 64}}, Workload{}), kvattn::shape_error);
}

TEST(ElementBits, ParsesDecimalsExactly) {
  EXPECT_EQ(ElementBits::parse("16"), ElementBits(16));
  EXPECT_EQ(ElementBits::parse("4.5"), ElementBits(9, 2));
  EXPECT_EQ(ElementBits::parse("6.25"), ElementBits(25, 4));
  EXPECT_EQ(ElementBits::parse("8.0"), ElementBits(8));
  EXPECT_EQ(ElementBits::parse(".5"), ElementBits(1, 2));
  EXPECT_EQ(ElementBits(18, 4), ElementBits(9, 2));  // kept reduced
  for (const char* bad : {"", "0", "0.0", "-1", "abc", "1.2.3", ".", "4.5bits", "1e3", "99999999"})
    EXPECT_THROW(ElementBits::parse(bad), kvattn::invalid_argument) << "'" << bad << "'";
  EXPECT_THROW(ElementBits(0), kvattn::invalid_argument);
  EXPECT_THROW(ElementBits(3, 0), kvattn::invalid_argument);
}

TEST(ElementBits, PrintsAsDecimals) {
  for (const char* text : {"16", "4.5", "6.25", "0.125", "3.1"}) EXPECT_EQ(ElementBits::parse(text).to_string(), text);
  EXPECT_EQ(ElementBits(17, 3).to_string(), "17/3");
}

TEST(Footprint, SubByteWidths) {
  const Model& m = presets::deepseek_v2.model;  // 576 elements per token per layer, 60 layers
  EXPECT_EQ(kvattn::footprint(m, Workload{1, 1, 8}).bytes_per_token_layer, 576u);
  EXPECT_EQ(kvattn::footprint(m, Workload{1, 1, 6}).bytes_per_token_layer, 432u);
  EXPECT_EQ(kvattn::footprint(m, Workload{1, 1, ElementBits(9, 2)}).bytes_per_token_layer, 324u);
  EXPECT_EQ(kvattn::footprint(m, Workload{1000, 1, ElementBits(9, 2)}).bytes_per_sequence, 576u * 60 * 1000 * 9 / 16);
  // Rounding up happens once, for the level asked: 3 elements of 4.5 bits are 13.5 bits, 2 bytes;
  // 16 such tokens are 216 bits, exactly 27 bytes (not 16 · 2).
  const Model tiny{"tiny", 1, MlaShape{1, 1, 2, 1, 1, 0}};
  EXPECT_EQ(kvattn::footprint(tiny, Workload{16, 1, ElementBits(9, 2)}).bytes_per_token, 2u);
  EXPECT_EQ(kvattn::footprint(tiny, Workload{16, 1, ElementBits(9, 2)}).bytes_per_sequence, 27u);
  // Halving the width halves every whole-byte figure.
  const auto f16 = kvattn::footprint(m, Workload{4096, 4, 16}), f8 = kvattn::footprint(m, Workload{4096, 4, 8});
  EXPECT_EQ(f16.bytes_per_batch, 2 * f8.bytes_per_batch);
}

TEST(AsDesign, SameHeadsCachedAnotherWay) {
  const Model& ds = presets::deepseek_v2.model;
  EXPECT_EQ(kvattn::as_design(ds, Design::mha).gqa(), GqaShape::mha(128, 128));
  EXPECT_EQ(kvattn::as_design(ds, Design::gqa, 8).gqa(), GqaShape::gqa(128, 8, 128));
  EXPECT_EQ(kvattn::as_design(ds, Design::mqa).gqa(), GqaShape::mqa(128, 128));
  EXPECT_EQ(kvattn::as_design(ds, Design::mla).mla(), ds.mla());
  EXPECT_EQ(kvattn::as_design(ds, Design::mha).layers, 60);
  // DeepSeek-V2 as GQA with 8 groups: 2·8·128 per layer; as MQA: 2·128.
  EXPECT_EQ(kvattn::footprint(kvattn::as_design(ds, Design::gqa, 8), Workload{}).elements_per_token_layer, 2048u);
  EXPECT_EQ(kvattn::footprint(kvattn::as_design(ds, Design::mqa), Workload{}).elements_per_token_layer, 256u);

  EXPECT_THROW(kvattn::as_design(presets::llama3_8b.model, Design::mla), kvattn::shape_error);
  EXPECT_THROW(kvattn::as_design(presets::qwen25_7b.model, Design::gqa, 8), kvattn::shape_error);  // 28 heads
}

TEST(AsDesign, CompareRowsAndDefaultGroups) {
  EXPECT_EQ(kvattn::default_gqa_groups(presets::qwen25_7b.model), 4);         // its own
  EXPECT_EQ(kvattn::default_gqa_groups(presets::llama2_7b.model), 8);
  EXPECT_EQ(kvattn::default_gqa_groups(presets::deepseek_v2_lite.model), 8);
  EXPECT_EQ(kvattn::default_gqa_groups(Model{"m", 1, GqaShape::mha(12, 64)}), 6);
  EXPECT_EQ(kvattn::default_gqa_groups(Model{"m", 1, GqaShape::mha(7, 64)}), 7);
  EXPECT_EQ(kvattn::default_gqa_groups(Model{"m", 1, GqaShape::mha(1, 64)}), 1);

  const auto gqa_rows = kvattn::compare_designs(presets::llama3_8b.model);
  ASSERT_EQ(gqa_rows.size(), 3u);
  EXPECT_EQ(gqa_rows[0].design(), Design::mha);
  EXPECT_EQ(gqa_rows[1].gqa(), presets::llama3_8b.model.gqa());
  EXPECT_EQ(gqa_rows[2].design(), Design::mqa);
  const auto mla_rows = kvattn::compare_designs(presets::deepseek_v2.model);
  ASSERT_EQ(mla_rows.size(), 4u);
  EXPECT_EQ(mla_rows[3].design(), Design::mla);
}

kvattn::CapacityRequest request(int tp, std::uint64_t weights = 0, int page = 1) {
  kvattn::CapacityRequest r;
  r.device_bytes = 80 * GiB;
  r.weight_bytes = weights;
  r.context = 4096;
  r.bits = 16;
  r.tensor_parallel = tp;
  r.page_size = page;
  return r;
}

TEST(Capacity, SingleDevice) {
  // Llama 3 8B: 2·8·128 elements · 32 layers · 2 bytes = 131,072 bytes per token.
  const auto p = kvattn::plan_capacity(presets::llama3_8b.model, request(1, 16 * GiB));
  EXPECT_EQ(p.bytes_per_token_per_rank, 131072u);
  EXPECT_EQ(p.cache_bytes_per_rank, 64 * GiB);
  EXPECT_EQ(p.tokens, 64 * GiB / 131072);  // 524,288
  EXPECT_EQ(p.sequences, p.tokens / 4096);
  EXPECT_EQ(p.layout.replication, 1);
}

TEST(Capacity, PagesRoundSequencesUp) {
  // Pages of 7 tokens: a 4,096-token sequence holds 586 pages (4,102 slots).
  const auto p = kvattn::plan_capacity(presets::llama3_8b.model, request(1, 0, 7));
  EXPECT_EQ(p.bytes_per_page_per_rank, 7u * 131072);
  EXPECT_EQ(p.pages, 80 * GiB / (7 * 131072));
  EXPECT_EQ(p.tokens, p.pages * 7);
  EXPECT_EQ(p.sequences, p.pages / 586);
}

TEST(Capacity, TensorParallelSplitsKvHeadsThenReplicatesThem) {
  const Model& m = presets::llama3_8b.model;  // 32 query heads, 8 KV heads
  struct Expect {
    int tp, kv_per_rank, replication;
  };
  for (const Expect& e : {Expect{1, 8, 1}, Expect{2, 4, 1}, Expect{4, 2, 1}, Expect{8, 1, 1}, Expect{16, 1, 2}, Expect{32, 1, 4}}) {
    SCOPED_TRACE(::testing::Message() << "tp=" << e.tp);
    const auto p = kvattn::plan_capacity(m, request(e.tp, 16 * GiB));
    EXPECT_EQ(p.layout.kv_heads_per_rank, e.kv_per_rank);
    EXPECT_EQ(p.layout.replication, e.replication);
    EXPECT_EQ(p.bytes_per_token_per_rank, 131072u / 8 * e.kv_per_rank);
    // Across ranks the group spends max(kv_heads, tp) heads' worth per token: replication shows.
    EXPECT_EQ(p.bytes_per_token_all_ranks, 131072u / 8 * std::max(8, e.tp));
    EXPECT_EQ(p.weight_bytes_per_rank, 16 * GiB / e.tp);
    EXPECT_EQ(p.tokens, p.cache_bytes_per_rank / p.bytes_per_token_per_rank);
  }
}

TEST(Capacity, MlaLatentIsReplicatedOnEveryRank) {
  const Model& m = presets::deepseek_v2.model;
  for (int tp : {1, 2, 8, 16}) {
    const auto p = kvattn::plan_capacity(m, request(tp, 0));
    EXPECT_EQ(p.layout.replication, tp);
    EXPECT_EQ(p.bytes_per_token_per_rank, 69120u) << "tp=" << tp;
    EXPECT_EQ(p.bytes_per_token_all_ranks, 69120u * tp);
  }
}

TEST(Capacity, RejectsWhatCannotBePlanned) {
  const Model& m = presets::llama3_8b.model;
  EXPECT_THROW(kvattn::plan_capacity(m, request(0)), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::plan_capacity(m, request(-2)), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::plan_capacity(m, request(3)), kvattn::shape_error);   // 32 query heads
  EXPECT_THROW(kvattn::plan_capacity(presets::qwen25_7b.model, request(7)), kvattn::shape_error);  // 4 KV heads, 7 ranks: 28 % 7 == 0 but 7 % 4 != 0
  EXPECT_THROW(kvattn::plan_capacity(m, request(1, 0, 0)), kvattn::invalid_argument);
  EXPECT_THROW(kvattn::plan_capacity(m, request(1, 80 * GiB)), kvattn::capacity_error);
  auto r = request(1);
  r.context = 0;
  EXPECT_THROW(kvattn::plan_capacity(m, r), kvattn::invalid_argument);
  try {
    kvattn::plan_capacity(presets::qwen25_7b.model, request(7));
  } catch (const kvattn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor_parallel=7 kv_heads=4"), std::string::npos) << e.what();
  }
}

}  // namespace
