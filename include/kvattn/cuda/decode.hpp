// kvattn/cuda/decode.hpp — MHA / GQA / MQA decode attention over a device cache.
//
// The operator of kvattn/decode.hpp on an NVIDIA GPU, with the same arguments, shapes, variants
// and results (device pointers):
//   q    [batch][Q][q_heads][head_dim]  fp32
//   out  [batch][Q][q_heads][head_dim]  fp32
//   lse  [batch][Q][q_heads]            fp32, natural log, -inf for a row that sees no key; optional
// Query i of sequence b sits at position L_b − Q + i and attends to the positions at or before it
// (within the last `window` for Variant<true, ...>; scores capped for Variant<..., true>).
//
// Work: the batch is split into items (sequence, chunk of keys) on the host, as the CPU operator
// splits it (kvattn::DecodeWorkspace::plan_items), with enough items to give every multiprocessor a few
// thread blocks. One thread block per (item, KV head, block of up to 8 query rows); the rows of a
// block are the query heads of the group (times Q), so each key and value byte of a chunk is read
// from memory once for groups up to 8 (larger groups take several row blocks, which read the same
// keys again, mostly from L2).
// In a block of 128 threads, a row of head_dim elements is covered by TPR threads holding EPT
// consecutive elements each (head sizes 64, 128, 256: 8, 16, 32 threads of 8 elements, one 16-byte
// load of fp16/bf16 each; any other size up to 512: 32 threads with EPT rounded up and masked).
// The block's 128 / TPR lane groups take the chunk's tokens in turn, two at a time with both
// tokens' rows loaded before either is used and the page entries of the next two read a step
// ahead; each group keeps an online softmax
// state per row ({m, d} and its EPT output elements), scores reduced across its TPR lanes with
// shuffles. The groups' states are merged through shared memory at the end of the chunk and
// written as the item's partial result {o normalized, m, d}; a second kernel merges the chunks of
// each row (state.hpp: empty parts are harmless) into out and lse. A sequence that is one item has
// its out and lse written by the first kernel (the second, launched only when some sequence is
// split, skips it at once), so a batch with no split sequence takes one launch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../decode.hpp"
#include "../state.hpp"
#include "runtime.hpp"

