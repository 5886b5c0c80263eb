// kvattn/paged_cache.hpp — the paged KV cache: one container for every attention design.
//
// Memory is handed out in pages of page_size tokens. A sequence owns a list of page ids (its
// page table); a page id is shared by every layer, so one allocation per block of tokens serves
// the whole model, and a layer's storage for a page is found by (layer, page id). Pages are
// reference-counted: fork() gives a child every page of its parent, and the first write into a
// shared page copies that page, in every layer, for the writer (copy-on-write).
//
// Storage, one KV format T (format.hpp: fp32, fp16, bf16, int8_row, fp8_e4m3_row, fp8_e4m3_layer,
// q4_block, hadamard<>), in the memory space M:
//   pool   [layers][num_pages][page_stride]        layer_stride = num_pages · page_stride
// and within one page of one layer (PageLayout, in units of T):
//   GQA family  [2 (K, V)][kv_heads][head_stride]  a head block holds [page_size][row_units]
//               (row_units = head_dim, or head_dim / 2 for q4_block's two values a byte)
//               then, for formats with scales in the page, the scale block
//               [2 (K, V)][kv_heads][page_size][scale_slots] of 4 bytes (one fp32 per row,
//               or q4_block's BlockScale per block of 32 values)
//   MLA         [page_size][row_stride]            a row holds [latent_dim | rope_dim], or for the
//               MLA formats (fp8_e4m3_latent, int8_latent) [latent_dim codes | latent_dim / 128
//               fp32 scales | rope_dim bf16] bytes
// Why: a decode kernel works on one (sequence, KV head) at a time and streams that head's keys,
// then its values, page after page; with one KV head's tokens contiguous each page gives it two
// unbroken runs of page_size · head_dim elements, and each head block starts on a cache line
// (head_stride is padded to 64 bytes). MLA scores every head against the same latent rows, so a
// token's latent and rotary key sit together in one row, and the values are a view of the
// latent (the first latent_dim elements of each row). Every page starts on a cache line.
// A quantized format's scales sit in the page's own scale block, not beside each row, so that
// every head's run of values stays contiguous and aligned; kernels find them through the same
// view, fork and copy-on-write copy them with their page, and callers never pass them. A format
// with one scale per layer (fp8_e4m3_layer) keeps its scales in the cache itself: they are
// given when the cache is made (KvScales, one pair per layer), fixed for its life, and every view
// of a layer carries that layer's pair.
//
// Kernels see the cache through PagedKvView: the layer's pool pointer, the layout, and a batch's
// page table as plain CSR arrays (indptr, indices, tokens in the last page), identical for CPU
// and CUDA kernels.
//
// Every mutation is all-or-nothing: a request that cannot be met (pool exhausted, unknown or
// removed sequence, truncation past the end, a size of zero or less, a layer out of range)
// throws before anything changes (kvattn::invalid_argument or kvattn::capacity_error, with the
// values in the message), and the cache is exactly as it was. A writer of several sequences at
// once (a batched prefill) makes their pages writable in one request first (make_writable of
// TokenRanges), so that the batch, too, fails whole or succeeds whole.
//
// Thread safety: mutations (add_sequence, append, fork, truncate, remove, write*) from one
// thread at a time; any number of threads may read (read*, views, page tables, stats) and run
// kernels concurrently while no mutation runs. Slots, views and page tables describe the cache
// as it was when they were taken: any mutation may move a sequence's pages (copy-on-write).
//
// One cache may be shared by translation units built for different instruction sets: the
// members that run SIMD code (write*, read*) carry the caller's target in their symbols
// (this_target, config.hpp); the bookkeeping members are plain scalar code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "format.hpp"
#include "memory.hpp"
#include "model.hpp"
#include "shape.hpp"
#include "storage.hpp"

namespace kvattn {

using SeqId = std::int64_t;
using PageId = std::int32_t;

/// What a page holds: keys and values per KV head, or MLA's latent and rotary key per token.
enum class PageContent { gqa, mla };

/// Where one token's entries are: a page and the token's index within it.
struct Slot {
  PageId page = 0;
  std::int32_t offset = 0;
  friend constexpr bool operator==(Slot a, Slot b) noexcept { return a.page == b.page && a.offset == b.offset; }
  friend constexpr bool operator!=(Slot a, Slot b) noexcept { return !(a == b); }
};

/// Tokens [first, first + count) of one sequence: what a batched writer (prefill) is about to write.
struct TokenRange {
  SeqId seq = 0;
  std::int64_t first = 0;
  std::int64_t count = 0;  ///< 0: nothing to write (the sequence must still exist)
};

/// Offsets within one page of one layer, in units of the cache's format (format_traits<F>::unit:
/// an element of fp32 / fp16 / bf16, a byte of the 8-bit and 4-bit formats). The same for every page and
/// layer.
struct PageLayout {
  PageContent content = PageContent::gqa;
  int page_size = 0;               ///< tokens per page
  int kv_heads = 0, head_dim = 0;  ///< GQA family
  std::int64_t head_stride = 0;    ///< GQA: units from one head block to the next
  int latent_dim = 0, rope_dim = 0;  ///< MLA
  std::int64_t row_stride = 0;       ///< MLA: units from one token's row to the next
  std::int64_t rope_offset = 0;      ///< MLA: units from a row's start to its rotary key
  int latent_block = 0;              ///< MLA formats: latent values per fp32 scale (after the latent); 0: none
  /// GQA formats with scales in the page (a scale per row, or per block of a row): units from
  /// the page's start to its scale block, [2 (K, V)][kv_heads][page_size][scale_slots] 4-byte
  /// slots on a cache line (key_scale, value_scale); 0: none.
  std::int64_t scale_offset = 0;
  std::int64_t page_stride = 0;      ///< units from one page to the next (64-byte multiple)
  int unit_bytes = 0;                ///< bytes of one unit
  int row_units = 0;                 ///< GQA: units of one token's row of one KV head (head_dim / values per unit)
  int scale_slots = 0;               ///< GQA: 4-byte scale slots per row (1: a row scale; head_dim / block: block scales)

