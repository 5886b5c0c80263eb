// The KV-cache arithmetic: DESIGN.md's worked examples, the identities between designs,
// linearity, sub-byte widths, the cache's KV formats counted exactly (their row, block and latent
// scales, against real caches' page layouts), and the capacity planner under tensor parallelism.
#include <kvattn/budget.hpp>
#include <kvattn/paged_cache.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>

namespace {

using kvattn::Design;
using kvattn::ElementBits;
using kvattn::GqaShape;
using kvattn::KvFormat;
using kvattn::MlaShape;
using kvattn::Model;
using kvattn::Workload;
namespace presets = kvattn::presets;
namespace kv_formats = kvattn::kv_formats;

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
// Formats: the table equals what format_traits says, and int8 counts its scales: Llama 3 8B
// holds 2·8·(128 + 4)·32 = 67,584 bytes per token in int8, 2·8·128·2·32 = 131,072 in bf16.
static_assert(KvFormat::of<kvattn::fp32>() == kv_formats::fp32);
static_assert(KvFormat::of<kvattn::fp16>() == kv_formats::fp16);
static_assert(KvFormat::of<kvattn::bf16>() == kv_formats::bf16);
static_assert(KvFormat::of<kvattn::int8_row>() == kv_formats::int8);
static_assert(KvFormat::of<kvattn::hadamard<kvattn::int8_row>>() == kv_formats::int8_hadamard);
static_assert(KvFormat::of<kvattn::fp8_e4m3_row>() == kv_formats::fp8);
static_assert(KvFormat::of<kvattn::hadamard<kvattn::fp8_e4m3_row>>() == kv_formats::fp8_hadamard);
static_assert(KvFormat::of<kvattn::fp8_e4m3_layer>() == kv_formats::fp8_layer);
static_assert(KvFormat::of<kvattn::q4_block>() == kv_formats::q4);
static_assert(KvFormat::of<kvattn::hadamard<kvattn::q4_block>>() == kv_formats::q4_hadamard);
static_assert(KvFormat::of<kvattn::fp8_e4m3_latent>() == kv_formats::fp8_latent);
static_assert(KvFormat::of<kvattn::int8_latent>() == kv_formats::int8_latent);
static_assert(KvFormat::kLatentScaleBytes == sizeof(float));
static_assert(KvFormat::kLatentRopeBits == 8 * sizeof(kvattn::bf16));
static_assert(kv_formats::fp8_latent.latent_block() == kvattn::format_traits<kvattn::fp8_e4m3_latent>::latent_block);
static_assert(kv_formats::int8_latent.latent_block() == kvattn::format_traits<kvattn::int8_latent>::latent_block);
static_assert(KvFormat::kMaxRotatedDim == kvattn::kMaxRotatedDim);
static_assert(KvFormat::kMaxBlockScaledDim == kvattn::kMaxBlockScaledDim);
static_assert(KvFormat::kBlockScaleBytes == sizeof(kvattn::BlockScale));
static_assert(kv_formats::q4.block() == kvattn::format_traits<kvattn::q4_block>::block);
static_assert(kv_formats::q4.values_per_unit() == kvattn::format_traits<kvattn::q4_block>::values_per_unit);
static_assert(kvattn::footprint(presets::llama3_8b.model, Workload{1, 1, kv_formats::int8}).bytes_per_token == 67584);
static_assert(kvattn::footprint(presets::llama3_8b.model, Workload{1, 1, kv_formats::bf16}).bytes_per_token == 131072);
// q4: 2·8·(128/2 + 128/32·4)·32 = 40,960 bytes per token, its values and a 4-byte block scale per 32.
static_assert(kvattn::footprint(presets::llama3_8b.model, Workload{1, 1, kv_formats::q4}).bytes_per_token == 40960);
static_assert(kvattn::footprint(presets::llama3_8b.model, Workload{1, 1, kv_formats::q4_hadamard}).bytes_per_token == 40960);
// The MLA formats: DeepSeek-V2's row is 512 + 512/128·4 + 64·2 = 656 bytes (format_traits'
// row_bytes), 60 · 656 = 39,360 per token.
static_assert(kv_formats::fp8_latent.bytes_per_token_layer(presets::deepseek_v2.model.mla()) == 656);
static_assert(kvattn::format_traits<kvattn::fp8_e4m3_latent>::row_bytes(512, 64) == 656);
static_assert(kvattn::footprint(presets::deepseek_v2.model, Workload{1, 1, kv_formats::fp8_latent}).bytes_per_token == 39360);
static_assert(kvattn::footprint(presets::deepseek_v2.model, Workload{1, 1, kv_formats::int8_latent}).bytes_per_token == 39360);

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

// ---------------------------------------------------------------------------------------------
// KV formats

TEST(Formats, ParseByNameAndListTheNamesOtherwise) {
  EXPECT_EQ(KvFormat::parse("fp32"), kv_formats::fp32);
  EXPECT_EQ(KvFormat::parse("fp16"), kv_formats::fp16);
  EXPECT_EQ(KvFormat::parse("bf16"), kv_formats::bf16);
  EXPECT_EQ(KvFormat::parse("int8"), kv_formats::int8);
  EXPECT_EQ(KvFormat::parse("int8_hadamard"), kv_formats::int8_hadamard);
  EXPECT_EQ(KvFormat::parse("fp8"), kv_formats::fp8);
  EXPECT_EQ(KvFormat::parse("fp8_hadamard"), kv_formats::fp8_hadamard);
  EXPECT_EQ(KvFormat::parse("fp8_layer"), kv_formats::fp8_layer);
  EXPECT_EQ(KvFormat::parse("q4"), kv_formats::q4);
  EXPECT_EQ(KvFormat::parse("q4_hadamard"), kv_formats::q4_hadamard);
  EXPECT_NE(kv_formats::q4, kv_formats::q4_hadamard);
  EXPECT_NE(kv_formats::q4, (KvFormat{"q4", 4, KvFormat::Blocks{64, 4}}));  // the block is part of it
  EXPECT_NE(kv_formats::q4, (KvFormat{"q4", 4, KvFormat::Blocks{32, 2}}));
  EXPECT_NE(kv_formats::fp8_layer, (KvFormat{"fp8_layer", 8}));  // the per-layer scales are part of it
  EXPECT_NE(kv_formats::fp16, kv_formats::bf16);  // same width, another format
  EXPECT_NE(kv_formats::int8, kv_formats::fp8);
  EXPECT_EQ(KvFormat::parse("fp8_latent"), kv_formats::fp8_latent);
  EXPECT_EQ(KvFormat::parse("int8_latent"), kv_formats::int8_latent);
  EXPECT_NE(kv_formats::fp8_latent, kv_formats::fp8);  // the latent blocks are part of it
  EXPECT_NE(kv_formats::fp8_latent, (KvFormat{"fp8_latent", 8, KvFormat::Latent{64, 4, 16}}));
  EXPECT_NE(kv_formats::fp8_latent, (KvFormat{"fp8_latent", 8, KvFormat::Latent{128, 4, 8}}));
  EXPECT_EQ(KvFormat::names(),
            "fp32, fp16, bf16, int8, int8_hadamard, fp8, fp8_hadamard, fp8_layer, q4, q4_hadamard, fp8_latent, int8_latent");
  for (const KvFormat& f : kv_formats::all) EXPECT_EQ(KvFormat::parse(f.name()), f) << f.name();  // round trip
  for (const char* bad : {"", "int4", "INT8", "int8_row", "fp8_e4m3", "bf16 ", "q4_block", "Q4", "q4_0", "fp8_e4m3_latent", "latent"}) {
    SCOPED_TRACE(bad);
    try {
      KvFormat::parse(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const kvattn::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + std::string(bad) + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("fp32, fp16, bf16, int8, int8_hadamard, fp8, fp8_hadamard, fp8_layer, q4, q4_hadamard, fp8_latent, int8_latent"),
                std::string::npos)
          << what;
    }
  }
  EXPECT_THROW(KvFormat("x", 4), kvattn::invalid_argument);  // 4-bit values come in blocks with scales
  EXPECT_THROW(KvFormat("x", 3, KvFormat::Blocks{32, 4}), kvattn::invalid_argument);
  EXPECT_THROW(KvFormat("x", 4, KvFormat::Blocks{31, 4}), kvattn::invalid_argument);  // 15.5 bytes
  EXPECT_THROW(KvFormat("x", 4, KvFormat::Blocks{32, 0}), kvattn::invalid_argument);
  EXPECT_THROW(KvFormat("x", 4, KvFormat::Blocks{0, 4}), kvattn::invalid_argument);
  EXPECT_THROW(KvFormat("x", 8, KvFormat::Blocks{-32, 4}), kvattn::invalid_argument);
  EXPECT_THROW(KvFormat("x", 8, -1), kvattn::invalid_argument);
  EXPECT_NO_THROW(KvFormat("x", 8, KvFormat::Blocks{3, 2}));  // whole bytes need no even block
  EXPECT_THROW(KvFormat("x", 8, KvFormat::Latent{0, 4, 16}), kvattn::invalid_argument);
  EXPECT_THROW(KvFormat("x", 8, KvFormat::Latent{128, -1, 16}), kvattn::invalid_argument);
  EXPECT_THROW(KvFormat("x", 8, KvFormat::Latent{128, 4, 12}), kvattn::invalid_argument);
  EXPECT_THROW(KvFormat("x", 4, KvFormat::Latent{128, 4, 16}), kvattn::invalid_argument);
}

TEST(Formats, ExactBytesPerTokenCountTheScales) {
  const Model& m = presets::llama3_8b.model;  // 32 layers, 8 KV heads of 128
  const auto int8 = kvattn::footprint(m, Workload{4096, 3, kv_formats::int8});
  EXPECT_EQ(int8.elements_per_token_layer, 2048u);
  EXPECT_EQ(int8.bytes_per_token_layer, 2u * 8 * (128 + 4));  // 2,112
  EXPECT_EQ(int8.bytes_per_token, 67584u);
  EXPECT_EQ(int8.bytes_per_sequence, 67584u * 4096);
  EXPECT_EQ(int8.bytes_per_batch, 67584u * 4096 * 3);
  for (const KvFormat& f : {kv_formats::int8_hadamard, kv_formats::fp8, kv_formats::fp8_hadamard})
    EXPECT_EQ(kvattn::footprint(m, Workload{4096, 3, f}).bytes_per_batch, int8.bytes_per_batch) << f.name();
  // The plain formats equal the uniform width of their bits.
  for (const KvFormat& f : {kv_formats::fp32, kv_formats::fp16, kv_formats::bf16}) {
    const auto exact = kvattn::footprint(m, Workload{4096, 3, f});
    const auto uniform = kvattn::footprint(m, Workload{4096, 3, static_cast<unsigned>(f.bits())});
    EXPECT_EQ(exact.bytes_per_token_layer, uniform.bytes_per_token_layer) << f.name();
    EXPECT_EQ(exact.bytes_per_batch, uniform.bytes_per_batch) << f.name();
  }
  EXPECT_EQ(kvattn::footprint(m, Workload{1, 1, kv_formats::bf16}).bytes_per_token, 131072u);
  // int8 is not a uniform 8 bits: 4 bytes of scale per row, 32 per token per layer here.
  EXPECT_EQ(int8.bytes_per_token_layer - kvattn::footprint(m, Workload{1, 1, 8}).bytes_per_token_layer, 2u * 8 * 4);
  // The scale's share depends on the head size: MQA of head_dim 7, 3 layers: 2·(7 + 4)·3.
  EXPECT_EQ(kvattn::footprint(Model{"m", 3, GqaShape::mqa(5, 7)}, Workload{1, 1, kv_formats::int8}).bytes_per_token, 66u);
  // fp8_layer's scales are the cache's, not its pages': 8 bits exactly, as a uniform width.
  EXPECT_EQ(kvattn::footprint(m, Workload{4096, 3, kv_formats::fp8_layer}).bytes_per_batch,
            kvattn::footprint(m, Workload{4096, 3, 8}).bytes_per_batch);
  // A format's width is its value width.
  EXPECT_EQ(Workload(1, 1, kv_formats::int8).bits, ElementBits(8));
}

TEST(Formats, MlaRejectsTheGqaFormatsWithScales) {
  const Model& ds = presets::deepseek_v2.model;  // 576 elements per token per layer, 60 layers
  EXPECT_EQ(kvattn::footprint(ds, Workload{1, 1, kv_formats::bf16}).bytes_per_token, 69120u);
  EXPECT_EQ(kvattn::footprint(ds, Workload{1, 1, kv_formats::fp32}).bytes_per_token, 138240u);
  for (const KvFormat& f : {kv_formats::int8, kv_formats::int8_hadamard, kv_formats::fp8, kv_formats::fp8_hadamard,
                            kv_formats::fp8_layer, kv_formats::q4, kv_formats::q4_hadamard}) {
    SCOPED_TRACE(std::string(f.name()));
    EXPECT_FALSE(f.holds(ds.attention));
    try {
      kvattn::footprint(ds, Workload{1, 1, f});
      ADD_FAILURE() << "an MLA footprint in a format with scales";
    } catch (const kvattn::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the " + std::string(f.name()) + " format"), std::string::npos) << what;
      EXPECT_NE(what.find("model 'deepseek-v2' is MLA"), std::string::npos) << what;
      EXPECT_NE(what.find("an MLA cache is fp32, fp16, bf16, fp8_latent or int8_latent"), std::string::npos) << what;
    }
    kvattn::CapacityRequest r;
    r.device_bytes = GiB;
    r.format = f;
    EXPECT_THROW(kvattn::plan_capacity(ds, r), kvattn::invalid_argument);
  }
  // Its MHA/GQA/MQA forms (head_dim = nope_dim = 128) are GQA-family caches: int8 holds them.
  for (const Model& row : kvattn::compare_designs(ds)) {
    EXPECT_EQ(kv_formats::int8.check(row).empty(), !row.is_mla()) << kvattn::to_string(row.design());
    EXPECT_EQ(kv_formats::int8_hadamard.holds(row.attention), !row.is_mla());
  }
  // Each design's bytes come from its own shape: MHA 128 heads, MQA 1 head, of 128 + 4.
  EXPECT_EQ(kvattn::footprint(kvattn::as_design(ds, Design::mha), Workload{1, 1, kv_formats::int8}).bytes_per_token_layer,
            2u * 128 * 132);
  EXPECT_EQ(kvattn::footprint(kvattn::as_design(ds, Design::mqa), Workload{1, 1, kv_formats::int8}).bytes_per_token_layer,
            2u * 132);
}

/// An MLA format's bytes per token per layer and per page of `shape` against PageLayout::of<F>
/// and format_traits<F>::row_bytes.
template <class F> void expect_latent_rows_match_the_layout(const MlaShape& shape, int page) {
  const KvFormat f = KvFormat::of<F>();
  SCOPED_TRACE(::testing::Message() << f.name() << " latent_dim=" << shape.latent_dim << " rope_dim=" << shape.rope_dim
                                    << " page_size=" << page);
  const kvattn::PageLayout layout = kvattn::PageLayout::of<F>(shape, page);
  EXPECT_EQ(f.bytes_per_token_layer(shape), static_cast<std::uint64_t>(layout.token_bytes()));
  EXPECT_EQ(f.bytes_per_token_layer(shape), static_cast<std::uint64_t>(kvattn::format_traits<F>::row_bytes(shape.latent_dim, shape.rope_dim)));
  EXPECT_EQ(f.page_bytes(shape, page), static_cast<std::uint64_t>(layout.page_stride * layout.unit_bytes));
}

TEST(Formats, LatentFormatsCountTheirRowsAsThePageLayoutLaysThemOut) {
  const Model& ds = presets::deepseek_v2.model;          // 60 layers, latent 512 + rope 64
  const MlaShape narrow{16, 256, 32, 128, 128, 0};       // 256 + 256/128·4 + 32·2 = 328 bytes
  for (const KvFormat& f : {kv_formats::fp8_latent, kv_formats::int8_latent}) {
    SCOPED_TRACE(std::string(f.name()));
    EXPECT_TRUE(f.latent_scale());
    EXPECT_FALSE(f.row_scale() || f.block_scale() || f.layer_scale() || f.rotated());
    EXPECT_EQ(f.latent_block(), 128);
    EXPECT_EQ(f.latent_scale_bytes(), 4);
    EXPECT_EQ(f.rope_bits(), 16);
    EXPECT_TRUE(f.holds(ds.attention));
    EXPECT_TRUE(f.check(ds).empty()) << f.check(ds);
    // 512 codes, 4 fp32 scales, 64 bf16: 656 bytes per token per layer, against bf16's 1,152.
    const auto fp = kvattn::footprint(ds, Workload{4096, 3, f});
    EXPECT_EQ(fp.elements_per_token_layer, 576u);
    EXPECT_EQ(fp.bytes_per_token_layer, 656u);
    EXPECT_EQ(fp.bytes_per_token, 39360u);
    EXPECT_EQ(fp.bytes_per_sequence, 39360u * 4096);
    EXPECT_EQ(fp.bytes_per_batch, 39360u * 4096 * 3);
    EXPECT_EQ(f.bytes_per_token_layer(narrow), 328u);
    EXPECT_EQ(Workload(1, 1, f).bits, ElementBits(8));
  }
  EXPECT_EQ(kvattn::footprint(ds, Workload{1, 1, kv_formats::bf16}).bytes_per_token_layer, 1152u);
  for (int page : {1, 2, 3, 16, 64, 65}) {
    expect_latent_rows_match_the_layout<kvattn::fp8_e4m3_latent>(ds.mla(), page);
    expect_latent_rows_match_the_layout<kvattn::int8_latent>(ds.mla(), page);
    expect_latent_rows_match_the_layout<kvattn::fp8_e4m3_latent>(narrow, page);
    expect_latent_rows_match_the_layout<kvattn::int8_latent>(narrow, page);
  }
  // Pages are padded once: 3 rows of 656 bytes are 1,968, padded to 1,984; 16 rows fill whole lines.
  EXPECT_EQ(kv_formats::fp8_latent.page_bytes(ds.mla(), 3), 1984u);
  EXPECT_EQ(kv_formats::fp8_latent.page_bytes(ds.mla(), 16), 16u * 656);
  // The capacity plan: every rank holds the whole latent, 60 layers of 656-byte rows.
  kvattn::CapacityRequest r;
  r.device_bytes = 80 * GiB;
  r.tensor_parallel = 8;
  r.page_size = 16;
  r.format = kv_formats::fp8_latent;
  const auto p = kvattn::plan_capacity(ds, r);
  EXPECT_EQ(p.bytes_per_token_per_rank, 39360u);
  EXPECT_EQ(p.bytes_per_token_all_ranks, 8u * 39360);
  EXPECT_EQ(p.bytes_per_page_per_rank, 60u * 16 * 656);
  EXPECT_EQ(p.pages, 80 * GiB / (60 * 16 * 656));
}

TEST(Formats, LatentFormatsHoldMlaModelsOfWholeLatentBlocksOnly) {
  for (const KvFormat& f : {kv_formats::fp8_latent, kv_formats::int8_latent}) {
    SCOPED_TRACE(std::string(f.name()));
    // A GQA-family model, and the GQA forms of DeepSeek-V2 that --compare shows.
    const Model& llama = presets::llama3_8b.model;
    EXPECT_FALSE(f.holds(llama.attention));
    const std::string why = f.check(llama);
    EXPECT_EQ(why, "the " + std::string(f.name()) +
                       " format holds MLA rows (a latent and a rotary key per token) only, and model 'llama-3-8b' is GQA "
                       "(keys and values per KV head)");
    try {
      kvattn::footprint(llama, Workload{1, 1, f});
      ADD_FAILURE() << "a GQA footprint in an MLA format";
    } catch (const kvattn::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), why);
    }
    kvattn::CapacityRequest r;
    r.device_bytes = GiB;
    r.format = f;
    EXPECT_THROW(kvattn::plan_capacity(llama, r), kvattn::invalid_argument);
    for (const Model& row : kvattn::compare_designs(presets::deepseek_v2.model)) {
      SCOPED_TRACE(std::string(kvattn::to_string(row.design())));
      EXPECT_EQ(f.check(row).empty(), row.is_mla()) << f.check(row);
      if (!row.is_mla()) {
        EXPECT_NE(f.check(row).find("model 'deepseek-v2' is " + std::string(kvattn::to_string(row.design()))), std::string::npos);
      }
    }
    // An MLA model whose latent is not whole blocks of 128.
    for (int latent : {64, 100, 192, 520}) {
      SCOPED_TRACE(latent);
      const Model m{"x", 2, MlaShape{8, latent, 64, 128, 128, 0}};
      ASSERT_TRUE(m.valid());
      EXPECT_FALSE(f.holds(m.attention));
      EXPECT_EQ(f.check(m), "the " + std::string(f.name()) + " format quantizes the latent in blocks of 128 values: latent_dim=" +
                                std::to_string(latent) + " of model 'x' is not a multiple of 128");
      EXPECT_THROW(kvattn::footprint(m, Workload{1, 1, f}), kvattn::invalid_argument);
      EXPECT_THROW(kvattn::plan_capacity(m, r), kvattn::invalid_argument);
    }
    for (int latent : {128, 256, 1024}) EXPECT_TRUE(f.check(Model{"x", 2, MlaShape{8, latent, 64, 128, 128, 0}}).empty()) << latent;
  }
  // The real caches say the same.
  EXPECT_THROW((kvattn::PagedKvCache<kvattn::fp8_e4m3_latent>(kvattn::CacheConfig{2, 1, 1, presets::llama3_8b.model.attention})),
               kvattn::invalid_argument);
  EXPECT_THROW((kvattn::PagedKvCache<kvattn::int8_latent>(kvattn::CacheConfig{2, 1, 1, MlaShape{8, 192, 64, 128, 128, 0}})),
               kvattn::invalid_argument);
}

