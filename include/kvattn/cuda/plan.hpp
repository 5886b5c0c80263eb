// kvattn/cuda/plan.hpp — one decode step on the GPU: the plan every layer's call reads, the device
// copies of a score policy's arrays, and the merge every CUDA kernel applies.
//
// An engine's decode step, for any number of layers, every call on `stream`:
//   kvattn::BatchPageTable table = cache.page_table(seqs);    // after the step's appends and forks
//   kvattn::cuda::DecodePlan plan;                             // kept across steps: reuses its memory
//   plan.make(cache, table, shape, params, stream);            // once per step: checks, plans, uploads
//   for (int layer = 0; layer < layers; ++layer)
//     kvattn::cuda::decode(plan.view(cache, layer), q, out, lse, plan, stream, policy);
// make() does all the step's host work and all its device allocation: it checks the arguments
// (kvattn::shape_error / invalid_argument naming the values, as kvattn::DecodePlan::make), splits
// the batch into work items (a sequence and a chunk of its keys) with the one split-KV planner
// of the CPU (kvattn::DecodePlan::split) under a rule of the GPU's, packs the items and the page
// table into pinned host memory, and copies them to the device with one cudaMemcpyAsync on the
// stream; it also sizes the partial results of the sequences that are split. The per-layer calls
// (cuda::decode, cuda::mla_decode) then only check their arguments on the host and launch
// kernels: no allocation, no copy, no synchronization, so a whole step can be captured into a
// CUDA graph and replayed (the graph holds the plan's device arrays and its grid: replay it for
// the step it was captured in, e.g. with new queries written into the same buffers).
//
// The plan reads only the cache's bookkeeping (its layout, its pages, its generation), never its
// pool. make() waits, if need be, only for its own previous upload (its pinned staging is then
// rewritten). Kernels of the previous step that still read the plan's device arrays must be ordered
// before make()'s stream (the same stream, or the engine's events). One plan per concurrent step.
//
// Score policies (kvattn/policy.hpp) reach the kernels by value; their arrays (ALiBi slopes, sink
// logits, tree-mask bits) must be device memory. PolicyArrays makes device copies of host arrays,
// checked on the host first with the CPU operators' check:
//   kvattn::cuda::PolicyArrays sinks_on_device;                             // per policy kept alive
//   const kvattn::Sinks sinks = sinks_on_device.upload(kvattn::Sinks{host_logits, q_heads},
//                                                      kvattn::PolicyCall{q_heads}, stream);
// (a tree mask, which changes every step, is checked against the step's plan: upload(tree, plan,
// stream)). The CUDA operators check a policy's sizes against the call, not its device values.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <variant>
#include <vector>

#include "../core.hpp"
#include "../error.hpp"
#include "../paged_cache.hpp"
#include "../policy.hpp"
#include "../shape.hpp"
#include "../state.hpp"
#include "runtime.hpp"

