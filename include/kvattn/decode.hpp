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
// A score policy (policy.hpp) adds what a variant of attention changes: a sliding window, a
// soft-cap, ALiBi, attention sinks, a tree mask, or several of them (compose). The plain kernel
// (Plain) carries none of their tests.
//
// Over an int8 format, DecodeParams::int8_queries scores keys against int8-quantized queries, and
// DecodeParams::u8_probabilities weighs values by 8-bit probabilities, by integer dot products
// (simd::I8Dot) where the instruction set has them.
//
// Calls take the step's DecodePlan (core.hpp): made once per step, it splits the batch into work
// items and holds their scratch; every layer's call reuses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "config.hpp"
#include "core.hpp"
#include "error.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "policy.hpp"
#include "shape.hpp"
#include "simd.hpp"
#include "state.hpp"
#include "tile.hpp"

namespace kvattn {

KVATTN_BEGIN_TARGET_NAMESPACE
namespace decode_impl {  // (not "detail": that name is kvattn::detail's)

/// Tokens per tile: keys and values of a tile are loaded from memory once and then reused, from
/// the L1 cache, by every query row of the group.
inline constexpr int kDecodeTile = 32;
/// Query rows whose accumulators stay in registers together: two vectors per row in the
/// value pass, so 8 rows where there are 32 vector registers and 4 where there are 16.
template <class Isa> constexpr int decode_row_block() { return Isa::vector_registers >= 32 ? 8 : 4; }
using decode_layout::partial_row_floats;
/// Tokens of a span (see Span).
inline constexpr int kDecodeSpan = decode_layout::kGqaSpan;
/// How far ahead keys and values are prefetched: (span, KV head) units, each a run of a head
/// block. One unit is several memory latencies of work already, but on a machine whose
/// bandwidth is shared the latency swings: bench_decode, 32/8×128 bf16, two threads, three
/// interleaved runs, median GiB/s of 1 / 2 / 4 units: ctx 16K 18.9 / 19.3 / 23.1, ctx 64K
/// 19.8 / 24.7 / 24.0; MHA 32×128 the same within the noise for all three.
inline constexpr int kPrefetchUnits = 2;

/// Prefetches (into L2) the cache lines of row[c0, c1): the columns one pass of a tile reads from
/// a token's row, for the same token of a later unit. Each pass prefetches, token by token, what
/// it will read there, so that the misses stream out at the rate the work goes (issued in bursts,
/// they left the memory idle between bursts and stalled on full line fill buffers: bench_decode,
/// 32/8×128, 12-20% slower). Pacing a list of the unit's lines by a count of the work done cost
/// as many instructions as the multiply-adds and ran 5-10% slower than this (32/8×128 bf16, one
/// thread, on cached and on cold keys alike).
template <class T> KVATTN_ALWAYS_INLINE void prefetch_columns(const T* row, int c0, int c1) noexcept {
  const auto first = reinterpret_cast<std::uintptr_t>(row + c0) & ~std::uintptr_t{63};
  const auto last = reinterpret_cast<std::uintptr_t>(row + c1 - 1);
  for (std::uintptr_t a = first; a <= last; a += 64) KVATTN_PREFETCH_L2(reinterpret_cast<const char*>(a));
}

/// Block-scaled formats (format.hpp's block_scale): a tile's blocks' scales and minimums as
/// floats, [kDecodeTile][blocks][2 (d, m)], for its keys and for its values.
inline constexpr int kMaxBlockScales = kMaxBlockScaledDim / 32;
struct TileBlockScales {
  alignas(64) float k[kDecodeTile * 2 * kMaxBlockScales];
  alignas(64) float v[kDecodeTile * 2 * kMaxBlockScales];
};

/// The pair of vectors of columns [c, c + 2W) of a row (pair order): load_pair; for a format
/// with block scales, the codes times the block's scale plus its minimum (dm: the row's
/// [blocks][2] scales and minimums as floats).
template <class Isa, class T>
KVATTN_ALWAYS_INLINE void load_columns(const T* row, int c, const float* dm, simd::Vec<Isa>& a, simd::Vec<Isa>& b) noexcept {
  using Vec = simd::Vec<Isa>;
  using Tr = format_traits<T>;
  if constexpr (Tr::block_scale) {
    Vec::load_pair(row + c / Tr::values_per_unit, a, b);
    const float* s = dm + 2 * (c / Tr::block);
    const Vec d = Vec::set1(s[0]), m = Vec::set1(s[1]);
    a = fma(a, d, m);
    b = fma(b, d, m);
  } else {
    Vec::load_pair(row + c, a, b);
  }
}

/// o[r][c0, c0 + CP · 2W) = alpha[r] · o[r] + Σ_t p[r][t] v_t over the same columns (pair order),
/// prefetching those columns of ahead[t]'s value row (no prefetch when ahead is null). vdm:
/// block-scaled formats' value scales ([kDecodeTile][blocks][2], `blocks` per token).
template <class Isa, int NR, int CP, class T>
KVATTN_ALWAYS_INLINE void pv_pairs(const T* const* keys, const T* const* ahead, std::int64_t value_minus_key, int n,
                                   int c0, const float (*p)[kDecodeTile], const float* alpha, float* const* o,
                                   const float* vdm, int blocks) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int U = format_traits<T>::values_per_unit;
  constexpr int W = Vec::lanes, V2 = 2 * CP;  // vectors per row
  Vec acc[NR][V2];
  KVATTN_UNROLL for (int r = 0; r < NR; ++r) {
    const Vec al = Vec::set1(alpha[r]);
    KVATTN_UNROLL for (int j = 0; j < V2; ++j) acc[r][j] = Vec::load(o[r] + c0 + j * W) * al;
  }
  for (int t = 0; t < n; ++t) {
    if (ahead) prefetch_columns(ahead[t] + value_minus_key, c0 / U, (c0 + V2 * W) / U);
    Vec v[V2];
    const float* dm = vdm + std::int64_t{t} * 2 * blocks;
    KVATTN_UNROLL for (int j = 0; j < CP; ++j)
      load_columns<Isa>(keys[t] + value_minus_key, c0 + 2 * j * W, dm, v[2 * j], v[2 * j + 1]);
    KVATTN_UNROLL for (int r = 0; r < NR; ++r) {
      const Vec pr = Vec::set1(p[r][t]);
      KVATTN_UNROLL for (int j = 0; j < V2; ++j) acc[r][j] = fma(pr, v[j], acc[r][j]);
    }
  }
  KVATTN_UNROLL for (int r = 0; r < NR; ++r)
    KVATTN_UNROLL for (int j = 0; j < V2; ++j) acc[r][j].store(o[r] + c0 + j * W);
}

/// One pair of vectors of columns c · 2W of a key against NR query rows (pair order): the key's
/// even columns into acc[r], its odd ones into acc2[r].
template <class Isa, int NR, class T>
KVATTN_ALWAYS_INLINE void score_pair(const T* key, const float* dm, const float* const* qr, int c, simd::Vec<Isa>* acc,
                                     simd::Vec<Isa>* acc2) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, W2 = 2 * W;
  Vec ka, kb;
  load_columns<Isa>(key, c * W2, dm, ka, kb);
  KVATTN_UNROLL for (int r = 0; r < NR; ++r) {
    acc[r] = fma(Vec::load(qr[r] + c * W2), ka, acc[r]);
    acc2[r] = fma(Vec::load(qr[r] + c * W2 + W), kb, acc2[r]);
  }
}

