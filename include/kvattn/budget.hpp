// kvattn/budget.hpp — how many bytes a KV cache holds, and how many tokens fit in memory.
//
// Elements cached per token per layer (DESIGN.md):
//   MHA, GQA, MQA   2 · kv_heads · head_dim        (a key and a value per KV head)
//   MLA             latent_dim + rope_dim          (one latent and one rotary key, all heads)
// Bytes multiply by bits per element / 8, a sequence by layers and tokens, a batch by its
// sequences. Element widths may be fractional (4.5 bits: 4-bit values plus a scale per 32);
// byte counts of widths that do not fill whole bytes round up once, at the level asked for
// (the cache as one packed stream), never per element.
//
// Everything but parsing and the design comparison is constexpr: a configuration can be
// checked by static_assert. Integer arithmetic is exact and checked: a count that does not fit
// in 64 bits is an error, never a wrapped number.
#pragma once

#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"
#include "model.hpp"
#include "shape.hpp"

namespace kvattn {

namespace detail {
constexpr std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a)
    raise<invalid_argument>(concat("size overflow: ", a, " * ", b, " does not fit in 64 bits"));
  return a * b;
}
constexpr std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) noexcept { return a / b + (a % b != 0); }
}  // namespace detail

/// Bits per element as an exact fraction: 16, 8, 6, 4.5 (= 9/2), 4.25 (= 17/4).
class ElementBits {
 public:
  constexpr ElementBits(unsigned bits = 16) : num_(bits), den_(1) {  // NOLINT: 16 reads as a width
    if (bits == 0) raise<invalid_argument>("bits per element must be positive, got 0");
  }
  constexpr ElementBits(std::uint32_t num, std::uint32_t den) : num_(num), den_(den) {
    if (num == 0 || den == 0)
      raise<invalid_argument>(detail::concat("bits per element ", num, "/", den, " must be positive"));
    const std::uint32_t g = std::gcd(num_, den_);
    num_ /= g;
    den_ /= g;
  }

  /// Parses a positive decimal: "16", "4.5", "6.25". Throws kvattn::invalid_argument otherwise.
  static ElementBits parse(std::string_view text) {
    const auto bad = [&] {
      raise<invalid_argument>("bits per element '" + std::string(text) + "': expected a positive decimal such as 16 or 4.5");
    };
    std::uint64_t num = 0, den = 1;
    bool digits = false, point = false;
    for (char c : text) {
      if (c == '.' && !point) {
        point = true;
      } else if (c >= '0' && c <= '9') {
        digits = true;
        num = num * 10 + static_cast<std::uint64_t>(c - '0');
        if (point) den *= 10;
        if (num > 1'000'000 || den > 1'000'000) bad();
      } else {
        bad();
      }
    }
    if (!digits || num == 0) bad();
    return ElementBits(static_cast<std::uint32_t>(num), static_cast<std::uint32_t>(den));
  }

  constexpr std::uint32_t numerator() const noexcept { return num_; }
  constexpr std::uint32_t denominator() const noexcept { return den_; }
  constexpr double value() const noexcept { return static_cast<double>(num_) / den_; }

  /// Bytes that `elements` elements fill, rounded up to a whole byte.
  constexpr std::uint64_t bytes_for(std::uint64_t elements) const {
    return detail::ceil_div(detail::checked_mul(elements, num_), std::uint64_t{8} * den_);
  }
  /// "16", "4.5", "17/3" (a fraction when it has no short decimal form).
  std::string to_string() const {
    std::uint64_t scale = 1;
    while (scale < 1'000'000 && (scale * num_) % den_ != 0) scale *= 10;
    if ((scale * num_) % den_ != 0) return detail::concat(num_, "/", den_);
    std::string digits = std::to_string(scale * num_ / den_);
    std::size_t decimals = 0;
    for (std::uint64_t s = scale; s > 1; s /= 10) ++decimals;
    if (decimals == 0) return digits;
    if (digits.size() <= decimals) digits.insert(0, decimals + 1 - digits.size(), '0');
    digits.insert(digits.size() - decimals, ".");
    return digits;
  }

  friend constexpr bool operator==(ElementBits a, ElementBits b) noexcept {
    return a.num_ == b.num_ && a.den_ == b.den_;
  }
  friend constexpr bool operator!=(ElementBits a, ElementBits b) noexcept { return !(a == b); }

 private:
  std::uint32_t num_;
  std::uint32_t den_;
};

// ---------------------------------------------------------------------------------------------
// Footprint: elements and bytes per token per layer, per token, per sequence, per batch.