TEST(Formats, HadamardNeedsAPowerOfTwoHeadDim) {
  for (int d : {1, 2, 64, 128, 256, 1024}) {
    const Model m{"m", 2, GqaShape::gqa(8, 2, d)};
    EXPECT_TRUE(kv_formats::int8_hadamard.check(m).empty()) << d;
    EXPECT_EQ(kvattn::footprint(m, Workload{1, 1, kv_formats::int8_hadamard}).bytes_per_token_layer,
              2u * 2 * (static_cast<unsigned>(d) + 4));
  }
  for (int d : {3, 96, 100, 192, 2048}) {
    SCOPED_TRACE(d);
    const Model m{"odd", 2, GqaShape::gqa(8, 2, d)};
    EXPECT_TRUE(kv_formats::int8.check(m).empty());  // without rotation any head size does
    const std::string why = kv_formats::int8_hadamard.check(m);
    EXPECT_NE(why.find("head_dim=" + std::to_string(d)), std::string::npos) << why;
    EXPECT_NE(why.find("model 'odd'"), std::string::npos) << why;
    EXPECT_THROW(kvattn::footprint(m, Workload{1, 1, kv_formats::int8_hadamard}), kvattn::invalid_argument);
    // The real cache says the same.
    EXPECT_THROW((kvattn::PagedKvCache<kvattn::hadamard<kvattn::int8_row>>(kvattn::CacheConfig{2, 1, 1, m.attention})),
                 kvattn::invalid_argument);
  }
}

