// Built with -fno-exceptions: a bad shape goes to the installed error handler, then aborts.
#include <kvattn/shape.hpp>

#include <cstdio>

int main() {
  kvattn::set_error_handler([](const char* kind, const char* message) noexcept {
    std::fprintf(stderr, "custom handler: %s: %s\n", kind, message);
  });
  kvattn::GqaShape{12, 5, 64}.validate();
  std::fprintf(stderr, "validate() returned\n");
  return 0;
}