constexpr std::uint64_t elements_per_token_layer(const GqaShape& s) noexcept {
  return 2 * static_cast<std::uint64_t>(s.kv_heads) * static_cast<std::uint64_t>(s.head_dim);
}
constexpr std::uint64_t elements_per_token_layer(const MlaShape& s) noexcept {
  return static_cast<std::uint64_t>(s.latent_dim) + static_cast<std::uint64_t>(s.rope_dim);
}
constexpr std::uint64_t elements_per_token_layer(const AttentionShape& a) noexcept {
  return std::holds_alternative<MlaShape>(a) ? elements_per_token_layer(std::get<MlaShape>(a))
                                             : elements_per_token_layer(std::get<GqaShape>(a));
}

/// What a cache holds for `batch` sequences of `context` tokens each.
struct Workload {
  std::uint64_t context = 4096;  ///< tokens per sequence, T
  std::uint64_t batch = 1;       ///< sequences, B
  ElementBits bits = 16;         ///< bits per cached element
};

struct Footprint {
  std::uint64_t elements_per_token_layer = 0;
  std::uint64_t elements_per_token = 0;  ///< × layers
  std::uint64_t bytes_per_token_layer = 0;
  std::uint64_t bytes_per_token = 0;     ///< all layers
  std::uint64_t bytes_per_sequence = 0;  ///< all layers, T tokens
  std::uint64_t bytes_per_batch = 0;     ///< all layers, T tokens, B sequences
};

constexpr Footprint footprint(const Model& model, const Workload& w) {
  if (!model.valid()) raise<shape_error>("footprint of an invalid model: " + model.check());
  Footprint f;
  f.elements_per_token_layer = elements_per_token_layer(model.attention);
  f.elements_per_token = detail::checked_mul(f.elements_per_token_layer, static_cast<std::uint64_t>(model.layers));
  const std::uint64_t sequence = detail::checked_mul(f.elements_per_token, w.context);
  f.bytes_per_token_layer = w.bits.bytes_for(f.elements_per_token_layer);
  f.bytes_per_token = w.bits.bytes_for(f.elements_per_token);
  f.bytes_per_sequence = w.bits.bytes_for(sequence);
  f.bytes_per_batch = w.bits.bytes_for(detail::checked_mul(sequence, w.batch));
  return f;
}

// ---------------------------------------------------------------------------------------------
// The same model cached another way.

/// The model with its keys and values cached as `design`, its query heads unchanged. An MLA
/// model as MHA, GQA or MQA uses head_dim = nope_dim (d_h), as DESIGN.md and the DeepSeek-V2
/// paper compare them. GQA needs `groups` (KV heads) dividing the query heads; MLA needs a
/// model that is MLA already (a latent width cannot be made up).
constexpr Model as_design(const Model& model, Design design, int groups = 8) {
  if (!model.valid()) raise<shape_error>("as_design of an invalid model: " + model.check());
  if (design == Design::mla) {
    if (!model.is_mla())
      raise<shape_error>("model '" + std::string(model.name) +
                         "' is not MLA: its latent and rotary widths are unknown, so it has no MLA form");
    return model;
  }
  const int heads = model.q_heads();
  const int head_dim = model.is_mla() ? model.mla().nope_dim : model.gqa().head_dim;
  GqaShape shape = design == Design::mha ? GqaShape::mha(heads, head_dim)
                 : design == Design::mqa ? GqaShape::mqa(heads, head_dim)
                                         : GqaShape::gqa(heads, groups, head_dim);
  if (!shape.valid())
    raise<shape_error>(detail::concat("model '", model.name, "' as GQA with ", groups, " groups: ", shape.check()));
  return Model{model.name, model.layers, shape};
}

/// KV heads for a model's GQA form: its own when it is GQA, else the largest divisor of its
/// query heads that is at most 8 (8 groups is the common choice).
constexpr int default_gqa_groups(const Model& model) noexcept {
  if (!model.is_mla() && model.design() == Design::gqa) return model.gqa().kv_heads;
  int g = model.q_heads() < 8 ? model.q_heads() : 8;
  while (g > 1 && model.q_heads() % g != 0) --g;
  return g;
}

