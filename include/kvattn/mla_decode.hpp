// kvattn/mla_decode.hpp — MLA decode attention straight against the cached latents (the folded
// path of DESIGN.md, "MLA and the folded decode path").
//
// With the up-projections folded into the query (q̃_i = [W_UK,iᵀ q_i^C ; q_i^R], mla.hpp), every
// head scores a token against the same cached row [c ; k^R] (latent_dim + rope_dim wide) and
// mixes the same latents c (latent_dim wide):
//   out[b][i][h] = Σ_t softmax_t(scale · q̃[b][i][h] · [c_t ; k^R_t]) c_t
// for query i of sequence b at position L_b − Q + i, over the positions at or before it. W_UV
// and W_O are applied afterwards, once per head and step (mla.hpp). Keys and values are never
// rebuilt.
//
//   q    [batch][Q][heads][latent_dim + rope_dim]  fp32, the absorbed queries
//   out  [batch][Q][heads][latent_dim]             fp32, attention in latent space
//   lse  [batch][Q][heads]                         fp32, natural log, -inf for a row that sees no key; optional
//
// Every head reads the same numbers, so the work is two small matrix products per tile of
// tokens: scores S = Q̃ · Cᵀ (rows × tokens, inner width latent_dim + rope_dim) and then
// O += P · C (rows × latent_dim, inner width the tile's tokens), with an online softmax between
// them. On a CPU this is compute-bound: a tile is converted to fp32 once and then reused, from
// the caches, by every head; the products run in register blocks (rows × tokens for scores,
// rows × columns for values) that keep both FMA pipes busy. Long sequences are split into
// chunks of keys merged through their log-sum-exp (state.hpp), as decode() does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "decode.hpp"
#include "error.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "shape.hpp"
#include "simd.hpp"
#include "state.hpp"
#include "storage.hpp"

namespace kvattn {

struct MlaDecodeParams {
  int queries_per_seq = 1;        ///< Q: new tokens per sequence, the last Q of its cache
  float scale = 0.0f;             ///< softmax scale; 0: 1 / sqrt(nope_dim + rope_dim)
  std::int64_t chunk_tokens = 0;  ///< split-KV chunk length; 0: chosen from the work and `threads`
  int threads = 1;                ///< threads the parallel-for will use (for choosing chunks)
};

/// Scratch memory of mla_decode(): work items, each item's queries, tile and partial result.
/// Keep one per concurrent caller and reuse it across steps; it only grows.
using MlaDecodeWorkspace = DecodeWorkspace;

KVATTN_BEGIN_TARGET_NAMESPACE
namespace mla_impl {

/// Tokens per tile: converted to fp32 once, then read by every query row.
inline constexpr int kMlaTile = 64;
/// Register blocks. Scores: kRows query rows × kTokens tokens, one accumulator vector each
/// (lanes along the inner dimension, summed lanes-wise at the end with Vec::sum_each). Values:
/// kRows rows × kVecs vectors of columns (lanes along the latent). 16 accumulators where there
/// are 32 vector registers, 8 on AVX2.
template <class Isa> constexpr int rows_block() { return std::is_same_v<Isa, isa::avx2> ? 2 : 4; }
template <class Isa> constexpr int score_rows() { return std::is_same_v<Isa, isa::avx2> ? 2 : 4; }
template <class Isa> constexpr int score_tokens() { return std::is_same_v<Isa, isa::avx2> ? 4 : 4; }
inline constexpr int kTokens = 4;
inline constexpr int kVecs = 4;
/// Tokens of the tile scored against every row block before the next ones.
inline constexpr int kScoreGroup = 8;
/// Query rows are padded to a multiple of this (every rows_block divides it).
inline constexpr int kRowPad = 8;

constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }
using detail::kLineFloats;  // every row an item works on starts on a cache line

/// Widths of one item's arrays, in floats.
template <class Isa> struct Dims {
  int K;                 ///< scored width, latent_dim + rope_dim
  int Kp;                ///< K rounded up to whole cache lines (queries and tile rows, zero padded)
  int Dp;                ///< latent_dim rounded up to whole vectors (output columns computed)
  int rows, rows_p;      ///< query rows Q · heads, and rounded up to kRowPad
  std::int64_t o_stride;  ///< floats per output row: Dp, then {m, d}, whole cache lines

  Dims(const MlaShape& s, int Q) {
    constexpr int W = simd::Vec<Isa>::lanes;
    K = s.latent_dim + s.rope_dim;
    Kp = static_cast<int>(round_up(K, kLineFloats));
    Dp = static_cast<int>(round_up(s.latent_dim, W));
    rows = Q * s.heads;
    rows_p = static_cast<int>(round_up(rows, kRowPad));
    o_stride = round_up(Dp + 2, kLineFloats);
  }
  /// Floats of one item: outputs [rows_p][o_stride], queries [rows_p][Kp], tile [kMlaTile][Kp],
  /// probabilities [rows_p][kMlaTile], rescale factors [rows_p].
  std::int64_t item_floats() const {
    return round_up(std::int64_t{rows_p} * o_stride + std::int64_t{rows_p} * Kp + std::int64_t{kMlaTile} * Kp +
                        std::int64_t{rows_p} * kMlaTile + rows_p,
                    kLineFloats);
  }
};

/// s[r][t0 + t] = Σ_k q[r][k] · c[t][k] for R rows and kTokens tokens (rows Kp apart).
template <class Isa, int R, int kTokens>
KVATTN_ALWAYS_INLINE void score_block(const float* q, const float* c, int Kp, float (*s)[kMlaTile], int t0,
                                      const float* next_q) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, N = R * kTokens;
  static_assert(N % W == 0, "the accumulators are summed lanes-wise in groups of W");
  Vec acc[N];
  KVATTN_UNROLL for (int i = 0; i < N; ++i) acc[i] = Vec::zero();
  for (int k = 0; k < Kp; k += W) {
    if (next_q != nullptr)
      KVATTN_UNROLL for (int r = 0; r < R; ++r) KVATTN_PREFETCH(next_q + std::int64_t{r} * Kp + k);
    Vec cv[kTokens];
    KVATTN_UNROLL for (int t = 0; t < kTokens; ++t) cv[t] = Vec::load(c + std::int64_t{t} * Kp + k);
    KVATTN_UNROLL for (int r = 0; r < R; ++r) {
      const Vec qv = Vec::load(q + std::int64_t{r} * Kp + k);
      KVATTN_UNROLL for (int t = 0; t < kTokens; ++t) acc[r * kTokens + t] = fma(qv, cv[t], acc[r * kTokens + t]);
    }
  }
  alignas(64) float sums[N];
  KVATTN_UNROLL for (int g = 0; g < N; g += W) Vec::sum_each(&acc[g]).store(sums + g);
  KVATTN_UNROLL for (int r = 0; r < R; ++r)
    KVATTN_UNROLL for (int t = 0; t < kTokens; ++t) s[r][t0 + t] = sums[r * kTokens + t];
}

