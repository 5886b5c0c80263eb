// kvattn/prefill.hpp — causal (chunked) prefill attention for the MHA / GQA / MQA family.
//
// A chunk of n new tokens per sequence: their keys and values are written into the paged cache
// (the tokens must already be appended, cache.append(seq, n), as the last n of the sequence), and
// each new token's queries attend causally to everything cached at or before its position: the
// earlier chunks as well as the new tokens before it. Chunking a prompt any way gives the same
// result as one-shot prefill.
//
//   q_indptr [batch + 1]                 sequence b's chunk is rows [q_indptr[b], q_indptr[b+1])
//   q        [total][q_heads][head_dim]  fp32 (total = q_indptr[batch])
//   k, v     [total][kv_heads][head_dim] fp32, written into `layer` of the cache
//   out      [total][q_heads][head_dim]  fp32
//   lse      [total][q_heads]            fp32, natural log; optional
//
// Tiled as FlashAttention is: work items are (sequence, KV head, block of query tokens), and each
// runs over the key tiles its block can see with an online softmax, so no score matrix of size
// tokens × tokens is ever materialized. Within an item the vector lanes hold query rows: scores
// of a tile, their running max and sum, and the rescaling are all computed for a whole vector of
// rows at once, so no horizontal reductions are needed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "rope.hpp"
#include "simd.hpp"

namespace kvattn {

struct PrefillParams {
  float scale = 0.0f;            ///< softmax scale; 0: 1 / sqrt(head_dim)
  std::int64_t window = 0;       ///< sliding window W (Variant<true, ...>)
  float soft_cap = 0.0f;         ///< soft-cap (Variant<..., true>), > 0
  /// Query tokens per work item, from 1 to kMaxQueryBlock; a chunk shorter than this is one block.
  int query_block = 64;
  /// The largest query_block, and the most query rows (group size × the block actually used) one
  /// item may hold: an item's scratch grows with its rows.
  static constexpr int kMaxQueryBlock = 4096;
  static constexpr std::int64_t kMaxItemRows = std::int64_t{1} << 20;
  /// Rotary position embedding: when set, the chunk's queries and keys are rotated at their
  /// positions (each token's index in its sequence) before the keys are cached and attended to;
  /// q and k are only read (the rotated copies live in the workspace). rope->head_dim() must
  /// equal shape.head_dim. Null: q and k are used as given.
  const Rope* rope = nullptr;
};

/// Scratch memory of prefill(); reuse it across calls. The fields belong to prefill().
struct PrefillWorkspace {
  struct Item {
    std::int32_t seq, kv_head;
    std::int64_t q_begin, q_end;  ///< rows of q (global token index)
  };
  std::vector<Item> items;
  std::vector<float> scratch;  ///< per lane: packed queries, a tile's keys and values, probabilities, stats
  std::vector<float> rotated_q;  ///< with PrefillParams::rope: [total][q_heads][head_dim] the queries, rotated
  std::vector<float> rotated_k;  ///< with PrefillParams::rope: [total][kv_heads][head_dim] the keys, rotated
  std::vector<std::int64_t> positions;  ///< with PrefillParams::rope: [total] each chunk token's position
};

KVATTN_BEGIN_TARGET_NAMESPACE
namespace prefill_impl {

inline constexpr int kTile = 32;  // keys per tile: each output row is loaded, rescaled and stored once per tile
inline constexpr int kScoreRegs = 16;  // score accumulators tile_scores keeps in registers

/// Lanes of work items per hardware thread (see prefill()): enough that a parallel-for handing
/// out lanes one at a time still balances them over its threads.
inline constexpr int kLanesPerThread = 8;

/// An item's scratch: where each region starts, in floats from the item's start, which is on a
/// cache line, as every region's is (a vector load that straddles two lines costs two: on
/// AVX-512, every load of the kernel's inner loops).
struct ScratchLayout {
  std::int64_t qt;       ///< queries, transposed per block of W rows: [block][dim][W], pre-scaled
  std::int64_t kf, vf;   ///< the tile's keys and values as fp32: [kTile][dim] each
  std::int64_t pr;       ///< probabilities of one row block: [kTile][W]
  std::int64_t mrow, drow;  ///< running max and sum per row: [blocks · W] each
  std::int64_t sc;       ///< scores of two blocks of rows: [2][kTile][W]
  std::int64_t acc_out;  ///< the outputs, accumulated: [blocks · W][dim] (padding rows too)
  std::int64_t floats;   ///< in all, a whole number of cache lines

