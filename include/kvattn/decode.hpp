// kvattn/decode.hpp — MHA / GQA / MQA decode attention over the paged cache.
//
// Each sequence b of the batch has L_b tokens in the cache, the last Q of which are its new
// tokens (Q = queries_per_seq: 1 for plain decode, a few for speculative verification). Query i
// of sequence b sits at position L_b - Q + i and attends causally to the positions at or before
// it (within the last `window` tokens when the variant has a sliding window):
//   out[b][i][h] = Σ_t softmax_t(scale · q[b][i][h] · K_t) V_t,   K, V of KV head h / group_size.
// All query heads of a group (and all Q queries) are computed together, so every key and value
// byte is read once per step. Long sequences are split into chunks of keys (split-KV) that are
// computed independently and merged through their log-sum-exp (state.hpp), so a single sequence
// uses every thread.
//
//   q    [batch][Q][q_heads][head_dim]  fp32
//   out  [batch][Q][q_heads][head_dim]  fp32
//   lse  [batch][Q][q_heads]            fp32, natural log, -inf for a row that sees no key; optional
// A row that sees no key (context shorter than its position) gets zeros, never NaN.
//
// Variants are compile-time: decode<Variant<true, false>> adds the sliding window,
// decode<Variant<false, true>> the logit soft-cap (score = cap · tanh(score / cap)); the plain
// kernel carries neither test.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "shape.hpp"
#include "simd.hpp"
#include "state.hpp"

namespace kvattn {

/// Compile-time attention variants.
template <bool SlidingWindow, bool SoftCap> struct Variant {
  static constexpr bool sliding_window = SlidingWindow;
  static constexpr bool soft_cap = SoftCap;
};
using Plain = Variant<false, false>;

struct DecodeParams {
  int queries_per_seq = 1;        ///< Q: new tokens per sequence, the last Q of its cache
  float scale = 0.0f;             ///< softmax scale; 0: 1 / sqrt(head_dim)
  std::int64_t window = 0;        ///< sliding window W (Variant<true, ...>): the last W positions, own included
  float soft_cap = 0.0f;          ///< soft-cap (Variant<..., true>), > 0
  std::int64_t chunk_tokens = 0;  ///< split-KV chunk length; 0: chosen from the work and `threads`
  int threads = 1;                ///< threads the parallel-for will use (for choosing chunks)
};

/// Scratch memory of decode(): its work items and their partial results. Keep one per concurrent
/// caller and reuse it across steps; it only grows. The fields belong to decode().
struct DecodeWorkspace {
  struct Item {
    std::int32_t seq, kv_head;
    std::int64_t begin, end;  ///< key positions [begin, end)
    std::int64_t partial;     ///< offset of this item's [rows][head_dim + 2] floats in `partial`
  };
  std::vector<Item> items;
  std::vector<std::int64_t> first_item;  ///< [batch + 1]: the items of sequence b
  std::vector<float> partial;

