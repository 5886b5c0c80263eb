// kvattn/cuda/mla_decode.hpp — MLA decode attention on the GPU, straight against the cached latents
// (the folded path: kvattn/mla_decode.hpp has the equations, shapes and semantics, which are the
// same here; every pointer but the workspace's is a device pointer).
//
//   q    [batch][Q][heads][latent_dim + rope_dim]  fp32, the absorbed queries
//   out  [batch][Q][heads][latent_dim]             fp32, attention in latent space
//   lse  [batch][Q][heads]                         fp32, natural log, -inf for a row that sees no key; optional
//
// Query i of sequence b sits at position L_b − Q + i and sees the positions at or before it; a
// row that sees nothing gets zeros and lse = -inf.
//
// Work. The batch is split on the host (DecodeWorkspace::plan, as on the CPU) into items: a
// sequence and a range [begin, end) of its positions, long sequences in several chunks so that
// the grid fills the device. The rows of a sequence, r = i · heads + h (its Q · heads queries, in
// the order of q and out), are cut into blocks of kRows = 16. The main kernel runs one thread
// block of 256 threads (8 warps) per (item, row block, column block); all its rows share every
// tile of the latent cache, which is read from the pages once per block:
//   - Tiles of kTile = 32 tokens. The tile's rows [latent | rope] are copied from their pages into
//     shared memory in the storage type (16-byte loads when every row starts on 16 bytes, i.e.
//     (latent_dim + rope_dim) · sizeof(T) % 16 == 0 and the pool is 16-byte aligned; element by
//     element otherwise). The queries of the row block sit in shared memory in fp32, scaled.
//   - Scores S = Q̃ · Cᵀ (16 rows × 32 tokens): each thread computes a 4 × 4 block of them over
//     one eighth of the inner dimension (warp w takes the float4 columns ≡ w mod 8; lane l the
//     rows 4·(l / 8) + a and the tokens l % 8 + 8·u), and the eight partial sums meet in shared
//     memory. Shared rows are padded to an odd number of float4s so that these reads are free
//     of bank conflicts.
//   - Online softmax: warp w owns rows 2w and 2w + 1, a lane per token; the running {m, d} of
//     every row and this tile's rescale factor live in shared memory; the probabilities are
//     written to shared memory as P [32 tokens][16 rows].
//   - O = alpha · O + P · C over the latent columns: warp w owns 32 · NC columns of the block's
//     column block (NC = 1 or 2, so 256 or 512 columns per block: one column block up to
//     latent_dim = 512), for all 16 rows, in registers (16 · NC accumulators per thread).
//   - The shared memory of one block, with Kp the padded row width:
//       queries [16][Kp] fp32 | tile [32][Kp] T | partial scores [8][16][32] fp32 |
//       P [32][16] fp32 | m, d, alpha [16] fp32 | tile row offsets [32] int64
//     (DeepSeek-V2's 512 + 64: 93 KB in bf16, two blocks per SM on an H100, one on an A100;
//     130 KB in fp32). When the rows are too wide for the device's shared memory, the inner
//     dimension is processed in chunks of 1024, 512 or 256 columns (the queries are then
//     reloaded chunk by chunk, and the chunk that holds the block's latent columns is reloaded
//     for O += P · C): any width works.
// Each block writes, for its rows and columns, the item's normalized partial state {o, m, d}
// (state.hpp) to the workspace, or, when the item is its sequence's only one, the final out and
// lse directly.
//
// Merge. A second kernel, launched when some sequence was split into several items, one block
// per (sequence, row) (those of unsplit sequences return at once), merges the items' partial
// states in order exactly as merge_state (state.hpp) does: an empty
// part (d = 0) is skipped, so empty states never produce NaN, and a row with no key at all
// ends with out = 0 and lse = -inf.
//
// Every __syncthreads() sits in control flow that is uniform over the block (loops over tiles
// and chunks of an item); the warp shuffles of the softmax run with all 32 lanes.
//
// The launcher checks every argument first (kvattn::shape_error / invalid_argument, with the
// values in the message) and throws before any device work; then it plans on the host (from the
// host copy of the page table in DevicePageTable), uploads the items, and launches on `stream`
// without waiting for it (it only waits, if need be, for the previous call's uploads from the
// same workspace, whose host plan it is about to rewrite). The kernels never allocate or fail on
// valid input. Keep one workspace per stream; it only grows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "../decode.hpp"
#include "../error.hpp"
#include "../mla_decode.hpp"
#include "../paged_cache.hpp"
#include "../shape.hpp"
#include "../state.hpp"
#include "runtime.hpp"

