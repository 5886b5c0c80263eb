// kvattn's AVX-512 kernels (isa_kernels.hpp) for bf16 storage, compiled with -march=x86-64-v4
// whatever the machine that builds them has (tests/CMakeLists.txt); test_x86_isas.cpp runs them
// where the CPU can. The other storage types: isa_kernels_avx512.cpp.
#include "isa_kernels_impl.hpp"

static_assert(KVATTN_HAS_AVX512, "isa_kernels_avx512_bf16.cpp must be compiled with -march=x86-64-v4");

template struct isa_kernels::Kernels<kvattn::isa::avx512, kvattn::bf16>;
