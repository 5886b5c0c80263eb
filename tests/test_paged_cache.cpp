// tests/test_paged_cache.cpp — PagedKvCache: every operation and every error.
//
// Every test runs for fp32, fp16 and bf16 storage (typed tests), and loops over page sizes 1, 3,
// 16 and 64 and over both page contents (GQA keys and values, MLA latent and rotary key). Token
// data is derived from a token id (value(id, layer, index)), with values that fp16 and bf16 hold
// exactly, so every read is compared bit for bit.
//
// Every rejected request is checked three ways: the exact exception type, a message that names
// the offending values, and a snapshot of the whole container (every live sequence's length and
// page table, the reference count of every page, the free count, stats() and the pool's bytes)
// that must be identical before and after.
#include <kvattn/paged_cache.hpp>

#include <gtest/gtest.h>

#include "cache_snapshot.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

namespace {

using kvattn::AttentionShape;
using kvattn::BatchPageTable;
using kvattn::CacheConfig;
using kvattn::CacheStats;
using kvattn::GqaShape;
using kvattn::MlaShape;
using kvattn::PageContent;
using kvattn::PageId;
using kvattn::PageLayout;
using kvattn::SeqId;
using kvattn::Slot;
template <class T> using Cache = kvattn::PagedKvCache<T>;
using Ids = std::vector<std::uint64_t>;

constexpr int kPageSizes[] = {1, 3, 16, 64};
constexpr int kLayers = 3;
// Awkward sizes: a head of 5 elements and a row of 11 fill no SIMD register and no cache line.
constexpr GqaShape kGqa = GqaShape::gqa(4, 2, 5);
constexpr MlaShape kMla{4, 7, 4, 8, 8, 0};
const AttentionShape kShapes[] = {kGqa, kMla};

CacheConfig config(const AttentionShape& shape, int page_size, std::int64_t num_pages, int layers = kLayers) {
  return CacheConfig{layers, page_size, num_pages, shape};
}

std::string describe(const AttentionShape& shape, int page_size) {
  return std::string(std::holds_alternative<MlaShape>(shape) ? "MLA" : "GQA") + " page_size=" + std::to_string(page_size);
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ---- token data ------------------------------------------------------------------------------

/// Entry `index` of token `id` in `layer`: a multiple of 1/4 in [-32, 31.75], exact in fp32,
/// fp16 and bf16, so a round trip through any of them is bit-exact.
float value(std::uint64_t id, int layer, std::int64_t index) {
  std::uint64_t x = id * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(layer) * 0xC2B2AE3D27D4EB4Full +
                    static_cast<std::uint64_t>(index) * 0x165667B19E3779F9ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int>(x & 255u) - 128) * 0.25f;
}

template <class T> std::uint32_t bits(T x) {
  if constexpr (sizeof(T) == 2) {
    std::uint16_t b;
    std::memcpy(&b, &x, 2);
    return b;
  } else {
    std::uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
  }
}

/// Elements of the first of a token's two parts: the keys (GQA) or the latent (MLA).
std::size_t first_part(const PageLayout& l) {
  return static_cast<std::size_t>(l.content == PageContent::gqa ? l.kv_heads * l.head_dim : l.latent_dim);
}

/// Token `id`'s entries in `layer` as write() takes them: GQA [kv_heads][head_dim] keys then
/// [kv_heads][head_dim] values; MLA [latent_dim] latent then [rope_dim] rotary key.
std::vector<float> token_values(const PageLayout& l, std::uint64_t id, int layer) {
  std::vector<float> v(static_cast<std::size_t>(l.token_elements()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(id, layer, static_cast<std::int64_t>(i));
  return v;
}

/// Writes tokens [first, first + ids.size()) of `s` in `layer` (token first + i gets ids[i]) with
/// one write() / write_latent() call, from elements of type Src.
template <class Src = float, class T>
void write_tokens(Cache<T>& c, SeqId s, int layer, std::int64_t first, const Ids& ids) {
  const PageLayout& l = c.layout();
  const std::size_t a = first_part(l), b = static_cast<std::size_t>(l.token_elements()) - a;
  std::vector<Src> x(ids.size() * a), y(ids.size() * b);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::vector<float> v = token_values(l, ids[i], layer);
    for (std::size_t j = 0; j < a; ++j) x[i * a + j] = kvattn::from_float<Src>(v[j]);
    for (std::size_t j = 0; j < b; ++j) y[i * b + j] = kvattn::from_float<Src>(v[a + j]);
  }
  const auto count = static_cast<std::int64_t>(ids.size());
  if (l.content == PageContent::gqa)
    c.write(s, layer, first, count, x.data(), y.data());
  else
    c.write_latent(s, layer, first, count, x.data(), y.data());
}

template <class T> void write_all_layers(Cache<T>& c, SeqId s, std::int64_t first, const Ids& ids) {
  for (int layer = 0; layer < c.config().layers; ++layer) write_tokens(c, s, layer, first, ids);
}

/// ids first, first + 1, ..., first + count - 1.
Ids id_range(std::uint64_t first, std::int64_t count) {
  Ids ids(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = first + i;
  return ids;
}

/// Another 16-bit type than T: bf16 for fp16, fp16 for bf16 and fp32.
template <class T> using Narrow = std::conditional_t<std::is_same_v<T, kvattn::fp16>, kvattn::bf16, kvattn::fp16>;

/// Token `position` of `s` in `layer` reads back as token `id`, bit for bit, through read() or
/// read_latent() into T, into fp32 and into another 16-bit type.
template <class T>
::testing::AssertionResult reads_as(const Cache<T>& c, SeqId s, int layer, std::int64_t position, std::uint64_t id) {
  const PageLayout& l = c.layout();
  const std::vector<float> want = token_values(l, id, layer);
  const std::size_t a = first_part(l);
  std::vector<T> got(want.size());
  std::vector<float> got32(want.size());
  std::vector<Narrow<T>> got16(want.size());  // a narrowing read when T is fp32
  if (l.content == PageContent::gqa) {
    c.read(s, layer, position, got.data(), got.data() + a);
    c.read(s, layer, position, got32.data(), got32.data() + a);
    c.read(s, layer, position, got16.data(), got16.data() + a);
  } else {
    c.read_latent(s, layer, position, got.data(), got.data() + a);
    c.read_latent(s, layer, position, got32.data(), got32.data() + a);
    c.read_latent(s, layer, position, got16.data(), got16.data() + a);
  }
  for (std::size_t i = 0; i < want.size(); ++i)
    if (bits(got[i]) != bits(kvattn::from_float<T>(want[i])) || bits(got32[i]) != bits(want[i]) ||
        bits(got16[i]) != bits(kvattn::from_float<Narrow<T>>(want[i])))
      return ::testing::AssertionFailure() << "seq " << s << " layer " << layer << " position " << position << " entry "
                                           << i << ": read " << kvattn::to_float(got[i]) << " / " << got32[i]
                                           << ", want " << want[i] << " (token id " << id << ")";
  return ::testing::AssertionSuccess();
}

/// Every token of `s` reads back as `ids` in every layer, and `s` holds exactly ids.size() tokens.
template <class T> ::testing::AssertionResult reads_all(const Cache<T>& c, SeqId s, const Ids& ids) {
  if (c.length(s) != static_cast<std::int64_t>(ids.size()))
    return ::testing::AssertionFailure() << "seq " << s << " holds " << c.length(s) << " tokens, want " << ids.size();
  for (int layer = 0; layer < c.config().layers; ++layer)
    for (std::size_t p = 0; p < ids.size(); ++p)
      if (auto r = reads_as(c, s, layer, static_cast<std::int64_t>(p), ids[p]); !r) return r;
  return ::testing::AssertionSuccess();
}

/// Token `offset` of page `page`, read from one layer's pool through the layout, in the order of
/// token_values().
template <class T> std::vector<T> raw_token(const T* layer_pool, const PageLayout& l, PageId page, int offset) {
  const T* p = layer_pool + std::int64_t{page} * l.page_stride;
  std::vector<T> out;
  if (l.content == PageContent::gqa) {
    for (int h = 0; h < l.kv_heads; ++h)
      for (int d = 0; d < l.head_dim; ++d) out.push_back(p[l.key(h, offset) + d]);
    for (int h = 0; h < l.kv_heads; ++h)
      for (int d = 0; d < l.head_dim; ++d) out.push_back(p[l.value(h, offset) + d]);
  } else {
    for (int d = 0; d < l.latent_dim; ++d) out.push_back(p[l.latent(offset) + d]);
    for (int d = 0; d < l.rope_dim; ++d) out.push_back(p[l.rope(offset) + d]);
  }
  return out;
}

template <class T>
::testing::AssertionResult raw_is(const std::vector<T>& raw, const PageLayout& l, std::uint64_t id, int layer) {
  const std::vector<float> want = token_values(l, id, layer);
  if (raw.size() != want.size()) return ::testing::AssertionFailure() << raw.size() << " entries, want " << want.size();
  for (std::size_t i = 0; i < want.size(); ++i)
    if (bits(raw[i]) != bits(kvattn::from_float<T>(want[i])))
      return ::testing::AssertionFailure() << "entry " << i << " is " << kvattn::to_float(raw[i]) << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

/// Runs write* and read* with the scalar conversions whatever this translation unit targets.
struct ScalarTarget {
  using isa = kvattn::isa::scalar;
};

// ---- snapshots of the whole container --------------------------------------------------------

using cache_snapshot::same_state;
using cache_snapshot::Snapshot;
using cache_snapshot::snapshot;

template <class E> std::string type_name() {
  if (typeid(E) == typeid(kvattn::shape_error)) return "kvattn::shape_error";
  if (typeid(E) == typeid(kvattn::invalid_argument)) return "kvattn::invalid_argument";
  if (typeid(E) == typeid(kvattn::capacity_error)) return "kvattn::capacity_error";
  return typeid(E).name();
}
std::string type_name(const std::exception& e) {
  if (typeid(e) == typeid(kvattn::shape_error)) return "kvattn::shape_error";
  if (typeid(e) == typeid(kvattn::invalid_argument)) return "kvattn::invalid_argument";
  if (typeid(e) == typeid(kvattn::capacity_error)) return "kvattn::capacity_error";
  return typeid(e).name();
}

/// `op` throws exactly E (not a type derived from it) with every one of `parts` in its message.
template <class E, class F> ::testing::AssertionResult throws(F&& op, std::initializer_list<std::string> parts) {
  try {
    op();
  } catch (const std::exception& e) {
    const std::string message = e.what();
    if (typeid(e) != typeid(E))
      return ::testing::AssertionFailure() << "threw " << type_name(e) << " (\"" << message << "\"), want "
                                           << type_name<E>();
    for (const std::string& part : parts)
      if (message.find(part) == std::string::npos)
        return ::testing::AssertionFailure() << "the message \"" << message << "\" does not name \"" << part << "\"";
    return ::testing::AssertionSuccess();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw something that is not a std::exception";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

/// As throws(), and `c` is exactly as it was before `op`.
template <class E, class T, class F>
::testing::AssertionResult rejects(const Cache<T>& c, F&& op, std::initializer_list<std::string> parts) {
  const Snapshot before = snapshot(c);
  if (auto r = throws<E>(op, parts); !r) return r;
  if (auto r = same_state(before, snapshot(c)); !r) return r << " (after a rejected request)";
  try {
    c.check_invariants();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "check_invariants: " << e.what();
  }
  return ::testing::AssertionSuccess();
}

std::string seq_is(const char* op, SeqId s) { return std::string(op) + "(seq=" + std::to_string(s); }

// ---- the typed suite -------------------------------------------------------------------------

template <class T> class PagedCache : public ::testing::Test {};
struct ElementName {
  template <class T> static std::string GetName(int) { return std::string(kvattn::storage_traits<T>::name); }
};
using ElementTypes = ::testing::Types<kvattn::fp32, kvattn::fp16, kvattn::bf16>;
TYPED_TEST_SUITE(PagedCache, ElementTypes, ElementName);

TYPED_TEST(PagedCache, LayoutGqaHeadBlocksStartOnCacheLines) {
  using T = TypeParam;
  const std::int64_t per_line = static_cast<std::int64_t>(kvattn::kAlignment / sizeof(T));
  for (int P : kPageSizes)
    for (GqaShape shape : {kGqa, GqaShape::mha(8, 64), GqaShape::gqa(32, 8, 128), GqaShape::mqa(4, 3)}) {
      SCOPED_TRACE(::testing::Message() << "page_size=" << P << " kv_heads=" << shape.kv_heads << " head_dim=" << shape.head_dim);
      const PageLayout l = PageLayout::make(shape, P, sizeof(T));
      EXPECT_EQ(l.content, PageContent::gqa);
      EXPECT_EQ(l.page_size, P);
      EXPECT_EQ(l.kv_heads, shape.kv_heads);
      EXPECT_EQ(l.head_dim, shape.head_dim);
      // A head block holds [page_size][head_dim], padded to whole cache lines and no more.
      EXPECT_GE(l.head_stride, std::int64_t{P} * shape.head_dim);
      EXPECT_LT(l.head_stride - std::int64_t{P} * shape.head_dim, per_line);
      EXPECT_EQ(l.head_stride % per_line, 0);
      EXPECT_EQ(l.page_stride, 2 * shape.kv_heads * l.head_stride);
      EXPECT_EQ(l.page_stride * static_cast<std::int64_t>(sizeof(T)) % 64, 0);
      EXPECT_EQ(l.token_elements(), 2 * shape.kv_heads * shape.head_dim);
      for (int h = 0; h < shape.kv_heads; ++h)
        for (int t = 0; t < P; ++t) {
          EXPECT_EQ(l.key(h, t), h * l.head_stride + std::int64_t{t} * shape.head_dim);
          EXPECT_EQ(l.value(h, t), (shape.kv_heads + h) * l.head_stride + std::int64_t{t} * shape.head_dim);
        }
      EXPECT_LE(l.value(shape.kv_heads - 1, P - 1) + shape.head_dim, l.page_stride);
    }
}

TYPED_TEST(PagedCache, LayoutMlaRowsHoldLatentThenRope) {
  using T = TypeParam;
  const std::int64_t per_line = static_cast<std::int64_t>(kvattn::kAlignment / sizeof(T));
  for (int P : kPageSizes)
    for (MlaShape shape : {kMla, kvattn::presets::deepseek_v2.model.mla()}) {
      SCOPED_TRACE(::testing::Message() << "page_size=" << P << " latent_dim=" << shape.latent_dim);
      const PageLayout l = PageLayout::make(shape, P, sizeof(T));
      EXPECT_EQ(l.content, PageContent::mla);
      EXPECT_EQ(l.latent_dim, shape.latent_dim);
      EXPECT_EQ(l.rope_dim, shape.rope_dim);
      EXPECT_EQ(l.row_stride, shape.latent_dim + shape.rope_dim);
      EXPECT_GE(l.page_stride, P * l.row_stride);
      EXPECT_LT(l.page_stride - P * l.row_stride, per_line);
      EXPECT_EQ(l.page_stride % per_line, 0);
      EXPECT_EQ(l.token_elements(), shape.latent_dim + shape.rope_dim);
      for (int t = 0; t < P; ++t) {
        EXPECT_EQ(l.latent(t), t * l.row_stride);
        EXPECT_EQ(l.rope(t), t * l.row_stride + shape.latent_dim);
      }
    }
}

TYPED_TEST(PagedCache, StartsEmptyWithAZeroedAlignedPool) {
  using T = TypeParam;
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      const Cache<T> c(config(shape, P, 5));
      const PageLayout want = PageLayout::make(shape, P, sizeof(T));
      EXPECT_EQ(c.layout().page_stride, want.page_stride);
      EXPECT_EQ(c.layout().head_stride, want.head_stride);
      EXPECT_EQ(c.layout().row_stride, want.row_stride);
      EXPECT_EQ(c.config().layers, kLayers);
      EXPECT_EQ(c.config().page_size, P);
      EXPECT_EQ(c.config().num_pages, 5);
      EXPECT_EQ(c.free_pages(), 5);
      EXPECT_TRUE(c.sequences().empty());
      for (PageId p = 0; p < 5; ++p) EXPECT_EQ(c.page_refcount(p), 0);
      EXPECT_EQ(c.layer_stride(), 5 * want.page_stride);
      EXPECT_EQ(c.pool_bytes(), static_cast<std::size_t>(kLayers * 5 * want.page_stride) * sizeof(T));
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(c.data()) % kvattn::kAlignment, 0u);
      for (int layer = 0; layer < kLayers; ++layer) EXPECT_EQ(c.layer_data(layer), c.data() + layer * c.layer_stride());
      const auto* bytes = reinterpret_cast<const unsigned char*>(c.data());
      EXPECT_TRUE(std::all_of(bytes, bytes + c.pool_bytes(), [](unsigned char b) { return b == 0; }));
      const CacheStats st = c.stats();
      EXPECT_EQ(st.pages_total, 5);
      EXPECT_EQ(st.pages_free, 5);
      EXPECT_EQ(st.pages_used, 0);
      EXPECT_EQ(st.pages_shared, 0);
      EXPECT_EQ(st.sequences, 0);
      EXPECT_EQ(st.tokens_logical, 0);
      EXPECT_EQ(st.tokens_stored, 0);
      EXPECT_EQ(st.bytes_per_page, want.page_stride * kLayers * static_cast<std::int64_t>(sizeof(T)));
      EXPECT_EQ(st.bytes_reserved, 0);
      EXPECT_EQ(st.bytes_stored, 0);
      EXPECT_EQ(st.bytes_pool, 5 * st.bytes_per_page);
      EXPECT_GT(st.bytes_bookkeeping, 0);
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, AddSequenceGivesFreshEmptySequences) {
  Cache<TypeParam> c(config(kGqa, 3, 4));
  const SeqId a = c.add_sequence(), b = c.add_sequence(), d = c.add_sequence();
  EXPECT_NE(a, b);
  EXPECT_NE(b, d);
  EXPECT_EQ(c.sequences(), (std::vector<SeqId>{a, b, d}));
  for (SeqId s : {a, b, d}) {
    EXPECT_TRUE(c.contains(s));
    EXPECT_EQ(c.length(s), 0);
    EXPECT_TRUE(c.pages(s).empty());
  }
  EXPECT_EQ(c.free_pages(), 4);
  EXPECT_EQ(c.stats().sequences, 3);
  c.remove(b);
  EXPECT_FALSE(c.contains(b));
  const SeqId e = c.add_sequence();  // an id is never given out twice
  EXPECT_NE(e, a);
  EXPECT_NE(e, b);
  EXPECT_NE(e, d);
  EXPECT_FALSE(c.contains(b));
  EXPECT_EQ(c.sequences(), (std::vector<SeqId>{a, d, e}));
  EXPECT_NO_THROW(c.check_invariants());
}

TYPED_TEST(PagedCache, AppendReturnsTheSlotsOfTheNewTokensInOrder) {
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      const std::int64_t num_pages = 40;
      Cache<TypeParam> c(config(shape, P, num_pages));
      const SeqId s = c.add_sequence(), other = c.add_sequence();
      std::vector<std::int64_t> sizes{1, P, P + 1, 2 * P + 3, 1, 1};
      if (P > 1) sizes.insert(sizes.begin() + 1, P - 1);
      std::int64_t len = 0, other_len = 0;
      for (std::int64_t n : sizes) {
        SCOPED_TRACE(::testing::Message() << "append " << n << " to " << len);
        const std::vector<PageId> before = c.pages(s);
        const std::int64_t free_before = c.free_pages();
        const std::vector<Slot> slots = c.append(s, n);
        ASSERT_EQ(slots.size(), static_cast<std::size_t>(n));
        const std::vector<PageId>& pages = c.pages(s);
        ASSERT_EQ(static_cast<std::int64_t>(pages.size()), ceil_div(len + n, P));
        EXPECT_TRUE(std::equal(before.begin(), before.end(), pages.begin()));  // old pages stay (nothing shared)
        EXPECT_EQ(c.free_pages(), free_before - (static_cast<std::int64_t>(pages.size()) - static_cast<std::int64_t>(before.size())));
        for (std::int64_t k = 0; k < n; ++k) {
          const std::int64_t position = len + k;
          EXPECT_EQ(slots[static_cast<std::size_t>(k)].page, pages[static_cast<std::size_t>(position / P)]) << "token " << position;
          EXPECT_EQ(slots[static_cast<std::size_t>(k)].offset, position % P) << "token " << position;
          EXPECT_EQ(slots[static_cast<std::size_t>(k)], c.slot(s, position));
        }
        len += n;
        EXPECT_EQ(c.length(s), len);
        for (PageId p : pages) EXPECT_EQ(c.page_refcount(p), 1);
        // Interleave another sequence, so that pages are not handed out in one run.
        c.append(other, 1);
        ++other_len;
        std::set<PageId> all(pages.begin(), pages.end());
        all.insert(c.pages(other).begin(), c.pages(other).end());
        EXPECT_EQ(static_cast<std::int64_t>(all.size()), ceil_div(len, P) + ceil_div(other_len, P)) << "a page is used twice";
        EXPECT_EQ(c.free_pages(), num_pages - static_cast<std::int64_t>(all.size()));
        EXPECT_NO_THROW(c.check_invariants());
      }
    }
}

TYPED_TEST(PagedCache, AppendWritesTheSlotsToTheCallersArray) {
  for (int P : kPageSizes) {
    SCOPED_TRACE(describe(kGqa, P));
    Cache<TypeParam> a(config(kGqa, P, 16)), b(config(kGqa, P, 16));
    const SeqId sa = a.add_sequence(), sb = b.add_sequence();
    for (std::int64_t n : {std::int64_t{1}, std::int64_t{P + 2}, std::int64_t{2 * P - 1}}) {
      // The array variant writes exactly n slots, the same as the vector variant returns.
      std::vector<Slot> out(static_cast<std::size_t>(n) + 1, Slot{-1, -1});
      a.append(sa, n, out.data());
      const std::vector<Slot> want = b.append(sb, n);
      EXPECT_TRUE(std::equal(want.begin(), want.end(), out.begin()));
      EXPECT_EQ(out.back(), (Slot{-1, -1})) << "wrote past n slots";
    }
    // Without an array, the same reservation.
    a.append(sa, P, nullptr);
    b.append(sb, P);
    EXPECT_EQ(a.length(sa), b.length(sb));
    EXPECT_EQ(a.pages(sa), b.pages(sb));
    EXPECT_EQ(a.free_pages(), b.free_pages());
    EXPECT_NO_THROW(a.check_invariants());
  }
}

TYPED_TEST(PagedCache, WriteAndReadEveryLayerBitExactly) {
  using T = TypeParam;
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<T> c(config(shape, P, 8));
      const SeqId s = c.add_sequence(), other = c.add_sequence();
      const std::int64_t len = 2 * P + 1;
      const std::vector<Slot> slots = c.append(s, len);
      c.append(other, 1);
      // Each layer holds its own data: value() depends on the layer.
      for (int layer = 0; layer < kLayers; ++layer) {
        write_tokens(c, s, layer, 0, id_range(100, len - 1));     // [first, first + count)
        write_tokens(c, s, layer, len - 1, Ids{static_cast<std::uint64_t>(100 + len - 1)});  // one token
      }
      write_all_layers(c, other, 0, Ids{7});
      ASSERT_TRUE(reads_all(c, s, id_range(100, len)));
      ASSERT_TRUE(reads_all(c, other, Ids{7}));
      // The entries are where the layout says, in the layer's own part of the pool.
      for (int layer = 0; layer < kLayers; ++layer)
        for (std::int64_t p = 0; p < len; ++p) {
          const Slot at = slots[static_cast<std::size_t>(p)];
          EXPECT_TRUE(raw_is(raw_token(c.layer_data(layer), c.layout(), at.page, at.offset), c.layout(), 100 + p, layer))
              << "layer " << layer << " token " << p;
        }
      // Overwriting one token in one layer changes that token in that layer only, from any source type.
      write_tokens<kvattn::fp16>(c, s, 1, P, Ids{555});
      write_tokens<kvattn::bf16>(c, s, 2, 0, Ids{556});
      for (int layer = 0; layer < kLayers; ++layer)
        for (std::int64_t p = 0; p < len; ++p) {
          std::uint64_t want = 100 + p;
          if (layer == 1 && p == P) want = 555;
          if (layer == 2 && p == 0) want = 556;
          EXPECT_TRUE(reads_as(c, s, layer, p, want));
        }
      EXPECT_TRUE(reads_all(c, other, Ids{7}));
      // Writes and reads with the scalar code (the Target argument) give the same bits.
      const PageLayout& l = c.layout();
      const std::vector<float> v = token_values(l, 4242, 0);
      const std::size_t a = first_part(l);
      std::vector<T> got(v.size());
      if (l.content == PageContent::gqa) {
        c.template write<float, ScalarTarget>(other, 0, 0, v.data(), v.data() + a);
        c.template read<T, ScalarTarget>(other, 0, 0, got.data(), got.data() + a);
      } else {
        c.template write_latent<float, ScalarTarget>(other, 0, 0, v.data(), v.data() + a);
        c.template read_latent<T, ScalarTarget>(other, 0, 0, got.data(), got.data() + a);
      }
      EXPECT_TRUE(reads_as(c, other, 0, 0, 4242));
      EXPECT_TRUE(raw_is(got, l, 4242, 0));
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, ForkSharesEveryPage) {
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<TypeParam> c(config(shape, P, 8));
      const SeqId parent = c.add_sequence();
      const std::int64_t len = 2 * P + 1;
      c.append(parent, len);
      write_all_layers(c, parent, 0, id_range(10, len));
      const Snapshot before = snapshot(c);
      const SeqId child = c.fork(parent);
      EXPECT_NE(child, parent);
      EXPECT_TRUE(c.contains(child));
      EXPECT_EQ(c.length(child), len);
      EXPECT_EQ(c.pages(child), c.pages(parent));
      for (PageId p : c.pages(parent)) EXPECT_EQ(c.page_refcount(p), 2);
      EXPECT_EQ(c.free_pages(), before.free_pages);  // nothing copied
      EXPECT_EQ(std::memcmp(before.pool.data(), c.data(), c.pool_bytes()), 0);
      const CacheStats st = c.stats();
      EXPECT_EQ(st.pages_shared, ceil_div(len, P));
      EXPECT_EQ(st.tokens_logical, 2 * len);
      EXPECT_EQ(st.tokens_stored, len);
      EXPECT_TRUE(reads_all(c, parent, id_range(10, len)));
      EXPECT_TRUE(reads_all(c, child, id_range(10, len)));
      const SeqId grandchild = c.fork(child);
      for (PageId p : c.pages(parent)) EXPECT_EQ(c.page_refcount(p), 3);
      EXPECT_TRUE(reads_all(c, grandchild, id_range(10, len)));
      const SeqId empty = c.add_sequence();
      const SeqId empty_child = c.fork(empty);
      EXPECT_EQ(c.length(empty_child), 0);
      EXPECT_TRUE(c.pages(empty_child).empty());
      EXPECT_EQ(c.free_pages(), before.free_pages);
      EXPECT_EQ(c.sequences(), (std::vector<SeqId>{parent, child, grandchild, empty, empty_child}));
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, FirstWriteIntoASharedPageCopiesItInEveryLayerForTheWriter) {
  using T = TypeParam;
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<T> c(config(shape, P, 12));
      const std::size_t page_bytes = static_cast<std::size_t>(c.layout().page_stride) * sizeof(T);
      const auto page_ptr = [&](int layer, PageId p) { return c.layer_data(layer) + std::int64_t{p} * c.layout().page_stride; };
      const SeqId parent = c.add_sequence();
      const std::int64_t len = 3 * P + 1;  // pages 0..2 full, page 3 holds one token
      c.append(parent, len);
      const Ids old = id_range(1000, len);
      write_all_layers(c, parent, 0, old);
      const SeqId child = c.fork(parent);
      const std::vector<PageId> shared = c.pages(parent);
      const std::int64_t free0 = c.free_pages();

      // The child writes one token of page 1 in layer 1 only.
      const std::int64_t q = P + P / 2;
      write_tokens(c, child, 1, q, Ids{7});
      const std::vector<PageId> child_pages = c.pages(child);
      EXPECT_EQ(c.pages(parent), shared);  // the writer gets the copy, the other keeps the page
      EXPECT_NE(child_pages[1], shared[1]);
      for (std::size_t i : {0u, 2u, 3u}) EXPECT_EQ(child_pages[i], shared[i]);
      EXPECT_EQ(c.page_refcount(shared[1]), 1);
      EXPECT_EQ(c.page_refcount(child_pages[1]), 1);
      for (std::size_t i : {0u, 2u, 3u}) EXPECT_EQ(c.page_refcount(shared[i]), 2);
      EXPECT_EQ(c.free_pages(), free0 - 1);
      EXPECT_EQ(c.slot(child, q), (Slot{child_pages[1], static_cast<std::int32_t>(q % P)}));
      // The copy is the whole page in every layer: layers 0 and 2 byte for byte, layer 1 but the token.
      for (int layer : {0, 2}) EXPECT_EQ(std::memcmp(page_ptr(layer, child_pages[1]), page_ptr(layer, shared[1]), page_bytes), 0);
      Ids child_ids = old;
      EXPECT_TRUE(reads_all(c, parent, old));  // the other sequence still reads its old data
      for (int layer = 0; layer < kLayers; ++layer)
        for (std::int64_t p = 0; p < len; ++p)
          EXPECT_TRUE(reads_as(c, child, layer, p, layer == 1 && p == q ? 7 : old[static_cast<std::size_t>(p)]));

      // Further writes into the now private page copy nothing.
      write_all_layers(c, child, q, Ids{7});
      child_ids[static_cast<std::size_t>(q)] = 7;
      write_all_layers(c, child, P, Ids{8});
      child_ids[static_cast<std::size_t>(P)] = 8;
      EXPECT_EQ(c.pages(child), child_pages);
      EXPECT_EQ(c.free_pages(), free0 - 1);
      // The parent's page 1 is private again (refcount 1): writing it copies nothing either.
      write_all_layers(c, parent, P, Ids{9});
      EXPECT_EQ(c.pages(parent), shared);
      EXPECT_EQ(c.free_pages(), free0 - 1);
      Ids parent_ids = old;
      parent_ids[static_cast<std::size_t>(P)] = 9;

      // One write over two shared pages (all of page 2 and the token of page 3) copies both.
      write_all_layers(c, child, 2 * P, id_range(2000, P + 1));
      for (std::int64_t p = 2 * P; p < len; ++p) child_ids[static_cast<std::size_t>(p)] = 2000 + static_cast<std::uint64_t>(p - 2 * P);
      const std::vector<PageId> after = c.pages(child);
      EXPECT_NE(after[2], shared[2]);
      EXPECT_NE(after[3], shared[3]);
      EXPECT_EQ(after[0], shared[0]);
      EXPECT_EQ(c.free_pages(), free0 - 3);
      // And a write by the parent into page 0 (still shared) copies it for the parent.
      write_all_layers(c, parent, 0, Ids{10});
      parent_ids[0] = 10;
      EXPECT_NE(c.pages(parent)[0], shared[0]);
      EXPECT_EQ(c.pages(child)[0], shared[0]);
      EXPECT_EQ(c.page_refcount(shared[0]), 1);
      EXPECT_EQ(c.free_pages(), free0 - 4);
      EXPECT_EQ(c.stats().pages_shared, 0);
      EXPECT_TRUE(reads_all(c, parent, parent_ids));
      EXPECT_TRUE(reads_all(c, child, child_ids));
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, AppendIntoASharedPartlyFilledLastPageCopiesIt) {
  using T = TypeParam;
  for (const AttentionShape& shape : kShapes)
    for (int P : {3, 16, 64}) {  // page size 1 has no partly filled pages
      SCOPED_TRACE(describe(shape, P));
      Cache<T> c(config(shape, P, 12));
      const SeqId parent = c.add_sequence();
      c.append(parent, P + 1);  // page X full, page Y holds one token
      const Ids old = id_range(300, P + 1);
      write_all_layers(c, parent, 0, old);
      const SeqId child = c.fork(parent);
      const PageId X = c.pages(parent)[0], Y = c.pages(parent)[1];
      const std::int64_t free0 = c.free_pages();

      const std::vector<Slot> slots = c.append(parent, 1);
      ASSERT_EQ(slots.size(), 1u);
      const PageId Y2 = c.pages(parent)[1];
      EXPECT_NE(Y2, Y);
      EXPECT_EQ(c.pages(parent)[0], X);
      EXPECT_EQ(slots[0], (Slot{Y2, 1}));
      EXPECT_EQ(c.page_refcount(X), 2);
      EXPECT_EQ(c.page_refcount(Y), 1);
      EXPECT_EQ(c.page_refcount(Y2), 1);
      EXPECT_EQ(c.pages(child), (std::vector<PageId>{X, Y}));
      EXPECT_EQ(c.free_pages(), free0 - 1);
      // The copy holds the tokens already there, in every layer.
      for (int layer = 0; layer < kLayers; ++layer)
        for (std::int64_t p = 0; p <= P; ++p) EXPECT_TRUE(reads_as(c, parent, layer, p, old[static_cast<std::size_t>(p)]));
      // Writing the new token through its slot, straight into the pool, cannot reach the child.
      for (int layer = 0; layer < kLayers; ++layer) {
        T* page = c.layer_data(layer) + std::int64_t{slots[0].page} * c.layout().page_stride;
        const std::vector<float> v = token_values(c.layout(), 42, layer);
        const PageLayout& l = c.layout();
        std::size_t i = 0;
        if (l.content == PageContent::gqa) {
          for (int h = 0; h < l.kv_heads; ++h)
            for (int d = 0; d < l.head_dim; ++d) page[l.key(h, slots[0].offset) + d] = kvattn::from_float<T>(v[i++]);
          for (int h = 0; h < l.kv_heads; ++h)
            for (int d = 0; d < l.head_dim; ++d) page[l.value(h, slots[0].offset) + d] = kvattn::from_float<T>(v[i++]);
        } else {
          for (int d = 0; d < l.latent_dim; ++d) page[l.latent(slots[0].offset) + d] = kvattn::from_float<T>(v[i++]);
          for (int d = 0; d < l.rope_dim; ++d) page[l.rope(slots[0].offset) + d] = kvattn::from_float<T>(v[i++]);
        }
      }
      Ids parent_ids = old;
      parent_ids.push_back(42);
      EXPECT_TRUE(reads_all(c, parent, parent_ids));
      EXPECT_TRUE(reads_all(c, child, old));
      // Y is the child's alone now: the child's append copies nothing.
      c.append(child, 1);
      EXPECT_EQ(c.pages(child), (std::vector<PageId>{X, Y}));
      EXPECT_EQ(c.free_pages(), free0 - 1);
      // An append that copies the last page and takes two more: three pages.
      const SeqId third = c.add_sequence();
      c.append(third, P + 2);
      const SeqId fourth = c.fork(third);
      const std::int64_t free1 = c.free_pages();
      c.append(third, 2 * P);
      EXPECT_EQ(c.free_pages(), free1 - 3);
      EXPECT_EQ(c.pages(third)[0], c.pages(fourth)[0]);
      EXPECT_NE(c.pages(third)[1], c.pages(fourth)[1]);
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, AppendAfterASharedFullPageTakesANewPageAndCopiesNothing) {
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<TypeParam> c(config(shape, P, 8));
      const SeqId parent = c.add_sequence();
      c.append(parent, 2 * P);
      write_all_layers(c, parent, 0, id_range(50, 2 * P));
      const SeqId child = c.fork(parent);
      const std::vector<PageId> shared = c.pages(parent);
      const std::int64_t free0 = c.free_pages();
      const std::vector<Slot> slots = c.append(parent, 1);
      EXPECT_EQ(c.free_pages(), free0 - 1);
      ASSERT_EQ(c.pages(parent).size(), 3u);
      EXPECT_TRUE(std::equal(shared.begin(), shared.end(), c.pages(parent).begin()));
      EXPECT_EQ(slots[0], (Slot{c.pages(parent)[2], 0}));
      for (PageId p : shared) EXPECT_EQ(c.page_refcount(p), 2);
      EXPECT_TRUE(reads_all(c, child, id_range(50, 2 * P)));
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, TruncateFreesThePagesThatFallOutOfUse) {
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      const std::int64_t num_pages = 10;
      Cache<TypeParam> c(config(shape, P, num_pages));
      const SeqId s = c.add_sequence();
      const std::int64_t len = 3 * P + 1;
      c.append(s, len);
      Ids ids = id_range(70, len);
      write_all_layers(c, s, 0, ids);
      const std::vector<PageId> pages = c.pages(s);

      const Snapshot same = snapshot(c);
      c.truncate(s, len);  // to the same length: nothing changes
      EXPECT_TRUE(same_state(same, snapshot(c)));

      c.truncate(s, 3 * P);  // the last page falls out of use
      EXPECT_EQ(c.length(s), 3 * P);
      EXPECT_EQ(c.pages(s), std::vector<PageId>(pages.begin(), pages.begin() + 3));
      EXPECT_EQ(c.page_refcount(pages[3]), 0);
      EXPECT_EQ(c.free_pages(), num_pages - 3);
      EXPECT_TRUE(reads_all(c, s, Ids(ids.begin(), ids.begin() + 3 * P)));

      c.truncate(s, P + 1);  // within a page: the page stays
      EXPECT_EQ(c.pages(s), std::vector<PageId>(pages.begin(), pages.begin() + 2));
      EXPECT_EQ(c.free_pages(), num_pages - 2);
      EXPECT_TRUE(reads_all(c, s, Ids(ids.begin(), ids.begin() + P + 1)));
      EXPECT_NO_THROW(c.check_invariants());

      // Appending again continues at the new end.
      const std::vector<Slot> slots = c.append(s, 1);
      EXPECT_EQ(slots[0], c.slot(s, P + 1));
      EXPECT_EQ(slots[0].offset, (P + 1) % P);

      c.truncate(s, 0);
      EXPECT_EQ(c.length(s), 0);
      EXPECT_TRUE(c.pages(s).empty());
      EXPECT_EQ(c.free_pages(), num_pages);
      EXPECT_TRUE(c.contains(s));
      for (PageId p = 0; p < num_pages; ++p) EXPECT_EQ(c.page_refcount(p), 0);
      const Snapshot empty = snapshot(c);
      c.truncate(s, 0);
      EXPECT_TRUE(same_state(empty, snapshot(c)));
      EXPECT_NO_THROW(c.check_invariants());

      // Shared pages stay while another sequence uses them.
      c.append(s, 2 * P + 1);
      write_all_layers(c, s, 0, ids = id_range(90, 2 * P + 1));
      const SeqId child = c.fork(s);
      const std::vector<PageId> shared = c.pages(s);
      c.truncate(child, 0);
      EXPECT_EQ(c.free_pages(), num_pages - 3);
      for (PageId p : shared) EXPECT_EQ(c.page_refcount(p), 1);
      EXPECT_TRUE(reads_all(c, s, ids));
      const SeqId child2 = c.fork(s);
      c.truncate(s, P);  // s drops pages 1 and 2; child2 still holds them
      EXPECT_EQ(c.free_pages(), num_pages - 3);
      EXPECT_EQ(c.page_refcount(shared[0]), 2);
      EXPECT_EQ(c.page_refcount(shared[1]), 1);
      EXPECT_EQ(c.page_refcount(shared[2]), 1);
      c.truncate(child2, P);  // now nobody does
      EXPECT_EQ(c.free_pages(), num_pages - 1);
      EXPECT_TRUE(reads_all(c, child2, Ids(ids.begin(), ids.begin() + P)));
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, RemoveReturnsPagesOnlyWhenNoSequenceUsesThem) {
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      const std::int64_t num_pages = 10;
      Cache<TypeParam> c(config(shape, P, num_pages));
      const SeqId parent = c.add_sequence();
      c.append(parent, 2 * P + 1);
      const Ids ids = id_range(5, 2 * P + 1);
      write_all_layers(c, parent, 0, ids);
      const SeqId child = c.fork(parent);
      c.append(child, P);  // the child has pages of its own as well
      const std::vector<PageId> parent_pages = c.pages(parent);
      const std::int64_t free0 = c.free_pages();
      c.remove(parent);
      EXPECT_FALSE(c.contains(parent));
      // Pages the child shares stay, now the child's alone. With P > 1 the child's append copied the
      // shared, partly filled last page, so the original was the parent's alone: it returns.
      std::int64_t freed = 0;
      for (PageId p : parent_pages) {
        const bool child_has = std::count(c.pages(child).begin(), c.pages(child).end(), p) != 0;
        EXPECT_EQ(c.page_refcount(p), child_has ? 1 : 0);
        freed += child_has ? 0 : 1;
      }
      EXPECT_EQ(freed, P > 1 ? 1 : 0);
      EXPECT_EQ(c.free_pages(), free0 + freed);
      for (int layer = 0; layer < kLayers; ++layer)
        for (std::int64_t p = 0; p < 2 * P + 1; ++p) EXPECT_TRUE(reads_as(c, child, layer, p, ids[static_cast<std::size_t>(p)]));
      c.remove(child);
      EXPECT_EQ(c.free_pages(), num_pages);
      for (PageId p = 0; p < num_pages; ++p) EXPECT_EQ(c.page_refcount(p), 0);
      EXPECT_TRUE(c.sequences().empty());
      const SeqId empty = c.add_sequence();
      c.remove(empty);
      EXPECT_TRUE(c.sequences().empty());
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, PageTableAndViewDescribeTheBatch) {
  using T = TypeParam;
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<T> c(config(shape, P, 24));
      const SeqId empty = c.add_sequence(), one = c.add_sequence(), full = c.add_sequence(), longer = c.add_sequence();
      c.append(one, 1);
      c.append(full, P);
      c.append(longer, 2 * P + 1);
      const SeqId forked = c.fork(longer);
      c.truncate(forked, P + 1);
      c.append(forked, 2);  // copies its shared last page when P > 2
      std::uint64_t next = 1;
      for (SeqId s : {one, full, longer, forked})
        for (std::int64_t p = 0; p < c.length(s); ++p) write_all_layers(c, s, p, Ids{next++});
      const std::vector<SeqId> batch{one, empty, full, longer, forked, empty, one};

      BatchPageTable table;
      table.indptr.assign(50, -7);  // build_page_table reuses and resizes whatever it is given
      table.indices.assign(500, -7);
      table.last_page_len.assign(3, -7);
      c.build_page_table(batch.data(), batch.size(), table);
      ASSERT_EQ(table.batch(), static_cast<int>(batch.size()));
      ASSERT_EQ(table.indptr.size(), batch.size() + 1);
      ASSERT_EQ(table.last_page_len.size(), batch.size());
      EXPECT_EQ(table.indptr[0], 0);
      std::vector<std::int32_t> indices;
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const std::vector<PageId>& pages = c.pages(batch[b]);
        indices.insert(indices.end(), pages.begin(), pages.end());
        EXPECT_EQ(table.indptr[b + 1], static_cast<std::int32_t>(indices.size()));
        const std::int64_t len = c.length(batch[b]);
        EXPECT_EQ(table.last_page_len[b], len == 0 ? 0 : (len - 1) % P + 1) << "sequence " << batch[b];
      }
      EXPECT_EQ(table.indices, indices);
      EXPECT_EQ(table.last_page_len[1], 0);  // an empty sequence
      EXPECT_EQ(table.last_page_len[2], P);  // a full last page
      const BatchPageTable same = c.page_table(batch);
      EXPECT_EQ(same.indptr, table.indptr);
      EXPECT_EQ(same.indices, table.indices);
      EXPECT_EQ(same.last_page_len, table.last_page_len);

      const PageLayout& l = c.layout();
      for (int layer = 0; layer < kLayers; ++layer) {
        const kvattn::PagedKvView<T> v = c.view(table, layer);
        EXPECT_EQ(v.pool, c.layer_data(layer));
        EXPECT_EQ(v.indptr, table.indptr.data());
        EXPECT_EQ(v.indices, table.indices.data());
        EXPECT_EQ(v.last_page_len, table.last_page_len.data());
        EXPECT_EQ(v.batch, static_cast<int>(batch.size()));
        EXPECT_EQ(v.layout.page_stride, l.page_stride);
        EXPECT_EQ(v.layout.content, l.content);
        for (int b = 0; b < v.batch; ++b) {
          const SeqId s = batch[static_cast<std::size_t>(b)];
          ASSERT_EQ(v.length(b), c.length(s));
          for (std::int64_t t = 0; t < v.length(b); ++t) {
            const PageId page = v.indices[v.indptr[b] + t / P];
            EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.page(page)) % kvattn::kAlignment, 0u);
            EXPECT_EQ(v.page(page), c.layer_data(layer) + std::int64_t{page} * l.page_stride);
            // Through the view's pool and the layout offsets, the same bits as read().
            const std::vector<T> raw = raw_token(v.pool, v.layout, page, static_cast<int>(t % P));
            std::vector<T> got(raw.size());
            if (l.content == PageContent::gqa)
              c.read(s, layer, t, got.data(), got.data() + first_part(l));
            else
              c.read_latent(s, layer, t, got.data(), got.data() + first_part(l));
            for (std::size_t i = 0; i < raw.size(); ++i)
              ASSERT_EQ(bits(raw[i]), bits(got[i])) << "batch entry " << b << " token " << t << " entry " << i;
          }
        }
      }
      // An empty batch.
      const BatchPageTable none = c.page_table({});
      EXPECT_EQ(none.indptr, std::vector<std::int32_t>{0});
      EXPECT_TRUE(none.indices.empty());
      EXPECT_TRUE(none.last_page_len.empty());
      EXPECT_EQ(none.batch(), 0);
      EXPECT_EQ(c.view(none, 0).batch, 0);
    }
}

TEST(PagedCachePageTable, MorePagesThanInt32IndicesIsRejected) {
  // One sequence of 20,000 pages, 107,375 times in one batch: 2,147,500,000 page ids.
  Cache<kvattn::fp16> c(config(GqaShape::mqa(1, 1), 1, 20000, 1));
  const SeqId s = c.add_sequence();
  c.append(s, 20000);
  const std::vector<SeqId> batch(107375, s);
  BatchPageTable table = c.page_table({s});
  const BatchPageTable before = table;
  EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.build_page_table(batch.data(), batch.size(), table); },
                                                {"build_page_table", "2147500000 pages", "int32"}));
  EXPECT_EQ(table.indptr, before.indptr);
  EXPECT_EQ(table.indices, before.indices);
  EXPECT_EQ(table.last_page_len, before.last_page_len);
}