TEST(Formats, Q4CountsItsValuesAsHalfBytesAndItsBlockScales) {
  const Model& m = presets::llama3_8b.model;  // 32 layers, 8 KV heads of 128
  for (const KvFormat& f : {kv_formats::q4, kv_formats::q4_hadamard}) {
    SCOPED_TRACE(std::string(f.name()));
    const auto q4 = kvattn::footprint(m, Workload{4096, 3, f});
    EXPECT_EQ(q4.elements_per_token_layer, 2048u);
    EXPECT_EQ(q4.bytes_per_token_layer, 2u * 8 * (64 + 16));  // 1,280, against bf16's 4,096
    EXPECT_EQ(q4.bytes_per_token, 40960u);
    EXPECT_EQ(q4.bytes_per_batch, 40960u * 4096 * 3);
    // 5 bits per value exactly (4 bits and 32 bits of scale and minimum per 32 values): a
    // uniform 5 bits counts the same bytes.
    EXPECT_EQ(q4.bytes_per_batch, kvattn::footprint(m, Workload{4096, 3, 5}).bytes_per_batch);
    EXPECT_EQ(Workload(1, 1, f).bits, ElementBits(4));
    EXPECT_TRUE(f.block_scale());
    EXPECT_FALSE(f.row_scale());
    EXPECT_EQ(f.unit_bytes(), 1);
    EXPECT_EQ(f.values_per_unit(), 2);
  }
  // The blocks' share is the same at any head size: MQA of 32, 3 layers: 2·(16 + 4)·3; 96 (not
  // a power of two: q4 only): 2·3·(48 + 12).
  EXPECT_EQ(kvattn::footprint(Model{"m", 3, GqaShape::mqa(5, 32)}, Workload{1, 1, kv_formats::q4}).bytes_per_token, 120u);
  EXPECT_EQ(kvattn::footprint(Model{"m", 1, GqaShape::gqa(6, 3, 96)}, Workload{1, 1, kv_formats::q4}).bytes_per_token, 360u);
  EXPECT_FALSE(kv_formats::q4_hadamard.holds(GqaShape::gqa(6, 3, 96)));
}