  /// The layout for `shape` with pages of `page_size` tokens of units of `unit_bytes`, each
  /// holding `values_per_unit` values; with `scale_slots` > 0, a GQA page ends in a scale block
  /// of that many 4-byte slots per row.
  static PageLayout make(const AttentionShape& shape, int page_size, std::size_t unit_bytes, int scale_slots = 0,
                         int values_per_unit = 1) {
    const auto pad = [&](std::int64_t units) { return whole_lines(units, unit_bytes); };
    PageLayout l;
    l.page_size = page_size;
    l.unit_bytes = static_cast<int>(unit_bytes);
    if (const auto* g = std::get_if<GqaShape>(&shape)) {
      l.content = PageContent::gqa;
      l.kv_heads = g->kv_heads;
      l.head_dim = g->head_dim;
      l.row_units = g->head_dim / values_per_unit;
      l.head_stride = pad(std::int64_t{page_size} * l.row_units);
      l.page_stride = 2 * l.kv_heads * l.head_stride;
      if (scale_slots > 0) {
        l.scale_slots = scale_slots;
        l.scale_offset = l.page_stride;
        const std::int64_t scale_bytes = 2 * std::int64_t{l.kv_heads} * page_size * scale_slots * std::int64_t{4};
        l.page_stride += pad((scale_bytes + static_cast<std::int64_t>(unit_bytes) - 1) / static_cast<std::int64_t>(unit_bytes));
      }
    } else {
      const MlaShape& m = std::get<MlaShape>(shape);
      l.content = PageContent::mla;
      l.latent_dim = m.latent_dim;
      l.rope_dim = m.rope_dim;
      l.row_stride = m.latent_dim + m.rope_dim;
      l.rope_offset = m.latent_dim;
      l.page_stride = pad(std::int64_t{page_size} * l.row_stride);
    }
    return l;
  }
  /// `units` of `unit_bytes` each rounded up to whole cache lines.
  static constexpr std::int64_t whole_lines(std::int64_t units, std::size_t unit_bytes) noexcept {
    const auto per_line = static_cast<std::int64_t>(kAlignment / unit_bytes);
    return (units + per_line - 1) / per_line * per_line;
  }
  /// The layout a PagedKvCache<F> uses (format_traits<F>: its unit, values per unit, scales).
  template <class F> static PageLayout of(const AttentionShape& shape, int page_size) {
    using Tr = format_traits<F>;
    int slots = Tr::row_scale ? 1 : 0;
    if constexpr (Tr::block_scale)
      if (const auto* g = std::get_if<GqaShape>(&shape)) slots = g->head_dim / Tr::block;
    PageLayout l = make(shape, page_size, sizeof(typename Tr::unit), slots, Tr::values_per_unit);
    if constexpr (Tr::latent_block > 0) {  // an MLA format's rows (format.hpp), in bytes
      if (const auto* m = std::get_if<MlaShape>(&shape)) {
        l.latent_block = Tr::latent_block;
        l.rope_offset = Tr::row_bytes(m->latent_dim, 0);
        l.row_stride = Tr::row_bytes(m->latent_dim, m->rope_dim);
        l.page_stride = whole_lines(page_size * l.row_stride, 1);
      }
    }
    return l;
  }

  /// GQA: first unit of token `token`'s key (value) row for KV head `head`: [row_units].
  constexpr std::int64_t key(int head, int token) const noexcept { return head * head_stride + std::int64_t{token} * row_units; }
  constexpr std::int64_t value(int head, int token) const noexcept {
    return (kv_heads + head) * head_stride + std::int64_t{token} * row_units;
  }
  /// MLA: first unit of token `token`'s latent [latent_dim] and rotary key [rope_dim] (for the
  /// MLA formats, bytes: the codes, and the rotary key's bf16 elements).
  constexpr std::int64_t latent(int token) const noexcept { return std::int64_t{token} * row_stride; }
  constexpr std::int64_t rope(int token) const noexcept { return std::int64_t{token} * row_stride + rope_offset; }
  /// MLA formats: first byte of token `token`'s latent scales [latent_dim / latent_block] fp32.
  constexpr std::int64_t latent_scales(int token) const noexcept { return std::int64_t{token} * row_stride + latent_dim; }
  /// GQA, formats with scales in the page: index, in the scale block's 4-byte slots, of the first
  /// scale of token `token`'s key (value) row for KV head `head` (its scale_slots follow).
  /// Tokens of one head are consecutive.
  constexpr std::int64_t key_scale(int head, int token) const noexcept {
    return (std::int64_t{head} * page_size + token) * scale_slots;
  }
  constexpr std::int64_t value_scale(int head, int token) const noexcept {
    return ((std::int64_t{kv_heads} + head) * page_size + token) * scale_slots;
  }
  /// Values one token holds in one layer, padding and scales excluded.
  constexpr std::int64_t token_elements() const noexcept {
    return content == PageContent::gqa ? 2 * std::int64_t{kv_heads} * head_dim : std::int64_t{latent_dim} + rope_dim;
  }
  /// Bytes one token holds in one layer, its scales included, padding excluded.
  constexpr std::int64_t token_bytes() const noexcept {
    return content == PageContent::gqa ? 2 * std::int64_t{kv_heads} * (std::int64_t{row_units} * unit_bytes + std::int64_t{scale_slots} * 4)
                                       : row_stride * unit_bytes;
  }
};

/// The size of a cache: layers, head layout, page size and how many pages the pool holds.
struct CacheConfig {
  int layers = 0;
  int page_size = 0;           ///< tokens per page, >= 1
  std::int64_t num_pages = 0;  ///< pages in the pool, >= 1
  AttentionShape shape;

  static CacheConfig for_model(const Model& model, int page_size, std::int64_t num_pages) {
    return CacheConfig{model.layers, page_size, num_pages, model.attention};
  }

  std::string check() const {
    std::string why = std::visit([](const auto& s) { return s.check(); }, shape);
    if (!why.empty()) return why;
    if (layers <= 0) return detail::concat("layers=", layers, ": must be positive");
    if (page_size <= 0) return detail::concat("page_size=", page_size, ": must be positive");
    if (num_pages <= 0 || num_pages > std::numeric_limits<PageId>::max())
      return detail::concat("num_pages=", num_pages, ": must be from 1 to ", std::numeric_limits<PageId>::max());
    return {};
  }
};

/// A batch's page tables in CSR form, the format every kernel reads.
struct BatchPageTable {
  std::vector<std::int32_t> indptr;         ///< [batch + 1] sequence b's pages are indices[indptr[b], indptr[b+1])
  std::vector<std::int32_t> indices;        ///< [indptr[batch]] page ids
  std::vector<std::int32_t> last_page_len;  ///< [batch] tokens in each sequence's last page (0 if empty)