TYPED_TEST(PagedCache, StatsCountSharedPagesAndTokensOnce) {
  using T = TypeParam;
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<T> c(config(shape, P, 16));
      const SeqId a = c.add_sequence();
      c.append(a, 2 * P + 2);
      const SeqId b = c.fork(a);
      c.truncate(b, P + 1);  // b keeps a's first two pages, both still shared
      const SeqId e = c.add_sequence();
      const SeqId d = c.add_sequence();
      c.append(d, P);
      (void)e;
      const std::int64_t pages_a = ceil_div(2 * P + 2, P);
      const CacheStats st = c.stats();
      const auto elem = static_cast<std::int64_t>(sizeof(T));
      EXPECT_EQ(st.pages_total, 16);
      EXPECT_EQ(st.pages_used, pages_a + 1);
      EXPECT_EQ(st.pages_free, 16 - pages_a - 1);
      EXPECT_EQ(st.pages_free, c.free_pages());
      EXPECT_EQ(st.pages_shared, 2);
      EXPECT_EQ(st.sequences, 4);
      EXPECT_EQ(st.tokens_logical, (2 * P + 2) + (P + 1) + 0 + P);
      EXPECT_EQ(st.tokens_stored, (2 * P + 2) + P);  // b's tokens are a's
      EXPECT_EQ(st.bytes_per_page, c.layout().page_stride * kLayers * elem);
      EXPECT_EQ(st.bytes_reserved, st.pages_used * st.bytes_per_page);
      EXPECT_EQ(st.bytes_stored, st.tokens_stored * c.layout().token_elements() * kLayers * elem);
      EXPECT_EQ(st.bytes_pool, 16 * st.bytes_per_page);
      EXPECT_LE(st.bytes_stored, st.bytes_reserved);
      // A shared page that b fills less than a counts a's tokens: truncating a below b gives b's.
      c.truncate(a, 1);
      const CacheStats st2 = c.stats();
      EXPECT_EQ(st2.tokens_stored, (P + 1) + P);
      EXPECT_EQ(st2.pages_shared, 1);
      EXPECT_EQ(st2.pages_used, ceil_div(P + 1, P) + 1);
    }
}

