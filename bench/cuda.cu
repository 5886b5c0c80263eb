// bench/cuda.cu — the CUDA specializations on the GPU: decode for the GQA family (bytes of K/V
// read per second) and folded MLA decode (FLOP/s), beside the card's copy bandwidth measured in
// the same run.
//
//   machine/cuda_copy_bandwidth     cudaMemcpy device to device of 1 GiB: bytes_per_second counts
//                                   the bytes read (half of the bytes moved), the figure decode's
//                                   bytes read compare with
//   decode/cuda/gqa32x8/<dtype>/ctx:C/batch:B
//                                   kvattn::cuda::decode, 32 query heads, 8 KV heads, head size
//                                   128, one query per sequence, pages of 16; bytes_per_second =
//                                   B · C · 8 · 128 · 2 (K and V) · 2 bytes per step (dtype fp16 or
//                                   bf16; int8 and fp8: int8_row and fp8_e4m3_row, one byte per
//                                   value and 4 bytes of scale per row: B · C · 8 · 2 · (128 + 4))
//   mla/cuda/folded/ctx:C/batch:B   kvattn::cuda::mla_decode, DeepSeek-V2's heads (128, latent 512
//                                   + rotary 64), bf16 latents; flops = B · 128 · C · 2 · (576 + 512)
// C in {4K, 16K, 64K} (MLA: 1K, 4K, 16K), B in {1, 64}; every configuration whose cache fits in
// a quarter of the device's free memory. Times are the GPU's (CUDA events around each call): the
// step's plan (cuda::DecodePlan::make) is made once, outside the timing, and the per-layer call
// is timed, as an engine calls it once per layer.
// Without a CUDA device the program says so and exits 0.
#include <kvattn/cuda/decode.hpp>
#include <kvattn/cuda/mla_decode.hpp>
#include <kvattn/cuda/plan.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using kvattn::cuda::check;
using kvattn::cuda::DeviceBuffer;

constexpr int kPage = 16;

/// Fills n elements with values in [-1, 1) from a hash of the index (no host traffic).
template <class E> __global__ void fill_kernel(E* p, std::int64_t n, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = kvattn::cuda::impl::from_float<E>(static_cast<float>(x & 0xFFFFFF) / 8388608.0f - 1.0f);
  }
}
template <class E> void fill(E* p, std::int64_t n, std::uint32_t seed) {
  fill_kernel<<<1024, 256>>>(p, n, seed);
  check(cudaGetLastError(), "fill");
}

/// An 8-bit format's pages: codes from a hash of the index (every byte of the layer), then every
/// page's scale block set to 1/64.
__global__ void fill_codes_kernel(std::uint8_t* p, std::int64_t n, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    p[i] = static_cast<std::uint8_t>((x >> 8) & 0x77u);  // int8 in [0, 119], fp8 below 2^7 · 2^-8 (no NaN code)
  }
}
__global__ void fill_scales_kernel(std::uint8_t* p, const kvattn::PageLayout l, std::int64_t pages) {
  const std::int64_t per_page = 2 * std::int64_t{l.kv_heads} * l.page_size * l.scale_slots;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < pages * per_page;
       i += std::int64_t{gridDim.x} * blockDim.x)
    reinterpret_cast<float*>(p + i / per_page * l.page_stride + l.scale_offset)[i % per_page] = 1.0f / 64;
}

/// One layer of a cache of format T filled for the benchmark: values in [-1, 1) (16-bit formats)
/// or codes and scales (8-bit formats).
template <class T, class M> void fill_layer(kvattn::PagedKvCache<T, M>& cache, std::uint32_t seed) {
  if constexpr (kvattn::format_traits<T>::row_scale) {
    auto* p = reinterpret_cast<std::uint8_t*>(cache.layer_data(0));
    fill_codes_kernel<<<1024, 256>>>(p, cache.layer_stride(), seed);
    fill_scales_kernel<<<1024, 256>>>(p, cache.layout(), cache.config().num_pages);
    check(cudaGetLastError(), "fill");
  } else {
    using E = typename kvattn::cuda::impl::device_type<T>::type;
    fill(reinterpret_cast<E*>(cache.layer_data(0)), cache.layer_stride(), seed);
  }
}

std::size_t free_memory() {
  std::size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

/// GPU time of one call of f, by CUDA events, as the benchmark's manual time.
template <class F> void time_steps(benchmark::State& state, F&& f) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  f();  // warm-up: kernels loaded
  check(cudaDeviceSynchronize(), "warm-up");
  for (auto _ : state) {
    check(cudaEventRecord(start), "cudaEventRecord");
    f();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

void bm_copy_bandwidth(benchmark::State& state) {
  const std::size_t bytes = std::size_t{1} << 30;
  DeviceBuffer<char> a(bytes), b(bytes);
  time_steps(state, [&] { check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice), "copy"); });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
}

