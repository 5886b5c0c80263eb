// kvattn's AVX-512 kernels (isa_kernels.hpp), compiled with -march=x86-64-v4 whatever the machine
// that builds them has (tests/CMakeLists.txt); test_x86_isas.cpp runs them where the CPU can.
// fp32 storage and RoPE here; fp16 and bf16 in isa_kernels_avx512_fp16.cpp and
// isa_kernels_avx512_bf16.cpp: a storage type per translation unit, so that they compile in parallel.
#include "isa_kernels_impl.hpp"

static_assert(KVATTN_HAS_AVX512, "isa_kernels_avx512.cpp must be compiled with -march=x86-64-v4");

template struct isa_kernels::Kernels<kvattn::isa::avx512, kvattn::fp32>;
template void isa_kernels::apply_rope<kvattn::isa::avx512>(const kvattn::Rope&, float*, std::int64_t, int,
                                                            const std::int64_t*) noexcept;