TEST(Formats, Q4NeedsAHeadDimOfWholeBlocksUpTo1024) {
  for (int d : {1, 16, 48, 80, 100, 200, 1056}) {
    SCOPED_TRACE(d);
    const Model m{"x", 2, GqaShape::gqa(8, 2, d)};
    EXPECT_TRUE(kv_formats::int8.check(m).empty());
    for (const KvFormat& f : {kv_formats::q4, kv_formats::q4_hadamard}) {
      EXPECT_FALSE(f.holds(m.attention)) << f.name();
      const std::string why = f.check(m);
      EXPECT_NE(why.find("the " + std::string(f.name()) + " format quantizes blocks of 32 values: head_dim=" + std::to_string(d) +
                         " of model 'x' is not a multiple of 32 up to 1024"),
                std::string::npos)
          << why;
      try {
        kvattn::footprint(m, Workload{1, 1, f});
        ADD_FAILURE() << "a q4 footprint of head_dim " << d;
      } catch (const kvattn::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()), why);
      }
      EXPECT_THROW(kvattn::plan_capacity(m, [&] {
                     kvattn::CapacityRequest r;
                     r.device_bytes = GiB;
                     r.format = f;
                     return r;
                   }()),
                   kvattn::invalid_argument);
    }
    // The real caches say the same.
    EXPECT_THROW((kvattn::PagedKvCache<kvattn::q4_block>(kvattn::CacheConfig{2, 1, 1, m.attention})), kvattn::invalid_argument);
    EXPECT_THROW((kvattn::PagedKvCache<kvattn::hadamard<kvattn::q4_block>>(kvattn::CacheConfig{2, 1, 1, m.attention})),
                 kvattn::invalid_argument);
  }
  // A multiple of 32 that is not a power of two: q4 holds it, q4_hadamard names the rotation.
  const Model m96{"x", 2, GqaShape::gqa(8, 2, 96)};
  EXPECT_TRUE(kv_formats::q4.check(m96).empty());
  EXPECT_NE(kv_formats::q4_hadamard.check(m96).find("rotates rows of head_dim=96 (model 'x')"), std::string::npos)
      << kv_formats::q4_hadamard.check(m96);
  for (int d : {32, 64, 128, 256, 1024}) {
    EXPECT_TRUE(kv_formats::q4.check(Model{"x", 2, GqaShape::gqa(8, 2, d)}).empty()) << d;
    EXPECT_TRUE(kv_formats::q4_hadamard.check(Model{"x", 2, GqaShape::gqa(8, 2, d)}).empty()) << d;
  }
}