  int batch() const noexcept { return indptr.empty() ? 0 : static_cast<int>(indptr.size()) - 1; }
};

/// Tokens of sequence b of a CSR page table (pages of page_size tokens): its full pages and the
/// tokens of its last. The host's and the GPU kernels' one formula.
KVATTN_HOST_DEVICE inline std::int64_t sequence_length(const std::int32_t* indptr, const std::int32_t* last_page_len, int page_size,
                                                       int b) noexcept {
  const std::int32_t pages = indptr[b + 1] - indptr[b];
  return pages == 0 ? 0 : std::int64_t{pages - 1} * page_size + last_page_len[b];
}

/// One layer's key and value scales, for a format with one scale per layer (fp8_e4m3_layer): a
/// stored byte q means q · k (keys) or q · v (values). As a checkpoint gives them (k_scale and
/// v_scale); 1 when it gives none.
struct KvScales {
  float k = 1.0f;
  float v = 1.0f;
};

/// What a kernel needs to read one layer of a batch: pointers and integers only.
template <class T> struct PagedKvView {
  const T* pool = nullptr;                      ///< this layer: [num_pages][layout.page_stride]
  PageLayout layout;
  const std::int32_t* indptr = nullptr;         ///< [batch + 1]
  const std::int32_t* indices = nullptr;        ///< [indptr[batch]]
  const std::int32_t* last_page_len = nullptr;  ///< [batch]
  int batch = 0;
  KvScales scales;  ///< this layer's scales (formats with one scale per layer; {1, 1} otherwise)

  /// First element of page `page` in this layer: [layout.page_stride].
  const T* page(std::int32_t page_id) const noexcept { return pool + std::int64_t{page_id} * layout.page_stride; }
  /// Tokens of sequence b.
  KVATTN_HOST_DEVICE std::int64_t length(int b) const noexcept { return sequence_length(indptr, last_page_len, layout.page_size, b); }
};

/// Counts and bytes of a cache at one moment.
struct CacheStats {
  std::int64_t pages_total = 0;
  std::int64_t pages_free = 0;
  std::int64_t pages_used = 0;
  std::int64_t pages_shared = 0;       ///< used by more than one sequence
  std::int64_t sequences = 0;
  std::int64_t tokens_logical = 0;     ///< sum of sequence lengths (a shared token counts per sequence)
  std::int64_t tokens_stored = 0;      ///< token slots holding data (a shared token counts once)
  std::int64_t bytes_per_page = 0;     ///< all layers, padding included
  std::int64_t bytes_reserved = 0;     ///< pages_used · bytes_per_page
  std::int64_t bytes_stored = 0;       ///< tokens_stored · payload bytes per token, all layers
  std::int64_t bytes_pool = 0;         ///< the whole pool, pages_total · bytes_per_page
  std::int64_t bytes_bookkeeping = 0;  ///< host memory of the free list, counts and page tables
};

template <class T, class M = HostMemory> class PagedKvCache {
  static_assert(is_kv_format_v<T>, "kvattn::PagedKvCache: T must be a KV format: fp32, fp16, bf16, int8_row, fp8_e4m3_row, fp8_e4m3_layer, q4_block, hadamard<> of int8_row, fp8_e4m3_row or q4_block, fp8_e4m3_latent or int8_latent (format.hpp)");

 public:
  using element_type = T;  ///< the format: format_traits<T>
  using memory_space = M;
  /// Whether each row carries a scale (format.hpp): the page then ends in a scale block.
  static constexpr bool kRowScale = format_traits<T>::row_scale;
  /// Whether one key scale and one value scale serve each layer (format.hpp): the cache holds them.
  static constexpr bool kLayerScale = format_traits<T>::layer_scale;
  /// Whether each block of a row carries a scale and a minimum (format.hpp): in the scale block.
  static constexpr bool kBlockScale = format_traits<T>::block_scale;
  /// Whether T is an MLA format (format.hpp): rows of latent codes, their scales and a bf16 rotary key.
  static constexpr bool kLatentScale = format_traits<T>::latent_block > 0;

  /// A cache of `config`'s size. `layer_scales`: for a format with one scale per layer
  /// (fp8_e4m3_layer), each layer's key and value scales [config.layers] (empty: 1 for every
  /// layer), each from 2^-126 to 2^100; other formats take none.
  explicit PagedKvCache(const CacheConfig& config, std::vector<KvScales> layer_scales = {}) : config_(config) {
    if (std::string why = config.check(); !why.empty()) raise<shape_error>("PagedKvCache: " + why);
    if ((kRowScale || kLayerScale || kBlockScale) && !std::holds_alternative<GqaShape>(config.shape))
      raise<invalid_argument>(detail::concat("PagedKvCache: the ", format_traits<T>::name,
                                             " format holds GQA-family pages (keys and values per KV head); an MLA cache is fp32, fp16, bf16, fp8_e4m3_latent or int8_latent"));
    if constexpr (kLatentScale) {
      const MlaShape* m = std::get_if<MlaShape>(&config.shape);
      if (m == nullptr)
        raise<invalid_argument>(detail::concat("PagedKvCache: the ", format_traits<T>::name,
                                               " format holds MLA rows (a latent and a rotary key per token); a GQA-family cache is fp32, "
                                               "fp16, bf16, int8_row, fp8_e4m3_row, fp8_e4m3_layer, q4_block or hadamard<> of one"));
      if (m->latent_dim % format_traits<T>::latent_block != 0)
        raise<invalid_argument>(detail::concat("PagedKvCache: the ", format_traits<T>::name, " format quantizes the latent in blocks of ",
                                               format_traits<T>::latent_block, " values: latent_dim=", m->latent_dim,
                                               " must be a multiple of ", format_traits<T>::latent_block));
    }
    if constexpr (kLayerScale) {
      if (layer_scales.empty()) layer_scales.assign(static_cast<std::size_t>(config.layers), KvScales{});
      if (layer_scales.size() != static_cast<std::size_t>(config.layers))
        raise<invalid_argument>(detail::concat("PagedKvCache: ", layer_scales.size(), " layer scales for layers=", config.layers,
                                               ": give one {k, v} pair per layer, or none (all 1)"));
      for (std::size_t l = 0; l < layer_scales.size(); ++l)
        for (const auto& [which, value] : {std::pair{"k", layer_scales[l].k}, std::pair{"v", layer_scales[l].v}})
          if (!format_traits<T>::valid_scale(value))
            raise<invalid_argument>(detail::concat("PagedKvCache: layer ", l, "'s ", which, " scale=", value,
                                                   ": a scale must be from 2^-126 to 2^100 (positive, finite, not subnormal)"));
    } else if (!layer_scales.empty()) {
      raise<invalid_argument>(detail::concat("PagedKvCache: ", layer_scales.size(), " layer scales given, and the ",
                                             format_traits<T>::name, " format has none (fp8_e4m3_layer has)"));
    }
    scales_ = std::move(layer_scales);
    if constexpr (format_traits<T>::rotated) {
      const int d = std::get<GqaShape>(config.shape).head_dim;
      if (d > kMaxRotatedDim || (d & (d - 1)) != 0)
        raise<invalid_argument>(detail::concat("PagedKvCache: the ", format_traits<T>::name, " format rotates rows of head_dim=", d,
                                               ": head_dim must be a power of two up to ", kMaxRotatedDim));
    }
    if constexpr (kBlockScale) {
      const int d = std::get<GqaShape>(config.shape).head_dim;
      if (d % format_traits<T>::block != 0 || d > kMaxBlockScaledDim)
        raise<invalid_argument>(detail::concat("PagedKvCache: the ", format_traits<T>::name, " format quantizes blocks of ",
                                               format_traits<T>::block, " values: head_dim=", d, " must be a multiple of ",
                                               format_traits<T>::block, " up to ", kMaxBlockScaledDim));
    }
    check_sizes(config);
    layout_ = PageLayout::of<T>(config.shape, config.page_size);
    layer_stride_ = config.num_pages * layout_.page_stride;
    pool_bytes_ = static_cast<std::size_t>(layer_stride_ * config.layers) * sizeof(T);
    refcount_.assign(static_cast<std::size_t>(config.num_pages), 0);
    free_.reserve(static_cast<std::size_t>(config.num_pages));  // never reallocates: frees cannot throw
    for (std::int64_t p = config.num_pages; p-- > 0;) free_.push_back(static_cast<PageId>(p));
    pool_ = static_cast<T*>(M::allocate(pool_bytes_));
  }
  ~PagedKvCache() { M::deallocate(pool_, pool_bytes_); }

  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;
  /// A moved-from cache holds no pages and no sequences: appends fail with capacity_error, and
  /// it may be assigned to or destroyed.
  PagedKvCache(PagedKvCache&& other) noexcept
      : config_(other.config_), layout_(other.layout_), layer_stride_(other.layer_stride_), pool_(other.pool_),
        pool_bytes_(other.pool_bytes_), refcount_(std::move(other.refcount_)), free_(std::move(other.free_)),
        seqs_(std::move(other.seqs_)), scales_(std::move(other.scales_)), next_id_(other.next_id_), generation_(other.generation_ + 1) {
    other.pool_ = nullptr;
    other.pool_bytes_ = 0;
    other.config_.num_pages = 0;
    other.layer_stride_ = 0;
    other.refcount_.clear();
    other.free_.clear();
    other.seqs_.clear();
    other.scales_.clear();
    ++other.generation_;
  }
  PagedKvCache& operator=(PagedKvCache&& other) noexcept {
    if (this != &other) {
      PagedKvCache gone(std::move(other));
      swap(gone);
    }
    return *this;
  }

  const CacheConfig& config() const noexcept { return config_; }
  const PageLayout& layout() const noexcept { return layout_; }
  /// A count of the changes that can move a sequence's tokens or pages: append, fork, truncate,
  /// remove, and every copy-on-write copy (a write into a shared page included). What was taken
  /// of the cache at one generation (page tables, views, plans) describes it while the
  /// generation is the same; writes that copy nothing and add_sequence leave it alone.
  std::uint64_t generation() const noexcept { return generation_; }
  /// Layer `layer`'s key and value scales: those given when the cache was made for a format with
  /// one scale per layer (fp8_e4m3_layer), {1, 1} for every other format.
  KvScales scales(int layer) const {
    check_layer(layer, "scales");
    return kLayerScale ? scales_[static_cast<std::size_t>(layer)] : KvScales{};
  }

  // ---- sequences -----------------------------------------------------------------------------

  /// A new, empty sequence.
  SeqId add_sequence() {
    const SeqId id = next_id_;
    seqs_.emplace(id, Sequence{});
    ++next_id_;
    return id;
  }

  bool contains(SeqId seq) const noexcept { return seqs_.count(seq) != 0; }
  std::int64_t length(SeqId seq) const { return get(seq, "length").length; }
  /// The sequence's page ids, in token order.
  const std::vector<PageId>& pages(SeqId seq) const { return get(seq, "pages").pages; }
  /// Live sequences, in increasing id order.
  std::vector<SeqId> sequences() const {
    std::vector<SeqId> ids;
    ids.reserve(seqs_.size());
    for (const auto& entry : seqs_) ids.push_back(entry.first);
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  /// Reserves n more tokens at the end of `seq` and writes where each one goes, in order, to
  /// slots [n] (unless it is null). Takes new pages from the pool, and a private copy of a
  /// shared, partly filled last page.
  void append(SeqId seq, std::int64_t n, Slot* slots) { commit_append(plan_append(seq, n), slots); }
  /// As above, returning the slots.
  std::vector<Slot> append(SeqId seq, std::int64_t n) {
    const AppendPlan plan = plan_append(seq, n);  // every check first: no allocation for a request that fails
    std::vector<Slot> slots(static_cast<std::size_t>(n));
    commit_append(plan, slots.data());
    return slots;
  }

  /// A new sequence sharing every page of `parent` (nothing is copied until one of them writes).
  SeqId fork(SeqId parent) {
    Sequence copy = get(parent, "fork");
    const SeqId id = next_id_;
    const Sequence& child = seqs_.emplace(id, std::move(copy)).first->second;
    ++next_id_;
    ++generation_;
    for (PageId p : child.pages) ++refcount_[page_index(p)];
    return id;
  }

  /// Shortens `seq` to `new_length` tokens; pages no sequence uses any more return to the pool.
  void truncate(SeqId seq, std::int64_t new_length) {
    Sequence& s = get(seq, "truncate");
    if (new_length < 0 || new_length > s.length)
      raise<invalid_argument>(detail::concat("truncate(seq=", seq, ", length=", new_length,
                                             "): the sequence holds ", s.length, " tokens"));
    const std::int64_t keep = (new_length + config_.page_size - 1) / config_.page_size;
    while (static_cast<std::int64_t>(s.pages.size()) > keep) {
      release_page(s.pages.back());
      s.pages.pop_back();
    }
    s.length = new_length;
    ++generation_;
  }

  /// Removes `seq`; its pages return to the pool unless another sequence shares them.
  void remove(SeqId seq) {
    Sequence& s = get(seq, "remove");
    for (PageId p : s.pages) release_page(p);
    seqs_.erase(seq);
    ++generation_;
  }

  /// For writers outside the cache (a device kernel writing through slots): checks that tokens
  /// [first, first + count) of `seq` exist and gives `seq` its own copy of every shared page
  /// among them, in every layer, so that slot() then names pages it may write. All or nothing:
  /// throws (invalid_argument, capacity_error when the pool cannot hold the copies) before any
  /// change.
  void make_writable(SeqId seq, std::int64_t first, std::int64_t count) {
    make_pages_private(get(seq, "make_writable"), seq, first, count, "make_writable");
  }

  /// make_writable for the ranges of several sequences at once, all or nothing across them: every
  /// range is checked and the copies they need are counted before any is made, so a batched
  /// writer (prefill) cannot fail on a later sequence after changing an earlier one. A page that
  /// w of the ranges write and r sequences hold needs min(w, r - 1) copies (the last holder left
  /// may write it in place). A sequence may appear once; ranges of count 0 are only checked.
  /// Throws invalid_argument (unknown or repeated sequence, range outside it) or capacity_error.
  /// `op` names the caller in the messages.
  void make_writable(const std::vector<TokenRange>& ranges, const char* op = "make_writable") {
    const std::int64_t P = config_.page_size;
    std::vector<SeqId> ids;
    std::vector<PageId> written;  // each range's pages, once per range
    ids.reserve(ranges.size());
    for (const TokenRange& r : ranges) {
      const Sequence& s = get(r.seq, op);
      ids.push_back(r.seq);
      if (r.count == 0) continue;
      check_position(r.seq, s, r.first, r.count, op);
      for (std::int64_t i = r.first / P; i <= (r.first + r.count - 1) / P; ++i) written.push_back(s.pages[static_cast<std::size_t>(i)]);
    }
    std::sort(ids.begin(), ids.end());
    if (const auto twice = std::adjacent_find(ids.begin(), ids.end()); twice != ids.end())
      raise<invalid_argument>(detail::concat(op, ": sequence ", *twice, " appears more than once among the ", ranges.size(),
                                             " ranges"));
    std::sort(written.begin(), written.end());
    std::int64_t copies = 0;
    for (std::size_t i = 0, j = 0; i < written.size(); i = j) {
      while (j < written.size() && written[j] == written[i]) ++j;
      copies += std::min<std::int64_t>(static_cast<std::int64_t>(j - i), refcount_[page_index(written[i])] - 1);
    }
    if (copies > free_pages())
      raise<capacity_error>(detail::concat(op, ": the ", ranges.size(), " ranges need ", copies, " copies of shared pages, the pool has ",
                                           free_pages(), " free"));
    for (const TokenRange& r : ranges) {  // cannot fail now: every copy has its page
      if (r.count == 0) continue;
      Sequence& s = seqs_.at(r.seq);
      for (std::int64_t i = r.first / P; i <= (r.first + r.count - 1) / P; ++i)
        if (refcount_[page_index(s.pages[static_cast<std::size_t>(i)])] > 1) make_private(s, i);
    }
  }

  /// Where token `position` of `seq` is (read-only: a write through it would bypass copy-on-write).
  Slot slot(SeqId seq, std::int64_t position) const {
    const Sequence& s = get(seq, "slot");
    check_position(seq, s, position, 1, "slot");
    return Slot{s.pages[static_cast<std::size_t>(position / config_.page_size)],
                static_cast<std::int32_t>(position % config_.page_size)};
  }

  // ---- writing and reading tokens ------------------------------------------------------------

  /// GQA family: writes keys and values of tokens [first, first + count) of `seq` in `layer`.
  /// k, v: [count][kv_heads][head_dim] of fp32, fp16 or bf16 (converted to T, or quantized with
  /// one scale per row, per block of a row, or the layer's scales: format.hpp). Copies any shared page in that range
  /// first (in every layer); fails before writing if the pool cannot. A format with one scale per
  /// layer refuses a NaN or an infinity (invalid_argument naming it), before writing anything.
  template <class Src, class Target = this_target>
  void write(SeqId seq, int layer, std::int64_t first, std::int64_t count, const Src* k, const Src* v) {
    static_assert(is_storage_type_v<Src>, "kvattn::PagedKvCache::write: k and v are fp32, fp16 or bf16");
    static_assert(!kLatentScale, "kvattn::PagedKvCache::write: an MLA format's cache is written with write_latent");
    if constexpr (kLayerScale) check_finite(seq, layer, first, count, k, v);
    prepare_write(seq, layer, first, count, PageContent::gqa, "write");
    const Sequence& s = seqs_.at(seq);
    const std::size_t d = static_cast<std::size_t>(layout_.head_dim);
    for (std::int64_t i = 0; i < count; ++i) {
      T* page = page_data(layer, s, first + i);
      const int t = static_cast<int>((first + i) % config_.page_size);
      for (int h = 0; h < layout_.kv_heads; ++h) {
        const std::int64_t src = (i * layout_.kv_heads + h) * layout_.head_dim;
        if constexpr (kRowScale) {
          float* scales = scale_block(page);
          scales[layout_.key_scale(h, t)] = format_traits<T>::quantize_row(k + src, page + layout_.key(h, t), d);
          scales[layout_.value_scale(h, t)] = format_traits<T>::quantize_row(v + src, page + layout_.value(h, t), d);
        } else if constexpr (kBlockScale) {
          BlockScale* scales = block_scales(page);
          format_traits<T>::quantize_row(k + src, page + layout_.key(h, t), d, scales + layout_.key_scale(h, t));
          format_traits<T>::quantize_row(v + src, page + layout_.value(h, t), d, scales + layout_.value_scale(h, t));
        } else if constexpr (kLayerScale) {
          const KvScales& ls = scales_[static_cast<std::size_t>(layer)];
          format_traits<T>::quantize_row(k + src, page + layout_.key(h, t), d, ls.k);
          format_traits<T>::quantize_row(v + src, page + layout_.value(h, t), d, ls.v);
        } else {
          convert_row(typename Target::isa{}, k + src, page + layout_.key(h, t), d);
          convert_row(typename Target::isa{}, v + src, page + layout_.value(h, t), d);
        }
      }
    }
  }
  template <class Src, class Target = this_target>
  void write(SeqId seq, int layer, std::int64_t position, const Src* k, const Src* v) {
    write<Src, Target>(seq, layer, position, 1, k, v);
  }

  /// MLA: writes latents [count][latent_dim] and rotary keys [count][rope_dim] of tokens
  /// [first, first + count) of `seq` in `layer`, of fp32, fp16 or bf16 (converted to T; an MLA
  /// format quantizes each latent block of 128 with its scale and rounds the rotary key to bf16:
  /// format.hpp). Copy-on-write as write().
  template <class Src, class Target = this_target>
  void write_latent(SeqId seq, int layer, std::int64_t first, std::int64_t count, const Src* latent, const Src* rope) {
    static_assert(is_storage_type_v<Src>, "kvattn::PagedKvCache::write_latent: latent and rope are fp32, fp16 or bf16");
    static_assert(!kRowScale && !kLayerScale && !kBlockScale,
                  "kvattn::PagedKvCache::write_latent: MLA caches are fp32, fp16, bf16, fp8_e4m3_latent or int8_latent");
    prepare_write(seq, layer, first, count, PageContent::mla, "write_latent");
    const Sequence& s = seqs_.at(seq);
    const auto dc = static_cast<std::size_t>(layout_.latent_dim), dr = static_cast<std::size_t>(layout_.rope_dim);
    for (std::int64_t i = 0; i < count; ++i) {
      T* page = page_data(layer, s, first + i);
      const int t = static_cast<int>((first + i) % config_.page_size);
      if constexpr (kLatentScale) {
        format_traits<T>::quantize_latent(latent + i * layout_.latent_dim, page + layout_.latent(t), latent_scales(page, t), dc);
        convert_row(typename Target::isa{}, rope + i * layout_.rope_dim, latent_rope(page, t), dr);
      } else {
        convert_row(typename Target::isa{}, latent + i * layout_.latent_dim, page + layout_.latent(t), dc);
        convert_row(typename Target::isa{}, rope + i * layout_.rope_dim, page + layout_.rope(t), dr);
      }
    }
  }
  template <class Src, class Target = this_target>
  void write_latent(SeqId seq, int layer, std::int64_t position, const Src* latent, const Src* rope) {
    write_latent<Src, Target>(seq, layer, position, 1, latent, rope);
  }

  /// GQA family: token `position`'s keys and values in `layer`, k, v: [kv_heads][head_dim]
  /// (dequantized: the values the kernels compute with).
  template <class Dst, class Target = this_target>
  void read(SeqId seq, int layer, std::int64_t position, Dst* k, Dst* v) const {
    static_assert(is_storage_type_v<Dst>, "kvattn::PagedKvCache::read: k and v are fp32, fp16 or bf16");
    static_assert(!kLatentScale, "kvattn::PagedKvCache::read: an MLA format's cache is read with read_latent");
    const T* page = token_page(seq, layer, position, PageContent::gqa, "read");
    const int t = static_cast<int>(position % config_.page_size);
    const std::size_t d = static_cast<std::size_t>(layout_.head_dim);
    for (int h = 0; h < layout_.kv_heads; ++h) {
      Dst* kd = k + std::int64_t{h} * layout_.head_dim;
      Dst* vd = v + std::int64_t{h} * layout_.head_dim;
      if constexpr (kRowScale) {
        const float* scales = scale_block(page);
        const auto dequantize = [&](const T* q, float scale, Dst* dst) {
          float x[format_traits<T>::rotated ? kMaxRotatedDim : 1];
          for (std::size_t c = 0; c < d; ++c) {
            const float value = format_traits<T>::dequantize(q[c], scale);
            if constexpr (format_traits<T>::rotated) x[c] = value;
            else dst[c] = from_float<Dst>(value);
          }
          if constexpr (format_traits<T>::rotated) {  // back from the rotated basis
            hadamard_rotate(x, static_cast<int>(d));
            for (std::size_t c = 0; c < d; ++c) dst[c] = from_float<Dst>(x[c]);
          }
        };
        dequantize(page + layout_.key(h, t), scales[layout_.key_scale(h, t)], kd);
        dequantize(page + layout_.value(h, t), scales[layout_.value_scale(h, t)], vd);
      } else if constexpr (kBlockScale) {
        const BlockScale* scales = block_scales(page);
        const auto dequantize = [&](const T* q, const BlockScale* bs, Dst* dst) {
          float x[format_traits<T>::rotated ? kMaxRotatedDim : 1];
          for (std::size_t c = 0; c < d; ++c) {
            const float value = format_traits<T>::dequantize(q, c, bs);
            if constexpr (format_traits<T>::rotated) x[c] = value;
            else dst[c] = from_float<Dst>(value);
          }
          if constexpr (format_traits<T>::rotated) {  // back from the rotated basis
            hadamard_rotate(x, static_cast<int>(d));
            for (std::size_t c = 0; c < d; ++c) dst[c] = from_float<Dst>(x[c]);
          }
        };
        dequantize(page + layout_.key(h, t), scales + layout_.key_scale(h, t), kd);
        dequantize(page + layout_.value(h, t), scales + layout_.value_scale(h, t), vd);
      } else if constexpr (kLayerScale) {
        const KvScales& ls = scales_[static_cast<std::size_t>(layer)];
        const T* kq = page + layout_.key(h, t);
        const T* vq = page + layout_.value(h, t);
        for (std::size_t c = 0; c < d; ++c) {
          kd[c] = from_float<Dst>(format_traits<T>::dequantize(kq[c], ls.k));
          vd[c] = from_float<Dst>(format_traits<T>::dequantize(vq[c], ls.v));
        }
      } else {
        convert_row(typename Target::isa{}, page + layout_.key(h, t), kd, d);
        convert_row(typename Target::isa{}, page + layout_.value(h, t), vd, d);
      }
    }
  }

  /// MLA: token `position`'s latent [latent_dim] and rotary key [rope_dim] in `layer`
  /// (dequantized: the values the kernels compute with).
  template <class Dst, class Target = this_target>
  void read_latent(SeqId seq, int layer, std::int64_t position, Dst* latent, Dst* rope) const {
    static_assert(is_storage_type_v<Dst>, "kvattn::PagedKvCache::read_latent: latent and rope are fp32, fp16 or bf16");
    static_assert(!kRowScale && !kLayerScale && !kBlockScale,
                  "kvattn::PagedKvCache::read_latent: MLA caches are fp32, fp16, bf16, fp8_e4m3_latent or int8_latent");
    const T* page = token_page(seq, layer, position, PageContent::mla, "read_latent");
    const int t = static_cast<int>(position % config_.page_size);
    const auto dc = static_cast<std::size_t>(layout_.latent_dim), dr = static_cast<std::size_t>(layout_.rope_dim);
    if constexpr (kLatentScale) {
      const float* scales = latent_scales(page, t);
      for (std::size_t c = 0; c < dc; ++c) latent[c] = from_float<Dst>(format_traits<T>::dequantize(page + layout_.latent(t), c, scales));
      convert_row(typename Target::isa{}, latent_rope(page, t), rope, dr);
    } else {
      convert_row(typename Target::isa{}, page + layout_.latent(t), latent, dc);
      convert_row(typename Target::isa{}, page + layout_.rope(t), rope, dr);
    }
  }

  // ---- what kernels read ---------------------------------------------------------------------

  /// Fills `out` with the page tables of `seqs` [count], reusing its vectors' memory.
  void build_page_table(const SeqId* seqs, std::size_t count, BatchPageTable& out) const {
    std::int64_t nnz = 0;
    for (std::size_t b = 0; b < count; ++b) nnz += static_cast<std::int64_t>(get(seqs[b], "build_page_table").pages.size());
    if (nnz > std::numeric_limits<std::int32_t>::max())
      raise<invalid_argument>(detail::concat("build_page_table: ", nnz, " pages exceed the int32 indices of the view"));
    out.indptr.resize(count + 1);
    out.indices.resize(static_cast<std::size_t>(nnz));
    out.last_page_len.resize(count);
    out.indptr[0] = 0;
    std::size_t at = 0;
    for (std::size_t b = 0; b < count; ++b) {
      const Sequence& s = seqs_.at(seqs[b]);
      std::copy(s.pages.begin(), s.pages.end(), out.indices.begin() + static_cast<std::ptrdiff_t>(at));
      at += s.pages.size();
      out.indptr[b + 1] = static_cast<std::int32_t>(at);
      out.last_page_len[b] =
          s.length == 0 ? 0 : static_cast<std::int32_t>(s.length - (static_cast<std::int64_t>(s.pages.size()) - 1) * config_.page_size);
    }
  }
  BatchPageTable page_table(const std::vector<SeqId>& seqs) const {
    BatchPageTable t;
    build_page_table(seqs.data(), seqs.size(), t);
    return t;
  }

  /// One layer of the pool with a batch's page table; valid while `table` lives and no mutation runs.
  PagedKvView<T> view(const BatchPageTable& table, int layer) const {
    check_layer(layer, "view");
    return PagedKvView<T>{layer_data(layer), layout_, table.indptr.data(), table.indices.data(),
                          table.last_page_len.data(), table.batch(), scales(layer)};
  }

  /// The pool of one layer: [num_pages][layout().page_stride].
  const T* layer_data(int layer) const noexcept { return pool_ + layer * layer_stride_; }
  T* layer_data(int layer) noexcept { return pool_ + layer * layer_stride_; }
  std::int64_t layer_stride() const noexcept { return layer_stride_; }
  /// The whole pool: [layers][num_pages][page_stride], pool_bytes() bytes.
  const T* data() const noexcept { return pool_; }
  std::size_t pool_bytes() const noexcept { return pool_bytes_; }

  // ---- accounting ----------------------------------------------------------------------------

  std::int64_t free_pages() const noexcept { return static_cast<std::int64_t>(free_.size()); }
  /// Sequences holding page `page` (0: free).
  int page_refcount(PageId page) const { return refcount_.at(page_index(page)); }

  CacheStats stats() const {
    CacheStats st;
    st.pages_total = config_.num_pages;
    st.pages_free = free_pages();
    st.pages_used = st.pages_total - st.pages_free;
    for (int r : refcount_) st.pages_shared += r > 1;
    st.sequences = static_cast<std::int64_t>(seqs_.size());
    std::vector<std::int32_t> filled(refcount_.size(), 0);  // tokens holding data per page
    const std::int64_t P = config_.page_size;
    for (const auto& entry : seqs_) {
      const Sequence& s = entry.second;
      st.tokens_logical += s.length;
      for (std::size_t i = 0; i < s.pages.size(); ++i) {
        auto& f = filled[page_index(s.pages[i])];
        f = std::max(f, static_cast<std::int32_t>(std::min<std::int64_t>(P, s.length - static_cast<std::int64_t>(i) * P)));
      }
    }
    for (std::int32_t f : filled) st.tokens_stored += f;
    const auto elem = static_cast<std::int64_t>(sizeof(T));
    st.bytes_per_page = layout_.page_stride * config_.layers * elem;
    st.bytes_reserved = st.pages_used * st.bytes_per_page;
    st.bytes_pool = st.pages_total * st.bytes_per_page;
    st.bytes_stored = st.tokens_stored * layout_.token_bytes() * config_.layers;
    std::int64_t tables = 0;
    for (const auto& entry : seqs_)
      tables += static_cast<std::int64_t>(sizeof(entry) + entry.second.pages.capacity() * sizeof(PageId));
    st.bytes_bookkeeping = static_cast<std::int64_t>(sizeof(*this) + refcount_.capacity() * sizeof(int) +
                                                     free_.capacity() * sizeof(PageId) +
                                                     seqs_.bucket_count() * sizeof(void*)) + tables;
    return st;
  }

  /// Checks the bookkeeping (reference counts match the page tables, free + used = total, every
  /// table has the pages its length needs); throws std::logic_error saying what is wrong.
  void check_invariants() const {
    std::vector<int> counted(refcount_.size(), 0);
    for (const auto& entry : seqs_) {
      const Sequence& s = entry.second;
      const std::int64_t need = (s.length + config_.page_size - 1) / config_.page_size;
      if (static_cast<std::int64_t>(s.pages.size()) != need)
        throw std::logic_error(detail::concat("seq ", entry.first, ": ", s.pages.size(), " pages for ", s.length, " tokens"));
      for (PageId p : s.pages) ++counted.at(page_index(p));
    }
    std::vector<bool> is_free(refcount_.size(), false);
    for (PageId p : free_) {
      if (is_free.at(page_index(p))) throw std::logic_error(detail::concat("page ", p, " is free twice"));
      is_free[page_index(p)] = true;
    }
    for (std::size_t p = 0; p < refcount_.size(); ++p) {
      if (refcount_[p] != counted[p])
        throw std::logic_error(detail::concat("page ", p, ": refcount ", refcount_[p], ", used by ", counted[p], " tables"));
      if (is_free[p] != (refcount_[p] == 0))
        throw std::logic_error(detail::concat("page ", p, ": refcount ", refcount_[p], (is_free[p] ? " but free" : " but not free")));
    }
  }

 private:
  struct Sequence {
    std::vector<PageId> pages;  // [ceil(length / page_size)]
    std::int64_t length = 0;
  };

  static std::size_t page_index(PageId p) noexcept { return static_cast<std::size_t>(p); }

  /// Sizes whose element counts or bytes would not fit in 64 bits are rejected up front. Padding
  /// adds less than one cache line to each head block (GQA) or page (MLA), which bounds page_stride.
  static void check_sizes(const CacheConfig& c) {
    using I = std::int64_t;
    const auto mul = [](I a, I b, I& out) {
      if (a != 0 && b > std::numeric_limits<I>::max() / a) return false;
      out = a * b;
      return true;
    };
    const I line = static_cast<I>(kAlignment / sizeof(T));
    I blocks = 1, width = 0;
    if (const auto* g = std::get_if<GqaShape>(&c.shape)) {
      blocks = I{2} * g->kv_heads;
      // A row's scale is at most 4 units more per token (scale block), padded like a head block.
      width = I{g->head_dim} + (kRowScale || kBlockScale ? I{4} : I{0});
    } else {
      const MlaShape& m = std::get<MlaShape>(c.shape);
      width = (kLatentScale ? I{2} : I{1}) * (I{m.latent_dim} + m.rope_dim);  // (codes, scales and bf16: at most 2 bytes a value)
    }
    I block = 0, stride = 0, layer = 0, pool = 0, bytes = 0;
    const bool ok = mul(c.page_size, width, block) && block <= std::numeric_limits<I>::max() - line &&
                    mul(blocks, block + line, stride) && mul(stride, c.num_pages, layer) && mul(layer, c.layers, pool) &&
                    mul(pool, static_cast<I>(sizeof(T)), bytes);
    if (!ok)
      raise<invalid_argument>(detail::concat("PagedKvCache: layers=", c.layers, " page_size=", c.page_size,
                                             " num_pages=", c.num_pages, ": the pool's size would overflow 64 bits"));
  }

  struct AppendPlan {
    Sequence* s;
    std::int64_t n, have, need;
    bool copy_last;
  };
  /// Every check of append(seq, n); changes nothing.
  AppendPlan plan_append(SeqId seq, std::int64_t n) {
    Sequence& s = get(seq, "append");
    if (n <= 0) raise<invalid_argument>(detail::concat("append(seq=", seq, ", n=", n, "): n must be positive"));
    const std::int64_t P = config_.page_size;
    const std::int64_t capacity = config_.num_pages * P;
    if (n > capacity - s.length)
      raise<capacity_error>(detail::concat("append(seq=", seq, ", n=", n, "): ", s.length, " + ", n,
                                           " tokens exceed the pool's ", capacity));
    const std::int64_t have = static_cast<std::int64_t>(s.pages.size());
    const std::int64_t need = (s.length + n + P - 1) / P;
    const bool copy_last = s.length % P != 0 && refcount_[page_index(s.pages.back())] > 1;
    const std::int64_t new_pages = need - have + (copy_last ? 1 : 0);
    if (new_pages > static_cast<std::int64_t>(free_.size()))
      raise<capacity_error>(detail::concat("append(seq=", seq, ", n=", n, "): needs ", new_pages, " free page",
                                           new_pages == 1 ? "" : "s", ", the pool has ", free_.size(), " of ",
                                           config_.num_pages));
    return AppendPlan{&s, n, have, need, copy_last};
  }
  /// Carries out a checked append; only the page table's growth can throw (std::bad_alloc), first.
  void commit_append(const AppendPlan& a, Slot* slots) {
    Sequence& s = *a.s;
    const std::int64_t P = config_.page_size;
    if (static_cast<std::size_t>(a.need) > s.pages.capacity())  // grow geometrically: appends stay O(1)
      s.pages.reserve(std::max(static_cast<std::size_t>(a.need), 2 * s.pages.capacity()));
    // Nothing below throws.
    if (a.copy_last) make_private(s, a.have - 1);
    for (std::int64_t i = a.have; i < a.need; ++i) s.pages.push_back(take_page());
    if (slots != nullptr)
      for (std::int64_t t = s.length; t < s.length + a.n; ++t)
        *slots++ = Slot{s.pages[static_cast<std::size_t>(t / P)], static_cast<std::int32_t>(t % P)};
    s.length += a.n;
    ++generation_;
  }

  Sequence& get(SeqId seq, const char* op) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) raise<invalid_argument>(detail::concat(op, "(seq=", seq, "): no such sequence"));
    return it->second;
  }
  const Sequence& get(SeqId seq, const char* op) const { return const_cast<PagedKvCache*>(this)->get(seq, op); }

