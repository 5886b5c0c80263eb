// kvattn/rope_config.hpp — what a rotary position embedding is: its style, its configuration and
// its frequencies (Rope), without the kernel that applies it (apply_rope, kvattn/rope.hpp). The
// plans (core.hpp) take a Rope; see rope.hpp for the rotation itself and its numerics.
#pragma once

#include <cmath>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "config.hpp"
#include "error.hpp"

namespace kvattn {

/// Which elements of a head form the rotated pairs.
enum class RopeStyle {
  /// Rotate-half: pair i is (x[i], x[i + rotary_dim/2]). Llama, GPT-NeoX, Qwen, Mistral (the
  /// Hugging Face `rotate_half` convention).
  neox,
  /// Interleaved: pair i is (x[2i], x[2i + 1]). GPT-J, and DeepSeek's MLA rotary part in its
  /// reference code (complex multiplication of adjacent pairs).
  gptj,
};

constexpr std::string_view to_string(RopeStyle s) noexcept {
  switch (s) {
    case RopeStyle::neox: return "neox";
    case RopeStyle::gptj: return "gptj";
  }
  return "?";
}

/// What a Rope rotates: the head layout and the frequencies.
struct RopeConfig {
  RopeStyle style = RopeStyle::neox;
  int head_dim = 0;       ///< width of every head, d_h; > 0
  int rotary_dim = 0;     ///< rotated width, even and <= head_dim; 0: head_dim (the whole head)
  double base = 10000.0;  ///< theta: 10000 (Llama 2, GPT-NeoX), 500000 (Llama 3), 1000000 (Qwen 2); > 0, finite

  /// The rotated width: rotary_dim, or head_dim when rotary_dim is 0.
  constexpr int rotary_width() const noexcept { return rotary_dim == 0 ? head_dim : rotary_dim; }

  /// What is wrong with this configuration, naming the values; empty when nothing is.
  std::string check() const {
    if (style != RopeStyle::neox && style != RopeStyle::gptj)
      return detail::concat("style=", static_cast<int>(style), ": must be RopeStyle::neox or RopeStyle::gptj");
    if (head_dim <= 0) return detail::concat("head_dim=", head_dim, ": must be positive");
    if (rotary_dim < 0) return detail::concat("rotary_dim=", rotary_dim, ": must be >= 0 (0: head_dim)");
    if (rotary_dim > head_dim)
      return detail::concat("rotary_dim=", rotary_dim, " head_dim=", head_dim, ": rotary_dim must not exceed head_dim");
    if (rotary_width() % 2 != 0)
      return rotary_dim == 0
                 ? detail::concat("rotary_dim=0 head_dim=", head_dim,
                                  ": the rotated width (head_dim when rotary_dim=0) must be even")
                 : detail::concat("rotary_dim=", rotary_dim, ": must be even (it rotates pairs)");
    if (!(base > 0.0 && std::isfinite(base))) return detail::concat("base=", base, ": must be positive and finite");
    return {};
  }
  /// Throws kvattn::invalid_argument with check()'s message when the configuration is not valid.
  const RopeConfig& validate() const {
    if (std::string why = check(); !why.empty()) raise<invalid_argument>("RopeConfig " + why);
    return *this;
  }
};

/// A validated RoPE configuration and its frequencies. Cheap to share: kernels only read it.
class Rope {
 public:
  /// Validates `config` (kvattn::invalid_argument naming the values) and computes the
  /// frequencies inv_freq[i] = base^(-2i / rotary_dim) in double.
  explicit Rope(const RopeConfig& config) : config_(config.validate()) {
    const int half = config_.rotary_width() / 2;
    inv_freq_.resize(static_cast<std::size_t>(half));
    for (int i = 0; i < half; ++i)
      inv_freq_[static_cast<std::size_t>(i)] =
          std::pow(config_.base, -2.0 * static_cast<double>(i) / static_cast<double>(config_.rotary_width()));
  }

  /// The configuration as given (rotary_dim may be 0; rotary_dim() resolves it).
  const RopeConfig& config() const noexcept { return config_; }
  RopeStyle style() const noexcept { return config_.style; }
  int head_dim() const noexcept { return config_.head_dim; }
  /// The rotated width (never 0).
  int rotary_dim() const noexcept { return config_.rotary_width(); }
  /// [rotary_dim / 2]: the angle of pair i at position p is p · inv_freq()[i].
  const double* inv_freq() const noexcept { return inv_freq_.data(); }

 private:
  RopeConfig config_;
  std::vector<double> inv_freq_;  // [rotary_dim / 2]
};

}  // namespace kvattn
