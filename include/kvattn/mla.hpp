// kvattn/mla.hpp — one multi-head latent attention (MLA) layer: weights, the latent cache's
// append, the unfolded prefill, the fold, and the folded decode step.
//
// The equations (DeepSeek-V2; DESIGN.md, "MLA and the folded decode path"), per token with hidden
// state h at position p and per head i:
//   c^Q   = W_DQ h                       query latent [q_latent_dim] (or c^Q = h without one)
//   q_i   = [q_i^C ; q_i^R] = W_UQ,i c^Q  [nope_dim ; rope_dim], q_i^R then rotated: RoPE(q_i^R, p)
//   c     = W_DKV h                      the cached latent [latent_dim]
//   k^R   = RoPE(W_KR h, p)              the cached rotary key [rope_dim], shared by every head
//   k_i   = [W_UK,i c ; k^R],  v_i = W_UV,i c
//   o_i   = Σ_t softmax_t(q_i · k_i,t / sqrt(nope_dim + rope_dim)) v_i,t   (causal)
//   out   = W_O [o_0 ; ... ; o_{heads-1}]
// (The normalizations DeepSeek applies to c^Q and c are the engine's: they sit outside
// attention, before the cache.)
//
// Two ways to compute it:
//   unfolded (mla_prefill, a batch of chunks): rebuild k_i and v_i of every cached token from its latent and run
//     causal attention; many queries share the rebuild, so it suits prefill, and it is the
//     oracle of the folded path;
//   folded (fold, mla_decode_layer): W_UK,i moves onto the query (q̃_i = W_UK,iᵀ q_i^C) and
//     W_UV,i onto the output, so each step scores straight against the cached latents
//     (mla_decode.hpp) and keys and values are never rebuilt.
//
// Weights are given as plain row-major arrays (fp32, fp16 or bf16) and held in fp32; the fold
// multiplies them in double and rounds once. Matrix work goes through Eigen (single-threaded);
// attention in mla_decode_layer through the caller's parallel-for. The rotary embedding is plain
// RoPE of any base (DeepSeek's YaRN rescaling of the frequencies is not applied).
// (GCC 12 with AVX-512 may report -Wmaybe-uninitialized, or at -O1 and -O2 -Wuninitialized,
// inside Eigen's matrix products inlined into these functions: GCC bug 105593, a false
// positive; kvattn's own programs that include this header turn those warnings off.)
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "eigen.hpp"  // <Eigen/Core>, and kvattn's 16-bit types beside Eigen's
#include "core.hpp"
#include "error.hpp"
#include "mla_decode.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "policy.hpp"
#include "rope.hpp"
#include "shape.hpp"
#include "storage.hpp"

