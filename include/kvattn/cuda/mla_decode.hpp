// kvattn/cuda/mla_decode.hpp — MLA decode attention on the GPU, straight against the cached latents
// (the folded path: kvattn/mla_decode.hpp has the equations, shapes and semantics, which are the
// same here; every pointer is a device pointer).
//
//   q    [batch][Q][heads][latent_dim + rope_dim]  fp32, the absorbed queries
//   out  [batch][Q][heads][latent_dim]             fp32, attention in latent space
//   lse  [batch][Q][heads]                         fp32, natural log, -inf for a row that sees no key; optional
//
// The cache is fp32, fp16, bf16, fp8_e4m3_latent or int8_latent (format.hpp). A row of the two
// MLA formats is [latent_dim codes][latent_dim / 128 fp32 scales s][rope_dim bf16], row_stride
// bytes apart (656 at 512 + 64); a latent value is impl::to_float(code) · kernel_scale(s) (q · s
// for int8; q · 2^-8 · (s · 2^8) for e4m3), the same fp32 product the host's read_latent forms, so
// the kernel sees exactly the latents the reference sees.
//
// Query i of sequence b sits at position L_b − Q + i and sees the positions at or before it, with
// what the score policy (kvattn/policy.hpp) adds, applied as the CPU kernel applies it (see
// cuda/decode.hpp): window, logits of the scaled score, mask, and a sink counted once per row at
// the very end. A row that sees nothing gets zeros and lse = -inf (lse = sink with a sink).
//
// Work. The step's cuda::DecodePlan (plan.hpp, made with the MlaShape) split the batch into items:
// a sequence and a range [begin, end) of its positions, long sequences in several chunks so that
// the grid fills the device. The rows of a sequence, r = i · heads + h (its Q · heads queries, in
// the order of q and out), are cut into blocks of kRows = 16. The main kernel runs one thread
// block of 256 threads (8 warps) per (item, row block, column block); all its rows share every
// tile of the latent cache, which is read from the pages once per block:
//   - Tiles of kTile = 32 tokens. The tile's rows [latent | rope] are copied from their pages into
//     shared memory: fp32, fp16 and bf16 in the storage type (16-byte loads when every row starts
//     on 16 bytes, i.e. (latent_dim + rope_dim) · sizeof(T) % 16 == 0 and the pool is 16-byte
//     aligned; element by element otherwise); the MLA formats in fp32, dequantized as they are
//     copied (each code times its block's scale, the rotary key widened from bf16), so every later
//     step is the fp32 cache's. Their codes are read 16 to a load when rows start on 16 bytes
//     (row_stride % 16 == 0, as at 512 + 64), else 4 (every row of theirs starts on 4 bytes:
//     rope_dim is even), the block's scale once per load, the rotary key in bf16 pairs. The
//     queries of the row block sit in shared memory in fp32, scaled.
//   - Scores S = Q̃ · Cᵀ (16 rows × 32 tokens): each thread computes a 4 × 4 block of them over
//     one eighth of the inner dimension (warp w takes the float4 columns ≡ w mod 8; lane l the
//     rows 4·(l / 8) + a and the tokens l % 8 + 8·u), and the eight partial sums meet in shared
//     memory. Shared rows are padded to an odd number of float4s so that these reads are free
//     of bank conflicts.
//   - Online softmax: warp w owns rows 2w and 2w + 1, a lane per token; the policy's window, mask
//     and logits, then one kvattn::softmax_step per row and tile; the running {m, d} of every row
//     and this tile's rescale factor live in shared memory; the probabilities are written to
//     shared memory as P [32 tokens][16 rows].
//   - O = alpha · O + P · C over the latent columns: warp w owns 32 · NC columns of the block's
//     column block (NC = 1 or 2, so 256 or 512 columns per block: one column block up to
//     latent_dim = 512), for all 16 rows, in registers (16 · NC accumulators per thread).
//   - The shared memory of one block, with Kp the padded row width:
//       queries [16][Kp] fp32 | tile [32][Kp] T (fp32 for the MLA formats) |
//       partial scores [8][16][32] fp32 | P [32][16] fp32 | m, d, alpha [16] fp32 |
//       tile row offsets [32] int64
//     (DeepSeek-V2's 512 + 64: 93 KB in bf16, two blocks per SM on an H100, one on an A100;
//     130 KB in fp32 and in the MLA formats). When the rows are too wide for the device's shared
//     memory, the inner dimension is processed in chunks of 1024, 512 or 256 columns (the queries
//     are then reloaded chunk by chunk, and the chunk that holds the block's latent columns is
//     reloaded for O += P · C): any width works.
// Each block writes, for its rows and columns, the item's normalized partial state {o, m, d}
// (state.hpp) to the plan's partial results, or, when the item is its sequence's only one, the
// final out and lse directly (the sink counted).
//
// Merge. A second kernel, launched when some sequence was split into several items, one block
// per (sequence, row) (those of unsplit sequences return at once), merges the items' partial
// states in order with kvattn::merge_weights (an empty part changes nothing, so empty states
// never produce NaN), then adds the sink; a row with no key at all ends with out = 0 and
// lse = -inf (or the sink).
//
// Every __syncthreads() sits in control flow that is uniform over the block (loops over tiles
// and chunks of an item); the warp shuffles of the softmax run with all 32 lanes.
//
// The call checks every argument first (kvattn::shape_error / invalid_argument / capacity_error,
// with the values in the message) and throws before any launch; then it launches on `stream`
// and returns: no allocation, no copy, no synchronization (the shared-memory opt-in of a kernel,
// cudaFuncSetAttribute, is made once per kernel and device, on its first launch), so a step can be
// captured into a CUDA graph. The kernels never allocate or fail on valid input.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
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

