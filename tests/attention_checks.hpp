// tests/attention_checks.hpp — the comparisons every attention test makes against reference.hpp,
// with the element-wise bounds stated at the top of test_decode.cpp and test_prefill.cpp, the
// random prompts the prefill tests feed, and the decode cases (cache, queries, parameters) the
// decode tests of every backend share.
#pragma once

#include <kvattn/decode.hpp>
#include <kvattn/paged_cache.hpp>
#include <kvattn/shape.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "policy_checks.hpp"
#include "reference.hpp"

namespace checks {

/// One prompt's inputs, entries uniform in [-1, 1] (queries times q_scale).
struct Prompt {
  std::vector<float> q, k, v;  // [tokens][heads][dim]
};

inline Prompt random_prompt(const kvattn::GqaShape& s, std::int64_t tokens, unsigned seed, float q_scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Prompt p;
  p.q.resize(static_cast<std::size_t>(tokens) * s.q_heads * s.head_dim);
  p.k.resize(static_cast<std::size_t>(tokens) * s.kv_heads * s.head_dim);
  p.v.resize(p.k.size());
  for (auto& x : p.q) x = dist(rng) * q_scale;
  for (auto& x : p.k) x = dist(rng);
  for (auto& x : p.v) x = dist(rng);
  return p;
}

/// Element-wise |got − ref| <= abs + rel · |ref|; an infinite reference must be matched exactly.
inline void expect_close(const std::vector<float>& got, const std::vector<double>& ref, double abs, double rel,
                         const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const bool ok = std::isinf(ref[i]) ? got[i] == ref[i] : std::abs(got[i] - ref[i]) <= abs + rel * std::abs(ref[i]);
    if (!ok && bad++ < 5) ADD_FAILURE() << what << " element " << i << ": got " << got[i] << ", reference " << ref[i];
  }
}
/// Outputs (values in [-1, 1]); e_s: one fp32 score's rounding.
inline void expect_out_close(const std::vector<float>& got, const std::vector<double>& ref, const std::string& what, double e_s = 0) {
  expect_close(got, ref, (2e-5 + 2 * e_s) * 1.0 /* max|v| */, 2e-5, what);
}
inline void expect_lse_close(const std::vector<float>& got, const std::vector<double>& ref, const std::string& what, double e_s = 0) {
  expect_close(got, ref, 2e-5 + e_s, 2e-5, what);
}

/// decode()'s out [B][Q][q_heads][D] and lse [B][Q][q_heads] for q of the same shape against the
/// reference, sequence by sequence (options(b): sequence b's variant): |out − ref| <=
/// (2e-5 + 2·e_s)·vmax + 2e-5·|ref| and |lse − ref| <= 2e-5·(1 + |ref|) + e_s (an infinite lse
/// matched exactly).
template <class T, class Options>
void expect_decode_matches(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                           const kvattn::GqaShape& shape, const std::vector<float>& q, const std::vector<float>& out,
                           const std::vector<float>& lse, Options&& options, double vmax, double e_s) {
  const std::size_t H = static_cast<std::size_t>(shape.q_heads), D = static_cast<std::size_t>(shape.head_dim);
  std::vector<double> ref, ref_lse;
  int reported = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const reference::Options o = options(b);
    const std::size_t Q = static_cast<std::size_t>(o.queries_per_seq);
    reference::decode(cache, seqs[b], 0, shape, q.data() + b * Q * H * D, o, ref, ref_lse);
    for (std::size_t j = 0; j < ref.size(); ++j) {
      const float got = out[b * Q * H * D + j];
      const double bound = (2e-5 + 2 * e_s) * vmax + 2e-5 * std::abs(ref[j]);
      if (!(std::abs(got - ref[j]) <= bound) && reported++ < 5)
        ADD_FAILURE() << "b=" << b << " element " << j << ": got " << got << ", reference " << ref[j] << ", bound " << bound;
    }
    for (std::size_t j = 0; j < ref_lse.size(); ++j) {
      const float got = lse[b * Q * H + j];
      const double r = ref_lse[j];
      const bool ok = std::isinf(r) ? got == -std::numeric_limits<float>::infinity() : std::abs(got - r) <= 2e-5 * (1 + std::abs(r)) + e_s;
      if (!ok && reported++ < 5) ADD_FAILURE() << "b=" << b << " lse " << j << ": got " << got << ", reference " << r;
    }
  }
}

// ---- decode cases ----------------------------------------------------------------------------

/// One decode test: the head layout, the cache's page size, the batch's sequence lengths, and
/// the operator's parameters (window and soft_cap: the values of the policies that use them).
struct DecodeCase {
  kvattn::GqaShape shape;
  int page_size;
  std::vector<std::int64_t> lengths;
  int queries = 1;
  std::int64_t window = 0;
  float soft_cap = 0.0f;
  std::int64_t chunk = 0;
  float q_scale = 1.0f;  // multiplies the queries: large values make large logits
};

inline std::string describe(const DecodeCase& c) {
  std::string s = kvattn::detail::concat("q_heads=", c.shape.q_heads, " kv_heads=", c.shape.kv_heads,
                                         " head_dim=", c.shape.head_dim, " page=", c.page_size, " Q=", c.queries,
                                         " window=", c.window, " cap=", c.soft_cap, " chunk=", c.chunk, " lengths=");
  for (auto l : c.lengths) s += std::to_string(l) + ",";
  return s;
}

