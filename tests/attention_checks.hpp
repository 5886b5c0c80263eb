// tests/attention_checks.hpp — the comparisons every attention test makes against reference.hpp,
// with the element-wise bounds stated at the top of test_decode.cpp and test_prefill.cpp, and
// the random prompts the prefill tests feed.
#pragma once

#include <kvattn/paged_cache.hpp>
#include <kvattn/shape.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

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
/// reference, sequence by sequence: |out − ref| <= (2e-5 + 2·e_s)·vmax + 2e-5·|ref| and
/// |lse − ref| <= 2e-5·(1 + |ref|) + e_s (an infinite lse matched exactly).
template <class T>
void expect_decode_matches(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                           const kvattn::GqaShape& shape, const std::vector<float>& q, const std::vector<float>& out,
                           const std::vector<float>& lse, const reference::Options& o, double vmax, double e_s) {
  const std::size_t Q = static_cast<std::size_t>(o.queries_per_seq), H = static_cast<std::size_t>(shape.q_heads),
                    D = static_cast<std::size_t>(shape.head_dim);
  std::vector<double> ref, ref_lse;
  int reported = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
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

}  // namespace checks