namespace kvattn::cuda {

namespace impl {
/// A CUDA event, created on first use (constructing one touches no device).
class Event {
 public:
  Event() = default;
  ~Event() {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  /// Marks the work queued on `stream` so far.
  void record(cudaStream_t stream) {
    if (e_ == nullptr) check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventRecord(e_, stream), "cudaEventRecord");
  }
  /// Waits for the work marked last (nothing if none was).
  void wait() const {
    if (e_ != nullptr) check(cudaEventSynchronize(e_), "cudaEventSynchronize");
  }

 private:
  cudaEvent_t e_ = nullptr;
};
}  // namespace impl

/// Scratch memory of cuda::mla_decode(): the plan on the host, its items and the partial results
/// on the device. Keep one per stream and reuse it across steps; it only grows. The fields belong
/// to mla_decode().
struct MlaDecodeWorkspace {
  /// Host plan: items (sequence, positions [begin, end), and in `partial` the item's first row in
  /// the partial buffers, or -1 when the item is its sequence's only one) and first_item [batch + 1].
  kvattn::DecodeWorkspace plan;
  DeviceBuffer<kvattn::DecodeWorkspace::Item> items;  ///< [items]
  DeviceBuffer<std::int64_t> first_item;              ///< [batch + 1]
  /// o [split rows][latent_dim], then {m, d} [split rows][2]: the rows of the items of sequences
  /// split into several items.
  DeviceBuffer<float> partial;
  impl::Event uploaded;  ///< the uploads of the last call (the host plan is kept until they are done)
  int device = -1;       ///< the device the next fields describe
  int multiprocessors = 0;
  int shared_optin = 0;  ///< bytes of shared memory one block may use

