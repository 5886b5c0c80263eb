// kvattn's AVX2 kernels (isa_kernels.hpp) for int8_row storage (the
// rotation of hadamard<int8_row> is the same code on every ISA: test_decode checks it natively),
// compiled with -march=x86-64-v3 whatever the machine that builds them has (tests/CMakeLists.txt);
// test_x86_isas.cpp runs them where the CPU can. Decode and prefill only: MLA caches and
// convert_row do not take int8.
#include "isa_kernels_impl.hpp"

static_assert(KVATTN_HAS_AVX2 && !KVATTN_HAS_AVX512, "isa_kernels_avx2_int8.cpp must be compiled with -march=x86-64-v3");

ISA_KERNELS_INSTANTIATE_QUANTIZED(kvattn::isa::avx2, kvattn::int8_row)
