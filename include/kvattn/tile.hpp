// kvattn/tile.hpp — a row's tile of scores in the CPU kernels that keep a row's scores in a row
// (decode, MLA decode): the score policy's part (policy_tile) and the online-softmax step
// (row_softmax). Internal to the kernels; the public types they read are in core.hpp and
// policy.hpp, and a unit that calls the compiled kernels (kernels.hpp) does not include this.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "config.hpp"
#include "policy.hpp"
#include "simd.hpp"
#include "state.hpp"

namespace kvattn {

KVATTN_BEGIN_TARGET_NAMESPACE
namespace core_impl {

/// One row's online-softmax step over a tile of N scores `s` (-inf where the row sees no key), for
/// the CPU kernels that keep a row's scores in a row (decode, MLA decode): turns them into
/// exp(s − m) with m the row's new reference (all 0 while the row has seen nothing), updates the
/// running {m, d} at md[0], md[1], and returns the factor the row's accumulated output must be
/// rescaled by. The reference moves only where some score exceeds it by more than kSoftmaxSlack
/// (state.hpp), which after the first tiles is rare: only then are the tile's maximum (a
/// reduction) and the step taken.
template <class Isa, int N> KVATTN_ALWAYS_INLINE float row_softmax(float* s, float* md) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  static_assert(N % W == 0, "a tile is whole vectors of scores");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float m_old = md[0];
  Vec m = Vec::load(s);
  for (int g = W; g < N; g += W) m = max(m, Vec::load(s + g));
  float m_new = m_old, alpha = 1.0f;
  if (any_greater(m, Vec::set1(m_old + kSoftmaxSlack))) {
    const SoftmaxStep<float> step = softmax_step(m_old, m.reduce_max());
    m_new = step.m;
    alpha = step.alpha;
  }
  if (m_new == kNegInf) {  // nothing seen yet: no probability, nothing to rescale
    std::fill(s, s + N, 0.0f);
    return 1.0f;
  }
  Vec sum = Vec::zero();
  for (int g = 0; g < N; g += W) {
    const Vec e = exp(Vec::load(s + g) - Vec::set1(m_new));  // exp(-inf) = 0
    e.store(s + g);
    sum = sum + e;
  }
  md[0] = m_new;
  md[1] = md[1] * alpha + sum.reduce_add();
  return alpha;
}

/// The policy's part of a row's tile of N scores s[t] (keys t0 + t; the first n of them exist),
/// for the CPU kernels that keep a row's scores in a row (decode, MLA decode), as policy.hpp's
/// sees() and policy_logit() say for one key: logits for the whole tile (a loop of constant
/// length, which vectorizes; keys the row does not see are overwritten next), then -inf for every
/// key the row does not see: past its position or the tile's n keys, before its window, or hidden
/// by its mask.
template <int N, class P>
KVATTN_ALWAYS_INLINE void policy_tile(const P& policy, const QueryRow& q, std::int64_t t0, int n, float* s) noexcept {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const PolicyRow row = policy_row(policy, q);
  // The keys the row may see form one range [lo, hi) of the tile: causal, and the window's.
  const int hi = static_cast<int>(std::clamp<std::int64_t>(q.pos - t0 + 1, 0, n));
  int lo = 0;
  if constexpr (P::kWindow) lo = static_cast<int>(std::clamp<std::int64_t>(row.lo - t0, 0, hi));
  if constexpr (P::kLogits) {  // (key − pos as the tile's first distance plus t: int-to-float conversions that vectorize)
    const float distance = static_cast<float>(t0 - q.pos);
    for (int t = 0; t < N; ++t) s[t] = policy.logit(s[t], q, distance + static_cast<float>(t));
  }
  if constexpr (P::kMask)
    for (int t = static_cast<int>(std::clamp<std::int64_t>(row.mask_from - t0, lo, hi)); t < hi; ++t)
      if (!policy.visible(q, t0 + t)) s[t] = kNegInf;
  for (int t = 0; t < lo; ++t) s[t] = kNegInf;
  for (int t = hi; t < N; ++t) s[t] = kNegInf;
}

}  // namespace core_impl
KVATTN_END_TARGET_NAMESPACE

}  // namespace kvattn