  std::size_t device_bytes() const noexcept {
    return items.capacity() * sizeof(kvattn::DecodeWorkspace::Item) + first_item.capacity() * sizeof(std::int64_t) +
           partial.capacity() * sizeof(float);
  }
};

namespace mla_impl {

inline constexpr int kThreads = 256;  ///< threads of a main-kernel block
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kRows = 16;   ///< query rows of a block
inline constexpr int kTile = 32;   ///< tokens of a tile: a lane per token in the softmax
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
/// the top of this file).
__host__ __device__ constexpr std::size_t shared_bytes(int Kp, std::size_t elem) {
  return std::size_t{kRows} * Kp * sizeof(float) + std::size_t{kTile} * Kp * elem +
         std::size_t{kWarps} * kRows * kTile * sizeof(float) + std::size_t{kTile} * kRows * sizeof(float) +
         3 * std::size_t{kRows} * sizeof(float) + std::size_t{kTile} * sizeof(std::int64_t);
}

/// What the main kernel reads and writes; every pointer is a device pointer.
template <class D> struct Args {
  const D* pool;                 ///< the layer: [num_pages][page_stride]
  std::int64_t page_stride;      ///< elements from one page to the next
  int page_size;                 ///< tokens per page
  std::int64_t row_stride;       ///< elements from one token's row to the next (>= K)
  const std::int32_t* indptr;    ///< [batch + 1]
  const std::int32_t* indices;   ///< [indptr[batch]]
  const std::int32_t* last_page_len;  ///< [batch]
  const kvattn::DecodeWorkspace::Item* items;  ///< [items]
  const float* q;                ///< [batch][rows][K]
  float scale;
  int heads, Q, rows;            ///< rows = Q · heads per sequence
  int latent, K;                 ///< latent_dim, latent_dim + rope_dim (a token's row in the page)
  int chunk;                     ///< columns of the inner dimension per chunk (K: one chunk)
  int chunks;                    ///< ceil(K / chunk)
  int Kp;                        ///< elements of a shared row: shared_row(chunk)
  float* part_o;                 ///< [split rows][latent]
  float* part_md;                ///< [split rows][2]
  float* out;                    ///< [batch][rows][latent]
  float* lse;                    ///< [batch][rows] or null
};

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
template <bool Vec, class D>
__device__ __forceinline__ void load_tile(const D* __restrict__ pool, const std::int64_t* row, int c0, int width, int n,
                                          D* tile, int Kp) {
  if constexpr (Vec) {
    constexpr int E = 16 / static_cast<int>(sizeof(D));
    const int units = width / E;
    for (int i = threadIdx.x; i < n * units; i += kThreads) {
      const int t = i / units, u = i - t * units;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(pool + row[t] + c0 + u * E));
      D* dst = tile + t * Kp + u * E;
      if constexpr (sizeof(D) == 4) {
        *reinterpret_cast<uint4*>(dst) = v;
      } else {  // 16-bit rows are 8-byte aligned in shared memory
        reinterpret_cast<uint2*>(dst)[0] = make_uint2(v.x, v.y);
        reinterpret_cast<uint2*>(dst)[1] = make_uint2(v.z, v.w);
      }
    }
  } else {
    const int w4 = (width + 3) / 4 * 4;
    const D zero = impl::from_float<D>(0.0f);
    for (int i = threadIdx.x; i < n * w4; i += kThreads) {
      const int t = i / w4, k = i - t * w4;
      tile[t * Kp + k] = k < width ? pool[row[t] + c0 + k] : zero;
    }
  }
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
/// blockIdx.z (kWarps · 32 · NC of them). Vec: tiles are copied in 16-byte units.
template <class D, int NC, bool Vec>
__global__ void __launch_bounds__(kThreads, 2) mla_decode_kernel(const Args<D> a) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kCols = kWarps * 32 * NC;  // columns of a column block
  extern __shared__ float4 shared_f4[];
  const int Kp = a.Kp;
  float* qs = reinterpret_cast<float*>(shared_f4);                      // [kRows][Kp]
  D* tile = reinterpret_cast<D*>(qs + kRows * Kp);                      // [kTile][Kp]
  float* red = reinterpret_cast<float*>(tile + kTile * Kp);             // [kWarps][kRows][kTile]
  float* ps = red + kWarps * kRows * kTile;                             // [kTile][kRows]
  float* ms = ps + kTile * kRows;                                       // [kRows]
  float* ds = ms + kRows;                                               // [kRows]
  float* alphas = ds + kRows;                                           // [kRows]
  std::int64_t* row_at = reinterpret_cast<std::int64_t*>(alphas + kRows);  // [kTile]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const kvattn::DecodeWorkspace::Item it = a.items[blockIdx.x];
  const int seq = it.seq;
  const int row0 = static_cast<int>(blockIdx.y) * kRows;
  const int col0 = static_cast<int>(blockIdx.z) * kCols;
  const std::int32_t* pages = a.indices + a.indptr[seq];
  const std::int32_t n_pages = a.indptr[seq + 1] - a.indptr[seq];
  const std::int64_t length = n_pages == 0 ? 0 : std::int64_t{n_pages - 1} * a.page_size + a.last_page_len[seq];
  const float* q_seq = a.q + std::int64_t{seq} * a.rows * a.K;
  const bool resident = a.chunks == 1;      // queries and tiles whole: loaded once per tile
  const int col_chunk = col0 / a.chunk;     // the chunk holding this block's columns
  const int col_chunk0 = col_chunk * a.chunk;

  for (int i = tid; i < kTile * Kp; i += kThreads) tile[i] = impl::from_float<D>(0.0f);
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
      load_tile<Vec>(a.pool, row_at, c0, width, n, tile, Kp);
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

    // 2. Online softmax: warp w, rows 2w and 2w + 1, lane = token.
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = 2 * warp + rr, gr = row0 + r;
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[(w * kRows + r) * kTile + lane];
      // The row's query position (none for rows past the sequence's): it sees t0 + lane <= last.
      const std::int64_t last = gr < a.rows ? length - a.Q + gr / a.heads : -1;
      s = lane < n && t0 + lane <= last ? s : kNegInf;
      const float m_old = ms[r];
      const float m_new = fmaxf(m_old, warp_max(s));
      float p = 0.0f, alpha = 1.0f;  // nothing seen yet: no probability, nothing to rescale
      if (m_new != kNegInf) {
        p = expf(s - m_new);          // exp(-inf) = 0
        alpha = expf(m_old - m_new);  // 0 when m_old = -inf (and then d = 0)
      }
      const float sum = warp_sum(p);
      ps[lane * kRows + r] = p;
      __syncwarp();
      if (lane == 0) {
        ms[r] = m_new;
        ds[r] = ds[r] * alpha + sum;
        alphas[r] = alpha;
      }
    }
    __syncthreads();

