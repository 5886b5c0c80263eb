// tests/cuda/graph_kernels.hpp — a whole decode step captured into a CUDA graph and replayed,
// behind a plain C++ call (the device side in graph_kernels.cu).
#pragma once

#include <string>
#include <vector>

namespace cuda_tests {

/// What graph_step saw, replay by replay: every result of the step (each layer's out, then each
/// layer's lse, then the MLA layer's out and lse) from the direct calls and from the graph.
struct GraphStep {
  std::string error;  ///< what failed ("" when nothing did)
  std::vector<std::vector<float>> direct, graph;
};

/// On a non-blocking stream: a device cache of 3 GQA layers (8 query heads on 2 KV heads of 128,
/// bf16) and an MLA cache (DeepSeek-V2-Lite's heads), written with cuda::write_kv / write_latent;
/// one plan per cache (some sequences split, so the merge kernels run too) and policies on the
/// device (gpt-oss's window + soft-cap + sinks for the GQA layers, sinks for the MLA one). The step (cuda::decode on every layer, then
/// cuda::mla_decode) runs once directly, is captured into a graph (cudaStreamBeginCapture in
/// global mode: any allocation, copy or synchronization in the calls fails the capture), and
/// for each of `replays` replays: new queries are written, the graph's outputs are filled with
/// NaN, the graph is launched, and the step is run directly again on the same queries.
GraphStep graph_step(int replays);

}  // namespace cuda_tests
