// kvattn/state.hpp — the online softmax of every attention kernel: its running state, its one
// step, and its one merge.
//
// Attention of one query row over a set of keys S is o = Σ_j p_j v_j with p_j = exp(s_j - m) / d,
// m = max_j s_j and d = Σ_j exp(s_j - m). A partial result over a subset is the state
// {o (already divided by d), m, d}; two partial results over disjoint subsets merge exactly:
//   m = max(m1, m2),  d = d1·exp(m1 - m) + d2·exp(m2 - m),  o = (o1·d1·exp(m1 - m) + o2·d2·exp(m2 - m)) / d.
// The log-sum-exp of the scores, lse = m + ln d (natural log, as FlashAttention), is what crosses
// the API. An empty state has m = -inf, d = 0, lse = -inf and o = 0, and merging two empty
// states yields an empty state, never NaN.
//
// Kernels build a state block by block (online): softmax_step folds a block of scores into the
// running reference m and says by how much the output accumulated so far must be rescaled. The
// reference need not be the exact maximum: the merge and the log-sum-exp hold for any m, and it
// moves to a block's largest score only when that exceeds it by more than kSoftmaxSlack. Blocks
// whose scores creep upwards (ALiBi's bias grows towards the query; most scores of a long context)
// then skip the rescale, and every p = exp(s − m) stays below e^8 ≈ 2981, far from overflow. Split-KV
// results, the lane groups of a GPU block and attention sinks all meet through merge_weights.
// Both are written once, for a float (the CUDA kernels, per token) or a vector of floats (the CPU
// kernels, a lane per row): one definition, every kernel.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>

#include "config.hpp"

namespace kvattn {

namespace detail {
/// The float forms of the operations softmax_step takes from its number type (a vector type has
/// its own, found by argument-dependent lookup): max, exp, and a float broadcast.
KVATTN_HOST_DEVICE inline float max(float a, float b) noexcept { return a > b ? a : b; }
KVATTN_HOST_DEVICE inline float exp(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  return std::exp(x);
#endif
}
KVATTN_HOST_DEVICE inline float select_greater(float a, float b, float x, float y) noexcept { return a > b ? x : y; }
KVATTN_HOST_DEVICE inline float log(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return ::logf(x);
#else
  return std::log(x);
#endif
}
template <class F> KVATTN_HOST_DEVICE F splat(float x) noexcept { return F::set1(x); }
template <> KVATTN_HOST_DEVICE inline float splat<float>(float x) noexcept { return x; }
}  // namespace detail

/// How far a block's largest score may exceed a row's reference m before m moves (see above).
inline constexpr float kSoftmaxSlack = 8.0f;

/// The running reference and sum of one query row's softmax.
struct SoftmaxStats {
  float m = -std::numeric_limits<float>::infinity();  ///< reference: the max score seen, or up to kSoftmaxSlack below it
  float d = 0.0f;                                      ///< Σ exp(score - m)

  KVATTN_HOST_DEVICE bool empty() const noexcept { return d == 0.0f; }
  /// Natural-log log-sum-exp of the scores seen; -inf when none were.
  KVATTN_HOST_DEVICE float lse() const noexcept {
    return empty() ? -std::numeric_limits<float>::infinity() : m + detail::log(d);
  }
  /// A state with this log-sum-exp (lse = -inf: empty).
  KVATTN_HOST_DEVICE static SoftmaxStats from_lse(float lse) noexcept {
    SoftmaxStats s;
    if (lse != -std::numeric_limits<float>::infinity()) {
      s.m = lse;
      s.d = 1.0f;
    }
    return s;
  }
};

/// What folding a block of scores into a running state takes: the new reference m, the factor
/// alpha the output and sum accumulated so far are rescaled by, and the shift the block's
/// probabilities are taken against, p = exp(s - shift). The shift is m, or the lowest finite float
/// while the row has seen nothing (m = -inf), so that a masked score (-inf) gives p = 0 and alpha
/// is 0, never NaN.
template <class F> struct SoftmaxStep {
  F m, alpha, shift;
};

// (Always inlined on the host: a call of its own costs the vector kernels more than its three
// operations, and GCC 12 reports false uninitialized values inside the AVX-512 intrinsics of an
// out-of-line copy.)
#if defined(__CUDACC__)
#define KVATTN_INLINE_STEP __forceinline__
#elif defined(__GNUC__) || defined(__clang__)
#define KVATTN_INLINE_STEP inline __attribute__((always_inline))
#else
#define KVATTN_INLINE_STEP inline
#endif
/// The online-softmax step: the state's reference `m_old` meets a block whose largest score is
/// `block_max` (-inf for a block the row does not see); the reference moves to block_max only
/// where that exceeds m_old + kSoftmaxSlack (always, while the row has seen nothing). F is float
/// or a vector of floats (a lane per row).
template <class F>
KVATTN_HOST_DEVICE KVATTN_INLINE_STEP SoftmaxStep<F> softmax_step(F m_old, F block_max) noexcept {
  using detail::exp;
  using detail::max;
  using detail::select_greater;
  const F m = select_greater(block_max, m_old + detail::splat<F>(kSoftmaxSlack), block_max, m_old);
  const F shift = max(m, detail::splat<F>(std::numeric_limits<float>::lowest()));
  return {m, exp(m_old - shift), shift};
}

/// The one merge: the weights of two partial results over disjoint sets of keys, o = a·o1 + b·o2,
/// and the merged state. An empty side gets weight 0 (its o is never read), so two empty states
/// merge into an empty one.
struct MergeWeights {
  float a, b;
  SoftmaxStats stats;
};
KVATTN_HOST_DEVICE inline MergeWeights merge_weights(SoftmaxStats s1, SoftmaxStats s2) noexcept {
  if (s2.empty()) return {1.0f, 0.0f, s1};
  if (s1.empty()) return {0.0f, 1.0f, s2};
  const float m = detail::max(s1.m, s2.m);
  const float w1 = s1.d * detail::exp(s1.m - m), w2 = s2.d * detail::exp(s2.m - m);
  const float d = w1 + w2;
  return {w1 / d, w2 / d, SoftmaxStats{m, d}};
}

/// One element of the merged output: a·o1 + b·o2, where an empty side's element (weight 0) is
/// never read, so it may hold anything (a part never written, say).
KVATTN_HOST_DEVICE inline float merge_value(float o1, float o2, const MergeWeights& w) noexcept {
  return w.b == 0.0f ? o1 : w.a == 0.0f ? o2 : w.a * o1 + w.b * o2;
}

/// Merges the partial result (o2 [n], s2) into (o1 [n], s1), both normalized (o = Σ p v / d).
inline void merge_state(float* o1, SoftmaxStats& s1, const float* o2, SoftmaxStats s2, std::size_t n) noexcept {
  const MergeWeights w = merge_weights(s1, s2);
  s1 = w.stats;
  if (w.b == 0.0f) return;
  for (std::size_t i = 0; i < n; ++i) o1[i] = merge_value(o1[i], o2[i], w);
}

/// An attention sink: one more logit in the denominator that brings no value, i.e. a merge with
/// the state {o = 0, m = sink, d = 1}. Updates the row's state and returns the factor its
/// normalized output is multiplied by. The row's log-sum-exp then counts the sink:
/// lse = ln(exp(sink) + Σ_j exp(s_j)); a row that sees no key gets out = 0 and lse = sink.
KVATTN_HOST_DEVICE inline float add_sink(SoftmaxStats& s, float sink) noexcept {
  const MergeWeights w = merge_weights(s, SoftmaxStats{sink, 1.0f});
  s = w.stats;
  return w.a;
}

}  // namespace kvattn
