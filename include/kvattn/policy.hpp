// kvattn/policy.hpp — score policies: what a variant of attention changes about the scores.
//
// Every attention kernel (decode, prefill, MLA decode, on the CPU and the GPU) scores query row r
// against key position j as s = scale · q_r · k_j, keeps the causal mask (j ≤ the row's position)
// and takes a softmax over what is left. A policy says what else happens, through hooks the
// kernels call with what they know of the row (QueryRow) and the key:
//   first_key(row)           the lowest key position the row may see           (kWindow)
//   logit(s, row, j - pos)   the logit that enters the softmax                 (kLogits)
//   mask_from(row)           the first key position an irregular mask covers,  (kMask)
//   visible(row, j)          and whether the row sees key j there
//   sink(head)               a logit that joins the softmax denominator and    (kSink)
//                            contributes no value: counted once per row, also under split-KV
// A kernel calls a hook only where the policy's flag says it does something, so a policy that
// does nothing (Plain) compiles to the plain kernel, and a new variant is one new type.
//
// The policies kvattn ships, each a small aggregate that carries its own parameters:
//   Plain                  nothing beyond the causal mask
//   SlidingWindow{W}       the last W positions, the row's own included (Mistral, Gemma 2, gpt-oss)
//   SoftCap{c}             logit = c · tanh(s / c) (Gemma 2)
//   Alibi{slopes, heads}   logit = s + slope[head] · (j − pos): a linear bias per query head
//                          (BLOOM, MPT, Falcon); alibi_slopes() gives the published slopes
//   Sinks{logits, heads}   one learned sink logit per query head (gpt-oss)
//   TreeMask{bits, rows}   which of its sequence's new tokens each query sees (speculative
//                          verification of a draft tree), on top of the causal mask
// and compose(a, b, ...) combines them: compose(SlidingWindow{128}, Sinks{s, 64}) is gpt-oss's
// sliding layer; logits are transformed in the order given (compose(SoftCap{c}, Alibi{...}) caps,
// then biases).
//
// Arrays a policy points to (slopes, sink logits, mask bits) are read by the kernels: host
// memory for the CPU operators, device memory for the CUDA ones. Every operator checks its
// policy against the call before any work (check_policy: kvattn::invalid_argument naming the
// operator and the values); the CUDA operators check sizes, not the values of device arrays.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "state.hpp"

namespace kvattn {

/// What a kernel knows about one query row when it asks a policy about a key.
struct QueryRow {
  std::int64_t query = 0;      ///< the row's query token: its index along q's token dimension
                               ///< ([batch][Q] flattened for decode, the row of q for prefill)
  std::int64_t pos = 0;        ///< its position in its sequence
  std::int64_t first_new = 0;  ///< the position of its sequence's first new token (decode: L − Q;
                               ///< prefill: the chunk's first)
  int head = 0;                ///< its query head
};

/// What a policy is checked against: the call's query heads and its query rows, sequence by
/// sequence (sequence b's rows are [q_indptr[b], q_indptr[b + 1]) of q's token dimension, the last
/// q_indptr[b + 1] − q_indptr[b] tokens of the sequence).
struct PolicyCall {
  int q_heads = 0;
  int batch = 0;
  const std::int64_t* q_indptr = nullptr;  ///< [batch + 1]
  /// Whether the policy's arrays are host memory whose values can be checked (the CPU operators);
  /// for the CUDA operators they are device memory, and only their sizes are checked.
  bool host_arrays = true;
};

/// No variant: the causal mask alone. Every hook is off.
struct Plain {
  static constexpr bool kWindow = false, kLogits = false, kMask = false, kSink = false;
  std::string check(const PolicyCall&) const { return {}; }
};

/// Sliding-window attention: a row at position pos sees keys (pos − tokens, pos].
struct SlidingWindow {
  std::int64_t tokens = 0;  ///< W >= 1

  static constexpr bool kWindow = true, kLogits = false, kMask = false, kSink = false;
  KVATTN_HOST_DEVICE std::int64_t first_key(const QueryRow& r) const noexcept {
    return r.pos < tokens ? 0 : r.pos - tokens + 1;  // (no r.pos - tokens: tokens may be INT64_MAX)
  }
  std::string check(const PolicyCall&) const {
    return tokens >= 1 ? std::string() : detail::concat("SlidingWindow tokens=", tokens, ": must hold at least 1 token");
  }
};

/// Logit soft-capping: logit = cap · tanh(s / cap).
struct SoftCap {
  float cap = 0.0f;  ///< > 0, finite