/// One row's tile of probabilities s[kDecodeTile] (times the values' scales) rounded to 8 bits
/// relative to the tile's largest (DecodeParams::u8_probabilities): p8_t = round(255 · s_t / max s)
/// and unit = max s / 255, returned. Bytes: p8_t into p8 (s unchanged); else s_t <- p8_t · unit.
/// A tile holding a NaN returns unit NaN, so the row's output is NaN; a tile of zeros returns 0.
template <class Isa, bool Bytes> KVATTN_ALWAYS_INLINE float quantize_probabilities(float* s, std::uint8_t* p8) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  Vec m = Vec::zero(), sum = Vec::zero();
  for (int g = 0; g < kDecodeTile; g += W) {
    const Vec x = Vec::load(s + g);
    m = max(m, x);
    sum = sum + x;
  }
  const float top = m.reduce_max(), total = sum.reduce_add();
  const bool none = std::isnan(total) || !(top > 0.0f);
  const float inv = none ? 0.0f : 255.0f / top, unit = std::isnan(total) ? total : none ? 0.0f : top / 255.0f;
  if constexpr (Bytes) {
    simd::I8Dot<Isa>::pack_probabilities(s, inv, p8);  // (inv = 0: zeros)
  } else {
    for (int t = 0; t < kDecodeTile; ++t) s[t] = none ? unit * 0.0f : std::nearbyint(s[t] * inv) * unit;  // NaN stays NaN
  }
  return unit;
}

/// tile_scores with int8 queries on an instruction set with integer dot products
/// (simd::I8Dot): red[r][t] = lanes of partial sums of k_t · q_r + key_offset · Σ q_r, as floats.
/// qr[r]: row r's int8 query, zero-padded to whole cache lines.
template <class Isa, int HeadDim, int NR, class T>
KVATTN_ALWAYS_INLINE void int8_scores(const T* const* keys, const T* const* ahead, int n, int dim,
                                      const std::int8_t* const* qr, simd::Vec<Isa> (*red)[kDecodeTile]) noexcept {
  using I8 = simd::I8Dot<Isa>;
  constexpr int B = I8::bytes;
  const int whole = (HeadDim > 0 ? HeadDim : dim) / B * B;
  for (int t = 0; t < n; ++t) {
    if (ahead) prefetch_columns(ahead[t], 0, dim);
    const T* key = keys[t];
    typename I8::Acc acc[NR];
    KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = I8::zero();
    if constexpr (HeadDim > 0) {
      KVATTN_UNROLL for (int c = 0; c < HeadDim / B * B; c += B) {
        const auto k = I8::load_key(key + c);
        KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = I8::dot(acc[r], k, I8::load_query(qr[r] + c));
      }
    } else {
      for (int c = 0; c < whole; c += B) {
        const auto k = I8::load_key(key + c);
        KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = I8::dot(acc[r], k, I8::load_query(qr[r] + c));
      }
    }
    if (whole < dim) {
      const auto k = I8::load_key_partial(key + whole, dim - whole);
      KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = I8::dot(acc[r], k, I8::load_query(qr[r] + whole));
    }
    KVATTN_UNROLL for (int r = 0; r < NR; ++r) red[r][t] = I8::to_vec(acc[r]);
  }
}

/// Whether step 3 of a tile (tile_values) multiplies 8-bit probabilities with int8 values by
/// integer dot products (simd::I8Dot): with int8 queries, on instruction sets that have them, for
/// head sizes compiled for that are whole blocks of their columns.
template <class Isa, int HeadDim, bool Int8Q>
inline constexpr bool kIntValues = Int8Q && simd::I8Dot<Isa>::value_columns > 0 && HeadDim > 0 &&
                                   HeadDim % std::max(1, simd::I8Dot<Isa>::value_columns) == 0;

