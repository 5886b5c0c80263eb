// Shapes, models and presets: what is valid, what is not, and the messages that say why.
#include <kvattn/model.hpp>

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace {

using kvattn::Design;
using kvattn::GqaShape;
using kvattn::MlaShape;
using kvattn::Model;

// The named constructors, usable in constant expressions.
static_assert(GqaShape::mha(32, 128) == GqaShape{32, 32, 128});
static_assert(GqaShape::mqa(32, 128) == GqaShape{32, 1, 128});
static_assert(GqaShape::gqa(32, 8, 128).group_size() == 4);
static_assert(GqaShape::gqa(32, 8, 128).design() == Design::gqa);
static_assert(GqaShape::mha(32, 128).design() == Design::mha);
static_assert(GqaShape::mqa(32, 128).design() == Design::mqa);
static_assert(!GqaShape::gqa(12, 5, 64).valid());
static_assert(kvattn::presets::deepseek_v2.model.mla().qk_head_dim() == 192);

// A message names every offending value and says what rule was broken.
void expect_shape_error(const std::string& why, std::initializer_list<const char*> fragments) {
  EXPECT_FALSE(why.empty());
  for (const char* f : fragments) EXPECT_NE(why.find(f), std::string::npos) << "'" << f << "' missing from: " << why;
}

TEST(GqaShape, GroupsMapQueryHeadsToKvHeads) {
  const GqaShape s = GqaShape::gqa(12, 3, 64);
  EXPECT_EQ(s.group_size(), 4);
  for (int h = 0; h < 12; ++h) EXPECT_EQ(s.kv_head_of(h), h / 4) << "query head " << h;
  const GqaShape mha = GqaShape::mha(7, 16);
  for (int h = 0; h < 7; ++h) EXPECT_EQ(mha.kv_head_of(h), h);
  const GqaShape mqa = GqaShape::mqa(7, 16);
  for (int h = 0; h < 7; ++h) EXPECT_EQ(mqa.kv_head_of(h), 0);
}

TEST(GqaShape, OneHeadIsMhaNotMqa) { EXPECT_EQ(GqaShape::mqa(1, 64).design(), Design::mha); }

TEST(GqaShape, ValidShapesPassValidation) {
  for (const GqaShape& s : {GqaShape::mha(1, 1), GqaShape::gqa(32, 8, 128), GqaShape::mqa(64, 256), GqaShape::gqa(24, 3, 80)}) {
    EXPECT_TRUE(s.valid());
    EXPECT_EQ(s.check(), "");
    EXPECT_NO_THROW(s.validate());
  }
}

TEST(GqaShape, KvHeadsMustDivideQueryHeads) {
  const GqaShape s{12, 5, 128};
  expect_shape_error(s.check(), {"q_heads=12", "kv_heads=5", "multiple"});
  EXPECT_THROW(s.validate(), kvattn::shape_error);
  EXPECT_THROW(s.validate(), std::invalid_argument);  // callers may catch the standard base
  try {
    s.validate();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("q_heads=12 kv_heads=5"), std::string::npos) << e.what();
  }
}

TEST(GqaShape, EverySizeMustBePositive) {
  for (const GqaShape& s : {GqaShape{0, 1, 64}, GqaShape{8, 0, 64}, GqaShape{8, 8, 0}, GqaShape{-8, 1, 64}, GqaShape{8, 8, -1}}) {
    EXPECT_FALSE(s.valid());
    expect_shape_error(s.check(), {"positive"});
    EXPECT_NE(s.check().find("head_dim=" + std::to_string(s.head_dim)), std::string::npos) << s.check();
    EXPECT_THROW(s.validate(), kvattn::shape_error);
  }
}

TEST(MlaShape, DeepSeekLayoutIsValid) {
  const MlaShape s{128, 512, 64, 128, 128, 1536};
  EXPECT_TRUE(s.valid());
  EXPECT_TRUE(s.has_q_latent());
  EXPECT_EQ(s.qk_head_dim(), 192);
  EXPECT_EQ(s.design(), Design::mla);
  EXPECT_FALSE((MlaShape{16, 512, 64, 128, 128, 0}).has_q_latent());
}

TEST(MlaShape, OddRotaryWidthIsRejected) {
  const MlaShape s{16, 512, 63, 128, 128, 0};
  EXPECT_FALSE(s.valid());
  expect_shape_error(s.check(), {"rope_dim=63", "even"});
  EXPECT_THROW(s.validate(), kvattn::shape_error);
}

