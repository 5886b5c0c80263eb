// kvattn/core.hpp — what every attention operator shares: the softmax scale, the argument checks,
// the head-size dispatch, and the plans of a step, made once and reused by every layer: the
// decode plan (the split-KV work of one step) and the prefill plan (PrefillPlan, below: its
// chunks, their pages made writable, the work items; kvattn/prefill.hpp runs it).
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
#include "rope_config.hpp"
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

struct PrefillParams {
  float scale = 0.0f;  ///< softmax scale; 0: 1 / sqrt(head_dim)
  /// Query tokens per work item, from 1 to kMaxQueryBlock; a chunk shorter than this is one block.
  int query_block = 64;
  /// Rotary position embedding: when set, the chunk's queries and keys are rotated at their
  /// positions (each token's index in its sequence) before the keys are cached and attended to;
  /// q and k are only read (the rotated copies live in the plan). rope->head_dim() must equal
  /// the shape's head_dim. Null: q and k are used as given.
  const Rope* rope = nullptr;

  /// The largest query_block, and the most query rows (group size × the block actually used) one
  /// item may hold: an item's scratch grows with its rows.
  static constexpr int kMaxQueryBlock = 4096;
  static constexpr std::int64_t kMaxItemRows = kMaxRowsPerItem;
};

namespace prefill_layout {
inline constexpr int kTile = 32;  ///< keys per tile: each output row is loaded, rescaled and stored once per tile
/// Lanes of work items per thread of the parallel-for (see prefill()): enough that a parallel-for
/// handing out lanes one at a time still balances them over its threads.
inline constexpr int kLanesPerThread = 8;
/// Vector lanes the plan sizes scratch for: the most any instruction set has.
inline constexpr int kMaxLanes = 16;

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

  /// The layout for `rows` query rows in vectors of W lanes (the plan sizes every lane's scratch
  /// for 16, the most any instruction set has: no layout is larger).
  static constexpr ScratchLayout of(std::int64_t rows, int dim, int W) noexcept {
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

}  // namespace prefill_layout

/// One step's prefill: its chunks checked, their pages made writable, the page table, the work
/// items and their scratch. Made once per step (make), read by every layer's prefill call.
class PrefillPlan {
 public:
  /// A sequence's KV head and a block of its chunk's query tokens.
  struct Item {
    std::int32_t batch_index;     ///< b: the batch's sequence
    std::int32_t kv_head;
    std::int64_t q_begin, q_end;  ///< rows of q (the step's token index)
  };

  /// Checks the step (the shape against the cache, every chunk against its sequence, the
  /// parameters) and makes the chunks' pages writable in every layer at once
  /// (PagedKvCache::make_writable): all or nothing, a pool too small for the copy-on-write copies
  /// throws capacity_error with the cache unchanged. Then takes the batch's page table and splits
  /// the work for `threads` threads (or the parallel-for's, threads_of). Throws
  /// kvattn::invalid_argument or shape_error on inconsistent arguments.
  template <class T, class M>
  void make(PagedKvCache<T, M>& cache, const ChunkBatch& batch, const GqaShape& shape, const PrefillParams& p, int threads) {
    constexpr const char* op = "PrefillPlan::make";
    shape.validate();
    detail::check_layout(op, shape, cache.layout());
    detail::check_scale(op, p.scale, "1/sqrt(head_dim)");
    if (threads < 1) raise<invalid_argument>(detail::concat(op, ": threads=", threads, ": must be positive"));
    if (p.query_block < 1 || p.query_block > PrefillParams::kMaxQueryBlock)
      raise<invalid_argument>(detail::concat(op, ": query_block=", p.query_block, ": must be from 1 to ", PrefillParams::kMaxQueryBlock));
    if (p.rope != nullptr && p.rope->head_dim() != shape.head_dim)
      raise<shape_error>(detail::concat(op, ": rope head_dim=", p.rope->head_dim(), " does not match shape head_dim=", shape.head_dim));
    std::vector<TokenRange> ranges(static_cast<std::size_t>(batch.size()));
    std::int64_t longest = 0;
    for (int b = 0; b < batch.size(); ++b) {
      const SeqId s = batch.seq(b);
      if (!cache.contains(s))
        raise<invalid_argument>(detail::concat(op, ": sequence ", s, " (chunk ", b, " of the batch) is not in the cache"));
      const std::int64_t n = batch.tokens(b), L = cache.length(s);
      if (n > L)
        raise<invalid_argument>(detail::concat(op, ": sequence ", s, " has a chunk of ", n, " tokens but holds ", L,
                                               " (append the chunk first)"));
      ranges[static_cast<std::size_t>(b)] = {s, L - n, n};
      longest = std::max(longest, n);
    }
    // The block actually used: no longer than the longest chunk. Its rows size every item's
    // scratch, counted in 64 bits before anything is allocated.
    const int block = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(p.query_block, longest)));
    if (std::int64_t{shape.group_size()} * block > PrefillParams::kMaxItemRows)
      raise<invalid_argument>(detail::concat(op, ": query_block=", p.query_block, " with group size ", shape.group_size(),
                                             " makes items of ", std::int64_t{shape.group_size()} * block,
                                             " query rows: at most ", PrefillParams::kMaxItemRows));
    // Every chunk's pages are made private (copy-on-write) before anything is written, for the
    // whole batch and every layer at once: the layers' writes then copy nothing and cannot fail.
    cache.make_writable(ranges, op);  // (also rejects a sequence that appears twice)