  void check_layer(int layer, const char* op) const {
    if (layer < 0 || layer >= config_.layers)
      raise<invalid_argument>(detail::concat(op, ": layer=", layer, " is outside [0, ", config_.layers, ")"));
  }
  void check_position(SeqId seq, const Sequence& s, std::int64_t first, std::int64_t count, const char* op) const {
    if (count <= 0 || first < 0 || first > s.length - count)
      raise<invalid_argument>(detail::concat(op, "(seq=", seq, ", position=", first, ", count=", count,
                                             "): the sequence holds ", s.length, " tokens"));
  }
  void check_content(PageContent want, const char* op) const {
    if (layout_.content != want)
      raise<invalid_argument>(detail::concat(op, ": this cache holds ", layout_.content == PageContent::gqa ? "GQA" : "MLA",
                                             " pages (use ", layout_.content == PageContent::gqa ? "write/read" : "write_latent/read_latent",
                                             ")"));
  }

  PageId take_page() noexcept {
    const PageId p = free_.back();
    free_.pop_back();
    refcount_[page_index(p)] = 1;
    return p;
  }
  void release_page(PageId p) noexcept {
    if (--refcount_[page_index(p)] == 0) free_.push_back(p);  // capacity reserved: cannot throw
  }
  /// Gives `s` its own copy of its page `i`, in every layer. Needs one free page.
  void make_private(Sequence& s, std::int64_t i) noexcept {
    const PageId old = s.pages[static_cast<std::size_t>(i)];
    const PageId copy = take_page();
    const std::size_t bytes = static_cast<std::size_t>(layout_.page_stride) * sizeof(T);
    for (int l = 0; l < config_.layers; ++l)
      M::copy(layer_data(l) + std::int64_t{copy} * layout_.page_stride, layer_data(l) + std::int64_t{old} * layout_.page_stride, bytes);
    release_page(old);
    s.pages[static_cast<std::size_t>(i)] = copy;
    ++generation_;
  }