namespace kvattn::cuda {

namespace impl {

/// Grid limits: x up to 2^31 − 1 blocks, y and z up to 65,535.
inline constexpr std::int64_t kMaxGridX = std::numeric_limits<std::int32_t>::max();
inline constexpr std::int64_t kMaxGridYZ = 65535;

// ---- GQA-family decode geometry (decode.hpp) ----
inline constexpr int kDecodeThreads = 128;  ///< threads of a decode block
inline constexpr int kMaxRows = 8;          ///< query rows of one thread block
inline constexpr int kMaxHeadDim = 512;
/// Elements of a row each thread holds: 8 for the head sizes dispatched at compile time (64, 128,
/// 256: dim / 8 threads per row, one 16-byte load of 16-bit elements each); otherwise 32 threads
/// per row, dim / 32 rounded up to a power of two.
constexpr int gqa_elements_per_thread(int dim) {
  if (dim == 64 || dim == 128 || dim == 256) return 8;
  const int e = (dim + 31) / 32;
  return e <= 1 ? 1 : e <= 2 ? 2 : e <= 4 ? 4 : e <= 8 ? 8 : 16;
}
/// The most query rows of a block at `ept` elements per thread: the merge of its lane groups
/// takes 128 · ept · rows floats of shared memory, at most 32 KiB.
constexpr int gqa_max_row_block(int ept) { return std::min(kMaxRows, 32768 / (4 * kDecodeThreads * ept)); }
/// The query rows of a block for `rows` rows per (sequence, KV head): the smallest power of two
/// holding them, at most gqa_max_row_block.
constexpr int gqa_row_block(int ept, int rows) {
  const int max_rb = gqa_max_row_block(ept), want = std::min(rows, max_rb);
  return want <= 1 ? 1 : want <= 2 ? 2 : (want <= 4 || max_rb < 8) ? std::min(max_rb, 4) : max_rb;
}

}  // namespace impl

namespace mla_impl {

// ---- MLA decode geometry (mla_decode.hpp) ----
inline constexpr int kThreads = 256;  ///< threads of a main-kernel block
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kRows = 16;  ///< query rows of a block
inline constexpr int kTile = 32;  ///< tokens of a tile: a lane per token in the softmax
static_assert(kRows == 2 * kWarps, "the softmax gives each warp two rows");
static_assert(kRows == 16 && kTile == 32, "the score blocks: 4 groups of 4 rows × 8 groups of 4 tokens per warp");
inline constexpr int kMergeThreads = 128;
/// Shared memory a block may use without opting in.
inline constexpr std::size_t kDefaultShared = 48 * 1024;

/// Elements of one shared row holding `width` elements: whole float4s, an odd number of them
/// (rows an odd number of 16-byte units apart: the score reads hit distinct banks).
__host__ __device__ constexpr int shared_row(int width) {
  const int w4 = (width + 3) / 4;
  return 4 * (w4 % 2 == 1 ? w4 : w4 + 1);
}
/// Bytes of a block's shared memory for shared rows of Kp elements of `elem` bytes (layout at
/// the top of mla_decode.hpp).
__host__ __device__ constexpr std::size_t shared_bytes(int Kp, std::size_t elem) {
  return std::size_t{kRows} * Kp * sizeof(float) + std::size_t{kTile} * Kp * elem +
         std::size_t{kWarps} * kRows * kTile * sizeof(float) + std::size_t{kTile} * kRows * sizeof(float) +
         3 * std::size_t{kRows} * sizeof(float) + std::size_t{kTile} * sizeof(std::int64_t);
}

/// Bytes of one element of a tile in shared memory for a cache of format T: T's own element for
/// fp32, fp16 and bf16; fp32 for the MLA formats (fp8_e4m3_latent, int8_latent), whose codes are
/// dequantized as they are copied in.
template <class T> constexpr std::size_t staged_bytes() {
  return format_traits<T>::latent_block > 0 ? sizeof(float) : sizeof(T);
}

/// Launch geometry of one call.
struct Geometry {
  int chunk = 0, chunks = 1, Kp = 0;
  int nc = 1;  ///< columns per lane in O += P · C
  std::size_t shared = 0;
};

/// The widest chunk of the inner dimension whose block fits in `shared_optin` bytes: all of K
/// when it fits, else 1024, 512 or 256 columns (multiples of every column block). `op` names the
/// caller in the message of capacity_error.
inline Geometry choose_geometry(const char* op, int K, int latent, std::size_t elem, int shared_optin) {
  Geometry g;
  const auto fits = [&](int width) { return shared_bytes(shared_row(width), elem) <= static_cast<std::size_t>(shared_optin); };
  if (fits(K)) {
    g.chunk = K;
  } else {
    for (int w : {1024, 512, 256})
      if (w < K && fits(w)) {
        g.chunk = w;
        break;
      }
    if (g.chunk == 0)
      raise<capacity_error>(kvattn::detail::concat(op, ": latent_dim + rope_dim=", K, " needs ", shared_bytes(shared_row(256), elem),
                                                   " bytes of shared memory per block; the device allows ", shared_optin));
  }
  g.chunks = (K + g.chunk - 1) / g.chunk;
  g.Kp = shared_row(g.chunk);
  g.shared = shared_bytes(g.Kp, elem);
  // 512 columns per block (two per lane) for wide latents, when a chunk holds whole column blocks.
  g.nc = latent > 256 && (g.chunks == 1 || g.chunk % 512 == 0) ? 2 : 1;
  return g;
}
/// Column blocks of a latent of `latent` columns at `nc` columns per lane.
constexpr int column_blocks(int latent, int nc) { return (latent + kWarps * 32 * nc - 1) / (kWarps * 32 * nc); }

}  // namespace mla_impl

/// One step's decode work on the GPU: made once per step (make), read by every layer's call
/// (cuda::decode with a GqaShape, cuda::mla_decode with an MlaShape). See the top of this file.
class DecodePlan {
 public:
  /// A work item: row batch_index of the page table, key positions [begin, end), and in
  /// `partial` the item's first row in the plan's partial results, or -1 when the item is its
  /// sequence's only one (its rows' results go straight to out and lse).
  using Item = kvattn::DecodePlan::Item;
  static_assert(std::is_trivially_copyable_v<Item>, "items are copied to the device as bytes");