TEST(Formats, OverflowIsAnErrorNotAWrappedNumber) {
  const Workload huge{std::uint64_t{1} << 40, std::uint64_t{1} << 20, kv_formats::int8};
  EXPECT_THROW(kvattn::footprint(presets::llama31_405b.model, huge), kvattn::invalid_argument);
}

/// A request of `format` on 1 MiB devices (the pages then fit in a test's memory).
kvattn::CapacityRequest format_request(const KvFormat& format, int page, int tp = 1) {
  kvattn::CapacityRequest r;
  r.device_bytes = MiB;
  r.context = 10;
  r.page_size = page;
  r.tensor_parallel = tp;
  r.format = format;
  return r;
}

TEST(Formats, PagesArePaddedAsThePageLayoutPadsThem) {
  // 3 KV heads of 24, pages of 3 tokens, int8: a head block holds 72 bytes, padded to 128; six
  // of them and a scale block of 2·3·3·4 = 72 bytes, padded to 128: 896 bytes per layer, against
  // 3 · 2·3·(24 + 4) = 504 bytes of tokens.
  const Model m{"m", 5, GqaShape::gqa(12, 3, 24)};
  const auto p = kvattn::plan_capacity(m, format_request(kv_formats::int8, 3));
  EXPECT_EQ(p.bytes_per_token_per_rank, 5u * 168);
  EXPECT_EQ(p.bytes_per_page_per_rank, 5u * 896);
  EXPECT_EQ(p.pages, MiB / (5 * 896));
  EXPECT_EQ(p.tokens, 3 * p.pages);
  EXPECT_EQ(p.sequences, p.pages / 4);  // 10 tokens: 4 pages of 3
  // A uniform 8 bits counts neither the scales nor the padding.
  auto eight = format_request(kv_formats::int8, 3);
  eight.format.reset();
  eight.bits = 8;
  EXPECT_EQ(kvattn::plan_capacity(m, eight).bytes_per_page_per_rank, 5u * 3 * 144);
  // An MLA page of bf16: 3 rows of (10 + 2) · 2 bytes, 72 bytes, padded to 128.
  const Model mla{"mla", 2, MlaShape{4, 10, 2, 8, 8, 0}};
  EXPECT_EQ(kvattn::plan_capacity(mla, format_request(kv_formats::bf16, 3)).bytes_per_page_per_rank, 2u * 128);
  EXPECT_EQ(kvattn::plan_capacity(mla, format_request(kv_formats::bf16, 3)).bytes_per_token_per_rank, 2u * 24);
  // q4, 3 KV heads of 32, pages of 3 tokens: a head block holds 3·16 = 48 bytes, padded to 64;
  // six of them and a scale block of 2·3·3·(32/32)·4 = 72 bytes, padded to 128: 512 bytes per
  // layer, against 3 · 2·3·(16 + 4) = 360 bytes of tokens.
  const Model small{"small", 5, GqaShape::gqa(6, 3, 32)};
  const auto q4 = kvattn::plan_capacity(small, format_request(kv_formats::q4, 3));
  EXPECT_EQ(q4.bytes_per_token_per_rank, 5u * 120);
  EXPECT_EQ(q4.bytes_per_page_per_rank, 5u * 512);
  EXPECT_EQ(q4.pages, MiB / (5 * 512));
}

