// kvattn/shape.hpp — the head layouts of the attention designs kvattn serves.
//
//   GqaShape: the GQA family. MHA is kv_heads == q_heads, MQA is kv_heads == 1, GQA is anything
//             between; query head i reads KV head i / group_size().
//   MlaShape: multi-head latent attention (DeepSeek-V2 style): one latent of width latent_dim
//             (d_c) and one rotary key of width rope_dim (d_h^R) cached per token, shared by
//             every head.
//
// Shapes are plain aggregates, usable in constant expressions. check() says what is wrong (an
// empty string when nothing is); validate() throws kvattn::shape_error with that message.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "error.hpp"

namespace kvattn {

/// The four ways of caching keys and values that kvattn compares.
enum class Design { mha, gqa, mqa, mla };

constexpr std::string_view to_string(Design d) noexcept {
  switch (d) {
    case Design::mha: return "MHA";
    case Design::gqa: return "GQA";
    case Design::mqa: return "MQA";
    case Design::mla: return "MLA";
  }
  return "?";
}

/// Head layout of one attention layer in the MHA / GQA / MQA family.
struct GqaShape {
  int q_heads = 0;   ///< query heads, n_h
  int kv_heads = 0;  ///< key/value heads (groups), G; divides q_heads
  int head_dim = 0;  ///< width of every query, key and value head, d_h

  /// Multi-head attention: one KV head per query head.
  static constexpr GqaShape mha(int heads, int head_dim) noexcept { return {heads, heads, head_dim}; }
  /// Grouped-query attention: q_heads / kv_heads query heads share each KV head.
  static constexpr GqaShape gqa(int q_heads, int kv_heads, int head_dim) noexcept {
    return {q_heads, kv_heads, head_dim};
  }
  /// Multi-query attention: every query head shares one KV head.
  static constexpr GqaShape mqa(int q_heads, int head_dim) noexcept { return {q_heads, 1, head_dim}; }

  /// Query heads per KV head (valid shapes only).
  constexpr int group_size() const noexcept { return q_heads / kv_heads; }
  /// The KV head that query head `q_head` reads.
  constexpr int kv_head_of(int q_head) const noexcept { return q_head / group_size(); }
  /// MHA when every query head has its own KV head, MQA when there is one, GQA otherwise.
  constexpr Design design() const noexcept {
    return kv_heads == q_heads ? Design::mha : kv_heads == 1 ? Design::mqa : Design::gqa;
  }

  constexpr bool valid() const noexcept {
    return q_heads > 0 && kv_heads > 0 && head_dim > 0 && q_heads % kv_heads == 0;
  }
  std::string check() const {
    if (q_heads <= 0 || kv_heads <= 0 || head_dim <= 0)
      return detail::concat("q_heads=", q_heads, " kv_heads=", kv_heads, " head_dim=", head_dim,
                            ": every size must be positive");
    if (q_heads % kv_heads != 0)
      return detail::concat("q_heads=", q_heads, " kv_heads=", kv_heads,
                            ": q_heads must be a multiple of kv_heads");
    return {};
  }
  const GqaShape& validate() const {
    if (std::string why = check(); !why.empty()) raise<shape_error>("GqaShape " + why);
    return *this;
  }

  friend constexpr bool operator==(const GqaShape& a, const GqaShape& b) noexcept {
    return a.q_heads == b.q_heads && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim;
  }
  friend constexpr bool operator!=(const GqaShape& a, const GqaShape& b) noexcept { return !(a == b); }
};

/// Head layout of one multi-head latent attention layer. Names follow DESIGN.md; the names of
/// the DeepSeek configuration files are given beside each field.
struct MlaShape {
  int heads = 0;         ///< query heads, n_h                       (num_attention_heads)
  int latent_dim = 0;    ///< cached latent width, d_c               (kv_lora_rank)
  int rope_dim = 0;      ///< rotary query/key width, d_h^R; even    (qk_rope_head_dim)
  int nope_dim = 0;      ///< non-rotary query/key head width, d_h   (qk_nope_head_dim)
  int v_head_dim = 0;    ///< value head width                       (v_head_dim)
  int q_latent_dim = 0;  ///< query latent width d_c'; 0: none       (q_lora_rank)

  /// Width of one head's full query and key: [non-rotary ; rotary].
  constexpr int qk_head_dim() const noexcept { return nope_dim + rope_dim; }
  /// Whether queries pass through a low-rank latent (DeepSeek-V2) or come straight from the
  /// hidden state (DeepSeek-V2-Lite).
  constexpr bool has_q_latent() const noexcept { return q_latent_dim > 0; }
  constexpr Design design() const noexcept { return Design::mla; }

  constexpr bool valid() const noexcept {
    return heads > 0 && latent_dim > 0 && rope_dim > 0 && rope_dim % 2 == 0 && nope_dim > 0 &&
           v_head_dim > 0 && q_latent_dim >= 0;
  }
  std::string check() const {
    const auto fields = [&] {
      return detail::concat("heads=", heads, " latent_dim=", latent_dim, " rope_dim=", rope_dim,
                            " nope_dim=", nope_dim, " v_head_dim=", v_head_dim,
                            " q_latent_dim=", q_latent_dim);
    };
    if (heads <= 0 || latent_dim <= 0 || rope_dim <= 0 || nope_dim <= 0 || v_head_dim <= 0)
      return fields() + ": heads and every width but q_latent_dim must be positive";
    if (q_latent_dim < 0) return fields() + ": q_latent_dim must be 0 (no query latent) or positive";
    if (rope_dim % 2 != 0) return fields() + ": rope_dim must be even (RoPE rotates pairs)";
    return {};
  }
  const MlaShape& validate() const {
    if (std::string why = check(); !why.empty()) raise<shape_error>("MlaShape " + why);
    return *this;
  }

  friend constexpr bool operator==(const MlaShape& a, const MlaShape& b) noexcept {
    return a.heads == b.heads && a.latent_dim == b.latent_dim && a.rope_dim == b.rope_dim &&
           a.nope_dim == b.nope_dim && a.v_head_dim == b.v_head_dim && a.q_latent_dim == b.q_latent_dim;
  }
  friend constexpr bool operator!=(const MlaShape& a, const MlaShape& b) noexcept { return !(a == b); }
};

}  // namespace kvattn
