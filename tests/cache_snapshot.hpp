// tests/cache_snapshot.hpp — everything a PagedKvCache shows, captured so that a test can prove
// that a rejected request left the cache exactly as it was: the live sequences, their lengths
// and page tables, every page's reference count, the free pages, stats() and the pool's bytes.
#pragma once

#include <kvattn/paged_cache.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace cache_snapshot {

using kvattn::CacheStats;
using kvattn::PageId;
using kvattn::SeqId;

struct Snapshot {
  std::vector<SeqId> seqs;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<PageId>> pages;
  std::vector<int> refcounts;  // [num_pages]
  std::int64_t free_pages = 0;
  CacheStats stats;
  std::vector<unsigned char> pool;  // [pool_bytes()]
};

template <class T> Snapshot snapshot(const kvattn::PagedKvCache<T>& c) {
  Snapshot s;
  s.seqs = c.sequences();
  for (SeqId id : s.seqs) {
    s.lengths.push_back(c.length(id));
    s.pages.push_back(c.pages(id));
  }
  for (std::int64_t p = 0; p < c.config().num_pages; ++p) s.refcounts.push_back(c.page_refcount(static_cast<PageId>(p)));
  s.free_pages = c.free_pages();
  s.stats = c.stats();
  const auto* bytes = reinterpret_cast<const unsigned char*>(c.data());
  if (bytes != nullptr) s.pool.assign(bytes, bytes + c.pool_bytes());
  return s;
}

constexpr std::pair<const char*, std::int64_t CacheStats::*> kStatsFields[] = {
    {"pages_total", &CacheStats::pages_total},       {"pages_free", &CacheStats::pages_free},
    {"pages_used", &CacheStats::pages_used},         {"pages_shared", &CacheStats::pages_shared},
    {"sequences", &CacheStats::sequences},           {"tokens_logical", &CacheStats::tokens_logical},
    {"tokens_stored", &CacheStats::tokens_stored},   {"bytes_per_page", &CacheStats::bytes_per_page},
    {"bytes_reserved", &CacheStats::bytes_reserved}, {"bytes_stored", &CacheStats::bytes_stored},
    {"bytes_pool", &CacheStats::bytes_pool},         {"bytes_bookkeeping", &CacheStats::bytes_bookkeeping},
};

inline ::testing::AssertionResult same_state(const Snapshot& a, const Snapshot& b) {
  if (a.seqs != b.seqs) return ::testing::AssertionFailure() << "the live sequences changed";
  for (std::size_t i = 0; i < a.seqs.size(); ++i) {
    if (a.lengths[i] != b.lengths[i])
      return ::testing::AssertionFailure() << "seq " << a.seqs[i] << ": length " << a.lengths[i] << " -> " << b.lengths[i];
    if (a.pages[i] != b.pages[i]) return ::testing::AssertionFailure() << "seq " << a.seqs[i] << ": its page table changed";
  }
  for (std::size_t p = 0; p < a.refcounts.size(); ++p)
    if (a.refcounts[p] != b.refcounts[p])
      return ::testing::AssertionFailure() << "page " << p << ": refcount " << a.refcounts[p] << " -> " << b.refcounts[p];
  if (a.free_pages != b.free_pages)
    return ::testing::AssertionFailure() << "free_pages " << a.free_pages << " -> " << b.free_pages;
  for (const auto& [name, field] : kStatsFields)
    if (a.stats.*field != b.stats.*field)
      return ::testing::AssertionFailure() << "stats()." << name << " " << a.stats.*field << " -> " << b.stats.*field;
  if (a.pool.size() != b.pool.size() || (!a.pool.empty() && std::memcmp(a.pool.data(), b.pool.data(), a.pool.size()) != 0))
    return ::testing::AssertionFailure() << "the pool's bytes changed";
  return ::testing::AssertionSuccess();
}

}  // namespace cache_snapshot