  /// A format with one scale per layer: throws invalid_argument naming the first NaN or infinity
  /// of k, v [count][kv_heads][head_dim] (after checking the call's sequence, layer and tokens).
  template <class Src> void check_finite(SeqId seq, int layer, std::int64_t first, std::int64_t count, const Src* k, const Src* v) const {
    const Sequence& s = get(seq, "write");
    check_content(PageContent::gqa, "write");
    check_layer(layer, "write");
    check_position(seq, s, first, count, "write");
    const std::size_t d = static_cast<std::size_t>(layout_.head_dim);
    for (std::int64_t i = 0; i < count; ++i)
      for (int h = 0; h < layout_.kv_heads; ++h)
        for (const auto& [which, src] : {std::pair{"key", k}, std::pair{"value", v}}) {
          const Src* row = src + (i * layout_.kv_heads + h) * layout_.head_dim;
          if (const std::size_t c = format_traits<T>::first_non_finite(row, d); c != d)
            raise<invalid_argument>(detail::concat("write(seq=", seq, ", layer=", layer, ", position=", first + i, "): the ", which,
                                                   " of KV head ", h, " holds ", to_float(row[c]), " at column ", c, ": the ",
                                                   format_traits<T>::name, " format stores finite values only"));
        }
  }

  /// Validates a write of tokens [first, first + count) and makes their pages private to `seq`.
  void prepare_write(SeqId seq, int layer, std::int64_t first, std::int64_t count, PageContent content, const char* op) {
    static_assert(M::host_accessible, "kvattn::PagedKvCache: host writes need host-accessible memory");
    Sequence& s = get(seq, op);
    check_content(content, op);
    check_layer(layer, op);
    make_pages_private(s, seq, first, count, op);
  }
  /// Checks tokens [first, first + count) of `s` and copies its shared pages among them.
  void make_pages_private(Sequence& s, SeqId seq, std::int64_t first, std::int64_t count, const char* op) {
    check_position(seq, s, first, count, op);
    const std::int64_t P = config_.page_size;
    const std::int64_t a = first / P, b = (first + count - 1) / P;
    std::int64_t shared = 0;
    for (std::int64_t i = a; i <= b; ++i) shared += refcount_[page_index(s.pages[static_cast<std::size_t>(i)])] > 1;
    if (shared > free_pages())
      raise<capacity_error>(detail::concat(op, "(seq=", seq, ", position=", first, ", count=", count, "): copying ", shared,
                                           " shared page", shared == 1 ? "" : "s", " needs as many free pages, the pool has ",
                                           free_pages()));
    for (std::int64_t i = a; i <= b; ++i)
      if (refcount_[page_index(s.pages[static_cast<std::size_t>(i)])] > 1) make_private(s, i);
  }

