// kvattn/cuda/append.hpp — writing new tokens into a device cache's pages.
//
//   write_kv:     GQA family, k and v [count][kv_heads][head_dim] (device, fp32 / fp16 / bf16),
//                 converted to the cache's element type (fp32, fp16, bf16: round to nearest even)
//                 or quantized (int8_row, fp8_e4m3_row: a scale per row; fp8_e4m3_layer: the
//                 layer's scales, cache.scales(layer))
//   write_latent: MLA, latent [count][latent_dim] and rope [count][rope_dim] (device), converted
//                 (fp32, fp16, bf16) or quantized (fp8_e4m3_latent, int8_latent: a scale per block
//                 of 128 latent values, the rotary key rounded to bf16)
// for tokens [first, first + count) of one sequence in one layer, after PagedKvCache::append has
// reserved them (or over tokens already written). The stored bits equal the host writes'
// (PagedKvCache::write, write_latent; format.hpp's definitions, the same float operations):
//   - fp32, fp16, bf16 and the rotary key of the MLA formats: for every input but NaN (the
//     device writes its canonical NaN);
//   - the codes and scales of int8_row, fp8_e4m3_row, fp8_e4m3_latent and int8_latent: for every
//     input (a row or block holding NaN or an infinity: scale NaN, the host's quiet NaN, codes 0);
//   - fp8_e4m3_layer: for every finite input. The host refuses a NaN or an infinity; a kernel
//     cannot refuse, so the device writes ±448 · s (code 0x7E with the sign) for ±infinity and
//     code 0 for NaN, the rest of the row as usual, and counts each such value in the workspace
//     (AppendWorkspace::take_non_finite).
// Subnormal inputs and results are exact as nvcc compiles by default (no flush-to-zero).
// As the host writes: every check first, then the copy-on-write of any shared page in the range
// (PagedKvCache::make_writable, on the device), then the kernels on `stream`. A request that
// fails throws before anything changes. The kernels find each token's page through the
// sequence's page ids of the range, uploaded with the launch (AppendWorkspace: reuse one per
// stream). The 8-bit formats take one warp per row (a latent block): its max |x| and finiteness
// reduced across the warp, then its codes and scale written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "runtime.hpp"

namespace kvattn::cuda {

/// Scratch memory of the append launchers: the page ids of the range being written.
struct AppendWorkspace {
  std::vector<std::int32_t> host_pages;
  DeviceBuffer<std::int32_t> pages;
  /// [1] fp8_e4m3_layer: the NaNs and infinities the writes through this workspace met since the
  /// last take_non_finite (made, zeroed, by the first such write).
  DeviceBuffer<unsigned long long> non_finite;