namespace kvattn::cuda {

/// Scratch memory of decode(): the host plan, its items on the device, the partial results.
/// Keep one per concurrent caller (stream) and reuse it across steps; it only grows.
struct DecodeWorkspace {
  kvattn::DecodeWorkspace plan;  ///< items and first_item (host)
  DeviceBuffer<kvattn::DecodeWorkspace::Item> items;
  DeviceBuffer<std::int64_t> first_item;
  DeviceBuffer<float> partial;
};

namespace impl {

inline constexpr int kDecodeThreads = 128;
inline constexpr int kMaxRows = 8;  ///< query rows of one thread block

/// What every thread block of a decode launch reads.
template <class D> struct DecodeArgs {
  const D* pool;  ///< the layer: [num_pages][page_stride]
  PageLayout layout;
  const std::int32_t* indptr;
  const std::int32_t* indices;
  const std::int32_t* last_page_len;
  const kvattn::DecodeWorkspace::Item* items;
  const float* q;
  const std::int64_t* first_item;  ///< sequence b's items: [first_item[b], first_item[b + 1])
  float* partial;
  float* out;  ///< where a sequence of one item writes its rows' results directly (and lse, when not null)
  float* lse;
  int group, Q, rows, q_heads;
  float scale;
  std::int64_t window;
  float soft_cap;
};

__device__ __forceinline__ std::int64_t seq_length(const std::int32_t* indptr, const std::int32_t* last, int P, int b) {
  const std::int32_t pages = indptr[b + 1] - indptr[b];
  return pages == 0 ? 0 : std::int64_t{pages - 1} * P + last[b];
}

/// EPT consecutive elements of a row into floats: 16-byte loads when VEC, else one by one, masked
/// past `dim`.
template <class D, int EPT, bool VEC>
__device__ __forceinline__ void load_row(const D* p, int c0, int dim, float (&x)[EPT]) {
  if constexpr (VEC) {
    constexpr int kPer16 = 16 / sizeof(D);
    static_assert(EPT % kPer16 == 0, "whole 16-byte loads");
#pragma unroll
    for (int j = 0; j < EPT / kPer16; ++j) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p + c0 + j * kPer16);
      const D* e = reinterpret_cast<const D*>(&raw);
#pragma unroll
      for (int k = 0; k < kPer16; ++k) x[j * kPer16 + k] = to_float(e[k]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < EPT; ++e) x[e] = c0 + e < dim ? to_float(p[c0 + e]) : 0.0f;
  }
}

/// One (item, KV head, row block): see the top of the file. Writes the partial state of each
/// of its rows: partial + item.partial + (h · rows + row) · (dim + 2), {o [dim], m, d}; or, when
/// the item is its sequence's only one, the rows' outputs and log-sum-exps themselves.
template <class D, int TPR, int EPT, int RB, bool VEC, class V>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(DecodeArgs<D> a) {
  constexpr int NG = kDecodeThreads / TPR;  // lane groups
  constexpr float kNegInf = -INFINITY;
  const kvattn::DecodeWorkspace::Item item = a.items[blockIdx.x];
  const int h = blockIdx.y, r0 = blockIdx.z * RB;
  const int nr = min(RB, a.rows - r0);
  const int lane = threadIdx.x % TPR, g = threadIdx.x / TPR;
  const int dim = a.layout.head_dim, P = a.layout.page_size;
  const int c0 = lane * EPT;
  const int b = item.seq;
  const std::int64_t L = seq_length(a.indptr, a.last_page_len, P, b);

  float q[RB][EPT], acc[RB][EPT], m[RB], d[RB];
  std::int64_t qpos[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int row = r0 + (r < nr ? r : 0);
    const int i = row / a.group, head = h * a.group + row % a.group;
    const float* qr = a.q + ((std::int64_t{b} * a.Q + i) * a.q_heads + head) * dim;
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      q[r][e] = c0 + e < dim ? qr[c0 + e] : 0.0f;
      acc[r][e] = 0.0f;
    }
    m[r] = kNegInf;
    d[r] = 0.0f;
    qpos[r] = r < nr ? L - a.Q + i : -1;  // a padding row sees nothing
  }

  const std::int32_t* pages = a.indices + a.indptr[b];
  const std::int64_t value_minus_key = a.layout.value(h, 0) - a.layout.key(h, 0);
  // The page of each token an iteration reads is fetched one iteration ahead, so that the rows'
  // loads never wait for the page table.
  std::int32_t page[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const std::int64_t t = item.begin + u * NG + g;
    page[u] = t < item.end ? pages[t / P] : 0;
  }

  // Every lane of a warp runs the same number of iterations (the shuffles need all of them).
  for (std::int64_t t0 = item.begin; t0 < item.end; t0 += 2 * NG) {
    float k[2][EPT], v[2][EPT];
    bool valid[2];
    std::int32_t next[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const std::int64_t t = t0 + 2 * NG + u * NG + g;
      next[u] = t < item.end ? pages[t / P] : 0;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // both tokens' rows in flight before either is used
      const std::int64_t t = t0 + u * NG + g;
      valid[u] = t < item.end;
      if (valid[u]) {
        const D* kr = a.pool + std::int64_t{page[u]} * a.layout.page_stride + a.layout.key(h, static_cast<int>(t % P));
        load_row<D, EPT, VEC>(kr, c0, dim, k[u]);
        load_row<D, EPT, VEC>(kr + value_minus_key, c0, dim, v[u]);
      } else {
#pragma unroll
        for (int e = 0; e < EPT; ++e) k[u][e] = v[u][e] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const std::int64_t t = t0 + u * NG + g;
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < EPT; ++e) s = fmaf(q[r][e], k[u][e], s);
#pragma unroll
        for (int off = TPR / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off, TPR);
        bool visible = valid[u] && t <= qpos[r];
        if constexpr (V::sliding_window) visible = visible && t > qpos[r] - a.window;
        if (!visible) continue;  // uniform across the lane group: the shuffles are done
        s *= a.scale;
        if constexpr (V::soft_cap) s = a.soft_cap * tanhf(s / a.soft_cap);
        const float m_new = fmaxf(m[r], s);
        const float alpha = expf(m[r] - m_new);  // exp(-inf) = 0 on the first key
        const float p = expf(s - m_new);
        d[r] = d[r] * alpha + p;
#pragma unroll
        for (int e = 0; e < EPT; ++e) acc[r][e] = fmaf(p, v[u][e], acc[r][e] * alpha);
        m[r] = m_new;
      }
    }
    page[0] = next[0];
    page[1] = next[1];
  }

  // Merge the lane groups: [NG][RB] states, then each row's output elements by all threads.
  extern __shared__ float smem[];
  const int width = TPR * EPT;  // >= dim
  float* s_o = smem;                             // [NG][RB][width]
  float* s_m = s_o + NG * RB * width;            // [NG][RB]
  float* s_d = s_m + NG * RB;                    // [NG][RB]
