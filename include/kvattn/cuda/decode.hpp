// kvattn/cuda/decode.hpp — MHA / GQA / MQA decode attention over a device cache.
//
// The operator of kvattn/decode.hpp on an NVIDIA GPU, with the same shapes, policies and results
// (device pointers):
//   q    [batch][Q][q_heads][head_dim]  fp32
//   out  [batch][Q][q_heads][head_dim]  fp32
//   lse  [batch][Q][q_heads]            fp32, natural log, -inf for a row that sees no key; optional
// Query i of sequence b sits at position L_b − Q + i and attends to the positions at or before it,
// with what the score policy (kvattn/policy.hpp) adds: a window, logits (soft-cap, ALiBi), a mask
// (a draft tree), a sink, or several of them; the policy's arrays are device memory
// (cuda::PolicyArrays, plan.hpp). The semantics are the CPU kernel's: the policy's window bounds
// the keys from below, its logit applies to the scaled score, its mask is consulted for the keys
// from mask_from to the row's own position, and a sink joins each row's softmax once, at the very
// end, however its keys were split (lse then counts it; a row that sees nothing gets zeros and
// lse = -inf, or lse = sink).
//
// Work: the step's cuda::DecodePlan (plan.hpp) split the batch into items (sequence, chunk of
// keys) with enough items to give every multiprocessor a few thread blocks. One thread block per
// (item, KV head, block of up to 8 query rows); the rows of a block are the query heads of the
// group (times Q), so each key and value byte of a chunk is read from memory once for groups up
// to 8 (larger groups take several row blocks, which read the same keys again, mostly from L2).
// In a block of 128 threads, a row of head_dim elements is covered by TPR threads holding EPT
// consecutive elements each (head sizes 64, 128, 256, through kvattn::dispatch_head_dim: 8, 16,
// 32 threads of 8 elements, one 16-byte load of fp16/bf16 each; any other size up to 512: 32
// threads with EPT rounded up and masked). The block's 128 / TPR lane groups take the chunk's
// tokens in turn, two at a time with both tokens' rows loaded before either is used and the page
// entries of the next two read a step ahead; each group keeps an online softmax state per row
// ({m, d} and its EPT output elements, updated by kvattn::softmax_step), scores reduced across
// its TPR lanes with shuffles. The groups' states are merged through shared memory at the end of
// the chunk (kvattn::merge_weights) and written as the item's partial result {o normalized, m, d};
// a second kernel merges the items of each row (kvattn::merge_weights again: empty parts are
// harmless), adds the sink, and writes out and lse. A sequence that is one item has its out and
// lse (sink included) written by the first kernel, and the second kernel is launched only when
// some sequence is split, so a batch with no split sequence takes one launch.
//
// Formats: fp32, fp16, bf16, and the 8-bit int8_row, fp8_e4m3_row and fp8_e4m3_layer (format.hpp).
// An 8-bit row is read with one 8-byte load per thread for the head sizes above and converted to
// floats (an fp8 code as q · 2^-8: its fields placed in an fp16's); a row's scale, read from the
// page's scale block beside it, multiplies its score (keys) and its probability (values), and a
// layer's scales are folded into the softmax scale and into each probability. The scoring stays
// fp32 (DecodeParams::int8_queries is the CPU kernels': the plan refuses it). The 4-bit and rotated formats are CPU
// formats.
//
// The call itself launches kernels and nothing else (no allocation, copy or synchronization):
// a step of several layers can be captured into a CUDA graph.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <variant>

#include "../core.hpp"
#include "../error.hpp"
#include "../paged_cache.hpp"
#include "../policy.hpp"
#include "../shape.hpp"
#include "../state.hpp"
#include "plan.hpp"
#include "runtime.hpp"