  /// A page's scale block: [2][kv_heads][page_size] floats (formats with a scale per row).
  float* scale_block(T* page) const noexcept { return reinterpret_cast<float*>(page + layout_.scale_offset); }
  const float* scale_block(const T* page) const noexcept { return reinterpret_cast<const float*>(page + layout_.scale_offset); }
  /// A page's scale block of a format with block scales: [2][kv_heads][page_size][scale_slots].
  BlockScale* block_scales(T* page) const noexcept { return reinterpret_cast<BlockScale*>(page + layout_.scale_offset); }
  const BlockScale* block_scales(const T* page) const noexcept { return reinterpret_cast<const BlockScale*>(page + layout_.scale_offset); }
  /// MLA formats: the scales of token slot t's latent [latent_dim / latent_block], and its bf16 rotary key.
  float* latent_scales(T* page, int t) const noexcept { return reinterpret_cast<float*>(page + layout_.latent_scales(t)); }
  const float* latent_scales(const T* page, int t) const noexcept { return reinterpret_cast<const float*>(page + layout_.latent_scales(t)); }
  bf16* latent_rope(T* page, int t) const noexcept { return reinterpret_cast<bf16*>(page + layout_.rope(t)); }
  const bf16* latent_rope(const T* page, int t) const noexcept { return reinterpret_cast<const bf16*>(page + layout_.rope(t)); }