  /// What the kernels read: device pointers (null for an empty batch).
  struct DeviceArrays {
    const Item* items = nullptr;                  ///< [item_count()]
    const std::int64_t* first_item = nullptr;     ///< [batch + 1] sequence b's items: [first_item[b], first_item[b + 1])
    const std::int32_t* indptr = nullptr;         ///< the page table: [batch + 1]
    const std::int32_t* indices = nullptr;        ///< [indptr[batch]]
    const std::int32_t* last_page_len = nullptr;  ///< [batch]
    float* partial_o = nullptr;                   ///< [split_rows()][partial_width()] normalized outputs
    float* partial_md = nullptr;                  ///< [split_rows()][2] their {m, d}
  };

  DecodePlan() = default;
  DecodePlan(const DecodePlan&) = delete;
  DecodePlan& operator=(const DecodePlan&) = delete;

  /// The plan of cuda::decode for `table`, a batch of `cache` (PagedKvCache::page_table, taken
  /// after the step's last append, fork or copy-on-write), uploaded on `stream`. Throws
  /// kvattn::shape_error or invalid_argument on inconsistent arguments before any device work
  /// (the same checks as kvattn::DecodePlan::make, a head size above 512, a page table that does
  /// not fit the cache, more work than a grid holds, DecodeParams::int8_queries or
  /// u8_probabilities, which the GPU kernels do not have); cuda_error if the runtime fails. A plan
  /// whose make() threw must be made again before it is used. An empty batch needs no device.
  template <class T, class M>
  void make(const PagedKvCache<T, M>& cache, const BatchPageTable& table, const GqaShape& shape, const DecodeParams& p,
            cudaStream_t stream = nullptr) {
    constexpr const char* op = kMakeOp;
    batch_ = -1;
    const int rows = host_.prepare(op, shape, cache.layout(), p, 1);
    kvattn::DecodePlan::check_int8_math<T>(op, p);
    if (p.int8_queries || p.u8_probabilities)
      raise<invalid_argument>(kvattn::detail::concat(op, ": int8_queries=", p.int8_queries ? "true" : "false", " u8_probabilities=",
                                                     p.u8_probabilities ? "true" : "false",
                                                     ": cuda::decode scores in fp32 (the 8-bit arithmetic is the CPU kernels')"));
    if (shape.head_dim > impl::kMaxHeadDim)
      raise<shape_error>(kvattn::detail::concat(op, ": head_dim=", shape.head_dim, ": at most ", impl::kMaxHeadDim, " on the GPU"));
    const int rb = impl::gqa_row_block(impl::gqa_elements_per_thread(shape.head_dim), rows);
    const std::int64_t row_blocks = (rows + rb - 1) / rb;
    if (row_blocks > impl::kMaxGridYZ)
      raise<invalid_argument>(kvattn::detail::concat(op, ": queries_per_seq=", p.queries_per_seq, " × group size=", shape.group_size(),
                                                     " = ", rows, " query rows per KV head: at most ", impl::kMaxGridYZ * rb,
                                                     " on the GPU"));
    check_table(op, cache, table);
    const std::int64_t rows_per_item = std::int64_t{shape.kv_heads} * rows;
    check_merge_grid(op, table.batch(), rows_per_item);
    query_device(table);
    // About four thread blocks per multiprocessor; chunks of whole 64-token spans, at least 256.
    const std::int64_t blocks_per_item = std::int64_t{shape.kv_heads} * row_blocks;
    const std::int64_t want = std::max<std::int64_t>(1, (4 * std::int64_t{multiprocessors_} + blocks_per_item - 1) / blocks_per_item);
    finish(op, cache, table, SplitRule{want, 64, 256}, rows_per_item, shape.head_dim, stream);
  }