namespace kvattn::cuda {

namespace impl {

/// What every thread block of a decode launch reads (device pointers), beside the policy.
template <class E> struct DecodeArgs {
  const E* pool;  ///< the layer: [num_pages][page_stride]
  PageLayout layout;
  const std::int32_t* indptr;
  const std::int32_t* indices;
  const std::int32_t* last_page_len;
  const DecodePlan::Item* items;
  const float* q;
  float* partial_o;   ///< [split rows][head_dim]: row item.partial + h · rows + row of a split sequence's item
  float* partial_md;  ///< [split rows][2]
  float* out;         ///< where a sequence of one item writes its rows' results directly (and lse, when not null)
  float* lse;
  int group, Q, rows, q_heads;
  float scale;    ///< the softmax scale (formats with a layer scale: times the key scale, format_traits<T>::kernel_scale)
  float v_scale;  ///< formats with a layer scale: the value scale (kernel_scale); 1 otherwise
};

/// A vector of N bytes for one load.
template <int N> struct Bytes;
template <> struct Bytes<16> { using type = uint4; };
template <> struct Bytes<8> { using type = uint2; };

/// EPT consecutive elements of a row into floats: loads of 16 bytes (8 for 8-bit formats' rows of
/// 8 per thread) when VEC, else one by one, masked past `dim`.
template <class E, int EPT, bool VEC>
__device__ __forceinline__ void load_row(const E* p, int c0, int dim, float (&x)[EPT]) {
  if constexpr (VEC) {
    constexpr int kLoad = EPT * sizeof(E) < 16 ? static_cast<int>(EPT * sizeof(E)) : 16;  // bytes per load
    constexpr int kPer = kLoad / static_cast<int>(sizeof(E));
    static_assert(EPT % kPer == 0, "whole loads");
    using V = typename Bytes<kLoad>::type;
#pragma unroll
    for (int j = 0; j < EPT / kPer; ++j) {
      const V raw = *reinterpret_cast<const V*>(p + c0 + j * kPer);
      const E* e = reinterpret_cast<const E*>(&raw);
#pragma unroll
      for (int k = 0; k < kPer; ++k) x[j * kPer + k] = to_float(e[k]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < EPT; ++e) x[e] = c0 + e < dim ? to_float(p[c0 + e]) : 0.0f;
  }
}

/// One (item, KV head, row block): see the top of the file. Writes the partial state of each of
/// its rows (row item.partial + h · rows + row of partial_o and partial_md: {o normalized, m, d});
/// or, when the item is its sequence's only one (item.partial < 0), the rows' outputs and
/// log-sum-exps themselves, the sink counted.
template <class T, class E, int TPR, int EPT, int RB, bool VEC, class P>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const DecodeArgs<E> a, const P policy) {
  constexpr int NG = kDecodeThreads / TPR;  // lane groups
  constexpr bool kRowScale = format_traits<T>::row_scale;  // a scale per row, in the page's scale block
  constexpr bool kScaled = kRowScale || format_traits<T>::layer_scale;
  const DecodePlan::Item item = a.items[blockIdx.x];
  const int h = blockIdx.y, r0 = blockIdx.z * RB;
  const int nr = min(RB, a.rows - r0);
  const int lane = threadIdx.x % TPR, g = threadIdx.x / TPR;
  const int dim = a.layout.head_dim, page_size = a.layout.page_size;
  const int c0 = lane * EPT;
  const int b = item.batch_index;
  const std::int64_t L = sequence_length(a.indptr, a.last_page_len, page_size, b);

  float q[RB][EPT], acc[RB][EPT], m[RB], d[RB];
  PolicyRow row[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int rr = r0 + (r < nr ? r : 0);
    const int i = rr / a.group, head = h * a.group + rr % a.group;
    // A padding row (past the block's rows) is at position -1: it sees nothing.
    row[r] = policy_row(policy, QueryRow{std::int64_t{b} * a.Q + i, r < nr ? L - a.Q + i : -1, L - a.Q, head});
    const float* qr = a.q + ((std::int64_t{b} * a.Q + i) * a.q_heads + head) * dim;
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      q[r][e] = c0 + e < dim ? qr[c0 + e] : 0.0f;
      acc[r][e] = 0.0f;
    }
    m[r] = -INFINITY;
    d[r] = 0.0f;
  }

  const std::int32_t* pages = a.indices + a.indptr[b];
  const std::int64_t value_minus_key = a.layout.value(h, 0) - a.layout.key(h, 0);
  // The page of each token an iteration reads is fetched one iteration ahead, so that the rows'
  // loads never wait for the page table.
  std::int32_t page[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const std::int64_t t = item.begin + u * NG + g;
    page[u] = t < item.end ? pages[t / page_size] : 0;
  }

