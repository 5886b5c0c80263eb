// tests/test_paged_cache_random.cpp — PagedKvCache against a plain reference model, one random
// operation at a time.
//
// The model is a vector of tokens per sequence, each token the id its data is derived from in
// each layer (value(id, layer, index), exact in fp16 and bf16), plus each sequence's list of
// abstract pages with their reference counts: enough to predict exactly which requests the pool
// cannot meet and what copy-on-write must copy, without looking at the cache.
//
// Operations: add, fork, append (and fill the new tokens, through write() or straight through the
// returned slots), overwrite tokens of a sequence whose pages are shared (every layer or one),
// truncate, remove, requests that must fail because the pool is full (the pool is small so this
// happens often), requests that must fail because they are invalid, and page tables read through
// views. After every operation:
//  - check_invariants(), and the same checks made here: the live sequences, their lengths and
//    page tables match the model page for page (one cache page per model page, shared exactly
//    where the model shares), reference counts match the tables, free + used = total, stats();
//  - every token of every live sequence reads back bit-exactly in every layer;
//  - a failed request threw the expected type and left everything as it was (sequences, page
//    tables, every reference count, free pages, stats() and the pool's bytes).
//
// Seeded and reproducible: the seed is printed; KVATTN_TEST_SEED=<n> runs another one.
#include <kvattn/paged_cache.hpp>

#include <gtest/gtest.h>

#include "cache_snapshot.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <typeinfo>
#include <utility>
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

constexpr int kLayers = 2;
constexpr int kMaxSequences = 6;
constexpr int kOpsPerConfig = 8000;
constexpr int kConfigs = 2 * 4 * 2;  // content x page size x element type
static_assert(kOpsPerConfig * kConfigs >= 100000, "the issue asks for at least 100,000 operations");
constexpr std::uint64_t kDefaultSeed = 20240611;

std::uint64_t base_seed() {
  static const std::uint64_t seed = [] {
    const char* env = std::getenv("KVATTN_TEST_SEED");
    return env != nullptr && *env != '\0' ? std::strtoull(env, nullptr, 0) : kDefaultSeed;
  }();
  return seed;
}

/// Entry `index` of data id `id` in `layer`: a multiple of 1/4 in [-32, 31.75], exact in fp32,
/// fp16 and bf16.
float value(std::uint64_t id, int layer, std::int64_t index) {
  std::uint64_t x = id * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(layer) * 0xC2B2AE3D27D4EB4Full +
                    static_cast<std::uint64_t>(index) * 0x165667B19E3779F9ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int>(x & 255u) - 128) * 0.25f;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ---- the reference model ---------------------------------------------------------------------

/// A token: the data id of its entries in each layer.
using Token = std::array<std::uint32_t, kLayers>;

struct RefSeq {
  std::vector<Token> tokens;
  std::vector<std::uint32_t> pages;  // model page ids, [ceil(tokens / page_size)]
};

struct Reference {
  std::int64_t page_size = 0, num_pages = 0;
  std::map<SeqId, RefSeq> seqs;
  std::vector<int> refs;  // [model pages ever made] sequences holding each
  std::int64_t used = 0;

  std::int64_t free() const { return num_pages - used; }
  std::uint32_t new_page() {
    refs.push_back(1);
    ++used;
    return static_cast<std::uint32_t>(refs.size() - 1);
  }
  void release(std::uint32_t p) {
    if (--refs[p] == 0) --used;
  }
  bool shared(std::uint32_t p) const { return refs[p] > 1; }

  /// Pages append(s, n) takes, or -1 if more tokens than the pool holds.
  std::int64_t append_needs(const RefSeq& s, std::int64_t n) const {
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    if (n > num_pages * page_size - len) return -1;
    const bool copy_last = len % page_size != 0 && shared(s.pages.back());
    return ceil_div(len + n, page_size) - static_cast<std::int64_t>(s.pages.size()) + (copy_last ? 1 : 0);
  }
  void append(RefSeq& s, std::int64_t n, std::uint32_t& next_id) {
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    if (len % page_size != 0 && shared(s.pages.back())) {
      release(s.pages.back());
      s.pages.back() = new_page();
    }
    while (static_cast<std::int64_t>(s.pages.size()) < ceil_div(len + n, page_size)) s.pages.push_back(new_page());
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint32_t id = next_id++;
      s.tokens.push_back(Token{id, id});
    }
  }
  /// Shared pages among those holding tokens [first, first + count).
  std::int64_t shared_in(const RefSeq& s, std::int64_t first, std::int64_t count) const {
    std::int64_t n = 0;
    for (std::int64_t i = first / page_size; i <= (first + count - 1) / page_size; ++i) n += shared(s.pages[static_cast<std::size_t>(i)]);
    return n;
  }
  void make_private(RefSeq& s, std::int64_t first, std::int64_t count) {
    for (std::int64_t i = first / page_size; i <= (first + count - 1) / page_size; ++i) {
      auto& p = s.pages[static_cast<std::size_t>(i)];
      if (shared(p)) {
        release(p);
        p = new_page();
      }
    }
  }
  void truncate(RefSeq& s, std::int64_t length) {
    s.tokens.resize(static_cast<std::size_t>(length));
    while (static_cast<std::int64_t>(s.pages.size()) > ceil_div(length, page_size)) {
      release(s.pages.back());
      s.pages.pop_back();
    }
  }
  std::int64_t logical_tokens() const {
    std::int64_t n = 0;
    for (const auto& entry : seqs) n += static_cast<std::int64_t>(entry.second.tokens.size());
    return n;
  }
};