/// plan_capacity's page bytes and pages against a real cache of `F` holding `model`'s share of
/// one rank: its PageLayout, its pool, and that one page more would not fit.
template <class F> void expect_pages_match_a_real_cache(const Model& model, int page, int tp) {
  SCOPED_TRACE(::testing::Message() << model.name << " " << KvFormat::of<F>().name() << " page_size=" << page << " tp=" << tp);
  const auto p = kvattn::plan_capacity(model, format_request(KvFormat::of<F>(), page, tp));
  const kvattn::AttentionShape rank_shape =
      model.is_mla() ? kvattn::AttentionShape{model.mla()}
                     : kvattn::AttentionShape{GqaShape::gqa(model.q_heads() / tp, p.layout.kv_heads_per_rank, model.gqa().head_dim)};
  ASSERT_GT(p.pages, 0u);
  kvattn::PagedKvCache<F> cache(kvattn::CacheConfig{model.layers, page, static_cast<std::int64_t>(p.pages), rank_shape});
  const kvattn::PageLayout& layout = cache.layout();
  EXPECT_EQ(p.bytes_per_page_per_rank, static_cast<std::uint64_t>(layout.page_stride * layout.unit_bytes * model.layers));
  EXPECT_EQ(p.bytes_per_page_per_rank, static_cast<std::uint64_t>(cache.stats().bytes_per_page));
  EXPECT_EQ(p.bytes_per_token_per_rank, static_cast<std::uint64_t>(layout.token_bytes() * model.layers));
  EXPECT_EQ(KvFormat::of<F>().bytes_per_token_layer(rank_shape), static_cast<std::uint64_t>(layout.token_bytes()));
  EXPECT_EQ(KvFormat::of<F>().page_bytes(rank_shape, page), static_cast<std::uint64_t>(layout.page_stride * layout.unit_bytes));
  EXPECT_LE(static_cast<std::uint64_t>(cache.stats().bytes_pool), p.cache_bytes_per_rank);
  EXPECT_GT(static_cast<std::uint64_t>(cache.stats().bytes_pool + cache.stats().bytes_per_page), p.cache_bytes_per_rank);
  EXPECT_EQ(p.tokens, p.pages * static_cast<std::uint64_t>(page));
}