/// o[r][c0, c0 + V·W) = alpha[r] · o[r] + Σ_t p[r][t] c[t] over those columns, R rows.
template <class Isa, int R, int V>
KVATTN_ALWAYS_INLINE void value_block(const float* c, int Kp, int n, const float (*p)[kMlaTile], const float* alpha,
                                      float* o, std::int64_t o_stride, int c0) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  Vec acc[R][V];
  KVATTN_UNROLL for (int r = 0; r < R; ++r) {
    const Vec a = Vec::set1(alpha[r]);
    KVATTN_UNROLL for (int j = 0; j < V; ++j) acc[r][j] = Vec::load(o + r * o_stride + c0 + j * W) * a;
  }
  for (int t = 0; t < n; ++t) {
    Vec cv[V];
    KVATTN_UNROLL for (int j = 0; j < V; ++j) cv[j] = Vec::load(c + std::int64_t{t} * Kp + c0 + j * W);
    KVATTN_UNROLL for (int r = 0; r < R; ++r) {
      const Vec pr = Vec::set1(p[r][t]);
      KVATTN_UNROLL for (int j = 0; j < V; ++j) acc[r][j] = fma(pr, cv[j], acc[r][j]);
    }
  }
  KVATTN_UNROLL for (int r = 0; r < R; ++r)
    KVATTN_UNROLL for (int j = 0; j < V; ++j) acc[r][j].store(o + r * o_stride + c0 + j * W);
}

