// kvattn/cuda/append.hpp — writing new tokens into a device cache's pages.
//
//   write_kv:     GQA family, k and v [count][kv_heads][head_dim] (device, fp32 / fp16 / bf16),
//                 converted to the cache's element type (round to nearest even)
//   write_latent: MLA, latent [count][latent_dim] and rope [count][rope_dim] (device)
// for tokens [first, first + count) of one sequence in one layer, after PagedKvCache::append has
// reserved them (or over tokens already written). The stored bits equal the host writes' for
// every input but NaN (the device writes its canonical NaN). As the host writes: every check first, then the
// copy-on-write of any shared page in the range (PagedKvCache::make_writable, on the device),
// then one kernel on `stream`. A request that fails throws before anything changes.
// The kernel finds each token's page through the sequence's page ids of the range, uploaded with
// the launch (AppendWorkspace: reuse one per stream).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime.hpp"

namespace kvattn::cuda {

/// Scratch memory of the append launchers: the page ids of the range being written.
struct AppendWorkspace {
  std::vector<std::int32_t> host_pages;
  DeviceBuffer<std::int32_t> pages;
};

namespace impl {

/// One thread per element of the rows being written: rows [count][row_blocks], each row `width`
/// elements of src (row r of token i at src + (i · row_blocks + r) · width) to page offset
/// dst_offset(r, slot).
template <class E, class S, class Offset>
__global__ void write_rows_kernel(E* __restrict__ layer_pool, std::int64_t page_stride, const std::int32_t* __restrict__ pages,
                                  int page_size, std::int64_t first, std::int64_t count, int row_blocks, int width,
                                  const S* __restrict__ src, Offset dst_offset) {
  const std::int64_t per_token = std::int64_t{row_blocks} * width;
  const std::int64_t total = count * per_token;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < total; e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t i = e / per_token, within = e - i * per_token;
    const int r = static_cast<int>(within / width), c = static_cast<int>(within - std::int64_t{r} * width);
    const std::int64_t position = first + i;
    const std::int64_t page = pages[position / page_size - first / page_size];
    const int slot = static_cast<int>(position % page_size);
    layer_pool[page * page_stride + dst_offset(r, slot) + c] = from_float<E>(to_float(src[e]));
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
/// k, v: device [count][kv_heads][head_dim] of float, kvattn::fp16 or kvattn::bf16.
template <class T, class Src>
void write_kv(PagedKvCache<T, DeviceMemory>& cache, SeqId seq, int layer, std::int64_t first, std::int64_t count, const Src* k,
              const Src* v, AppendWorkspace& ws, cudaStream_t stream = nullptr) {
  static_assert(is_storage_type_v<Src>, "kvattn::cuda::write_kv: sources are fp32, fp16 or bf16");
  const std::int32_t* pages = impl::prepare(cache, seq, layer, first, count, PageContent::gqa, k, v, "cuda::write_kv", ws, stream);
  using E = typename impl::device_type<T>::type;
  using S = impl::device_src_t<Src>;
  const PageLayout& l = cache.layout();
  E* pool = reinterpret_cast<E*>(cache.layer_data(layer));
  const std::int64_t half = count * l.kv_heads * l.head_dim;
  // keys: rows 0..kv_heads-1 of the offset functor; values: kv_heads.. (the sources are separate arrays)
  impl::write_rows_kernel<<<impl::grid_for(half), 256, 0, stream>>>(pool, l.page_stride, pages, l.page_size, first, count,
                                                                     l.kv_heads, l.head_dim, reinterpret_cast<const S*>(k),
                                                                     impl::RowOffsetKv{l, false});
  impl::write_rows_kernel<<<impl::grid_for(half), 256, 0, stream>>>(pool, l.page_stride, pages, l.page_size, first, count,
                                                                     l.kv_heads, l.head_dim, reinterpret_cast<const S*>(v),
                                                                     impl::RowOffsetKv{l, true});
  check(cudaGetLastError(), "write_kv launch");
}

/// MLA: latents [count][latent_dim] and rotary keys [count][rope_dim] (device) of tokens
/// [first, first + count) of `seq` in `layer`.
template <class T, class Src>
void write_latent(PagedKvCache<T, DeviceMemory>& cache, SeqId seq, int layer, std::int64_t first, std::int64_t count,
                  const Src* latent, const Src* rope, AppendWorkspace& ws, cudaStream_t stream = nullptr) {
  static_assert(is_storage_type_v<Src>, "kvattn::cuda::write_latent: sources are fp32, fp16 or bf16");
  const std::int32_t* pages =
      impl::prepare(cache, seq, layer, first, count, PageContent::mla, latent, rope, "cuda::write_latent", ws, stream);
  using E = typename impl::device_type<T>::type;
  using S = impl::device_src_t<Src>;
  const PageLayout& l = cache.layout();
  E* pool = reinterpret_cast<E*>(cache.layer_data(layer));
  impl::write_rows_kernel<<<impl::grid_for(count * l.latent_dim), 256, 0, stream>>>(
      pool, l.page_stride, pages, l.page_size, first, count, 1, l.latent_dim, reinterpret_cast<const S*>(latent), impl::RowOffset{l, 0});
  if (l.rope_dim > 0)
    impl::write_rows_kernel<<<impl::grid_for(count * l.rope_dim), 256, 0, stream>>>(
        pool, l.page_stride, pages, l.page_size, first, count, 1, l.rope_dim, reinterpret_cast<const S*>(rope),
        impl::RowOffset{l, l.latent_dim});
  check(cudaGetLastError(), "write_latent launch");
}

}  // namespace kvattn::cuda
