// tests/cuda/graph_kernels.cu — graph_kernels.hpp: a decode step of several layers captured into a
// CUDA graph and replayed.
#include <kvattn/cuda/append.hpp>
#include <kvattn/cuda/decode.hpp>
#include <kvattn/cuda/mla_decode.hpp>
#include <kvattn/cuda/plan.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <random>
#include <vector>

#include "device_cache.cuh"
#include "graph_kernels.hpp"

namespace cuda_tests {

namespace {

namespace kc = kvattn::cuda;
using kc::check;
using kc::DeviceBuffer;
using Gpt = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;

/// Owns a stream, a graph and its executable, and ends a capture left open by an error.
struct GraphResources {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~GraphResources() {
    if (stream != nullptr) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
        cudaGraph_t left = nullptr;
        if (cudaStreamEndCapture(stream, &left) == cudaSuccess && left != nullptr) (void)cudaGraphDestroy(left);
      }
      (void)cudaStreamSynchronize(stream);
    }
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
    (void)cudaGetLastError();
  }
};

}  // namespace

GraphStep graph_step(int replays) {
  GraphStep result;
  GraphResources g;
  try {
    check(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    const cudaStream_t stream = g.stream;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const auto random = [&](std::size_t n) {
      std::vector<float> v(n);
      for (auto& x : v) x = dist(rng);
      return v;
    };

    // GQA: 3 layers of 8 query heads on 2 KV heads of 128, bf16, pages of 16; two queries per
    // sequence; chunks of 128 tokens, so the sequence of 700 is split (and merged) and the others are not.
    constexpr int kLayers = 3, kQ = 2;
    const kvattn::GqaShape shape = kvattn::GqaShape::gqa(8, 2, 128);
    const std::vector<std::int64_t> lengths{700, 40, 1};
    kvattn::PagedKvCache<kvattn::bf16, kc::DeviceMemory> cache(kvattn::CacheConfig{kLayers, 16, 64, shape});
    std::vector<kvattn::SeqId> seqs;
    std::vector<DeviceBuffer<float>> sources;  // kept until the writes are done
    kc::AppendWorkspace append_ws;
    for (std::int64_t L : lengths) {
      seqs.push_back(cache.add_sequence());
      cache.append(seqs.back(), L);
      const std::size_t n = static_cast<std::size_t>(L) * shape.kv_heads * shape.head_dim;
      for (int layer = 0; layer < kLayers; ++layer) {
        sources.push_back(to_device(random(n)));
        sources.push_back(to_device(random(n)));
        check(cudaDeviceSynchronize(), "sources");  // (copies from pageable memory; the stream is non-blocking)
        kc::write_kv(cache, seqs.back(), layer, 0, L, sources[sources.size() - 2].data(), sources.back().data(), append_ws, stream);
        check(cudaStreamSynchronize(stream), "write_kv");  // (the workspace's page list is reused by the next write)
      }
    }
    const kvattn::BatchPageTable table = cache.page_table(seqs);
    kvattn::DecodeParams p;
    p.queries_per_seq = kQ;
    p.chunk_tokens = 128;
    kc::DecodePlan plan;
    plan.make(cache, table, shape, p, stream);
    const std::vector<float> sinks = random(static_cast<std::size_t>(shape.q_heads));
    kc::PolicyArrays gqa_arrays;
    const Gpt gpt = gqa_arrays.upload(Gpt{{300}, {30.0f}, {sinks.data(), shape.q_heads}}, plan, stream);

    // MLA: one layer of DeepSeek-V2-Lite's heads (16, latent 512 + rotary 64), bf16; chunks of 64
    // tokens, so the sequence of 500 is split.
    const kvattn::MlaShape mla_shape{16, 512, 64, 128, 128, 0};
    const int K = mla_shape.latent_dim + mla_shape.rope_dim;
    const std::vector<std::int64_t> mla_lengths{500, 3};
    kvattn::PagedKvCache<kvattn::bf16, kc::DeviceMemory> mla_cache(kvattn::CacheConfig{1, 16, 64, mla_shape});
    std::vector<kvattn::SeqId> mla_seqs;
    for (std::int64_t L : mla_lengths) {
      mla_seqs.push_back(mla_cache.add_sequence());
      mla_cache.append(mla_seqs.back(), L);
      sources.push_back(to_device(random(static_cast<std::size_t>(L) * mla_shape.latent_dim)));
      sources.push_back(to_device(random(static_cast<std::size_t>(L) * mla_shape.rope_dim)));
      check(cudaDeviceSynchronize(), "sources");
      kc::write_latent(mla_cache, mla_seqs.back(), 0, 0, L, sources[sources.size() - 2].data(), sources.back().data(), append_ws,
                       stream);
      check(cudaStreamSynchronize(stream), "write_latent");
    }
    const kvattn::BatchPageTable mla_table = mla_cache.page_table(mla_seqs);
    kvattn::DecodeParams mla_p;
    mla_p.chunk_tokens = 64;
    kc::DecodePlan mla_plan;
    mla_plan.make(mla_cache, mla_table, mla_shape, mla_p, stream);
    const std::vector<float> mla_sinks = random(static_cast<std::size_t>(mla_shape.heads));
    kc::PolicyArrays mla_arrays;
    const kvattn::Sinks mla_policy = mla_arrays.upload(kvattn::Sinks{mla_sinks.data(), mla_shape.heads}, mla_plan, stream);

    // The step's arrays: queries, and the outputs of the direct calls and of the graph.
    const std::size_t B = lengths.size(), MB = mla_lengths.size();
    const std::size_t n_lse = B * kQ * shape.q_heads, n_q = n_lse * shape.head_dim;  // per layer
    const std::size_t mla_rows = MB * mla_shape.heads, mla_n_q = mla_rows * K, mla_n_out = mla_rows * mla_shape.latent_dim;
    const std::size_t n_results = kLayers * (n_q + n_lse) + mla_n_out + mla_rows;
    DeviceBuffer<float> q(kLayers * n_q), mla_q(mla_n_q), direct(n_results), graph(n_results);
    const auto step = [&](float* results) {  // [layers][n_q] out, [layers][n_lse] lse, MLA out, MLA lse
      float* out = results;
      float* lse = results + kLayers * n_q;
      for (int layer = 0; layer < kLayers; ++layer)
        kc::decode(plan.view(cache, layer), q.data() + layer * n_q, out + layer * n_q, lse + layer * n_lse, plan, stream, gpt);
      float* mla_out = lse + kLayers * n_lse;
      kc::mla_decode(mla_plan.view(mla_cache, 0), mla_q.data(), mla_out, mla_out + mla_n_out, mla_plan, stream, mla_policy);
    };
    const auto new_queries = [&] {  // (cudaMemcpyAsync copies pageable memory before it returns)
      const std::vector<float> hq = random(kLayers * n_q), hm = random(mla_n_q);
      check(cudaMemcpyAsync(q.data(), hq.data(), hq.size() * sizeof(float), cudaMemcpyHostToDevice, stream), "queries");
      check(cudaMemcpyAsync(mla_q.data(), hm.data(), hm.size() * sizeof(float), cudaMemcpyHostToDevice, stream), "MLA queries");
    };
    check(cudaDeviceSynchronize(), "setup");

    // Once directly (as an engine warms up), then the same calls captured.
    new_queries();
    step(direct.data());
    check(cudaStreamSynchronize(stream), "direct step");
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    step(graph.data());
    check(cudaStreamEndCapture(stream, &g.graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiateWithFlags(&g.exec, g.graph, 0), "cudaGraphInstantiateWithFlags");

    for (int r = 0; r < replays; ++r) {
      new_queries();
      check(cudaMemsetAsync(graph.data(), 0xFF, n_results * sizeof(float), stream), "NaN");
      check(cudaGraphLaunch(g.exec, stream), "cudaGraphLaunch");
      step(direct.data());
      check(cudaStreamSynchronize(stream), "replay");
      result.direct.emplace_back();
      result.graph.emplace_back();
      download(result.direct.back(), direct.data(), n_results);
      download(result.graph.back(), graph.data(), n_results);
    }
  } catch (const std::exception& e) {
    result.error = e.what();
  }
  return result;
}

}  // namespace cuda_tests