// A tile is up to kDecodeTile tokens against NR query rows, in three steps:
//   1. Scores (tile_scores): for each token, one vector of partial dot products per row; the
//      tile's vectors are then summed lanes-wise all at once (Vec::sum_each), not one reduction
//      per token, and scaled (by the key's scale too).
//   2. Per row over the tile (tile_softmax): the policy's window, logits and mask, then the online
//      softmax: new maximum, rescale factor, probabilities (times the value's scale).
//   3. o = alpha · o + Σ_t p_t v_t (tile_values), with keys' and values' pairs of vectors converted
//      once per token and shared by every row.
// Steps 1 and 3 are functions of their own, NR compile-time (the accumulators stay in registers),
// and know nothing of the score policy: every policy's decode_item calls the same ones, so a policy
// costs its own step 2 and walk, not another copy of the kernels. Not inlined into decode_item,
// which calls them for each row count: the compiler then optimizes each alone, and a call per
// tile costs nothing beside the tile's work.
//
// Their arguments: keys[t]: token t's key row [dim], its value row at keys[t] + value_minus_key;
// ahead[t]: the same token's key row in a later unit, whose key and value rows are prefetched as
// the scores and the values of token t are computed (ahead null: none). run_dim: the head size
// (HeadDim where that is not 0). qr[r]: row r's query [dim] in pair order (simd::to_pair_order);
// o[r]: its running output [dim] in pair order, then {m, d}. Formats with a scale per row
// (format.hpp): ks[t], vs[t] are token t's key and value scales ([kDecodeTile], 0 past n); other
// formats ignore them. Formats with a scale and a minimum per block of a row: bs holds the
// tile's, as floats, and a row's values are the codes times the scale plus the minimum as they
// are loaded (load_columns); others pass null. Int8Q (DecodeParams::int8_queries): qr[r] holds
// row r's int8 query values (int8_t where simd::I8Dot scores them, else as floats), q_scale[r]
// its scale and q_offset[r] what the integer sums carry besides k · q.

/// Step 1: s[r][t] = scale · k_t · q_r (times the key's scale) for the tile's n tokens, and 0
/// past them.
template <class Isa, int HeadDim, int NR, bool Int8Q, class T, class QT>
KVATTN_NOINLINE void tile_scores(const T* const* keys, const T* const* ahead, int n, int run_dim, const QT* const* qr_in,
                                 float scale, const float* ks, const TileBlockScales* bs, const float* q_scale,
                                 const float* q_offset, float (*s)[kDecodeTile]) noexcept {
  constexpr bool kRowScale = format_traits<T>::row_scale;
  constexpr bool kBlockScale = format_traits<T>::block_scale;
  constexpr int U = format_traits<T>::values_per_unit;
  const int dim = HeadDim > 0 ? HeadDim : run_dim;  // a constant for the head sizes compiled for
  // The rows' pointers as locals: the compiler then knows that no store of the tile changes them,
  // and keeps them in registers rather than reading the caller's arrays again at every use.
  const QT* qr[NR];
  for (int r = 0; r < NR; ++r) qr[r] = qr_in[r];
  const int blocks = kBlockScale ? dim / format_traits<T>::block : 0;  // block scales per row
  const float* kdm = kBlockScale ? bs->k : nullptr;
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, W2 = 2 * W;
  static_assert(kDecodeTile % W == 0, "a tile is whole vectors of tokens");
  const int pairs = dim / W2, singles = (dim % W2) / W, tail = dim % W;
  const int rest = pairs * W2;  // where the columns after the pairs start

  Vec red[NR][kDecodeTile];
  if constexpr (std::is_same_v<QT, std::int8_t>) {
    int8_scores<Isa, HeadDim, NR>(keys, ahead, n, dim, qr, red);
  } else {
    for (int t = 0; t < n; ++t) {
      if (ahead) prefetch_columns(ahead[t], 0, dim / U);
      const T* key = keys[t];
      const float* dm = kBlockScale ? kdm + std::int64_t{t} * 2 * blocks : nullptr;
      Vec acc[NR], acc2[NR];  // two chains per row: half the dependent adds
      KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = acc2[r] = Vec::zero();
      // Unrolled for the head sizes known at compile time. The general size's count is known only
      // at run time: clang cannot honour an unroll pragma there and warns (-Wpass-failed).
      if constexpr (HeadDim > 0) {
        KVATTN_UNROLL for (int c = 0; c < HeadDim / W2; ++c) score_pair<Isa, NR>(key, dm, qr, c, acc, acc2);
      } else {
        for (int c = 0; c < pairs; ++c) score_pair<Isa, NR>(key, dm, qr, c, acc, acc2);
      }
      KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = acc[r] + acc2[r];
      // (A block-scaled format's head_dim is whole blocks, whole pairs of vectors: no columns left.)
      if constexpr (!kBlockScale) {
        for (int c = 0; c < singles; ++c) {
          const Vec k = Vec::load(key + rest + c * W);
          KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = fma(Vec::load(qr[r] + rest + c * W), k, acc[r]);
        }
        if (tail) {
          const Vec k = Vec::load_partial(key + dim - tail, tail);
          KVATTN_UNROLL for (int r = 0; r < NR; ++r) acc[r] = fma(Vec::load_partial(qr[r] + dim - tail, tail), k, acc[r]);
        }
      }
      KVATTN_UNROLL for (int r = 0; r < NR; ++r) red[r][t] = acc[r];
    }
  }
  for (int t = n; t < kDecodeTile; ++t)
    KVATTN_UNROLL for (int r = 0; r < NR; ++r) red[r][t] = Vec::zero();

  for (int r = 0; r < NR; ++r) {
    if constexpr (Int8Q) {  // (k · q_int8 + offset − offset) · scale · q's scale · k's scale
      const Vec off = Vec::set1(q_offset[r]), vscale = Vec::set1(scale * q_scale[r]);
      for (int g = 0; g < kDecodeTile; g += W) ((Vec::sum_each(&red[r][g]) - off) * vscale * Vec::load(ks + g)).store(&s[r][g]);
    } else {
      const Vec vscale = Vec::set1(scale);
      for (int g = 0; g < kDecodeTile; g += W) {
        if constexpr (kRowScale)
          (Vec::sum_each(&red[r][g]) * vscale * Vec::load(ks + g)).store(&s[r][g]);
        else
          (Vec::sum_each(&red[r][g]) * vscale).store(&s[r][g]);
      }
    }
  }
}