  std::size_t bytes() const noexcept {
    return items.capacity() * sizeof(Item) + first_item.capacity() * sizeof(std::int64_t) + partial.capacity() * sizeof(float);
  }
};

namespace detail {
/// The checks decode() and prefill() share: the head layout matches the cache's, and the
/// scale and the variant's parameters are usable. `op` names the caller in the message.
template <class V>
void check_attention_args(const char* op, const GqaShape& shape, const PageLayout& layout, float scale,
                          std::int64_t window, float soft_cap) {
  shape.validate();
  if (layout.content != PageContent::gqa || layout.kv_heads != shape.kv_heads || layout.head_dim != shape.head_dim)
    raise<shape_error>(concat(op, ": shape kv_heads=", shape.kv_heads, " head_dim=", shape.head_dim,
                              " does not match the cache's kv_heads=", layout.kv_heads, " head_dim=", layout.head_dim));
  if (!(std::isfinite(scale) && scale >= 0.0f))
    raise<invalid_argument>(concat(op, ": scale=", scale, ": must be finite and >= 0 (0: 1/sqrt(head_dim))"));
  if (V::sliding_window && window < 1)
    raise<invalid_argument>(concat(op, ": window=", window, ": a sliding window must hold at least 1 token"));
  if (V::soft_cap && !(soft_cap > 0.0f && std::isfinite(soft_cap)))
    raise<invalid_argument>(concat(op, ": soft_cap=", soft_cap, ": must be positive and finite"));
}
}  // namespace detail

KVATTN_BEGIN_TARGET_NAMESPACE
namespace decode_impl {  // (not "detail": that name is kvattn::detail's)

/// Tokens per tile: keys and values of a tile are loaded from memory once and then reused, from
/// the L1 cache, by every query row of the group.
inline constexpr int kDecodeTile = 16;
/// Query rows whose accumulators stay in registers together.
inline constexpr int kDecodeRowBlock = 8;

/// One tile of up to kDecodeTile tokens against NR query rows (NR compile-time: the
/// accumulators stay in registers). qr[r]: the row's query [dim]; qpos[r]: its position;
/// o[r]: its partial output [dim + 2].
template <class Isa, int D, int NR, class V, class T>
KVATTN_ALWAYS_INLINE void decode_tile(const T* const* keys, const T* const* values, const T* const* ahead, int n_ahead, std::int64_t value_minus_key, int n, std::int64_t t0, int dim,
                                      const float* const* qr, const std::int64_t* qpos, float* const* o, float scale,
                                      const DecodeParams& p) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  const int full = dim / W, tail = dim % W;
  float s[NR][kDecodeTile];
  for (int t = 0; t < n; ++t) {
    if (t < n_ahead) {  // the next tile's rows, one token per token of this tile
      const char* k = reinterpret_cast<const char*>(ahead[t]);
      const char* v = reinterpret_cast<const char*>(ahead[t] + value_minus_key);
      for (int b = 0; b < dim * static_cast<int>(sizeof(T)); b += 64) {
        KVATTN_PREFETCH(k + b);
        KVATTN_PREFETCH(v + b);
      }
    }
    Vec acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = Vec::zero();
    for (int c = 0; c < full; ++c) {
      const Vec k = Vec::load(keys[t] + c * W);
      for (int r = 0; r < NR; ++r) acc[r] = fma(Vec::load(qr[r] + c * W), k, acc[r]);
    }
    if (tail) {
      const Vec k = Vec::load_partial(keys[t] + full * W, tail);
      for (int r = 0; r < NR; ++r) acc[r] = fma(Vec::load_partial(qr[r] + full * W, tail), k, acc[r]);
    }
    const std::int64_t pos = t0 + t;
    for (int r = 0; r < NR; ++r) {
      float score = acc[r].reduce_add() * scale;
      if constexpr (V::soft_cap) score = p.soft_cap * std::tanh(score / p.soft_cap);
      bool visible = pos <= qpos[r];
      if constexpr (V::sliding_window) visible = visible && pos > qpos[r] - p.window;
      s[r][t] = visible ? score : -std::numeric_limits<float>::infinity();
    }
  }
  for (int r = 0; r < NR; ++r) {
    float* out = o[r];
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) tile_max = std::max(tile_max, s[r][t]);
    const float m_old = out[dim];
    const float m_new = std::max(m_old, tile_max);
    if (m_new == -std::numeric_limits<float>::infinity()) {
      for (int t = 0; t < n; ++t) s[r][t] = 0.0f;
      continue;
    }
    const float alpha = m_old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m_old - m_new);
    float sum = 0.0f;
    int t = 0;
    for (; t + W <= n; t += W) {
      const Vec e = exp(Vec::load(&s[r][t]) - Vec::set1(m_new));
      e.store(&s[r][t]);
      sum += e.reduce_add();
    }
    for (; t < n; ++t) {
      s[r][t] = std::exp(s[r][t] - m_new);
      sum += s[r][t];
    }
    out[dim] = m_new;
    out[dim + 1] = out[dim + 1] * alpha + sum;
    if (alpha != 1.0f)
      for (int c = 0; c < dim; ++c) out[c] *= alpha;
  }
  for (int c = 0; c <= full; ++c) {
    const int width = c < full ? W : tail;
    if (width == 0) break;
    Vec acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = width == W ? Vec::load(o[r] + c * W) : Vec::load_partial(o[r] + c * W, width);
    for (int t = 0; t < n; ++t) {
      const Vec v = width == W ? Vec::load(values[t] + c * W) : Vec::load_partial(values[t] + c * W, width);
      for (int r = 0; r < NR; ++r) acc[r] = fma(Vec::set1(s[r][t]), v, acc[r]);
    }
    for (int r = 0; r < NR; ++r) {
      if (width == W)
        acc[r].store(o[r] + c * W);
      else
        acc[r].store_partial(o[r] + c * W, width);
    }
  }
}

