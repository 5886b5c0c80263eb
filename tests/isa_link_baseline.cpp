// Compiled for the baseline instruction set of the target (see CMakeLists.txt), linked into the
// same program as test_isa_link.cpp, which is compiled with -march=native.
#include <kvattn/storage.hpp>

#include <string_view>

namespace isa_link {
std::string_view baseline_isa() { return kvattn::isa::native::name; }
void baseline_fp32_to_bf16(const float* src, kvattn::bf16* dst, std::size_t n) { kvattn::convert_row(src, dst, n); }
}  // namespace isa_link
