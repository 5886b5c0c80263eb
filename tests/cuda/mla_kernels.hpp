// tests/cuda/mla_kernels.hpp — kvattn::cuda::mla_decode (kvattn/cuda/mla_decode.hpp) behind plain
// C++ functions: host cache and queries in, host results out. The test files that include it are
// compiled by the host compiler; the device copies and launches live in mla_kernels.cu.
#pragma once

#include <kvattn/core.hpp>
#include <kvattn/paged_cache.hpp>
#include <kvattn/policy.hpp>
#include <kvattn/shape.hpp>

#include <cstddef>
#include <memory>
#include <vector>

namespace cuda_tests {

/// One MLA decode plan, policy arrays and stream, kept across calls (the plan grows and is reused
/// as in a serving loop).
class MlaDecoder {
 public:
  MlaDecoder();
  ~MlaDecoder();
  MlaDecoder(const MlaDecoder&) = delete;
  MlaDecoder& operator=(const MlaDecoder&) = delete;

  /// Which device pointer to pass as null (the call must then throw invalid_argument).
  enum class Null { none, q, out };

  /// Copies `cache` (the sequences `seqs`) to a device cache and q [B][Q][heads][latent + rope]
  /// to the device, plans the step (cuda::DecodePlan::make with p), copies the policy's arrays to
  /// the device (cuda::PolicyArrays), runs kvattn::cuda::mla_decode on this decoder's stream, and
  /// copies out [B][Q][heads][latent] and, when `lse` is not null, lse [B][Q][heads] back (both
  /// resized). The device outputs are filled with NaN first, so an element the kernels miss shows.
  /// Instantiated in mla_kernels.cu (Plain) and mla_policies.cu.
  template <class T, class P>
  void run(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::MlaShape& shape,
           const std::vector<float>& q, const kvattn::DecodeParams& p, const P& policy, std::vector<float>& out,
           std::vector<float>* lse, Null null = Null::none);
  /// run() without a policy (Plain).
  template <class T>
  void run(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::MlaShape& shape,
           const std::vector<float>& q, const kvattn::DecodeParams& p, std::vector<float>& out, std::vector<float>* lse,
           Null null = Null::none) {
    run(cache, seqs, shape, q, p, kvattn::Plain{}, out, lse, null);
  }

  /// Bytes of device memory the plan holds.
  std::size_t plan_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// One call with a fresh decoder: out and lse of the batch `seqs`.
template <class T, class P = kvattn::Plain>
void run_cuda_mla_decode(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs,
                         const kvattn::MlaShape& shape, const std::vector<float>& q, const kvattn::DecodeParams& p,
                         std::vector<float>& out, std::vector<float>& lse, const P& policy = P{}) {
  MlaDecoder d;
  d.run(cache, seqs, shape, q, p, policy, out, &lse);
}

/// Plans an empty batch of a host cache of format T and `cache_shape` (the plan reads only the
/// cache's bookkeeping; an empty batch needs no device) with `shape` and `p`, then calls
/// kvattn::cuda::mla_decode over a view that claims `view_batch` sequences but reads no device
/// array, with null q when `null_q`, else dummy non-null q and out. Every argument check must
/// throw before the device is touched; an empty batch with good arguments must return without
/// touching it. Instantiated for fp32, fp8_e4m3_latent and int8_latent.
template <class T = float>
void mla_decode_without_device(const kvattn::AttentionShape& cache_shape, int view_batch, const kvattn::MlaShape& shape,
                               const kvattn::DecodeParams& p, bool null_q);

/// Bytes of shared memory one block of kvattn::cuda::mla_decode takes on a cache of format T of
/// `shape` on a device that allows `shared_optin` per block (its launch geometry). Instantiated
/// for fp32, bf16, fp8_e4m3_latent and int8_latent.
template <class T> std::size_t mla_block_shared_bytes(const kvattn::MlaShape& shape, int shared_optin);

}  // namespace cuda_tests