  // Every lane of a warp runs the same number of iterations (the shuffles need all of them).
  for (std::int64_t t0 = item.begin; t0 < item.end; t0 += 2 * NG) {
    float k[2][EPT], v[2][EPT];
    float ks[2] = {1.0f, 1.0f}, vs[2] = {a.v_scale, a.v_scale};  // the rows' scales (row-scaled formats)
    bool valid[2];
    std::int32_t next[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const std::int64_t t = t0 + 2 * NG + u * NG + g;
      next[u] = t < item.end ? pages[t / page_size] : 0;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // both tokens' rows in flight before either is used
      const std::int64_t t = t0 + u * NG + g;
      valid[u] = t < item.end;
      if (valid[u]) {
        const E* base = a.pool + std::int64_t{page[u]} * a.layout.page_stride;
        const int slot = static_cast<int>(t % page_size);
        const E* kr = base + a.layout.key(h, slot);
        load_row<E, EPT, VEC>(kr, c0, dim, k[u]);
        load_row<E, EPT, VEC>(kr + value_minus_key, c0, dim, v[u]);
        if constexpr (kRowScale) {  // one byte per unit: the scale block is scale_offset bytes into the page
          const float* scales = reinterpret_cast<const float*>(base + a.layout.scale_offset);
          ks[u] = scales[a.layout.key_scale(h, slot)];
          vs[u] = scales[a.layout.value_scale(h, slot)];
        }
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
        if (!valid[u] || !sees(policy, row[r], t)) continue;  // uniform across the lane group: the shuffles are done
        if constexpr (kRowScale) s *= ks[u];
        s = policy_logit(policy, row[r], s * a.scale, t);
        const SoftmaxStep<float> step = softmax_step<float>(m[r], s);
        const float p = expf(s - step.shift);
        d[r] = d[r] * step.alpha + p;
        float pv = p;
        if constexpr (kScaled) pv *= vs[u];  // the value row's scale
#pragma unroll
        for (int e = 0; e < EPT; ++e) acc[r][e] = fmaf(pv, v[u][e], acc[r][e] * step.alpha);
        m[r] = step.m;
      }
    }
    page[0] = next[0];
    page[1] = next[1];
  }

  // Merge the lane groups: their [NG][RB] states meet row by row (merge_weights, group after
  // group), which gives each group's weight in the row's result; then every thread forms output
  // elements from the groups' accumulators and those weights.
  extern __shared__ float smem[];
  const int width = TPR * EPT;  // >= dim
  float* s_acc = smem;                   // [NG][RB][width] each group's accumulated Σ p v
  float* s_m = s_acc + NG * RB * width;  // [NG][RB]
  float* s_d = s_m + NG * RB;            // [NG][RB]
  float* s_w = s_d + NG * RB;            // [NG][RB] each group's accumulator's weight in the row's output
  float* s_row = s_w + NG * RB;          // [RB][2] the row's merged {m, d} (its sink counted on the direct path)
#pragma unroll
  for (int r = 0; r < RB; ++r) {
#pragma unroll
    for (int e = 0; e < EPT; ++e) s_acc[(g * RB + r) * width + c0 + e] = acc[r][e];
    if (lane == 0) {
      s_m[g * RB + r] = m[r];
      s_d[g * RB + r] = d[r];
    }
  }
  __syncthreads();
  const bool direct = item.partial < 0;  // the sequence's only item: its state is the result
  if (threadIdx.x < nr) {
    const int r = threadIdx.x;
    // The groups' results are o_j = acc_j / d_j (normalized) with states {m_j, d_j}; merging them in
    // order gives o = Σ_j b_j · Π_{k > j} a_k · o_j with (a_k, b_k) the weights of merge k.
    SoftmaxStats st;
    float a_of[NG];
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const MergeWeights w = merge_weights(st, SoftmaxStats{s_m[j * RB + r], s_d[j * RB + r]});
      a_of[j] = w.a;
      s_w[j * RB + r] = w.b;
      st = w.stats;
    }
    float later = 1.0f;  // Π of the later merges' a, and the sink's factor
    if (direct) {
      const int rr = r0 + r;
      later = sink_factor(policy, st, h * a.group + rr % a.group);
    }
#pragma unroll
    for (int j = NG - 1; j >= 0; --j) {
      const float dj = s_d[j * RB + r];
      s_w[j * RB + r] = dj > 0.0f ? s_w[j * RB + r] * later / dj : 0.0f;
      later *= a_of[j];
    }
    s_row[2 * r] = st.m;
    s_row[2 * r + 1] = st.d;
  }
  __syncthreads();
  for (int x = threadIdx.x; x < nr * dim; x += kDecodeThreads) {
    const int r = x / dim, c = x % dim;
    float o = 0.0f;
#pragma unroll
    for (int j = 0; j < NG; ++j) o = fmaf(s_w[j * RB + r], s_acc[(j * RB + r) * width + c], o);
    const int rr = r0 + r;
    if (direct) {
      const int i = rr / a.group, head = h * a.group + rr % a.group;
      const std::int64_t at = (std::int64_t{b} * a.Q + i) * a.q_heads + head;
      a.out[at * dim + c] = o;
      if (c == 0 && a.lse != nullptr) a.lse[at] = SoftmaxStats{s_row[2 * r], s_row[2 * r + 1]}.lse();
    } else {
      const std::int64_t prow = item.partial + std::int64_t{h} * a.rows + rr;
      a.partial_o[prow * dim + c] = o;
      if (c == 0) {
        a.partial_md[2 * prow] = s_row[2 * r];
        a.partial_md[2 * prow + 1] = s_row[2 * r + 1];
      }
    }
  }
}

