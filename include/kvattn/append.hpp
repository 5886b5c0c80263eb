// kvattn/append.hpp — new tokens' keys and values into the cache, rotated by RoPE at their
// positions, and decode queries rotated to match.
//
// A model with rotary position embedding (rope.hpp) rotates every query and key by the position
// of its token before attention. The cache holds keys already rotated: a token's position never
// changes once it is cached, so its key is rotated once, when it is written, and every later step
// reads it as it is. The position of a token is its index in its sequence:
//   write_kv:               token first + i of the sequence, at position first + i;
//   rotate_decode_queries:  query i of sequence b (the last Q of its L_b tokens), at L_b − Q + i,
//                           the position decode() gives that query;
//   prefill():              with PrefillParams::rope set, both for the chunk (prefill.hpp).
//
// One decode step of a batch, layer by layer (the step's tokens appended once, before layer 0;
// writes into tokens just appended never move pages, so one page table serves every layer):
//   for (SeqId s : seqs) cache.append(s, 1);
//   const kvattn::BatchPageTable table = cache.page_table(seqs);
//   for (int layer = 0; layer < layers; ++layer) {
//     // q [batch][1][q_heads][head_dim], k, v [batch][kv_heads][head_dim] of the new tokens
//     for (b ...) kvattn::write_kv(cache, seqs[b], layer, cache.length(seqs[b]) - 1, 1, k_b, v_b, &rope, append_ws);
//     const auto view = cache.view(table, layer);
//     kvattn::rotate_decode_queries(rope, view, q, 1, q_heads);
//     kvattn::decode(view, shape, q, out, lse, params, decode_ws);
//   }
// There is no call that appends and writes at once: a step appends its tokens once, for every
// layer, but each layer's keys exist only when the forward pass reaches that layer.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "paged_cache.hpp"
#include "rope.hpp"

namespace kvattn {

/// Scratch memory of write_kv(); reuse it across calls (it only grows). The field belongs to write_kv().
struct AppendWorkspace {
  std::vector<float> keys;  ///< [count][kv_heads][head_dim]: the rotated keys of the latest call