TYPED_TEST(PagedCache, StatsOverheadIsAtMostOnePartlyFilledPagePerSequence) {
  using T = TypeParam;
  // Shapes whose head blocks and rows need no padding at any page size: 32 elements of 2 or 4 bytes
  // are whole cache lines, so every byte of a page is payload or a free token slot.
  const AttentionShape unpadded[] = {GqaShape::gqa(4, 2, 32), MlaShape{4, 28, 4, 8, 8, 0}};
  for (const AttentionShape& shape : unpadded)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<T> c(config(shape, P, 64));
      const std::int64_t payload = c.layout().token_elements() * kLayers * static_cast<std::int64_t>(sizeof(T));
      ASSERT_EQ(c.stats().bytes_per_page, P * payload);
      std::vector<SeqId> seqs;
      std::int64_t pages = 0, tokens = 0, empty_slots = 0;
      for (std::int64_t len : {std::int64_t{0}, std::int64_t{1}, std::int64_t{P}, std::int64_t{P + 1}, 5 * std::int64_t{P} - 1, std::int64_t{3}}) {
        seqs.push_back(c.add_sequence());
        if (len > 0) c.append(seqs.back(), len);
        pages += ceil_div(len, P);
        tokens += len;
        empty_slots += ceil_div(len, P) * P - len;
      }
      CacheStats st = c.stats();
      EXPECT_EQ(st.pages_used, pages);  // no page beyond what the lengths need
      EXPECT_EQ(st.tokens_stored, tokens);
      EXPECT_EQ(st.bytes_reserved - st.bytes_stored, empty_slots * payload);
      EXPECT_LE(st.bytes_reserved - st.bytes_stored, st.sequences * st.bytes_per_page);
      // Forks add sequences, not pages.
      c.fork(seqs[4]);
      c.fork(seqs[3]);
      st = c.stats();
      EXPECT_EQ(st.pages_used, pages);
      EXPECT_EQ(st.tokens_stored, tokens);
      EXPECT_LE(st.bytes_reserved - st.bytes_stored, st.sequences * st.bytes_per_page);
    }
}

