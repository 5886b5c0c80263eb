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

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace reference {

/// out [Q][heads][latent_dim], lse [Q][heads] of one sequence; q [Q][heads][latent_dim + rope_dim].
template <class T>
void mla_attention(const kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, const kvattn::MlaShape& s, const float* q,
                   int Q, double scale, std::vector<double>& out, std::vector<double>& lse) {
  const int H = s.heads, Dc = s.latent_dim, K = s.latent_dim + s.rope_dim;
  const std::int64_t L = cache.length(seq);
  std::vector<float> rows(static_cast<std::size_t>(L * K));
  for (std::int64_t t = 0; t < L; ++t) cache.read_latent(seq, 0, t, &rows[t * K], &rows[t * K + Dc]);
  out.assign(static_cast<std::size_t>(Q) * H * Dc, 0.0);
  lse.assign(static_cast<std::size_t>(Q) * H, -std::numeric_limits<double>::infinity());
  std::vector<double> sc(static_cast<std::size_t>(L));
  for (int i = 0; i < Q; ++i) {
    const std::int64_t seen = L - Q + i + 1;  // positions 0 .. L − Q + i
    for (int h = 0; h < H; ++h) {
      const float* qv = q + (std::int64_t{i} * H + h) * K;
      double m = -std::numeric_limits<double>::infinity();
      for (std::int64_t t = 0; t < seen; ++t) {
        double dot = 0;
        for (int k = 0; k < K; ++k) dot += double(qv[k]) * rows[t * K + k];
        sc[t] = dot * scale;
        m = std::max(m, sc[t]);
      }
      if (seen <= 0) continue;
      double d = 0;
      double* o = &out[(std::size_t(i) * H + h) * Dc];
      for (std::int64_t t = 0; t < seen; ++t) {
        const double p = std::exp(sc[t] - m);
        d += p;
        for (int c = 0; c < Dc; ++c) o[c] += p * rows[t * K + c];
      }
      for (int c = 0; c < Dc; ++c) o[c] /= d;
      lse[std::size_t(i) * H + h] = m + std::log(d);
    }
  }
}

}  // namespace reference

namespace checks {

/// mla_decode's out [B][Q][heads][latent_dim] and lse [B][Q][heads] for q [B][Q][heads][K] of
/// entries at most q_scale, latents at most 1, default scale, against reference::mla_attention.
template <class T>
void expect_mla_decode_matches(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                               const kvattn::MlaShape& s, const std::vector<float>& q, int Q, const std::vector<float>& out,
                               const std::vector<float>& lse, double q_scale) {
  const std::size_t H = static_cast<std::size_t>(s.heads), Dc = static_cast<std::size_t>(s.latent_dim),
                    K = Dc + static_cast<std::size_t>(s.rope_dim);
  const double scale = 1.0 / std::sqrt(double(s.qk_head_dim()));
  const double e_s = std::ldexp(1.0, -23) * scale * double(K) * q_scale;
  std::vector<double> ref, ref_lse;
  int reported = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    reference::mla_attention(cache, seqs[b], s, q.data() + b * Q * H * K, Q, scale, ref, ref_lse);
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
/// and the operator's parameters.
struct MlaCase {
  kvattn::MlaShape shape;
  int page_size;
  std::vector<std::int64_t> lengths;
  int queries = 1;
  float q_scale = 1.0f;
  std::int64_t chunk_tokens = 0;
};

inline std::string describe(const MlaCase& c) {
  std::string l;
  for (auto n : c.lengths) l += std::to_string(n) + ",";
  return kvattn::detail::concat("heads=", c.shape.heads, " latent=", c.shape.latent_dim, " rope=", c.shape.rope_dim,
                                " page=", c.page_size, " Q=", c.queries, " q_scale=", c.q_scale, " chunk=", c.chunk_tokens,
                                " lengths=", l);
}

/// The case's MlaDecodeParams, for a parallel-for of `threads` threads.
inline kvattn::MlaDecodeParams mla_params(const MlaCase& c, int threads = 1) {
  kvattn::MlaDecodeParams p;
  p.queries_per_seq = c.queries;
  p.chunk_tokens = c.chunk_tokens;
  p.threads = threads;
  return p;
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

}  // namespace checks
