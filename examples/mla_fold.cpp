// mla_fold — MLA's folded decode, step by step, on a small layer.
//
// A multi-head latent attention layer caches one latent per token instead of every head's key
// and value. Decoding can rebuild each head's keys and values from the latents (unfolded), or
// fold the up-projections into the query and the output and score straight against the
// latents (folded). This program builds a small random layer, feeds both caches the same prompt,
// decodes a few tokens both ways, and prints how far apart the two are and what each design
// caches per token.
//
//   build/release/examples/mla_fold
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports -Wmaybe-uninitialized inside Eigen's AVX-512 matrix products once they are
// inlined here (GCC bug 105593, a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, as -O1 and -O2 report it
#endif

#include <kvattn/budget.hpp>
#include <kvattn/mla.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  // 1. A small layer with DeepSeek-V2-Lite's proportions: 8 heads, a latent of 64, a rotary
  //    part of 16, heads of 32, hidden size 128, no query latent.
  const kvattn::MlaShape shape{/*heads*/ 8, /*latent_dim*/ 64, /*rope_dim*/ 16, /*nope_dim*/ 32, /*v_head_dim*/ 32,
                               /*q_latent_dim*/ 0};
  const int hidden = 128;
  std::mt19937 rng(7);
  const auto random = [&](int rows, int cols) {  // entries of size 1/sqrt(cols): activations stay O(1)
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> m(static_cast<std::size_t>(rows) * cols);
    for (float& x : m) x = dist(rng) / std::sqrt(static_cast<float>(cols));
    return m;
  };
  const int H = shape.heads;
  const auto w_uq = random(H * shape.qk_head_dim(), hidden), w_dkv = random(shape.latent_dim, hidden),
             w_kr = random(shape.rope_dim, hidden), w_uk = random(H * shape.nope_dim, shape.latent_dim),
             w_uv = random(H * shape.v_head_dim, shape.latent_dim), w_o = random(hidden, H * shape.v_head_dim);
  const kvattn::MlaWeights weights(shape, hidden,
                                   kvattn::MlaWeightArrays<float>{nullptr, w_uq.data(), w_dkv.data(), w_kr.data(),
                                                                  w_uk.data(), w_uv.data(), w_o.data()},
                                   kvattn::RopeConfig{kvattn::RopeStyle::gptj, shape.rope_dim, 0, 10000.0});

  // 2. The fold, once per layer: what a folded step multiplies by (W_UK on the query side, W_UV
  //    and W_O on the output side, the softmax scale folded in).
  const kvattn::MlaFolded folded = kvattn::fold(weights);
  std::printf("folded: query side %s, output side %s, %zu bytes of fp32 matrices\n",
              folded.fused_query ? "fused" : "apart", folded.fused_output ? "fused" : "apart", folded.bytes());

  // 3. Two caches (bf16 latents, pages of 16 tokens) holding the same 40-token prompt.
  const kvattn::CacheConfig config{/*layers*/ 1, /*page_size*/ 16, /*num_pages*/ 8, shape};
  kvattn::PagedKvCache<kvattn::bf16> unfolded_cache(config), folded_cache(config);
  const kvattn::SeqId a = unfolded_cache.add_sequence(), b = folded_cache.add_sequence();
  const auto prompt = random(40, hidden);
  std::vector<float> out(prompt.size());
  kvattn::MlaWorkspace ws;
  for (auto* cache : {&unfolded_cache, &folded_cache}) {
    const kvattn::SeqId seq = cache == &unfolded_cache ? a : b;
    cache->append(seq, 40);
    // A batch of one chunk: the sequence's last 40 tokens (all of it).
    kvattn::mla_prefill(weights, *cache, /*layer*/ 0, kvattn::ChunkBatch{{seq, 40}}, prompt.data(), out.data(), ws);
  }

  // 4. Decode five tokens both ways and compare. (A real decoder would feed each step's output
  //    through the rest of the model; here the next hidden state is random.)
  std::vector<float> y_unfolded(hidden), y_folded(hidden);
  kvattn::BatchPageTable table;
  kvattn::DecodePlan plan;  // kept across steps: it reuses its memory
  double worst = 0;
  for (int step = 0; step < 5; ++step) {
    const auto h = random(1, hidden);
    // Unfolded: append the token, then rebuild every cached token's keys and values.
    unfolded_cache.append(a, 1);
    kvattn::mla_prefill(weights, unfolded_cache, 0, kvattn::ChunkBatch{{a, 1}}, h.data(), y_unfolded.data(), ws);
    // Folded: append the token, write its latent, then plan the step (once, for every layer of
    // a real model; scale 0, as the fold carries the softmax scale) and attend straight over
    // the latents.
    folded_cache.append(b, 1);
    const std::int64_t position = folded_cache.length(b) - 1;
    kvattn::mla_append(weights, folded_cache, b, 0, position, 1, h.data(), ws);
    folded_cache.build_page_table(&b, 1, table);
    const kvattn::PagedKvView<kvattn::bf16> view = folded_cache.view(table, 0);
    plan.make(view, folded.shape, kvattn::DecodeParams{}, kvattn::SerialFor{});
    kvattn::mla_decode_layer(folded, view, h.data(), y_folded.data(), plan, ws);

    double diff = 0, size = 0;
    for (int i = 0; i < hidden; ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(y_folded[i] - y_unfolded[i])));
      size = std::max(size, static_cast<double>(std::abs(y_unfolded[i])));
    }
    worst = std::max(worst, diff / size);
    std::printf("step %d (position %lld): max |folded - unfolded| = %.2e, %.1e of the largest output (%.2e)\n",
                step, static_cast<long long>(position), diff, diff / size, size);
  }

  // 5. What each design caches per token and layer, here and at DeepSeek-V2's size.
  const auto report = [](const char* name, const kvattn::MlaShape& s) {
    const double mla = static_cast<double>(kvattn::elements_per_token_layer(s)) * 2;  // bf16
    const double mha = 2.0 * s.heads * s.v_head_dim * 2;  // K and V of every head, bf16
    std::printf("%s: MLA caches %.0f bytes per token and layer (latent %d + rotary key %d); MHA with these "
                "%d heads of %d would cache %.0f (%.1fx more)\n",
                name, mla, s.latent_dim, s.rope_dim, s.heads, s.v_head_dim, mha, mha / mla);
  };
  report("this layer", shape);
  report("DeepSeek-V2", kvattn::presets::deepseek_v2.model.mla());
  return worst < 1e-4 ? 0 : 1;  // fp32 rounding apart, the two ways agree
}