  template <class Isa> static constexpr ScratchLayout of(std::int64_t rows, int dim) noexcept {
    constexpr int W = simd::Vec<Isa>::lanes;
    const std::int64_t blocks = (rows + W - 1) / W;
    std::int64_t at = 0;
    const auto take = [&at](std::int64_t n) {
      const std::int64_t start = at;
      at += detail::whole_lines(n);
      return start;
    };
    ScratchLayout l{};
    l.qt = take(blocks * W * dim);
    l.kf = take(std::int64_t{kTile} * dim);
    l.vf = take(std::int64_t{kTile} * dim);
    l.pr = take(kTile * W);
    l.mrow = take(blocks * W);
    l.drow = take(blocks * W);
    l.sc = take(2 * kTile * W);
    l.acc_out = take(blocks * W * dim);
    l.floats = at;
    return l;
  }
};

/// Scores of NB consecutive blocks of W query rows against a tile: sc[j][t] (a vector of W
/// rows) = Σ_d kf[t][d] · qb[j][d], kScoreRegs / NB keys per pass. Each broadcast key element
/// serves NB blocks, and the kScoreRegs accumulators fill the registers: one load per NB fused
/// multiply-adds.
///   qb  [NB][dim][W]  queries, rows in lanes     kf  [kTile][dim]     sc  [NB][kTile][W]
// (tile_scores and tile_values are not inlined: on their own, their accumulators get the vector
// registers, where inside the item the compiler was seen to spill the queries to the stack.)
template <class Isa, int D, int NB>
KVATTN_NOINLINE void tile_scores(const float* KVATTN_RESTRICT qb, const float* KVATTN_RESTRICT kf, int dim,
                                 float* KVATTN_RESTRICT sc) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, H = kScoreRegs / NB;  // keys per pass
  static_assert(kTile % H == 0);
  if constexpr (D > 0) dim = D;
  for (int h0 = 0; h0 < kTile; h0 += H) {
    Vec acc[NB][H];
    KVATTN_UNROLL for (int j = 0; j < NB; ++j)
      KVATTN_UNROLL for (int t = 0; t < H; ++t) acc[j][t] = Vec::zero();
    for (int d = 0; d < dim; ++d) {
      Vec qd[NB];
      KVATTN_UNROLL for (int j = 0; j < NB; ++j) qd[j] = Vec::load(qb + (std::int64_t{j} * dim + d) * W);
      KVATTN_UNROLL for (int t = 0; t < H; ++t) {
        const Vec k = Vec::set1(kf[(h0 + t) * dim + d]);
        KVATTN_UNROLL for (int j = 0; j < NB; ++j) acc[j][t] = fma(k, qd[j], acc[j][t]);
      }
    }
    KVATTN_UNROLL for (int j = 0; j < NB; ++j)
      KVATTN_UNROLL for (int t = 0; t < H; ++t) acc[j][t].store(sc + (j * kTile + h0 + t) * W);
  }
}

/// o_r = α_r · o_r + Σ_t p[t][r] · v_t for one block of W rows (padding rows included: they are
/// scratch, never read), R rows × 2 vectors of columns in registers at once: 2R independent
/// accumulators cover the fused multiply-add latency.
///   pr  [kTile][W]  probabilities, rows in lanes     alpha [W]     vf [kTile][dim]     o [W][dim]
template <class Isa, int D>
KVATTN_NOINLINE void tile_values(const float* KVATTN_RESTRICT pr, const float* KVATTN_RESTRICT alpha,
                                 const float* KVATTN_RESTRICT vf, int dim, float* KVATTN_RESTRICT o) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  constexpr int R = std::is_same_v<Isa, isa::avx2> ? 4 : (W < 8 ? W : 8);  // 16 vector registers on AVX2
  if constexpr (D > 0) dim = D;
  for (int l0 = 0; l0 < W; l0 += R, o += std::int64_t{R} * dim) {
    const float* prl = pr + l0;
    int c = 0;
    for (; c + 2 * W <= dim; c += 2 * W) {
      Vec acc[R][2];
      KVATTN_UNROLL for (int j = 0; j < R; ++j) {
        const Vec al = Vec::set1(alpha[l0 + j]);
        acc[j][0] = Vec::load(o + j * dim + c) * al;
        acc[j][1] = Vec::load(o + j * dim + c + W) * al;
      }
      for (int t = 0; t < kTile; ++t) {
        const Vec v0 = Vec::load(vf + t * dim + c), v1 = Vec::load(vf + t * dim + c + W);
        KVATTN_UNROLL for (int j = 0; j < R; ++j) {
          const Vec pj = Vec::set1(prl[t * W + j]);
          acc[j][0] = fma(pj, v0, acc[j][0]);
          acc[j][1] = fma(pj, v1, acc[j][1]);
        }
      }
      KVATTN_UNROLL for (int j = 0; j < R; ++j) {
        acc[j][0].store(o + j * dim + c);
        acc[j][1].store(o + j * dim + c + W);
      }
    }
    for (int j = 0; j < R; ++j)  // columns left over (head sizes not a multiple of 2 · W)
      for (int cc = c; cc < dim; ++cc) {
        float a = o[j * dim + cc] * alpha[l0 + j];
        for (int t = 0; t < kTile; ++t) a += prl[t * W + j] * vf[t * dim + cc];
        o[j * dim + cc] = a;
      }
  }
}