TYPED_TEST(PagedCache, MoveConstructionAndAssignmentTakeEverything) {
  using T = TypeParam;
  for (const AttentionShape& shape : kShapes) {
    SCOPED_TRACE(describe(shape, 3));
    Cache<T> a(config(shape, 3, 8));
    const SeqId s = a.add_sequence();
    a.append(s, 7);
    const Ids ids = id_range(11, 7);
    write_all_layers(a, s, 0, ids);
    const SeqId f = a.fork(s);
    const Snapshot before = snapshot(a);
    const T* pool = a.data();

    Cache<T> b(std::move(a));
    EXPECT_EQ(b.data(), pool);  // the pool moves, nothing is copied
    EXPECT_TRUE(same_state(before, snapshot(b)));
    EXPECT_TRUE(reads_all(b, s, ids));
    EXPECT_TRUE(reads_all(b, f, ids));
    EXPECT_EQ(b.config().page_size, 3);
    EXPECT_EQ(b.layout().page_stride, PageLayout::make(shape, 3, sizeof(T)).page_stride);
    EXPECT_TRUE(a.sequences().empty());  // the moved-from cache holds nothing
    EXPECT_FALSE(a.contains(s));
    EXPECT_EQ(a.pool_bytes(), 0u);

    // Assignment over a cache that has its own pool and sequences (LeakSanitizer sees a leak).
    Cache<T> c(config(kGqa, 16, 4));
    c.append(c.add_sequence(), 20);
    c = std::move(b);
    EXPECT_EQ(c.data(), pool);
    EXPECT_TRUE(same_state(before, snapshot(c)));
    EXPECT_TRUE(reads_all(c, f, ids));
    EXPECT_TRUE(b.sequences().empty());
    // Assigning a cache to itself changes nothing.
    Cache<T>& alias = c;
    c = std::move(alias);
    EXPECT_TRUE(same_state(before, snapshot(c)));
    // A moved-from cache can be assigned to again and used.
    a = std::move(c);
    EXPECT_TRUE(reads_all(a, s, ids));
    a.append(s, 1);
    EXPECT_NO_THROW(a.check_invariants());
    // Ids continue where they were: the next sequence is not an old one.
    const SeqId n = a.add_sequence();
    EXPECT_NE(n, s);
    EXPECT_NE(n, f);
  }
}