/// The case's DecodeParams.
inline kvattn::DecodeParams decode_params(const DecodeCase& c) {
  kvattn::DecodeParams p;
  p.queries_per_seq = c.queries;
  p.chunk_tokens = c.chunk;
  return p;
}

/// The values of every policy for the case's call (policy_checks::Values), from its seed.
inline policy_checks::Values policy_values(const DecodeCase& c) {
  return policy_checks::Values(c.shape.q_heads, policy_checks::uniform_indptr(c.lengths.size(), c.queries), c.window,
                               c.soft_cap, static_cast<unsigned>(c.lengths.size() * 31 + c.shape.q_heads));
}

/// Scales for a cache of `layers` layers of format T: for a format with one scale per layer
/// (fp8_e4m3_layer), a key and a value scale that map keys and values in [-1, 1] to most of its
/// range: 1 to codes 288 and 208, so that no value reads back larger than 1 (the bounds' max|k|
/// and max|v|), and the two scales differ and are not powers of two (a scale applied twice, or
/// to the wrong side, shows); none for the other formats.
template <class T> std::vector<kvattn::KvScales> test_scales(int layers = 1) {
  if constexpr (kvattn::format_traits<T>::layer_scale)
    return std::vector<kvattn::KvScales>(static_cast<std::size_t>(layers), kvattn::KvScales{1.0f / 288, 1.0f / 208});
  else
    return {};
}

/// A one-layer cache holding the case's sequences, keys and values uniform in [-1, 1], and the
/// queries q [batch][Q][q_heads][head_dim] (uniform in [-1, 1] times q_scale).
template <class T> struct DecodeInputs {
  kvattn::PagedKvCache<T> cache;
  std::vector<kvattn::SeqId> seqs;
  std::vector<float> q;
  float vmax = 0;  // max |v|

  explicit DecodeInputs(const DecodeCase& c) : cache(config(c), test_scales<T>()) {
    std::mt19937 rng(static_cast<unsigned>(c.lengths.size() * 131 + c.shape.head_dim));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const int G = c.shape.kv_heads, D = c.shape.head_dim, H = c.shape.q_heads;
    for (auto L : c.lengths) {
      const kvattn::SeqId s = cache.add_sequence();
      seqs.push_back(s);
      if (L == 0) continue;
      cache.append(s, L);
      std::vector<float> k(static_cast<std::size_t>(L) * G * D), v(k.size());  // [L][kv_heads][head_dim]
      for (auto& x : k) x = dist(rng);
      for (auto& x : v) x = dist(rng), vmax = std::max(vmax, std::abs(x));
      cache.write(s, 0, 0, L, k.data(), v.data());
    }
    q.resize(seqs.size() * static_cast<std::size_t>(c.queries) * H * D);
    for (auto& x : q) x = dist(rng) * c.q_scale;
  }

  /// Outputs of the right sizes, filled with a value no kernel would write.
  std::vector<float> out() const { return std::vector<float>(q.size(), 123.0f); }
  std::vector<float> lse(const DecodeCase& c) const {
    return std::vector<float>(seqs.size() * static_cast<std::size_t>(c.queries) * c.shape.q_heads, 123.0f);
  }

 private:
  static kvattn::CacheConfig config(const DecodeCase& c) {
    std::int64_t pages = 0;
    for (auto l : c.lengths) pages += (l + c.page_size - 1) / c.page_size;
    return kvattn::CacheConfig{1, c.page_size, std::max<std::int64_t>(1, pages), c.shape};
  }
};

/// expect_decode_matches for a case run with policy P of `values`: the reference's options, max|v|
/// and score rounding.
template <class P, class T>
void expect_decode_case_matches(const DecodeInputs<T>& in, const DecodeCase& c, const policy_checks::Values& values,
                                const std::vector<float>& out, const std::vector<float>& lse) {
  const double e_s = std::ldexp(1.0, -23) * c.q_scale * std::sqrt(double(c.shape.head_dim));  // scale · D = sqrt(D)
  expect_decode_matches(in.cache, in.seqs, c.shape, in.q, out, lse,
                        [&](std::size_t b) { return policy_checks::options<P>(values, b); }, in.vmax, e_s);
}

/// Runs case `c` in format T with policy P (its values from the case) through
/// decode(view, q, out, lse, plan, pf, policy), the plan made for `pf`'s threads, and checks it
/// against the reference. `decode` is the operator under test (kvattn::decode with an ISA tag,
/// kvattn::kernels::decode, ...).
template <class T, class P, class PF, class Decode> void check_decode_case(const DecodeCase& c, PF& pf, Decode&& decode) {
  const DecodeInputs<T> in(c);
  std::vector<float> out = in.out(), lse = in.lse(c);
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  const policy_checks::Values values = policy_values(c);
  kvattn::DecodePlan plan;
  plan.make(in.cache.view(table, 0), c.shape, decode_params(c), pf);
  decode(in.cache.view(table, 0), in.q.data(), out.data(), lse.data(), plan, pf, policy_checks::make<P>(values));
  expect_decode_case_matches<P>(in, c, values, out, lse);
}

}  // namespace checks
