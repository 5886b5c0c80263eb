// kvattn's AVX-512 kernels (isa_kernels.hpp) for fp8_e4m3_row storage, compiled with
// -march=x86-64-v4 whatever the machine that builds them has (tests/CMakeLists.txt);
// test_x86_isas.cpp runs them where the CPU can. Decode and prefill only: MLA caches and
// convert_row do not take fp8.
#include "isa_kernels_impl.hpp"

static_assert(KVATTN_HAS_AVX512, "isa_kernels_avx512_fp8.cpp must be compiled with -march=x86-64-v4");

ISA_KERNELS_INSTANTIATE_QUANTIZED(kvattn::isa::avx512, kvattn::fp8_e4m3_row)