/// One work item: every query row of sequence `seq` against its key positions [begin, end).
/// Writes the normalized partial output and {m, d} of every row to `o` ([rows_p][o_stride]);
/// `scratch` holds the item's queries, tile and probabilities (Dims::item_floats).
template <class Isa, class T>
void mla_item(const PagedKvView<T>& kv, const Dims<Isa>& dims, int seq, std::int64_t begin, std::int64_t end,
              const float* q, int heads, int Q, float scale, float* o, float* scratch) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, R = rows_block<Isa>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int K = dims.K, Kp = dims.Kp, Dp = dims.Dp, rows = dims.rows, rows_p = dims.rows_p;
  const std::int64_t os = dims.o_stride;
  float* qs = scratch;                                  // [rows_p][Kp]
  float* tile = qs + std::int64_t{rows_p} * Kp;         // [kMlaTile][Kp]
  auto* s = reinterpret_cast<float (*)[kMlaTile]>(tile + std::int64_t{kMlaTile} * Kp);  // [rows_p][kMlaTile]
  float* alpha = tile + std::int64_t{kMlaTile} * Kp + std::int64_t{rows_p} * kMlaTile;   // [rows_p]

  for (int r = 0; r < rows_p; ++r) {  // start empty; queries scaled, zero padded
    float* orow = o + r * os;
    std::fill(orow, orow + Dp, 0.0f);
    orow[Dp] = kNegInf;
    orow[Dp + 1] = 0.0f;
    float* qr = qs + std::int64_t{r} * Kp;
    if (r < rows)
      for (int k = 0; k < K; ++k) qr[k] = q[std::int64_t{r} * K + k] * scale;
    std::fill(qr + (r < rows ? K : 0), qr + Kp, 0.0f);
  }
  if (begin >= end) return;
  const std::int64_t length = kv.length(seq);
  const std::int32_t* pages = kv.indices + kv.indptr[seq];
  const int P = kv.layout.page_size;
  const auto row_of = [&](std::int64_t t) { return kv.page(pages[t / P]) + kv.layout.latent(static_cast<int>(t % P)); };
  const int row_bytes = K * static_cast<int>(sizeof(T));

  for (std::int64_t t0 = begin; t0 < end; t0 += kMlaTile) {
    const int n = static_cast<int>(std::min<std::int64_t>(kMlaTile, end - t0));
    const int n_pad = static_cast<int>(round_up(n, kTokens));
    // The tile in fp32, rows Kp apart, zero padded; the next tile's rows prefetched meanwhile.
    for (int t = 0; t < n; ++t) {
      float* dst = tile + std::int64_t{t} * Kp;
      convert_row(Isa{}, row_of(t0 + t), dst, static_cast<std::size_t>(K));
      std::fill(dst + K, dst + Kp, 0.0f);
      if (t0 + kMlaTile + t < end) {
        const char* next = reinterpret_cast<const char*>(row_of(t0 + kMlaTile + t));
        for (int b = 0; b < row_bytes; b += 64) KVATTN_PREFETCH_L2(next + b);
      }
    }
    for (int t = n; t < n_pad; ++t) std::fill(tile + std::int64_t{t} * Kp, tile + std::int64_t{t + 1} * Kp, 0.0f);

    // 1. Scores of every row against the tile: groups of kScoreGroup tokens (which stay in the
    //    first-level cache) against every block of rows in turn.
    constexpr int RS = score_rows<Isa>(), NT = score_tokens<Isa>();
    for (int tg = 0; tg < n_pad; tg += kScoreGroup)
      for (int r0 = 0; r0 < rows_p; r0 += RS)
        for (int tb = tg; tb < std::min(tg + kScoreGroup, n_pad); tb += NT)
          score_block<Isa, RS, NT>(qs + std::int64_t{r0} * Kp, tile + std::int64_t{tb} * Kp, Kp, s + r0, tb,
                                   tb == tg && W > 1 ? qs + std::int64_t{(r0 + RS) % rows_p} * Kp : nullptr);

    // 2. Online softmax per row; the tokens row r sees are [0, hi) of the tile.
    for (int r = 0; r < rows_p; ++r) {
      float* orow = o + r * os;
      const std::int64_t last = r < rows ? length - Q + r / heads - t0 : -1;  // padding rows see nothing
      const int hi = static_cast<int>(std::clamp<std::int64_t>(last + 1, 0, n));
      for (int t = hi; t < kMlaTile; ++t) s[r][t] = kNegInf;
      alpha[r] = decode_impl::online_softmax<Isa, kMlaTile>(s[r], orow + Dp);
    }

    // 3. o = alpha · o + P · C over the latent columns: a block of columns of the tile (which
    //    stays in the first-level cache) against every block of rows in turn.
    int c = 0;
    for (; c + kVecs * W <= Dp; c += kVecs * W)
      for (int r0 = 0; r0 < rows_p; r0 += R) value_block<Isa, R, kVecs>(tile, Kp, n, s + r0, alpha + r0, o + r0 * os, os, c);
    for (; c < Dp; c += W)
      for (int r0 = 0; r0 < rows_p; r0 += R) value_block<Isa, R, 1>(tile, Kp, n, s + r0, alpha + r0, o + r0 * os, os, c);
  }
  for (int r = 0; r < rows; ++r) {  // normalize: o = Σ p c / d
    float* orow = o + r * os;
    if (orow[Dp + 1] > 0.0f) {
      const float inv = 1.0f / orow[Dp + 1];
      for (int c = 0; c < Dp; ++c) orow[c] *= inv;
    }
  }
}

}  // namespace mla_impl

