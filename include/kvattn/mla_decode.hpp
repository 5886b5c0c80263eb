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
// them. On a CPU this is compute-bound: a tile is converted to fp32 once (for an MLA format,
// format.hpp, each block of latent codes times its scale, and the bf16 rotary key) and then
// reused, from the caches, by every head; the products run in register blocks (rows × tokens for scores,
// rows × columns for values) that keep both FMA pipes busy. Long sequences are split into
// chunks of keys merged through their log-sum-exp (state.hpp), as decode() does. A score policy
// (policy.hpp) adds a variant, as for decode(); calls take the step's DecodePlan (core.hpp),
// made with the MlaShape.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
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
#include "storage.hpp"

namespace kvattn {

KVATTN_BEGIN_TARGET_NAMESPACE
namespace mla_impl {

using decode_layout::kMlaTile;  // tokens per tile: converted to fp32 once, then read by every query row
using Dims = decode_layout::Mla;
/// Register blocks. Scores: score_rows() query rows × kScoreTokens tokens, one accumulator vector
/// each (lanes along the inner dimension, summed lanes-wise at the end with Vec::sum_each).
/// Values: rows_block() rows × kVecs vectors of columns (lanes along the latent). 16 accumulators
/// where there are 32 vector registers, 8 where there are 16.
template <class Isa> constexpr int rows_block() { return Isa::vector_registers >= 32 ? 4 : 2; }
template <class Isa> constexpr int score_rows() { return Isa::vector_registers >= 32 ? 4 : 2; }
inline constexpr int kScoreTokens = 4;
inline constexpr int kVecs = 4;
/// Tokens of the tile scored against every row block before the next ones.
inline constexpr int kScoreGroup = 8;
static_assert(decode_layout::kMlaRowPad % 4 == 0, "the row blocks (2 or 4 rows) divide the padded rows");

constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

/// s[r][t0 + t] = Σ_k q[r][k] · c[t][k] for R rows and NT tokens (rows Kp apart).
template <class Isa, int R, int NT>
KVATTN_ALWAYS_INLINE void score_block(const float* q, const float* c, int Kp, float (*s)[kMlaTile], int t0,
                                      const float* next_q) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, N = R * NT;
  static_assert(N % W == 0, "the accumulators are summed lanes-wise in groups of W");
  Vec acc[N];
  KVATTN_UNROLL for (int i = 0; i < N; ++i) acc[i] = Vec::zero();
  for (int k = 0; k < Kp; k += W) {
    if (next_q != nullptr)
      KVATTN_UNROLL for (int r = 0; r < R; ++r) KVATTN_PREFETCH(next_q + std::int64_t{r} * Kp + k);
    Vec cv[NT];
    KVATTN_UNROLL for (int t = 0; t < NT; ++t) cv[t] = Vec::load(c + std::int64_t{t} * Kp + k);
    KVATTN_UNROLL for (int r = 0; r < R; ++r) {
      const Vec qv = Vec::load(q + std::int64_t{r} * Kp + k);
      KVATTN_UNROLL for (int t = 0; t < NT; ++t) acc[r * NT + t] = fma(qv, cv[t], acc[r * NT + t]);
    }
  }
  alignas(64) float sums[N];
  KVATTN_UNROLL for (int g = 0; g < N; g += W) Vec::sum_each(&acc[g]).store(sums + g);
  KVATTN_UNROLL for (int r = 0; r < R; ++r)
    KVATTN_UNROLL for (int t = 0; t < NT; ++t) s[r][t0 + t] = sums[r * NT + t];
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

/// An MLA format's row (format.hpp: latent codes, a scale per block of them, the rotary key in
/// bf16) as fp32 [latent_dim + rope_dim]: each block's codes times its scale, then the rotary key.
template <class Isa, class T>
KVATTN_ALWAYS_INLINE void latent_row_to_float(const T* row, const PageLayout& l, float* dst) noexcept {
  using Tr = format_traits<T>;
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes, B = Tr::latent_block;
  static_assert(B % W == 0, "a latent block is whole vectors");
  const auto* codes = static_cast<const typename Tr::code*>(row);
  const float* scales = reinterpret_cast<const float*>(row + l.latent_dim);
  for (int b = 0; b < l.latent_dim; b += B) {
    const Vec s = Vec::set1(Tr::kernel_scale(scales[b / B]));
    KVATTN_UNROLL for (int c = 0; c < B; c += W) (Vec::load(codes + b + c) * s).store(dst + b + c);
  }
  convert_row(Isa{}, reinterpret_cast<const bf16*>(row + l.rope_offset), dst + l.latent_dim, static_cast<std::size_t>(l.rope_dim));
}

/// One work item: every query row of the batch's sequence b against its key positions
/// [begin, end), with the policy's window, logits and mask. Writes the normalized partial output
/// and {m, d} of every row to `o` ([rows_p][o_stride]); `scratch` holds the item's queries, tile
/// and probabilities (Dims::item_floats).
template <class Isa, class P, class T>
void mla_item(const PagedKvView<T>& kv, const Dims& dims, int b, std::int64_t begin, std::int64_t end, const float* q,
              int heads, int Q, float scale, const P& policy, float* o, float* scratch) noexcept {
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
  const std::int64_t length = kv.length(b);
  const std::int32_t* pages = kv.indices + kv.indptr[b];
  const int page_size = kv.layout.page_size;
  const auto row_of = [&](std::int64_t t) {
    return kv.page(pages[t / page_size]) + kv.layout.latent(static_cast<int>(t % page_size));
  };
  const auto row_bytes = static_cast<int>(kv.layout.row_stride * static_cast<std::int64_t>(sizeof(T)));

  for (std::int64_t t0 = begin; t0 < end; t0 += kMlaTile) {
    const int n = static_cast<int>(std::min<std::int64_t>(kMlaTile, end - t0));
    const int n_pad = static_cast<int>(round_up(n, kScoreTokens));
    // The tile in fp32, rows Kp apart, zero padded; the next tile's rows prefetched meanwhile.
    for (int t = 0; t < n; ++t) {
      float* dst = tile + std::int64_t{t} * Kp;
      if constexpr (format_traits<T>::latent_block > 0)
        latent_row_to_float<Isa>(row_of(t0 + t), kv.layout, dst);
      else
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
    constexpr int RS = score_rows<Isa>(), NT = kScoreTokens;
    for (int tg = 0; tg < n_pad; tg += kScoreGroup)
      for (int r0 = 0; r0 < rows_p; r0 += RS)
        for (int tb = tg; tb < std::min(tg + kScoreGroup, n_pad); tb += NT)
          score_block<Isa, RS, NT>(qs + std::int64_t{r0} * Kp, tile + std::int64_t{tb} * Kp, Kp, s + r0, tb,
                                   tb == tg && W > 1 ? qs + std::int64_t{(r0 + RS) % rows_p} * Kp : nullptr);

    // 2. Per row: the policy's part (window, logits, mask), then the online softmax. Padding rows
    //    see nothing (told of the last row, at position -1).
    for (int r = 0; r < rows_p; ++r) {
      const int rr = r < rows ? r : rows - 1, i = rr / heads;
      const QueryRow row{std::int64_t{b} * Q + i, r < rows ? length - Q + i : -1, length - Q, rr - i * heads};
      core_impl::policy_tile<kMlaTile>(policy, row, t0, n, s[r]);
      alpha[r] = core_impl::row_softmax<Isa, kMlaTile>(s[r], o + r * os + Dp);
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


/// mla_decode with the scale given (mla_decode_layer: 1, the fold has it); `op` names the caller.
template <class T, class PF, class P, class Isa>
void run(const char* op, const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, PF&& pf,
         const P& policy, float scale, Isa) {
  const MlaShape& shape = plan.check_call<MlaShape>(op, kv, policy, q, out, plan.policy_call());
  const int Q = plan.params().queries_per_seq, H = shape.heads, Dc = shape.latent_dim;
  const Dims dims(shape, Q);
  const std::int64_t q_seq = std::int64_t{dims.rows} * dims.K;  // floats of q per sequence
  const std::int64_t out_seq = std::int64_t{dims.rows} * Dc;
  float* const base = plan.scratch();
  const std::vector<DecodePlan::Item>& items = plan.items();

  // Work items: (sequence, chunk of keys), all heads in one item.
  pf(static_cast<std::int64_t>(items.size()), [&](std::int64_t i) {
    const DecodePlan::Item& it = items[static_cast<std::size_t>(i)];
    float* o = base + it.partial;
    float* scratch = o + std::int64_t{dims.rows_p} * dims.o_stride;
    mla_item<Isa>(kv, dims, it.batch_index, it.begin, it.end, q + it.batch_index * q_seq, H, Q, scale, policy, o, scratch);
  });

  // Merge each sequence's chunks (and the sink, counted once), row by row, into out [b][i][h][latent_dim].
  pf(std::int64_t{kv.batch} * dims.rows, [&](std::int64_t br) {
    const int b = static_cast<int>(br / dims.rows), r = static_cast<int>(br % dims.rows);
    float* orow = out + b * out_seq + std::int64_t{r} * Dc;
    SoftmaxStats st;
    std::fill(orow, orow + Dc, 0.0f);
    for (std::int64_t c = plan.first_item(b); c < plan.first_item(b + 1); ++c) {
      const float* part = base + items[static_cast<std::size_t>(c)].partial + r * dims.o_stride;
      merge_state(orow, st, part, SoftmaxStats{part[dims.Dp], part[dims.Dp + 1]}, static_cast<std::size_t>(Dc));
    }
    if constexpr (P::kSink) {
      const float f = sink_factor(policy, st, r % H);
      for (int c = 0; c < Dc; ++c) orow[c] *= f;
    }
    if (lse) lse[std::int64_t{b} * dims.rows + r] = st.lse();
  });
}
}  // namespace mla_impl

/// MLA decode attention in latent space for a batch: see the top of this file for shapes. `kv`
/// is one layer's view of an MLA cache (PagedKvCache::view) for the batch `plan` was made for
/// (DecodePlan::make, with the MlaShape); `policy` adds a variant (policy.hpp). Calls
/// pf(items, body) twice (the chunks, then their merge). Throws kvattn::invalid_argument or
/// shape_error on inconsistent arguments, before any work; the kernels themselves never throw or
/// allocate.
template <class T, class PF = SerialFor, class P = Plain, class IsaTag = isa::native>
void mla_decode(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, PF&& pf = PF{},
                const P& policy = P{}, IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  static_assert(!format_traits<T>::row_scale && !format_traits<T>::layer_scale && !format_traits<T>::block_scale,
                "kvattn::mla_decode: MLA caches are fp32, fp16, bf16, fp8_e4m3_latent or int8_latent");
  mla_impl::run("mla_decode", kv, q, out, lse, plan, pf, policy, plan.scale(), Isa{});
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
