// kvattn/prefill.hpp — causal (chunked) prefill attention for the MHA / GQA / MQA family.
//
// A chunk of new tokens per sequence: their keys and values are written into the paged cache
// (the tokens must already be appended, cache.append(seq, n), as the last n of the sequence), and
// each new token's queries attend causally to everything cached at or before its position: the
// earlier chunks as well as the new tokens before it. Chunking a prompt any way gives the same
// result as one-shot prefill. A score policy (policy.hpp) adds a variant: a sliding window, a
// soft-cap, ALiBi, attention sinks, a tree mask over the chunk's tokens, or several (compose).
//
// A step's chunks are described once (ChunkBatch: sequence b's chunk is rows
// [indptr[b], indptr[b + 1]) of q, k, v, out, lse), planned once (PrefillPlan: checks, the
// copy-on-write of shared pages for every layer, the page table, the work items and their
// scratch), and run per layer:
//   q    [total][q_heads][head_dim]   fp32 (total = the batch's tokens)
//   k, v [total][kv_heads][head_dim]  fp32, written into the layer of the cache
//   out  [total][q_heads][head_dim]   fp32
//   lse  [total][q_heads]             fp32, natural log; optional
//
// Tiled as FlashAttention is: work items are (sequence, KV head, block of query tokens), and each
// runs over the key tiles its block can see with an online softmax, so no score matrix of size
// tokens × tokens is ever materialized. Within an item the vector lanes hold query rows: scores
// of a tile, their running max and sum, and the rescaling are all computed for a whole vector of
// rows at once, so no horizontal reductions are needed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "core.hpp"
#include "error.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "policy.hpp"
#include "rope.hpp"
#include "shape.hpp"
#include "simd.hpp"
#include "state.hpp"

namespace kvattn {

KVATTN_BEGIN_TARGET_NAMESPACE
namespace prefill_impl {

using prefill_layout::kTile;
using prefill_layout::ScratchLayout;
inline constexpr int kScoreRegs = 16;  // score accumulators tile_scores keeps in registers

/// Scores of NB consecutive blocks of W query rows against a tile: sc[j][t] (a vector of W
/// rows) = Σ_d kf[t][d] · qb[j][d], kScoreRegs / NB keys per pass. Each broadcast key element
/// serves NB blocks, and the kScoreRegs accumulators fill the registers: one load per NB fused
/// multiply-adds.
///   qb  [NB][dim][W]  queries, rows in lanes     kf  [kTile][dim]     sc  [NB][kTile][W]
// (tile_scores and tile_values are not inlined: on their own, their accumulators get the vector
// registers, where inside the item the compiler was seen to spill the queries to the stack.)
template <class Isa, int HeadDim, int NB>
KVATTN_NOINLINE void tile_scores(const float* KVATTN_RESTRICT qb, const float* KVATTN_RESTRICT kf, int dim,
                                 float* KVATTN_RESTRICT sc) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, H = kScoreRegs / NB;  // keys per pass
  static_assert(kTile % H == 0);
  if constexpr (HeadDim > 0) dim = HeadDim;
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
template <class Isa, int HeadDim>
KVATTN_NOINLINE void tile_values(const float* KVATTN_RESTRICT pr, const float* KVATTN_RESTRICT alpha,
                                 const float* KVATTN_RESTRICT vf, int dim, float* KVATTN_RESTRICT o) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  constexpr int R = std::min(W, Isa::vector_registers / 4);  // rows of lanes: 4 where there are 16 registers, 8 with 32
  if constexpr (HeadDim > 0) dim = HeadDim;
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

/// One item: rows = group · tokens query rows (row r: token r / group, head r % group of the
/// group) against keys [0, last position], with the policy's window, logits and mask. Writes
/// normalized rows to out and lse. first_row: the item's first token's row along q's token
/// dimension; first_new: the position of its sequence's first new token.
template <class Isa, int HeadDim, class P, class T>
void prefill_item(const PagedKvView<T>& kv, int b, int kv_head, std::int64_t first_row, std::int64_t first_new,
                  std::int64_t first_pos, int tokens, const float* q, float* out, float* lse, int group, int q_heads,
                  float scale, const P& policy, float* scratch) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  const int dim = HeadDim > 0 ? HeadDim : kv.layout.head_dim;
  const int rows = group * tokens;
  const int blocks = (rows + W - 1) / W;
  const std::int64_t row_stride = std::int64_t{q_heads} * dim;  // floats per token in q and out
  const ScratchLayout layout = ScratchLayout::of(rows, dim, W);
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
  // What the policy is told of row r (padding rows, past the last, are told of the last: they are
  // scratch, never read, but the policy may read arrays indexed by the row).
  const auto row_of = [&](int r) {
    const int rr = r < rows ? r : rows - 1, t = rr / group;
    return QueryRow{first_row + t, first_pos + t, first_new, kv_head * group + rr % group};
  };
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  for (int blk = 0; blk < blocks; ++blk) {  // pack the queries, scaled, rows in lanes; zero the outputs
    const float* qrow[W];
    for (int l = 0; l < W; ++l) qrow[l] = blk * W + l < rows ? q_of(blk * W + l) : nullptr;
    for (int d = 0; d < dim; ++d)  // (one vector of W rows at a time: the stores are contiguous)
      for (int l = 0; l < W; ++l) qt[(std::int64_t{blk} * dim + d) * W + l] = qrow[l] ? qrow[l][d] * scale : 0.0f;
    for (int l = 0; l < W; ++l) {
      mrow[blk * W + l] = kNegInf;
      drow[blk * W + l] = 0.0f;
      std::fill(o_of(blk * W + l), o_of(blk * W + l) + dim, 0.0f);  // (padding rows too: scratch, never read)
    }
  }

