// bench/machine_limits.cpp — this machine's limits alone: streaming read bandwidth and fp32 FMA
// peak, for 1, 2 and all threads (see bench_common.hpp). Every other kvattn benchmark program
// prints the same figures beside its own.
#include "bench_common.hpp"

KVATTN_BENCHMARK_MAIN()