#pragma unroll
  for (int r = 0; r < RB; ++r) {
#pragma unroll
    for (int e = 0; e < EPT; ++e) s_o[(g * RB + r) * width + c0 + e] = acc[r][e];
    if (lane == 0) {
      s_m[g * RB + r] = m[r];
      s_d[g * RB + r] = d[r];
    }
  }
  __syncthreads();
  const int stride = dim + 2;
  const bool only_item = a.first_item[b + 1] - a.first_item[b] == 1;
  for (int x = threadIdx.x; x < nr * dim; x += kDecodeThreads) {
    const int r = x / dim, c = x % dim;
    float M = kNegInf;
    for (int j = 0; j < NG; ++j) M = fmaxf(M, s_m[j * RB + r]);
    float sum = 0.0f, o = 0.0f;
    if (M != kNegInf)
      for (int j = 0; j < NG; ++j) {
        const float w = expf(s_m[j * RB + r] - M);  // 0 for a group that saw nothing
        sum += s_d[j * RB + r] * w;
        o += s_o[(j * RB + r) * width + c] * w;
      }
    if (only_item) {  // the sequence's only item: its state is the result
      const int row = r0 + r, i = row / a.group, head = h * a.group + row % a.group;
      const std::int64_t at = (std::int64_t{b} * a.Q + i) * a.q_heads + head;
      a.out[at * dim + c] = sum > 0.0f ? o / sum : 0.0f;
      if (c == 0 && a.lse != nullptr) a.lse[at] = sum > 0.0f ? M + logf(sum) : kNegInf;
      continue;
    }
    float* row = a.partial + item.partial + (std::int64_t{h} * a.rows + r0 + r) * stride;
    row[c] = sum > 0.0f ? o / sum : 0.0f;
    if (c == 0) {
      row[dim] = sum > 0.0f ? M : kNegInf;
      row[dim + 1] = sum;
    }
  }
}

/// One thread block per (sequence, KV head, row): merges the items' partial states of that row
/// (state.hpp) into out and lse; a sequence of one item was written by decode_kernel.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_merge_kernel(const float* __restrict__ partial, const kvattn::DecodeWorkspace::Item* __restrict__ items,
                        const std::int64_t* __restrict__ first_item, int rows, int group, int Q, int q_heads,
                        int dim, float* __restrict__ out, float* __restrict__ lse) {
  const int b = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
  const int i = r / group, head = h * group + r % group;
  const std::int64_t first = first_item[b], last = first_item[b + 1];
  if (last - first == 1) return;
  const std::int64_t off = (std::int64_t{h} * rows + r) * (dim + 2);
  float M = -INFINITY;
  for (std::int64_t c = first; c < last; ++c) M = fmaxf(M, partial[items[c].partial + off + dim]);
  float sum = 0.0f;
  if (M != -INFINITY)
    for (std::int64_t c = first; c < last; ++c) {
      const float* p = partial + items[c].partial + off;
      if (p[dim + 1] > 0.0f) sum += p[dim + 1] * expf(p[dim] - M);
    }
  float* o = out + ((std::int64_t{b} * Q + i) * q_heads + head) * dim;
  for (int col = threadIdx.x; col < dim; col += blockDim.x) {
    float x = 0.0f;
    if (sum > 0.0f) {
      for (std::int64_t c = first; c < last; ++c) {
        const float* p = partial + items[c].partial + off;
        if (p[dim + 1] > 0.0f) x += p[col] * (p[dim + 1] * expf(p[dim] - M));
      }
      x /= sum;
    }
    o[col] = x;
  }
  if (lse != nullptr && threadIdx.x == 0)
    lse[(std::int64_t{b} * Q + i) * q_heads + head] = sum > 0.0f ? M + logf(sum) : -INFINITY;
}

