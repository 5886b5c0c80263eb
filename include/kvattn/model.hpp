// kvattn/model.hpp — a model as the KV cache sees it (layer count and head layout), and presets
// for published models, every field taken from the model's own published configuration file.
#pragma once

#include <array>
#include <cctype>
#include <cstddef>
#include <string>
#include <string_view>
#include <variant>

#include "error.hpp"
#include "shape.hpp"

namespace kvattn {

/// The head layout of one attention layer: the GQA family or MLA.
using AttentionShape = std::variant<GqaShape, MlaShape>;

/// What the KV cache needs to know of a model: how many layers, and each layer's head layout.
struct Model {
  std::string_view name;
  int layers = 0;
  AttentionShape attention;

  constexpr bool is_mla() const noexcept { return std::holds_alternative<MlaShape>(attention); }
  constexpr const GqaShape& gqa() const { return std::get<GqaShape>(attention); }
  constexpr const MlaShape& mla() const { return std::get<MlaShape>(attention); }
  constexpr Design design() const noexcept { return is_mla() ? Design::mla : std::get<GqaShape>(attention).design(); }
  /// Query heads, whatever the design.
  constexpr int q_heads() const noexcept {
    return is_mla() ? std::get<MlaShape>(attention).heads : std::get<GqaShape>(attention).q_heads;
  }

  constexpr bool valid() const noexcept {
    return layers > 0 && std::visit([](const auto& s) { return s.valid(); }, attention);
  }
  std::string check() const {
    std::string why = std::visit([](const auto& s) { return s.check(); }, attention);
    if (!why.empty()) return why;
    if (layers <= 0) return detail::concat("layers=", layers, ": must be positive");
    return {};
  }
  const Model& validate() const {
    if (std::string why = check(); !why.empty()) raise<shape_error>("model '" + std::string(name) + "': " + why);
    return *this;
  }
};

/// A published model: its shape and where the figures come from.
struct ModelPreset {
  Model model;
  std::string_view source;  ///< the configuration file the fields were taken from
};

namespace presets {
// clang-format off
// name, layers (num_hidden_layers), heads (num_attention_heads), KV heads (num_key_value_heads),
// head size (hidden_size / num_attention_heads, or head_dim).
inline constexpr ModelPreset llama2_7b   {{"llama-2-7b",    32, GqaShape::mha(32, 128)},    "meta-llama/Llama-2-7b-hf config.json"};
inline constexpr ModelPreset llama3_8b   {{"llama-3-8b",    32, GqaShape::gqa(32, 8, 128)}, "meta-llama/Meta-Llama-3-8B config.json"};
inline constexpr ModelPreset llama31_8b  {{"llama-3.1-8b",  32, GqaShape::gqa(32, 8, 128)}, "meta-llama/Llama-3.1-8B config.json"};
inline constexpr ModelPreset llama31_70b {{"llama-3.1-70b", 80, GqaShape::gqa(64, 8, 128)}, "meta-llama/Llama-3.1-70B config.json"};
inline constexpr ModelPreset llama31_405b{{"llama-3.1-405b",126, GqaShape::gqa(128, 8, 128)},"meta-llama/Llama-3.1-405B config.json"};
inline constexpr ModelPreset mistral_7b  {{"mistral-7b",    32, GqaShape::gqa(32, 8, 128)}, "mistralai/Mistral-7B-v0.1 config.json"};
inline constexpr ModelPreset qwen25_7b   {{"qwen2.5-7b",    28, GqaShape::gqa(28, 4, 128)}, "Qwen/Qwen2.5-7B config.json"};
inline constexpr ModelPreset qwen25_72b  {{"qwen2.5-72b",   80, GqaShape::gqa(64, 8, 128)}, "Qwen/Qwen2.5-72B config.json"};
// MLA: heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, q_lora_rank (null = 0).
inline constexpr ModelPreset deepseek_v2_lite{{"deepseek-v2-lite", 27, MlaShape{16, 512, 64, 128, 128, 0}},    "deepseek-ai/DeepSeek-V2-Lite config.json"};
inline constexpr ModelPreset deepseek_v2     {{"deepseek-v2",      60, MlaShape{128, 512, 64, 128, 128, 1536}}, "deepseek-ai/DeepSeek-V2 config.json"};
inline constexpr ModelPreset deepseek_v3     {{"deepseek-v3",      61, MlaShape{128, 512, 64, 128, 128, 1536}}, "deepseek-ai/DeepSeek-V3 config.json"};
// clang-format on

/// Every preset, in the order `kv_budget --list-presets` prints them.
inline constexpr std::array<ModelPreset, 11> all{
    llama2_7b, llama3_8b, llama31_8b, llama31_70b, llama31_405b, mistral_7b,
    qwen25_7b, qwen25_72b, deepseek_v2_lite, deepseek_v2, deepseek_v3};

/// The preset called `name` (case-insensitive), or nullptr.
inline const ModelPreset* find(std::string_view name) noexcept {
  const auto lower = [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); };
  for (const ModelPreset& p : all) {
    const std::string_view n = p.model.name;
    if (n.size() != name.size()) continue;
    bool same = true;
    for (std::size_t i = 0; i < n.size() && same; ++i) same = lower(n[i]) == lower(name[i]);
    if (same) return &p;
  }
  return nullptr;
}
}  // namespace presets

}  // namespace kvattn
