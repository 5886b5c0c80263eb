// tests/reference.hpp — plain double-precision attention, the oracle every kernel is tested
// against. It reads the same rounded keys and values the kernel reads (through the cache's own
// read()), so the only differences left are the kernel's fp32 arithmetic.
#pragma once

#include <kvattn/paged_cache.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace reference {

struct Options {
  int queries_per_seq = 1;
  double scale = 0.0;         // 0: 1/sqrt(head_dim)
  std::int64_t window = 0;    // 0: none
  double soft_cap = 0.0;      // 0: none
};

/// out [Q][q_heads][head_dim] and lse [Q][q_heads] of one sequence, q [Q][q_heads][head_dim].
template <class T>
void decode(const kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, int layer, const kvattn::GqaShape& shape,
            const float* q, const Options& o, std::vector<double>& out, std::vector<double>& lse) {
  const int Q = o.queries_per_seq, D = shape.head_dim, H = shape.q_heads, G = shape.kv_heads;
  const std::int64_t L = cache.length(seq);
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<float> k(static_cast<std::size_t>(L) * G * D), v(k.size());
  for (std::int64_t t = 0; t < L; ++t) cache.read(seq, layer, t, &k[static_cast<std::size_t>(t * G * D)], &v[static_cast<std::size_t>(t * G * D)]);
  out.assign(static_cast<std::size_t>(Q) * H * D, 0.0);
  lse.assign(static_cast<std::size_t>(Q) * H, -std::numeric_limits<double>::infinity());
  std::vector<double> s(static_cast<std::size_t>(L));
  for (int i = 0; i < Q; ++i) {
    const std::int64_t qpos = L - Q + i;
    for (int h = 0; h < H; ++h) {
      const int g = shape.kv_head_of(h);
      const float* qv = q + (static_cast<std::int64_t>(i) * H + h) * D;
      double m = -std::numeric_limits<double>::infinity();
      for (std::int64_t t = 0; t < L; ++t) {
        const bool visible = t <= qpos && (o.window == 0 || t > qpos - o.window);
        if (!visible) {
          s[static_cast<std::size_t>(t)] = -std::numeric_limits<double>::infinity();
          continue;
        }
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(qv[d]) * k[static_cast<std::size_t>((t * G + g) * D + d)];
        double score = dot * scale;
        if (o.soft_cap > 0) score = o.soft_cap * std::tanh(score / o.soft_cap);
        s[static_cast<std::size_t>(t)] = score;
        m = std::max(m, score);
      }
      if (m == -std::numeric_limits<double>::infinity()) continue;  // sees nothing: zeros, lse -inf
      double sum = 0;
      double* ov = &out[static_cast<std::size_t>((static_cast<std::int64_t>(i) * H + h) * D)];
      for (std::int64_t t = 0; t < L; ++t) {
        const double w = std::exp(s[static_cast<std::size_t>(t)] - m);
        if (w == 0) continue;
        sum += w;
        for (int d = 0; d < D; ++d) ov[d] += w * v[static_cast<std::size_t>((t * G + g) * D + d)];
      }
      for (int d = 0; d < D; ++d) ov[d] /= sum;
      lse[static_cast<std::size_t>(i * H + h)] = m + std::log(sum);
    }
  }
}

}  // namespace reference