  std::size_t bytes() const noexcept { return keys.capacity() * sizeof(float); }
};

KVATTN_BEGIN_TARGET_NAMESPACE

/// GQA family: writes the keys and values of tokens [first, first + count) of `seq` in `layer`,
/// the keys rotated by `rope` at positions first + i (no rotation when `rope` is null). The
/// caller's arrays are only read: the rotated keys are formed in `ws`.
///   k, v  [count][kv_heads][head_dim]  fp32, converted to the cache's element type
/// Every check comes first, and a call that fails leaves the cache exactly as it was:
/// kvattn::shape_error when rope->head_dim() differs from the cache's head_dim;
/// kvattn::invalid_argument for an unknown sequence, an MLA cache, a layer out of range, a range
/// outside the sequence's tokens (count must be positive, as in PagedKvCache::write) or null
/// k / v; kvattn::capacity_error when shared pages in the range must be copied (copy-on-write,
/// as in PagedKvCache::write) and the pool has too few free pages.
/// `Isa` is the rotation's instruction set (apply_rope); the conversion is PagedKvCache::write's.
template <class IsaTag = isa::native, class T, class M>
void write_kv(PagedKvCache<T, M>& cache, SeqId seq, int layer, std::int64_t first, std::int64_t count, const float* k,
              const float* v, const Rope* rope, AppendWorkspace& ws, IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  const PageLayout& layout = cache.layout();
  if (!cache.contains(seq)) raise<invalid_argument>(detail::concat("write_kv(seq=", seq, "): no such sequence"));
  if (layout.content != PageContent::gqa)
    raise<invalid_argument>("write_kv: this cache holds MLA pages (write_kv writes GQA-family keys and values)");
  if (layer < 0 || layer >= cache.config().layers)
    raise<invalid_argument>(detail::concat("write_kv: layer=", layer, " is outside [0, ", cache.config().layers, ")"));
  const std::int64_t length = cache.length(seq);
  if (count <= 0 || first < 0 || first > length - count)
    raise<invalid_argument>(detail::concat("write_kv(seq=", seq, ", position=", first, ", count=", count,
                                           "): the sequence holds ", length, " tokens"));
  if (rope != nullptr && rope->head_dim() != layout.head_dim)
    raise<shape_error>(detail::concat("write_kv: rope head_dim=", rope->head_dim(), " does not match the cache's head_dim=",
                                      layout.head_dim));
  if (k == nullptr || v == nullptr) raise<invalid_argument>("write_kv: k and v must not be null");

  if (rope == nullptr) {
    cache.write(seq, layer, first, count, k, v);
    return;
  }
  const std::size_t n = static_cast<std::size_t>(count) * static_cast<std::size_t>(layout.kv_heads) *
                        static_cast<std::size_t>(layout.head_dim);
  if (ws.keys.size() < n) ws.keys.resize(n);
  std::copy(k, k + n, ws.keys.data());
  // Positions first, first + 1, ...: a small block of them at a time, on the stack.
  constexpr std::int64_t kBlock = 64;
  std::int64_t positions[kBlock];
  const std::int64_t token_floats = std::int64_t{layout.kv_heads} * layout.head_dim;
  for (std::int64_t t0 = 0; t0 < count; t0 += kBlock) {
    const std::int64_t m = std::min(kBlock, count - t0);
    for (std::int64_t i = 0; i < m; ++i) positions[i] = first + t0 + i;
    apply_rope(*rope, ws.keys.data() + t0 * token_floats, m, layout.kv_heads, positions, Isa{});
  }
  cache.write(seq, layer, first, count, ws.keys.data(), v);  // checks the range again, copies shared pages
}

/// Rotates decode queries in place by the positions decode() gives them: query i of sequence b,
/// which has L_b = kv.length(b) tokens, at position L_b − Q + i.
///   q  [kv.batch][queries_per_seq][q_heads][rope.head_dim()]  fp32, in place
/// Call it after the step's tokens are appended (kv taken from the cache as decode() will read
/// it) and before decode(); decode() reads q as given. In place because the queries are the
/// step's own scratch: copy them first where the unrotated ones are still needed. A sequence
/// shorter than Q gives its first queries negative positions (rotations backwards); decode()
/// gives those rows no key to see. Throws kvattn::shape_error when rope.head_dim() differs from
/// the view's head_dim (or the view is not of a GQA-family cache), kvattn::invalid_argument for
/// queries_per_seq < 1, q_heads < 1 or a null q with a non-empty batch; q is then untouched.
/// Allocates nothing.
template <class IsaTag = isa::native, class T>
void rotate_decode_queries(const Rope& rope, const PagedKvView<T>& kv, float* q, int queries_per_seq, int q_heads,
                           IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  if (kv.layout.content != PageContent::gqa || rope.head_dim() != kv.layout.head_dim)
    raise<shape_error>(detail::concat("rotate_decode_queries: rope head_dim=", rope.head_dim(),
                                      " does not match the view's head_dim=", kv.layout.head_dim));
  if (queries_per_seq < 1 || q_heads < 1)
    raise<invalid_argument>(detail::concat("rotate_decode_queries: queries_per_seq=", queries_per_seq, " q_heads=", q_heads,
                                           ": both must be positive"));
  if (kv.batch > 0 && q == nullptr) raise<invalid_argument>("rotate_decode_queries: q must not be null");
  constexpr int kBlock = 64;
  std::int64_t positions[kBlock];
  const std::int64_t token_floats = std::int64_t{q_heads} * rope.head_dim();
  for (int b = 0; b < kv.batch; ++b) {
    const std::int64_t pos0 = kv.length(b) - queries_per_seq;  // query 0's position
    float* qb = q + std::int64_t{b} * queries_per_seq * token_floats;
    for (int i0 = 0; i0 < queries_per_seq; i0 += kBlock) {
      const int m = std::min(kBlock, queries_per_seq - i0);
      for (int i = 0; i < m; ++i) positions[i] = pos0 + i0 + i;
      apply_rope(rope, qb + std::int64_t{i0} * token_floats, m, q_heads, positions, Isa{});
    }
  }
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
