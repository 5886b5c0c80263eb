// tests/cuda/mla_kernels.cu — the device side of mla_kernels.hpp: copies to and from the device
// around kvattn::cuda::mla_decode.
#include <kvattn/cuda/mla_decode.hpp>

#include <cstdint>
#include <vector>

#include "mla_kernels.hpp"

namespace cuda_tests {

namespace kc = kvattn::cuda;

struct MlaDecoder::State {
  cudaStream_t stream = nullptr;
  kc::MlaDecodeWorkspace ws;
  kc::DevicePageTable table;
  kc::DeviceBuffer<unsigned char> pool;  // layer 0 of the cache, byte for byte
  kc::DeviceBuffer<float> q, out, lse;

  // A blocking stream: ordered after the zero-fill of new device buffers (DeviceMemory::allocate),
  // which runs on the default stream.
  State() { kc::check(cudaStreamCreate(&stream), "cudaStreamCreate"); }
  ~State() {
    (void)cudaStreamSynchronize(stream);
    (void)cudaStreamDestroy(stream);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
};

MlaDecoder::MlaDecoder() : state_(std::make_unique<State>()) {}
MlaDecoder::~MlaDecoder() = default;

std::size_t MlaDecoder::workspace_bytes() const { return state_->ws.device_bytes(); }

template <class T>
void MlaDecoder::run(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                     const kvattn::MlaShape& shape, const std::vector<float>& q, const kvattn::MlaDecodeParams& p,
                     std::vector<float>& out, std::vector<float>* lse, Null null) {
  State& s = *state_;
  const cudaStream_t stream = s.stream;
  const std::size_t B = seqs.size(), rows = B * static_cast<std::size_t>(p.queries_per_seq) * static_cast<std::size_t>(shape.heads);
  const std::size_t n_out = rows * static_cast<std::size_t>(shape.latent_dim);

  s.table.upload(cache.page_table(seqs), stream);
  const std::size_t pool_bytes = static_cast<std::size_t>(cache.layer_stride()) * sizeof(T);
  s.pool.upload(reinterpret_cast<const unsigned char*>(cache.layer_data(0)), pool_bytes, stream);
  const kvattn::PagedKvView<T> view = s.table.view(reinterpret_cast<const T*>(s.pool.data()), cache.layout());
  const float* q_dev = s.q.upload(q.data(), q.size(), stream);
  float* out_dev = s.out.reserve(n_out);
  float* lse_dev = lse != nullptr ? s.lse.reserve(rows) : nullptr;
  if (n_out > 0) kc::check(cudaMemsetAsync(out_dev, 0xFF, n_out * sizeof(float), stream), "cudaMemsetAsync (out)");  // NaN
  if (lse_dev != nullptr && rows > 0)
    kc::check(cudaMemsetAsync(lse_dev, 0xFF, rows * sizeof(float), stream), "cudaMemsetAsync (lse)");
  // The host sources of the asynchronous copies above must stay until they are done.
  kc::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (inputs)");

  kc::mla_decode(view, s.table, shape, null == Null::q ? nullptr : q_dev, null == Null::out ? nullptr : out_dev, lse_dev, p,
                 s.ws, stream);

  out.assign(n_out, 0.0f);
  if (n_out > 0)
    kc::check(cudaMemcpyAsync(out.data(), out_dev, n_out * sizeof(float), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (out)");
  if (lse != nullptr) {
    lse->assign(rows, 0.0f);
    if (rows > 0)
      kc::check(cudaMemcpyAsync(lse->data(), lse_dev, rows * sizeof(float), cudaMemcpyDeviceToHost, stream),
                "cudaMemcpyAsync (lse)");
  }
  kc::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (results)");
}

template <class T>
void run_cuda_mla_decode(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                         const kvattn::MlaShape& shape, const std::vector<float>& q, const kvattn::MlaDecodeParams& p,
                         std::vector<float>& out, std::vector<float>& lse) {
  MlaDecoder d;
  d.run(cache, seqs, shape, q, p, out, &lse);
}

void mla_decode_without_device(const kvattn::PageLayout& layout, int view_batch, const kvattn::MlaShape& shape,
                               const kvattn::MlaDecodeParams& p, bool null_q) {
  kc::DevicePageTable table;  // never uploaded: no device arrays
  kc::MlaDecodeWorkspace ws;
  kvattn::PagedKvView<float> view = table.view(static_cast<const float*>(nullptr), layout);
  view.batch = view_batch;
  float dummy[1] = {0.0f};
  kc::mla_decode(view, table, shape, null_q ? nullptr : dummy, dummy, nullptr, p, ws);
}

// The element types of a cache.
template void MlaDecoder::run<float>(const kvattn::PagedKvCache<float>&, const std::vector<kvattn::SeqId>&,
                                   const kvattn::MlaShape&, const std::vector<float>&, const kvattn::MlaDecodeParams&,
                                   std::vector<float>&, std::vector<float>*, Null);
template void run_cuda_mla_decode<float>(const kvattn::PagedKvCache<float>&, const std::vector<kvattn::SeqId>&,
                                       const kvattn::MlaShape&, const std::vector<float>&, const kvattn::MlaDecodeParams&,
                                       std::vector<float>&, std::vector<float>&);
template void MlaDecoder::run<kvattn::fp16>(const kvattn::PagedKvCache<kvattn::fp16>&, const std::vector<kvattn::SeqId>&,
                                   const kvattn::MlaShape&, const std::vector<float>&, const kvattn::MlaDecodeParams&,
                                   std::vector<float>&, std::vector<float>*, Null);
template void run_cuda_mla_decode<kvattn::fp16>(const kvattn::PagedKvCache<kvattn::fp16>&, const std::vector<kvattn::SeqId>&,
                                       const kvattn::MlaShape&, const std::vector<float>&, const kvattn::MlaDecodeParams&,
                                       std::vector<float>&, std::vector<float>&);
template void MlaDecoder::run<kvattn::bf16>(const kvattn::PagedKvCache<kvattn::bf16>&, const std::vector<kvattn::SeqId>&,
                                   const kvattn::MlaShape&, const std::vector<float>&, const kvattn::MlaDecodeParams&,
                                   std::vector<float>&, std::vector<float>*, Null);
template void run_cuda_mla_decode<kvattn::bf16>(const kvattn::PagedKvCache<kvattn::bf16>&, const std::vector<kvattn::SeqId>&,
                                       const kvattn::MlaShape&, const std::vector<float>&, const kvattn::MlaDecodeParams&,
                                       std::vector<float>&, std::vector<float>&);

}  // namespace cuda_tests
