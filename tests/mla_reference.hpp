// tests/mla_reference.hpp — MLA decode attention in latent space in plain double precision,
// and the comparison test_mla and test_x86_isas make against it. It reads the same rounded
// latents and rotary keys the kernel reads (through the cache's read_latent), so the only
// differences left are the kernel's fp32 arithmetic.
//
// Bounds, element-wise, as the GQA decode tests': |out − ref| <= (2e-5 + 2·e_s) · max|c| +
// 2e-5 · |ref| and |lse − ref| <= 2e-5 · (1 + |ref|) + e_s, with e_s = 2^-23 · scale ·
// (latent_dim + rope_dim) · max|q| · max|c| the rounding of one fp32 score (max|c| = 1 here).
#pragma once

#include <kvattn/error.hpp>
#include <kvattn/mla_decode.hpp>
#include <kvattn/paged_cache.hpp>
#include <kvattn/shape.hpp>

#include <gtest/gtest.h>

#include "policy_checks.hpp"
#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace reference {

/// out [Q][heads][latent_dim], lse [Q][heads] of one sequence; q [Q][heads][latent_dim + rope_dim];
/// the variant (and Q) in `o` (o.scale must be set).
template <class T>
void mla_attention(const kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, const kvattn::MlaShape& s, const float* q,
                   const Options& o, std::vector<double>& out, std::vector<double>& lse) {
  const int Q = o.queries_per_seq, H = s.heads, Dc = s.latent_dim, K = s.latent_dim + s.rope_dim;
  const std::int64_t L = cache.length(seq);
  std::vector<float> rows(static_cast<std::size_t>(L * K));
  for (std::int64_t t = 0; t < L; ++t) cache.read_latent(seq, 0, t, &rows[t * K], &rows[t * K + Dc]);
  out.assign(static_cast<std::size_t>(Q) * H * Dc, 0.0);
  lse.assign(static_cast<std::size_t>(Q) * H, -std::numeric_limits<double>::infinity());
  std::vector<double> sc(static_cast<std::size_t>(L));
  for (int i = 0; i < Q; ++i) {
    const std::int64_t qpos = L - Q + i;
    for (int h = 0; h < H; ++h) {
      const float* qv = q + (std::int64_t{i} * H + h) * K;
      for (std::int64_t t = 0; t < L; ++t) {
        double dot = 0;
        for (int k = 0; k < K; ++k) dot += double(qv[k]) * rows[t * K + k];
        sc[t] = logit(o, dot * o.scale, h, i, qpos, L - Q, t);
      }
      lse[std::size_t(i) * H + h] =
          softmax_row(o, h, sc, Dc, &out[(std::size_t(i) * H + h) * Dc], [&](std::int64_t t, int c) { return double(rows[t * K + c]); });
    }
  }
}

}  // namespace reference

namespace checks {

/// mla_decode's out [B][Q][heads][latent_dim] and lse [B][Q][heads] for q [B][Q][heads][K] of
/// entries at most q_scale, latents at most 1, default scale, against reference::mla_attention
/// with sequence b's variant options(b) (its queries_per_seq is Q).
template <class T, class Options>
void expect_mla_decode_matches(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                               const kvattn::MlaShape& s, const std::vector<float>& q, int Q, const std::vector<float>& out,
                               const std::vector<float>& lse, double q_scale, Options&& options) {
  const std::size_t H = static_cast<std::size_t>(s.heads), Dc = static_cast<std::size_t>(s.latent_dim),
                    K = Dc + static_cast<std::size_t>(s.rope_dim);
  const double scale = 1.0 / std::sqrt(double(s.qk_head_dim()));
  const double e_s = std::ldexp(1.0, -23) * scale * double(K) * q_scale;
  std::vector<double> ref, ref_lse;
  int reported = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    reference::Options o = options(b);
    o.scale = scale;
    reference::mla_attention(cache, seqs[b], s, q.data() + b * Q * H * K, o, ref, ref_lse);
    for (std::size_t j = 0; j < ref.size(); ++j) {
      const float got = out[b * Q * H * Dc + j];
      const double bound = (2e-5 + 2 * e_s) + 2e-5 * std::abs(ref[j]);
      if (!(std::abs(got - ref[j]) <= bound) && reported++ < 5)
        ADD_FAILURE() << "b=" << b << " out element " << j << ": got " << got << ", reference " << ref[j];
    }
    for (std::size_t j = 0; j < ref_lse.size(); ++j) {
      const float got = lse[b * Q * H + j];
      const double r = ref_lse[j];
      const bool ok = std::isinf(r) ? got == r : std::abs(got - r) <= 2e-5 * (1 + std::abs(r)) + e_s;
      if (!ok && reported++ < 5) ADD_FAILURE() << "b=" << b << " lse " << j << ": got " << got << ", reference " << r;
    }
  }
}

