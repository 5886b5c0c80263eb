// tests/cuda/gqa_formats.cu — run_decode (gqa_kernels.hpp) for the 8-bit formats (each
// instantiates every decode kernel again, so they have a translation unit of their own; the
// policies act on scores whatever the format, and are run on fp16 and bf16), and the
// check of a plan asking for int8 queries, which the GPU kernels do not have.
#include <kvattn/cuda/plan.hpp>

#include <string>

#include "gqa_run.cuh"

CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::int8_row, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::fp8_e4m3_row, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::fp8_e4m3_layer, kvattn::Plain)

namespace cuda_tests {

std::string int8_queries_error(const kvattn::GqaShape& shape) {
  try {
    const kvattn::PagedKvCache<kvattn::int8_row> cache(kvattn::CacheConfig{1, 16, 4, shape});
    kvattn::DecodeParams p;
    p.int8_queries = true;
    kvattn::cuda::DecodePlan plan;
    plan.make(cache, kvattn::BatchPageTable{}, shape, p);
  } catch (const kvattn::invalid_argument& e) {
    return e.what();
  }
  return {};
}

}  // namespace cuda_tests