    shape_ = shape;
    params_ = p;
    scale_ = softmax_scale(p.scale, shape.head_dim);
    threads_ = threads;
    batch_ = batch;
    cache_ = &cache;
    generation_ = cache.generation();
    cache.build_page_table(batch.seqs().data(), batch.seqs().size(), table_);
    first_pos_.resize(static_cast<std::size_t>(batch.size()));
    for (int b = 0; b < batch.size(); ++b) first_pos_[static_cast<std::size_t>(b)] = ranges[static_cast<std::size_t>(b)].first;

    // Items from the last query block of each sequence to the first: the later a block, the more
    // keys it sees, and each lane below then ends on its cheap items.
    const std::vector<std::int64_t>& indptr = batch.indptr();
    items_.clear();
    for (int b = 0; b < batch.size(); ++b)
      for (std::int64_t n = batch.tokens(b), t = indptr[static_cast<std::size_t>(b)] + (n - 1) / block * block;
           n > 0 && t >= indptr[static_cast<std::size_t>(b)]; t -= block)
        for (int h = 0; h < shape.kv_heads; ++h)
          items_.push_back({b, h, t, std::min<std::int64_t>(indptr[static_cast<std::size_t>(b) + 1], t + block)});
    // The items are dealt round-robin into lanes, a few per thread; the parallel-for runs the
    // lanes, and a lane runs its items one after another in a scratch of its own. The scratch
    // thus grows with the threads, not with the prompt, and stays warm from item to item; and as
    // consecutive items (the KV heads of one query block) cost the same, the lanes do too. Every
    // lane's scratch starts on a cache line (per_lane is a whole number of them).
    lanes_ = std::min<std::int64_t>(static_cast<std::int64_t>(items_.size()), std::int64_t{prefill_layout::kLanesPerThread} * threads);
    per_lane_ = prefill_layout::ScratchLayout::of(std::int64_t{shape.group_size()} * block, shape.head_dim, prefill_layout::kMaxLanes).floats;
    grow(scratch_, per_lane_ * lanes_ + detail::kLineFloats);
    if (p.rope != nullptr) {
      grow(rotated_q_, batch.total() * shape.q_heads * shape.head_dim);
      grow(rotated_k_, batch.total() * shape.kv_heads * shape.head_dim);
      grow(positions_, batch.total());
      for (int b = 0; b < batch.size(); ++b)
        for (std::int64_t t = 0; t < batch.tokens(b); ++t)
          positions_[static_cast<std::size_t>(indptr[static_cast<std::size_t>(b)] + t)] = first_pos_[static_cast<std::size_t>(b)] + t;
    }
  }
  /// make() with the threads of a parallel-for.
  template <class T, class M, class PF, class = std::enable_if_t<!std::is_integral_v<PF>>>
  void make(PagedKvCache<T, M>& cache, const ChunkBatch& batch, const GqaShape& shape, const PrefillParams& p, const PF& pf) {
    make(cache, batch, shape, p, threads_of(pf));
  }

  /// Checks that the plan was made for `cache` as it is now (no mutation since: PagedKvCache::
  /// generation) and that `layer` is one of its layers. Throws invalid_argument naming `op`.
  template <class T, class M> void check(const char* op, const PagedKvCache<T, M>& cache, int layer) const {
    if (cache_ == nullptr) raise<invalid_argument>(detail::concat(op, ": the plan was never made (PrefillPlan::make)"));
    if (cache_ != static_cast<const void*>(&cache))
      raise<invalid_argument>(detail::concat(op, ": the plan was made for another cache"));
    if (cache.generation() != generation_)
      raise<invalid_argument>(detail::concat(op, ": the cache has changed since the plan was made (generation ", generation_,
                                             ", now ", cache.generation(), "): make the plan again"));
    if (layer < 0 || layer >= cache.config().layers)
      raise<invalid_argument>(detail::concat(op, ": layer=", layer, " is outside [0, ", cache.config().layers, ")"));
  }

  const GqaShape& shape() const noexcept { return shape_; }
  const PrefillParams& params() const noexcept { return params_; }
  float scale() const noexcept { return scale_; }
  int threads() const noexcept { return threads_; }
  const ChunkBatch& batch() const noexcept { return batch_; }
  /// The position of sequence b's first new token.
  std::int64_t first_pos(int b) const noexcept { return first_pos_[static_cast<std::size_t>(b)]; }
  const BatchPageTable& table() const noexcept { return table_; }
  const std::vector<Item>& items() const noexcept { return items_; }
  std::int64_t lanes() const noexcept { return lanes_; }
  std::int64_t lane_floats() const noexcept { return per_lane_; }
  /// Lane i's scratch: lane_floats() floats from a cache line.
  float* lane_scratch(std::int64_t i) noexcept { return detail::align_to_line(scratch_.data()) + i * per_lane_; }
  float* rotated_q() noexcept { return rotated_q_.data(); }
  float* rotated_k() noexcept { return rotated_k_.data(); }
  const std::int64_t* positions() const noexcept { return positions_.data(); }
  /// What the policy of a call is checked against.
  PolicyCall policy_call() const noexcept { return PolicyCall{shape_.q_heads, batch_.size(), batch_.indptr().data()}; }
  std::size_t bytes() const noexcept {
    return items_.capacity() * sizeof(Item) + (scratch_.capacity() + rotated_q_.capacity() + rotated_k_.capacity()) * sizeof(float) +
           (positions_.capacity() + first_pos_.capacity()) * sizeof(std::int64_t) +
           (table_.indptr.capacity() + table_.indices.capacity() + table_.last_page_len.capacity()) * sizeof(std::int32_t);
  }

 private:
  template <class V> static void grow(V& buffer, std::int64_t n) {
    if (buffer.size() < static_cast<std::size_t>(n)) buffer.resize(static_cast<std::size_t>(n));
  }

  GqaShape shape_;
  PrefillParams params_;
  float scale_ = 1.0f;
  int threads_ = 1;
  ChunkBatch batch_;
  const void* cache_ = nullptr;  // the cache the plan was made for
  std::uint64_t generation_ = 0;
  BatchPageTable table_;
  std::vector<std::int64_t> first_pos_;  // [batch]
  std::vector<Item> items_;
  std::int64_t lanes_ = 0, per_lane_ = 0;
  std::vector<float> scratch_;           // [lanes][per_lane]: packed queries, a tile's keys and values, probabilities, stats
  std::vector<float> rotated_q_;         // with PrefillParams::rope: [total][q_heads][head_dim] the queries, rotated
  std::vector<float> rotated_k_;         // with PrefillParams::rope: [total][kv_heads][head_dim] the keys, rotated
  std::vector<std::int64_t> positions_;  // with PrefillParams::rope: [total] each chunk token's position
};

}  // namespace kvattn