namespace kvattn {

/// The weights of one MLA layer as row-major arrays (rows are outputs). q_in is q_latent_dim
/// with a query latent, hidden without; head i's rows come together, in the order given.
template <class T> struct MlaWeightArrays {
  const T* q_down = nullptr;    ///< W_DQ  [q_latent_dim][hidden]; only with a query latent
  const T* q_up = nullptr;      ///< W_UQ  [heads][nope_dim + rope_dim][q_in]: head i's [q_i^C ; q_i^R] rows
  const T* kv_down = nullptr;   ///< W_DKV [latent_dim][hidden]
  const T* rope_key = nullptr;  ///< W_KR  [rope_dim][hidden]
  const T* k_up = nullptr;      ///< W_UK  [heads][nope_dim][latent_dim]
  const T* v_up = nullptr;      ///< W_UV  [heads][v_head_dim][latent_dim]
  const T* out = nullptr;       ///< W_O   [hidden][heads · v_head_dim]
};

/// Row-major fp32 matrix, the type every MLA weight is held in.
using MlaMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// One MLA layer's weights in fp32 and its rotary embedding (the rotary part of queries and keys,
/// rope_dim wide; DeepSeek pairs adjacent elements: RopeStyle::gptj).
class MlaWeights {
 public:
  /// Copies the arrays (converted to fp32). Throws kvattn::shape_error for an invalid shape, a
  /// hidden size below 1 or a RoPE whose width is not rope_dim, kvattn::invalid_argument for a
  /// null array the shape needs.
  template <class T>
  MlaWeights(const MlaShape& shape, int hidden, const MlaWeightArrays<T>& w, const RopeConfig& rope)
      : shape_(checked(shape, hidden, rope)), hidden_(hidden), rope_(rope) {
    const auto need = [](const void* p, const char* name) {
      if (p == nullptr) raise<invalid_argument>(detail::concat("MlaWeights: ", name, " must not be null"));
    };
    if (shape.has_q_latent()) need(w.q_down, "q_down (W_DQ; the shape has q_latent_dim > 0)");
    need(w.q_up, "q_up (W_UQ)");
    need(w.kv_down, "kv_down (W_DKV)");
    need(w.rope_key, "rope_key (W_KR)");
    need(w.k_up, "k_up (W_UK)");
    need(w.v_up, "v_up (W_UV)");
    need(w.out, "out (W_O)");
    const int H = shape.heads;
    if (shape.has_q_latent()) load(q_down_, w.q_down, shape.q_latent_dim, hidden);
    load(q_up_, w.q_up, H * shape.qk_head_dim(), q_in());
    load(kv_down_, w.kv_down, shape.latent_dim, hidden);
    load(rope_key_, w.rope_key, shape.rope_dim, hidden);
    load(k_up_, w.k_up, H * shape.nope_dim, shape.latent_dim);
    load(v_up_, w.v_up, H * shape.v_head_dim, shape.latent_dim);
    load(out_, w.out, hidden, H * shape.v_head_dim);
  }

  const MlaShape& shape() const noexcept { return shape_; }
  int hidden() const noexcept { return hidden_; }
  const Rope& rope() const noexcept { return rope_; }
  /// Width of what W_UQ multiplies: q_latent_dim, or hidden without a query latent.
  int q_in() const noexcept { return shape_.has_q_latent() ? shape_.q_latent_dim : hidden_; }
  /// Softmax scale of the scores, 1 / sqrt(nope_dim + rope_dim).
  double scale() const noexcept { return 1.0 / std::sqrt(static_cast<double>(shape_.qk_head_dim())); }

  const MlaMatrix& q_down() const noexcept { return q_down_; }      ///< [q_latent_dim][hidden] (empty without)
  const MlaMatrix& q_up() const noexcept { return q_up_; }          ///< [heads · (nope + rope)][q_in]
  const MlaMatrix& kv_down() const noexcept { return kv_down_; }    ///< [latent_dim][hidden]
  const MlaMatrix& rope_key() const noexcept { return rope_key_; }  ///< [rope_dim][hidden]
  const MlaMatrix& k_up() const noexcept { return k_up_; }          ///< [heads · nope_dim][latent_dim]
  const MlaMatrix& v_up() const noexcept { return v_up_; }          ///< [heads · v_head_dim][latent_dim]
  const MlaMatrix& out() const noexcept { return out_; }            ///< [hidden][heads · v_head_dim]

 private:
  static const MlaShape& checked(const MlaShape& shape, int hidden, const RopeConfig& rope) {
    shape.validate();
    if (hidden < 1) raise<shape_error>(detail::concat("MlaWeights: hidden=", hidden, ": must be positive"));
    if (rope.head_dim != shape.rope_dim || rope.rotary_width() != shape.rope_dim)
      raise<shape_error>(detail::concat("MlaWeights: RoPE head_dim=", rope.head_dim, " rotary_dim=", rope.rotary_dim,
                                        ": MLA rotates the whole rotary part, so both must be rope_dim=", shape.rope_dim,
                                        " (or rotary_dim=0)"));
    return shape;
  }
  template <class T> static void load(MlaMatrix& m, const T* p, int rows, int cols) {
    m.resize(rows, cols);
    for (std::int64_t i = 0; i < std::int64_t{rows} * cols; ++i) m.data()[i] = static_cast<float>(p[i]);
  }

