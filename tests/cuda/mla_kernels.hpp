// tests/cuda/mla_kernels.hpp — kvattn::cuda::mla_decode (kvattn/cuda/mla_decode.hpp) behind plain
// C++ functions: host cache and queries in, host results out. The test files that include it are
// compiled by the host compiler; the device copies and launches live in mla_kernels.cu.
#pragma once

#include <kvattn/mla_decode.hpp>
#include <kvattn/paged_cache.hpp>
#include <kvattn/shape.hpp>

#include <cstddef>
#include <memory>
#include <vector>

namespace cuda_tests {

/// A device copy of a host cache's layer 0 and one MLA decode workspace and stream, kept across
/// calls (the workspace grows and is reused as in a serving loop).
class MlaDecoder {
 public:
  MlaDecoder();
  ~MlaDecoder();
  MlaDecoder(const MlaDecoder&) = delete;
  MlaDecoder& operator=(const MlaDecoder&) = delete;

  /// Which device pointer to pass as null (the call must then throw invalid_argument).
  enum class Null { none, q, out };

  /// Copies layer 0 of `cache`, the page table of `seqs` and q [B][Q][heads][latent + rope] to
  /// the device, runs kvattn::cuda::mla_decode on this decoder's stream, and copies out
  /// [B][Q][heads][latent] and, when `lse` is not null, lse [B][Q][heads] back (both resized).
  /// The device outputs are filled with NaN first, so an element the kernels miss shows.
  template <class T>
  void run(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::MlaShape& shape,
           const std::vector<float>& q, const kvattn::MlaDecodeParams& p, std::vector<float>& out, std::vector<float>* lse,
           Null null = Null::none);

  /// Bytes of device memory the workspace holds.
  std::size_t workspace_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// One call with a fresh decoder: out and lse of the batch `seqs`.
template <class T>
void run_cuda_mla_decode(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                         const kvattn::MlaShape& shape, const std::vector<float>& q, const kvattn::MlaDecodeParams& p,
                         std::vector<float>& out, std::vector<float>& lse);

/// Calls kvattn::cuda::mla_decode over a view of `layout` that claims `view_batch` sequences but
/// reads no device array (its page table was never uploaded), with null q when `null_q`, else
/// dummy non-null q and out. Every argument check must throw before the device is touched;
/// an empty batch with good arguments must return without touching it.
void mla_decode_without_device(const kvattn::PageLayout& layout, int view_batch, const kvattn::MlaShape& shape,
                               const kvattn::MlaDecodeParams& p, bool null_q);

}  // namespace cuda_tests