/// MLA decode attention in latent space for a batch: see the top of this file for shapes. `kv`
/// is one layer's view of an MLA cache (PagedKvCache::view); `shape` must match its latent and
/// rotary widths. Calls pf(items, body) twice (the chunks, then their merge). Throws
/// kvattn::invalid_argument or shape_error on inconsistent arguments, before any work; the
/// kernels themselves never throw or allocate.
template <class Isa = isa::native, class T, class PF = SerialFor>
void mla_decode(const PagedKvView<T>& kv, const MlaShape& shape, const float* q, float* out, float* lse,
                const MlaDecodeParams& p, MlaDecodeWorkspace& ws, PF&& pf = PF{}, Isa = Isa{}) {
  shape.validate();
  if (kv.layout.content != PageContent::mla || kv.layout.latent_dim != shape.latent_dim ||
      kv.layout.rope_dim != shape.rope_dim)
    raise<shape_error>(detail::concat("mla_decode: shape latent_dim=", shape.latent_dim, " rope_dim=", shape.rope_dim,
                                      " does not match the cache's ",
                                      kv.layout.content == PageContent::mla ? "" : "(GQA-family) ",
                                      "latent_dim=", kv.layout.latent_dim, " rope_dim=", kv.layout.rope_dim));
  if (!(std::isfinite(p.scale) && p.scale >= 0.0f))
    raise<invalid_argument>(detail::concat("mla_decode: scale=", p.scale, ": must be finite and >= 0 (0: 1/sqrt(nope_dim + rope_dim))"));
  if (p.queries_per_seq < 1 || p.chunk_tokens < 0 || p.threads < 1)
    raise<invalid_argument>(detail::concat("mla_decode: queries_per_seq=", p.queries_per_seq, " chunk_tokens=", p.chunk_tokens,
                                           " threads=", p.threads,
                                           ": queries_per_seq and threads must be positive, chunk_tokens >= 0"));
  if (kv.batch > 0 && (q == nullptr || out == nullptr)) raise<invalid_argument>("mla_decode: q and out must not be null");

  const int Q = p.queries_per_seq, H = shape.heads, Dc = shape.latent_dim;
  const mla_impl::Dims<Isa> dims(shape, Q);
  const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(shape.qk_head_dim()));
  const std::int64_t q_seq = std::int64_t{dims.rows} * dims.K;  // floats of q per sequence
  const std::int64_t out_seq = std::int64_t{dims.rows} * Dc;

  // Work items: (sequence, chunk of keys), all heads in one item; chunks chosen by the
  // workspace are whole tiles, at least 8 of them.
  constexpr std::int64_t tile = mla_impl::kMlaTile;
  float* const base = ws.plan(kv, p.chunk_tokens, 2 * std::int64_t{p.threads}, tile, 8 * tile, dims.item_floats());

  pf(static_cast<std::int64_t>(ws.items.size()), [&](std::int64_t i) {
    const DecodeWorkspace::Item& it = ws.items[static_cast<std::size_t>(i)];
    float* o = base + it.partial;
    float* scratch = o + std::int64_t{dims.rows_p} * dims.o_stride;
    mla_impl::mla_item<Isa>(kv, dims, it.seq, it.begin, it.end, q + it.seq * q_seq, H, Q, scale, o, scratch);
  });

  // Merge each sequence's chunks, row by row, into out [b][i][h][latent_dim].
  pf(std::int64_t{kv.batch} * dims.rows, [&](std::int64_t br) {
    const int b = static_cast<int>(br / dims.rows), r = static_cast<int>(br % dims.rows);
    float* orow = out + b * out_seq + std::int64_t{r} * Dc;
    SoftmaxStats st;
    std::fill(orow, orow + Dc, 0.0f);
    const std::int64_t first = ws.first_item[static_cast<std::size_t>(b)];
    const std::int64_t last = ws.first_item[static_cast<std::size_t>(b) + 1];
    for (std::int64_t c = first; c < last; ++c) {
      const float* part = base + ws.items[static_cast<std::size_t>(c)].partial + r * dims.o_stride;
      merge_state(orow, st, part, SoftmaxStats{part[dims.Dp], part[dims.Dp + 1]}, static_cast<std::size_t>(Dc));
    }
    if (lse) lse[std::int64_t{b} * dims.rows + r] = st.lse();
  });
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