/// One work item: query rows [rows] of one (sequence, KV head) against key positions
/// [begin, end). Writes the normalized partial output [rows][D] and {m, d} per row to `part`
/// ([rows][D + 2]). D is the head size (0: read it from the layout at run time).
template <class Isa, int D, class V, class T>
void decode_item(const PagedKvView<T>& kv, int seq, int kv_head, std::int64_t begin, std::int64_t end, const float* q,
                 int rows, int group, int Q, std::int64_t q_row_stride, float scale, const DecodeParams& p,
                 float* part) noexcept {
  const int dim = D > 0 ? D : kv.layout.head_dim;
  const std::int64_t length = kv.length(seq);
  const std::int64_t stride = dim + 2;
  const int P = kv.layout.page_size;
  const std::int32_t* pages = kv.indices + kv.indptr[seq];

  for (int r = 0; r < rows; ++r) {  // start empty
    float* o = part + r * stride;
    std::fill(o, o + dim, 0.0f);
    o[dim] = -std::numeric_limits<float>::infinity();
    o[dim + 1] = 0.0f;
  }
  const T* keys[kDecodeTile];
  const T* values[kDecodeTile];
  const float* qr[kDecodeRowBlock];
  std::int64_t qpos[kDecodeRowBlock];
  float* o[kDecodeRowBlock];
  std::int64_t page = begin / P;  // where t0 is: page index in the table, slot in the page
  int slot = static_cast<int>(begin % P);
  const std::int64_t key_offset = kv.layout.key(kv_head, 0), value_offset = kv.layout.value(kv_head, 0);

  const T* ahead[kDecodeTile];  // keys of the next tile, prefetched during this one
  for (std::int64_t t0 = begin; t0 < end; t0 += kDecodeTile) {
    const int n = static_cast<int>(std::min<std::int64_t>(kDecodeTile, end - t0));
    for (int t = 0; t < n; ++t) {  // no division per token: walk (page, slot)
      const T* base = kv.page(pages[page]) + std::int64_t{slot} * dim;
      keys[t] = base + key_offset;
      values[t] = base + value_offset;
      if (++slot == P) {
        slot = 0;
        ++page;
      }
    }
    const int n_ahead = static_cast<int>(std::max<std::int64_t>(0, std::min<std::int64_t>(kDecodeTile, end - t0 - kDecodeTile)));
    {
      std::int64_t pp = page;
      int ps = slot;
      for (int t = 0; t < n_ahead; ++t) {
        ahead[t] = kv.page(pages[pp]) + std::int64_t{ps} * dim + key_offset;
        if (++ps == P) {
          ps = 0;
          ++pp;
        }
      }
    }
    for (int r0 = 0; r0 < rows; r0 += kDecodeRowBlock) {
      const int nr = std::min(kDecodeRowBlock, rows - r0);
      for (int r = 0; r < nr; ++r) {
        const int row = r0 + r, i = row / group;
        qr[r] = q + i * q_row_stride + (row - i * group) * std::int64_t{dim};
        qpos[r] = length - Q + i;
        o[r] = part + row * stride;
      }
      switch (nr) {
#define KVATTN_DECODE_TILE_CASE(NR) \
  case NR: decode_tile<Isa, D, NR, V>(keys, values, ahead, r0 == 0 ? n_ahead : 0, value_offset - key_offset, n, t0, dim, qr, qpos, o, scale, p); break;
        KVATTN_DECODE_TILE_CASE(1)
        KVATTN_DECODE_TILE_CASE(2)
        KVATTN_DECODE_TILE_CASE(3)
        KVATTN_DECODE_TILE_CASE(4)
        KVATTN_DECODE_TILE_CASE(5)
        KVATTN_DECODE_TILE_CASE(6)
        KVATTN_DECODE_TILE_CASE(7)
        default: decode_tile<Isa, D, 8, V>(keys, values, ahead, r0 == 0 ? n_ahead : 0, value_offset - key_offset, n, t0, dim, qr, qpos, o, scale, p); break;
#undef KVATTN_DECODE_TILE_CASE
      }
    }
  }
  for (int r = 0; r < rows; ++r) {  // normalize: o = Σ p v / d
    float* out = part + r * stride;
    if (out[dim + 1] > 0.0f) {
      const float inv = 1.0f / out[dim + 1];
      for (int c = 0; c < dim; ++c) out[c] *= inv;
    }
  }
}

}  // namespace decode_impl