    // 3. O = alpha · O + P · C over this block's latent columns (from its chunk's tile).
    if (a.chunks > 1 && col_chunk != a.chunks - 1) {
      load_tile<Vec>(a.pool, row_at, col_chunk0, ::min(a.chunk, a.K - col_chunk0), n, tile, Kp);
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
      const D* col = tile + (c - col_chunk0);
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

  // The item's rows: normalized partial state, or the final result when it is the sequence's only item.
  const bool direct = it.partial < 0;
  if (wc < a.latent) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int gr = row0 + r;
      if (gr >= a.rows) break;
      const float d = ds[r];
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;  // d = 0: o is 0 as well
      float* dst = direct ? a.out + (std::int64_t{seq} * a.rows + gr) * a.latent
                          : a.part_o + (it.partial + gr) * std::int64_t{a.latent};
#pragma unroll
      for (int j = 0; j < NC; ++j)
        if (c + j < a.latent) dst[c + j] = o[r][j] * inv;
    }
  }
  if (blockIdx.z == 0 && tid < kRows && row0 + tid < a.rows) {
    const int gr = row0 + tid;
    const float m = ms[tid], d = ds[tid];
    if (!direct) {
      a.part_md[2 * (it.partial + gr)] = m;
      a.part_md[2 * (it.partial + gr) + 1] = d;
    } else if (a.lse != nullptr) {
      a.lse[std::int64_t{seq} * a.rows + gr] = d > 0.0f ? m + logf(d) : kNegInf;
    }
  }
}

/// One block per (sequence, row) of a sequence split into several items: merges the items'
/// partial states in order, as merge_state (state.hpp), into out and lse.
__global__ void __launch_bounds__(kMergeThreads) mla_merge_kernel(const kvattn::DecodeWorkspace::Item* __restrict__ items,
                                                                  const std::int64_t* __restrict__ first_item, int rows,
                                                                  int latent, const float* __restrict__ part_o,
                                                                  const float* __restrict__ part_md, float* __restrict__ out,
                                                                  float* __restrict__ lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const std::int64_t br = blockIdx.x;
  const std::int64_t b = br / rows;
  const int r = static_cast<int>(br - b * rows);
  const std::int64_t first = first_item[b], last = first_item[b + 1];
  if (last - first <= 1) return;  // the main kernel wrote this sequence's rows
  float m = kNegInf, d = 0.0f;
  for (int c = threadIdx.x; c < latent; c += blockDim.x) {
    float o = 0.0f;
    m = kNegInf;
    d = 0.0f;
    for (std::int64_t i = first; i < last; ++i) {
      const std::int64_t row = items[i].partial + r;
      const float m2 = part_md[2 * row], d2 = part_md[2 * row + 1];
      if (d2 == 0.0f) continue;  // an empty part changes nothing
      const float v = part_o[row * latent + c];
      if (d == 0.0f) {
        o = v;
        m = m2;
        d = d2;
        continue;
      }
      const float mm = fmaxf(m, m2);
      const float w1 = d * expf(m - mm), w2 = d2 * expf(m2 - mm);
      const float dd = w1 + w2;
      o = (w1 / dd) * o + (w2 / dd) * v;
      m = mm;
      d = dd;
    }
    out[br * latent + c] = o;
  }
  // Thread 0 has merged column 0 (latent >= 1): its {m, d} are the row's.
  if (threadIdx.x == 0 && lse != nullptr) lse[br] = d > 0.0f ? m + logf(d) : kNegInf;
}

/// Launch geometry of one call.
struct Plan {
  int chunk = 0, chunks = 1, Kp = 0;
  int nc = 1;  ///< columns per lane in O += P · C
  std::size_t shared = 0;
};