  /// The plan of cuda::mla_decode for `table`, a batch of the MLA cache `cache`; as above (and
  /// kvattn::capacity_error when a row of the cache is too wide for the device's shared memory).
  template <class T, class M>
  void make(const PagedKvCache<T, M>& cache, const BatchPageTable& table, const MlaShape& shape, const DecodeParams& p,
            cudaStream_t stream = nullptr) {
    constexpr const char* op = kMakeOp;
    batch_ = -1;
    const int rows = host_.prepare(op, shape, cache.layout(), p, 1);
    const std::int64_t row_blocks = (rows + mla_impl::kRows - 1) / mla_impl::kRows;
    if (row_blocks > impl::kMaxGridYZ)
      raise<invalid_argument>(kvattn::detail::concat(op, ": queries_per_seq=", p.queries_per_seq, " heads=", shape.heads, ": more than ",
                                                     impl::kMaxGridYZ * mla_impl::kRows, " query rows per sequence on the GPU"));
    check_table(op, cache, table);
    check_merge_grid(op, table.batch(), rows);
    query_device(table);
    // About two thread blocks per multiprocessor (MLA decode is compute-bound); chunks of whole
    // tiles, at least 8 of them.
    std::int64_t want = 1;
    if (table.batch() > 0) {
      const mla_impl::Geometry g =
          mla_impl::choose_geometry(op, shape.latent_dim + shape.rope_dim, shape.latent_dim, mla_impl::staged_bytes<T>(), shared_optin_);
      const std::int64_t blocks_per_item = row_blocks * mla_impl::column_blocks(shape.latent_dim, g.nc);
      want = std::max<std::int64_t>(1, (2 * std::int64_t{multiprocessors_} + blocks_per_item - 1) / blocks_per_item);
    }
    finish(op, cache, table, SplitRule{want, mla_impl::kTile, 8 * mla_impl::kTile}, rows, shape.latent_dim, stream);
  }

  /// One layer of `cache` (the cache the plan was made for, unchanged since) with the plan's page
  /// table: every pointer a device pointer. Throws invalid_argument naming the values otherwise.
  template <class T> PagedKvView<T> view(const PagedKvCache<T, DeviceMemory>& cache, int layer) const {
    constexpr const char* op = "cuda::DecodePlan::view";
    require_made(op);
    if (static_cast<const void*>(&cache) != cache_)
      raise<invalid_argument>(kvattn::detail::concat(op, ": the cache at ", static_cast<const void*>(&cache),
                                                     " is not the one the plan was made for (at ", cache_, ")"));
    if (cache.generation() != generation_)
      raise<invalid_argument>(kvattn::detail::concat(op, ": the cache changed since the plan was made (generation ", cache.generation(),
                                                     ", the plan's ", generation_,
                                                     "): make the plan again after the step's appends, forks and copy-on-write writes"));
    if (layer < 0 || layer >= cache.config().layers)
      raise<invalid_argument>(kvattn::detail::concat(op, ": layer=", layer, " is outside [0, ", cache.config().layers, ")"));
    return PagedKvView<T>{cache.layer_data(layer), cache.layout(), device_.indptr, device_.indices, device_.last_page_len, batch_,
                          cache.scales(layer)};
  }