/// Decode attention for a batch: see the top of this file for shapes. `kv` is one layer's view of
/// the cache (PagedKvCache::view); `shape` must match its KV heads and head size. Calls
/// pf(items, body) twice (the chunks, then their merge). Throws kvattn::invalid_argument or
/// shape_error on inconsistent arguments, before any work; the kernels themselves never throw.
template <class V = Plain, class Isa = isa::native, class T, class PF = SerialFor>
void decode(const PagedKvView<T>& kv, const GqaShape& shape, const float* q, float* out, float* lse,
            const DecodeParams& p, DecodeWorkspace& ws, PF&& pf = PF{}, Isa = Isa{}) {
  detail::check_attention_args<V>("decode", shape, kv.layout, p.scale, p.window, p.soft_cap);
  if (p.queries_per_seq < 1)
    raise<invalid_argument>(detail::concat("decode: queries_per_seq=", p.queries_per_seq, ": must be positive"));
  if (p.chunk_tokens < 0 || p.threads < 1)
    raise<invalid_argument>(detail::concat("decode: chunk_tokens=", p.chunk_tokens, " threads=", p.threads,
                                           ": chunk_tokens must be >= 0 and threads >= 1"));
  if (kv.batch > 0 && (q == nullptr || out == nullptr))
    raise<invalid_argument>("decode: q and out must not be null");

  const int Q = p.queries_per_seq, group = shape.group_size(), D = shape.head_dim;
  const int rows = group * Q;  // query rows per (sequence, KV head)
  const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(D));
  const std::int64_t q_seq_stride = std::int64_t{Q} * shape.q_heads * D;  // floats per sequence
  const std::int64_t q_row_stride = std::int64_t{shape.q_heads} * D;      // floats per query token

  // Work items: (sequence, KV head, chunk of keys). Without a chunk length given, split only as
  // far as needed to give every thread a few items.
  std::int64_t total = 0;
  for (int b = 0; b < kv.batch; ++b) total += kv.length(b);
  std::int64_t chunk = p.chunk_tokens;
  if (chunk == 0) {
    const std::int64_t want = std::int64_t{4} * p.threads;  // items to aim for
    const std::int64_t base = std::int64_t{kv.batch} * shape.kv_heads;
    chunk = base >= want ? std::numeric_limits<std::int64_t>::max()
                         : std::max<std::int64_t>(256, (total * shape.kv_heads + want - 1) / want);
  }
  ws.items.clear();
  ws.first_item.assign(static_cast<std::size_t>(kv.batch) + 1, 0);
  std::int64_t floats = 0;
  for (int b = 0; b < kv.batch; ++b) {
    const std::int64_t L = kv.length(b);
    const std::int64_t chunks = L == 0 ? 1 : 1 + (L - 1) / chunk;  // (no L + chunk: chunk may be INT64_MAX)
    for (int h = 0; h < shape.kv_heads; ++h)
      for (std::int64_t c = 0; c < chunks; ++c) {
        const std::int64_t begin = std::min(L, c * chunk), end = std::min(L, begin + chunk);
        ws.items.push_back({b, h, begin, end, floats});
        floats += std::int64_t{rows} * (D + 2);
      }
    ws.first_item[static_cast<std::size_t>(b) + 1] = static_cast<std::int64_t>(ws.items.size());
  }
  if (ws.partial.size() < static_cast<std::size_t>(floats)) ws.partial.resize(static_cast<std::size_t>(floats));

  const auto run_item = [&](std::int64_t i) {
    const DecodeWorkspace::Item& it = ws.items[static_cast<std::size_t>(i)];
    const float* qb = q + it.seq * q_seq_stride + std::int64_t{it.kv_head} * group * D;
    float* part = ws.partial.data() + it.partial;
    switch (D) {  // the common head sizes get loops of constant length
      case 64: decode_impl::decode_item<Isa, 64, V>(kv, it.seq, it.kv_head, it.begin, it.end, qb, rows, group, Q, q_row_stride, scale, p, part); break;
      case 128: decode_impl::decode_item<Isa, 128, V>(kv, it.seq, it.kv_head, it.begin, it.end, qb, rows, group, Q, q_row_stride, scale, p, part); break;
      case 256: decode_impl::decode_item<Isa, 256, V>(kv, it.seq, it.kv_head, it.begin, it.end, qb, rows, group, Q, q_row_stride, scale, p, part); break;
      default: decode_impl::decode_item<Isa, 0, V>(kv, it.seq, it.kv_head, it.begin, it.end, qb, rows, group, Q, q_row_stride, scale, p, part); break;
    }
  };
  pf(static_cast<std::int64_t>(ws.items.size()), run_item);

  // Merge each (sequence, KV head)'s chunks and scatter rows to [b][i][h][D].
  const auto merge_item = [&](std::int64_t bh) {
    const int b = static_cast<int>(bh / shape.kv_heads), h = static_cast<int>(bh % shape.kv_heads);
    const std::int64_t first = ws.first_item[static_cast<std::size_t>(b)];
    const std::int64_t chunks = (ws.first_item[static_cast<std::size_t>(b) + 1] - first) / shape.kv_heads;
    const std::int64_t mine = first + h * chunks;
    for (int r = 0; r < rows; ++r) {
      const int i = r / group, head = h * group + r % group;
      float* o = out + b * q_seq_stride + i * q_row_stride + std::int64_t{head} * D;
      SoftmaxStats st;
      std::fill(o, o + D, 0.0f);
      for (std::int64_t c = 0; c < chunks; ++c) {
        const float* part = ws.partial.data() + ws.items[static_cast<std::size_t>(mine + c)].partial + std::int64_t{r} * (D + 2);
        merge_state(o, st, part, SoftmaxStats{part[D], part[D + 1]}, static_cast<std::size_t>(D));
      }
      if (lse) lse[(std::int64_t{b} * Q + i) * shape.q_heads + head] = st.lse();
    }
  };
  pf(std::int64_t{kv.batch} * shape.kv_heads, merge_item);
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
