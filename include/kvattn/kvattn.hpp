// kvattn/kvattn.hpp — the whole library. Include this one header.
#pragma once

#include "config.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "model.hpp"
#include "budget.hpp"
#include "storage.hpp"
#include "eigen.hpp"
#include "memory.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "state.hpp"
#include "policy.hpp"
#include "simd.hpp"
#include "core.hpp"
#include "tile.hpp"
#include "decode.hpp"
#include "prefill.hpp"
#include "rope.hpp"
#include "append.hpp"
#include "mla_decode.hpp"
#include "mla.hpp"
#include "kernels.hpp"  // the compiled kernels: declarations, defined by the kvattn::kernels library

// The CUDA specializations, only in a translation unit compiled by nvcc with KVATTN_ENABLE_CUDA=1
// (the kvattn::cuda CMake target): an engine that never compiles CUDA never sees them.
#if defined(__CUDACC__) && defined(KVATTN_ENABLE_CUDA) && KVATTN_ENABLE_CUDA
#include "cuda/append.hpp"
#include "cuda/decode.hpp"
#include "cuda/mla_decode.hpp"
#include "cuda/plan.hpp"
#include "cuda/runtime.hpp"
#endif