  /// Checks that `kv` is a view of this plan (view()): its page table is the plan's device copy,
  /// of the plan's batch, and its cache holds the plan's head layout. Throws invalid_argument (or
  /// shape_error) naming the operator `op` and the values.
  template <class T> void check(const char* op, const PagedKvView<T>& kv) const {
    require_made(op);
    check_pointers(op, kv);
    host_.check(op, host_view(kv));
  }

  /// The checks of a call (kvattn::DecodePlan::check_call, with the policy's arrays in device
  /// memory): `kv` is a view of this plan, the plan is of shape S, the policy fits, q and out are
  /// not null. Returns the plan's shape.
  template <class S, class T, class P>
  const S& check_call(const char* op, const PagedKvView<T>& kv, const P& policy, const float* q, const float* out) const {
    static_assert(std::is_trivially_copyable_v<P>, "kvattn::cuda: a policy reaches the kernels by value");
    require_made(op);
    check_pointers(op, kv);
    return host_.check_call<S>(op, host_view(kv), policy, q, out, policy_call());
  }

  /// What a call's policy is checked against: the plan's query heads and rows, the policy's
  /// arrays being device memory (sizes only).
  PolicyCall policy_call() const noexcept {
    PolicyCall c = host_.policy_call();
    c.host_arrays = false;
    return c;
  }

  /// The host plan (the CPU's DecodePlan, split under the GPU's rule): shape, parameters, items.
  const kvattn::DecodePlan& host() const noexcept { return host_; }
  const AttentionShape& shape() const noexcept { return host_.shape(); }
  const DecodeParams& params() const noexcept { return host_.params(); }
  float scale() const noexcept { return host_.scale(); }  ///< the softmax scale, the default resolved
  int batch() const noexcept { return batch_; }
  std::int64_t item_count() const noexcept { return static_cast<std::int64_t>(host_.items().size()); }
  /// Rows of partial results: the rows of every item of the sequences split into several items.
  std::int64_t split_rows() const noexcept { return split_rows_; }
  int partial_width() const noexcept { return partial_width_; }
  const DeviceArrays& device_arrays() const noexcept { return device_; }
  int device() const noexcept { return device_id_; }
  int multiprocessors() const noexcept { return multiprocessors_; }
  int shared_optin() const noexcept { return shared_optin_; }  ///< bytes of shared memory one block may use
  /// Device memory the plan holds.
  std::size_t device_bytes() const noexcept { return upload_.device_bytes() + partial_.capacity() * sizeof(float); }

 private:
  static constexpr const char* kMakeOp = "cuda::DecodePlan::make";

  /// `kv` reads this plan's device page table, for the plan's batch.
  template <class T> void check_pointers(const char* op, const PagedKvView<T>& kv) const {
    if (kv.batch != batch_ || kv.indptr != device_.indptr || kv.indices != device_.indices || kv.last_page_len != device_.last_page_len)
      raise<invalid_argument>(kvattn::detail::concat(
          op, ": the view (batch=", kv.batch, ", indptr=", static_cast<const void*>(kv.indptr), ", indices=",
          static_cast<const void*>(kv.indices), ") does not read this plan's page table (batch=", batch_, ", indptr=",
          static_cast<const void*>(device_.indptr), ", indices=", static_cast<const void*>(device_.indices),
          "): take the view with DecodePlan::view after DecodePlan::make"));
  }
  /// The same view with the host copy of the plan's table: what the CPU plan's checks read.
  template <class T> PagedKvView<T> host_view(const PagedKvView<T>& kv) const {
    PagedKvView<T> host = kv;
    host.indptr = host_indptr_;
    host.indices = host_indices_;
    host.last_page_len = host_last_;
    return host;
  }

  void require_made(const char* op) const {
    if (batch_ < 0) raise<invalid_argument>(kvattn::detail::concat(op, ": the plan was never made (cuda::DecodePlan::make)"));
  }