  MlaShape shape_;
  int hidden_;
  Rope rope_;
  MlaMatrix q_down_, q_up_, kv_down_, rope_key_, k_up_, v_up_, out_;
};

/// How fold() treats each side: multiply the two matrices of a side into one (the query side:
/// A_i = W_UK,iᵀ W_UQ,i^C; the output side: B_i = W_O,i W_UV,i) or keep them apart.
/// `cheapest` fuses a side only where that needs fewer multiply-adds per token (MlaFoldCost;
/// never for DeepSeek-V2, V2-Lite or V3, whose latent is four times a head: there the fold
/// keeps the matrices apart, arranged per head and scaled).
enum class MlaFoldChoice { cheapest, fused, separate };

/// Multiply-adds per token of each side of a decode step, with the side's two matrices fused
/// into one or kept apart (what MlaFoldChoice::cheapest compares). For DeepSeek-V2 (hidden 5120,
/// query latent 1536): query 100.7M fused against 33.6M apart, output 335.5M against 92.3M.
struct MlaFoldCost {
  double query_fused = 0, query_apart = 0, output_fused = 0, output_apart = 0;

  static MlaFoldCost of(const MlaShape& s, int hidden) noexcept {
    const double H = s.heads, Dc = s.latent_dim, qin = s.has_q_latent() ? s.q_latent_dim : hidden;
    return {H * Dc * qin, H * s.nope_dim * (qin + Dc), double(hidden) * H * Dc, H * s.v_head_dim * (Dc + hidden)};
  }
};

/// What a folded decode step multiplies by, made once per layer by fold(). The softmax scale is
/// folded into the query matrices, so scores need no scaling.
struct MlaFolded {
  MlaShape shape;
  int hidden = 0;
  Rope rope{RopeConfig{RopeStyle::gptj, 2, 0, 10000.0}};
  MlaMatrix q_down;  ///< W_DQ [q_latent_dim][hidden] (empty without a query latent)
  bool fused_query = false;
  MlaMatrix q_absorb;  ///< fused: [heads · latent_dim][q_in], scale · W_UK,iᵀ W_UQ,i^C per head
  MlaMatrix q_nope;    ///< separate: [heads · nope_dim][q_in], the W_UQ,i^C rows
  MlaMatrix k_up;      ///< separate: [heads · nope_dim][latent_dim], scale · W_UK,i
  MlaMatrix q_rope;    ///< [heads · rope_dim][q_in], scale · W_UQ,i^R
  bool fused_output = false;
  MlaMatrix out_absorb;  ///< fused: [hidden][heads · latent_dim], W_O,i W_UV,i per head
  MlaMatrix v_up;        ///< separate: [heads · v_head_dim][latent_dim]
  MlaMatrix out;         ///< separate: [hidden][heads · v_head_dim]

  std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (const MlaMatrix* m : {&q_down, &q_absorb, &q_nope, &k_up, &q_rope, &out_absorb, &v_up, &out})
      n += static_cast<std::size_t>(m->size()) * sizeof(float);
    return n;
  }
};

/// Scratch memory of the MLA layer functions; reuse it across calls (it only grows). The fields
/// belong to those functions; each holds, for the tokens of a call:
struct MlaWorkspace {
  MlaMatrix latent;        ///< [tokens][latent_dim] latents (mla_prefill: every cached token's)
  MlaMatrix rope_key;      ///< [tokens][rope_dim] rotary keys, rotated (mla_prefill: every cached token's)
  MlaMatrix query_latent;  ///< [tokens][q_latent_dim] c^Q
  MlaMatrix query;         ///< [tokens][heads][nope_dim + rope_dim] queries (mla_decode_layer: absorbed, [heads][latent_dim + rope_dim])
  MlaMatrix query_rope;    ///< [tokens][heads][rope_dim] the queries' rotary parts
  MlaMatrix query_nope;    ///< [tokens][heads][nope_dim or latent_dim] mla_decode_layer: the non-rotary parts before W_UK
  MlaMatrix head_kv;       ///< mla_prefill: one head's rebuilt keys [L][nope_dim] then values [L][v_head_dim]
  MlaMatrix scores;        ///< mla_prefill: one block of queries' probabilities over the keys it sees
  MlaMatrix attention;     ///< [tokens][heads][v_head_dim] (mla_decode_layer: [heads][latent_dim]) attention outputs
  MlaMatrix values;        ///< mla_decode_layer: [tokens][heads][v_head_dim] W_UV applied
  std::vector<std::int64_t> positions;  ///< [tokens] each token's position
};