/// Step 2, for one row: the policy's part (policy.hpp) and the online-softmax step on its scores
/// s[kDecodeTile], which become probabilities (times the values' scales vs, for formats with a
/// scale per row); md: the row's {m, d}. Returns the factor alpha the row's output is rescaled
/// by. With u8p (DecodeParams::u8_probabilities, with int8 queries), the probabilities are then
/// rounded to 8 bits, p8[t] · p_unit: into p8 where step 3 multiplies them as integers
/// (int_values: kIntValues of the head size), else into s.
template <class Isa, bool Int8Q, class T, class P>
KVATTN_ALWAYS_INLINE float tile_softmax(const P& policy, const QueryRow& row, std::int64_t t0, int n, float* s, float* md,
                                        const float* vs, bool u8p, bool int_values, std::uint8_t* p8, float& p_unit) noexcept {
  using Vec = simd::Vec<Isa>;
  core_impl::policy_tile<kDecodeTile>(policy, row, t0, n, s);
  const float alpha = core_impl::row_softmax<Isa, kDecodeTile>(s, md);
  if constexpr (format_traits<T>::row_scale)
    for (int g = 0; g < kDecodeTile; g += Vec::lanes) (Vec::load(s + g) * Vec::load(vs + g)).store(s + g);
  if constexpr (Int8Q) {
    if constexpr (simd::I8Dot<Isa>::value_columns > 0)
      if (u8p && int_values) {
        p_unit = quantize_probabilities<Isa, true>(s, p8);
        return alpha;
      }
    if (u8p) p_unit = quantize_probabilities<Isa, false>(s, p8);
  }
  return alpha;
}