/// The widest chunk of the inner dimension whose block fits in `shared_optin` bytes: all of K
/// when it fits, else 1024, 512 or 256 columns (multiples of every column block).
inline Plan choose_plan(int K, int latent, std::size_t elem, int shared_optin) {
  Plan p;
  const auto fits = [&](int width) { return shared_bytes(shared_row(width), elem) <= static_cast<std::size_t>(shared_optin); };
  if (fits(K)) {
    p.chunk = K;
  } else {
    for (int w : {1024, 512, 256})
      if (w < K && fits(w)) {
        p.chunk = w;
        break;
      }
    if (p.chunk == 0)
      raise<capacity_error>(kvattn::detail::concat("cuda::mla_decode: latent_dim + rope_dim=", K, " needs ",
                                                   shared_bytes(shared_row(256), elem),
                                                   " bytes of shared memory per block; the device allows ", shared_optin));
  }
  p.chunks = (K + p.chunk - 1) / p.chunk;
  p.Kp = shared_row(p.chunk);
  p.shared = shared_bytes(p.Kp, elem);
  // 512 columns per block (two per lane) for wide latents, when a chunk holds whole column blocks.
  p.nc = latent > 256 && (p.chunks == 1 || p.chunk % 512 == 0) ? 2 : 1;
  return p;
}

template <class D, int NC, bool Vec>
void launch_main(const Args<D>& a, dim3 grid, const Plan& plan, int shared_optin, cudaStream_t stream) {
  auto* kernel = &mla_decode_kernel<D, NC, Vec>;
  if (plan.shared > kDefaultShared)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_optin),
          "cudaFuncSetAttribute (mla_decode shared memory)");
  kernel<<<grid, kThreads, plan.shared, stream>>>(a);
}

}  // namespace mla_impl