// ---- snapshots -------------------------------------------------------------------------------

using cache_snapshot::same_state;
using cache_snapshot::Snapshot;
using cache_snapshot::snapshot;

// ---- configurations --------------------------------------------------------------------------

enum class Element { fp16, bf16 };

struct Scenario {
  PageContent content;
  int page_size;
  std::int64_t num_pages;  // small: the pool is full often
  Element element;
  int index;  // mixes the seed
};

std::string name_of(const Scenario& s) {
  return std::string(s.content == PageContent::gqa ? "GQA" : "MLA") + "_page" + std::to_string(s.page_size) + "_" +
         (s.element == Element::fp16 ? "fp16" : "bf16");
}

std::vector<Scenario> all_scenarios() {
  std::vector<Scenario> setups;
  for (PageContent content : {PageContent::gqa, PageContent::mla})
    for (int P : {1, 3, 16, 64})
      for (Element e : {Element::fp16, Element::bf16}) {
        // Pools of 20, 30, 96 and 256 tokens.
        const std::int64_t pages = P == 1 ? 20 : P == 3 ? 10 : P == 16 ? 6 : 4;
        setups.push_back(Scenario{content, P, pages, e, static_cast<int>(setups.size())});
      }
  return setups;
}

void PrintTo(const Scenario& s, std::ostream* out) { *out << name_of(s); }

/// Counts of what happened, so that a run that never reached a case cannot pass unnoticed.
struct Counts {
  int add = 0, fork = 0, append = 0, append_copied_last = 0, append_full = 0, overwrite = 0, overwrite_copied = 0,
      overwrite_full = 0, truncate = 0, remove = 0, invalid = 0, views = 0, max_tokens = 0;
};

// ---- the run ---------------------------------------------------------------------------------