  /// The table must be a CSR page table of the cache: the kernels index its pool with its ids.
  template <class T, class M> static void check_table(const char* op, const PagedKvCache<T, M>& cache, const BatchPageTable& t) {
    using kvattn::detail::concat;
    const int B = t.batch();
    if (B == 0) return;
    if (t.indptr[0] != 0 || t.last_page_len.size() != static_cast<std::size_t>(B) ||
        t.indptr[static_cast<std::size_t>(B)] != static_cast<std::int64_t>(t.indices.size()))
      raise<invalid_argument>(concat(op, ": the page table is not one: indptr holds ", t.indptr.size(), " entries from ", t.indptr[0],
                                     " to ", t.indptr[static_cast<std::size_t>(B)], ", indices ", t.indices.size(), ", last_page_len ",
                                     t.last_page_len.size(), " (take it with PagedKvCache::page_table)"));
    const int P = cache.layout().page_size;
    for (int b = 0; b < B; ++b) {
      const std::int64_t pages = std::int64_t{t.indptr[static_cast<std::size_t>(b) + 1]} - t.indptr[static_cast<std::size_t>(b)];
      const std::int32_t last = t.last_page_len[static_cast<std::size_t>(b)];
      if (pages < 0 || (pages == 0 ? last != 0 : (last < 1 || last > P)))
        raise<invalid_argument>(concat(op, ": sequence ", b, " of the page table has ", pages, " pages and last_page_len=", last,
                                       ": the last page holds 1 to page_size=", P, " tokens (0 without pages)"));
    }
    const std::int64_t num_pages = cache.config().num_pages;
    for (std::size_t k = 0; k < t.indices.size(); ++k)
      if (t.indices[k] < 0 || t.indices[k] >= num_pages)
        raise<invalid_argument>(concat(op, ": page id ", t.indices[k], " (entry ", k, " of the page table) is outside the cache's ",
                                       num_pages, " pages"));
  }

  /// The merge kernel runs a block per (sequence, row of an item).
  static void check_merge_grid(const char* op, int batch, std::int64_t rows_per_item) {
    if (std::int64_t{batch} * rows_per_item > impl::kMaxGridX)
      raise<invalid_argument>(kvattn::detail::concat(op, ": ", batch, " sequences × ", rows_per_item, " query rows exceed a grid (at most ",
                                                     impl::kMaxGridX, ")"));
  }