/// The model as MHA, GQA (default_gqa_groups), MQA, and MLA where it is MLA, in that order.
inline std::vector<Model> compare_designs(const Model& model) {
  std::vector<Model> rows{as_design(model, Design::mha), as_design(model, Design::gqa, default_gqa_groups(model)),
                          as_design(model, Design::mqa)};
  if (model.is_mla()) rows.push_back(model);
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Capacity under tensor parallelism.

/// How one layer's cache is split across `ranks` tensor-parallel ranks. Query heads are split
/// evenly. GQA-family KV heads are split when ranks <= kv_heads; when ranks outnumber them,
/// each rank holds one KV head and each head is replicated on ranks / kv_heads ranks. MLA's
/// latent serves every head, so every rank holds all of it (replicated `ranks` times).
struct ShardLayout {
  int ranks = 1;
  int kv_heads_per_rank = 0;  ///< GQA family: KV heads on one rank; MLA: 1 (the shared latent)
  int replication = 1;        ///< ranks holding each KV head (or the latent)
  std::uint64_t elements_per_token_layer_per_rank = 0;
};

constexpr ShardLayout shard(const Model& model, int ranks) {
  if (!model.valid()) raise<shape_error>("shard of an invalid model: " + model.check());
  if (ranks <= 0) raise<invalid_argument>(detail::concat("tensor_parallel=", ranks, ": must be positive"));
  const int heads = model.q_heads();
  if (heads % ranks != 0)
    raise<shape_error>(detail::concat("tensor_parallel=", ranks, " q_heads=", heads,
                                      ": query heads must split evenly across ranks"));
  ShardLayout s;
  s.ranks = ranks;
  if (model.is_mla()) {
    s.kv_heads_per_rank = 1;
    s.replication = ranks;
    s.elements_per_token_layer_per_rank = elements_per_token_layer(model.mla());
    return s;
  }
  const GqaShape& g = model.gqa();
  if (ranks <= g.kv_heads) {
    if (g.kv_heads % ranks != 0)
      raise<shape_error>(detail::concat("tensor_parallel=", ranks, " kv_heads=", g.kv_heads,
                                        ": KV heads must split evenly across ranks"));
    s.kv_heads_per_rank = g.kv_heads / ranks;
    s.replication = 1;
  } else {
    if (ranks % g.kv_heads != 0)
      raise<shape_error>(detail::concat("tensor_parallel=", ranks, " kv_heads=", g.kv_heads,
                                        ": with more ranks than KV heads, ranks must be a multiple of KV heads"));
    s.kv_heads_per_rank = 1;
    s.replication = ranks / g.kv_heads;
  }
  s.elements_per_token_layer_per_rank = 2 * static_cast<std::uint64_t>(s.kv_heads_per_rank) * g.head_dim;
  return s;
}

/// Memory of one device (rank) and what must share it with the cache.
struct CapacityRequest {
  std::uint64_t device_bytes = 0;  ///< memory of one device
  std::uint64_t weight_bytes = 0;  ///< weights of the whole model; each rank holds 1/tensor_parallel
  std::uint64_t context = 4096;    ///< tokens per sequence, for `sequences`
  ElementBits bits = 16;
  int tensor_parallel = 1;
  int page_size = 1;               ///< tokens per page; a sequence holds whole pages
};

struct CapacityPlan {
  ShardLayout layout;
  std::uint64_t weight_bytes_per_rank = 0;
  std::uint64_t cache_bytes_per_rank = 0;       ///< device − weights
  std::uint64_t bytes_per_token_per_rank = 0;   ///< all layers
  std::uint64_t bytes_per_token_all_ranks = 0;  ///< what the whole group spends per token
  std::uint64_t bytes_per_page_per_rank = 0;
  std::uint64_t pages = 0;      ///< pages that fit on each rank
  std::uint64_t tokens = 0;     ///< tokens that fit (each rank holds its share of every token)
  std::uint64_t sequences = 0;  ///< sequences of `context` tokens that fit
};

constexpr CapacityPlan plan_capacity(const Model& model, const CapacityRequest& r) {
  if (r.page_size <= 0) raise<invalid_argument>(detail::concat("page_size=", r.page_size, ": must be positive"));
  if (r.context == 0) raise<invalid_argument>("context=0: a sequence holds at least one token");
  CapacityPlan p;
  p.layout = shard(model, r.tensor_parallel);
  const auto ranks = static_cast<std::uint64_t>(r.tensor_parallel);
  p.weight_bytes_per_rank = detail::ceil_div(r.weight_bytes, ranks);
  if (p.weight_bytes_per_rank >= r.device_bytes)
    raise<capacity_error>(detail::concat("weights of ", r.weight_bytes, " bytes over ", ranks, " ranks (",
                                         p.weight_bytes_per_rank, " per rank) leave nothing of ",
                                         r.device_bytes, " device bytes for the cache"));
  p.cache_bytes_per_rank = r.device_bytes - p.weight_bytes_per_rank;
  const std::uint64_t per_token =
      detail::checked_mul(p.layout.elements_per_token_layer_per_rank, static_cast<std::uint64_t>(model.layers));
  p.bytes_per_token_per_rank = r.bits.bytes_for(per_token);
  p.bytes_per_token_all_ranks = detail::checked_mul(p.bytes_per_token_per_rank, ranks);
  p.bytes_per_page_per_rank = r.bits.bytes_for(detail::checked_mul(per_token, static_cast<std::uint64_t>(r.page_size)));
  p.pages = p.cache_bytes_per_rank / p.bytes_per_page_per_rank;
  p.tokens = p.pages * static_cast<std::uint64_t>(r.page_size);
  p.sequences = p.pages / detail::ceil_div(r.context, static_cast<std::uint64_t>(r.page_size));
  return p;
}

}  // namespace kvattn