  /// fp8_e4m3_layer: how many NaNs and infinities the writes on `stream` through this workspace
  /// met since the last call (each stored as the top of this file says), and 0 from then on.
  /// Waits for `stream`.
  unsigned long long take_non_finite(cudaStream_t stream = nullptr) {
    if (non_finite.capacity() == 0) return 0;
    unsigned long long n = 0;
    check(cudaMemcpyAsync(&n, non_finite.data(), sizeof n, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (non-finite count)");
    check(cudaMemsetAsync(non_finite.data(), 0, sizeof n, stream), "cudaMemsetAsync (non-finite count)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (non-finite count)");
    return n;
  }
};

namespace impl {

/// A source value as an element of E (round to nearest even).
template <class E> struct Rounded {
  __device__ E operator()(float x) const { return from_float<E>(x); }
};

/// One thread per element of the rows being written: rows [count][row_blocks], each row `width`
/// elements of src (row r of token i at src + (i · row_blocks + r) · width) to page offset
/// dst_offset(r, slot), each value as convert(value) gives it.
template <class E, class S, class Offset, class Convert = Rounded<E>>
__global__ void write_rows_kernel(E* __restrict__ layer_pool, std::int64_t page_stride, const std::int32_t* __restrict__ pages,
                                  int page_size, std::int64_t first, std::int64_t count, int row_blocks, int width,
                                  const S* __restrict__ src, Offset dst_offset, Convert convert = {}) {
  const std::int64_t per_token = std::int64_t{row_blocks} * width;
  const std::int64_t total = count * per_token;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < total; e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t i = e / per_token, within = e - i * per_token;
    const int r = static_cast<int>(within / width), c = static_cast<int>(within - std::int64_t{r} * width);
    const std::int64_t position = first + i;
    const std::int64_t page = pages[position / page_size - first / page_size];
    const int slot = static_cast<int>(position % page_size);
    layer_pool[page * page_stride + dst_offset(r, slot) + c] = convert(to_float(src[e]));
  }
}

struct RowOffsetKv {  // row r: the key (value) of KV head r
  PageLayout l;
  bool value;
  __device__ std::int64_t operator()(int r, int slot) const { return value ? l.value(r, slot) : l.key(r, slot); }
};
struct RowOffset {  // MLA: one part of a token's row (latent or rope) at `at`
  PageLayout l;
  std::int64_t at;
  __device__ std::int64_t operator()(int, int slot) const { return l.latent(slot) + at; }
};

template <class S> using device_src_t = typename device_type<S>::type;

/// The e4m3 code of x: format.hpp's fp8_e4m3_encode, the same operations (the same byte for every
/// float; NaN gives 0x7E with its sign, as there).
__host__ __device__ inline std::uint8_t e4m3_encode(float x) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  u &= 0x7FFFFFFFu;
  float a;
  std::memcpy(&a, &u, sizeof a);
  std::uint32_t code;
  if (!(a < 464.0f)) {
    code = 0x7E;
  } else if (a < 0.015625f) {  // subnormal steps of 2^-9; a · 512 is exact, rintf rounds to nearest even
    code = static_cast<std::uint32_t>(rintf(a * 512.0f));
  } else {
    u += 0x7FFFFu + ((u >> 20) & 1u);
    code = (u >> 20) - ((127u - 7u) << 3);
    code = code < 0x7Eu ? code : 0x7Eu;
  }
  return static_cast<std::uint8_t>(sign | code);
}

/// The int8 code of x: format_traits<int8_row>'s (to nearest even, clamped to ±127), as a byte.
__host__ __device__ inline std::uint8_t int8_encode(float x) noexcept {
  return static_cast<std::uint8_t>(static_cast<std::int8_t>(fminf(127.0f, fmaxf(-127.0f, rintf(x)))));
}

/// The 8-bit formats' per-row (per-block) rules, format.hpp's quantize_by_row_max: codes of
/// x · (kMax / amax), the stored scale from amax / kMax as format_traits computes it.
struct Int8Rule {  // int8_row, int8_latent: the scale is amax / 127
  static constexpr float kMax = 127.0f;
  __device__ static std::uint8_t code(float x) noexcept { return int8_encode(x); }
  __device__ static float scale(float s) noexcept { return s; }
};
struct E4m3RowRule {  // fp8_e4m3_row: the page holds s · 2^8
  static constexpr float kMax = 448.0f;
  __device__ static std::uint8_t code(float x) noexcept { return e4m3_encode(x); }
  __device__ static float scale(float s) noexcept { return __fmul_rn(s, 256.0f); }
};
struct E4m3LatentRule {  // fp8_e4m3_latent: s itself, as the host computes it ((s · 2^8) · 2^-8)
  static constexpr float kMax = 448.0f;
  __device__ static std::uint8_t code(float x) noexcept { return e4m3_encode(x); }
  __device__ static float scale(float s) noexcept { return __fmul_rn(__fmul_rn(s, 256.0f), 1.0f / 256.0f); }
};

/// Where row r of a token in page slot `slot` goes, in bytes from its page's start: its codes and
/// its fp32 scale.
struct QuantOffsetKv {  // GQA: row r is KV head r's key (value); the scale in the page's scale block
  PageLayout l;
  bool value;
  __device__ std::int64_t codes(int r, int slot) const { return value ? l.value(r, slot) : l.key(r, slot); }
  __device__ std::int64_t scale(int r, int slot) const {
    return l.scale_offset + 4 * (value ? l.value_scale(r, slot) : l.key_scale(r, slot));
  }
};
struct QuantOffsetLatent {  // MLA formats: row r is the latent's block r of 128 values
  PageLayout l;
  __device__ std::int64_t codes(int r, int slot) const { return l.latent(slot) + std::int64_t{r} * l.latent_block; }
  __device__ std::int64_t scale(int r, int slot) const { return l.latent_scales(slot) + 4 * std::int64_t{r}; }
};
struct RopeOffset {  // MLA formats: the rotary key, in bf16 elements from the page's start
  PageLayout l;
  __device__ std::int64_t operator()(int, int slot) const { return l.rope(slot) / 2; }
};

constexpr int kQuantWarps = 8;  // warps per block of the quantizing kernels

/// One warp per row of `n` values: rows [count][row_blocks], row r of token i at
/// src + (i · row_blocks + r) · n, quantized by Rule to `at`'s codes and scale in its page.
template <class Rule, class S, class Offsets>
__global__ void __launch_bounds__(kQuantWarps * 32)
    quantize_rows_kernel(unsigned char* __restrict__ layer_pool, std::int64_t page_stride, const std::int32_t* __restrict__ pages,
                         int page_size, std::int64_t first, std::int64_t count, int row_blocks, int n, const S* __restrict__ src,
                         Offsets at) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t rows = count * row_blocks, warps = std::int64_t{gridDim.x} * kQuantWarps;
  for (std::int64_t w = blockIdx.x * std::int64_t{kQuantWarps} + threadIdx.x / 32; w < rows; w += warps) {  // the same w in a warp
    const std::int64_t i = w / row_blocks;
    const int r = static_cast<int>(w - i * row_blocks);
    const std::int64_t position = first + i;
    const std::int64_t page = pages[position / page_size - first / page_size];
    const int slot = static_cast<int>(position % page_size);
    const S* row = src + w * n;
    float amax = 0.0f;
    bool finite = true;
    for (int c = lane; c < n; c += 32) {
      const float x = to_float(row[c]);
      finite = finite && isfinite(x);
      amax = fmaxf(amax, fabsf(x));
    }
    finite = __all_sync(0xFFFFFFFFu, finite);
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    unsigned char* base = layer_pool + page * page_stride;
    unsigned char* codes = base + at.codes(r, slot);
    if (!finite || amax == 0.0f) {
      for (int c = lane; c < n; c += 32) codes[c] = 0;
      if (lane == 0) *reinterpret_cast<float*>(base + at.scale(r, slot)) = finite ? 0.0f : __uint_as_float(0x7FC00000u);
    } else {
      const float inv = __fdiv_rn(Rule::kMax, amax);
      for (int c = lane; c < n; c += 32) codes[c] = Rule::code(__fmul_rn(to_float(row[c]), inv));
      if (lane == 0) *reinterpret_cast<float*>(base + at.scale(r, slot)) = Rule::scale(__fdiv_rn(amax, Rule::kMax));
    }
  }
}

/// fp8_e4m3_layer's code of a value (write_rows_kernel's conversion): e4m3(x · inv); a NaN gives
/// code 0, and each NaN or infinity adds one to *non_finite.
struct LayerCode {
  float inv;
  unsigned long long* non_finite;
  __device__ std::uint8_t operator()(float x) const {
    if (!isfinite(x)) atomicAdd(non_finite, 1ull);
    return isnan(x) ? std::uint8_t{0} : e4m3_encode(__fmul_rn(x, inv));
  }
};

/// Warps of the quantizing kernels for `rows` rows (grid-stride beyond).
inline unsigned quant_grid_for(std::int64_t rows) {
  constexpr std::int64_t kMaxBlocks = 65535;
  return static_cast<unsigned>(std::min<std::int64_t>(kMaxBlocks, (rows + kQuantWarps - 1) / kQuantWarps));
}

/// Checks, copy-on-write, and the page ids of [first, first + count) on the device.
template <class T>
const std::int32_t* prepare(PagedKvCache<T, DeviceMemory>& cache, SeqId seq, int layer, std::int64_t first, std::int64_t count,
                            PageContent content, const void* a, const void* b, const char* op, AppendWorkspace& ws,
                            cudaStream_t stream) {
  const PageLayout& l = cache.layout();
  if (l.content != content)
    raise<invalid_argument>(kvattn::detail::concat(op, ": this cache holds ", l.content == PageContent::gqa ? "GQA" : "MLA", " pages"));
  if (layer < 0 || layer >= cache.config().layers)
    raise<invalid_argument>(kvattn::detail::concat(op, ": layer=", layer, " is outside [0, ", cache.config().layers, ")"));
  if (a == nullptr || b == nullptr) raise<invalid_argument>(kvattn::detail::concat(op, ": a source pointer is null"));
  cache.make_writable(seq, first, count);  // checks the range; copies shared pages; throws before any change
  const std::vector<PageId>& pages = cache.pages(seq);
  const std::int64_t P = l.page_size;
  ws.host_pages.assign(pages.begin() + first / P, pages.begin() + (first + count - 1) / P + 1);
  return ws.pages.upload(ws.host_pages.data(), ws.host_pages.size(), stream);
}

inline unsigned grid_for(std::int64_t elements) {
  constexpr std::int64_t kMaxBlocks = 65535;
  return static_cast<unsigned>(std::min<std::int64_t>(kMaxBlocks, (elements + 255) / 256));
}

}  // namespace impl