// ---- MLA decode cases ------------------------------------------------------------------------

/// n values uniform in [-1, 1) times `scale`, from `seed`.
inline std::vector<float> uniform(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng) * scale;
  return v;
}

/// One MLA decode test: the head layout, the cache's page size, the batch's sequence lengths,
/// and the operator's parameters (window and soft_cap: the values of the policies that use them).
struct MlaCase {
  kvattn::MlaShape shape;
  int page_size;
  std::vector<std::int64_t> lengths;
  int queries = 1;
  float q_scale = 1.0f;
  std::int64_t chunk_tokens = 0;
  std::int64_t window = 0;
  float soft_cap = 0.0f;
};

inline std::string describe(const MlaCase& c) {
  std::string l;
  for (auto n : c.lengths) l += std::to_string(n) + ",";
  return kvattn::detail::concat("heads=", c.shape.heads, " latent=", c.shape.latent_dim, " rope=", c.shape.rope_dim,
                                " page=", c.page_size, " Q=", c.queries, " q_scale=", c.q_scale, " chunk=", c.chunk_tokens,
                                " lengths=", l);
}

/// The case's DecodeParams.
inline kvattn::DecodeParams mla_params(const MlaCase& c) {
  kvattn::DecodeParams p;
  p.queries_per_seq = c.queries;
  p.chunk_tokens = c.chunk_tokens;
  return p;
}

/// The values of every policy for the case's call (policy_checks::Values), from its seed.
inline policy_checks::Values policy_values(const MlaCase& c) {
  return policy_checks::Values(c.shape.heads, policy_checks::uniform_indptr(c.lengths.size(), c.queries), c.window, c.soft_cap,
                               static_cast<unsigned>(c.lengths.size() * 17 + c.shape.heads));
}

/// A one-layer cache holding random latent rows (uniform in [-1, 1)) for each of the case's
/// lengths, and the absorbed queries q [batch][Q][heads][latent_dim + rope_dim] (times q_scale).
template <class T> struct MlaInputs {
  kvattn::PagedKvCache<T> cache;
  std::vector<kvattn::SeqId> seqs;
  std::vector<float> q;

  MlaInputs(const MlaCase& c, unsigned seed) : cache(config(c)) {
    const kvattn::MlaShape& s = c.shape;
    unsigned salt = seed;
    for (auto n : c.lengths) {
      seqs.push_back(cache.add_sequence());
      if (n == 0) continue;
      cache.append(seqs.back(), n);
      const auto lat = uniform(std::size_t(n) * s.latent_dim, ++salt), rope = uniform(std::size_t(n) * s.rope_dim, ++salt);
      cache.write_latent(seqs.back(), 0, 0, n, lat.data(), rope.data());
    }
    const std::size_t K = std::size_t(s.latent_dim) + s.rope_dim;
    q = uniform(seqs.size() * c.queries * s.heads * K, ++salt, c.q_scale);
  }

 private:
  static kvattn::CacheConfig config(const MlaCase& c) {
    std::int64_t pages = 0;
    for (auto n : c.lengths) pages += (n + c.page_size - 1) / c.page_size;
    return kvattn::CacheConfig{1, c.page_size, std::max<std::int64_t>(1, pages), c.shape};
  }
};

/// Runs case `c` in format T with policy P (its values from the case) through
/// mla_decode(view, q, out, lse, plan, pf, policy) on MlaInputs(c, seed), the plan made for `pf`'s
/// threads, and checks it against the reference; returns the output (for comparisons between
/// runs). `mla_decode` is the operator under test (kvattn::mla_decode with an ISA tag,
/// kvattn::kernels::mla_decode).
template <class T, class P, class PF, class MlaDecode>
std::vector<float> check_mla_case(const MlaCase& c, unsigned seed, PF& pf, MlaDecode&& mla_decode) {
  const MlaInputs<T> in(c, seed);
  const kvattn::MlaShape& s = c.shape;
  const std::size_t rows = in.seqs.size() * c.queries * s.heads;
  std::vector<float> out(rows * s.latent_dim, -7.0f), lse(rows, -7.0f);
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  const policy_checks::Values values = policy_values(c);
  kvattn::DecodePlan plan;
  plan.make(in.cache.view(table, 0), s, mla_params(c), pf);
  mla_decode(in.cache.view(table, 0), in.q.data(), out.data(), lse.data(), plan, pf, policy_checks::make<P>(values));
  expect_mla_decode_matches(in.cache, in.seqs, s, in.q, c.queries, out, lse, c.q_scale,
                            [&](std::size_t b) { return policy_checks::options<P>(values, b); });
  return out;
}

}  // namespace checks
