// tests/cuda/gqa_kernels.hpp — the CUDA GQA-family operators behind plain C++ calls on host data,
// so that the tests themselves are compiled by the host compiler and compare against the same
// references as the CPU tests. Defined in gqa_kernels.cu (nvcc).
#pragma once

#include <kvattn/core.hpp>
#include <kvattn/paged_cache.hpp>
#include <kvattn/policy.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace cuda_tests {

/// Copies `cache` (layer 0 of the sequences `seqs`) to a device cache, plans the step
/// (cuda::DecodePlan), copies the policy's arrays to the device (cuda::PolicyArrays, checked on
/// the host), runs kvattn::cuda::decode with it on q [batch][Q][q_heads][head_dim], and returns out
/// and lse. Instantiated in gqa_kernels.cu (Plain) and gqa_policies.cu (the other policies).
template <class T, class P>
void run_decode(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::GqaShape& shape,
                const std::vector<float>& q, const kvattn::DecodeParams& p, const P& policy, std::vector<float>& out,
                std::vector<float>& lse);

/// What decode_error does wrong.
enum class DecodeMisuse {
  none,            ///< nothing: an empty batch, which the call returns from
  window_zero,     ///< SlidingWindow{0}
  cap_zero,        ///< SoftCap{0}
  alibi_heads,     ///< Alibi of one head more than the shape's query heads
  tree_rows,       ///< TreeMask of 3 rows for the empty batch's 0
  batch_mismatch,  ///< a view that claims a sequence the plan does not have
  mla_plan,        ///< a plan made for an MLA shape
  never_made,      ///< a plan never made
};

/// Plans an empty batch of a host cache of `shape` (pages of 16, fp16: the plan reads only the
/// cache's bookkeeping, and an empty batch needs no device), then calls kvattn::cuda::decode
/// doing `misuse` — every check comes before any device call, so this runs without a GPU — and
/// returns the message of what it throws ("" if nothing).
std::string decode_error(const kvattn::GqaShape& shape, DecodeMisuse misuse);

/// The message of what cuda::DecodePlan::make throws for `shape` and `p` over a host cache of
/// `cache_shape` (one layer of 4 pages of 16 tokens, fp16) and `table` ("" if nothing): checks
/// that run without a GPU (an empty table needs none; a bad one is rejected first).
std::string plan_error(const kvattn::GqaShape& cache_shape, const kvattn::GqaShape& shape, const kvattn::DecodeParams& p,
                       const kvattn::BatchPageTable& table = {});

/// The message of what cuda::PolicyArrays::upload throws for `policy` with `q_heads` query heads
/// and one sequence of `rows` query rows ("" if it would copy): the host check, before any device call.
template <class P> std::string upload_error(const P& policy, int q_heads, std::int64_t rows);

/// The message of what cuda::DecodePlan::make throws for an empty batch of an int8_row host cache
/// of `shape` with DecodeParams::int8_queries ("" if nothing): no device needed.
std::string int8_queries_error(const kvattn::GqaShape& shape);

/// The view checks of cuda::DecodePlan (needs a GPU): the messages of DecodePlan::view for another
/// cache, for the plan's cache once it has changed, and for a layer out of range.
std::vector<std::string> view_errors();

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