// ---- errors ----------------------------------------------------------------------------------

TYPED_TEST(PagedCache, UnknownOrRemovedSequenceIsRejectedByEveryOperation) {
  for (const AttentionShape& shape : kShapes) {
    SCOPED_TRACE(describe(shape, 3));
    Cache<TypeParam> c(config(shape, 3, 8));
    const bool gqa = std::holds_alternative<GqaShape>(shape);
    const SeqId live = c.add_sequence();
    c.append(live, 7);
    write_all_layers(c, live, 0, id_range(1, 7));
    const SeqId forked = c.fork(live);
    const SeqId removed = c.add_sequence();
    c.append(removed, 4);
    c.remove(removed);
    (void)forked;
    std::vector<float> k(64), v(64);
    for (SeqId bad : {removed, SeqId{999}, SeqId{-1}}) {
      SCOPED_TRACE(::testing::Message() << "seq " << bad);
      using E = kvattn::invalid_argument;
      const std::string none = "no such sequence";
      EXPECT_TRUE(rejects<E>(c, [&] { (void)c.length(bad); }, {seq_is("length", bad), none}));
      EXPECT_TRUE(rejects<E>(c, [&] { (void)c.pages(bad); }, {seq_is("pages", bad), none}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(bad, 1); }, {seq_is("append", bad), none}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.fork(bad); }, {seq_is("fork", bad), none}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.truncate(bad, 0); }, {seq_is("truncate", bad), none}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.remove(bad); }, {seq_is("remove", bad), none}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.slot(bad, 0); }, {seq_is("slot", bad), none}));
      if (gqa) {
        EXPECT_TRUE(rejects<E>(c, [&] { c.write(bad, 0, 0, k.data(), v.data()); }, {seq_is("write", bad), none}));
        EXPECT_TRUE(rejects<E>(c, [&] { c.write(bad, 0, 0, 1, k.data(), v.data()); }, {seq_is("write", bad), none}));
        EXPECT_TRUE(rejects<E>(c, [&] { c.read(bad, 0, 0, k.data(), v.data()); }, {seq_is("read", bad), none}));
      } else {
        EXPECT_TRUE(rejects<E>(c, [&] { c.write_latent(bad, 0, 0, k.data(), v.data()); }, {seq_is("write_latent", bad), none}));
        EXPECT_TRUE(rejects<E>(c, [&] { c.write_latent(bad, 0, 0, 1, k.data(), v.data()); }, {seq_is("write_latent", bad), none}));
        EXPECT_TRUE(rejects<E>(c, [&] { c.read_latent(bad, 0, 0, k.data(), v.data()); }, {seq_is("read_latent", bad), none}));
      }
      // A batch with one bad sequence: the error, and the output table untouched.
      BatchPageTable table;
      table.indptr = {5, 6};
      table.indices = {9};
      table.last_page_len = {4};
      const SeqId batch[] = {live, bad};
      EXPECT_TRUE(rejects<E>(c, [&] { c.build_page_table(batch, 2, table); }, {seq_is("build_page_table", bad), none}));
      EXPECT_EQ(table.indptr, (std::vector<std::int32_t>{5, 6}));
      EXPECT_EQ(table.indices, std::vector<std::int32_t>{9});
      EXPECT_EQ(table.last_page_len, std::vector<std::int32_t>{4});
      EXPECT_TRUE(rejects<E>(c, [&] { (void)c.page_table({bad, live}); }, {seq_is("build_page_table", bad), none}));
      EXPECT_FALSE(c.contains(bad));
    }
    // The failed fork did not use up an id: the next one follows the last one given out.
    EXPECT_EQ(c.add_sequence(), removed + 1);
  }
}