  /// The properties of the current device, for a batch (an empty one needs no device).
  void query_device(const BatchPageTable& table) {
    if (table.batch() == 0) return;
    int device = 0;
    cuda::check(cudaGetDevice(&device), "cudaGetDevice");
    if (device != device_id_) {
      cuda::check(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute (multiprocessors)");
      cuda::check(cudaDeviceGetAttribute(&shared_optin_, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
            "cudaDeviceGetAttribute (shared memory per block)");
      device_id_ = device;
    }
  }

  static std::size_t aligned(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

  /// The host plan's split under `rule` (its shape and parameters were set by prepare()), the
  /// items' partial rows, the upload. Until it returns, the plan is unmade.
  template <class T, class M>
  void finish(const char* op, const PagedKvCache<T, M>& cache, const BatchPageTable& table, const SplitRule& rule,
              std::int64_t rows_per_item, int width, cudaStream_t stream) {
    const int B = table.batch();
    host_.split(PagedKvView<T>{nullptr, cache.layout(), table.indptr.data(), table.indices.data(), table.last_page_len.data(), B,
                               KvScales{}},
                host_.params().chunk_tokens, rule, 0);
    std::vector<Item>& items = host_.items();
    if (static_cast<std::int64_t>(items.size()) > impl::kMaxGridX)
      raise<invalid_argument>(kvattn::detail::concat(op, ": ", items.size(), " work items exceed a grid (at most ", impl::kMaxGridX,
                                                     "): raise chunk_tokens"));
    std::int64_t split_rows = 0;
    for (int b = 0; b < B; ++b) {
      const std::int64_t first = host_.first_item(b), last = host_.first_item(b + 1);
      for (std::int64_t i = first; i < last; ++i) {
        items[static_cast<std::size_t>(i)].partial = last - first == 1 ? -1 : split_rows;
        if (last - first > 1) split_rows += rows_per_item;
      }
    }
    // Pinned staging, one copy: items, first_item, indptr, indices, last_page_len, 16-byte aligned.
    const std::size_t n_items = items.size(), nb = static_cast<std::size_t>(B), nnz = table.indices.size();
    const std::size_t at_first = aligned(n_items * sizeof(Item));
    const std::size_t at_indptr = at_first + aligned((nb + 1) * sizeof(std::int64_t));
    const std::size_t at_indices = at_indptr + aligned((nb + 1) * sizeof(std::int32_t));
    const std::size_t at_last = at_indices + aligned(nnz * sizeof(std::int32_t));
    const std::size_t bytes = B == 0 ? 0 : at_last + aligned(nb * sizeof(std::int32_t));
    float* partial = split_rows > 0 ? partial_.reserve(static_cast<std::size_t>(split_rows) * (static_cast<std::size_t>(width) + 2)) : nullptr;
    DeviceArrays d;
    host_indptr_ = host_indices_ = host_last_ = nullptr;
    if (bytes > 0) {
      unsigned char* h = upload_.stage(bytes);
      std::memcpy(h, items.data(), n_items * sizeof(Item));
      std::memcpy(h + at_first, host_.first_items().data(), (nb + 1) * sizeof(std::int64_t));
      std::memcpy(h + at_indptr, table.indptr.data(), (nb + 1) * sizeof(std::int32_t));
      if (nnz > 0) std::memcpy(h + at_indices, table.indices.data(), nnz * sizeof(std::int32_t));
      std::memcpy(h + at_last, table.last_page_len.data(), nb * sizeof(std::int32_t));
      const unsigned char* dev = upload_.send(bytes, stream);
      d.items = reinterpret_cast<const Item*>(dev);
      d.first_item = reinterpret_cast<const std::int64_t*>(dev + at_first);
      d.indptr = reinterpret_cast<const std::int32_t*>(dev + at_indptr);
      d.indices = reinterpret_cast<const std::int32_t*>(dev + at_indices);
      d.last_page_len = reinterpret_cast<const std::int32_t*>(dev + at_last);
      // The host copy of the table the checks read: the staging, kept until the next make().
      host_indptr_ = reinterpret_cast<const std::int32_t*>(h + at_indptr);
      host_indices_ = reinterpret_cast<const std::int32_t*>(h + at_indices);
      host_last_ = reinterpret_cast<const std::int32_t*>(h + at_last);
    }
    d.partial_o = partial;
    d.partial_md = partial != nullptr ? partial + split_rows * width : nullptr;
    device_ = d;
    split_rows_ = split_rows;
    partial_width_ = width;
    batch_ = B;
    cache_ = static_cast<const void*>(&cache);
    generation_ = cache.generation();
  }

  kvattn::DecodePlan host_;
  StagedUpload upload_;
  DeviceBuffer<float> partial_;
  DeviceArrays device_;
  const std::int32_t* host_indptr_ = nullptr;
  const std::int32_t* host_indices_ = nullptr;
  const std::int32_t* host_last_ = nullptr;
  std::int64_t split_rows_ = 0;
  int partial_width_ = 0;
  int batch_ = -1;  // -1: never made
  const void* cache_ = nullptr;
  std::uint64_t generation_ = 0;
  int device_id_ = -1;  // the device the next two describe
  int multiprocessors_ = 1;
  int shared_optin_ = 0;
};

// ---- the arrays of a policy on the device ------------------------------------------------------

/// Says which arrays a score policy points to: each(policy, f) calls f(pointer, count) with a
/// reference to each of its array pointers and the number of elements there. PolicyArrays uses
/// it to copy the arrays to the device. kvattn's policies are described here; a policy of an
/// engine's own specializes it (an empty each() when it holds no array).
template <class P> struct policy_arrays {
  static_assert(sizeof(P) == 0, "kvattn::cuda::policy_arrays: say which arrays this policy holds (specialize it)");
  template <class F> static void each(P&, F&&) {}
};
template <> struct policy_arrays<Plain> {
  template <class F> static void each(Plain&, F&&) {}
};
template <> struct policy_arrays<SlidingWindow> {
  template <class F> static void each(SlidingWindow&, F&&) {}
};
template <> struct policy_arrays<SoftCap> {
  template <class F> static void each(SoftCap&, F&&) {}
};
template <> struct policy_arrays<Alibi> {
  template <class F> static void each(Alibi& p, F&& f) { f(p.slopes, std::int64_t{p.heads}); }
};
template <> struct policy_arrays<Sinks> {
  template <class F> static void each(Sinks& p, F&& f) { f(p.logits, std::int64_t{p.heads}); }
};
template <> struct policy_arrays<TreeMask> {
  template <class F> static void each(TreeMask& p, F&& f) { f(p.bits, p.rows); }
};
template <class... Ps> struct policy_arrays<Compose<Ps...>> {
  template <class F> static void each(Compose<Ps...>& p, F&& f) { (policy_arrays<Ps>::each(static_cast<Ps&>(p), f), ...); }
};

/// Device copies of score policies' arrays. upload(policy, call, stream) checks the policy with
/// its host values against the call (kvattn::check_policy, as the CPU operators do: sizes, and
/// finite slopes and sinks, tree bits within each row's own tokens), copies its arrays to device
/// memory this object holds (pinned staging, one asynchronous copy on `stream`), and returns the
/// policy with device pointers, for the CUDA operators. The returned policy is valid until the
/// next upload through the same PolicyArrays (which may reuse or move that memory) or its
/// destruction; keep one per policy that must stay alive (say, per layer's sinks) and one per step
/// for a tree mask. The host arrays may change as soon as upload returns.
class PolicyArrays {
 public:
  template <class P> P upload(const P& policy, PolicyCall call, cudaStream_t stream = nullptr) {
    static_assert(is_policy_v<P>, "kvattn::cuda::PolicyArrays: not a score policy (see kvattn/policy.hpp)");
    static_assert(std::is_trivially_copyable_v<P>, "kvattn::cuda::PolicyArrays: a policy reaches the kernels by value");
    call.host_arrays = true;
    check_policy("cuda::PolicyArrays::upload", policy, call);
    P device = policy;
    std::size_t bytes = 0;
    policy_arrays<P>::each(device, [&](auto*& p, std::int64_t n) {
      if (p != nullptr && n > 0) bytes = aligned(bytes) + static_cast<std::size_t>(n) * sizeof(*p);
    });
    if (bytes == 0) return device;
    unsigned char* host = upload_.stage(aligned(bytes));
    std::size_t at = 0;
    policy_arrays<P>::each(device, [&](auto*& p, std::int64_t n) {
      if (p == nullptr || n <= 0) return;
      at = aligned(at);
      std::memcpy(host + at, p, static_cast<std::size_t>(n) * sizeof(*p));
      at += static_cast<std::size_t>(n) * sizeof(*p);
    });
    const unsigned char* dev = upload_.send(aligned(bytes), stream);
    at = 0;
    policy_arrays<P>::each(device, [&](auto*& p, std::int64_t n) {
      if (p == nullptr || n <= 0) return;
      at = aligned(at);
      p = reinterpret_cast<std::remove_reference_t<decltype(p)>>(dev + at);
      at += static_cast<std::size_t>(n) * sizeof(*p);
    });
    return device;
  }
  /// upload() checked against the call of a step's plan (its query heads and rows).
  template <class P> P upload(const P& policy, const DecodePlan& plan, cudaStream_t stream = nullptr) {
    return upload(policy, plan.host().policy_call(), stream);
  }
  std::size_t device_bytes() const noexcept { return upload_.device_bytes(); }

 private:
  static std::size_t aligned(std::size_t bytes) { return (bytes + 15) / 16 * 16; }
  StagedUpload upload_;
};

// ---- the merge of the CUDA kernels ---------------------------------------------------------------

namespace impl {

/// Folds one element of a partial result (normalized o2, state s2) into the running (o, s): the
/// one merge (kvattn::merge_weights), as kvattn::merge_state does it.
__device__ __forceinline__ void merge_into(float& o, SoftmaxStats& s, float o2, SoftmaxStats s2) {
  const MergeWeights w = merge_weights(s, s2);
  s = w.stats;
  o = merge_value(o, o2, w);
}
}  // namespace impl

}  // namespace kvattn::cuda
