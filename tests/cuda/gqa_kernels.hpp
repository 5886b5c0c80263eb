// tests/cuda/gqa_kernels.hpp — the CUDA GQA-family operators behind plain C++ calls on host data,
// so that the tests themselves are compiled by the host compiler and compare against the same
// references as the CPU tests. Defined in gqa_kernels.cu (nvcc).
#pragma once

#include <kvattn/decode.hpp>
#include <kvattn/paged_cache.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace cuda_tests {

/// Copies layer 0 of `cache`'s pool and the page table of `seqs` to the device, runs
/// kvattn::cuda::decode<V> on q [batch][Q][q_heads][head_dim], and returns out and lse.
template <class T, class V>
void run_decode(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::GqaShape& shape,
                const std::vector<float>& q, const kvattn::DecodeParams& p, std::vector<float>& out, std::vector<float>& lse);

/// Calls kvattn::cuda::decode on an empty batch whose cache holds `cache_shape` (pages of 16,
/// fp16) with `shape` and `p` — the argument checks come before any device call, so this runs
/// without a GPU — and returns the message of what it throws ("" if nothing). variant: 0 plain,
/// 1 sliding window, 2 soft-cap. batch_mismatch: the view claims a batch the table does not have.
std::string decode_error(const kvattn::GqaShape& cache_shape, const kvattn::GqaShape& shape, const kvattn::DecodeParams& p,
                         int variant, bool batch_mismatch = false);

/// What one step of the append test does, on a host cache and on a device cache alike.
struct AppendStep {
  enum Kind { add, append, write, fork } kind;
  int seq = 0;                 ///< index into the sequences made so far (add: ignored)
  std::int64_t first = 0, count = 0;
  int layer = 0;
};

/// Runs `steps` on `cache` (any memory space), the sequences made in `seqs`; write(seq, step, row)
/// writes a write step's tokens from rows [row, row + count) of the step's keys and values.
/// Returns the message of the first step that throws ("" if none did); the steps after it are not run.
template <class Cache, class Write>
std::string replay(Cache& cache, const std::vector<AppendStep>& steps, std::vector<kvattn::SeqId>& seqs, Write&& write) {
  std::size_t row = 0;
  try {
    for (const AppendStep& s : steps) {
      switch (s.kind) {
        case AppendStep::add: seqs.push_back(cache.add_sequence()); break;
        case AppendStep::append: cache.append(seqs.at(static_cast<std::size_t>(s.seq)), s.count); break;
        case AppendStep::fork: seqs.push_back(cache.fork(seqs.at(static_cast<std::size_t>(s.seq)))); break;
        case AppendStep::write:
          write(seqs.at(static_cast<std::size_t>(s.seq)), s, row);
          row += static_cast<std::size_t>(s.count);
          break;
      }
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

/// Replays `steps` on a PagedKvCache<T, cuda::DeviceMemory> with `config` (writes through
/// cuda::write_kv of float keys and values [count][kv_heads][head_dim] taken in order from
/// `k`, `v`), then returns its whole pool copied to the host, and the page tables of its sequences.
/// A step that throws is reported through `error` (its message) and the replay stops there,
/// after also returning the pool.
template <class T>
void replay_on_device(const kvattn::CacheConfig& config, const std::vector<AppendStep>& steps, const std::vector<float>& k,
                      const std::vector<float>& v, std::vector<T>& pool, std::vector<std::vector<kvattn::PageId>>& tables,
                      std::string& error);

}  // namespace cuda_tests