namespace mla_impl {

using impl::merge_into;

/// What the main kernel reads and writes; every pointer is a device pointer.
template <class E> struct Args {
  const E* pool;                 ///< the layer: [num_pages][page_stride]
  std::int64_t page_stride;      ///< elements (bytes for the MLA formats) from one page to the next
  int page_size;                 ///< tokens per page
  std::int64_t row_stride;       ///< elements (bytes) from one token's row to the next (>= K)
  std::int64_t rope_offset;      ///< MLA formats: bytes from a row's start to its rotary key
  const std::int32_t* indptr;    ///< [batch + 1]
  const std::int32_t* indices;   ///< [indptr[batch]]
  const std::int32_t* last_page_len;  ///< [batch]
  const DecodePlan::Item* items;  ///< [items]
  const float* q;                ///< [batch][rows][K]
  float scale;
  int heads, Q, rows;            ///< rows = Q · heads per sequence
  int latent, K;                 ///< latent_dim, latent_dim + rope_dim (a token's row in the page)
  int chunk;                     ///< columns of the inner dimension per chunk (K: one chunk)
  int chunks;                    ///< ceil(K / chunk)
  int Kp;                        ///< elements of a shared row: shared_row(chunk)
  float* part_o;                 ///< [split rows][latent]: row item.partial + r of a split sequence's item
  float* part_md;                ///< [split rows][2]
  float* out;                    ///< [batch][rows][latent]
  float* lse;                    ///< [batch][rows] or null
};

/// The 8-bit codes of the MLA formats (a byte of the page each).
template <class E> inline constexpr bool is_code_v = std::is_same_v<E, impl::Int8Code> || std::is_same_v<E, impl::E4m3Code>;
/// The type a tile is staged in, in shared memory: the stored element for fp32, fp16 and bf16;
/// fp32 for the MLA formats' codes, dequantized as they are copied in.
template <class E> using staged_t = std::conditional_t<is_code_v<E>, float, E>;
/// Latent values per scale in the MLA formats.
inline constexpr int kLatentBlock = 128;

/// Four consecutive elements of shared memory (16-byte aligned for float, 8 for 16-bit) as fp32.
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __half* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
/// Two consecutive elements (8-byte aligned for float, 4 for 16-bit) as fp32.
__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 load2(const __half* p) { return __half22float2(*reinterpret_cast<const __half2*>(p)); }
__device__ __forceinline__ float2 load2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Copies columns [c0, c0 + width) of the n token rows at pool + row[t] into tile [t][0, width)
/// (rows Kp apart), zero up to the next multiple of 4. Vec: 16-byte copies (the caller has
/// checked that rows, c0 and width are whole 16-byte units).
template <bool Vec, class E>
__device__ __forceinline__ void load_tile(const E* __restrict__ pool, const std::int64_t* row, int c0, int width, int n,
                                          E* tile, int Kp) {
  if constexpr (Vec) {
    constexpr int kPer16 = 16 / static_cast<int>(sizeof(E));
    const int units = width / kPer16;
    for (int i = threadIdx.x; i < n * units; i += kThreads) {
      const int t = i / units, u = i - t * units;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(pool + row[t] + c0 + u * kPer16));
      E* dst = tile + t * Kp + u * kPer16;
      if constexpr (sizeof(E) == 4) {
        *reinterpret_cast<uint4*>(dst) = v;
      } else {  // 16-bit rows are 8-byte aligned in shared memory
        reinterpret_cast<uint2*>(dst)[0] = make_uint2(v.x, v.y);
        reinterpret_cast<uint2*>(dst)[1] = make_uint2(v.z, v.w);
      }
    }
  } else {
    const int w4 = (width + 3) / 4 * 4;
    const E zero = impl::from_float<E>(0.0f);
    for (int i = threadIdx.x; i < n * w4; i += kThreads) {
      const int t = i / w4, k = i - t * w4;
      tile[t * Kp + k] = k < width ? pool[row[t] + c0 + k] : zero;
    }
  }
}