/// Step 3: o[r] = alpha[r] · o[r] + Σ_t p[r][t] v_t (in pair order), with the probabilities of
/// step 2: s (floats), or with u8p where kIntValues holds, p8[r][t] · p_unit[r].
template <class Isa, int HeadDim, int NR, bool Int8Q, class T>
KVATTN_NOINLINE void tile_values(const T* const* keys, const T* const* ahead, std::int64_t value_minus_key, int n,
                                 int run_dim, const float (*s)[kDecodeTile], [[maybe_unused]] const std::uint8_t (*p8)[kDecodeTile],
                                 [[maybe_unused]] const float* p_unit, const float* alpha, float* const* o_in,
                                 const TileBlockScales* bs, [[maybe_unused]] bool u8p) noexcept {
  constexpr bool kBlockScale = format_traits<T>::block_scale;
  const int dim = HeadDim > 0 ? HeadDim : run_dim;
  float* o[NR];
  for (int r = 0; r < NR; ++r) o[r] = o_in[r];
  const int blocks = kBlockScale ? dim / format_traits<T>::block : 0;
  const float* vdm = kBlockScale ? bs->v : nullptr;
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, W2 = 2 * W;
  const int pairs = dim / W2;
  const int rest = pairs * W2;
  if constexpr (kIntValues<Isa, HeadDim, Int8Q>) if (u8p) {  // 3, by integer dot products: o = alpha · o + unit · Σ_t p8_t v_t
    using I8 = simd::I8Dot<Isa>;
    constexpr int C = I8::value_columns;
    // Blocks of up to 4 rows: 16 accumulators, the values' 4 vectors and the rest in registers.
    constexpr int RB = NR < 4 ? NR : 4;
    for (int c = 0; c < HeadDim; c += C)
      for (int r0 = 0; r0 < NR; r0 += RB) {
        const int nr = std::min(RB, NR - r0);
        typename I8::Acc acc[RB][4];
        KVATTN_UNROLL for (int r = 0; r < RB; ++r)
          KVATTN_UNROLL for (int j = 0; j < 4; ++j) acc[r][j] = I8::zero();
        for (int t = 0; t < n; t += 4) {  // 4 tokens at a time; past n: any row, its probability is 0
          const T* row[4];
          KVATTN_UNROLL for (int i = 0; i < 4; ++i) {
            const int ti = std::min(t + i, n - 1);
            row[i] = keys[ti] + value_minus_key + c;
            if (ahead && r0 == 0) prefetch_columns(ahead[ti] + value_minus_key, c, c + C);
          }
          typename I8::Acc v[4];
          I8::load_values(row, v);
          KVATTN_UNROLL for (int r = 0; r < RB; ++r) {
            if (r < nr) {
              std::uint32_t p4;
              std::memcpy(&p4, &p8[r0 + r][t], sizeof p4);
              KVATTN_UNROLL for (int j = 0; j < 4; ++j) acc[r][j] = I8::dot_values(acc[r][j], p4, v[j]);
            }
          }
        }
        for (int r = 0; r < nr; ++r) I8::add_values(o[r0 + r] + c, acc[r], p_unit[r0 + r], alpha[r0 + r]);
      }
    return;
  }

  // 3. o = alpha · o + Σ_t p_t v_t, CP pairs of vectors of columns at a time: NR · 2 · CP
  // independent accumulators, as many as half the vector registers hold, so that the
  // multiply-adds' latency is covered even for one row.
  constexpr int kAccumulators = Isa::vector_registers / 2;
  constexpr int CP = NR * 8 <= kAccumulators ? 4 : NR * 4 <= kAccumulators ? 2 : 1;
  // (The pairs of a head size compiled for are counted at compile time: no loop over the pairs
  // left after the blocks of CP where there are none.)
  const int whole = pairs / CP * CP;
  for (int c = 0; c < whole; c += CP) pv_pairs<Isa, NR, CP>(keys, ahead, value_minus_key, n, c * W2, s, alpha, o, vdm, blocks);
  if constexpr (HeadDim == 0 || HeadDim / W2 % CP != 0)
    for (int c = whole; c < pairs; ++c) pv_pairs<Isa, NR, 1>(keys, ahead, value_minus_key, n, c * W2, s, alpha, o, vdm, blocks);
  if constexpr (!kBlockScale) {  // the columns after the pairs (none where head_dim is whole blocks)
    for (int c = rest; c < dim; c += W) {  // whole vectors, then the partial one
      const int width = std::min(W, dim - c);
      Vec a[NR];
      KVATTN_UNROLL for (int r = 0; r < NR; ++r)
        a[r] = (width == W ? Vec::load(o[r] + c) : Vec::load_partial(o[r] + c, width)) * Vec::set1(alpha[r]);
      for (int t = 0; t < n; ++t) {
        if (ahead && c == rest) prefetch_columns(ahead[t] + value_minus_key, rest, dim);
        const T* value = keys[t] + value_minus_key + c;
        const Vec v = width == W ? Vec::load(value) : Vec::load_partial(value, width);
        KVATTN_UNROLL for (int r = 0; r < NR; ++r) a[r] = fma(Vec::set1(s[r][t]), v, a[r]);
      }
      KVATTN_UNROLL for (int r = 0; r < NR; ++r) {
        if (width == W)
          a[r].store(o[r] + c);
        else
          a[r].store_partial(o[r] + c, width);
      }
    }
  }
}

/// Up to kDecodeSpan consecutive tokens of one sequence: where each token's row starts in its
/// page (add PageLayout::key(h, 0) or value(h, 0) for KV head h). A span never crosses a page
/// boundary when pages hold kDecodeTile tokens or more, so it is one run of each head block.
/// Formats with scales in the page (per row or per block): scale[i] is token i's first key scale
/// slot for KV head 0 in its page's scale block (add PageLayout::key_scale(h, 0) or
/// value_scale(h, 0) for KV head h).
template <class T> inline constexpr bool kPageScales = format_traits<T>::row_scale || format_traits<T>::block_scale;
template <class T> struct Span {
  std::int64_t t0 = 0;  ///< position of the first token
  int n = 0;            ///< tokens, 0: none
  const T* token[kDecodeSpan];
  const float* scale[kPageScales<T> ? kDecodeSpan : 1];
};

/// Walks a sequence's page table from a position on, without a division per token.
template <class T> struct SpanWalker {
  const PagedKvView<T>* kv;
  const std::int32_t* pages;  ///< the sequence's page ids
  std::int64_t t, end;        ///< next position, end of the range
  std::int64_t page;          ///< index of t's page in `pages`
  int slot;                   ///< t's slot in that page

  SpanWalker(const PagedKvView<T>& view, int seq, std::int64_t begin, std::int64_t end_) noexcept
      : kv(&view), pages(view.indices + view.indptr[seq]), t(begin), end(end_),
        page(begin / view.layout.page_size), slot(static_cast<int>(begin % view.layout.page_size)) {}

  /// The next span (n = 0 past the end).
  void next(Span<T>& s) noexcept {
    const int P = kv->layout.page_size, row = kv->layout.row_units, slots = kv->layout.scale_slots;
    const std::int64_t room = P >= kDecodeTile ? std::min(kDecodeSpan, P - slot) : kDecodeTile;
    s.t0 = t;
    s.n = static_cast<int>(std::min(room, end - t));
    for (int i = 0; i < s.n; ++i) {
      const T* p = kv->page(pages[page]);
      s.token[i] = p + std::int64_t{slot} * row;
      if constexpr (kPageScales<T>)
        s.scale[i] = reinterpret_cast<const float*>(p + kv->layout.scale_offset) + std::int64_t{slot} * slots;
      if (++slot == P) {
        slot = 0;
        ++page;
      }
    }
    t += s.n;
  }
};

