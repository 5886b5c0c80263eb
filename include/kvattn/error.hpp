// kvattn/error.hpp — the errors kvattn reports at its API boundary.
//
// Bad input (a shape that is not a shape, a size of zero, a request the cache cannot meet) is
// reported before anything changes, as an exception whose message names the offending values:
//   kvattn::invalid_argument  (derives from std::invalid_argument): the caller passed bad values;
//   kvattn::shape_error       (derives from kvattn::invalid_argument): a head layout is not valid;
//   kvattn::capacity_error    (derives from std::runtime_error): valid, but does not fit.
// Kernels' inner loops never throw: their inputs are checked once, at the entry point.
//
// In a build without exceptions (-fno-exceptions) the same errors go to a handler set with
// kvattn::set_error_handler(); the default handler prints the message to stderr. Either way the
// process then aborts, since the caller cannot be given control back with a bad result.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace kvattn {

class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class shape_error : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

class capacity_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Called with the exception's type name and message when exceptions are disabled.
using error_handler = void (*)(const char* kind, const char* message) noexcept;

namespace detail {
inline void default_error_handler(const char* kind, const char* message) noexcept {
  std::fprintf(stderr, "kvattn: %s: %s\n", kind, message);
}
inline std::atomic<error_handler>& error_handler_slot() noexcept {
  static std::atomic<error_handler> slot{&default_error_handler};
  return slot;
}

template <class E> constexpr const char* error_kind() noexcept {
  if constexpr (std::is_same_v<E, shape_error>) return "shape_error";
  else if constexpr (std::is_same_v<E, capacity_error>) return "capacity_error";
  else return "invalid_argument";
}

/// Streams every argument into one message: concat("q_heads=", 12) == "q_heads=12".
template <class... Args> std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

/// Installs the handler used when exceptions are disabled; returns the previous one.
inline error_handler set_error_handler(error_handler handler) noexcept {
  return detail::error_handler_slot().exchange(handler ? handler : &detail::default_error_handler);
}

/// Throws E(message), or with exceptions disabled reports it through the handler and aborts.
template <class E> [[noreturn]] void raise(const std::string& message) {
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
  throw E(message);
#else
  detail::error_handler_slot().load()(detail::error_kind<E>(), message.c_str());
  std::abort();
#endif
}

}  // namespace kvattn