  const std::int64_t last_pos = first_pos + tokens - 1;
  std::int64_t key_begin = 0;  // no row sees a key before it
  if constexpr (P::kWindow) {
    key_begin = std::numeric_limits<std::int64_t>::max();
    for (int r = 0; r < rows; ++r) key_begin = std::min(key_begin, policy_row(policy, row_of(r)).lo);
  }
  const int page_size = kv.layout.page_size;
  const std::int32_t* pages = kv.indices + kv.indptr[b];

  for (std::int64_t t0 = key_begin; t0 <= last_pos; t0 += kTile) {
    const int n = static_cast<int>(std::min<std::int64_t>(kTile, last_pos + 1 - t0));
    if (n < kTile) {  // a short last tile: zero keys and values, masked below, keep every loop kTile long
      std::fill(kf + n * dim, kf + kTile * dim, 0.0f);
      std::fill(vf + n * dim, vf + kTile * dim, 0.0f);
    }
    for (int t = 0; t < n; ++t) {  // the tile's keys and values, converted to fp32 once
      const std::int64_t pos = t0 + t;
      const T* page = kv.page(pages[pos / page_size]);
      const int slot = static_cast<int>(pos % page_size);
      const T* k = page + kv.layout.key(kv_head, slot);
      const T* v = page + kv.layout.value(kv_head, slot);
      Vec ks = Vec::set1(1.0f), vs = ks;  // the rows' or the layer's scales (format.hpp)
      if constexpr (format_traits<T>::layer_scale) {
        ks = Vec::set1(format_traits<T>::kernel_scale(kv.scales.k));
        vs = Vec::set1(format_traits<T>::kernel_scale(kv.scales.v));
      }
      if constexpr (format_traits<T>::row_scale) {
        const float* scales = reinterpret_cast<const float*>(page + kv.layout.scale_offset);
        ks = Vec::set1(scales[kv.layout.key_scale(kv_head, slot)]);
        vs = Vec::set1(scales[kv.layout.value_scale(kv_head, slot)]);
      }
      if constexpr (format_traits<T>::block_scale) {  // codes times their block's scale plus its minimum
        using Tr = format_traits<T>;
        const auto* scales = reinterpret_cast<const BlockScale*>(page + kv.layout.scale_offset);
        const BlockScale* kb = scales + kv.layout.key_scale(kv_head, slot);
        const BlockScale* vb = scales + kv.layout.value_scale(kv_head, slot);
        for (int c = 0; c < dim; c += 2 * W) {  // (head_dim is whole blocks: whole pairs of vectors)
          Vec d, m, a, b2;
          Vec::block_scale(kb + c / Tr::block, d, m);
          Vec::load_pair(k + c / Tr::values_per_unit, a, b2);
          fma(a, d, m).store(kf + t * dim + c);
          fma(b2, d, m).store(kf + t * dim + c + W);
          Vec::block_scale(vb + c / Tr::block, d, m);
          Vec::load_pair(v + c / Tr::values_per_unit, a, b2);
          fma(a, d, m).store(vf + t * dim + c);
          fma(b2, d, m).store(vf + t * dim + c + W);
        }
      } else {
        int c = 0;
        for (; c + W <= dim; c += W) {
          (Vec::load(k + c) * ks).store(kf + t * dim + c);
          (Vec::load(v + c) * vs).store(vf + t * dim + c);
        }
        if (c < dim) {
          (Vec::load_partial(k + c, dim - c) * ks).store_partial(kf + t * dim + c, dim - c);
          (Vec::load_partial(v + c, dim - c) * vs).store_partial(vf + t * dim + c, dim - c);
        }
      }
      if constexpr (format_traits<T>::rotated) {  // back from the rotated basis (format.hpp)
        hadamard_rotate(kf + t * dim, dim);
        hadamard_rotate(vf + t * dim, dim);
      }
    }
    for (int blk = 0; blk < blocks; ++blk) {
      const int r0 = blk * W;
      const std::int64_t block_last = first_pos + std::min(rows - 1, r0 + W - 1) / group;
      const std::int64_t block_first = first_pos + r0 / group;
      // Scores, rows in lanes: s[t] = Σ_d k_t[d] · q_rows[d], for blocks blk and blk + 1 together
      // (each key element loaded once for both) unless neither sees this tile.
      if (blk % 2 == 0 && t0 <= first_pos + std::min(rows - 1, r0 + 2 * W - 1) / group) {
        const float* qb = qt + std::int64_t{blk} * dim * W;
        if (blk + 1 < blocks)
          tile_scores<Isa, HeadDim, 2>(qb, kf, dim, sc);
        else
          tile_scores<Isa, HeadDim, 1>(qb, kf, dim, sc);
      }
      if (t0 > block_last) continue;  // causal: no row of this block sees this tile
      float* sb = sc + (blk % 2) * kTile * W;  // this block's scores: [kTile][W]
      if constexpr (P::kLogits)
        for (int l = 0; l < W; ++l) {
          const PolicyRow row = policy_row(policy, row_of(r0 + l));
          for (int t = 0; t < kTile; ++t) sb[t * W + l] = policy_logit(policy, row, sb[t * W + l], t0 + t);
        }
      // Some row cannot see some key of the tile (or its zero padding): causally, by the window,
      // or by the mask. Then every lane's keys as policy.hpp's sees() says (padding rows, told of
      // the last row, see what it sees; they are never read).
      bool masked = t0 + kTile - 1 > block_first;
      if constexpr (P::kWindow || P::kMask)
        for (int l = 0; l < W && !masked; ++l) {
          const PolicyRow row = policy_row(policy, row_of(r0 + l));
          masked = t0 < row.lo || t0 + kTile > row.mask_from;
        }
      if (masked)
        for (int l = 0; l < W; ++l) {
          const PolicyRow row = policy_row(policy, row_of(r0 + l));
          for (int t = 0; t < kTile; ++t)
            if (!sees(policy, row, t0 + t)) sb[t * W + l] = kNegInf;
        }
      // Online softmax for W rows at once.
      Vec block_max = Vec::load(sb);
      for (int t = 1; t < kTile; ++t) block_max = max(block_max, Vec::load(sb + t * W));
      const SoftmaxStep<Vec> step = softmax_step(Vec::load(mrow + r0), block_max);
      float alpha[W];
      step.alpha.store(alpha);
      Vec sum[2] = {Vec::zero(), Vec::zero()};  // (two chains of additions)
      for (int t = 0; t < kTile; ++t) {
        const Vec e = exp(Vec::load(sb + t * W) - step.shift);
        e.store(pr + t * W);
        sum[t % 2] = sum[t % 2] + e;
      }
      fma(Vec::load(drow + r0), step.alpha, sum[0] + sum[1]).store(drow + r0);
      step.m.store(mrow + r0);
      tile_values<Isa, HeadDim>(pr, alpha, vf, dim, o_of(r0));
    }
  }
  for (int r = 0; r < rows; ++r) {  // normalize into out (the sink counted once), and the log-sum-exp
    const float* o = o_of(r);
    float* dst = out_of(r);
    SoftmaxStats st{mrow[r], drow[r]};
    float factor = st.d > 0.0f ? 1.0f / st.d : 0.0f;  // (a row that saw nothing has o = 0)
    factor *= sink_factor(policy, st, kv_head * group + r % group);
    for (int c = 0; c < dim; ++c) dst[c] = o[c] * factor;
    if (lse) lse[(r / group) * q_heads + kv_head * group + r % group] = st.lse();
  }
}

}  // namespace prefill_impl