template <class D, int TPR, int EPT, int RB, bool VEC, class V>
void launch_decode(const DecodeArgs<D>& a, unsigned items, int kv_heads, cudaStream_t stream) {
  constexpr int NG = kDecodeThreads / TPR;
  const std::size_t smem = sizeof(float) * (std::size_t{NG} * RB * TPR * EPT + 2 * std::size_t{NG} * RB);
  const dim3 grid(items, static_cast<unsigned>(kv_heads), static_cast<unsigned>((a.rows + RB - 1) / RB));
  decode_kernel<D, TPR, EPT, RB, VEC, V><<<grid, kDecodeThreads, smem, stream>>>(a);
}

/// The row block for `rows` query rows: the smallest power of two holding them, at most kMaxRows.
template <class D, int TPR, int EPT, bool VEC, class V>
void launch_rows(const DecodeArgs<D>& a, unsigned items, int kv_heads, cudaStream_t stream) {
  // Shared memory of the merge, NG · RB · TPR · EPT floats = 128 · EPT · RB floats: at most 32 KiB.
  constexpr int kMaxRb = std::min(kMaxRows, 32768 / (4 * kDecodeThreads * EPT));
  const int want = std::min(a.rows, kMaxRb);
  if (want <= 1)
    launch_decode<D, TPR, EPT, 1, VEC, V>(a, items, kv_heads, stream);
  else if (want <= 2)
    launch_decode<D, TPR, EPT, 2, VEC, V>(a, items, kv_heads, stream);
  else if (want <= 4 || kMaxRb < 8)
    launch_decode<D, TPR, EPT, (kMaxRb < 4 ? kMaxRb : 4), VEC, V>(a, items, kv_heads, stream);
  else
    launch_decode<D, TPR, EPT, kMaxRb, VEC, V>(a, items, kv_heads, stream);
}

}  // namespace impl