KVATTN_BEGIN_TARGET_NAMESPACE
namespace mla_layer_impl {

using Map = Eigen::Map<MlaMatrix>;
using ConstMap = Eigen::Map<const MlaMatrix>;

/// Rotates the rotary parts [tokens][heads][rope_dim] in place at `positions`.
template <class Isa>
void rotate(const Rope& rope, MlaMatrix& x, int heads, const std::int64_t* positions) {
  apply_rope<Isa>(rope, x.data(), x.rows(), heads, positions);
}

/// Latents [tokens][latent_dim] and rotated rotary keys [tokens][rope_dim] of hidden states.
template <class Isa>
void latents(const MlaWeights& w, const float* hidden, std::int64_t tokens, const std::int64_t* positions,
             MlaMatrix& latent, MlaMatrix& rope_key) {
  const ConstMap h(hidden, tokens, w.hidden());
  latent.noalias() = h * w.kv_down().transpose();
  rope_key.noalias() = h * w.rope_key().transpose();
  rotate<Isa>(w.rope(), rope_key, 1, positions);
}

/// Queries [tokens][heads][nope_dim + rope_dim] of hidden states, rotary parts rotated; rq and cq
/// are scratch.
template <class Isa>
void queries(const MlaWeights& w, const float* hidden, std::int64_t tokens, const std::int64_t* positions,
             MlaMatrix& q, MlaMatrix& rq, MlaMatrix& cq) {
  const MlaShape& s = w.shape();
  const ConstMap h(hidden, tokens, w.hidden());
  if (s.has_q_latent()) {
    cq.noalias() = h * w.q_down().transpose();
    q.noalias() = cq * w.q_up().transpose();
  } else {
    q.noalias() = h * w.q_up().transpose();
  }
  const int K = s.qk_head_dim();
  rq.resize(tokens, std::int64_t{s.heads} * s.rope_dim);
  for (int i = 0; i < s.heads; ++i) rq.middleCols(std::int64_t{i} * s.rope_dim, s.rope_dim) = q.middleCols(std::int64_t{i} * K + s.nope_dim, s.rope_dim);
  rotate<Isa>(w.rope(), rq, s.heads, positions);
  for (int i = 0; i < s.heads; ++i) q.middleCols(std::int64_t{i} * K + s.nope_dim, s.rope_dim) = rq.middleCols(std::int64_t{i} * s.rope_dim, s.rope_dim);
}

/// The cache holds MLA pages of the weights' widths, and `layer` is one of its layers.
template <class T, class M> void check_cache(const char* op, const MlaShape& s, const PagedKvCache<T, M>& cache, int layer) {
  detail::check_layout(op, s, cache.layout());
  if (layer < 0 || layer >= cache.config().layers)
    raise<invalid_argument>(detail::concat(op, ": layer=", layer, " is outside [0, ", cache.config().layers, ")"));
}
template <class T, class M> void check_sequence(const char* op, const PagedKvCache<T, M>& cache, SeqId seq) {
  if (!cache.contains(seq)) raise<invalid_argument>(detail::concat(op, "(seq=", seq, "): no such sequence"));
}

/// Unfolded MLA of one sequence's last `count` tokens, whose pages are writable (see mla_prefill).
template <class Isa, class T, class M>
void prefill_sequence(const MlaWeights& w, PagedKvCache<T, M>& cache, SeqId seq, int layer, std::int64_t count,
                      const float* hidden, float* out, MlaWorkspace& ws);

}  // namespace mla_layer_impl

