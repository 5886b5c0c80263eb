// Compiled for the baseline instruction set of the target (see CMakeLists.txt), linked into the
// same program as test_isa_link.cpp, which is compiled with -march=native.
#include <kvattn/decode.hpp>
#include <kvattn/rope.hpp>
#include <kvattn/storage.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <vector>

namespace isa_link {
std::string_view baseline_isa() { return kvattn::isa::native::name; }
void baseline_fp32_to_bf16(const float* src, kvattn::bf16* dst, std::size_t n) { kvattn::convert_row(src, dst, n); }

// A tag richer than this unit's target runs the target's own kernels (config.hpp: compiled_isa_t).
static_assert(std::is_same_v<kvattn::compiled_isa_t<kvattn::isa::avx512>, kvattn::isa::native> &&
                  std::is_same_v<kvattn::compiled_isa_t<kvattn::isa::avx2>, kvattn::isa::native> &&
                  std::is_same_v<kvattn::compiled_isa_t<kvattn::isa::neon>, kvattn::isa::scalar>,
              "a build for the x86-64 baseline compiles the scalar path alone");

namespace {
/// Decode over a small bf16 cache (head size 64, groups of 2, 37 tokens), then RoPE on its output,
/// with the instruction-set tag Isa.
template <class Isa> std::vector<float> decode_then_rope(Isa) {
  const kvattn::GqaShape shape = kvattn::GqaShape::gqa(4, 2, 64);
  kvattn::PagedKvCache<kvattn::bf16> cache(kvattn::CacheConfig{1, 16, 4, shape});
  const kvattn::SeqId seq = cache.add_sequence();
  cache.append(seq, 37);
  std::vector<float> k(2 * 64), v(2 * 64);
  for (std::int64_t t = 0; t < 37; ++t) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = std::sin(0.37f * static_cast<float>(t) + 0.11f * static_cast<float>(i));
      v[i] = std::cos(0.23f * static_cast<float>(t) - 0.07f * static_cast<float>(i));
    }
    cache.write(seq, 0, t, k.data(), v.data());
  }
  const kvattn::BatchPageTable table = cache.page_table({seq});
  std::vector<float> q(4 * 64), out(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.05f * static_cast<float>(i));
  kvattn::DecodePlan plan;
  plan.make(cache.view(table, 0), shape, kvattn::DecodeParams{}, 1);
  kvattn::decode(cache.view(table, 0), q.data(), out.data(), nullptr, plan, kvattn::SerialFor{}, kvattn::Plain{}, Isa{});
  kvattn::RopeConfig config;
  config.head_dim = 64;
  const kvattn::Rope rope(config);
  const std::int64_t position = 36;
  kvattn::apply_rope(rope, out.data(), 1, 4, &position, Isa{});
  return out;
}
}  // namespace

bool baseline_richer_tags_run_its_kernels() {
  const std::vector<float> scalar = decode_then_rope(kvattn::isa::scalar{});
  const std::vector<float> avx2 = decode_then_rope(kvattn::isa::avx2{});
  const std::vector<float> avx512 = decode_then_rope(kvattn::isa::avx512{});
  const std::size_t bytes = scalar.size() * sizeof(float);
  return std::memcmp(scalar.data(), avx2.data(), bytes) == 0 && std::memcmp(scalar.data(), avx512.data(), bytes) == 0;
}
}  // namespace isa_link