/// The tile kernels (steps 1 and 3) for one head size, one per row count nr in [1, Max]:
/// scores[nr - 1] and values[nr - 1], the kernels compiled for the head size (dispatch_head_dim:
/// the general one where none is). Chosen once per work item; a tile then costs one call each.
template <class Isa, int Max, bool Int8Q, class T, class QT> struct TileKernels {
  using Scores = void (*)(const T* const*, const T* const*, int, int, const QT* const*, float, const float*,
                          const TileBlockScales*, const float*, const float*, float (*)[kDecodeTile]) noexcept;
  using Values = void (*)(const T* const*, const T* const*, std::int64_t, int, int, const float (*)[kDecodeTile],
                          const std::uint8_t (*)[kDecodeTile], const float*, const float*, float* const*,
                          const TileBlockScales*, bool) noexcept;
  Scores scores[Max];
  Values values[Max];
  bool int_values = false;  // kIntValues of the head size

  explicit TileKernels(int dim) noexcept {
    dispatch_head_dim(dim, [&](auto head_dim) { fill<decltype(head_dim)::value>(std::make_integer_sequence<int, Max>{}); });
  }

 private:
  template <int HeadDim, int... I> void fill(std::integer_sequence<int, I...>) noexcept {
    ((scores[I] = &tile_scores<Isa, HeadDim, I + 1, Int8Q, T, QT>), ...);
    ((values[I] = &tile_values<Isa, HeadDim, I + 1, Int8Q, T>), ...);
    int_values = kIntValues<Isa, HeadDim, Int8Q>;
  }
};