/// The fold: what a folded decode step needs, from the layer's weights, computed once per layer
/// (see MlaFolded and MlaFoldChoice). Products are formed in double and rounded to fp32 once.
template <class Isa = isa::native>
MlaFolded fold(const MlaWeights& w, MlaFoldChoice choice = MlaFoldChoice::cheapest, Isa = Isa{}) {
  using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const MlaShape& s = w.shape();
  const int H = s.heads, K = s.qk_head_dim(), Dc = s.latent_dim, hid = w.hidden(), qin = w.q_in();
  const double scale = w.scale();
  MlaFolded f;
  f.shape = s;
  f.hidden = hid;
  f.rope = w.rope();
  f.q_down = w.q_down();
  const MlaFoldCost cost = MlaFoldCost::of(s, hid);
  f.fused_query = choice == MlaFoldChoice::fused || (choice == MlaFoldChoice::cheapest && cost.query_fused < cost.query_apart);
  f.fused_output = choice == MlaFoldChoice::fused || (choice == MlaFoldChoice::cheapest && cost.output_fused < cost.output_apart);

  f.q_rope.resize(std::int64_t{H} * s.rope_dim, qin);
  for (int i = 0; i < H; ++i)
    f.q_rope.middleRows(std::int64_t{i} * s.rope_dim, s.rope_dim) =
        (w.q_up().middleRows(std::int64_t{i} * K + s.nope_dim, s.rope_dim).cast<double>() * scale).cast<float>();
  if (f.fused_query) {
    f.q_absorb.resize(std::int64_t{H} * Dc, qin);
    for (int i = 0; i < H; ++i) {
      const MatrixD uk = w.k_up().middleRows(std::int64_t{i} * s.nope_dim, s.nope_dim).cast<double>();  // [nope][Dc]
      const MatrixD uq = w.q_up().middleRows(std::int64_t{i} * K, s.nope_dim).cast<double>();         // [nope][qin]
      f.q_absorb.middleRows(std::int64_t{i} * Dc, Dc) = ((uk.transpose() * uq) * scale).cast<float>();
    }
  } else {
    f.q_nope.resize(std::int64_t{H} * s.nope_dim, qin);
    for (int i = 0; i < H; ++i)
      f.q_nope.middleRows(std::int64_t{i} * s.nope_dim, s.nope_dim) = w.q_up().middleRows(std::int64_t{i} * K, s.nope_dim);
    f.k_up = (w.k_up().cast<double>() * scale).cast<float>();
  }
  if (f.fused_output) {
    f.out_absorb.resize(hid, std::int64_t{H} * Dc);
    for (int i = 0; i < H; ++i) {
      const MatrixD wo = w.out().middleCols(std::int64_t{i} * s.v_head_dim, s.v_head_dim).cast<double>();  // [hid][v]
      const MatrixD uv = w.v_up().middleRows(std::int64_t{i} * s.v_head_dim, s.v_head_dim).cast<double>();  // [v][Dc]
      f.out_absorb.middleCols(std::int64_t{i} * Dc, Dc) = (wo * uv).cast<float>();
    }
  } else {
    f.v_up = w.v_up();
    f.out = w.out();
  }
  return f;
}

/// Computes the latents and rotated rotary keys of tokens [first, first + count) of `seq` from
/// their hidden states [count][hidden] (token first + i at position first + i) and writes them
/// into `layer` of the cache (the tokens must be appended already). Every check comes first, and
/// a call that fails leaves the cache exactly as it was: kvattn::shape_error when the cache is
/// not an MLA cache of the weights' widths; kvattn::invalid_argument for an unknown sequence, a
/// layer out of range, a range outside the sequence or a null `hidden`; kvattn::capacity_error
/// when shared pages must be copied and the pool is short (PagedKvCache::write_latent).
template <class IsaTag = isa::native, class T, class M>
void mla_append(const MlaWeights& w, PagedKvCache<T, M>& cache, SeqId seq, int layer, std::int64_t first,
                std::int64_t count, const float* hidden, MlaWorkspace& ws, IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  mla_layer_impl::check_cache("mla_append", w.shape(), cache, layer);
  mla_layer_impl::check_sequence("mla_append", cache, seq);
  const std::int64_t length = cache.length(seq);
  if (count <= 0 || first < 0 || first > length - count)
    raise<invalid_argument>(detail::concat("mla_append(seq=", seq, ", position=", first, ", count=", count,
                                           "): the sequence holds ", length, " tokens"));
  if (hidden == nullptr) raise<invalid_argument>("mla_append: hidden must not be null");
  ws.positions.resize(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) ws.positions[static_cast<std::size_t>(i)] = first + i;
  mla_layer_impl::latents<Isa>(w, hidden, count, ws.positions.data(), ws.latent, ws.rope_key);
  cache.write_latent(seq, layer, first, count, ws.latent.data(), ws.rope_key.data());
}

