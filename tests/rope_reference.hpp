// tests/rope_reference.hpp — RoPE in double precision, written from the definition (none of
// rope.hpp's math): the oracle of test_rope, test_append and test_x86_isas.
#pragma once

#include <kvattn/rope.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace reference {

/// How far an fp32 rotation may be from the exact one: 4 · 2^-24 · (|a| + |b|) of its pair.
constexpr double kRopeBound = 4.0 / 16777216.0;

/// Element indices of the two members of pair i within a head (rotary width R).
inline void pair_members(kvattn::RopeStyle style, int R, int i, int& first, int& second) {
  if (style == kvattn::RopeStyle::neox) {
    first = i;
    second = i + R / 2;
  } else {
    first = 2 * i;
    second = 2 * i + 1;
  }
}

/// out [tokens][heads][D] = the exact rotation of x [tokens][heads][D], token t at positions[t]
/// (R == 0 means R == D).
inline std::vector<double> rope(kvattn::RopeStyle style, int D, int R, double base, const float* x, std::int64_t tokens,
                                int heads, const std::int64_t* positions) {
  if (R == 0) R = D;
  std::vector<double> out(x, x + tokens * heads * D);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h) {
      const std::size_t off = static_cast<std::size_t>((t * heads + h) * D);
      for (int i = 0; i < R / 2; ++i) {
        const double theta = static_cast<double>(positions[t]) / std::pow(base, (2.0 * i) / R);
        int f, s;
        pair_members(style, R, i, f, s);
        const double a = x[off + static_cast<std::size_t>(f)], b = x[off + static_cast<std::size_t>(s)];
        out[off + static_cast<std::size_t>(f)] = a * std::cos(theta) - b * std::sin(theta);
        out[off + static_cast<std::size_t>(s)] = a * std::sin(theta) + b * std::cos(theta);
      }
    }
  return out;
}

/// |a| + |b| of the input pair that element j of a head belongs to (0 for pass-through elements).
inline double pair_scale(kvattn::RopeStyle style, int R, const float* head, int j) {
  if (j >= R) return 0.0;
  const int i = style == kvattn::RopeStyle::neox ? j % (R / 2) : j / 2;
  int f, s;
  pair_members(style, R, i, f, s);
  return std::abs(static_cast<double>(head[f])) + std::abs(static_cast<double>(head[s]));
}

}  // namespace reference