/// The code in byte b as the kernels read it (impl::to_float: q, or q · 2^-8 for e4m3).
template <class E> __device__ __forceinline__ E code_of(unsigned b);
template <> __device__ __forceinline__ impl::Int8Code code_of<impl::Int8Code>(unsigned b) {
  return impl::Int8Code{static_cast<std::int8_t>(b)};
}
template <> __device__ __forceinline__ impl::E4m3Code code_of<impl::E4m3Code>(unsigned b) {
  return impl::E4m3Code{static_cast<std::uint8_t>(b)};
}
/// What the loaded codes are multiplied by for a block's stored scale s: s for int8, s · 2^8 for
/// e4m3 (format_traits<F>::kernel_scale).
__device__ __forceinline__ float kernel_scale(impl::Int8Code, float s) { return s; }
__device__ __forceinline__ float kernel_scale(impl::E4m3Code, float s) { return s * 256.0f; }

/// Four codes (the bytes of w, the lowest first) times `scale`, into dst[0, 4).
template <class E> __device__ __forceinline__ void dequantize4(unsigned w, float scale, float* dst) {
  *reinterpret_cast<float4*>(dst) =
      make_float4(impl::to_float(code_of<E>(w & 0xFFu)) * scale, impl::to_float(code_of<E>((w >> 8) & 0xFFu)) * scale,
                  impl::to_float(code_of<E>((w >> 16) & 0xFFu)) * scale, impl::to_float(code_of<E>(w >> 24)) * scale);
}

/// An MLA format's load_tile: columns [c0, c0 + width) of the n token rows at byte pool + row[t]
/// (format.hpp: [latent codes][latent / 128 fp32 scales][rope bf16]) into tile [t][0, width) in
/// fp32 (rows Kp apart), zero up to the next multiple of 4: a code's value (impl::to_float) times
/// its block's kernel_scale, exactly as the host dequantizes it, then the rotary key's elements.
/// Codes are read 16 to a load when Vec (rows on 16 bytes), else 4 (rows on 4 bytes, as every row
/// of these formats is: rope_dim is even); scales as fp32, the rotary key in pairs of bf16. c0 is
/// a multiple of 256 (or 0) and latent of 128, so a load never straddles two blocks or the codes'
/// end.
template <bool Vec, class E>
__device__ __forceinline__ void load_latent_tile(const E* __restrict__ pool, const std::int64_t* row, int c0, int width, int n,
                                                 float* tile, int Kp, int latent, std::int64_t rope_offset) {
  constexpr int G = Vec ? 16 : 4;  // codes per load
  const unsigned char* base = reinterpret_cast<const unsigned char*>(pool);
  const int end = c0 + width, end4 = c0 + (width + 3) / 4 * 4;
  const int code_units = ::max(0, ::min(end, latent) - c0) / G;  // codes: columns [c0, min(end, latent))
  const int r0 = ::max(c0, latent), pair_units = ::max(0, end4 - r0) / 2;  // rotary key: columns [r0, end4) in pairs
  const int units = code_units + pair_units;
  for (int i = threadIdx.x; i < n * units; i += kThreads) {
    const int t = i / units, u = i - t * units;
    const unsigned char* src = base + row[t];
    float* dst = tile + t * Kp;
    if (u < code_units) {
      const int k = c0 + u * G;
      const float s = kernel_scale(E{}, __ldg(reinterpret_cast<const float*>(src + latent) + k / kLatentBlock));
      if constexpr (Vec) {
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(src + k));
        dequantize4<E>(w.x, s, dst + (k - c0));
        dequantize4<E>(w.y, s, dst + (k - c0) + 4);
        dequantize4<E>(w.z, s, dst + (k - c0) + 8);
        dequantize4<E>(w.w, s, dst + (k - c0) + 12);
      } else {
        dequantize4<E>(__ldg(reinterpret_cast<const unsigned*>(src + k)), s, dst + (k - c0));
      }
    } else {
      const int k = r0 + 2 * (u - code_units);  // even; k + 1 < end when k < end (rope_dim even)
      float2 v = make_float2(0.0f, 0.0f);
      if (k < end) {
        const unsigned w = __ldg(reinterpret_cast<const unsigned*>(src + rope_offset) + (k - latent) / 2);
        v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
      }
      *reinterpret_cast<float2*>(dst + (k - c0)) = v;
    }
  }
}