/// Unfolded MLA for a batch of chunks (a prefill step, or a decode step done the unfolded way):
/// each sequence's chunk is its last batch.tokens(b) tokens (appended already). Writes their
/// latents (mla_append), rebuilds every cached token's per-head key and value from its latent, and
/// runs causal attention of the chunk's queries over them, head by head, in blocks of queries (no
/// tokens × tokens score matrix).
///   hidden  [total][hidden]  fp32, the chunks' hidden states (sequence b's are rows
///                             [batch.indptr()[b], batch.indptr()[b + 1]))
///   out     [total][hidden]  fp32, W_O times the heads' attention outputs
/// All or nothing: every chunk is checked and the shared pages of every chunk are copied
/// (copy-on-write) before anything is written. Throws kvattn::shape_error when the cache is not an
/// MLA cache of the weights' widths; kvattn::invalid_argument for a layer out of range, an unknown
/// or repeated sequence, a chunk longer than its sequence or a null array; kvattn::capacity_error
/// when the pool cannot hold the copies.
template <class IsaTag = isa::native, class T, class M>
void mla_prefill(const MlaWeights& w, PagedKvCache<T, M>& cache, int layer, const ChunkBatch& batch, const float* hidden,
                 float* out, MlaWorkspace& ws, IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  using namespace mla_layer_impl;
  constexpr const char* op = "mla_prefill";
  check_cache(op, w.shape(), cache, layer);
  std::vector<TokenRange> ranges(static_cast<std::size_t>(batch.size()));
  for (int b = 0; b < batch.size(); ++b) {
    check_sequence(op, cache, batch.seq(b));
    const std::int64_t n = batch.tokens(b), L = cache.length(batch.seq(b));
    if (n > L)
      raise<invalid_argument>(detail::concat(op, ": sequence ", batch.seq(b), " has a chunk of ", n, " tokens but holds ", L,
                                             " (append the chunk first)"));
    ranges[static_cast<std::size_t>(b)] = {batch.seq(b), L - n, n};
  }
  if (batch.total() > 0 && (hidden == nullptr || out == nullptr)) raise<invalid_argument>("mla_prefill: hidden and out must not be null");
  cache.make_writable(ranges, op);
  const std::int64_t width = w.hidden();
  for (int b = 0; b < batch.size(); ++b)
    if (batch.tokens(b) > 0) {
      const std::int64_t row = batch.indptr()[static_cast<std::size_t>(b)];
      prefill_sequence<Isa>(w, cache, batch.seq(b), layer, batch.tokens(b), hidden + row * width, out + row * width, ws);
    }
}

