// kvattn/kvattn.hpp — the whole library. Include this one header.
#pragma once

#include "config.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "model.hpp"
#include "budget.hpp"
#include "storage.hpp"
#include "memory.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "state.hpp"
#include "simd.hpp"
#include "decode.hpp"
#include "prefill.hpp"
#include "rope.hpp"
#include "append.hpp"
