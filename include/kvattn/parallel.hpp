// kvattn/parallel.hpp — how kernels share out their work.
//
// Threading belongs to the engine. A kernel exposes its work as n independent items and takes a
// parallel-for: any callable pf(n, body) that calls body(i) once for every i in [0, n), in any
// order and on any threads, and returns when every call has returned. Bodies never throw and
// never allocate. Two are provided: SerialFor (the calling thread alone) and ThreadPool (a
// fixed set of workers; the calling thread works too).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "error.hpp"

namespace kvattn {

/// The hardware threads of this machine (at least 1).
inline int hardware_threads() noexcept { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

/// Runs every item on the calling thread, in order.
struct SerialFor {
  template <class Body> void operator()(std::int64_t n, Body&& body) const {
    for (std::int64_t i = 0; i < n; ++i) body(i);
  }
};

/// A fixed pool of worker threads. operator()(n, body) hands items out one at a time, so
/// uneven items balance; the calling thread takes items too. One call at a time.
class ThreadPool {
 public:
  /// `threads` workers in all, the calling thread included (so threads - 1 are started).
  explicit ThreadPool(int threads = hardware_threads()) {
    if (threads < 1) raise<invalid_argument>(detail::concat("ThreadPool: threads=", threads, ": must be positive"));
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    for (int i = 0; i < threads - 1; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const noexcept { return static_cast<int>(workers_.size()) + 1; }

  template <class Body> void operator()(std::int64_t n, Body&& body) {
    if (n <= 0) return;
    if (workers_.empty() || n == 1) {
      for (std::int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    using B = std::remove_reference_t<Body>;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = const_cast<void*>(static_cast<const void*>(&body));
      call_ = [](void* b, std::int64_t i) { (*static_cast<B*>(b))(i); };
      n_ = n;
      next_.store(0, std::memory_order_relaxed);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    run_items();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return busy_ == 0; });
  }

 private:
  void run_items() {
    for (std::int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) call_(body_, i);
  }
  void work() {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      run_items();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (--busy_ == 0) done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  std::uint64_t generation_ = 0;
  int busy_ = 0;
  void* body_ = nullptr;
  void (*call_)(void*, std::int64_t) = nullptr;
  std::int64_t n_ = 0;
  std::atomic<std::int64_t> next_{0};
};

namespace detail {
template <class PF, class = void> struct tells_threads : std::false_type {};
template <class PF>
struct tells_threads<PF, std::void_t<decltype(static_cast<int>(std::declval<const PF&>().threads()))>> : std::true_type {};
}  // namespace detail

/// The threads a parallel-for runs on, where it can tell: its threads() (ThreadPool, or any
/// parallel-for of the engine's with that member), 1 for SerialFor, and this machine's hardware
/// threads for any other.
template <class PF> int threads_of(const PF& pf) noexcept {
  using P = std::decay_t<PF>;
  if constexpr (std::is_same_v<P, SerialFor>) {
    return 1;
  } else if constexpr (detail::tells_threads<P>::value) {
    return std::max(1, static_cast<int>(pf.threads()));
  } else {
    (void)pf;
    return hardware_threads();
  }
}

/// A parallel-for passed by reference through a function that is not a template (the compiled
/// kernels, kvattn/kernels.hpp): it refers to `pf` (which must outlive it) and forwards each call,
/// the body passed as a pointer and a function. It tells pf's threads (threads_of: pf.threads()
/// where pf has it, 1 for SerialFor, this machine's hardware threads for any other). A
/// default-made one runs items on the calling thread, like SerialFor.
class ParallelForRef {
 public:
  ParallelForRef() noexcept = default;
  template <class PF, class = std::enable_if_t<!std::is_same_v<std::decay_t<PF>, ParallelForRef>>>
  ParallelForRef(PF& pf) noexcept  // implicit: it stands where a parallel-for is taken
      : pf_(const_cast<void*>(static_cast<const void*>(&pf))),
        threads_(threads_of(pf)),
        run_([](void* f, std::int64_t n, void* body, Call call) {
          (*static_cast<PF*>(f))(n, [body, call](std::int64_t i) { call(body, i); });
        }) {}

  int threads() const noexcept { return threads_; }

  template <class Body> void operator()(std::int64_t n, Body&& body) const {
    using B = std::remove_reference_t<Body>;
    void* b = const_cast<void*>(static_cast<const void*>(&body));
    const Call call = [](void* f, std::int64_t i) { (*static_cast<B*>(f))(i); };
    if (run_ == nullptr) {
      for (std::int64_t i = 0; i < n; ++i) call(b, i);
    } else {
      run_(pf_, n, b, call);
    }
  }

 private:
  using Call = void (*)(void*, std::int64_t);

  void* pf_ = nullptr;
  int threads_ = 1;
  void (*run_)(void*, std::int64_t, void*, Call) = nullptr;
};

}  // namespace kvattn