namespace mla_layer_impl {
template <class Isa, class T, class M>
void prefill_sequence(const MlaWeights& w, PagedKvCache<T, M>& cache, SeqId seq, int layer, std::int64_t count,
                      const float* hidden, float* out, MlaWorkspace& ws) {
  const std::int64_t L = cache.length(seq), first = L - count;
  mla_append<Isa>(w, cache, seq, layer, first, count, hidden, ws);

  const MlaShape& s = w.shape();
  const int H = s.heads, K = s.qk_head_dim(), Dc = s.latent_dim, Dv = s.v_head_dim;
  // Every cached token's latent and rotary key, as stored (rounded to T), in fp32.
  MlaMatrix& lat = ws.latent;
  MlaMatrix& kr = ws.rope_key;
  lat.resize(L, Dc);
  kr.resize(L, s.rope_dim);
  for (std::int64_t t = 0; t < L; ++t) cache.read_latent(seq, layer, t, lat.row(t).data(), kr.row(t).data());
  queries<Isa>(w, hidden, count, ws.positions.data(), ws.query, ws.query_rope, ws.query_latent);  // (positions: set by mla_append)
  const MlaMatrix& q = ws.query;
  MlaMatrix& o = ws.attention;  // [count][heads · v]
  o.resize(count, std::int64_t{H} * Dv);
  MlaMatrix& kv = ws.head_kv;  // head i's rebuilt keys [L][nope] then values [L][v]
  MlaMatrix& sc = ws.scores;   // scores of a block of queries
  const float scale = static_cast<float>(w.scale());
  constexpr std::int64_t kBlock = 64;
  for (int i = 0; i < H; ++i) {
    kv.resize(L, s.nope_dim + Dv);
    kv.leftCols(s.nope_dim).noalias() = lat * w.k_up().middleRows(std::int64_t{i} * s.nope_dim, s.nope_dim).transpose();
    kv.rightCols(Dv).noalias() = lat * w.v_up().middleRows(std::int64_t{i} * Dv, Dv).transpose();
    for (std::int64_t j0 = 0; j0 < count; j0 += kBlock) {
      const std::int64_t n = std::min(kBlock, count - j0), keys = first + j0 + n;  // keys the block can see
      sc.resize(n, keys);
      sc.noalias() = q.block(j0, std::int64_t{i} * K, n, s.nope_dim) * kv.topLeftCorner(keys, s.nope_dim).transpose();
      sc.noalias() += q.block(j0, std::int64_t{i} * K + s.nope_dim, n, s.rope_dim) * kr.topRows(keys).transpose();
      for (std::int64_t j = 0; j < n; ++j) {  // softmax of row j over positions <= first + j0 + j
        const std::int64_t seen = first + j0 + j + 1;
        auto row = sc.row(j);
        row.head(seen) *= scale;
        const float m = row.head(seen).maxCoeff();
        row.head(seen) = (row.head(seen).array() - m).exp().matrix();
        row.head(seen) /= row.head(seen).sum();
        row.tail(keys - seen).setZero();
      }
      o.block(j0, std::int64_t{i} * Dv, n, Dv).noalias() = sc * kv.topRightCorner(keys, Dv);
    }
  }
  Map(out, count, w.hidden()).noalias() = o * w.out().transpose();
}
}  // namespace mla_layer_impl