template <class T> class Runner {
 public:
  Runner(const Scenario& setup, std::uint64_t seed)
      : setup_(setup),
        cache_(CacheConfig{kLayers, setup.page_size, setup.num_pages,
                           setup.content == PageContent::gqa ? AttentionShape{GqaShape::gqa(4, 2, 5)}
                                                             : AttentionShape{MlaShape{4, 7, 4, 8, 8, 0}}}),
        rng_(seed) {
    ref_.page_size = setup.page_size;
    ref_.num_pages = setup.num_pages;
    const PageLayout& l = cache_.layout();
    elements_ = static_cast<std::size_t>(l.token_elements());
    first_part_ = static_cast<std::size_t>(l.content == PageContent::gqa ? l.kv_heads * l.head_dim : l.latent_dim);
    buffer_.resize(elements_);
    want_.resize(elements_);
  }

  const Counts& counts() const { return counts_; }

  /// Runs `ops` operations; stops at the first failure, reported with the operation.
  void run(int ops) {
    for (op_ = 0; op_ < ops; ++op_) {
      what_.clear();
      ::testing::AssertionResult r = ::testing::AssertionSuccess();
      try {
        r = step();
        if (r) r = verify();
      } catch (const std::exception& e) {
        r = ::testing::AssertionFailure() << "unexpected exception: " << e.what();
      }
      if (!r) {
        ADD_FAILURE() << name_of(setup_) << ", seed " << seed_text() << ", operation " << op_ << " (" << what_
                      << "): " << r.message();
        return;
      }
      counts_.max_tokens = std::max(counts_.max_tokens, static_cast<int>(ref_.logical_tokens()));
    }
  }

 private:
  std::string seed_text() const {
    std::ostringstream out;
    out << "KVATTN_TEST_SEED=" << base_seed();
    return out.str();
  }
  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng_);
  }
  bool chance(int percent) { return uniform(0, 99) < percent; }
  SeqId pick_live() {
    auto it = ref_.seqs.begin();
    std::advance(it, uniform(0, static_cast<std::int64_t>(ref_.seqs.size()) - 1));
    return it->first;
  }
  std::int64_t len(SeqId s) const { return static_cast<std::int64_t>(ref_.seqs.at(s).tokens.size()); }
  template <class... Args> void note(const Args&... args) {
    std::ostringstream out;
    (out << ... << args);
    what_ = out.str();
  }

  // -- one random operation --

  ::testing::AssertionResult step() {
    const int live = static_cast<int>(ref_.seqs.size());
    // Keep the work per check bounded: with many tokens, shrink rather than grow.
    const bool crowded = ref_.logical_tokens() > 4 * setup_.page_size * setup_.num_pages / 3 + 24;
    const int r = static_cast<int>(uniform(0, 99));
    if (live == 0 || (r < 8 && live < kMaxSequences)) return op_add();
    if (r < 16 && live < kMaxSequences && !crowded) return op_fork();
    if (r < 40) return crowded ? op_truncate() : op_append();
    if (r < 62) return op_overwrite();
    if (r < 76) return op_truncate();
    if (r < 82 || (crowded && r < 88)) return op_remove();
    if (r < 96) return op_invalid();
    return op_views();
  }

  ::testing::AssertionResult fresh_id(SeqId s) {
    if (!ever_.insert(s).second) return ::testing::AssertionFailure() << "id " << s << " was given out before";
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult op_add() {
    note("add_sequence");
    const SeqId s = cache_.add_sequence();
    ++counts_.add;
    ref_.seqs[s];
    return fresh_id(s);
  }

  ::testing::AssertionResult op_fork() {
    const SeqId parent = pick_live();
    note("fork(", parent, ")");
    const SeqId child = cache_.fork(parent);
    ++counts_.fork;
    RefSeq copy = ref_.seqs.at(parent);
    for (std::uint32_t p : copy.pages) ++ref_.refs[p];
    ref_.seqs[child] = std::move(copy);
    return fresh_id(child);
  }

  ::testing::AssertionResult op_append() {
    const SeqId s = pick_live();
    const std::int64_t P = setup_.page_size, capacity = P * setup_.num_pages;
    const int r = static_cast<int>(uniform(0, 99));
    // Decode steps, prompts up to a few pages, and now and then more than the pool holds.
    const std::int64_t n = r < 35 ? uniform(1, 4) : r < 70 ? uniform(1, P) : r < 92 ? uniform(1, 2 * P) : uniform(1, capacity + 2);
    note("append(", s, ", ", n, ") at length ", len(s), " with ", ref_.free(), " free pages");
    RefSeq& m = ref_.seqs.at(s);
    const std::int64_t needs = ref_.append_needs(m, n);
    if (needs < 0 || needs > ref_.free()) {
      ++counts_.append_full;
      const std::string why = needs < 0 ? "exceed the pool's " + std::to_string(capacity)
                                        : "the pool has " + std::to_string(ref_.free()) + " of " + std::to_string(setup_.num_pages);
      if (chance(50)) return rejects<kvattn::capacity_error>([&] { cache_.append(s, n); }, why);
      std::vector<Slot> out(static_cast<std::size_t>(n), Slot{-1, -1});
      if (auto r = rejects<kvattn::capacity_error>([&] { cache_.append(s, n, out.data()); }, why); !r) return r;
      if (std::any_of(out.begin(), out.end(), [](Slot x) { return x != Slot{-1, -1}; }))
        return ::testing::AssertionFailure() << "a rejected append wrote slots";
      return ::testing::AssertionSuccess();
    }
    const std::int64_t first = len(s);
    const bool copies = first % P != 0 && ref_.shared(m.pages.back());
    // The three forms: slots returned, written to an array, or none (then asked with slot()).
    std::vector<Slot> slots;
    const int form = static_cast<int>(uniform(0, 2));
    if (form == 0) {
      slots = cache_.append(s, n);
    } else if (form == 1) {
      slots.assign(static_cast<std::size_t>(n), Slot{-1, -1});
      cache_.append(s, n, slots.data());
    } else {
      cache_.append(s, n, nullptr);
      for (std::int64_t t = first; t < first + n; ++t) slots.push_back(cache_.slot(s, t));
    }
    ++counts_.append;
    counts_.append_copied_last += copies;
    ref_.append(m, n, next_id_);
    // The slots, in order, where the page table says.
    if (static_cast<std::int64_t>(slots.size()) != n) return ::testing::AssertionFailure() << slots.size() << " slots";
    const std::vector<PageId>& pages = cache_.pages(s);
    for (std::int64_t k = 0; k < n; ++k) {
      const std::int64_t t = first + k;
      const Slot want{pages.at(static_cast<std::size_t>(t / P)), static_cast<std::int32_t>(t % P)};
      if (slots[static_cast<std::size_t>(k)] != want)
        return ::testing::AssertionFailure() << "slot " << k << " is (" << slots[static_cast<std::size_t>(k)].page << ", "
                                             << slots[static_cast<std::size_t>(k)].offset << "), want (" << want.page << ", "
                                             << want.offset << ")";
    }
    // Fill the new tokens: one write per layer, one per token, or straight into the pool through
    // the slots (which must then be the sequence's own pages).
    const int how = static_cast<int>(uniform(0, 2));
    for (int layer = 0; layer < kLayers; ++layer) {
      if (how == 0) {
        write_range(s, layer, first, n);
      } else if (how == 1) {
        for (std::int64_t t = first; t < first + n; ++t) write_range(s, layer, t, 1);
      } else {
        for (std::int64_t k = 0; k < n; ++k) write_raw(slots[static_cast<std::size_t>(k)], layer, m.tokens[static_cast<std::size_t>(first + k)][layer]);
      }
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult op_overwrite() {
    // Most often a sequence with a shared page, writing from inside a shared page.
    std::vector<std::pair<SeqId, std::int64_t>> shared;  // (sequence, a shared page of it)
    for (const auto& [id, m] : ref_.seqs)
      for (std::size_t i = 0; i < m.pages.size(); ++i)
        if (ref_.shared(m.pages[i])) shared.emplace_back(id, static_cast<std::int64_t>(i));
    SeqId s = -1;
    std::int64_t first = 0;
    const std::int64_t P = setup_.page_size;
    if (!shared.empty() && chance(75)) {
      const auto [id, page] = shared[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(shared.size()) - 1))];
      s = id;
      first = page * P + uniform(0, std::min(P, len(s) - page * P) - 1);
    } else {
      std::vector<SeqId> nonempty;
      for (const auto& [id, m] : ref_.seqs)
        if (!m.tokens.empty()) nonempty.push_back(id);
      if (nonempty.empty()) return op_append();
      s = nonempty[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(nonempty.size()) - 1))];
      first = uniform(0, len(s) - 1);
    }
    const std::int64_t count = uniform(1, std::min(len(s) - first, 2 * P + 1));
    const int only = chance(30) ? static_cast<int>(uniform(0, kLayers - 1)) : -1;  // one layer, or all
    RefSeq& m = ref_.seqs.at(s);
    const std::int64_t copies = ref_.shared_in(m, first, count);
    note("overwrite(", s, ", [", first, ", ", first + count, "), layer ", only, ") copying ", copies, " with ", ref_.free(),
         " free pages");
    const int first_layer = only >= 0 ? only : static_cast<int>(uniform(0, kLayers - 1));
    if (copies > ref_.free()) {
      ++counts_.overwrite_full;
      return rejects<kvattn::capacity_error>([&] { write_range(s, first_layer, first, count, 0); },
                                             "copying " + std::to_string(copies) + " shared page" + (copies == 1 ? "" : "s") +
                                                 " needs as many free pages, the pool has " + std::to_string(ref_.free()));
    }
    ++counts_.overwrite;
    counts_.overwrite_copied += copies > 0;
    ref_.make_private(m, first, count);
    const std::uint32_t base = next_id_;
    next_id_ += static_cast<std::uint32_t>(count);
    for (int k = 0; k < kLayers; ++k) {
      const int layer = (first_layer + k) % kLayers;
      if (only >= 0 && layer != only) continue;
      for (std::int64_t i = 0; i < count; ++i) m.tokens[static_cast<std::size_t>(first + i)][layer] = base + static_cast<std::uint32_t>(i);
      write_range(s, layer, first, count);
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult op_truncate() {
    const SeqId s = pick_live();
    const std::int64_t length = len(s), P = setup_.page_size;
    const int r = static_cast<int>(uniform(0, 99));
    const std::int64_t to = r < 10 ? 0 : r < 20 ? length : r < 50 ? std::max<std::int64_t>(0, length - uniform(1, P)) : uniform(0, length);
    note("truncate(", s, ", ", to, ") from ", length);
    cache_.truncate(s, to);
    ++counts_.truncate;
    ref_.truncate(ref_.seqs.at(s), to);
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult op_remove() {
    const SeqId s = pick_live();
    note("remove(", s, ")");
    cache_.remove(s);
    ++counts_.remove;
    RefSeq& m = ref_.seqs.at(s);
    for (std::uint32_t p : m.pages) ref_.release(p);
    ref_.seqs.erase(s);
    return ::testing::AssertionSuccess();
  }

  /// A request that is not valid: unknown sequence, bad count, length, layer or position, or the
  /// other content's operation.
  ::testing::AssertionResult op_invalid() {
    ++counts_.invalid;
    using E = kvattn::invalid_argument;
    const bool gqa = setup_.content == PageContent::gqa;
    const int kind = static_cast<int>(uniform(0, 5));
    const SeqId s = pick_live();
    const std::int64_t length = len(s);
    std::vector<float> k(elements_ * 8), v(elements_ * 8);
    if (kind == 0) {  // a sequence that was removed or never was
      SeqId bad = uniform(1000000, 2000000);
      for (SeqId old : ever_)
        if (ref_.seqs.count(old) == 0 && chance(50)) bad = old;
      const std::string seq = "seq=" + std::to_string(bad);
      const int op = static_cast<int>(uniform(0, 8));
      note("request ", op, " on unknown sequence ", bad);
      switch (op) {
        case 0: return rejects<E>([&] { cache_.append(bad, 1); }, seq);
        case 1: return rejects<E>([&] { cache_.fork(bad); }, seq);
        case 2: return rejects<E>([&] { cache_.truncate(bad, 0); }, seq);
        case 3: return rejects<E>([&] { cache_.remove(bad); }, seq);
        case 4: return rejects<E>([&] { write_range(bad, 0, 0, 1, 0); }, seq);
        case 5: return rejects<E>([&] { read_into(bad, 0, 0, k.data(), v.data()); }, seq);
        case 6: return rejects<E>([&] { cache_.slot(bad, 0); }, seq);
        case 7: return rejects<E>([&] { (void)cache_.length(bad); }, seq);
        default: return rejects<E>([&] { (void)cache_.page_table({s, bad}); }, seq);
      }
    }
    if (kind == 1) {  // append of zero or fewer tokens
      const std::int64_t n = -uniform(0, 3);
      note("append(", s, ", ", n, ")");
      return rejects<E>([&] { cache_.append(s, n); }, "n=" + std::to_string(n));
    }
    if (kind == 2) {  // truncation past the end or below zero
      const std::int64_t to = chance(50) ? length + uniform(1, 5) : -uniform(1, 5);
      note("truncate(", s, ", ", to, ") from ", length);
      return rejects<E>([&] { cache_.truncate(s, to); }, "length=" + std::to_string(to));
    }
    if (kind == 3) {  // layer out of range
      const int layer = chance(50) ? -1 : kLayers + static_cast<int>(uniform(0, 2));
      note("layer ", layer, " of ", s);
      const std::string what = "layer=" + std::to_string(layer);
      if (length > 0 && chance(50)) return rejects<E>([&] { write_range(s, layer, 0, 1, 0); }, what);
      if (length > 0) return rejects<E>([&] { read_into(s, layer, 0, k.data(), v.data()); }, what);
      const BatchPageTable table = cache_.page_table({s});
      return rejects<E>([&] { (void)cache_.view(table, layer); }, what);
    }
    if (kind == 4) {  // position out of range
      const int layer = static_cast<int>(uniform(0, kLayers - 1));
      const std::int64_t at = chance(50) ? length + uniform(0, 3) : -uniform(1, 3);
      note("position ", at, " of ", s, " holding ", length);
      const std::string what = "position=" + std::to_string(at);
      switch (uniform(0, 3)) {
        case 0: return rejects<E>([&] { read_into(s, layer, at, k.data(), v.data()); }, what);
        case 1: return rejects<E>([&] { cache_.slot(s, at); }, what);
        case 2: return rejects<E>([&] { write_range(s, layer, at, 1, 0); }, what);
        default: {
          const std::int64_t first = uniform(0, length), count = length - first + uniform(1, 3);
          return rejects<E>([&] { write_range(s, layer, first, count, 0); }, "count=" + std::to_string(count));
        }
      }
    }
    note("the other content's operation on ", s);
    const char* op = gqa ? "write_latent" : "write";
    if (length == 0) return ::testing::AssertionSuccess();
    if (gqa) {
      if (chance(50)) return rejects<E>([&] { cache_.write_latent(s, 0, 0, k.data(), v.data()); }, op);
      return rejects<E>([&] { cache_.read_latent(s, 0, 0, k.data(), v.data()); }, "read_latent");
    }
    if (chance(50)) return rejects<E>([&] { cache_.write(s, 0, 0, k.data(), v.data()); }, op);
    return rejects<E>([&] { cache_.read(s, 0, 0, k.data(), v.data()); }, "read");
  }

  /// Every live sequence (and each twice) through a page table and one view per layer.
  ::testing::AssertionResult op_views() {
    ++counts_.views;
    note("page table and views");
    std::vector<SeqId> batch;
    for (const auto& entry : ref_.seqs) batch.push_back(entry.first);
    for (const auto& entry : ref_.seqs) batch.push_back(entry.first);
    const BatchPageTable table = cache_.page_table(batch);
    const std::int64_t P = setup_.page_size;
    for (int layer = 0; layer < kLayers; ++layer) {
      const kvattn::PagedKvView<T> view = cache_.view(table, layer);
      if (view.batch != static_cast<int>(batch.size())) return ::testing::AssertionFailure() << "view.batch " << view.batch;
      for (int b = 0; b < view.batch; ++b) {
        const RefSeq& m = ref_.seqs.at(batch[static_cast<std::size_t>(b)]);
        const auto length = static_cast<std::int64_t>(m.tokens.size());
        if (view.length(b) != length) return ::testing::AssertionFailure() << "view.length(" << b << ") " << view.length(b);
        const std::int32_t last = view.last_page_len[b];
        if (last != (length == 0 ? 0 : (length - 1) % P + 1)) return ::testing::AssertionFailure() << "last_page_len " << last;
        for (std::int64_t t = 0; t < length; ++t) {
          const T* page = view.page(view.indices[view.indptr[b] + t / P]);
          const auto o = static_cast<int>(t % P);
          const PageLayout& l = view.layout;
          std::size_t i = 0;
          if (l.content == PageContent::gqa) {
            for (int h = 0; h < l.kv_heads; ++h)
              for (int d = 0; d < l.head_dim; ++d) buffer_[i++] = kvattn::to_float(page[l.key(h, o) + d]);
            for (int h = 0; h < l.kv_heads; ++h)
              for (int d = 0; d < l.head_dim; ++d) buffer_[i++] = kvattn::to_float(page[l.value(h, o) + d]);
          } else {
            for (int d = 0; d < l.latent_dim; ++d) buffer_[i++] = kvattn::to_float(page[l.latent(o) + d]);
            for (int d = 0; d < l.rope_dim; ++d) buffer_[i++] = kvattn::to_float(page[l.rope(o) + d]);
          }
          if (auto r = compare(m.tokens[static_cast<std::size_t>(t)][layer], layer); !r)
            return r << " (through the view: batch entry " << b << ", token " << t << ", layer " << layer << ")";
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  // -- writing and reading --

  /// Writes tokens [first, first + count) of `s` in `layer` with the data the model holds for
  /// them (or, for a request expected to fail, `fill` for all). Src is fp32, or now and then
  /// the other 16-bit type (exact either way).
  void write_range(SeqId s, int layer, std::int64_t first, std::int64_t count, int fill = -1) {
    const std::size_t n = static_cast<std::size_t>(std::max<std::int64_t>(count, 1));
    const std::size_t a = first_part_, b = elements_ - a;
    const bool narrow = chance(10);
    std::vector<float> x(n * a), y(n * b);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t id = fill >= 0 ? static_cast<std::uint64_t>(fill)
                                         : ref_.seqs.at(s).tokens[static_cast<std::size_t>(first) + i][static_cast<std::size_t>(layer)];
      for (std::size_t j = 0; j < a; ++j) x[i * a + j] = value(id, layer, static_cast<std::int64_t>(j));
      for (std::size_t j = 0; j < b; ++j) y[i * b + j] = value(id, layer, static_cast<std::int64_t>(a + j));
    }
    if (narrow) {
      std::vector<kvattn::bf16> xb(x.size()), yb(y.size());
      kvattn::convert_row(x.data(), xb.data(), x.size());
      kvattn::convert_row(y.data(), yb.data(), y.size());
      if (setup_.content == PageContent::gqa) cache_.write(s, layer, first, count, xb.data(), yb.data());
      else cache_.write_latent(s, layer, first, count, xb.data(), yb.data());
    } else if (setup_.content == PageContent::gqa) {
      cache_.write(s, layer, first, count, x.data(), y.data());
    } else {
      cache_.write_latent(s, layer, first, count, x.data(), y.data());
    }
  }

  /// Writes token data `id` straight into the pool at `slot` of `layer`, through the layout.
  void write_raw(Slot slot, int layer, std::uint64_t id) {
    const PageLayout& l = cache_.layout();
    T* page = cache_.layer_data(layer) + std::int64_t{slot.page} * l.page_stride;
    std::int64_t i = 0;
    const auto put = [&](T* dst, int n) {
      for (int d = 0; d < n; ++d) dst[d] = kvattn::from_float<T>(value(id, layer, i++));
    };
    if (l.content == PageContent::gqa) {
      for (int h = 0; h < l.kv_heads; ++h) put(page + l.key(h, slot.offset), l.head_dim);
      for (int h = 0; h < l.kv_heads; ++h) put(page + l.value(h, slot.offset), l.head_dim);
    } else {
      put(page + l.latent(slot.offset), l.latent_dim);
      put(page + l.rope(slot.offset), l.rope_dim);
    }
  }

  void read_into(SeqId s, int layer, std::int64_t position, float* a, float* b) const {
    if (setup_.content == PageContent::gqa) cache_.read(s, layer, position, a, b);
    else cache_.read_latent(s, layer, position, a, b);
  }

  /// buffer_ holds token data `id` of `layer`, bit for bit.
  ::testing::AssertionResult compare(std::uint64_t id, int layer) {
    for (std::size_t i = 0; i < elements_; ++i) want_[i] = value(id, layer, static_cast<std::int64_t>(i));
    if (std::memcmp(buffer_.data(), want_.data(), elements_ * sizeof(float)) == 0) return ::testing::AssertionSuccess();
    std::size_t i = 0;
    while (i < elements_ && std::memcmp(&buffer_[i], &want_[i], sizeof(float)) == 0) ++i;
    return ::testing::AssertionFailure() << "entry " << i << " reads " << buffer_[i] << ", want " << want_[i] << " (data id " << id << ")";
  }

  // -- checks --

  /// `request` throws exactly E naming `part`, and changes nothing at all.
  template <class E, class F> ::testing::AssertionResult rejects(F&& request, const std::string& part) {
    const Snapshot before = snapshot(cache_);
    try {
      request();
      return ::testing::AssertionFailure() << "did not throw";
    } catch (const std::exception& e) {
      if (typeid(e) != typeid(E)) return ::testing::AssertionFailure() << "threw " << typeid(e).name() << ": " << e.what();
      if (std::string(e.what()).find(part) == std::string::npos)
        return ::testing::AssertionFailure() << "the message \"" << e.what() << "\" does not name \"" << part << "\"";
    }
    if (auto r = same_state(before, snapshot(cache_)); !r) return r << " (by a request that failed)";
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult verify() {
    try {
      cache_.check_invariants();
    } catch (const std::exception& e) {
      return ::testing::AssertionFailure() << "check_invariants: " << e.what();
    }
    // The sequences and their page tables: one cache page per model page, both ways.
    std::vector<SeqId> ids;
    for (const auto& entry : ref_.seqs) ids.push_back(entry.first);
    if (cache_.sequences() != ids) return ::testing::AssertionFailure() << "sequences() differ from the model's";
    const std::int64_t P = setup_.page_size, N = setup_.num_pages;
    page_of_.clear();
    node_of_.assign(static_cast<std::size_t>(N), -1);
    std::vector<int> fill(static_cast<std::size_t>(N), 0);
    std::int64_t tokens = 0, partial = 0;
    for (const auto& [id, m] : ref_.seqs) {
      const auto length = static_cast<std::int64_t>(m.tokens.size());
      tokens += length;
      partial += length % P != 0;
      if (cache_.length(id) != length)
        return ::testing::AssertionFailure() << "seq " << id << ": length " << cache_.length(id) << ", model " << length;
      const std::vector<PageId>& pages = cache_.pages(id);
      if (pages.size() != m.pages.size())
        return ::testing::AssertionFailure() << "seq " << id << ": " << pages.size() << " pages, model " << m.pages.size();
      for (std::size_t i = 0; i < pages.size(); ++i) {
        const PageId p = pages[i];
        if (p < 0 || p >= N) return ::testing::AssertionFailure() << "seq " << id << ": page id " << p;
        const std::uint32_t node = m.pages[i];
        const auto [it, added] = page_of_.emplace(node, p);
        if (it->second != p || (node_of_[static_cast<std::size_t>(p)] != -1 && node_of_[static_cast<std::size_t>(p)] != node))
          return ::testing::AssertionFailure() << "seq " << id << " page " << i << ": cache page " << p
                                               << " is shared differently from the model's";
        node_of_[static_cast<std::size_t>(p)] = node;
        (void)added;
        const auto in_page = static_cast<int>(std::min<std::int64_t>(P, length - static_cast<std::int64_t>(i) * P));
        fill[static_cast<std::size_t>(p)] = std::max(fill[static_cast<std::size_t>(p)], in_page);
      }
    }
    // Reference counts match the tables; free + used = total.
    std::int64_t used = 0, shared = 0, stored = 0, partial_pages = 0;
    for (PageId p = 0; p < N; ++p) {
      const std::int64_t node = node_of_[static_cast<std::size_t>(p)];
      const int want = node < 0 ? 0 : ref_.refs[static_cast<std::size_t>(node)];
      if (cache_.page_refcount(p) != want)
        return ::testing::AssertionFailure() << "page " << p << ": refcount " << cache_.page_refcount(p) << ", model " << want;
      used += node >= 0;
      shared += want > 1;
      stored += fill[static_cast<std::size_t>(p)];
      partial_pages += node >= 0 && fill[static_cast<std::size_t>(p)] < P;
    }
    if (used != ref_.used) return ::testing::AssertionFailure() << used << " pages used, model " << ref_.used;
    if (cache_.free_pages() + used != N)
      return ::testing::AssertionFailure() << "free " << cache_.free_pages() << " + used " << used << " != " << N;
    // At most one partly filled page per sequence: no page is reserved beyond what lengths need.
    if (partial_pages > partial) return ::testing::AssertionFailure() << partial_pages << " partly filled pages";
    const CacheStats st = cache_.stats();
    const std::int64_t elem = static_cast<std::int64_t>(sizeof(T)), bpp = cache_.layout().page_stride * kLayers * elem;
    const std::int64_t payload = cache_.layout().token_elements() * kLayers * elem;
    const std::pair<std::int64_t, std::int64_t> want[] = {
        {st.pages_total, N},          {st.pages_free, N - used},   {st.pages_used, used},
        {st.pages_shared, shared},    {st.sequences, static_cast<std::int64_t>(ref_.seqs.size())},
        {st.tokens_logical, tokens},  {st.tokens_stored, stored},  {st.bytes_per_page, bpp},
        {st.bytes_reserved, used * bpp}, {st.bytes_stored, stored * payload}, {st.bytes_pool, N * bpp}};
    for (std::size_t i = 0; i < std::size(want); ++i)
      if (want[i].first != want[i].second)
        return ::testing::AssertionFailure() << "stats() field " << i << " is " << want[i].first << ", want " << want[i].second;
    if (st.bytes_reserved - st.bytes_stored > st.sequences * bpp + used * (bpp - P * payload))
      return ::testing::AssertionFailure() << "reserved beyond the payload: " << st.bytes_reserved - st.bytes_stored;
    // Every token of every live sequence, in every layer, bit for bit.
    for (const auto& [id, m] : ref_.seqs)
      for (int layer = 0; layer < kLayers; ++layer)
        for (std::size_t t = 0; t < m.tokens.size(); ++t) {
          read_into(id, layer, static_cast<std::int64_t>(t), buffer_.data(), buffer_.data() + first_part_);
          if (auto r = compare(m.tokens[t][static_cast<std::size_t>(layer)], layer); !r)
            return r << " (seq " << id << ", token " << t << ", layer " << layer << ")";
        }
    return ::testing::AssertionSuccess();
  }

  Scenario setup_;
  Cache<T> cache_;
  Reference ref_;
  std::mt19937_64 rng_;
  std::set<SeqId> ever_;          // every id given out
  std::uint32_t next_id_ = 1;     // the next token data id
  std::size_t elements_ = 0, first_part_ = 0;
  std::vector<float> buffer_, want_;  // [token_elements]
  std::map<std::uint32_t, PageId> page_of_;  // model page -> cache page, rebuilt by verify()
  std::vector<std::int64_t> node_of_;        // [num_pages] cache page -> model page or -1
  Counts counts_;
  int op_ = 0;
  std::string what_;
};

class PagedCacheRandom : public ::testing::TestWithParam<Scenario> {};

template <class T> Counts run_setup(const Scenario& setup) {
  const std::uint64_t seed = base_seed() * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(setup.index);
  Runner<T> runner(setup, seed);
  runner.run(kOpsPerConfig);
  return runner.counts();
}

TEST_P(PagedCacheRandom, MatchesTheReferenceAfterEveryOperation) {
  const Scenario& setup = GetParam();
  std::cout << "[ seed     ] KVATTN_TEST_SEED=" << base_seed() << " (" << name_of(setup) << ", " << kOpsPerConfig
            << " operations)\n";
  const Counts c = setup.element == Element::fp16 ? run_setup<kvattn::fp16>(setup) : run_setup<kvattn::bf16>(setup);
  if (HasFailure()) return;
  std::cout << "[ counts   ] add " << c.add << ", fork " << c.fork << ", append " << c.append << " (copied a shared last page "
            << c.append_copied_last << ", pool full " << c.append_full << "), overwrite " << c.overwrite << " (copied "
            << c.overwrite_copied << ", pool full " << c.overwrite_full << "), truncate " << c.truncate << ", remove "
            << c.remove << ", invalid " << c.invalid << ", views " << c.views << "; most tokens at once " << c.max_tokens
            << "\n";
  // The run reached every case (loose bounds: they hold for any seed).
  EXPECT_GT(c.fork, 50);
  EXPECT_GT(c.append, 200);
  EXPECT_GT(c.append_full, 100);
  EXPECT_GT(c.overwrite_copied, 15);
  EXPECT_GT(c.overwrite_full, 20);
  EXPECT_GT(c.truncate, 200);
  EXPECT_GT(c.remove, 50);
  EXPECT_GT(c.invalid, 100);
  EXPECT_GT(c.views, 20);
  if (setup.page_size > 1) {
    EXPECT_GT(c.append_copied_last, 3);
  }
}

INSTANTIATE_TEST_SUITE_P(Configurations, PagedCacheRandom, ::testing::ValuesIn(all_scenarios()),
                         [](const ::testing::TestParamInfo<Scenario>& info) { return name_of(info.param); });

}  // namespace
