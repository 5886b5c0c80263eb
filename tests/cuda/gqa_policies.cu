// tests/cuda/gqa_policies.cu — run_decode (gqa_kernels.hpp) for the score policies: each
// instantiates every decode kernel again, so they have a translation unit of their own. The
// window and the soft-cap on fp16 (as before the policies had names); sinks, ALiBi, tree masks and
// gpt-oss's composition on bf16: the hooks act on scores, whatever the storage.
#include <kvattn/policy.hpp>

#include "gqa_run.cuh"

using Gpt = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;
using WindowCap = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap>;

CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::fp16, kvattn::SlidingWindow)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::fp16, kvattn::SoftCap)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::fp16, WindowCap)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::bf16, kvattn::Sinks)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::bf16, kvattn::Alibi)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::bf16, kvattn::TreeMask)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::bf16, Gpt)