TEST(Formats, PagesAreWhatARealCacheHolds) {
  const Model llama{"llama-like", 4, GqaShape::gqa(32, 8, 128)};
  const Model odd{"odd", 3, GqaShape::gqa(12, 3, 24)};
  const Model mla{"mla", 2, MlaShape{4, 10, 2, 8, 8, 0}};
  const Model odd32{"odd32", 3, GqaShape::gqa(12, 3, 32)};  // q4: head blocks of page_size · 16 bytes
  const Model wide{"wide", 2, GqaShape::gqa(4, 2, 96)};     // q4: 3 blocks a row
  const Model latent{"latent", 3, MlaShape{16, 512, 64, 128, 128, 0}};  // MLA formats: rows of 656 bytes
  const Model narrow{"narrow", 2, MlaShape{8, 256, 32, 64, 64, 0}};     // rows of 328 bytes
  for (int page : {1, 3, 7, 16, 17}) {
    for (int tp : {1, 2, 16}) {
      expect_pages_match_a_real_cache<kvattn::int8_row>(llama, page, tp);
      expect_pages_match_a_real_cache<kvattn::hadamard<kvattn::int8_row>>(llama, page, tp);
      expect_pages_match_a_real_cache<kvattn::bf16>(llama, page, tp);
      expect_pages_match_a_real_cache<kvattn::fp32>(llama, page, tp);
      expect_pages_match_a_real_cache<kvattn::q4_block>(llama, page, tp);
      expect_pages_match_a_real_cache<kvattn::hadamard<kvattn::q4_block>>(llama, page, tp);
    }
    expect_pages_match_a_real_cache<kvattn::q4_block>(odd32, page, 1);
    expect_pages_match_a_real_cache<kvattn::q4_block>(odd32, page, 3);
    expect_pages_match_a_real_cache<kvattn::hadamard<kvattn::q4_block>>(odd32, page, 1);
    expect_pages_match_a_real_cache<kvattn::q4_block>(wide, page, 1);
    expect_pages_match_a_real_cache<kvattn::int8_row>(odd, page, 1);
    expect_pages_match_a_real_cache<kvattn::int8_row>(odd, page, 3);
    expect_pages_match_a_real_cache<kvattn::fp16>(odd, page, 1);
    expect_pages_match_a_real_cache<kvattn::fp8_e4m3_layer>(odd, page, 3);
    expect_pages_match_a_real_cache<kvattn::bf16>(mla, page, 1);
    expect_pages_match_a_real_cache<kvattn::fp32>(mla, page, 2);
    expect_pages_match_a_real_cache<kvattn::fp8_e4m3_latent>(latent, page, 1);
    expect_pages_match_a_real_cache<kvattn::int8_latent>(latent, page, 2);
    expect_pages_match_a_real_cache<kvattn::fp8_e4m3_latent>(narrow, page, 4);
  }
}