/// GQA family: keys and values of tokens [first, first + count) of `seq` in `layer`;
/// k, v: device [count][kv_heads][head_dim] of float, kvattn::fp16 or kvattn::bf16. The cache is
/// fp32, fp16, bf16, int8_row, fp8_e4m3_row or fp8_e4m3_layer (its layer's scales).
template <class T, class Src>
void write_kv(PagedKvCache<T, DeviceMemory>& cache, SeqId seq, int layer, std::int64_t first, std::int64_t count, const Src* k,
              const Src* v, AppendWorkspace& ws, cudaStream_t stream = nullptr) {
  static_assert(is_storage_type_v<Src>, "kvattn::cuda::write_kv: sources are fp32, fp16 or bf16");
  static_assert(format_traits<T>::latent_block == 0, "kvattn::cuda::write_kv: an MLA format's cache is written with cuda::write_latent");
  constexpr bool kPlain = is_storage_type_v<T>;
  constexpr bool kRow = std::is_same_v<T, int8_row> || std::is_same_v<T, fp8_e4m3_row>;
  constexpr bool kLayer = std::is_same_v<T, fp8_e4m3_layer>;
  static_assert(kPlain || kRow || kLayer || format_traits<T>::latent_block > 0,
                "kvattn::cuda::write_kv: the device writes fp32, fp16, bf16, int8_row, fp8_e4m3_row and fp8_e4m3_layer caches "
                "(q4_block and the hadamard<> formats are CPU formats: a host PagedKvCache holds them)");
  if constexpr (kPlain || kRow || kLayer) {
    if constexpr (kLayer) (void)ws.non_finite.reserve(1);  // before any change to the cache
    const std::int32_t* pages = impl::prepare(cache, seq, layer, first, count, PageContent::gqa, k, v, "cuda::write_kv", ws, stream);
    using S = impl::device_src_t<Src>;
    const PageLayout& l = cache.layout();
    const S* ks = reinterpret_cast<const S*>(k);
    const S* vs = reinterpret_cast<const S*>(v);
    if constexpr (kPlain) {
      using E = typename impl::device_type<T>::type;
      E* pool = reinterpret_cast<E*>(cache.layer_data(layer));
      const std::int64_t half = count * l.kv_heads * l.head_dim;
      // keys: rows 0..kv_heads-1 of the offset functor; values: kv_heads.. (the sources are separate arrays)
      impl::write_rows_kernel<<<impl::grid_for(half), 256, 0, stream>>>(pool, l.page_stride, pages, l.page_size, first, count,
                                                                         l.kv_heads, l.head_dim, ks, impl::RowOffsetKv{l, false});
      impl::write_rows_kernel<<<impl::grid_for(half), 256, 0, stream>>>(pool, l.page_stride, pages, l.page_size, first, count,
                                                                         l.kv_heads, l.head_dim, vs, impl::RowOffsetKv{l, true});
    } else if constexpr (kRow) {
      using Rule = std::conditional_t<std::is_same_v<T, int8_row>, impl::Int8Rule, impl::E4m3RowRule>;
      auto* pool = reinterpret_cast<unsigned char*>(cache.layer_data(layer));
      const unsigned grid = impl::quant_grid_for(count * l.kv_heads);
      impl::quantize_rows_kernel<Rule><<<grid, impl::kQuantWarps * 32, 0, stream>>>(
          pool, l.page_stride, pages, l.page_size, first, count, l.kv_heads, l.head_dim, ks, impl::QuantOffsetKv{l, false});
      impl::quantize_rows_kernel<Rule><<<grid, impl::kQuantWarps * 32, 0, stream>>>(
          pool, l.page_stride, pages, l.page_size, first, count, l.kv_heads, l.head_dim, vs, impl::QuantOffsetKv{l, true});
    } else {
      const KvScales scales = cache.scales(layer);
      const float inv_k = 1.0f / scales.k, inv_v = 1.0f / scales.v;  // as format_traits<fp8_e4m3_layer>::quantize_row
      unsigned long long* non_finite = ws.non_finite.data();
      auto* pool = reinterpret_cast<unsigned char*>(cache.layer_data(layer));
      const std::int64_t half = count * l.kv_heads * l.head_dim;
      impl::write_rows_kernel<<<impl::grid_for(half), 256, 0, stream>>>(pool, l.page_stride, pages, l.page_size, first, count, l.kv_heads,
                                                                         l.head_dim, ks, impl::RowOffsetKv{l, false},
                                                                         impl::LayerCode{inv_k, non_finite});
      impl::write_rows_kernel<<<impl::grid_for(half), 256, 0, stream>>>(pool, l.page_stride, pages, l.page_size, first, count, l.kv_heads,
                                                                         l.head_dim, vs, impl::RowOffsetKv{l, true},
                                                                         impl::LayerCode{inv_v, non_finite});
    }
    check(cudaGetLastError(), "write_kv launch");
  }
}