/// Copies columns [c0, c0 + width) of the item's n tile rows (row[t]) into the tile in shared
/// memory: load_tile for fp32, fp16 and bf16, load_latent_tile for the MLA formats.
template <bool Vec, class E>
__device__ __forceinline__ void copy_tile(const Args<E>& a, const std::int64_t* row, int c0, int width, int n, staged_t<E>* tile,
                                          int Kp) {
  if constexpr (is_code_v<E>)
    load_latent_tile<Vec>(a.pool, row, c0, width, n, tile, Kp, a.latent, a.rope_offset);
  else
    load_tile<Vec>(a.pool, row, c0, width, n, tile, Kp);
}

/// Columns [c0, c0 + width) of the block's query rows, scaled, into qs [kRows][Kp]; zero past
/// `width` and in rows past the sequence's.
__device__ __forceinline__ void load_queries(const float* __restrict__ q_seq, int row0, int rows, int K, float scale,
                                             int c0, int width, float* qs, int Kp) {
  for (int i = threadIdx.x; i < kRows * Kp; i += kThreads) {
    const int r = i / Kp, k = i - r * Kp;
    const int gr = row0 + r;
    qs[i] = gr < rows && k < width ? q_seq[std::int64_t{gr} * K + c0 + k] * scale : 0.0f;
  }
}