TEST(MlaShape, ZeroAndNegativeSizesAreRejected) {
  const MlaShape bad[] = {{0, 512, 64, 128, 128, 0},  {16, 0, 64, 128, 128, 0}, {16, 512, 0, 128, 128, 0},
                          {16, 512, 64, 0, 128, 0},   {16, 512, 64, 128, 0, 0}, {16, 512, 64, 128, 128, -1},
                          {-16, 512, 64, 128, 128, 0}};
  for (const MlaShape& s : bad) {
    EXPECT_FALSE(s.valid());
    expect_shape_error(s.check(), {"heads=", "latent_dim=", "q_latent_dim="});
    EXPECT_THROW(s.validate(), kvattn::shape_error);
  }
}

TEST(Model, LayersMustBePositive) {
  const Model m{"m", 0, GqaShape::mha(8, 64)};
  EXPECT_FALSE(m.valid());
  expect_shape_error(m.check(), {"layers=0"});
  try {
    m.validate();
    FAIL() << "validate() accepted layers=0";
  } catch (const kvattn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("model 'm'"), std::string::npos) << e.what();
  }
}

TEST(Model, ReportsItsAttentionShapesError) {
  const Model m{"m", 4, GqaShape{12, 5, 64}};
  expect_shape_error(m.check(), {"q_heads=12", "kv_heads=5"});
}

// Every figure as published in the model's configuration file (layers, heads, KV heads, head
// size; for MLA kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, q_lora_rank).
TEST(Presets, MatchPublishedConfigurations) {
  namespace p = kvattn::presets;
  struct Expect {
    const kvattn::ModelPreset& preset;
    int layers;
    GqaShape shape;
  };
  for (const Expect& e : {Expect{p::llama2_7b, 32, {32, 32, 128}}, Expect{p::llama3_8b, 32, {32, 8, 128}},
                          Expect{p::llama31_8b, 32, {32, 8, 128}}, Expect{p::llama31_70b, 80, {64, 8, 128}},
                          Expect{p::llama31_405b, 126, {128, 8, 128}}, Expect{p::mistral_7b, 32, {32, 8, 128}},
                          Expect{p::qwen25_7b, 28, {28, 4, 128}}, Expect{p::qwen25_72b, 80, {64, 8, 128}}}) {
    SCOPED_TRACE(std::string(e.preset.model.name));
    EXPECT_EQ(e.preset.model.layers, e.layers);
    EXPECT_EQ(e.preset.model.gqa(), e.shape);
  }
  EXPECT_EQ(p::deepseek_v2.model.layers, 60);
  EXPECT_EQ(p::deepseek_v2.model.mla(), (MlaShape{128, 512, 64, 128, 128, 1536}));
  EXPECT_EQ(p::deepseek_v2_lite.model.layers, 27);
  EXPECT_EQ(p::deepseek_v2_lite.model.mla(), (MlaShape{16, 512, 64, 128, 128, 0}));
  EXPECT_EQ(p::deepseek_v3.model.layers, 61);
  EXPECT_EQ(p::deepseek_v3.model.mla(), (MlaShape{128, 512, 64, 128, 128, 1536}));
}

TEST(Presets, AreValidUniqueAndFoundByName) {
  std::set<std::string> names;
  for (const kvattn::ModelPreset& preset : kvattn::presets::all) {
    const std::string name(preset.model.name);
    EXPECT_TRUE(preset.model.valid()) << name << ": " << preset.model.check();
    EXPECT_TRUE(names.insert(name).second) << "duplicate preset " << name;
    EXPECT_FALSE(preset.source.empty()) << name;
    EXPECT_EQ(kvattn::presets::find(name), &preset);
  }
  ASSERT_NE(kvattn::presets::find("DeepSeek-V2"), nullptr);
  EXPECT_EQ(kvattn::presets::find("DeepSeek-V2")->model.name, "deepseek-v2");
  EXPECT_EQ(kvattn::presets::find("deepseek-v"), nullptr);
  EXPECT_EQ(kvattn::presets::find(""), nullptr);
  for (const char* required : {"llama-2-7b", "llama-3-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "deepseek-v2",
                               "deepseek-v2-lite", "deepseek-v3"})
    EXPECT_NE(kvattn::presets::find(required), nullptr) << required;
}

TEST(Errors, HandlerCanBeReplacedAndRestored) {
  const auto mine = +[](const char*, const char*) noexcept {};
  const kvattn::error_handler before = kvattn::set_error_handler(mine);
  EXPECT_NE(before, nullptr);
  EXPECT_EQ(kvattn::set_error_handler(before), mine);
  EXPECT_EQ(kvattn::set_error_handler(nullptr), before);  // nullptr restores the default
  kvattn::set_error_handler(before);
}

}  // namespace