/// One item: rows = group · (q_end - q_begin) query rows (row r: token r / group, head r % group
/// of the group) against keys [0, last position]. Writes normalized rows to out and lse.
template <class Isa, int D, class V, class T>
void prefill_item(const PagedKvView<T>& kv, int seq, int kv_head, std::int64_t first_pos, int tokens, const float* q,
                  float* out, float* lse, int group, int q_heads, float scale, const PrefillParams& p,
                  float* scratch) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  const int dim = D > 0 ? D : kv.layout.head_dim;
  const int rows = group * tokens;
  const int blocks = (rows + W - 1) / W;
  const std::int64_t row_stride = std::int64_t{q_heads} * dim;  // floats per token in q and out
  const ScratchLayout layout = ScratchLayout::of<Isa>(rows, dim);
  float* qt = scratch + layout.qt;            // [blocks][dim][W]
  float* kf = scratch + layout.kf;            // [kTile][dim]
  float* vf = scratch + layout.vf;            // [kTile][dim]
  float* pr = scratch + layout.pr;            // [kTile][W]
  float* mrow = scratch + layout.mrow;        // [blocks · W]
  float* drow = scratch + layout.drow;        // [blocks · W]
  float* sc = scratch + layout.sc;            // [2][kTile][W] scores of two blocks
  float* acc_out = scratch + layout.acc_out;  // [blocks · W][dim]
  const auto q_of = [&](int r) { return q + (r / group) * row_stride + std::int64_t{kv_head * group + r % group} * dim; };
  // Outputs accumulate in scratch, rows dim apart, and reach `out` (rows q_heads · dim apart,
  // a multiple of 4 KiB for the common shapes: they would share cache sets) once, normalized.
  const auto o_of = [&](int r) { return acc_out + std::int64_t{r} * dim; };
  const auto out_of = [&](int r) { return out + (r / group) * row_stride + std::int64_t{kv_head * group + r % group} * dim; };
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  for (int b = 0; b < blocks; ++b) {  // pack the queries, scaled, rows in lanes; zero the outputs
    const float* qrow[W];
    for (int l = 0; l < W; ++l) qrow[l] = b * W + l < rows ? q_of(b * W + l) : nullptr;
    for (int d = 0; d < dim; ++d)  // (one vector of W rows at a time: the stores are contiguous)
      for (int l = 0; l < W; ++l) qt[(std::int64_t{b} * dim + d) * W + l] = qrow[l] ? qrow[l][d] * scale : 0.0f;
    for (int l = 0; l < W; ++l) {
      mrow[b * W + l] = kNegInf;
      drow[b * W + l] = 0.0f;
      std::fill(o_of(b * W + l), o_of(b * W + l) + dim, 0.0f);  // (padding rows too: scratch, never read)
    }
  }

  const std::int64_t last_pos = first_pos + tokens - 1;
  std::int64_t key_begin = 0;
  if constexpr (V::sliding_window) key_begin = std::max<std::int64_t>(0, first_pos - p.window + 1);
  const int P = kv.layout.page_size;
  const std::int32_t* pages = kv.indices + kv.indptr[seq];

  for (std::int64_t t0 = key_begin; t0 <= last_pos; t0 += kTile) {
    const int n = static_cast<int>(std::min<std::int64_t>(kTile, last_pos + 1 - t0));
    if (n < kTile) {  // a short last tile: zero keys and values, masked below, keep every loop kTile long
      std::fill(kf + n * dim, kf + kTile * dim, 0.0f);
      std::fill(vf + n * dim, vf + kTile * dim, 0.0f);
    }
    for (int t = 0; t < n; ++t) {  // the tile's keys and values, converted to fp32 once
      const std::int64_t pos = t0 + t;
      const T* page = kv.page(pages[pos / P]);
      const int slot = static_cast<int>(pos % P);
      const T* k = page + kv.layout.key(kv_head, slot);
      const T* v = page + kv.layout.value(kv_head, slot);
      int c = 0;
      for (; c + W <= dim; c += W) {
        Vec::load(k + c).store(kf + t * dim + c);
        Vec::load(v + c).store(vf + t * dim + c);
      }
      if (c < dim) {
        Vec::load_partial(k + c, dim - c).store_partial(kf + t * dim + c, dim - c);
        Vec::load_partial(v + c, dim - c).store_partial(vf + t * dim + c, dim - c);
      }
    }
    for (int b = 0; b < blocks; ++b) {
      const int r0 = b * W;
      const std::int64_t block_last = first_pos + std::min(rows - 1, r0 + W - 1) / group;
      const std::int64_t block_first = first_pos + r0 / group;
      // Scores, rows in lanes: s[t] = Σ_d k_t[d] · q_rows[d], for blocks b and b + 1 together
      // (each key element loaded once for both) unless neither sees this tile.
      if (b % 2 == 0 && t0 <= first_pos + std::min(rows - 1, r0 + 2 * W - 1) / group) {
        const float* qb = qt + std::int64_t{b} * dim * W;
        if (b + 1 < blocks)
          tile_scores<Isa, D, 2>(qb, kf, dim, sc);
        else
          tile_scores<Isa, D, 1>(qb, kf, dim, sc);
      }
      if (t0 > block_last) continue;  // causal: no row of this block sees this tile
      float* sb = sc + (b % 2) * kTile * W;  // this block's scores: [kTile][W]
      if constexpr (V::soft_cap)
        for (int i = 0; i < kTile * W; ++i) sb[i] = p.soft_cap * std::tanh(sb[i] / p.soft_cap);
      const bool diagonal = t0 + kTile - 1 > block_first;  // some row cannot see some key (or padding)
      const bool windowed = V::sliding_window && t0 <= block_last - p.window;
      if (diagonal || windowed) {
        std::int64_t qpos[W];  // each lane's token position
        for (int l = 0; l < W; ++l) qpos[l] = first_pos + (r0 + l) / group;
        for (int t = 0; t < kTile; ++t)
          for (int l = 0; l < W; ++l) {
            const std::int64_t pos = t0 + t;
            bool visible = pos <= qpos[l];  // (padding lies past last_pos, so past every qpos)
            if constexpr (V::sliding_window) visible = visible && pos > qpos[l] - p.window;
            if (!visible) sb[t * W + l] = kNegInf;
          }
      }
      // Online softmax for W rows at once.
      const Vec m_old = Vec::load(mrow + r0);
      Vec m_new = m_old;
      for (int t = 0; t < kTile; ++t) m_new = max(m_new, Vec::load(sb + t * W));
      // α = exp(m_old - m_new) is 0 for a row that had seen nothing (m_old = -inf, also when
      // m_new is: simd exp maps NaN to 0); a row that still sees nothing shifts by the lowest
      // finite float instead of -inf, so its probabilities are exp(-inf) = 0, never NaN.
      const Vec a = exp(m_old - m_new);
      const Vec shift = max(m_new, Vec::set1(std::numeric_limits<float>::lowest()));
      float alpha[W];
      a.store(alpha);
      Vec sum[2] = {Vec::zero(), Vec::zero()};  // (two chains of additions)
      for (int t = 0; t < kTile; ++t) {
        const Vec e = exp(Vec::load(sb + t * W) - shift);
        e.store(pr + t * W);
        sum[t % 2] = sum[t % 2] + e;
      }
      fma(Vec::load(drow + r0), a, sum[0] + sum[1]).store(drow + r0);
      m_new.store(mrow + r0);
      tile_values<Isa, D>(pr, alpha, vf, dim, o_of(r0));
    }
  }
  for (int r = 0; r < rows; ++r) {  // normalize into out, and the log-sum-exp
    const float* o = o_of(r);
    float* dst = out_of(r);
    const float dsum = drow[r];
    const float inv = dsum > 0.0f ? 1.0f / dsum : 0.0f;  // (a row that saw nothing has o = 0)
    for (int c = 0; c < dim; ++c) dst[c] = o[c] * inv;
    if (lse) lse[(r / group) * q_heads + kv_head * group + r % group] = SoftmaxStats{mrow[r], dsum}.lse();
  }
}

}  // namespace prefill_impl

