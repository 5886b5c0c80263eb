// A consumer of the compiled kernels: includes kvattn/kernels.hpp alone, instantiates no kernel,
// and decodes one step through the dispatcher.
#include <kvattn/kernels.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const kvattn::GqaShape shape = kvattn::GqaShape::gqa(8, 2, 64);
  kvattn::PagedKvCache<kvattn::bf16> cache(kvattn::CacheConfig{1, 16, 8, shape});
  const kvattn::SeqId seq = cache.add_sequence();
  cache.append(seq, 20);
  std::vector<float> k(2 * 64, 0.25f), v(2 * 64, 0.5f);  // every token the same: out = v
  for (std::int64_t t = 0; t < 20; ++t) cache.write(seq, 0, t, k.data(), v.data());
  const kvattn::BatchPageTable table = cache.page_table({seq});
  kvattn::ThreadPool pool(2);
  kvattn::DecodePlan plan;
  plan.make(cache.view(table, 0), shape, kvattn::DecodeParams{}, pool);
  std::vector<float> q(8 * 64, 0.1f), out(q.size()), lse(8);
  kvattn::kernels::decode(cache.view(table, 0), q.data(), out.data(), lse.data(), plan, pool);
  std::printf("kvattn::kernels (%s): out[0] = %g\n", kvattn::kernels::isa().data(), static_cast<double>(out[0]));
  return std::abs(out[0] - 0.5f) < 1e-6f ? 0 : 1;
}
