// tests/cuda/mla_policies.cu — MlaDecoder::run (mla_kernels.hpp) for the score policies, on fp32,
// bf16 and fp8_e4m3_latent latents: each instantiates the MLA kernels again, so they have a
// translation unit of their own.
#include <kvattn/policy.hpp>

#include "mla_run.cuh"

using Gpt = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;
using WindowCap = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap>;

CUDA_TESTS_INSTANTIATE_MLA_RUN(float, kvattn::Sinks)
CUDA_TESTS_INSTANTIATE_MLA_RUN(float, kvattn::Alibi)
CUDA_TESTS_INSTANTIATE_MLA_RUN(float, kvattn::TreeMask)
CUDA_TESTS_INSTANTIATE_MLA_RUN(float, WindowCap)
CUDA_TESTS_INSTANTIATE_MLA_RUN(float, Gpt)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::bf16, Gpt)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::fp8_e4m3_latent, Gpt)