/// MLA: latents [count][latent_dim] and rotary keys [count][rope_dim] (device, float,
/// kvattn::fp16 or kvattn::bf16) of tokens [first, first + count) of `seq` in `layer`. The cache
/// is fp32, fp16, bf16, fp8_e4m3_latent or int8_latent.
template <class T, class Src>
void write_latent(PagedKvCache<T, DeviceMemory>& cache, SeqId seq, int layer, std::int64_t first, std::int64_t count,
                  const Src* latent, const Src* rope, AppendWorkspace& ws, cudaStream_t stream = nullptr) {
  static_assert(is_storage_type_v<Src>, "kvattn::cuda::write_latent: sources are fp32, fp16 or bf16");
  constexpr bool kPlain = is_storage_type_v<T>;
  constexpr bool kLatent = std::is_same_v<T, fp8_e4m3_latent> || std::is_same_v<T, int8_latent>;
  static_assert(kPlain || kLatent, "kvattn::cuda::write_latent: an MLA cache is fp32, fp16, bf16, fp8_e4m3_latent or int8_latent");
  if constexpr (kPlain || kLatent) {
    const std::int32_t* pages =
        impl::prepare(cache, seq, layer, first, count, PageContent::mla, latent, rope, "cuda::write_latent", ws, stream);
    using S = impl::device_src_t<Src>;
    const PageLayout& l = cache.layout();
    const S* ls = reinterpret_cast<const S*>(latent);
    const S* rs = reinterpret_cast<const S*>(rope);
    if constexpr (kPlain) {
      using E = typename impl::device_type<T>::type;
      E* pool = reinterpret_cast<E*>(cache.layer_data(layer));
      impl::write_rows_kernel<<<impl::grid_for(count * l.latent_dim), 256, 0, stream>>>(
          pool, l.page_stride, pages, l.page_size, first, count, 1, l.latent_dim, ls, impl::RowOffset{l, 0});
      if (l.rope_dim > 0)
        impl::write_rows_kernel<<<impl::grid_for(count * l.rope_dim), 256, 0, stream>>>(
            pool, l.page_stride, pages, l.page_size, first, count, 1, l.rope_dim, rs, impl::RowOffset{l, l.latent_dim});
    } else {
      using Rule = std::conditional_t<std::is_same_v<T, int8_latent>, impl::Int8Rule, impl::E4m3LatentRule>;
      auto* pool = reinterpret_cast<unsigned char*>(cache.layer_data(layer));
      const int blocks = l.latent_dim / l.latent_block;
      impl::quantize_rows_kernel<Rule><<<impl::quant_grid_for(count * blocks), impl::kQuantWarps * 32, 0, stream>>>(
          pool, l.page_stride, pages, l.page_size, first, count, blocks, l.latent_block, ls, impl::QuantOffsetLatent{l});
      // The rotary key: bf16 at an even byte offset of each row (rope_dim is even), pages of page_stride / 2 elements.
      if (l.rope_dim > 0)
        impl::write_rows_kernel<<<impl::grid_for(count * l.rope_dim), 256, 0, stream>>>(
            reinterpret_cast<__nv_bfloat16*>(pool), l.page_stride / 2, pages, l.page_size, first, count, 1, l.rope_dim, rs,
            impl::RopeOffset{l});
    }
    check(cudaGetLastError(), "write_latent launch");
  }
}

}  // namespace kvattn::cuda