/// One thread block per (sequence, KV head, row) of the batch, flattened: merges the items'
/// partial states of that row (merge_weights, item after item), adds the sink, and writes out and
/// lse. A sequence of one item was written by decode_kernel: its blocks return at once.
template <class P>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_merge_kernel(const DecodePlan::Item* __restrict__ items, const std::int64_t* __restrict__ first_item,
                        const float* __restrict__ partial_o, const float* __restrict__ partial_md, int kv_heads, int rows,
                        int group, int Q, int q_heads, int dim, float* __restrict__ out, float* __restrict__ lse, const P policy) {
  const std::int64_t x = blockIdx.x;
  const int r = static_cast<int>(x % rows);
  const std::int64_t bh = x / rows;
  const int h = static_cast<int>(bh % kv_heads), b = static_cast<int>(bh / kv_heads);
  const std::int64_t first = first_item[b], last = first_item[b + 1];
  if (last - first == 1) return;
  const int i = r / group, head = h * group + r % group;
  const std::int64_t at = (std::int64_t{b} * Q + i) * q_heads + head;
  const std::int64_t row_in_item = std::int64_t{h} * rows + r;
  SoftmaxStats st;
  for (int col = threadIdx.x; col < dim; col += blockDim.x) {
    float o = 0.0f;
    st = SoftmaxStats{};
    for (std::int64_t c = first; c < last; ++c) {
      const std::int64_t prow = items[c].partial + row_in_item;
      merge_into(o, st, partial_o[prow * dim + col], SoftmaxStats{partial_md[2 * prow], partial_md[2 * prow + 1]});
    }
    out[at * dim + col] = o * sink_factor(policy, st, head);
  }
  // Thread 0 has merged column 0 (dim >= 1): its state is the row's, the sink counted.
  if (lse != nullptr && threadIdx.x == 0) lse[at] = st.lse();
}

template <class T, class E, int TPR, int EPT, int RB, bool VEC, class P>
void launch_decode(const DecodeArgs<E>& a, const P& policy, unsigned items, int kv_heads, cudaStream_t stream) {
  constexpr int NG = kDecodeThreads / TPR;
  // The merge's shared memory: accumulators [NG][RB][TPR · EPT], {m, d} and weights [NG][RB], rows' {m, d}.
  const std::size_t smem = sizeof(float) * (std::size_t{NG} * RB * TPR * EPT + 3 * std::size_t{NG} * RB + 2 * std::size_t{RB});
  const dim3 grid(items, static_cast<unsigned>(kv_heads), static_cast<unsigned>((a.rows + RB - 1) / RB));
  decode_kernel<T, E, TPR, EPT, RB, VEC, P><<<grid, kDecodeThreads, smem, stream>>>(a, policy);
}

/// The row block for the call's rows (gqa_row_block, as the plan counted it).
template <class T, class E, int TPR, int EPT, bool VEC, class P>
void launch_rows(const DecodeArgs<E>& a, const P& policy, unsigned items, int kv_heads, cudaStream_t stream) {
  constexpr int kMaxRb = gqa_max_row_block(EPT);
  static_assert(kMaxRb == 4 || kMaxRb == 8, "row blocks of 1, 2, 4 and the most");
  switch (gqa_row_block(EPT, a.rows)) {
    case 1: launch_decode<T, E, TPR, EPT, 1, VEC>(a, policy, items, kv_heads, stream); break;
    case 2: launch_decode<T, E, TPR, EPT, 2, VEC>(a, policy, items, kv_heads, stream); break;
    case 4: launch_decode<T, E, TPR, EPT, 4, VEC>(a, policy, items, kv_heads, stream); break;
    default: launch_decode<T, E, TPR, EPT, kMaxRb, VEC>(a, policy, items, kv_heads, stream); break;
  }
}

}  // namespace impl

