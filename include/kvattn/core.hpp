// kvattn/core.hpp — what every attention operator shares: the softmax scale, the argument checks,
// the head-size dispatch, and the decode plan (the split-KV work of one step, made once and
// reused by every layer).
//
// An engine's decode step, for any number of layers:
//   kvattn::BatchPageTable table = cache.page_table(seqs);           // after the step's appends
//   kvattn::DecodePlan plan;                                          // kept across steps: reuses its memory
//   plan.make(cache.view(table, 0), shape, params, pool);             // once per step
//   for (int layer = 0; layer < layers; ++layer)
//     kvattn::decode(cache.view(table, layer), q, out, lse, plan, pool, policy);
// The plan splits the batch into work items (a sequence and a chunk of its keys: long sequences
// are split so that every thread has work, and the chunks merged through their log-sum-exp),
// sizes the items' scratch and holds it. Every call checks that its view describes the batch the
// plan was made for (the same number of sequences, of the same lengths, and a cache of the plan's
// head layout); it cannot tell whether the page ids are still the cache's, so views are taken
// after the step's last mutation of the cache, as PagedKvView says. One call at a time per plan.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "memory.hpp"
#include "model.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "policy.hpp"
#include "shape.hpp"
#include "state.hpp"

namespace kvattn {

/// Parameters of a decode step (GQA family and MLA alike).
struct DecodeParams {
  int queries_per_seq = 1;        ///< Q: new tokens per sequence, the last Q of its cache
  float scale = 0.0f;             ///< softmax scale; 0: 1 / sqrt(head_dim) (MLA: 1 / sqrt(nope_dim + rope_dim))
  std::int64_t chunk_tokens = 0;  ///< split-KV chunk length; 0: chosen from the work and the threads
  /// GQA-family decode over an int8 format (int8_row, hadamard<int8_row>) only: each query row
  /// is quantized to int8 like a key row (one scale, max |q| / 127, after the rotation of a
  /// rotated format) and scored with integer dot products, exact in 32 bits, times the two
  /// scales: AVX-512 VNNI, AVX-VNNI, AVX2 (vpmaddubsw, vpmaddwd) and NEON's dot product compute
  /// them, other instruction sets the same sums with fp32 multiply-adds. false: the query stays
  /// fp32.
  bool int8_queries = false;
  /// With int8_queries only (it needs them): the probabilities of each query row times the
  /// values' scales, in tiles of 32 keys, are rounded to 8 bits relative to the tile's largest
  /// (p8 = round(255 · p / max p), unsigned) and multiplied with the int8 values by integer dot
  /// products, exact in 32 bits, times max p / 255: AVX-512 VNNI computes them for head sizes
  /// 64, 128 and 256, every other case the same products with fp32 multiply-adds. false: fp32.
  /// With both, no fp32 multiply-add per key is left.
  bool u8_probabilities = false;
};

/// The softmax scale of a call: `scale`, or 1 / sqrt(qk_dim) when it is 0.
inline float softmax_scale(float scale, int qk_dim) noexcept {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(qk_dim));
}