/// One block: rows [row0, row0 + kRows) of item blockIdx.x, latent columns of column block
/// blockIdx.z (kWarps · 32 · NC of them), the policy applied to every score. Vec: tiles are
/// copied in 16-byte units (copy_tile).
template <class E, int NC, bool Vec, class P>
__global__ void __launch_bounds__(kThreads, 2) mla_decode_kernel(const Args<E> a, const P policy) {
  using S = staged_t<E>;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kCols = kWarps * 32 * NC;  // columns of a column block
  extern __shared__ float4 shared_f4[];
  const int Kp = a.Kp;
  float* qs = reinterpret_cast<float*>(shared_f4);                      // [kRows][Kp]
  S* tile = reinterpret_cast<S*>(qs + kRows * Kp);                      // [kTile][Kp]
  float* red = reinterpret_cast<float*>(tile + kTile * Kp);             // [kWarps][kRows][kTile]
  float* ps = red + kWarps * kRows * kTile;                             // [kTile][kRows]
  float* ms = ps + kTile * kRows;                                       // [kRows]
  float* ds = ms + kRows;                                               // [kRows]
  float* alphas = ds + kRows;                                           // [kRows]
  std::int64_t* row_at = reinterpret_cast<std::int64_t*>(alphas + kRows);  // [kTile]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const DecodePlan::Item it = a.items[blockIdx.x];
  const int seq = it.batch_index;
  const int row0 = static_cast<int>(blockIdx.y) * kRows;
  const int col0 = static_cast<int>(blockIdx.z) * kCols;
  const std::int32_t* pages = a.indices + a.indptr[seq];
  const std::int64_t length = sequence_length(a.indptr, a.last_page_len, a.page_size, seq);
  const float* q_seq = a.q + std::int64_t{seq} * a.rows * a.K;
  const bool resident = a.chunks == 1;      // queries and tiles whole: loaded once per tile
  const int col_chunk = col0 / a.chunk;     // the chunk holding this block's columns
  const int col_chunk0 = col_chunk * a.chunk;

  for (int i = tid; i < kTile * Kp; i += kThreads) tile[i] = impl::from_float<S>(0.0f);
  if (tid < kRows) {
    ms[tid] = kNegInf;
    ds[tid] = 0.0f;
    alphas[tid] = 1.0f;
  }
  if (resident) load_queries(q_seq, row0, a.rows, a.K, a.scale, 0, a.K, qs, Kp);
  __syncthreads();

  float o[kRows][NC];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < NC; ++j) o[r][j] = 0.0f;

  const int rg = lane >> 3, tg = lane & 7;  // score block: rows 4·rg + a, tokens tg + 8·u
  const int wc = col0 + warp * 32 * NC;     // this warp's first column
  const int c = wc + lane * NC;             // this lane's first column

  for (std::int64_t t0 = it.begin; t0 < it.end; t0 += kTile) {
    const int n = static_cast<int>(std::min<std::int64_t>(kTile, it.end - t0));
    if (tid < n) {
      const std::int64_t pos = t0 + tid;
      row_at[tid] = std::int64_t{pages[pos / a.page_size]} * a.page_stride + (pos % a.page_size) * a.row_stride;
    }
    __syncthreads();

    // 1. Partial scores of this warp's share of the inner dimension, chunk by chunk.
    float acc[4][4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int u = 0; u < 4; ++u) acc[x][u] = 0.0f;
    for (int ch = 0; ch < a.chunks; ++ch) {
      const int c0 = ch * a.chunk, width = ::min(a.chunk, a.K - c0);
      if (ch > 0) __syncthreads();  // the previous chunk's readers are done
      if (!resident) load_queries(q_seq, row0, a.rows, a.K, a.scale, c0, width, qs, Kp);
      copy_tile<Vec>(a, row_at, c0, width, n, tile, Kp);
      __syncthreads();
      const int k4s = (width + 3) / 4;
      for (int k4 = warp; k4 < k4s; k4 += kWarps) {
        float4 qv[4], cv[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) qv[x] = *reinterpret_cast<const float4*>(qs + (rg * 4 + x) * Kp + 4 * k4);
#pragma unroll
        for (int u = 0; u < 4; ++u) cv[u] = load4(tile + (tg + 8 * u) * Kp + 4 * k4);
#pragma unroll
        for (int x = 0; x < 4; ++x)
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            float s = acc[x][u];
            s = fmaf(qv[x].x, cv[u].x, s);
            s = fmaf(qv[x].y, cv[u].y, s);
            s = fmaf(qv[x].z, cv[u].z, s);
            s = fmaf(qv[x].w, cv[u].w, s);
            acc[x][u] = s;
          }
      }
    }
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int u = 0; u < 4; ++u) red[(warp * kRows + rg * 4 + x) * kTile + tg + 8 * u] = acc[x][u];
    __syncthreads();

    // 2. Online softmax: warp w, rows 2w and 2w + 1, lane = token t0 + lane. The policy's window,
    //    mask and logits (the queries are scaled already), then one softmax step for the tile.
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = 2 * warp + rr, gr = row0 + r;
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[(w * kRows + r) * kTile + lane];
      // Row gr is query i of the sequence, head gr − i · heads; a row past the sequence's is at
      // position -1 and sees nothing.
      const int i = gr / a.heads;
      const PolicyRow row =
          policy_row(policy, QueryRow{std::int64_t{seq} * a.Q + i, gr < a.rows ? length - a.Q + i : -1, length - a.Q, gr - i * a.heads});
      const std::int64_t t = t0 + lane;
      s = lane < n && sees(policy, row, t) ? policy_logit(policy, row, s, t) : kNegInf;
      const SoftmaxStep<float> step = softmax_step<float>(ms[r], warp_max(s));
      const float p = expf(s - step.shift);  // 0 for a key the row does not see
      const float sum = warp_sum(p);
      ps[lane * kRows + r] = p;
      __syncwarp();
      if (lane == 0) {
        ms[r] = step.m;
        ds[r] = ds[r] * step.alpha + sum;
        alphas[r] = step.alpha;
      }
    }
    __syncthreads();

    // 3. O = alpha · O + P · C over this block's latent columns (from its chunk's tile).
    if (a.chunks > 1 && col_chunk != a.chunks - 1) {
      copy_tile<Vec>(a, row_at, col_chunk0, ::min(a.chunk, a.K - col_chunk0), n, tile, Kp);
      __syncthreads();
    }
    if (wc < a.latent) {  // (uniform over the warp; no barrier inside)
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float al = alphas[r];
#pragma unroll
        for (int j = 0; j < NC; ++j) o[r][j] *= al;
      }
      const bool mine = c < a.latent;  // with NC = 2, c + 1 is then inside the row too (c even, rows whole float4s)
      const S* col = tile + (c - col_chunk0);
      for (int t = 0; t < n; ++t) {
        float v[NC];
        if constexpr (NC == 2) {
          const float2 v2 = mine ? load2(col + t * Kp) : make_float2(0.0f, 0.0f);
          v[0] = v2.x;
          v[1] = v2.y;
        } else {
          v[0] = mine ? impl::to_float(col[t * Kp]) : 0.0f;
        }
        const float4* pt = reinterpret_cast<const float4*>(ps + t * kRows);
#pragma unroll
        for (int g = 0; g < kRows / 4; ++g) {
          const float4 p4 = pt[g];
#pragma unroll
          for (int j = 0; j < NC; ++j) {
            o[4 * g + 0][j] = fmaf(p4.x, v[j], o[4 * g + 0][j]);
            o[4 * g + 1][j] = fmaf(p4.y, v[j], o[4 * g + 1][j]);
            o[4 * g + 2][j] = fmaf(p4.z, v[j], o[4 * g + 2][j]);
            o[4 * g + 3][j] = fmaf(p4.w, v[j], o[4 * g + 3][j]);
          }
        }
      }
    }
    __syncthreads();  // before the next tile replaces row_at, the tile, P and alpha
  }

  // The item's rows: normalized partial state, or the final result (the sink counted) when it is
  // the sequence's only item.
  const bool direct = it.partial < 0;
  if (wc < a.latent) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int gr = row0 + r;
      if (gr >= a.rows) break;
      SoftmaxStats st{ms[r], ds[r]};
      float factor = st.d > 0.0f ? 1.0f / st.d : 0.0f;  // d = 0: o is 0 as well
      if (direct) factor *= sink_factor(policy, st, gr % a.heads);
      float* dst = direct ? a.out + (std::int64_t{seq} * a.rows + gr) * a.latent
                          : a.part_o + (it.partial + gr) * std::int64_t{a.latent};
