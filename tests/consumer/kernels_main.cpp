// A consumer of the compiled kernels: includes kvattn/kernels.hpp alone, instantiates no kernel,
// and runs a prefill, a decode step and an MLA decode step through the dispatcher.
#include <kvattn/kernels.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  kvattn::ThreadPool pool(2);
  bool ok = true;

  // GQA: a prompt of 20 tokens whose keys are all the same and values all 0.5 (so every output
  // is 0.5), prefilled in one chunk, then one decode step over them.
  const kvattn::GqaShape shape = kvattn::GqaShape::gqa(8, 2, 64);
  kvattn::PagedKvCache<kvattn::bf16> cache(kvattn::CacheConfig{1, 16, 8, shape});
  const kvattn::SeqId seq = cache.add_sequence();
  cache.append(seq, 20);
  std::vector<float> q(20 * 8 * 64, 0.1f), k(20 * 2 * 64, 0.25f), v(20 * 2 * 64, 0.5f), out(q.size()), lse(20 * 8);
  kvattn::PrefillPlan prefill_plan;
  prefill_plan.make(cache, kvattn::ChunkBatch{{seq, 20}}, shape, kvattn::PrefillParams{}, pool);
  kvattn::kernels::prefill(cache, 0, q.data(), k.data(), v.data(), out.data(), lse.data(), prefill_plan, pool);
  ok = ok && std::abs(out[0] - 0.5f) < 1e-6f && std::abs(out.back() - 0.5f) < 1e-6f;

  const kvattn::BatchPageTable table = cache.page_table({seq});
  kvattn::DecodePlan plan;
  plan.make(cache.view(table, 0), shape, kvattn::DecodeParams{}, pool);
  kvattn::kernels::decode(cache.view(table, 0), q.data(), out.data(), lse.data(), plan, pool);
  ok = ok && std::abs(out[0] - 0.5f) < 1e-6f;

  // MLA: 12 cached latents all 0.5 (rotary keys 0): the attention in latent space is 0.5.
  const kvattn::MlaShape mla{4, 128, 16, 32, 32, 0};
  kvattn::PagedKvCache<kvattn::bf16> latents(kvattn::CacheConfig{1, 16, 2, mla});
  const kvattn::SeqId s = latents.add_sequence();
  latents.append(s, 12);
  std::vector<float> c(12 * 128, 0.5f), rope(12 * 16, 0.0f), mq(4 * (128 + 16), 0.1f), mout(4 * 128);
  latents.write_latent(s, 0, 0, 12, c.data(), rope.data());
  const kvattn::BatchPageTable mla_table = latents.page_table({s});
  kvattn::DecodePlan mla_plan;
  mla_plan.make(latents.view(mla_table, 0), mla, kvattn::DecodeParams{}, pool);
  kvattn::kernels::mla_decode(latents.view(mla_table, 0), mq.data(), mout.data(), nullptr, mla_plan, pool);
  ok = ok && std::abs(mout[0] - 0.5f) < 1e-6f;

  std::printf("kvattn::kernels (%s): prefill, decode and MLA decode out[0] = %g, %g\n", kvattn::kernels::isa().data(),
              static_cast<double>(out[0]), static_cast<double>(mout[0]));
  return ok ? 0 : 1;
}