/// The head-size dispatch: calls f(std::integral_constant<int, D>{}) with D = the head size for
/// the sizes whose loops are compiled with a constant length (64, 128, 256), and D = 0 (the size
/// read at run time) for every other.
template <class F> decltype(auto) dispatch_head_dim(int dim, F&& f) {
  switch (dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

/// The new tokens of one step, sequence by sequence: sequence seq(b) brings tokens(b) tokens, rows
/// [indptr()[b], indptr()[b + 1]) of the step's arrays, the last tokens(b) of the sequence.
class ChunkBatch {
 public:
  struct Chunk {
    SeqId seq;
    std::int64_t tokens;
  };
  ChunkBatch() = default;
  ChunkBatch(std::initializer_list<Chunk> chunks) {
    for (const Chunk& c : chunks) add(c.seq, c.tokens);
  }
  /// Appends sequence `seq`'s chunk of `tokens` (>= 0) tokens to the batch.
  void add(SeqId seq, std::int64_t tokens) {
    if (tokens < 0) raise<invalid_argument>(detail::concat("ChunkBatch::add(seq=", seq, ", tokens=", tokens, "): must be >= 0"));
    seqs_.push_back(seq);
    indptr_.push_back(indptr_.back() + tokens);
  }
  void clear() noexcept {
    seqs_.clear();
    indptr_.resize(1);
  }
  int size() const noexcept { return static_cast<int>(seqs_.size()); }
  SeqId seq(int b) const noexcept { return seqs_[static_cast<std::size_t>(b)]; }
  std::int64_t tokens(int b) const noexcept { return indptr_[static_cast<std::size_t>(b) + 1] - indptr_[static_cast<std::size_t>(b)]; }
  std::int64_t total() const noexcept { return indptr_.back(); }
  const std::vector<SeqId>& seqs() const noexcept { return seqs_; }
  const std::vector<std::int64_t>& indptr() const noexcept { return indptr_; }  ///< [size() + 1]

 private:
  std::vector<SeqId> seqs_;
  std::vector<std::int64_t> indptr_{0};
};

/// The most query rows one sequence may bring to one KV head (group size × queries per sequence),
/// or to an MLA cache (heads × queries per sequence): a work item's scratch grows with them.
inline constexpr std::int64_t kMaxRowsPerItem = std::int64_t{1} << 20;

namespace detail {
/// The cache a GQA-family operator reads must hold GQA pages of the shape's KV heads and head size.
inline void check_layout(const char* op, const GqaShape& shape, const PageLayout& layout) {
  if (layout.content != PageContent::gqa)
    raise<shape_error>(concat(op, ": the cache holds MLA pages (latent_dim=", layout.latent_dim, " rope_dim=", layout.rope_dim,
                              "), not the GQA-family pages of kv_heads=", shape.kv_heads, " head_dim=", shape.head_dim));
  if (layout.kv_heads != shape.kv_heads || layout.head_dim != shape.head_dim)
    raise<shape_error>(concat(op, ": shape kv_heads=", shape.kv_heads, " head_dim=", shape.head_dim,
                              " does not match the cache's kv_heads=", layout.kv_heads, " head_dim=", layout.head_dim));
}
/// The cache an MLA operator reads must hold MLA pages of the shape's latent and rotary widths.
inline void check_layout(const char* op, const MlaShape& shape, const PageLayout& layout) {
  if (layout.content != PageContent::mla)
    raise<shape_error>(concat(op, ": the cache holds GQA-family pages (kv_heads=", layout.kv_heads, " head_dim=", layout.head_dim,
                              "), not the MLA pages of latent_dim=", shape.latent_dim, " rope_dim=", shape.rope_dim));
  if (layout.latent_dim != shape.latent_dim || layout.rope_dim != shape.rope_dim)
    raise<shape_error>(concat(op, ": shape latent_dim=", shape.latent_dim, " rope_dim=", shape.rope_dim,
                              " does not match the cache's latent_dim=", layout.latent_dim, " rope_dim=", layout.rope_dim));
}
/// A scale is finite and >= 0 (0: the default, named by `default_name`).
inline void check_scale(const char* op, float scale, const char* default_name) {
  if (!(std::isfinite(scale) && scale >= 0.0f))
    raise<invalid_argument>(concat(op, ": scale=", scale, ": must be finite and >= 0 (0: ", default_name, ")"));
}
/// Query rows per (sequence, KV head) or per MLA sequence: `per_query` rows for each of Q queries.
inline int item_rows(const char* op, int per_query, const char* per_query_name, int queries) {
  const std::int64_t rows = std::int64_t{per_query} * queries;
  if (rows > kMaxRowsPerItem)
    raise<invalid_argument>(concat(op, ": queries_per_seq=", queries, " × ", per_query_name, "=", per_query, " = ", rows,
                                   " query rows per sequence: at most ", kMaxRowsPerItem));
  return static_cast<int>(rows);
}
}  // namespace detail

/// Scratch layouts of one decode work item, in floats, every row on a cache line. The plan sizes
/// the scratch with them; the kernels lay their items out with them.
namespace decode_layout {
/// GQA-family decode walks keys in spans of this many tokens; its chunks are whole spans.
inline constexpr int kGqaSpan = 64;
/// Floats of one row of a GQA-family item's partial result: the output [dim] and {m, d}.
constexpr std::int64_t partial_row_floats(int dim) { return detail::whole_lines(std::int64_t{dim} + 2); }
/// Floats of one row of a GQA-family item's int8 queries (DecodeParams::int8_queries): the row's
/// bytes, zero-padded to whole cache lines, then {scale, offset}, whole cache lines.
constexpr std::int64_t int8_query_row_floats(int dim) {
  return detail::whole_lines((std::int64_t{dim} + 3) / 4) + detail::kLineFloats;
}
/// A GQA-family item: the partial outputs [kv_heads][rows][partial_row_floats], then its queries
/// [kv_heads][rows][dim], then with int8 queries those [kv_heads][rows][int8_query_row_floats].
constexpr std::int64_t gqa_item_floats(const GqaShape& s, int rows, bool int8_queries = false) {
  const std::int64_t row = partial_row_floats(s.head_dim) + s.head_dim + (int8_queries ? int8_query_row_floats(s.head_dim) : 0);
  return detail::whole_lines(std::int64_t{s.kv_heads} * rows * row);
}

/// An MLA item: every row of one sequence (Q · heads), scored against tiles of kMlaTile tokens.
inline constexpr int kMlaTile = 64;   ///< tokens per tile
inline constexpr int kMlaRowPad = 8;  ///< rows are padded to a multiple of this
struct Mla {
  int K;                  ///< scored width, latent_dim + rope_dim
  int Kp;                 ///< K rounded up to whole cache lines (queries and tile rows, zero padded)
  int Dp;                 ///< latent_dim rounded up to whole cache lines (output columns computed)
  int rows, rows_p;       ///< query rows Q · heads, and rounded up to kMlaRowPad
  std::int64_t o_stride;  ///< floats per output row: Dp, then {m, d}, whole cache lines

  Mla(const MlaShape& s, int Q)
      : K(s.latent_dim + s.rope_dim),
        Kp(static_cast<int>(detail::whole_lines(K))),
        Dp(static_cast<int>(detail::whole_lines(s.latent_dim))),
        rows(Q * s.heads),
        rows_p((rows + kMlaRowPad - 1) / kMlaRowPad * kMlaRowPad),
        o_stride(detail::whole_lines(std::int64_t{Dp} + 2)) {}
  /// Outputs [rows_p][o_stride], queries [rows_p][Kp], tile [kMlaTile][Kp], probabilities
  /// [rows_p][kMlaTile], rescale factors [rows_p].
  std::int64_t item_floats() const {
    return detail::whole_lines(std::int64_t{rows_p} * o_stride + std::int64_t{rows_p} * Kp + std::int64_t{kMlaTile} * Kp +
                               std::int64_t{rows_p} * kMlaTile + rows_p);
  }
};
}  // namespace decode_layout

/// How finely a batch is split into items: until about `want` items (nothing when the batch alone
/// gives that many), in chunks of a multiple of `granule` tokens and at least `min_chunk`.
struct SplitRule {
  std::int64_t want = 1;
  std::int64_t granule = 1;
  std::int64_t min_chunk = 1;
};

/// One step's decode work: made once per step (make), read by every layer's call.
class DecodePlan {
 public:
  /// A sequence and a chunk of its keys.
  struct Item {
    std::int32_t batch_index;  ///< row b of the batch's page table
    std::int64_t begin, end;   ///< key positions [begin, end)
    std::int64_t partial;      ///< where the item's scratch starts, in floats from scratch()
  };

  /// The plan of decode() (kvattn/decode.hpp) for `kv`'s batch: any layer's view of the step's
  /// page table. `threads`: the threads the parallel-for will run on (or the parallel-for itself,
  /// threads_of). Throws kvattn::shape_error or invalid_argument on inconsistent arguments.
  template <class T> void make(const PagedKvView<T>& kv, const GqaShape& shape, const DecodeParams& p, int threads) {
    const int rows = prepare("DecodePlan::make", shape, kv.layout, p, threads);
    check_int8_math<T>("DecodePlan::make", p);
    // About 8 items per thread where the batch alone gives fewer: a thread that starts late (woken
    // by the parallel-for) then costs the others less than one item's time. Chunks are whole
    // spans (decode_layout::kGqaSpan), so they start where pages do, and at least 256 tokens long.
    split(kv, p.chunk_tokens, SplitRule{8 * std::int64_t{threads}, decode_layout::kGqaSpan, 256},
          decode_layout::gqa_item_floats(shape, rows, p.int8_queries));
  }
  /// The plan of mla_decode() (kvattn/mla_decode.hpp) for `kv`'s batch.
  template <class T> void make(const PagedKvView<T>& kv, const MlaShape& shape, const DecodeParams& p, int threads) {
    prepare("DecodePlan::make", shape, kv.layout, p, threads);
    // MLA decode is compute-bound: 2 items per thread, chunks of whole tiles, at least 8 of them.
    constexpr std::int64_t tile = decode_layout::kMlaTile;
    split(kv, p.chunk_tokens, SplitRule{2 * std::int64_t{threads}, tile, 8 * tile},
          decode_layout::Mla(shape, p.queries_per_seq).item_floats());
  }
  /// make() with the threads of a parallel-for.
  template <class T, class S, class PF, class = std::enable_if_t<!std::is_integral_v<PF>>>
  void make(const PagedKvView<T>& kv, const S& shape, const DecodeParams& p, const PF& pf) {
    make(kv, shape, p, threads_of(pf));
  }

  /// The checks of make() and the call's shape, parameters and threads: the first half of make()
  /// (the second is split()), for planners of other backends (the CUDA plan) that split under a
  /// rule of their own. `op` names the caller in the messages, `layout` is the cache's. Returns
  /// the query rows of a sequence in one item (group size or heads, times queries_per_seq).
  int prepare(const char* op, const GqaShape& shape, const PageLayout& layout, const DecodeParams& p, int threads) {
    shape.validate();
    detail::check_layout(op, shape, layout);
    check_params(op, p, threads, "1/sqrt(head_dim)");
    const int rows = detail::item_rows(op, shape.group_size(), "group size", p.queries_per_seq);
    set(shape, p, threads, softmax_scale(p.scale, shape.head_dim));
    return rows;
  }
  int prepare(const char* op, const MlaShape& shape, const PageLayout& layout, const DecodeParams& p, int threads) {
    shape.validate();
    detail::check_layout(op, shape, layout);
    check_params(op, p, threads, "1/sqrt(nope_dim + rope_dim)");
    if (p.int8_queries || p.u8_probabilities)
      raise<invalid_argument>(detail::concat(op, ": int8_queries=", p.int8_queries ? "true" : "false",
                                             " u8_probabilities=", p.u8_probabilities ? "true" : "false",
                                             ": MLA decode has no 8-bit arithmetic (it is for GQA-family decode over an "
                                             "int8 format)"));
    const int rows = detail::item_rows(op, shape.heads, "heads", p.queries_per_seq);
    set(shape, p, threads, softmax_scale(p.scale, shape.qk_head_dim()));
    return rows;
  }

  /// The split itself (what make() does after prepare(); the CUDA plans call it with their own
  /// rule): items of `item_floats` floats of scratch each (0: none), chunks of
  /// `chunk_tokens` tokens (0: chosen by `rule`). Records the batch it describes (check).
  template <class T>
  void split(const PagedKvView<T>& kv, std::int64_t chunk_tokens, const SplitRule& rule, std::int64_t item_floats) {
    batch_ = kv.batch;
    lengths_.resize(static_cast<std::size_t>(kv.batch));
    q_indptr_.resize(static_cast<std::size_t>(kv.batch) + 1);
    std::int64_t total = 0;
    for (int b = 0; b < kv.batch; ++b) {
      lengths_[static_cast<std::size_t>(b)] = kv.length(b);
      total += kv.length(b);
      q_indptr_[static_cast<std::size_t>(b)] = std::int64_t{b} * params_.queries_per_seq;
    }
    q_indptr_[static_cast<std::size_t>(kv.batch)] = std::int64_t{kv.batch} * params_.queries_per_seq;
    std::int64_t chunk = chunk_tokens;
    if (chunk == 0)
      chunk = kv.batch >= rule.want
                  ? std::numeric_limits<std::int64_t>::max()
                  : std::max(rule.min_chunk, ((total + rule.want - 1) / rule.want + rule.granule - 1) / rule.granule * rule.granule);
    items_.clear();
    first_item_.assign(static_cast<std::size_t>(kv.batch) + 1, 0);
    std::int64_t floats = 0;
    for (int b = 0; b < kv.batch; ++b) {
      const std::int64_t L = kv.length(b);
      const std::int64_t chunks = L == 0 ? 1 : 1 + (L - 1) / chunk;  // (no L + chunk: chunk may be INT64_MAX)
      for (std::int64_t c = 0; c < chunks; ++c) {
        const std::int64_t begin = std::min(L, c * chunk), end = std::min(L, begin + chunk);
        items_.push_back({b, begin, end, floats});
        floats += item_floats;
      }
      first_item_[static_cast<std::size_t>(b) + 1] = static_cast<std::int64_t>(items_.size());
    }
    item_floats_ = item_floats;
    scratch_floats_ = floats;
    if (floats > 0 && scratch_.size() < static_cast<std::size_t>(floats + detail::kLineFloats))
      scratch_.resize(static_cast<std::size_t>(floats + detail::kLineFloats));
  }

  /// Checks that `kv` describes the batch this plan was made for, with a cache of its head
  /// layout: the same number of sequences, each of the same length. Throws invalid_argument (or
  /// shape_error) naming the operator `op` and the values.
  template <class T> void check(const char* op, const PagedKvView<T>& kv) const {
    if (batch_ < 0) raise<invalid_argument>(detail::concat(op, ": the plan was never made (DecodePlan::make)"));
    std::visit([&](const auto& s) { detail::check_layout(op, s, kv.layout); }, shape_);
    if (kv.batch != batch_)
      raise<invalid_argument>(detail::concat(op, ": the view holds ", kv.batch, " sequences, the plan was made for ", batch_,
                                             " (make the plan again for a new batch)"));
    for (int b = 0; b < batch_; ++b)
      if (kv.length(b) != lengths_[static_cast<std::size_t>(b)])
        raise<invalid_argument>(detail::concat(op, ": sequence ", b, " of the batch holds ", kv.length(b),
                                               " tokens, the plan was made when it held ", lengths_[static_cast<std::size_t>(b)],
                                               " (make the plan again after the cache changes)"));
  }

  /// The checks every decode call makes before any work, one definition for decode, mla_decode
  /// and their CUDA forms: `kv` describes the plan's batch (check), the plan was made for a shape
  /// of type S (GqaShape or MlaShape), `policy` fits the call (check_policy against `call`), q and
  /// out are not null. Returns the plan's shape. Throws kvattn::invalid_argument or shape_error
  /// naming the operator `op` and the values.
  template <class S, class T, class P>
  const S& check_call(const char* op, const PagedKvView<T>& kv, const P& policy, const float* q, const float* out,
                      const PolicyCall& call) const {
    check(op, kv);
    const S* shape = std::get_if<S>(&shape_);
    if (shape == nullptr)
      raise<invalid_argument>(detail::concat(op, ": the plan was made for ",
                                             std::is_same_v<S, GqaShape> ? "an MLA shape, the call is for the GQA family"
                                                                         : "a GQA-family shape, the call is for MLA"));
    check_policy(op, policy, call);
    if (kv.batch > 0 && (q == nullptr || out == nullptr)) raise<invalid_argument>(detail::concat(op, ": q and out must not be null"));
    return *shape;
  }

  const AttentionShape& shape() const noexcept { return shape_; }
  const DecodeParams& params() const noexcept { return params_; }
  float scale() const noexcept { return scale_; }  ///< the softmax scale, the default resolved
  int threads() const noexcept { return threads_; }
  int batch() const noexcept { return batch_ < 0 ? 0 : batch_; }
  std::int64_t length(int b) const noexcept { return lengths_[static_cast<std::size_t>(b)]; }
  const std::vector<Item>& items() const noexcept { return items_; }
  std::vector<Item>& items() noexcept { return items_; }
  /// Sequence b's items are items()[first_item(b), first_item(b + 1)).
  std::int64_t first_item(int b) const noexcept { return first_item_[static_cast<std::size_t>(b)]; }
  const std::vector<std::int64_t>& first_items() const noexcept { return first_item_; }
  std::int64_t item_floats() const noexcept { return item_floats_; }
  /// The items' scratch, scratch_floats() floats from a cache line.
  float* scratch() noexcept { return detail::align_to_line(scratch_.data()); }
  std::int64_t scratch_floats() const noexcept { return scratch_floats_; }
  /// What the policy of a call is checked against: the plan's query heads and rows.
  PolicyCall policy_call() const noexcept {
    const int q_heads = std::visit(
        [](const auto& s) {
          if constexpr (std::is_same_v<std::decay_t<decltype(s)>, GqaShape>) return s.q_heads;
          else return s.heads;
        },
        shape_);
    return PolicyCall{q_heads, batch(), q_indptr_.data()};
  }
  /// Host memory the plan holds.
  std::size_t bytes() const noexcept {
    return items_.capacity() * sizeof(Item) + (first_item_.capacity() + lengths_.capacity() + q_indptr_.capacity()) * sizeof(std::int64_t) +
           scratch_.capacity() * sizeof(float);
  }

  /// int8_queries and u8_probabilities need a cache of an int8 format, and u8_probabilities needs
  /// int8_queries (DecodeParams): throws invalid_argument naming `op` and the values otherwise.
  /// make() checks it, decode() again, and so do the CUDA plans.
  template <class T> static void check_int8_math(const char* op, const DecodeParams& p) {
    if ((p.int8_queries || p.u8_probabilities) && !is_int8_format_v<T>)
      raise<invalid_argument>(detail::concat(op, ": ", p.int8_queries ? "int8_queries" : "u8_probabilities",
                                             "=true needs a cache of an int8 format (int8_row, hadamard<int8_row>); this cache is ",
                                             format_traits<T>::name));
    if (p.u8_probabilities && !p.int8_queries)
      raise<invalid_argument>(detail::concat(op, ": u8_probabilities=true needs int8_queries=true (the 8-bit probabilities "
                                                 "are the second half of decode's int8 arithmetic)"));
  }

 private:
  static void check_params(const char* op, const DecodeParams& p, int threads, const char* default_scale) {
    detail::check_scale(op, p.scale, default_scale);
    if (p.queries_per_seq < 1 || p.chunk_tokens < 0 || threads < 1)
      raise<invalid_argument>(detail::concat(op, ": queries_per_seq=", p.queries_per_seq, " chunk_tokens=", p.chunk_tokens,
                                             " threads=", threads,
                                             ": queries_per_seq and threads must be positive, chunk_tokens >= 0"));
  }
  void set(const AttentionShape& shape, const DecodeParams& p, int threads, float scale) {
    shape_ = shape;
    params_ = p;
    threads_ = threads;
    scale_ = scale;
  }

  AttentionShape shape_;
  DecodeParams params_;
  int threads_ = 1;
  float scale_ = 1.0f;
  int batch_ = -1;                       // -1: never made
  std::vector<Item> items_;              // [items]
  std::vector<std::int64_t> first_item_;  // [batch + 1]
  std::vector<std::int64_t> lengths_;    // [batch] each sequence's length when the plan was made
  std::vector<std::int64_t> q_indptr_;   // [batch + 1] b · Q: each sequence's query rows
  std::int64_t item_floats_ = 0, scratch_floats_ = 0;
  std::vector<float> scratch_;
};

}  // namespace kvattn