#pragma unroll
      for (int j = 0; j < NC; ++j)
        if (c + j < a.latent) dst[c + j] = o[r][j] * factor;
    }
  }
  if (blockIdx.z == 0 && tid < kRows && row0 + tid < a.rows) {
    const int gr = row0 + tid;
    SoftmaxStats st{ms[tid], ds[tid]};
    if (!direct) {
      a.part_md[2 * (it.partial + gr)] = st.m;
      a.part_md[2 * (it.partial + gr) + 1] = st.d;
    } else if (a.lse != nullptr) {
      sink_factor(policy, st, gr % a.heads);
      a.lse[std::int64_t{seq} * a.rows + gr] = st.lse();
    }
  }
}

/// One block per (sequence, row) of the batch, flattened: merges the items' partial states of a
/// sequence split into several items, in order (merge_weights, as merge_state), adds the sink,
/// and writes out and lse. A sequence of one item was written by the main kernel.
template <class P>
__global__ void __launch_bounds__(kMergeThreads) mla_merge_kernel(const DecodePlan::Item* __restrict__ items,
                                                                  const std::int64_t* __restrict__ first_item, int rows, int heads,
                                                                  int latent, const float* __restrict__ part_o,
                                                                  const float* __restrict__ part_md, float* __restrict__ out,
                                                                  float* __restrict__ lse, const P policy) {
  const std::int64_t br = blockIdx.x;
  const std::int64_t b = br / rows;
  const int r = static_cast<int>(br - b * rows);
  const std::int64_t first = first_item[b], last = first_item[b + 1];
  if (last - first <= 1) return;  // the main kernel wrote this sequence's rows
  SoftmaxStats st;
  for (int c = threadIdx.x; c < latent; c += blockDim.x) {
    float o = 0.0f;
    st = SoftmaxStats{};
    for (std::int64_t i = first; i < last; ++i) {
      const std::int64_t row = items[i].partial + r;
      merge_into(o, st, part_o[row * latent + c], SoftmaxStats{part_md[2 * row], part_md[2 * row + 1]});
    }
    out[br * latent + c] = o * sink_factor(policy, st, r % heads);
  }
  // Thread 0 has merged column 0 (latent >= 1): its state is the row's, the sink counted.
  if (threadIdx.x == 0 && lse != nullptr) lse[br] = st.lse();
}

