// kvattn's AVX-512 kernels (isa_kernels.hpp) for fp8_e4m3_row storage, and for q4_block storage with the
// plain policy only (isa_kernels.hpp's kPlainOnly), compiled with
// -march=x86-64-v4 whatever the machine that builds them has (tests/CMakeLists.txt);
// test_x86_isas.cpp runs them where the CPU can. Decode and prefill only: MLA caches and
// convert_row do not take them.
#include "isa_kernels_impl.hpp"

static_assert(KVATTN_HAS_AVX512, "isa_kernels_avx512_fp8.cpp must be compiled with -march=x86-64-v4");

ISA_KERNELS_INSTANTIATE_QUANTIZED(kvattn::isa::avx512, kvattn::fp8_e4m3_row)
ISA_KERNELS_INSTANTIATE_QUANTIZED(kvattn::isa::avx512, kvattn::q4_block)