/// Llama 3 8B in `format` on 64 GiB (16 GiB per rank, 4 ranks' worth), pages of 16 tokens: the
/// bytes per token and per page per layer as PagedKvCache lays them out, and what fits.
void expect_llama3_capacity(const KvFormat& format, std::uint64_t per_token, std::uint64_t per_page_layer) {
  SCOPED_TRACE(std::string(format.name()));
  auto r = request(1, 16 * GiB, 16);
  r.format = format;
  const auto p = kvattn::plan_capacity(presets::llama3_8b.model, r);
  EXPECT_EQ(p.bytes_per_token_per_rank, per_token);
  EXPECT_EQ(p.bytes_per_page_per_rank, per_page_layer * 32);
  EXPECT_EQ(p.pages, 64 * GiB / (per_page_layer * 32));
  EXPECT_EQ(p.tokens, 16 * p.pages);
  // With 4 ranks each holds 2 KV heads: a quarter of the bytes.
  r.tensor_parallel = 4;
  const auto p4 = kvattn::plan_capacity(presets::llama3_8b.model, r);
  EXPECT_EQ(p4.bytes_per_token_per_rank, per_token / 4);
  EXPECT_EQ(p4.bytes_per_page_per_rank, per_page_layer * 32 / 4);
  EXPECT_EQ(p4.bytes_per_token_all_ranks, per_token);
}

TEST(Formats, Llama3Capacity) {
  // int8: head blocks of 16·128 = 2,048 bytes (whole lines), a scale block of 2·8·16·4 = 1,024
  // bytes: 33,792 bytes per page per layer, 32 layers.
  expect_llama3_capacity(kv_formats::int8, 67584u, 33792u);
  // q4: head blocks of 16·64 = 1,024 bytes, a scale block of 2·8·16·4·4 = 4,096 bytes: 20,480
  // bytes per page per layer, no padding (16 · 1,280).
  expect_llama3_capacity(kv_formats::q4, 40960u, 20480u);
}

}  // namespace