  static constexpr bool kWindow = false, kLogits = true, kMask = false, kSink = false;
  KVATTN_HOST_DEVICE float logit(float s, const QueryRow&, float) const noexcept {
#if defined(__CUDA_ARCH__)
    return cap * ::tanhf(s / cap);
#else
    return cap * std::tanh(s / cap);
#endif
  }
  std::string check(const PolicyCall&) const {
    return cap > 0.0f && std::isfinite(cap) ? std::string() : detail::concat("SoftCap cap=", cap, ": must be positive and finite");
  }
};

/// ALiBi: logit = s + slopes[head] · (j − pos), a bias that grows linearly with the distance to
/// the key (j − pos <= 0 for every key a row sees).
struct Alibi {
  const float* slopes = nullptr;  ///< [heads] one slope per query head, finite
  int heads = 0;                  ///< must equal the call's query heads

  static constexpr bool kWindow = false, kLogits = true, kMask = false, kSink = false;
  KVATTN_HOST_DEVICE float logit(float s, const QueryRow& r, float distance) const noexcept {
    return s + slopes[r.head] * distance;
  }
  std::string check(const PolicyCall& c) const;
};

/// The slopes of ALiBi for `heads` query heads, as published (Press et al.; BLOOM's code): for a
/// power of two n, head h (0-based) gets 2^(−8(h + 1)/n); otherwise the n' = 2^⌊log2 heads⌋ slopes
/// of n', then every other slope of 2n' (the odd-numbered ones) until there are `heads`.
inline std::vector<float> alibi_slopes(int heads) {
  if (heads < 1) raise<invalid_argument>(detail::concat("alibi_slopes: heads=", heads, ": must be positive"));
  const auto powers = [](int n, int count, int step) {  // 2^(-8 (1 + step·i) / n), i < count
    std::vector<float> s;
    for (int i = 0; i < count; ++i) s.push_back(static_cast<float>(std::exp2(-8.0 * (1.0 + step * i) / n)));
    return s;
  };
  int n = 1;
  while (n * 2 <= heads) n *= 2;
  std::vector<float> slopes = powers(n, n, 1);
  if (n < heads) {
    const std::vector<float> extra = powers(2 * n, heads - n, 2);
    slopes.insert(slopes.end(), extra.begin(), extra.end());
  }
  return slopes;
}

/// Attention sinks: one learned logit per query head that joins the softmax denominator and
/// contributes no value. Counted once per row, whatever the split of the keys; the row's
/// log-sum-exp includes it: lse = ln(exp(sink) + Σ_j exp(s_j)), and a row that sees no key gets
/// zeros and lse = sink.
struct Sinks {
  const float* logits = nullptr;  ///< [heads] finite
  int heads = 0;                  ///< must equal the call's query heads

  static constexpr bool kWindow = false, kLogits = false, kMask = false, kSink = true;
  KVATTN_HOST_DEVICE float sink(int head) const noexcept { return logits[head]; }
  std::string check(const PolicyCall& c) const;
};

/// A tree mask over each sequence's new tokens (speculative verification of a draft tree): bit j
/// of bits[row] says whether query row `row` (along q's token dimension) sees its sequence's j-th
/// new token, on top of the causal mask and full attention to the cached prefix. Rows list a
/// tree's tokens ancestors first, so a row sees only new tokens at or before its own: a set bit
/// past the row's own token, or a sequence of more than 64 new tokens, is an error.
struct TreeMask {
  const std::uint64_t* bits = nullptr;  ///< [rows]
  std::int64_t rows = 0;                ///< must equal the call's query rows

