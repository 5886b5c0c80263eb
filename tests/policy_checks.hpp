// tests/policy_checks.hpp — the score policies the attention tests run (kvattn/policy.hpp), built
// from one set of values, and the reference's description of the same policy (reference.hpp):
// the policy type says which of the values apply, so a test cannot run one variant and check
// another.
#pragma once

#include <kvattn/policy.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "reference.hpp"

namespace policy_checks {

/// Every policy's parameters for one call: a window, a cap, ALiBi slopes and sink logits per query
/// head, and a random draft tree per sequence over its new tokens.
struct Values {
  std::int64_t window = 0;
  float soft_cap = 0.0f;
  int q_heads = 0;
  std::vector<float> slopes;         // [q_heads] alibi_slopes(q_heads)
  std::vector<float> sinks;          // [q_heads] uniform in [-1, 3]
  std::vector<std::uint64_t> tree;   // [rows] row i of a sequence sees its own token and its ancestors'
  std::vector<std::int64_t> q_indptr;  // [batch + 1] each sequence's query rows

  /// q_indptr: the call's query rows, sequence by sequence (each at most 64 when a tree is used).
  Values(int heads, std::vector<std::int64_t> indptr, std::int64_t w, float cap, unsigned seed)
      : window(w), soft_cap(cap), q_heads(heads), slopes(kvattn::alibi_slopes(heads)), q_indptr(std::move(indptr)) {
    std::mt19937 rng(seed * 7919u + 17u);
    std::uniform_real_distribution<float> sink(-1.0f, 3.0f);
    for (int h = 0; h < heads; ++h) sinks.push_back(sink(rng));
    tree.assign(static_cast<std::size_t>(q_indptr.back()), 0);
    for (std::size_t b = 0; b + 1 < q_indptr.size(); ++b) {
      const std::int64_t first = q_indptr[b], n = q_indptr[b + 1] - first;
      for (std::int64_t i = 0; i < n && i < 64; ++i) {  // parent: the prefix (-1) or an earlier new token
        const std::int64_t parent = std::uniform_int_distribution<std::int64_t>(-1, i - 1)(rng);
        tree[static_cast<std::size_t>(first + i)] =
            (parent < 0 ? 0 : tree[static_cast<std::size_t>(first + parent)]) | (std::uint64_t{1} << i);
      }
    }
  }
};

/// Whether policy P has the part Part.
template <class P, class Part> struct uses : std::is_same<P, Part> {};
template <class... Ps, class Part> struct uses<kvattn::Compose<Ps...>, Part> : std::disjunction<std::is_same<Ps, Part>...> {};
template <class P, class Part> inline constexpr bool uses_v = uses<P, Part>::value;

template <class P> struct maker;
template <> struct maker<kvattn::Plain> {
  static kvattn::Plain make(const Values&) { return {}; }
};
template <> struct maker<kvattn::SlidingWindow> {
  static kvattn::SlidingWindow make(const Values& v) { return {v.window}; }
};
template <> struct maker<kvattn::SoftCap> {
  static kvattn::SoftCap make(const Values& v) { return {v.soft_cap}; }
};
template <> struct maker<kvattn::Alibi> {
  static kvattn::Alibi make(const Values& v) { return {v.slopes.data(), v.q_heads}; }
};
template <> struct maker<kvattn::Sinks> {
  static kvattn::Sinks make(const Values& v) { return {v.sinks.data(), v.q_heads}; }
};
template <> struct maker<kvattn::TreeMask> {
  static kvattn::TreeMask make(const Values& v) { return {v.tree.data(), static_cast<std::int64_t>(v.tree.size())}; }
};
template <class... Ps> struct maker<kvattn::Compose<Ps...>> {
  static kvattn::Compose<Ps...> make(const Values& v) { return kvattn::Compose<Ps...>{maker<Ps>::make(v)...}; }
};

/// The policy P with the values it uses.
template <class P> P make(const Values& v) { return maker<P>::make(v); }

/// The reference's options for sequence b of the call under policy P (queries_per_seq: b's rows).
template <class P> reference::Options options(const Values& v, std::size_t b) {
  reference::Options o;
  o.queries_per_seq = static_cast<int>(v.q_indptr[b + 1] - v.q_indptr[b]);
  if constexpr (uses_v<P, kvattn::SlidingWindow>) o.window = v.window;
  if constexpr (uses_v<P, kvattn::SoftCap>) o.soft_cap = v.soft_cap;
  if constexpr (uses_v<P, kvattn::Alibi>) o.alibi = v.slopes.data();
  if constexpr (uses_v<P, kvattn::Sinks>) o.sinks = v.sinks.data();
  if constexpr (uses_v<P, kvattn::TreeMask>) o.tree = v.tree.data() + v.q_indptr[b];
  return o;
}

/// Q rows per sequence for `batch` sequences: the q_indptr of a decode call.
inline std::vector<std::int64_t> uniform_indptr(std::size_t batch, int Q) {
  std::vector<std::int64_t> p(batch + 1);
  for (std::size_t b = 0; b <= batch; ++b) p[b] = static_cast<std::int64_t>(b) * Q;
  return p;
}

}  // namespace policy_checks