/// Decode attention for a batch on the GPU: the operator of kvattn/decode.hpp (see the top of this
/// file). `kv` is a device view (DevicePageTable::view) of `table`; q, out, lse are device arrays.
/// Runs on `stream` and returns without waiting. Throws kvattn::invalid_argument or shape_error
/// on inconsistent arguments, before any work (the same checks as the CPU operator, and a head
/// size above 512); cuda_error if a launch fails.
template <class V = Plain, class T>
void decode(const PagedKvView<T>& kv, const DevicePageTable& table, const GqaShape& shape, const float* q, float* out,
            float* lse, const DecodeParams& p, DecodeWorkspace& ws, cudaStream_t stream = nullptr) {
  kvattn::detail::check_attention_args<V>("cuda::decode", shape, kv.layout, p.scale, p.window, p.soft_cap);
  if (p.queries_per_seq < 1)
    raise<invalid_argument>(kvattn::detail::concat("cuda::decode: queries_per_seq=", p.queries_per_seq, ": must be positive"));
  if (p.chunk_tokens < 0)
    raise<invalid_argument>(kvattn::detail::concat("cuda::decode: chunk_tokens=", p.chunk_tokens, ": must be >= 0"));
  if (!table.describes(kv))
    raise<invalid_argument>("cuda::decode: kv is not a view of `table` (use table.view(...))");
  if (kv.batch > 0 && (q == nullptr || out == nullptr)) raise<invalid_argument>("cuda::decode: q and out must not be null");
  constexpr int kMaxDim = 512;
  if (shape.head_dim > kMaxDim)
    raise<shape_error>(kvattn::detail::concat("cuda::decode: head_dim=", shape.head_dim, ": at most ", kMaxDim, " on the GPU"));
  if (reinterpret_cast<std::uintptr_t>(kv.pool) % 16 != 0)
    raise<invalid_argument>("cuda::decode: the pool must start on 16 bytes (rows are read with 16-byte loads)");
  if (kv.batch == 0) return;

  using D = typename impl::device_type<T>::type;
  const int Q = p.queries_per_seq, group = shape.group_size(), dim = shape.head_dim;
  const int rows = group * Q;
  const int row_blocks = (rows + impl::kMaxRows - 1) / impl::kMaxRows;
  const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(dim));

  // Items: enough for about four thread blocks per multiprocessor, chunks of at least 256 tokens.
  const std::int64_t blocks_per_item = std::int64_t{shape.kv_heads} * row_blocks;
  const std::int64_t want = std::max<std::int64_t>(1, (4 * std::int64_t{multiprocessors()} + blocks_per_item - 1) / blocks_per_item);
  const std::int64_t item_floats = std::int64_t{shape.kv_heads} * rows * (dim + 2);
  const PagedKvView<T> host = table.host_view(kv);
  ws.plan.plan_items(host, p.chunk_tokens, want, 64, 256, item_floats);
  const std::size_t n_items = ws.plan.items.size();
  if (n_items > std::size_t{std::numeric_limits<int>::max()})
    raise<invalid_argument>(kvattn::detail::concat("cuda::decode: ", n_items, " work items exceed a grid (raise chunk_tokens)"));
  // Sequences of one item (all of them, commonly, at large batches) are written by the decode
  // kernel: the partial results and the merge launch are needed only when some sequence is split.
  const bool split = n_items > static_cast<std::size_t>(kv.batch);
  ws.items.upload(ws.plan.items.data(), n_items, stream);
  ws.first_item.upload(ws.plan.first_item.data(), ws.plan.first_item.size(), stream);
  float* partial = split ? ws.partial.reserve(static_cast<std::size_t>(n_items * item_floats)) : nullptr;

  impl::DecodeArgs<D> a{reinterpret_cast<const D*>(kv.pool), kv.layout, kv.indptr, kv.indices, kv.last_page_len,
                        ws.items.data(), q, ws.first_item.data(), partial, out, lse,
                        group, Q, rows, shape.q_heads, scale, p.window, p.soft_cap};
  const auto items = static_cast<unsigned>(n_items);
  const int H = shape.kv_heads;
  constexpr bool kVec = sizeof(D) <= 4;  // 16-byte loads of whole rows (8 elements of 16 bits, 4 x 2 of fp32)
  switch (dim) {
    case 64: impl::launch_rows<D, 8, 8, kVec, V>(a, items, H, stream); break;
    case 128: impl::launch_rows<D, 16, 8, kVec, V>(a, items, H, stream); break;
    case 256: impl::launch_rows<D, 32, 8, kVec, V>(a, items, H, stream); break;
    default: {
      const int ept = (dim + 31) / 32;
      if (ept <= 1) impl::launch_rows<D, 32, 1, false, V>(a, items, H, stream);
      else if (ept <= 2) impl::launch_rows<D, 32, 2, false, V>(a, items, H, stream);
      else if (ept <= 4) impl::launch_rows<D, 32, 4, false, V>(a, items, H, stream);
      else if (ept <= 8) impl::launch_rows<D, 32, 8, false, V>(a, items, H, stream);
      else impl::launch_rows<D, 32, 16, false, V>(a, items, H, stream);
    }
  }
  check(cudaGetLastError(), "cuda::decode launch");
  if (!split) return;
  const dim3 merge_grid(static_cast<unsigned>(kv.batch), static_cast<unsigned>(H), static_cast<unsigned>(rows));
  impl::decode_merge_kernel<<<merge_grid, impl::kDecodeThreads, 0, stream>>>(partial, ws.items.data(), ws.first_item.data(),
                                                                             rows, group, Q, shape.q_heads, dim, out, lse);
  check(cudaGetLastError(), "cuda::decode merge launch");
}

}  // namespace kvattn::cuda