/// One work item: every query row of the batch's sequence b against its key positions [begin, end).
/// The keys are walked span by span and, within a span, KV head by KV head: the order in which
/// they lie in a page (PageLayout: [K, V][kv_heads][page_size][dim]), so the reads of a step are
/// long runs of neighbouring bytes, and the (span, head) unit kPrefetchUnits units ahead is
/// prefetched meanwhile. Writes the normalized partial output and {m, d} of every row to `part`:
/// [kv_heads][rows][row_floats(dim)], rows = group · Q (row r: query i = r / group, head
/// h·group + r % group), each row its output [dim] in pair order then {m, d}.
/// The head size is the layout's; the tile kernels are chosen for it (TileKernels).
template <class Isa, bool Int8Q, class P, class T>
void decode_item(const PagedKvView<T>& kv, int b, std::int64_t begin, std::int64_t end, const float* q, int group,
                 int Q, std::int64_t q_row_stride, float scale, const P& policy, float* part,
                 float* q_scratch, bool u8_probabilities) noexcept {
  const int dim = kv.layout.head_dim;
  const int H = kv.layout.kv_heads, rows = group * Q;
  const std::int64_t length = kv.length(b);
  const std::int64_t stride = partial_row_floats(dim);
  constexpr int kRowBlock = decode_row_block<Isa>();
  // A format with one scale per layer (format.hpp): the keys' scale is the scores', the values'
  // the output's, once for the whole item.
  float out_scale = 1.0f;
  if constexpr (format_traits<T>::layer_scale) {
    scale *= format_traits<T>::kernel_scale(kv.scales.k);
    out_scale = format_traits<T>::kernel_scale(kv.scales.v);
  }

  for (std::int64_t r = 0; r < std::int64_t{H} * rows; ++r) {  // start empty
    float* o = part + r * stride;
    std::fill(o, o + dim, 0.0f);
    o[dim] = -std::numeric_limits<float>::infinity();
    o[dim + 1] = 0.0f;
  }
  if (begin >= end) return;
  // The queries in the order keys and values are converted in: [kv_heads][rows][dim]; for a
  // rotated format (format.hpp), in the keys' rotated basis.
  constexpr bool kRotated = format_traits<T>::rotated;
  static_assert(!kRotated || !simd::Vec<Isa>::template interleaves_pairs<T>, "a rotated row is read in its natural order");
  for (int h = 0; h < H; ++h)
    for (int row = 0; row < rows; ++row) {
      const int i = row / group;
      float* qs = q_scratch + (std::int64_t{h} * rows + row) * dim;
      simd::to_pair_order<Isa, T>(q + i * q_row_stride + (std::int64_t{h} * group + (row - i * group)) * dim, qs, dim);
      if constexpr (kRotated) hadamard_rotate(qs, dim);
    }
  // With int8 queries (DecodeParams::int8_queries), each row quantized like a key row:
  // [kv_heads][rows][int8_query_row_floats] after the float queries, the row's int8 values
  // zero-padded to whole lines, then its {scale, key_offset · Σ q}. Instruction sets without
  // integer dot products score the same integers as floats: they replace the float row.
  using I8 = simd::I8Dot<Isa>;
  constexpr bool kIntDot = Int8Q && I8::available;
  const std::int64_t i8_row = decode_layout::int8_query_row_floats(dim), i8_bytes = (i8_row - detail::kLineFloats) * 4;
  float* const q8_base = q_scratch + std::int64_t{H} * rows * dim;
  if constexpr (Int8Q) {
    static_assert(is_int8_format_v<T>, "int8 queries score int8 keys");
    for (std::int64_t r = 0; r < std::int64_t{H} * rows; ++r) {
      float* qs = q_scratch + r * dim;
      float* q8 = q8_base + r * i8_row;
      auto* v = reinterpret_cast<int8_row*>(q8);
      const float qscale = format_traits<int8_row>::quantize_row(qs, v, static_cast<std::size_t>(dim));
      std::int64_t sum = 0;
      for (int c = 0; c < dim; ++c) sum += v[c].q;
      for (std::int64_t c = dim; c < i8_bytes; ++c) v[c].q = 0;
      q8[i8_bytes / 4] = qscale;
      q8[i8_bytes / 4 + 1] = kIntDot ? static_cast<float>(I8::key_offset * sum) : 0.0f;
      if constexpr (!kIntDot)
        for (int c = 0; c < dim; ++c) qs[c] = static_cast<float>(v[c].q);
    }
  }
  using QueryValue = std::conditional_t<kIntDot, std::int8_t, float>;
  const TileKernels<Isa, kRowBlock, Int8Q, T, QueryValue> tile(dim);

  const T* keys[kDecodeTile];
  const T* ahead[kDecodeTile];
  constexpr bool kRowScale = format_traits<T>::row_scale;
  constexpr bool kBlockScale = format_traits<T>::block_scale;
  alignas(64) float ks[kDecodeTile] = {}, vs[kDecodeTile] = {};  // the tile's scales (row-scale formats), 0 past n
  // Block-scaled formats: the tile's scales and minimums, converted to floats once per tile.
  struct NoBlockScales {};
  std::conditional_t<kBlockScale, TileBlockScales, NoBlockScales> tile_scales;
  const int blocks = kBlockScale ? dim / std::max(1, format_traits<T>::block) : 0;
  const QueryValue* qr[kRowBlock];
  float q_scale[kRowBlock] = {}, q_offset[kRowBlock] = {};  // int8 queries: each row's scale and offset
  QueryRow qrow[kRowBlock];
  float* o[kRowBlock];
  // A tile's probabilities (steps 2 and 3): floats, and bytes with 8-bit probabilities.
  alignas(64) float s[kRowBlock][kDecodeTile];
  alignas(64) std::uint8_t p8[kRowBlock][kDecodeTile];
  float alpha[kRowBlock], p_unit[kRowBlock] = {};
  const int lookahead = std::min(kPrefetchUnits, H);  // in (span, head) units; < 2 spans
  const std::int64_t value_minus_key = kv.layout.value(0, 0) - kv.layout.key(0, 0);

  Span<T> spans[2];
  Span<T>* cur = &spans[0];
  Span<T>* nxt = &spans[1];
  SpanWalker<T> walker(kv, b, begin, end);
  walker.next(*cur);
  while (cur->n > 0) {
    walker.next(*nxt);
    for (int h = 0; h < H; ++h) {
      const std::int64_t key_offset = kv.layout.key(h, 0);
      int hp = h + lookahead;  // the unit to prefetch: (cur, hp) or (nxt, hp - H)
      const Span<T>* sp = cur;
      if (hp >= H) {
        hp -= H;
        sp = nxt;
      }
      const std::int64_t ahead_offset = kv.layout.key(hp, 0);
      for (int i0 = 0; i0 < cur->n; i0 += kDecodeTile) {
        const int n = std::min(kDecodeTile, cur->n - i0);
        for (int t = 0; t < n; ++t) keys[t] = cur->token[i0 + t] + key_offset;
        if constexpr (kRowScale) {
          const std::int64_t k_at = kv.layout.key_scale(h, 0), v_at = kv.layout.value_scale(h, 0);
          for (int t = 0; t < n; ++t) {
            ks[t] = cur->scale[i0 + t][k_at];
            vs[t] = cur->scale[i0 + t][v_at];
          }
          for (int t = n; t < kDecodeTile; ++t) ks[t] = vs[t] = 0.0f;
        }
        if constexpr (kBlockScale) {
          const std::int64_t k_at = kv.layout.key_scale(h, 0), v_at = kv.layout.value_scale(h, 0);
          for (int t = 0; t < n; ++t) {
            const float* slots = cur->scale[i0 + t];
            convert_row(Isa{}, reinterpret_cast<const fp16*>(slots + k_at), tile_scales.k + t * 2 * blocks, std::size_t(2 * blocks));
            convert_row(Isa{}, reinterpret_cast<const fp16*>(slots + v_at), tile_scales.v + t * 2 * blocks, std::size_t(2 * blocks));
          }
        }
        // Tokens past the end of the later span prefetch their own rows again: no test per token.
        const int n_ahead = std::max(0, std::min(n, sp->n - i0));
        for (int t = 0; t < n; ++t) ahead[t] = t < n_ahead ? sp->token[i0 + t] + ahead_offset : keys[t];
        if constexpr (kPageScales<T>) {  // and that unit's scales, which live in their own lines (the page's scale block)
          const std::int64_t k_at = kv.layout.key_scale(hp, 0), v_at = kv.layout.value_scale(hp, 0);
          for (int t = 0; t < n_ahead; ++t) {
            KVATTN_PREFETCH_L2(sp->scale[i0 + t] + k_at);
            KVATTN_PREFETCH_L2(sp->scale[i0 + t] + v_at);
          }
        }
        const TileBlockScales* block_scales = nullptr;
        if constexpr (kBlockScale) block_scales = &tile_scales;
        // Only the first block of rows prefetches: the later unit's rows are fetched once per tile.
        for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
          const int nr = std::min(kRowBlock, rows - r0);
          for (int r = 0; r < nr; ++r) {
            const int row = r0 + r;
            const std::int64_t hr = std::int64_t{h} * rows + row;
            if constexpr (kIntDot)
              qr[r] = reinterpret_cast<const std::int8_t*>(q8_base + hr * i8_row);
            else
              qr[r] = q_scratch + hr * dim;
            if constexpr (Int8Q) {
              q_scale[r] = q8_base[hr * i8_row + i8_bytes / 4];
              q_offset[r] = q8_base[hr * i8_row + i8_bytes / 4 + 1];
            }
            const int i = row / group;
            qrow[r] = QueryRow{std::int64_t{b} * Q + i, length - Q + i, length - Q, h * group + (row - i * group)};
            o[r] = part + (std::int64_t{h} * rows + row) * stride;
          }
          const std::int64_t t0 = cur->t0 + i0;
          const T* const* prefetch = r0 == 0 ? ahead : nullptr;
          tile.scores[nr - 1](keys, prefetch, n, dim, qr, scale, ks, block_scales, q_scale, q_offset, s);
          for (int r = 0; r < nr; ++r)
            alpha[r] = tile_softmax<Isa, Int8Q, T>(policy, qrow[r], t0, n, s[r], o[r] + dim, vs, u8_probabilities, tile.int_values,
                                                   p8[r], p_unit[r]);
          tile.values[nr - 1](keys, prefetch, value_minus_key, n, dim, s, p8, p_unit, alpha, o, block_scales, u8_probabilities);
        }
      }
    }
    std::swap(cur, nxt);
  }
  for (std::int64_t r = 0; r < std::int64_t{H} * rows; ++r) {  // normalize: o = Σ p v / d, in natural order
    float* out = part + r * stride;
    simd::from_pair_order<Isa, T>(out, dim);
    if constexpr (kRotated) hadamard_rotate(out, dim);  // back from the values' rotated basis
    if (out[dim + 1] > 0.0f) {
      const float inv = out_scale / out[dim + 1];
      for (int c = 0; c < dim; ++c) out[c] *= inv;
    }
  }
}

}  // namespace decode_impl

