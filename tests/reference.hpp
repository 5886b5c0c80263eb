// tests/reference.hpp — plain double-precision attention, the oracle every kernel is tested
// against. It reads the same rounded keys and values the kernel reads (through the cache's own
// read()), so the only differences left are the kernel's fp32 arithmetic. Every score policy of
// kvattn/policy.hpp is written here again, as the math, in double: the window, the soft-cap then
// the ALiBi bias, the tree mask, and the sink in the denominator.
#pragma once

#include <kvattn/paged_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace reference {

/// The variant of attention of one sequence's call.
struct Options {
  int queries_per_seq = 1;               // Q: the sequence's last Q tokens are the queries
  double scale = 0.0;                    // 0: 1/sqrt(head_dim)
  std::int64_t window = 0;               // 0: none
  double soft_cap = 0.0;                 // 0: none
  const float* alibi = nullptr;          // [q_heads] slopes; null: none (applied after the soft-cap)
  const float* sinks = nullptr;          // [q_heads] sink logits; null: none
  const std::uint64_t* tree = nullptr;   // [Q] this sequence's rows of a tree mask; null: none
};

/// The logit query i (of Q, at position qpos, head h) gives key position t from its scaled dot
/// product, or -inf where the variant hides the key. first_new: the position of the first query.
inline double logit(const Options& o, double scaled, int h, int i, std::int64_t qpos, std::int64_t first_new, std::int64_t t) {
  constexpr double kHidden = -std::numeric_limits<double>::infinity();
  if (t > qpos) return kHidden;
  if (o.window > 0 && t <= qpos - o.window) return kHidden;
  if (o.tree != nullptr && t >= first_new && ((o.tree[i] >> (t - first_new)) & 1u) == 0) return kHidden;
  double s = scaled;
  if (o.soft_cap > 0) s = o.soft_cap * std::tanh(s / o.soft_cap);
  if (o.alibi != nullptr) s += double(o.alibi[h]) * double(t - qpos);
  return s;
}

/// Softmax of one row's logits s [L] (-inf: hidden) with head h's sink: out[c] = Σ_t p_t v(t)[c],
/// returns the log-sum-exp (the sink counted); a row that sees nothing and has no sink gets
/// zeros and -inf. value(t, c): the value of key t at column c.
template <class Value>
double softmax_row(const Options& o, int h, const std::vector<double>& s, int width, double* out, Value&& value) {
  double m = -std::numeric_limits<double>::infinity();
  for (double x : s) m = std::max(m, x);
  const double sink = o.sinks != nullptr ? double(o.sinks[h]) : -std::numeric_limits<double>::infinity();
  const double top = std::max(m, sink);
  if (top == -std::numeric_limits<double>::infinity()) return top;
  double sum = std::exp(sink - top);
  for (std::size_t t = 0; t < s.size(); ++t) {
    const double w = std::exp(s[t] - top);
    if (w == 0) continue;
    sum += w;
    for (int c = 0; c < width; ++c) out[c] += w * value(static_cast<std::int64_t>(t), c);
  }
  for (int c = 0; c < width; ++c) out[c] /= sum;
  return top + std::log(sum);
}

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
      for (std::int64_t t = 0; t < L; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(qv[d]) * k[static_cast<std::size_t>((t * G + g) * D + d)];
        s[static_cast<std::size_t>(t)] = logit(o, dot * scale, h, i, qpos, L - Q, t);
      }
      double* ov = &out[static_cast<std::size_t>((static_cast<std::int64_t>(i) * H + h) * D)];
      lse[static_cast<std::size_t>(i * H + h)] =
          softmax_row(o, h, s, D, ov, [&](std::int64_t t, int c) { return double(v[static_cast<std::size_t>((t * G + g) * D + c)]); });
    }
  }
}

}  // namespace reference