  T* page_data(int layer, const Sequence& s, std::int64_t position) noexcept {
    return layer_data(layer) + std::int64_t{s.pages[static_cast<std::size_t>(position / config_.page_size)]} * layout_.page_stride;
  }
  const T* token_page(SeqId seq, int layer, std::int64_t position, PageContent content, const char* op) const {
    static_assert(M::host_accessible, "kvattn::PagedKvCache: host reads need host-accessible memory");
    const Sequence& s = get(seq, op);
    check_content(content, op);
    check_layer(layer, op);
    check_position(seq, s, position, 1, op);
    return const_cast<PagedKvCache*>(this)->page_data(layer, s, position);
  }

  void swap(PagedKvCache& o) noexcept {
    std::swap(config_, o.config_);
    std::swap(layout_, o.layout_);
    std::swap(layer_stride_, o.layer_stride_);
    std::swap(pool_, o.pool_);
    std::swap(pool_bytes_, o.pool_bytes_);
    refcount_.swap(o.refcount_);
    free_.swap(o.free_);
    seqs_.swap(o.seqs_);
    scales_.swap(o.scales_);
    std::swap(next_id_, o.next_id_);
    std::swap(generation_, o.generation_);
  }

  CacheConfig config_;
  PageLayout layout_;
  std::int64_t layer_stride_ = 0;  // elements
  T* pool_ = nullptr;
  std::size_t pool_bytes_ = 0;
  std::vector<int> refcount_;      // [num_pages] sequences using each page
  std::vector<PageId> free_;       // free page ids, capacity num_pages
  std::unordered_map<SeqId, Sequence> seqs_;
  std::vector<KvScales> scales_;   // [layers] formats with one scale per layer; empty otherwise
  SeqId next_id_ = 0;
  std::uint64_t generation_ = 0;
};

}  // namespace kvattn