/// Decode attention for a batch: see the top of this file for shapes. `kv` is one layer's view of
/// the cache (PagedKvCache::view) for the batch `plan` was made for (DecodePlan::make, with a
/// GqaShape); `policy` adds a variant (policy.hpp). Calls pf(items, body) twice (the chunks, then
/// their merge). Throws kvattn::invalid_argument or shape_error on inconsistent arguments (a plan
/// of another batch or head layout, a policy that does not fit the call), before any work; the
/// kernels themselves never throw or allocate.
template <class T, class PF = SerialFor, class P = Plain, class IsaTag = isa::native>
void decode(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, PF&& pf = PF{},
            const P& policy = P{}, IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  static_assert(format_traits<T>::latent_block == 0, "kvattn::decode: an MLA format's cache is read by mla_decode");
  const GqaShape& shape = plan.check_call<GqaShape>("decode", kv, policy, q, out, plan.policy_call());
  const int Q = plan.params().queries_per_seq, group = shape.group_size(), dim = shape.head_dim;
  const int rows = group * Q;  // query rows per (sequence, KV head)
  const float scale = plan.scale();
  const std::int64_t q_seq_stride = std::int64_t{Q} * shape.q_heads * dim;  // floats per sequence
  const std::int64_t q_row_stride = std::int64_t{shape.q_heads} * dim;      // floats per query token

  // Work items: (sequence, chunk of keys), every KV head of the chunk in one item (see
  // decode_item). Per item: the partial outputs [kv_heads][rows][row_floats], then its queries
  // [kv_heads][rows][dim] (decode_layout::gqa_item_floats).
  const std::int64_t row_floats = decode_layout::partial_row_floats(dim);
  float* const base = plan.scratch();
  const std::vector<DecodePlan::Item>& items = plan.items();

  DecodePlan::check_int8_math<T>("decode", plan.params());
  const auto run = [&](auto int8) {
    pf(static_cast<std::int64_t>(items.size()), [&](std::int64_t i) {
      const DecodePlan::Item& it = items[static_cast<std::size_t>(i)];
      float* part = base + it.partial;
      float* q_scratch = part + std::int64_t{shape.kv_heads} * rows * row_floats;
      decode_impl::decode_item<Isa, decltype(int8)::value>(kv, it.batch_index, it.begin, it.end, q + it.batch_index * q_seq_stride,
                                                           group, Q, q_row_stride, scale, policy, part, q_scratch,
                                                           plan.params().u8_probabilities);
    });
  };
  // One kernel more for int8 formats (the int8 queries'), not one per flag: the 8-bit
  // probabilities are a branch per tile inside it.
  if constexpr (is_int8_format_v<T>) {
    if (plan.params().int8_queries)
      run(std::true_type{});
    else
      run(std::false_type{});
  } else {
    run(std::false_type{});
  }

  // Merge each (sequence, KV head)'s chunks (and the sink, counted once) and scatter rows to [b][i][h][dim].
  pf(std::int64_t{kv.batch} * shape.kv_heads, [&](std::int64_t bh) {
    const int b = static_cast<int>(bh / shape.kv_heads), h = static_cast<int>(bh % shape.kv_heads);
    const std::int64_t first = plan.first_item(b), last = plan.first_item(b + 1);
    for (int r = 0; r < rows; ++r) {
      const int i = r / group, head = h * group + r % group;
      float* o = out + b * q_seq_stride + i * q_row_stride + std::int64_t{head} * dim;
      SoftmaxStats st;
      std::fill(o, o + dim, 0.0f);
      for (std::int64_t c = first; c < last; ++c) {
        const float* part = base + items[static_cast<std::size_t>(c)].partial + (std::int64_t{h} * rows + r) * row_floats;
        merge_state(o, st, part, SoftmaxStats{part[dim], part[dim + 1]}, static_cast<std::size_t>(dim));
      }
      if constexpr (P::kSink) {
        const float f = sink_factor(policy, st, head);
        for (int c = 0; c < dim; ++c) o[c] *= f;
      }
      if (lse) lse[(std::int64_t{b} * Q + i) * shape.q_heads + head] = st.lse();
    }
  });
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