/// One folded decode step of an MLA layer for a batch: every sequence's last Q tokens (their
/// latents written already, mla_append) attend over the sequence's cache, scored straight
/// against the latents (mla_decode).
///   kv      one layer's view of the cache (PagedKvCache::view), the batch `plan` was made for
///   hidden  [batch][Q][hidden]  fp32, the new tokens' hidden states (query i at L_b − Q + i)
///   out     [batch][Q][hidden]  fp32
/// `plan` is the step's DecodePlan made with f.shape and scale 0: the fold carries the softmax
/// scale in its query weights, so another scale is rejected. `policy` adds a variant to the
/// attention (policy.hpp). The projections run on the calling thread; attention through `pf`.
/// Throws as mla_decode, and kvattn::shape_error when `f` does not match the plan's shape.
template <class T, class PF = SerialFor, class P = Plain, class IsaTag = isa::native>
void mla_decode_layer(const MlaFolded& f, const PagedKvView<T>& kv, const float* hidden, float* out, DecodePlan& plan,
                      MlaWorkspace& ws, PF&& pf = PF{}, const P& policy = P{}, IsaTag = IsaTag{}) {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  using namespace mla_layer_impl;
  constexpr const char* op = "mla_decode_layer";
  const MlaShape& s = f.shape;
  plan.check(op, kv);
  if (const MlaShape* ps = std::get_if<MlaShape>(&plan.shape()); ps == nullptr || *ps != s)
    raise<shape_error>(detail::concat(op, ": the plan was not made for the folded weights' shape (heads=", s.heads,
                                      " latent_dim=", s.latent_dim, " rope_dim=", s.rope_dim, " nope_dim=", s.nope_dim, ")"));
  if (plan.params().scale != 0.0f)
    raise<invalid_argument>(detail::concat(op, ": the plan's scale=", plan.params().scale,
                                           ": the folded weights carry the softmax scale; make the plan with scale 0"));
  if (kv.batch > 0 && (hidden == nullptr || out == nullptr)) raise<invalid_argument>("mla_decode_layer: hidden and out must not be null");
  const int Q = plan.params().queries_per_seq, H = s.heads, Dc = s.latent_dim, Dr = s.rope_dim, Kt = Dc + Dr;
  const std::int64_t tokens = std::int64_t{kv.batch} * Q;
  ws.positions.resize(static_cast<std::size_t>(tokens));
  for (int b = 0; b < kv.batch; ++b)
    for (int i = 0; i < Q; ++i) ws.positions[static_cast<std::size_t>(b) * Q + i] = kv.length(b) - Q + i;

  // Absorbed queries q̃ [tokens][heads][latent_dim + rope_dim], scaled.
  const ConstMap h(hidden, tokens, f.hidden);
  MlaMatrix& cq = ws.query_latent;
  if (s.has_q_latent()) cq.noalias() = h * f.q_down.transpose();
  const auto cq_or_h = [&](auto&& use) { s.has_q_latent() ? use(cq) : use(h); };
  MlaMatrix& qt = ws.query;
  qt.resize(tokens, std::int64_t{H} * Kt);
  MlaMatrix& qr = ws.query_rope;
  cq_or_h([&](const auto& x) { qr.noalias() = x * f.q_rope.transpose(); });
  rotate<Isa>(f.rope, qr, H, ws.positions.data());
  if (f.fused_query) {
    MlaMatrix& qc = ws.query_nope;
    cq_or_h([&](const auto& x) { qc.noalias() = x * f.q_absorb.transpose(); });
    for (int i = 0; i < H; ++i) qt.middleCols(std::int64_t{i} * Kt, Dc) = qc.middleCols(std::int64_t{i} * Dc, Dc);
  } else {
    MlaMatrix& qn = ws.query_nope;
    cq_or_h([&](const auto& x) { qn.noalias() = x * f.q_nope.transpose(); });
    for (int i = 0; i < H; ++i)
      qt.middleCols(std::int64_t{i} * Kt, Dc).noalias() =
          qn.middleCols(std::int64_t{i} * s.nope_dim, s.nope_dim) * f.k_up.middleRows(std::int64_t{i} * s.nope_dim, s.nope_dim);
  }
  for (int i = 0; i < H; ++i) qt.middleCols(std::int64_t{i} * Kt + Dc, Dr) = qr.middleCols(std::int64_t{i} * Dr, Dr);

  // Attention in latent space: ol [tokens][heads][latent_dim].
  MlaMatrix& ol = ws.attention;
  ol.resize(tokens, std::int64_t{H} * Dc);
  mla_impl::run(op, kv, qt.data(), ol.data(), nullptr, plan, pf, policy, 1.0f, Isa{});

  // Output: W_O (W_UV,i o_i) per head, or the fused W_O,i W_UV,i.
  Map o(out, tokens, f.hidden);
  if (f.fused_output) {
    o.noalias() = ol * f.out_absorb.transpose();
  } else {
    MlaMatrix& ov = ws.values;
    ov.resize(tokens, std::int64_t{H} * s.v_head_dim);
    for (int i = 0; i < H; ++i)
      ov.middleCols(std::int64_t{i} * s.v_head_dim, s.v_head_dim).noalias() =
          ol.middleCols(std::int64_t{i} * Dc, Dc) * f.v_up.middleRows(std::int64_t{i} * s.v_head_dim, s.v_head_dim).transpose();
    o.noalias() = ov * f.out.transpose();
  }
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