  static constexpr bool kWindow = false, kLogits = false, kMask = true, kSink = false;
  static constexpr int kMaxNewTokens = 64;
  KVATTN_HOST_DEVICE std::int64_t mask_from(const QueryRow& r) const noexcept { return r.first_new; }
  KVATTN_HOST_DEVICE bool visible(const QueryRow& r, std::int64_t key) const noexcept {
    return (bits[r.query] >> (key - r.first_new)) & 1u;
  }
  std::string check(const PolicyCall& c) const;
};

namespace detail {
inline std::string check_per_head(const char* what, const float* values, int heads, const PolicyCall& c) {
  if (heads != c.q_heads)
    return concat(what, " heads=", heads, ": must equal the call's q_heads=", c.q_heads);
  if (values == nullptr) return concat(what, ": the array of ", heads, " values is null");
  if (!c.host_arrays) return {};
  for (int h = 0; h < heads; ++h)
    if (!std::isfinite(values[h])) return concat(what, "[", h, "]=", values[h], ": must be finite");
  return {};
}
}  // namespace detail

inline std::string Alibi::check(const PolicyCall& c) const { return detail::check_per_head("Alibi slopes", slopes, heads, c); }
inline std::string Sinks::check(const PolicyCall& c) const { return detail::check_per_head("Sinks logits", logits, heads, c); }

inline std::string TreeMask::check(const PolicyCall& c) const {
  const std::int64_t total = c.batch > 0 ? c.q_indptr[c.batch] : 0;
  if (rows != total) return detail::concat("TreeMask rows=", rows, ": must equal the call's ", total, " query rows");
  if (rows > 0 && bits == nullptr) return detail::concat("TreeMask: the ", rows, " rows of bits are null");
  for (int b = 0; b < c.batch; ++b) {
    const std::int64_t first = c.q_indptr[b], n = c.q_indptr[b + 1] - first;
    if (n > kMaxNewTokens)
      return detail::concat("TreeMask: sequence ", b, " of the batch has ", n, " new tokens: at most ", kMaxNewTokens);
    for (std::int64_t i = 0; c.host_arrays && i < n; ++i) {
      const std::uint64_t later = i + 1 < 64 ? bits[first + i] >> (i + 1) : 0;
      if (later != 0)
        return detail::concat("TreeMask: row ", first + i, " (new token ", i, " of sequence ", b, ") has bits 0x", std::hex,
                              bits[first + i], std::dec, ": it may see new tokens 0 to ", i, " only");
    }
  }
  return {};
}

/// Several policies in one: windows intersect, masks intersect, logits are transformed in the
/// order the policies are listed, and at most one may bring sinks. An aggregate of its parts:
/// Compose<SlidingWindow, Sinks>{{128}, {logits, 64}}, or compose(SlidingWindow{128}, Sinks{logits, 64}).
template <class... P> struct Compose : P... {
  static constexpr bool kWindow = (P::kWindow || ...);
  static constexpr bool kLogits = (P::kLogits || ...);
  static constexpr bool kMask = (P::kMask || ...);
  static constexpr bool kSink = (P::kSink || ...);
  static_assert((int{P::kSink} + ... + 0) <= 1, "kvattn::Compose: at most one policy may bring sinks");

  KVATTN_HOST_DEVICE std::int64_t first_key(const QueryRow& r) const noexcept {
    std::int64_t first = 0;
    ((first = part_first_key<P>(first, r)), ...);
    return first;
  }
  KVATTN_HOST_DEVICE float logit(float s, const QueryRow& r, float distance) const noexcept {
    ((s = part_logit<P>(s, r, distance)), ...);
    return s;
  }
  KVATTN_HOST_DEVICE std::int64_t mask_from(const QueryRow& r) const noexcept {
    std::int64_t from = INT64_MAX;
    ((from = part_mask_from<P>(from, r)), ...);
    return from;
  }
  KVATTN_HOST_DEVICE bool visible(const QueryRow& r, std::int64_t key) const noexcept {
    return (part_visible<P>(r, key) && ...);
  }
  KVATTN_HOST_DEVICE float sink(int head) const noexcept {
    float s = 0.0f;
    ((s = part_sink<P>(s, head)), ...);
    return s;
  }
  std::string check(const PolicyCall& c) const {
    std::string why;
    ((why = why.empty() ? static_cast<const P&>(*this).check(c) : why), ...);
    return why;
  }

 private:
  // Each part's hook where its flag is on; the running value passes through the others.
  template <class Q> KVATTN_HOST_DEVICE const Q& part() const noexcept { return static_cast<const Q&>(*this); }
  template <class Q> KVATTN_HOST_DEVICE std::int64_t part_first_key(std::int64_t first, const QueryRow& r) const noexcept {
    if constexpr (Q::kWindow) {
      const std::int64_t k = part<Q>().first_key(r);
      return k > first ? k : first;
    } else {
      return first;
    }
  }
  template <class Q> KVATTN_HOST_DEVICE float part_logit(float s, const QueryRow& r, float distance) const noexcept {
    if constexpr (Q::kLogits) return part<Q>().logit(s, r, distance);
    else return s;
  }
  template <class Q> KVATTN_HOST_DEVICE std::int64_t part_mask_from(std::int64_t from, const QueryRow& r) const noexcept {
    if constexpr (Q::kMask) {
      const std::int64_t k = part<Q>().mask_from(r);
      return k < from ? k : from;
    } else {
      return from;
    }
  }
  template <class Q> KVATTN_HOST_DEVICE bool part_visible(const QueryRow& r, std::int64_t key) const noexcept {
    if constexpr (Q::kMask) return key < part<Q>().mask_from(r) || part<Q>().visible(r, key);
    else return true;
  }
  template <class Q> KVATTN_HOST_DEVICE float part_sink(float s, int head) const noexcept {
    if constexpr (Q::kSink) return part<Q>().sink(head);
    else return s;
  }
};

/// The policies `p...` in one (see Compose).
template <class... P> constexpr Compose<P...> compose(const P&... p) { return Compose<P...>{p...}; }

// ---- how every kernel applies a policy ---------------------------------------------------------
// One definition of the semantics, for the CPU and the CUDA kernels: the causal mask (key <= pos)
// always; the window's first key from below; the logit, applied to the scaled score of a key the
// row sees; the mask, consulted only for keys from mask_from to the row's own position; and the
// sink, once per row, when its result is final.

/// A query row as a kernel keeps it: what the policy is told of it, and its bounds under the
/// policy (computed once per row, read for every key).
struct PolicyRow {
  QueryRow q;
  std::int64_t lo = 0;                  ///< the first key it may see (the window's; 0 without one)
  std::int64_t mask_from = INT64_MAX;  ///< the first key the policy's mask covers (none without a mask)
};
template <class P> KVATTN_HOST_DEVICE PolicyRow policy_row(const P& policy, const QueryRow& q) noexcept {
  PolicyRow r{q, 0, INT64_MAX};
  if constexpr (P::kWindow) r.lo = policy.first_key(q);
  if constexpr (P::kMask) r.mask_from = policy.mask_from(q);
  (void)policy;
  return r;
}
/// Whether the row sees key `key`.
template <class P> KVATTN_HOST_DEVICE bool sees(const P& policy, const PolicyRow& r, std::int64_t key) noexcept {
  if (key > r.q.pos) return false;
  if constexpr (P::kWindow)
    if (key < r.lo) return false;
  if constexpr (P::kMask)
    if (key >= r.mask_from && !policy.visible(r.q, key)) return false;
  (void)policy;
  return true;
}
/// The logit of key `key` from its scaled score s.
template <class P> KVATTN_HOST_DEVICE float policy_logit(const P& policy, const PolicyRow& r, float s, std::int64_t key) noexcept {
  if constexpr (P::kLogits) return policy.logit(s, r.q, static_cast<float>(key - r.q.pos));
  (void)policy;
  (void)r;
  (void)key;
  return s;
}
/// The factor a row's normalized output is multiplied by once the policy's sink (if it has one)
/// joins its final state (add_sink, state.hpp): 1 without a sink.
template <class P> KVATTN_HOST_DEVICE float sink_factor(const P& policy, SoftmaxStats& s, int head) noexcept {
  if constexpr (P::kSink) return add_sink(s, policy.sink(head));
  (void)policy;
  (void)s;
  (void)head;
  return 1.0f;
}

/// Whether P is a score policy (it has the four flags and check()).
template <class P, class = void> struct is_policy : std::false_type {};
template <class P>
struct is_policy<P, std::void_t<decltype(P::kWindow), decltype(P::kLogits), decltype(P::kMask), decltype(P::kSink),
                                decltype(std::declval<const P&>().check(std::declval<const PolicyCall&>()))>>
    : std::true_type {};
template <class P> inline constexpr bool is_policy_v = is_policy<P>::value;

/// Checks `policy` against a call and throws kvattn::invalid_argument naming the operator `op`
/// and the values when it does not fit.
template <class P> void check_policy(const char* op, const P& policy, const PolicyCall& call) {
  static_assert(is_policy_v<P>, "kvattn: not a score policy (see kvattn/policy.hpp)");
  if (std::string why = policy.check(call); !why.empty()) raise<invalid_argument>(detail::concat(op, ": ", why));
}

}  // namespace kvattn