/// Chunked causal prefill of one layer for the step `plan` was made for (PrefillPlan::make); see
/// the top of this file for shapes. Writes the chunks' keys and values into `layer` (after
/// rotating them, with PrefillParams::rope), then attends; `policy` adds a variant (policy.hpp).
/// Throws kvattn::invalid_argument before anything is written when the plan does not fit (another
/// cache, a cache changed since, a layer out of range), the policy does not fit the call, or an
/// array is null.
template <class T, class M, class PF = SerialFor, class P = Plain, class IsaTag = isa::native>
void prefill(PagedKvCache<T, M>& cache, int layer, const float* q, const float* k, const float* v, float* out, float* lse,
             PrefillPlan& plan, PF&& pf = PF{}, const P& policy = P{}, IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  static_assert(format_traits<T>::latent_block == 0, "kvattn::prefill: an MLA format's cache is filled by mla_prefill");
  plan.check("prefill", cache, layer);
  check_policy("prefill", policy, plan.policy_call());
  const ChunkBatch& batch = plan.batch();
  if (batch.total() > 0 && (q == nullptr || k == nullptr || v == nullptr || out == nullptr))
    raise<invalid_argument>("prefill: q, k, v and out must not be null");
  const GqaShape& shape = plan.shape();
  const int group = shape.group_size(), dim = shape.head_dim;

  // With RoPE, copies of the chunk's queries and keys are rotated at their positions (q and k are
  // only read), blocks of tokens in parallel; everything below reads the copies.
  if (plan.params().rope != nullptr) {
    const std::int64_t total = batch.total();
    const std::int64_t q_row = std::int64_t{shape.q_heads} * dim, k_row = std::int64_t{shape.kv_heads} * dim;
    constexpr std::int64_t kRopeTokens = 64;  // tokens per work item
    const Rope& rope = *plan.params().rope;
    float* const rq = plan.rotated_q();
    float* const rk = plan.rotated_k();
    pf((total + kRopeTokens - 1) / kRopeTokens, [&](std::int64_t i) {
      const std::int64_t t0 = i * kRopeTokens, n = std::min(kRopeTokens, total - t0);
      std::copy(q + t0 * q_row, q + (t0 + n) * q_row, rq + t0 * q_row);
      std::copy(k + t0 * k_row, k + (t0 + n) * k_row, rk + t0 * k_row);
      apply_rope(rope, rq + t0 * q_row, n, shape.q_heads, plan.positions() + t0, Isa{});
      apply_rope(rope, rk + t0 * k_row, n, shape.kv_heads, plan.positions() + t0, Isa{});
    });
    q = rq;
    k = rk;
  }

  // The chunks' keys and values go into the cache first (their pages are private: the plan made
  // them so, and nothing has changed the cache since).
  for (int b = 0; b < batch.size(); ++b) {
    if (batch.tokens(b) == 0) continue;
    const std::int64_t offset = batch.indptr()[static_cast<std::size_t>(b)] * shape.kv_heads * dim;
    cache.write(batch.seq(b), layer, plan.first_pos(b), batch.tokens(b), k + offset, v + offset);
  }

  const PagedKvView<T> kv = cache.view(plan.table(), layer);
  const std::int64_t row = std::int64_t{shape.q_heads} * dim;
  const std::vector<PrefillPlan::Item>& items = plan.items();
  const std::int64_t n_items = static_cast<std::int64_t>(items.size()), lanes = plan.lanes();
  const float scale = plan.scale();
  dispatch_head_dim(dim, [&](auto head_dim) {
    constexpr int HeadDim = decltype(head_dim)::value;
    pf(lanes, [&](std::int64_t lane) {
      float* scratch = plan.lane_scratch(lane);
      for (std::int64_t i = lane; i < n_items; i += lanes) {
        const PrefillPlan::Item& it = items[static_cast<std::size_t>(i)];
        const std::int64_t first_row = batch.indptr()[static_cast<std::size_t>(it.batch_index)];
        const std::int64_t first_new = plan.first_pos(it.batch_index);
        const std::int64_t first_pos = first_new + (it.q_begin - first_row);
        float* l = lse ? lse + it.q_begin * shape.q_heads : nullptr;
        prefill_impl::prefill_item<Isa, HeadDim>(kv, it.batch_index, it.kv_head, it.q_begin, first_new, first_pos,
                                                 static_cast<int>(it.q_end - it.q_begin), q + it.q_begin * row,
                                                 out + it.q_begin * row, l, group, shape.q_heads, scale, policy, scratch);
      }
    });
  });
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