TYPED_TEST(PagedCache, AppendOfZeroOrNegativeTokensIsRejected) {
  Cache<TypeParam> c(config(kGqa, 3, 4));
  const SeqId s = c.add_sequence();
  c.append(s, 4);
  for (std::int64_t n : {std::int64_t{0}, std::int64_t{-1}, std::numeric_limits<std::int64_t>::min()})
    EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.append(s, n); },
                                                  {seq_is("append", s), "n=" + std::to_string(n), "must be positive"}));
}

TYPED_TEST(PagedCache, AppendBeyondThePoolIsRejected) {
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      using E = kvattn::capacity_error;
      Cache<TypeParam> c(config(shape, P, 4));
      const SeqId a = c.add_sequence(), b = c.add_sequence(), e = c.add_sequence();
      c.append(a, 2 * P);
      write_all_layers(c, a, 0, id_range(1, 2 * P));
      c.append(b, 2 * P - 1);
      write_all_layers(c, b, 0, id_range(100, 2 * P - 1));
      if (P == 1) c.append(b, 1);  // P == 1: fill the pool
      ASSERT_EQ(c.free_pages(), 0);
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(e, 1); }, {seq_is("append", e), "n=1", "needs 1 free page,", "the pool has 0 of 4"}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(a, 1); }, {seq_is("append", a), "n=1", "the pool has 0 of 4"}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(a, P); }, {seq_is("append", a), "n=" + std::to_string(P), "the pool has 0 of 4"}));
      // More tokens than the whole pool holds.
      const std::int64_t too_many = 4 * P + 1;
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(e, too_many); },
                             {seq_is("append", e), "n=" + std::to_string(too_many), "exceed the pool's " + std::to_string(4 * P)}));
      Slot out[2] = {Slot{-1, -1}, Slot{-1, -1}};
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(e, std::numeric_limits<std::int64_t>::max(), out); },
                             {seq_is("append", e), "n=9223372036854775807"}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(a, 1, out); }, {seq_is("append", a), "n=1", "the pool has 0 of 4"}));
      EXPECT_EQ(out[0], (Slot{-1, -1}));  // a rejected append writes no slot
      // Two pages asked, one free.
      c.truncate(b, P - (P > 1 ? 1 : 0));
      ASSERT_EQ(c.free_pages(), 1);
      EXPECT_TRUE(rejects<E>(c, [&] { c.append(e, P + 1); }, {"n=" + std::to_string(P + 1), "needs 2 free pages", "the pool has 1 of 4"}));
      c.append(e, P);
      EXPECT_TRUE(reads_all(c, a, id_range(1, 2 * P)));
    }
}

// append(seq, n) -> std::vector<Slot> checks everything before it allocates the n slots: an
// impossible n is a capacity_error (or an unknown sequence's invalid_argument), never an attempt to
// allocate n slots (std::length_error for INT64_MAX, gigabytes for 10^9).
TEST(PagedCacheAppend, FarMoreTokensThanThePoolIsACapacityErrorNotAnAllocation) {
  Cache<kvattn::fp16> c(config(kGqa, 16, 4));
  const SeqId s = c.add_sequence();
  c.append(s, 5);
  const std::int64_t n = std::numeric_limits<std::int64_t>::max();
  EXPECT_TRUE(rejects<kvattn::capacity_error>(c, [&] { c.append(s, n); }, {seq_is("append", s), "n=" + std::to_string(n)}));
  EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.append(s + 100, n); }, {seq_is("append", s + 100), "no such sequence"}));
}