/// Decode attention for a batch on the GPU: the operator of kvattn/decode.hpp (see the top of this
/// file). `kv` is one layer's view of the device cache from the step's plan (plan.view(cache,
/// layer)); `plan` was made with a GqaShape (DecodePlan::make); q, out, lse are device arrays;
/// `policy` adds a variant (policy.hpp), its arrays in device memory (PolicyArrays). Launches on
/// `stream` and returns without waiting; no allocation, no copy, no synchronization. Throws
/// kvattn::invalid_argument or shape_error on inconsistent arguments before any launch (a view
/// not of this plan, a plan of an MLA shape, a policy that does not fit the call, null q or
/// out); cuda_error if a launch fails.
template <class T, class P = Plain>
void decode(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, cudaStream_t stream = nullptr,
            const P& policy = P{}) {
  static_assert(format_traits<T>::latent_block == 0,
                "kvattn::cuda::decode reads GQA-family caches: fp8_e4m3_latent and int8_latent are MLA formats (cuda::mla_decode)");
  static_assert(!format_traits<T>::rotated && !format_traits<T>::block_scale,
                "kvattn::cuda::decode reads fp32, fp16, bf16, int8_row, fp8_e4m3_row and fp8_e4m3_layer caches (the 4-bit and the "
                "rotated formats are read by the CPU kernels)");
  constexpr const char* op = "cuda::decode";
  const GqaShape& shape = plan.check_call<GqaShape>(op, kv, policy, q, out);
  if (reinterpret_cast<std::uintptr_t>(kv.pool) % 16 != 0)
    raise<invalid_argument>("cuda::decode: the pool must start on 16 bytes (rows are read with 16-byte loads)");
  if (kv.batch == 0) return;

  using E = typename impl::device_type<T>::type;
  const int Q = plan.params().queries_per_seq, group = shape.group_size();
  const int rows = group * Q;
  const DecodePlan::DeviceArrays& dev = plan.device_arrays();
  float scale = plan.scale(), v_scale = 1.0f;
  if constexpr (format_traits<T>::layer_scale) {  // the layer's scales, out of the loop
    scale *= format_traits<T>::kernel_scale(kv.scales.k);
    v_scale = format_traits<T>::kernel_scale(kv.scales.v);
  }
  const impl::DecodeArgs<E> a{reinterpret_cast<const E*>(kv.pool), kv.layout, kv.indptr, kv.indices, kv.last_page_len, dev.items, q,
                              dev.partial_o, dev.partial_md, out, lse, group, Q, rows, shape.q_heads, scale, v_scale};
  const auto items = static_cast<unsigned>(plan.item_count());
  const int H = shape.kv_heads;
  dispatch_head_dim(shape.head_dim, [&](auto head_dim) {
    constexpr int HeadDim = decltype(head_dim)::value;
    if constexpr (HeadDim > 0) {  // whole-row loads: 16 bytes (8 elements of 16 bits; 2 × 4 of fp32) or 8 (8-bit codes)
      static_assert(impl::gqa_elements_per_thread(HeadDim) == 8, "8 elements per thread");
      impl::launch_rows<T, E, HeadDim / 8, 8, true>(a, policy, items, H, stream);
    } else {
      switch (impl::gqa_elements_per_thread(shape.head_dim)) {
        case 1: impl::launch_rows<T, E, 32, 1, false>(a, policy, items, H, stream); break;
        case 2: impl::launch_rows<T, E, 32, 2, false>(a, policy, items, H, stream); break;
        case 4: impl::launch_rows<T, E, 32, 4, false>(a, policy, items, H, stream); break;
        case 8: impl::launch_rows<T, E, 32, 8, false>(a, policy, items, H, stream); break;
        default: impl::launch_rows<T, E, 32, 16, false>(a, policy, items, H, stream); break;
      }
    }
  });
  check(cudaGetLastError(), "cuda::decode launch");
  if (plan.split_rows() == 0) return;
  const auto merge_blocks = static_cast<unsigned>(std::int64_t{kv.batch} * H * rows);
  impl::decode_merge_kernel<P><<<merge_blocks, impl::kDecodeThreads, 0, stream>>>(
      dev.items, dev.first_item, dev.partial_o, dev.partial_md, H, rows, group, Q, shape.q_heads, shape.head_dim, out, lse, policy);
  check(cudaGetLastError(), "cuda::decode merge launch");
}

}  // namespace kvattn::cuda