/// MLA decode attention in latent space for a batch, on `stream`: see the top of this file and
/// kvattn/mla_decode.hpp. `kv` is one layer's view of an MLA cache with device pointers
/// (DevicePageTable::view); `table` is the table it reads (its host copy is planned from);
/// `shape` must match the cache's latent and rotary widths; q, out, lse are device arrays.
/// Throws kvattn::shape_error or invalid_argument on inconsistent arguments before any device
/// work, cuda_error when the runtime reports one. Returns without waiting for the kernels.
template <class T>
void mla_decode(const PagedKvView<T>& kv, const DevicePageTable& table, const MlaShape& shape, const float* q, float* out,
                float* lse, const MlaDecodeParams& p, MlaDecodeWorkspace& ws, cudaStream_t stream = nullptr) {
  using kvattn::detail::concat;
  shape.validate();
  if (kv.layout.content != PageContent::mla || kv.layout.latent_dim != shape.latent_dim ||
      kv.layout.rope_dim != shape.rope_dim)
    raise<shape_error>(concat("cuda::mla_decode: shape latent_dim=", shape.latent_dim, " rope_dim=", shape.rope_dim,
                              " does not match the cache's ", kv.layout.content == PageContent::mla ? "" : "(GQA-family) ",
                              "latent_dim=", kv.layout.latent_dim, " rope_dim=", kv.layout.rope_dim));
  if (!(std::isfinite(p.scale) && p.scale >= 0.0f))
    raise<invalid_argument>(concat("cuda::mla_decode: scale=", p.scale, ": must be finite and >= 0 (0: 1/sqrt(nope_dim + rope_dim))"));
  if (p.queries_per_seq < 1 || p.chunk_tokens < 0)
    raise<invalid_argument>(concat("cuda::mla_decode: queries_per_seq=", p.queries_per_seq, " chunk_tokens=", p.chunk_tokens,
                                   ": queries_per_seq must be positive, chunk_tokens >= 0"));
  if (kv.batch > 0 && (q == nullptr || out == nullptr)) raise<invalid_argument>("cuda::mla_decode: q and out must not be null");
  if (!table.describes(kv))
    raise<invalid_argument>(concat("cuda::mla_decode: the view (batch=", kv.batch, ") does not read this page table's (batch=",
                                   table.batch(), ") device arrays: build it with DevicePageTable::view"));
  const std::int64_t rows64 = std::int64_t{p.queries_per_seq} * shape.heads;
  const std::int64_t row_blocks = (rows64 + mla_impl::kRows - 1) / mla_impl::kRows;
  if (row_blocks > 65535)
    raise<invalid_argument>(concat("cuda::mla_decode: queries_per_seq=", p.queries_per_seq, " heads=", shape.heads,
                                   ": more than ", 65535 * mla_impl::kRows, " query rows per sequence"));
  if (kv.batch == 0) return;

  using D = typename impl::device_type<T>::type;
  const int rows = static_cast<int>(rows64), latent = shape.latent_dim, K = shape.latent_dim + shape.rope_dim;
  const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(shape.qk_head_dim()));

  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  if (device != ws.device) {
    ws.multiprocessors = multiprocessors();
    check(cudaDeviceGetAttribute(&ws.shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute (shared memory per block)");
    ws.device = device;
  }
  const mla_impl::Plan plan = mla_impl::choose_plan(K, latent, sizeof(D), ws.shared_optin);
  const int cols = mla_impl::kWarps * 32 * plan.nc;
  const int col_blocks = (latent + cols - 1) / cols;

  // Items: enough for about two blocks per multiprocessor, in whole tiles, at least 8 of them.
  const std::int64_t blocks_per_item = row_blocks * col_blocks;
  const std::int64_t want = std::max<std::int64_t>(1, (2 * std::int64_t{ws.multiprocessors} + blocks_per_item - 1) / blocks_per_item);
  ws.uploaded.wait();  // the previous call's uploads read the host plan
  ws.plan.plan_items(table.host_view(kv), p.chunk_tokens, want, mla_impl::kTile, 8 * mla_impl::kTile, 0);
  std::int64_t split_rows = 0;
  for (int b = 0; b < kv.batch; ++b) {
    const std::int64_t first = ws.plan.first_item[static_cast<std::size_t>(b)];
    const std::int64_t last = ws.plan.first_item[static_cast<std::size_t>(b) + 1];
    for (std::int64_t i = first; i < last; ++i) {
      ws.plan.items[static_cast<std::size_t>(i)].partial = last - first == 1 ? -1 : split_rows;
      if (last - first > 1) split_rows += rows;
    }
  }
  const std::size_t n_items = ws.plan.items.size();
  const kvattn::DecodeWorkspace::Item* items = ws.items.upload(ws.plan.items.data(), n_items, stream);
  const std::int64_t* first_item = ws.first_item.upload(ws.plan.first_item.data(), ws.plan.first_item.size(), stream);
  ws.uploaded.record(stream);
  float* part_o = ws.partial.reserve(static_cast<std::size_t>(split_rows) * (static_cast<std::size_t>(latent) + 2));
  float* part_md = part_o + split_rows * latent;

  mla_impl::Args<D> a;
  a.pool = reinterpret_cast<const D*>(kv.pool);
  a.page_stride = kv.layout.page_stride;
  a.page_size = kv.layout.page_size;
  a.row_stride = kv.layout.row_stride;
  a.indptr = kv.indptr;
  a.indices = kv.indices;
  a.last_page_len = kv.last_page_len;
  a.items = items;
  a.q = q;
  a.scale = scale;
  a.heads = shape.heads;
  a.Q = p.queries_per_seq;
  a.rows = rows;
  a.latent = latent;
  a.K = K;
  a.chunk = plan.chunk;
  a.chunks = plan.chunks;
  a.Kp = plan.Kp;
  a.part_o = part_o;
  a.part_md = part_md;
  a.out = out;
  a.lse = lse;

  // 16-byte copies when every row (and every chunk: whole multiples of 256 columns) starts on 16 bytes.
  const bool vec = (static_cast<std::size_t>(K) * sizeof(D)) % 16 == 0 &&
                   (static_cast<std::size_t>(kv.layout.row_stride) * sizeof(D)) % 16 == 0 &&
                   (static_cast<std::size_t>(kv.layout.page_stride) * sizeof(D)) % 16 == 0 &&
                   reinterpret_cast<std::uintptr_t>(kv.pool) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(n_items), static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_blocks));
  if (plan.nc == 2) {
    if (vec)
      mla_impl::launch_main<D, 2, true>(a, grid, plan, ws.shared_optin, stream);
    else
      mla_impl::launch_main<D, 2, false>(a, grid, plan, ws.shared_optin, stream);
  } else {
    if (vec)
      mla_impl::launch_main<D, 1, true>(a, grid, plan, ws.shared_optin, stream);
    else
      mla_impl::launch_main<D, 1, false>(a, grid, plan, ws.shared_optin, stream);
  }
  check(cudaGetLastError(), "mla_decode launch");
  if (split_rows > 0) {
    const int threads = std::min(mla_impl::kMergeThreads, (latent + 31) / 32 * 32);
    mla_impl::mla_merge_kernel<<<static_cast<unsigned>(std::int64_t{kv.batch} * rows), threads, 0, stream>>>(
        items, first_item, rows, latent, part_o, part_md, out, lse);
    check(cudaGetLastError(), "mla_decode merge launch");
  }
}

}  // namespace kvattn::cuda