TYPED_TEST(PagedCache, AppendThatMustCopyASharedLastPageIsRejectedWhenThePoolIsFull) {
  for (const AttentionShape& shape : kShapes)
    for (int P : {3, 16, 64}) {
      SCOPED_TRACE(describe(shape, P));
      Cache<TypeParam> c(config(shape, P, 4));
      const SeqId a = c.add_sequence();
      c.append(a, P + 1);  // the last page holds one token: room for P - 1 more
      write_all_layers(c, a, 0, id_range(1, P + 1));
      const SeqId b = c.fork(a);
      const SeqId filler = c.add_sequence();
      c.append(filler, 2 * P);
      ASSERT_EQ(c.free_pages(), 0);
      EXPECT_TRUE(rejects<kvattn::capacity_error>(c, [&] { c.append(a, 1); }, {seq_is("append", a), "n=1", "needs 1 free page,", "the pool has 0 of 4"}));
      EXPECT_TRUE(rejects<kvattn::capacity_error>(c, [&] { c.append(b, P - 1); }, {seq_is("append", b), "needs 1 free page,"}));
      c.remove(filler);
      c.append(a, 1);  // now it can
      EXPECT_TRUE(reads_all(c, b, id_range(1, P + 1)));
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, CopyOnWriteIsRejectedWhenThePoolIsFull) {
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      using E = kvattn::capacity_error;
      const bool gqa = std::holds_alternative<GqaShape>(shape);
      const char* op = gqa ? "write" : "write_latent";
      Cache<TypeParam> c(config(shape, P, 4));
      const SeqId a = c.add_sequence();
      c.append(a, 2 * P);
      const Ids ids = id_range(1, 2 * P);
      write_all_layers(c, a, 0, ids);
      const SeqId b = c.fork(a);
      const SeqId filler = c.add_sequence();
      c.append(filler, 2 * P);
      ASSERT_EQ(c.free_pages(), 0);
      for (int layer : {0, kLayers - 1})
        EXPECT_TRUE(rejects<E>(c, [&] { write_tokens(c, b, layer, 0, Ids{77}); },
                               {seq_is(op, b), "position=0", "count=1", "copying 1 shared page needs", "the pool has 0"}));
      EXPECT_TRUE(rejects<E>(c, [&] { write_tokens(c, a, 1, P, Ids{77}); },
                             {seq_is(op, a), "position=" + std::to_string(P), "copying 1 shared page", "the pool has 0"}));
      // Two shared pages, one free page: nothing is copied, not even the first.
      c.truncate(filler, P);
      ASSERT_EQ(c.free_pages(), 1);
      EXPECT_TRUE(rejects<E>(c, [&] { write_tokens(c, b, 0, 0, id_range(500, 2 * P)); },
                             {seq_is(op, b), "count=" + std::to_string(2 * P), "copying 2 shared pages", "the pool has 1"}));
      // One page can be copied.
      write_tokens(c, b, 0, 0, Ids{78});
      EXPECT_EQ(c.free_pages(), 0);
      EXPECT_TRUE(rejects<E>(c, [&] { write_tokens(c, b, 2, P, Ids{79}); }, {"copying 1 shared page", "the pool has 0"}));
      // a's page 0 is a's alone now: writing it needs no free page.
      write_tokens(c, a, 2, 0, Ids{80});
      EXPECT_TRUE(reads_as(c, a, 2, 0, 80));
      EXPECT_TRUE(reads_as(c, b, 2, 0, ids[0]));
      EXPECT_TRUE(reads_as(c, b, 0, 0, 78));
      EXPECT_TRUE(reads_as(c, a, 0, 0, ids[0]));
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, BatchMakeWritableIsAllOrNothingAndCountsCopiesExactly) {
  using kvattn::TokenRange;
  for (const AttentionShape& shape : kShapes)
    for (int P : kPageSizes) {
      SCOPED_TRACE(describe(shape, P));
      Cache<TypeParam> c(config(shape, P, 8));
      const SeqId a = c.add_sequence();
      c.append(a, 2 * P);
      const Ids a_ids = id_range(1, 2 * P);
      write_all_layers(c, a, 0, a_ids);
      const SeqId b = c.fork(a);  // shares a's 2 pages
      const SeqId x = c.add_sequence();
      c.append(x, P);
      const Ids x_ids = id_range(500, P);
      write_all_layers(c, x, 0, x_ids);
      const SeqId y = c.fork(x);  // shares x's page
      const SeqId filler = c.add_sequence();
      c.append(filler, 3 * P);
      ASSERT_EQ(c.free_pages(), 2);
      const std::vector<PageId> shared = c.pages(a);

      // a's 2 pages and x's page: 3 copies, 2 free pages: nothing is copied, not even a's.
      EXPECT_TRUE(rejects<kvattn::capacity_error>(c, [&] { c.make_writable({{a, 0, 2 * P}, {x, 0, P}}); },
                                                  {"make_writable", "2 ranges need 3 copies", "the pool has 2 free"}));
      EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.make_writable({{a, 0, P}, {b, 0, 1}, {a, P, 1}}); },
                                                    {"make_writable", "sequence " + std::to_string(a) + " appears more than once"}));
      EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.make_writable({{x, 0, P}, {a, 0, 2 * P + 1}}); },
                                                    {seq_is("make_writable", a), "count=" + std::to_string(2 * P + 1),
                                                     "holds " + std::to_string(2 * P) + " tokens"}));
      EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.make_writable({{x, 0, P}, {b, 0, -1}}); },
                                                    {seq_is("make_writable", b), "count=-1"}));
      EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.make_writable({{x, 0, P}, {filler + 100, 0, 0}}); },
                                                    {std::to_string(filler + 100)}));
      // Empty ranges only check their sequence.
      const Snapshot before = snapshot(c);
      c.make_writable({{x, 0, 0}, {y, 0, 0}});
      c.make_writable({});
      EXPECT_TRUE(same_state(before, snapshot(c)));

      // a and b both write both shared pages: one copy per page (the second writer keeps the
      // original), so 2 free pages are enough.
      c.make_writable({{b, 0, 2 * P}, {a, 0, 2 * P}});
      EXPECT_EQ(c.free_pages(), 0);
      const std::vector<PageId> pa = c.pages(a), pb = c.pages(b);
      for (std::size_t i = 0; i < 2; ++i) {
        EXPECT_NE(pa[i], pb[i]);
        EXPECT_EQ(c.page_refcount(pa[i]), 1);
        EXPECT_EQ(c.page_refcount(pb[i]), 1);
      }
      EXPECT_TRUE(reads_all(c, a, a_ids));
      EXPECT_TRUE(reads_all(c, b, a_ids));
      // Their pages are private now: writing them copies nothing, and each sees only its own.
      write_all_layers(c, a, 0, id_range(900, 2 * P));
      write_all_layers(c, b, 0, id_range(950, 2 * P));
      EXPECT_TRUE(reads_all(c, a, id_range(900, 2 * P)));
      EXPECT_TRUE(reads_all(c, b, id_range(950, 2 * P)));
      EXPECT_TRUE(reads_all(c, y, x_ids));
      EXPECT_EQ(c.free_pages(), 0);
      EXPECT_NO_THROW(c.check_invariants());
    }
}

TYPED_TEST(PagedCache, TruncationPastTheEndOrBelowZeroIsRejected) {
  Cache<TypeParam> c(config(kMla, 3, 4));
  const SeqId s = c.add_sequence();
  c.append(s, 5);
  for (std::int64_t bad : {std::int64_t{6}, std::int64_t{-1}, std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()})
    EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.truncate(s, bad); },
                                                  {seq_is("truncate", s), "length=" + std::to_string(bad), "holds 5 tokens"}));
  const SeqId e = c.add_sequence();
  EXPECT_TRUE(rejects<kvattn::invalid_argument>(c, [&] { c.truncate(e, 1); }, {"length=1", "holds 0 tokens"}));
}

TYPED_TEST(PagedCache, LayerOutOfRangeIsRejected) {
  for (const AttentionShape& shape : kShapes) {
    SCOPED_TRACE(describe(shape, 3));
    Cache<TypeParam> c(config(shape, 3, 4));
    const bool gqa = std::holds_alternative<GqaShape>(shape);
    const SeqId s = c.add_sequence();
    c.append(s, 2);
    const SeqId f = c.fork(s);  // a write that would copy: the layer is checked first
    (void)f;
    std::vector<float> k(64), v(64);
    const BatchPageTable table = c.page_table({s});
    for (int layer : {-1, kLayers, std::numeric_limits<int>::max(), std::numeric_limits<int>::min()}) {
      const std::vector<std::string> parts{"layer=" + std::to_string(layer), "outside [0, " + std::to_string(kLayers) + ")"};
      using E = kvattn::invalid_argument;
      if (gqa) {
        EXPECT_TRUE(rejects<E>(c, [&] { c.write(s, layer, 0, k.data(), v.data()); }, {"write:", parts[0], parts[1]}));
        EXPECT_TRUE(rejects<E>(c, [&] { c.read(s, layer, 0, k.data(), v.data()); }, {"read:", parts[0], parts[1]}));
      } else {
        EXPECT_TRUE(rejects<E>(c, [&] { c.write_latent(s, layer, 0, 2, k.data(), v.data()); }, {"write_latent:", parts[0], parts[1]}));
        EXPECT_TRUE(rejects<E>(c, [&] { c.read_latent(s, layer, 0, k.data(), v.data()); }, {"read_latent:", parts[0], parts[1]}));
      }
      EXPECT_TRUE(rejects<E>(c, [&] { (void)c.view(table, layer); }, {"view:", parts[0], parts[1]}));
    }
  }
}

