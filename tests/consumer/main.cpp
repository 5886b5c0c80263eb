// A consumer of kvattn: includes the umbrella header and checks one figure from DESIGN.md.
#include <kvattn/kvattn.hpp>

#include <cstdio>

int main() {
  const kvattn::Footprint f = kvattn::footprint(kvattn::presets::llama2_7b.model, kvattn::Workload{4096, 1, 16});
  const kvattn::bf16 half_of_pi = kvattn::from_float<kvattn::bf16>(1.5707963f);
  std::printf("kvattn %s (%s): Llama 2 7B holds %llu bytes per token; bf16(pi/2) = %g\n", KVATTN_VERSION_STRING,
              kvattn::isa::native::name.data(), static_cast<unsigned long long>(f.bytes_per_token),
              static_cast<double>(kvattn::to_float(half_of_pi)));
  return f.bytes_per_token == 524288 ? 0 : 1;
}