template <class E, int NC, bool Vec, class P>
void launch_main(const Args<E>& a, const P& policy, dim3 grid, const Geometry& geometry, int device, int shared_optin,
                 cudaStream_t stream) {
  auto* kernel = &mla_decode_kernel<E, NC, Vec, P>;
  if (geometry.shared > kDefaultShared) {
    // The opt-in is a property of the kernel on a device, kept by the runtime: set once (per
    // kernel and device), so that later calls (those captured into a graph among them) only launch.
    constexpr int kDevices = 64;
    static std::atomic<int> opted_in[kDevices];  // bytes set, per device (zero-initialized: static)
    if (device < 0 || device >= kDevices || opted_in[device].load(std::memory_order_acquire) < shared_optin) {
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_optin),
            "cudaFuncSetAttribute (mla_decode shared memory)");
      if (device >= 0 && device < kDevices) opted_in[device].store(shared_optin, std::memory_order_release);
    }
  }
  kernel<<<grid, kThreads, geometry.shared, stream>>>(a, policy);
}

}  // namespace mla_impl

/// MLA decode attention in latent space for a batch, on `stream`: see the top of this file and
/// kvattn/mla_decode.hpp. `kv` is one layer's view of an MLA device cache from the step's plan
/// (plan.view(cache, layer)); `plan` was made with the MlaShape (DecodePlan::make); q, out, lse
/// are device arrays; `policy` adds a variant (policy.hpp), its arrays in device memory
/// (PolicyArrays). Throws kvattn::shape_error, invalid_argument or capacity_error on
/// inconsistent arguments (for the MLA formats, also a pool or rows not on 4 bytes) before any
/// launch, cuda_error when the runtime reports one. Returns without waiting for the kernels; no
/// allocation, no copy, no synchronization.
template <class T, class P = Plain>
void mla_decode(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, cudaStream_t stream = nullptr,
                const P& policy = P{}) {
  constexpr const char* op = "cuda::mla_decode";
  const MlaShape& shape = plan.check_call<MlaShape>(op, kv, policy, q, out);
  if (kv.batch == 0) return;

  using E = typename impl::device_type<T>::type;
  constexpr bool kCodes = mla_impl::is_code_v<E>;
  static_assert(mla_impl::staged_bytes<T>() == sizeof(mla_impl::staged_t<E>), "the plan sizes the tiles the kernel stages");
  static_assert(!kCodes || format_traits<T>::latent_block == mla_impl::kLatentBlock, "the MLA formats' blocks of 128");
  static_assert(kCodes || (format_traits<T>::latent_block == 0 && !format_traits<T>::row_scale && !format_traits<T>::layer_scale &&
                           !format_traits<T>::block_scale),
                "kvattn::cuda::mla_decode: MLA caches are fp32, fp16, bf16, fp8_e4m3_latent or int8_latent");
  const int Q = plan.params().queries_per_seq, rows = Q * shape.heads, latent = shape.latent_dim, K = shape.latent_dim + shape.rope_dim;
  const auto pool_at = reinterpret_cast<std::uintptr_t>(kv.pool);
  if constexpr (kCodes) {
    // Codes are read 4 or 16 bytes at a time, scales as fp32 and the rotary key in bf16 pairs: a
    // layer's pool and rows on 4 bytes (the cache's always are: rows of 4-byte multiples, pages of
    // 64-byte multiples from a 256-byte aligned allocation).
    if (pool_at % 4 != 0 || kv.layout.row_stride % 4 != 0 || kv.layout.page_stride % 4 != 0 || kv.layout.rope_offset % 4 != 0)
      raise<invalid_argument>(kvattn::detail::concat(op, ": the ", format_traits<T>::name, " pool at ", static_cast<const void*>(kv.pool),
                                                     " with row_stride=", kv.layout.row_stride, " page_stride=", kv.layout.page_stride,
                                                     " rope_offset=", kv.layout.rope_offset,
                                                     " bytes: the pool, its rows and its rotary keys must start on 4 bytes"));
    if (kv.layout.latent_block != mla_impl::kLatentBlock)
      raise<invalid_argument>(kvattn::detail::concat(op, ": the ", format_traits<T>::name, " view's layout has latent_block=",
                                                     kv.layout.latent_block, ", not the format's ", mla_impl::kLatentBlock,
                                                     " (take the layout from the cache: PageLayout::of)"));
  }
  const mla_impl::Geometry geometry = mla_impl::choose_geometry(op, K, latent, mla_impl::staged_bytes<T>(), plan.shared_optin());
  const int row_blocks = (rows + mla_impl::kRows - 1) / mla_impl::kRows;
  const int col_blocks = mla_impl::column_blocks(latent, geometry.nc);
  const DecodePlan::DeviceArrays& dev = plan.device_arrays();

  mla_impl::Args<E> a;
  a.pool = reinterpret_cast<const E*>(kv.pool);
  a.page_stride = kv.layout.page_stride;
  a.page_size = kv.layout.page_size;
  a.row_stride = kv.layout.row_stride;
  a.rope_offset = kv.layout.rope_offset;
  a.indptr = kv.indptr;
  a.indices = kv.indices;
  a.last_page_len = kv.last_page_len;
  a.items = dev.items;
  a.q = q;
  a.scale = plan.scale();
  a.heads = shape.heads;
  a.Q = Q;
  a.rows = rows;
  a.latent = latent;
  a.K = K;
  a.chunk = geometry.chunk;
  a.chunks = geometry.chunks;
  a.Kp = geometry.Kp;
  a.part_o = dev.partial_o;
  a.part_md = dev.partial_md;
  a.out = out;
  a.lse = lse;

  // 16-byte copies when every row (and every chunk: whole multiples of 256 columns) starts on 16
  // bytes; for the MLA formats, when every row does (their codes then come 16 to a load, the
  // rest as in the 4-byte copy).
  const bool vec = (kCodes || (static_cast<std::size_t>(K) * sizeof(E)) % 16 == 0) &&
                   (static_cast<std::size_t>(kv.layout.row_stride) * sizeof(E)) % 16 == 0 &&
                   (static_cast<std::size_t>(kv.layout.page_stride) * sizeof(E)) % 16 == 0 && pool_at % 16 == 0;
  const dim3 grid(static_cast<unsigned>(plan.item_count()), static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_blocks));
  const int device = plan.device(), optin = plan.shared_optin();
  if (geometry.nc == 2) {
    if (vec)
      mla_impl::launch_main<E, 2, true>(a, policy, grid, geometry, device, optin, stream);
    else
      mla_impl::launch_main<E, 2, false>(a, policy, grid, geometry, device, optin, stream);
  } else {
    if (vec)
      mla_impl::launch_main<E, 1, true>(a, policy, grid, geometry, device, optin, stream);
    else
      mla_impl::launch_main<E, 1, false>(a, policy, grid, geometry, device, optin, stream);
  }
  check(cudaGetLastError(), "cuda::mla_decode launch");
  if (plan.split_rows() > 0) {
    const int threads = std::min(mla_impl::kMergeThreads, (latent + 31) / 32 * 32);
    mla_impl::mla_merge_kernel<P><<<static_cast<unsigned>(std::int64_t{kv.batch} * rows), threads, 0, stream>>>(
        dev.items, dev.first_item, rows, shape.heads, latent, dev.partial_o, dev.partial_md, out, lse, policy);
    check(cudaGetLastError(), "cuda::mla_decode merge launch");
  }
}

}  // namespace kvattn::cuda