template <class T> void bm_decode(benchmark::State& state) {
  const std::int64_t ctx = state.range(0), batch = state.range(1);
  const auto shape = kvattn::GqaShape::gqa(32, 8, 128);
  const std::int64_t pages = batch * ((ctx + kPage - 1) / kPage);
  const kvattn::CacheConfig config{1, kPage, pages, shape};
  const std::int64_t kv_bytes = batch * ctx * kvattn::PageLayout::of<T>(shape, kPage).token_bytes();  // scales included
  if (static_cast<std::size_t>(kv_bytes) > free_memory() / 4) {
    state.SkipWithError("the cache would take more than a quarter of the free device memory");
    return;
  }
  kvattn::PagedKvCache<T, kvattn::cuda::DeviceMemory> cache(config);
  std::vector<kvattn::SeqId> seqs;
  for (std::int64_t b = 0; b < batch; ++b) {
    seqs.push_back(cache.add_sequence());
    cache.append(seqs.back(), ctx);
  }
  fill_layer(cache, 1);
  const std::size_t n = static_cast<std::size_t>(batch) * shape.q_heads * shape.head_dim;
  DeviceBuffer<float> q(n), out(n), lse(static_cast<std::size_t>(batch) * shape.q_heads);
  fill(q.data(), static_cast<std::int64_t>(n), 2);
  kvattn::cuda::DecodePlan plan;  // once per step
  plan.make(cache, cache.page_table(seqs), shape, kvattn::DecodeParams{});
  const auto view = plan.view(cache, 0);
  time_steps(state, [&] { kvattn::cuda::decode(view, q.data(), out.data(), lse.data(), plan); });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kv_bytes);
  state.SetLabel(std::to_string(kv_bytes >> 20) + " MiB K/V per step");
}

void bm_mla(benchmark::State& state) {
  const std::int64_t ctx = state.range(0), batch = state.range(1);
  const kvattn::MlaShape shape{128, 512, 64, 128, 128, 1536};  // DeepSeek-V2
  const std::int64_t pages = batch * ((ctx + kPage - 1) / kPage);
  const kvattn::CacheConfig config{1, kPage, pages, shape};
  kvattn::PagedKvCache<kvattn::bf16, kvattn::cuda::DeviceMemory> cache(config);
  std::vector<kvattn::SeqId> seqs;
  for (std::int64_t b = 0; b < batch; ++b) {
    seqs.push_back(cache.add_sequence());
    cache.append(seqs.back(), ctx);
  }
  fill(reinterpret_cast<__nv_bfloat16*>(cache.layer_data(0)), cache.layer_stride(), 3);
  const int K = shape.latent_dim + shape.rope_dim;
  DeviceBuffer<float> q(static_cast<std::size_t>(batch) * shape.heads * K),
      out(static_cast<std::size_t>(batch) * shape.heads * shape.latent_dim), lse(static_cast<std::size_t>(batch) * shape.heads);
  fill(q.data(), batch * shape.heads * K, 4);
  kvattn::cuda::DecodePlan plan;  // once per step
  plan.make(cache, cache.page_table(seqs), shape, kvattn::DecodeParams{});
  const auto view = plan.view(cache, 0);
  time_steps(state, [&] { kvattn::cuda::mla_decode(view, q.data(), out.data(), lse.data(), plan); });
  const double flops = 2.0 * static_cast<double>(batch) * shape.heads * static_cast<double>(ctx) * (K + shape.latent_dim);
  state.counters["flops"] = benchmark::Counter(flops * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (!kvattn::cuda::device_available()) {
    std::printf("bench_cuda: no CUDA device (cudaGetDeviceCount failed or found none): nothing measured\n");
    return 0;
  }
  benchmark::RegisterBenchmark("machine/cuda_copy_bandwidth", bm_copy_bandwidth)->UseManualTime()->Unit(benchmark::kMillisecond);
  for (std::int64_t ctx : {4096, 16384, 65536})
    for (std::int64_t batch : {1, 64}) {
      benchmark::RegisterBenchmark("decode/cuda/gqa32x8/fp16", bm_decode<kvattn::fp16>)
          ->ArgNames({"ctx", "batch"})->Args({ctx, batch})->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("decode/cuda/gqa32x8/bf16", bm_decode<kvattn::bf16>)
          ->ArgNames({"ctx", "batch"})->Args({ctx, batch})->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("decode/cuda/gqa32x8/int8", bm_decode<kvattn::int8_row>)
          ->ArgNames({"ctx", "batch"})->Args({ctx, batch})->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("decode/cuda/gqa32x8/fp8", bm_decode<kvattn::fp8_e4m3_row>)
          ->ArgNames({"ctx", "batch"})->Args({ctx, batch})->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
  for (std::int64_t ctx : {1024, 4096, 16384})
    for (std::int64_t batch : {1, 64})
      benchmark::RegisterBenchmark("mla/cuda/folded", bm_mla)->ArgNames({"ctx", "batch"})->Args({ctx, batch})->UseManualTime()->Unit(
          benchmark::kMicrosecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
