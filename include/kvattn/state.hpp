// kvattn/state.hpp — the online-softmax state of a partial attention result, and its merge.
//
// Attention of one query row over a set of keys S is o = Σ_j p_j v_j with p_j = exp(s_j - m) / d,
// m = max_j s_j and d = Σ_j exp(s_j - m). A partial result over a subset is the state
// {o (already divided by d), m, d}; two partial results over disjoint subsets merge exactly:
//   m = max(m1, m2),  d = d1·exp(m1 - m) + d2·exp(m2 - m),  o = (o1·d1·exp(m1 - m) + o2·d2·exp(m2 - m)) / d.
// The log-sum-exp of the scores, lse = m + ln d (natural log, as FlashAttention), is what crosses
// the API. An empty state has m = -inf, d = 0, lse = -inf and o = 0, and merging two empty
// states yields an empty state, never NaN.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>

namespace kvattn {

/// Running max and sum of one query row's softmax.
struct SoftmaxStats {
  float m = -std::numeric_limits<float>::infinity();  ///< max score seen
  float d = 0.0f;                                      ///< Σ exp(score - m)

  bool empty() const noexcept { return d == 0.0f; }
  /// Natural-log log-sum-exp of the scores seen; -inf when none were.
  float lse() const noexcept { return empty() ? -std::numeric_limits<float>::infinity() : m + std::log(d); }
  /// A state with this log-sum-exp (lse = -inf: empty).
  static SoftmaxStats from_lse(float lse) noexcept {
    SoftmaxStats s;
    if (lse != -std::numeric_limits<float>::infinity()) {
      s.m = lse;
      s.d = 1.0f;
    }
    return s;
  }
};

/// Merges the partial result (o2 [n], s2) into (o1 [n], s1), both normalized (o = Σ p v / d).
inline void merge_state(float* o1, SoftmaxStats& s1, const float* o2, SoftmaxStats s2, std::size_t n) noexcept {
  if (s2.empty()) return;
  if (s1.empty()) {
    for (std::size_t i = 0; i < n; ++i) o1[i] = o2[i];
    s1 = s2;
    return;
  }
  const float m = s1.m > s2.m ? s1.m : s2.m;
  const float w1 = s1.d * std::exp(s1.m - m), w2 = s2.d * std::exp(s2.m - m);
  const float d = w1 + w2;
  const float a = w1 / d, b = w2 / d;
  for (std::size_t i = 0; i < n; ++i) o1[i] = a * o1[i] + b * o2[i];
  s1.m = m;
  s1.d = d;
}

}  // namespace kvattn