/// Chunked causal prefill for one layer of a batch; see the top of this file for shapes. Each
/// sequence appears once in `seqs`. All or nothing: every argument is checked and the shared
/// pages of every chunk are copied (copy-on-write, PagedKvCache::make_writable) before any key
/// or value is written; a pool too small for those copies throws capacity_error with the cache
/// unchanged.
template <class V = Plain, class Isa = isa::native, class T, class M, class PF = SerialFor>
void prefill(PagedKvCache<T, M>& cache, int layer, const std::vector<SeqId>& seqs, const std::int64_t* q_indptr,
             const GqaShape& shape, const float* q, const float* k, const float* v, float* out, float* lse,
             const PrefillParams& p, PrefillWorkspace& ws, PF&& pf = PF{}, Isa = Isa{}) {
  detail::check_attention_args<V>("prefill", shape, cache.layout(), p.scale, p.window, p.soft_cap);
  if (p.query_block < 1 || p.query_block > PrefillParams::kMaxQueryBlock)
    raise<invalid_argument>(detail::concat("prefill: query_block=", p.query_block, ": must be from 1 to ",
                                           PrefillParams::kMaxQueryBlock));
  if (p.rope != nullptr && p.rope->head_dim() != shape.head_dim)
    raise<shape_error>(detail::concat("prefill: rope head_dim=", p.rope->head_dim(), " does not match shape head_dim=",
                                      shape.head_dim));
  const int batch = static_cast<int>(seqs.size());
  if (q_indptr[0] != 0) raise<invalid_argument>(detail::concat("prefill: q_indptr[0]=", q_indptr[0], ": must be 0"));
  for (int b = 0; b < batch; ++b) {
    const std::int64_t n = q_indptr[b + 1] - q_indptr[b];
    if (n < 0 || n > cache.length(seqs[static_cast<std::size_t>(b)]))
      raise<invalid_argument>(detail::concat("prefill: sequence ", seqs[static_cast<std::size_t>(b)], " has a chunk of ", n,
                                             " tokens but holds ", cache.length(seqs[static_cast<std::size_t>(b)]),
                                             " (append the chunk first)"));
  }
  if (layer < 0 || layer >= cache.config().layers)
    raise<invalid_argument>(detail::concat("prefill: layer=", layer, " is outside [0, ", cache.config().layers, ")"));
  // The block actually used: no longer than the longest chunk. Its rows size every item's scratch,
  // counted in 64 bits before anything is allocated.
  std::int64_t longest = 0;
  for (int b = 0; b < batch; ++b) longest = std::max(longest, q_indptr[b + 1] - q_indptr[b]);
  const int query_block = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(p.query_block, longest)));
  if (std::int64_t{shape.group_size()} * query_block > PrefillParams::kMaxItemRows)
    raise<invalid_argument>(detail::concat("prefill: query_block=", p.query_block, " with group size ", shape.group_size(),
                                           " makes items of ", std::int64_t{shape.group_size()} * query_block,
                                           " query rows: at most ", PrefillParams::kMaxItemRows));
  // Every chunk's pages are made private (copy-on-write) before anything is written, for the
  // whole batch at once: a pool too small for the copies of a later sequence fails the call
  // before an earlier sequence has changed (the writes below then copy nothing and cannot fail).
  {
    std::vector<TokenRange> ranges(static_cast<std::size_t>(batch));
    for (int b = 0; b < batch; ++b) {
      const SeqId s = seqs[static_cast<std::size_t>(b)];
      const std::int64_t n = q_indptr[b + 1] - q_indptr[b];
      ranges[static_cast<std::size_t>(b)] = {s, cache.length(s) - n, n};
    }
    cache.make_writable(ranges);
  }

  // With RoPE, copies of the chunk's queries and keys are rotated at their positions (q and k are
  // only read), blocks of tokens in parallel; everything below reads the copies.
  if (p.rope != nullptr) {
    const std::int64_t total = q_indptr[batch];
    const std::int64_t q_row = std::int64_t{shape.q_heads} * shape.head_dim;
    const std::int64_t k_row = std::int64_t{shape.kv_heads} * shape.head_dim;
    const auto grow = [](auto& buffer, std::int64_t n) {
      if (buffer.size() < static_cast<std::size_t>(n)) buffer.resize(static_cast<std::size_t>(n));
    };
    grow(ws.rotated_q, total * q_row);
    grow(ws.rotated_k, total * k_row);
    grow(ws.positions, total);
    for (int b = 0; b < batch; ++b) {
      const std::int64_t chunk_first = cache.length(seqs[static_cast<std::size_t>(b)]) - (q_indptr[b + 1] - q_indptr[b]);
      for (std::int64_t t = q_indptr[b]; t < q_indptr[b + 1]; ++t)
        ws.positions[static_cast<std::size_t>(t)] = chunk_first + (t - q_indptr[b]);
    }
    constexpr std::int64_t kRopeTokens = 64;  // tokens per work item
    const Rope& rope = *p.rope;
    const auto rotate = [&](std::int64_t i) {
      const std::int64_t t0 = i * kRopeTokens, n = std::min(kRopeTokens, total - t0);
      float* qr = ws.rotated_q.data() + t0 * q_row;
      float* kr = ws.rotated_k.data() + t0 * k_row;
      std::copy(q + t0 * q_row, q + (t0 + n) * q_row, qr);
      std::copy(k + t0 * k_row, k + (t0 + n) * k_row, kr);
      apply_rope(rope, qr, n, shape.q_heads, ws.positions.data() + t0, Isa{});
      apply_rope(rope, kr, n, shape.kv_heads, ws.positions.data() + t0, Isa{});
    };
    pf((total + kRopeTokens - 1) / kRopeTokens, rotate);
    q = ws.rotated_q.data();
    k = ws.rotated_k.data();
  }

  // The chunk's keys and values go into the cache first.
  for (int b = 0; b < batch; ++b) {
    const SeqId s = seqs[static_cast<std::size_t>(b)];
    const std::int64_t n = q_indptr[b + 1] - q_indptr[b];
    if (n == 0) continue;
    const std::int64_t offset = q_indptr[b] * shape.kv_heads * shape.head_dim;
    cache.write(s, layer, cache.length(s) - n, n, k + offset, v + offset);
  }

  const int group = shape.group_size(), D = shape.head_dim;
  const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(D));
  // Items from the last query block of each sequence to the first: the later a block, the more
  // keys it sees, and each lane below then ends on its cheap items.
  ws.items.clear();
  for (int b = 0; b < batch; ++b)
    for (std::int64_t n = q_indptr[b + 1] - q_indptr[b], t = q_indptr[b] + (n - 1) / query_block * query_block;
         n > 0 && t >= q_indptr[b]; t -= query_block)
      for (int h = 0; h < shape.kv_heads; ++h)
        ws.items.push_back({b, h, t, std::min<std::int64_t>(q_indptr[b + 1], t + query_block)});
  // The items are dealt round-robin into lanes, a few per hardware thread; the parallel-for runs
  // the lanes, and a lane runs its items one after another in a scratch of its own. The scratch
  // thus grows with the machine, not with the prompt, and stays warm from item to item; and as
  // consecutive items (the KV heads of one query block) cost the same, the lanes do too. Every
  // lane's scratch starts on a cache line (per_lane is a whole number of them).
  const std::int64_t n_items = static_cast<std::int64_t>(ws.items.size());
  const std::int64_t lanes = std::min<std::int64_t>(n_items, std::int64_t{prefill_impl::kLanesPerThread} * hardware_threads());
  const std::int64_t per_lane = prefill_impl::ScratchLayout::of<Isa>(std::int64_t{group} * query_block, D).floats;
  const std::size_t scratch_floats = static_cast<std::size_t>(per_lane * lanes + detail::kLineFloats);
  if (ws.scratch.size() < scratch_floats) ws.scratch.resize(scratch_floats);
  float* const scratch_base = detail::align_to_line(ws.scratch.data());

  const BatchPageTable table = cache.page_table(seqs);
  const PagedKvView<T> kv = cache.view(table, layer);
  const std::int64_t row = std::int64_t{shape.q_heads} * D;
  const auto run_item = [&](std::int64_t i, float* scratch) {
    const PrefillWorkspace::Item& it = ws.items[static_cast<std::size_t>(i)];
    const std::int64_t chunk_first = kv.length(it.seq) - (q_indptr[it.seq + 1] - q_indptr[it.seq]);
    const std::int64_t first_pos = chunk_first + (it.q_begin - q_indptr[it.seq]);
    const int tokens = static_cast<int>(it.q_end - it.q_begin);
    float* l = lse ? lse + it.q_begin * shape.q_heads : nullptr;
    const float* qi = q + it.q_begin * row;
    float* oi = out + it.q_begin * row;
    switch (D) {
      case 64: prefill_impl::prefill_item<Isa, 64, V>(kv, it.seq, it.kv_head, first_pos, tokens, qi, oi, l, group, shape.q_heads, scale, p, scratch); break;
      case 128: prefill_impl::prefill_item<Isa, 128, V>(kv, it.seq, it.kv_head, first_pos, tokens, qi, oi, l, group, shape.q_heads, scale, p, scratch); break;
      case 256: prefill_impl::prefill_item<Isa, 256, V>(kv, it.seq, it.kv_head, first_pos, tokens, qi, oi, l, group, shape.q_heads, scale, p, scratch); break;
      default: prefill_impl::prefill_item<Isa, 0, V>(kv, it.seq, it.kv_head, first_pos, tokens, qi, oi, l, group, shape.q_heads, scale, p, scratch); break;
    }
  };
  pf(lanes, [&](std::int64_t lane) {
    for (std::int64_t i = lane; i < n_items; i += lanes) run_item(i, scratch_base + lane * per_lane);
  });
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