TYPED_TEST(PagedCache, PositionOutOfRangeIsRejected) {
  for (const AttentionShape& shape : kShapes) {
    SCOPED_TRACE(describe(shape, 3));
    Cache<TypeParam> c(config(shape, 3, 4));
    const bool gqa = std::holds_alternative<GqaShape>(shape);
    const char* w = gqa ? "write" : "write_latent";
    const char* r = gqa ? "read" : "read_latent";
    const SeqId s = c.add_sequence(), e = c.add_sequence();
    c.append(s, 5);
    std::vector<float> k(64 * 8), v(64 * 8);
    const auto write = [&](SeqId seq, std::int64_t first, std::int64_t count) {
      if (gqa) c.write(seq, 0, first, count, k.data(), v.data());
      else c.write_latent(seq, 0, first, count, k.data(), v.data());
    };
    const auto read = [&](SeqId seq, std::int64_t position) {
      if (gqa) c.read(seq, 0, position, k.data(), v.data());
      else c.read_latent(seq, 0, position, k.data(), v.data());
    };
    using E = kvattn::invalid_argument;
    constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max(), kMin = std::numeric_limits<std::int64_t>::min();
    for (std::int64_t p : {std::int64_t{5}, std::int64_t{-1}, kMax, kMin}) {
      const std::string at = "position=" + std::to_string(p);
      EXPECT_TRUE(rejects<E>(c, [&] { read(s, p); }, {seq_is(r, s), at, "holds 5 tokens"}));
      EXPECT_TRUE(rejects<E>(c, [&] { c.slot(s, p); }, {seq_is("slot", s), at, "holds 5 tokens"}));
      EXPECT_TRUE(rejects<E>(c, [&] { write(s, p, 1); }, {seq_is(w, s), at, "count=1", "holds 5 tokens"}));
    }
    // Ranges that end past the sequence, and counts of zero or less.
    const std::pair<std::int64_t, std::int64_t> ranges[] = {{4, 2}, {0, 6}, {3, kMax}, {0, 0}, {2, -1}, {kMax, 2}, {-2, 3}};
    for (const auto& range : ranges) {
      const std::int64_t first = range.first, count = range.second;
      EXPECT_TRUE(rejects<E>(c, [&] { write(s, first, count); },
                             {seq_is(w, s), "position=" + std::to_string(first), "count=" + std::to_string(count), "holds 5 tokens"}));
    }
    // An empty sequence has no positions at all.
    EXPECT_TRUE(rejects<E>(c, [&] { read(e, 0); }, {seq_is(r, e), "position=0", "holds 0 tokens"}));
    EXPECT_TRUE(rejects<E>(c, [&] { c.slot(e, 0); }, {seq_is("slot", e), "holds 0 tokens"}));
    EXPECT_TRUE(rejects<E>(c, [&] { write(e, 0, 1); }, {seq_is(w, e), "holds 0 tokens"}));
  }
}

TYPED_TEST(PagedCache, WrongContentKindIsRejected) {
  using E = kvattn::invalid_argument;
  std::vector<float> k(64), v(64);
  Cache<TypeParam> g(config(kGqa, 3, 4));
  const SeqId gs = g.add_sequence();
  g.append(gs, 2);
  EXPECT_TRUE(rejects<E>(g, [&] { g.write_latent(gs, 0, 0, k.data(), v.data()); }, {"write_latent", "GQA", "write/read"}));
  EXPECT_TRUE(rejects<E>(g, [&] { g.write_latent(gs, 0, 0, 2, k.data(), v.data()); }, {"write_latent", "GQA"}));
  EXPECT_TRUE(rejects<E>(g, [&] { g.read_latent(gs, 0, 0, k.data(), v.data()); }, {"read_latent", "GQA", "write/read"}));
  Cache<TypeParam> m(config(kMla, 3, 4));
  const SeqId ms = m.add_sequence();
  m.append(ms, 2);
  EXPECT_TRUE(rejects<E>(m, [&] { m.write(ms, 0, 0, k.data(), v.data()); }, {"write", "MLA", "write_latent/read_latent"}));
  EXPECT_TRUE(rejects<E>(m, [&] { m.write(ms, 0, 0, 2, k.data(), v.data()); }, {"write", "MLA"}));
  EXPECT_TRUE(rejects<E>(m, [&] { m.read(ms, 0, 0, k.data(), v.data()); }, {"read", "MLA", "write_latent/read_latent"}));
}

TYPED_TEST(PagedCache, InvalidConfigIsRejected) {
  using T = TypeParam;
  using E = kvattn::shape_error;
  const auto construct = [](const CacheConfig& cfg) { return [cfg] { Cache<T> c(cfg); }; };
  for (int P : {0, -1, std::numeric_limits<int>::min()})
    EXPECT_TRUE(throws<E>(construct(config(kGqa, P, 4)), {"PagedKvCache", "page_size=" + std::to_string(P), "must be positive"}));
  const std::int64_t too_many = std::int64_t{std::numeric_limits<PageId>::max()} + 1;
  for (std::int64_t n : {std::int64_t{0}, std::int64_t{-5}, too_many})
    EXPECT_TRUE(throws<E>(construct(config(kMla, 16, n)), {"PagedKvCache", "num_pages=" + std::to_string(n), "from 1 to 2147483647"}));
  for (int layers : {0, -2})
    EXPECT_TRUE(throws<E>(construct(config(kGqa, 16, 4, layers)), {"PagedKvCache", "layers=" + std::to_string(layers), "must be positive"}));
  EXPECT_TRUE(throws<E>(construct(config(GqaShape{12, 5, 128}, 16, 4)), {"q_heads=12", "kv_heads=5", "multiple"}));
  EXPECT_TRUE(throws<E>(construct(config(GqaShape{8, 8, 0}, 16, 4)), {"head_dim=0", "positive"}));
  EXPECT_TRUE(throws<E>(construct(config(GqaShape{8, 0, 64}, 16, 4)), {"kv_heads=0", "positive"}));
  EXPECT_TRUE(throws<E>(construct(config(MlaShape{16, 512, 63, 128, 128, 0}, 16, 4)), {"rope_dim=63", "even"}));
  EXPECT_TRUE(throws<E>(construct(config(MlaShape{16, 0, 64, 128, 128, 0}, 16, 4)), {"latent_dim=0", "positive"}));
  // A pool whose size does not fit in 64 bits: 2^21 layers x 2^10 pages x 2^31 elements.
  EXPECT_TRUE(throws<kvattn::invalid_argument>(construct(config(GqaShape{1, 1, 1024}, 1 << 20, 1024, 1 << 21)),
                                               {"layers=2097152", "page_size=1048576", "num_pages=1024", "overflow"}));
}

// Every product behind the pool's size is checked before it is computed: 4 pages of 2^62 elements
// must be rejected, not wrapped to a layer stride of 0 (a null pool of 0 bytes).
TEST(PagedCacheConfig, SizesThatOverflowTheArithmeticAreRejected) {
  using T = kvattn::fp16;
  const auto construct = [](const CacheConfig& cfg) {
    return [cfg] {
      Cache<T> c(cfg);  // if this returns, report what was built
      throw std::logic_error("constructed: pool_bytes=" + std::to_string(c.pool_bytes()) +
                             " page_stride=" + std::to_string(c.layout().page_stride) +
                             " layer_stride=" + std::to_string(c.layer_stride()));
    };
  };
  // num_pages * page_stride = 4 * 2^62 (page_stride itself fits).
  EXPECT_TRUE(throws<kvattn::invalid_argument>(construct(config(GqaShape{2, 2, 1 << 30}, 1 << 30, 4, 1)), {"overflow"}));
  // page_stride = 2 * 8 * 2^60 (head_stride fits).
  EXPECT_TRUE(throws<kvattn::invalid_argument>(construct(config(GqaShape{8, 8, 1 << 30}, 1 << 30, 1, 1)), {"overflow"}));
}

TEST(PagedCacheConfig, ForModelTakesLayersAndShape) {
  const CacheConfig c = CacheConfig::for_model(kvattn::presets::llama3_8b.model, 16, 64);
  EXPECT_EQ(c.layers, 32);
  EXPECT_EQ(c.page_size, 16);
  EXPECT_EQ(c.num_pages, 64);
  EXPECT_EQ(std::get<GqaShape>(c.shape), GqaShape::gqa(32, 8, 128));
  EXPECT_TRUE(c.check().empty());
  const CacheConfig m = CacheConfig::for_model(kvattn::presets::deepseek_v2.model, 64, 8);
  EXPECT_EQ(m.layers, 60);
  EXPECT_EQ(std::get<MlaShape>(m.shape).latent_dim, 512);
}

// Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, pages of 16 tokens: 2 MiB a page. 64 pages.
TEST(PagedCacheStats, BookkeepingIsUnderOnePercentOfThePayloadLlama3_8B) {
  const kvattn::Model& model = kvattn::presets::llama3_8b.model;
  Cache<kvattn::bf16> c(CacheConfig::for_model(model, 16, 64));
  const CacheStats empty = c.stats();
  EXPECT_EQ(empty.bytes_per_page, 32 * 2 * 8 * 16 * 128 * 2);
  std::int64_t tokens = 0, partial = 0;
  for (std::int64_t len : {333, 17, 1, 250, 300}) {
    c.append(c.add_sequence(), len);
    tokens += len;
    partial += len % 16 != 0;
  }
  c.fork(c.sequences().front());
  const CacheStats st = c.stats();
  EXPECT_EQ(st.pages_used, 21 + 2 + 1 + 16 + 19);  // pages beyond the lengths' need are impossible
  EXPECT_EQ(st.tokens_stored, tokens);
  EXPECT_EQ(st.bytes_stored, tokens * 32 * 2 * 8 * 128 * 2);
  EXPECT_LE(st.bytes_reserved - st.bytes_stored, partial * st.bytes_per_page);
  EXPECT_LE(st.bytes_reserved - st.bytes_stored, st.sequences * st.bytes_per_page);
  const double share = static_cast<double>(st.bytes_bookkeeping) / static_cast<double>(st.bytes_stored);
  std::cout << "[ figure   ] llama-3-8b bf16, 16-token pages, " << st.pages_used << " of " << st.pages_total << " pages, "
            << st.sequences << " sequences, " << st.tokens_logical << " tokens: bookkeeping " << st.bytes_bookkeeping
            << " B for " << st.bytes_stored << " B of payload (" << share * 100 << " %), reserved beyond payload "
            << st.bytes_reserved - st.bytes_stored << " B\n";
  EXPECT_LT(share, 0.01);
}

// A moved-from cache keeps its geometry and holds no pages: add_sequence() then truncate(s, 0) and
// check_invariants() work (they once divided by a page size of 0). Run in a child process so that a
// crash fails this test only.
TEST(PagedCacheDeathTest, MovedFromCacheCanStillBeUsed) {
  EXPECT_EXIT(
      {
        Cache<float> a(config(kGqa, 4, 4));
        Cache<float> b(std::move(a));
        const SeqId s = a.add_sequence();
        a.truncate(s, 0);
        a.check_invariants();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
