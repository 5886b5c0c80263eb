// Two translation units that include the same kvattn headers for different instruction sets link
// into one program, and each keeps its own code: kvattn's inline functions live in a namespace
// named after the compiler's target (config.hpp), so the linker never has to pick one copy.
#include <kvattn/storage.hpp>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string_view>
#include <vector>

namespace isa_link {
std::string_view baseline_isa();
void baseline_fp32_to_bf16(const float* src, kvattn::bf16* dst, std::size_t n);
bool baseline_richer_tags_run_its_kernels();
}  // namespace isa_link

namespace {

TEST(IsaLink, TranslationUnitsForDifferentTargetsAgree) {
#define KVATTN_TEST_STR2(x) #x
#define KVATTN_TEST_STR(x) KVATTN_TEST_STR2(x)
  std::printf("this TU: %s (kvattn::%s); baseline TU: %s\n", kvattn::isa::native::name.data(),
              KVATTN_TEST_STR(KVATTN_TARGET_NAMESPACE), isa_link::baseline_isa().data());
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1e4f, 1e4f);
  std::vector<float> src(1000);
  for (float& x : src) x = dist(rng);
  std::vector<kvattn::bf16> native(src.size()), baseline(src.size());
  kvattn::convert_row(src.data(), native.data(), src.size());
  isa_link::baseline_fp32_to_bf16(src.data(), baseline.data(), src.size());
  EXPECT_EQ(std::memcmp(native.data(), baseline.data(), src.size() * sizeof(kvattn::bf16)), 0);
#if KVATTN_HAS_AVX2 || KVATTN_HAS_AVX512
  // Built for x86-64 with SIMD here and without it there: each TU reports its own ISA, which it
  // could not if the linker had folded the two copies of the inline functions into one.
  EXPECT_EQ(isa_link::baseline_isa(), "scalar");
  EXPECT_NE(kvattn::isa::native::name, isa_link::baseline_isa());
#endif
}

// decode and apply_rope called with isa::avx2{} and isa::avx512{} in the baseline unit, which is
// compiled for neither, run its scalar kernels: the same bits as with isa::scalar{}.
TEST(IsaLink, RicherTagsRunTheUnitsOwnKernels) { EXPECT_TRUE(isa_link::baseline_richer_tags_run_its_kernels()); }

}  // namespace
