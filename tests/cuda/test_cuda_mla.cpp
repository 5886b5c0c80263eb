// The CUDA folded MLA decode (kvattn/cuda/mla_decode.hpp) against the plain double-precision
// reference of mla_reference.hpp, on the same rounded latents, with the CPU kernel's bounds
// (test_mla.cpp): element-wise, |out − ref| <= (2e-5 + 2·e_s) · max|c| + 2e-5 · |ref| and
// |lse − ref| <= 2e-5 · (1 + |ref|) + e_s.
//
// Shapes: DeepSeek-V2's and V2-Lite's head layouts (128 and 16 heads, latent 512, rotary 64)
// and awkward ones: latent widths of 17, 40, 64, 300, 1100, 2000 and 2040 with rotary widths of
// 2 to 8 (rows of 16-byte multiples and not, so both tile copies run; one and two columns per
// lane; several column blocks; rows too wide for shared memory, done in chunks); 1, 2, 3, 5,
// 16 and 128 heads; pages of 1, 7, 16 and 64 tokens; contexts 0, 1, 2, a page ± 1, around a
// tile, a few hundred, 1000 and 3000; Q = 1 to 4; chunks of keys forced down to one token
// (so the merge sees empty parts); batches of mixed lengths; fp32, fp16 and bf16. The MLA
// formats fp8_e4m3_latent and int8_latent against the reference on the latents read_latent
// dequantizes (the same bounds): rows of 16-byte multiples (512 + 64, 128 + 6, 2048 + 8) and of
// 4-byte ones (128 + 16, 256 + 16, 384 + 8, 1920 + 8), one to sixteen blocks of 128, chunks of the
// inner dimension among them (one of the rotary key alone), with gpt-oss's policy. The score
// policies as the CPU tests run them (test_mla.cpp): sinks (counted once however the keys are
// split), ALiBi, tree masks (Q up to 16), the window with the soft-cap, and gpt-oss's window +
// soft-cap + sinks, with sequences split into many chunks and sequences of one.
//
// Every test that runs a kernel skips without a CUDA device; the argument checks run anywhere,
// since they throw before the device is touched.
#include <kvattn/core.hpp>
#include <kvattn/paged_cache.hpp>
#include <kvattn/policy.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../mla_reference.hpp"
#include "../policy_checks.hpp"
#include "device.hpp"
#include "mla_kernels.hpp"

namespace {

using kvattn::bf16;
using kvattn::fp16;
using kvattn::MlaShape;
using kvattn::PagedKvCache;
using kvattn::SeqId;

const MlaShape kV2{128, 512, 64, 128, 128, 1536};
const MlaShape kV2Lite{16, 512, 64, 128, 128, 0};
const MlaShape kOne{1, 17, 2, 8, 8, 0};       // rows of 19: element-wise copies
const MlaShape kOdd{3, 40, 6, 16, 12, 0};     // rows of 46
const MlaShape kSix{3, 64, 6, 16, 12, 0};     // rows of 70
const MlaShape kFive{5, 64, 8, 24, 16, 32};   // rows of 72: 16-byte copies in every type
const MlaShape kWide{2, 300, 2, 16, 16, 0};   // two columns per lane, lanes past the latent
const MlaShape kWider{2, 1100, 4, 16, 16, 0};  // three column blocks; in fp32, chunks on an A100
const MlaShape kHuge{1, 2040, 8, 16, 16, 0};   // rows of 2048: chunks of the inner dimension on any device
const MlaShape kHugeOdd{2, 2000, 2, 16, 16, 0};  // rows of 2002: chunks, element-wise copies

// The MLA formats' rows (format.hpp): latent_dim codes, latent_dim / 128 fp32 scales, rope_dim bf16.
const MlaShape kBlock{3, 128, 6, 16, 12, 0};         // 144 bytes: 16-byte loads, the rotary key on 4 bytes
const MlaShape kBlockRope16{2, 128, 16, 16, 16, 0};  // 164 bytes: 4-byte loads
const MlaShape kTwoBlocks{5, 256, 16, 24, 16, 32};   // 296 bytes: 4-byte loads
const MlaShape kThreeBlocks{3, 384, 8, 16, 12, 0};   // 412 bytes: 4-byte loads, two columns per lane
const MlaShape kBlocksHuge{1, 2048, 8, 16, 16, 0};   // 2128 bytes: chunks, the last one the rotary key alone
const MlaShape kBlocksHugeOdd{2, 1920, 8, 16, 16, 0};  // 1996 bytes: chunks, 4-byte loads

using Case = checks::MlaCase;

/// Runs the CUDA kernel with policy P (its values from the case: checks::policy_values, copied to
/// the device) on a cache filled with random rows (with `decoder`, or a fresh one) and checks it
/// against the reference; returns the output (for comparisons between runs).
template <class T, class P = kvattn::Plain>
std::vector<float> check_kernel(const Case& c, unsigned seed = 1, cuda_tests::MlaDecoder* decoder = nullptr) {
  SCOPED_TRACE(describe(c));
  const checks::MlaInputs<T> f(c, seed);
  const policy_checks::Values values = checks::policy_values(c);
  const P policy = policy_checks::make<P>(values);
  std::vector<float> out, lse;
  if (decoder != nullptr)
    decoder->run(f.cache, f.seqs, c.shape, f.q, checks::mla_params(c), policy, out, &lse);
  else
    cuda_tests::run_cuda_mla_decode(f.cache, f.seqs, c.shape, f.q, checks::mla_params(c), out, lse, policy);
  checks::expect_mla_decode_matches(f.cache, f.seqs, c.shape, f.q, c.queries, out, lse, c.q_scale,
                                    [&](std::size_t b) { return policy_checks::options<P>(values, b); });
  return out;
}

/// Contexts around a page of P tokens and a tile, and long ones.
std::vector<std::int64_t> contexts(int P) {
  std::vector<std::int64_t> l;
  for (std::int64_t n : {0, 1, 2, P - 1, P, P + 1, 31, 32, 33, 300, 1000}) l.push_back(n);
  return l;
}

TEST(CudaMlaDecode, MatchesReferenceOverShapesPagesAndContexts) {
  KVATTN_REQUIRE_GPU();
  for (const MlaShape& s : {kOne, kOdd, kSix, kFive, kV2Lite})
    for (int page : {1, 7, 16, 64})
      for (int Q : {1, 3}) check_kernel<float>({s, page, contexts(page), Q});
}

TEST(CudaMlaDecode, StorageTypes) {
  KVATTN_REQUIRE_GPU();
  for (const MlaShape& s : {kOne, kOdd, kSix, kFive, kV2Lite}) {
    check_kernel<fp16>({s, 7, {0, 1, 33, 250}, 1});
    check_kernel<bf16>({s, 16, {0, 1, 33, 250}, 2});
    check_kernel<fp16>({s, 64, {65, 2, 0, 129}, 4, 1.0f, 40});
  }
}

TEST(CudaMlaDecode, DeepSeekV2HeadLayout) {
  KVATTN_REQUIRE_GPU();
  check_kernel<bf16>({kV2, 16, {1, 77, 513}, 1});
  check_kernel<bf16>({kV2, 7, {40, 0, 65}, 2});
  check_kernel<float>({kV2, 16, {1, 700}, 4});
  check_kernel<fp16>({kV2, 64, {3000}, 1});  // split across the device, merged
}

TEST(CudaMlaDecode, SplitIntoChunksAndMerged) {
  KVATTN_REQUIRE_GPU();
  for (std::int64_t chunk : {1, 5, 32, 64, 96})
    for (const MlaShape& s : {kOdd, kFive, kV2Lite}) check_kernel<float>({s, 7, {1000, 1, 0, 64}, 2, 1.0f, chunk});
}

TEST(CudaMlaDecode, QuantizedLatentFormats) {
  KVATTN_REQUIRE_GPU();
  using kvattn::fp8_e4m3_latent;
  using kvattn::int8_latent;
  for (const MlaShape& s : {kBlock, kBlockRope16, kTwoBlocks, kThreeBlocks})
    for (int page : {1, 7, 16}) {
      check_kernel<fp8_e4m3_latent>({s, page, {0, 1, 33, 250}, 1});
      check_kernel<int8_latent>({s, page, {0, 1, 33, 250}, 2});
    }
  for (const MlaShape& s : {kBlock, kTwoBlocks, kV2Lite}) {  // split into chunks and merged
    check_kernel<fp8_e4m3_latent>({s, 7, {1000, 1, 0, 64}, 2, 1.0f, 64});
    check_kernel<int8_latent>({s, 1, {300, 0, 1, 31}, 1, 1.0f, 32});
  }
  check_kernel<fp8_e4m3_latent>({kV2, 16, {1, 77, 513}, 1});
  check_kernel<int8_latent>({kV2, 7, {40, 0, 65}, 2});
  check_kernel<int8_latent>({kV2Lite, 64, {3000}, 1});  // split across the device, merged
  check_kernel<fp8_e4m3_latent>({kV2Lite, 1, {2, 0, 1, 3}, 4, 1.0f, 1});  // rows that see no key, chunks of one token
  for (const MlaShape& s : {kBlocksHuge, kBlocksHugeOdd}) {
    check_kernel<fp8_e4m3_latent>({s, 16, {0, 1, 33, 100, 257}, 1});
    check_kernel<int8_latent>({s, 7, {0, 1, 33, 100, 257}, 2, 1.0f, 40});
  }
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::int64_t> len(0, 300);
  std::vector<std::int64_t> lengths(23);
  for (auto& n : lengths) n = len(rng);
  check_kernel<int8_latent>({kTwoBlocks, 7, lengths, 2});
  check_kernel<fp8_e4m3_latent>({kBlockRope16, 1, lengths, 1, 1.0f, 50});
}

TEST(CudaMlaDecode, QuantizedLatentFormatsPagedEqualsContiguousBitForBit) {
  KVATTN_REQUIRE_GPU();
  const std::vector<std::int64_t> lengths{300, 1, 77};
  const auto contiguous = check_kernel<kvattn::int8_latent>({kTwoBlocks, 512, lengths, 2, 1.0f, 64}, 5);
  for (int page : {1, 7, 16}) {
    const auto paged = check_kernel<kvattn::int8_latent>({kTwoBlocks, page, lengths, 2, 1.0f, 64}, 5);
    EXPECT_EQ(paged, contiguous) << "page size " << page;
  }
}

TEST(CudaMlaDecode, WideLatentsColumnBlocksAndChunkedRows) {
  KVATTN_REQUIRE_GPU();
  for (const MlaShape& s : {kWide, kWider, kHuge, kHugeOdd})
    for (std::int64_t chunk : {0, 40}) {
      check_kernel<float>({s, 16, {0, 1, 33, 100, 257}, 1, 1.0f, chunk});
      check_kernel<bf16>({s, 7, {0, 1, 33, 100, 257}, 2, 1.0f, chunk});
    }
}

TEST(CudaMlaDecode, HugeLogitsNeitherOverflowNorNaN) {
  KVATTN_REQUIRE_GPU();
  for (const MlaShape& s : {kOdd, kV2Lite}) {
    const auto out = check_kernel<float>({s, 16, {1, 200, 33}, 2, 300.0f});
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
    const auto split = check_kernel<float>({s, 16, {1, 200, 33}, 2, 300.0f, 16});
    for (float x : split) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(CudaMlaDecode, RowsThatSeeNoKeyAreZeroWithLseMinusInfinity) {
  KVATTN_REQUIRE_GPU();
  // Q = 4 queries on sequences of 0, 1 and 2 tokens: the early queries have no position; with
  // chunks of one token, most items are empty for most rows and the merge skips them.
  for (std::int64_t chunk : {0, 1}) {
    check_kernel<float>({kOdd, 7, {0, 1, 2}, 4, 1.0f, chunk});
    check_kernel<bf16>({kV2Lite, 1, {2, 0, 1, 3}, 4, 1.0f, chunk});
  }
}

TEST(CudaMlaDecode, LargeBatchOfMixedLengths) {
  KVATTN_REQUIRE_GPU();
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::int64_t> len(0, 400);
  std::vector<std::int64_t> lengths(37);
  for (auto& n : lengths) n = len(rng);
  check_kernel<bf16>({kFive, 16, lengths, 2});
  check_kernel<float>({kV2Lite, 7, lengths, 1});
  check_kernel<fp16>({kOne, 1, lengths, 3, 1.0f, 50});
}

TEST(CudaMlaDecode, PagedEqualsContiguousBitForBit) {
  KVATTN_REQUIRE_GPU();
  const std::vector<std::int64_t> lengths{300, 1, 77};
  const auto contiguous = check_kernel<bf16>({kFive, 512, lengths, 2, 1.0f, 64}, 5);
  for (int page : {1, 7, 16}) {
    const auto paged = check_kernel<bf16>({kFive, page, lengths, 2, 1.0f, 64}, 5);
    EXPECT_EQ(paged, contiguous) << "page size " << page;
  }
}

TEST(CudaMlaDecode, WorkspaceIsReusedAcrossShapesAndBatches) {
  KVATTN_REQUIRE_GPU();
  cuda_tests::MlaDecoder decoder;
  const Case big{kV2Lite, 7, {1000, 1, 0, 64}, 2, 1.0f, 32};
  const auto first = check_kernel<float>(big, 3, &decoder);
  const std::size_t grown = decoder.plan_bytes();
  EXPECT_GT(grown, 0u);
  check_kernel<bf16>({kOne, 16, {5, 0}, 1}, 4, &decoder);
  check_kernel<fp16>({kOdd, 1, {0}, 3}, 4, &decoder);
  EXPECT_EQ(decoder.plan_bytes(), grown) << "the plan's memory only grows, and these calls fit";
  const auto again = check_kernel<float>(big, 3, &decoder);
  EXPECT_EQ(again, first);
  cuda_tests::MlaDecoder fresh;
  EXPECT_EQ(check_kernel<float>(big, 3, &fresh), first);
}

TEST(CudaMlaDecode, LseIsOptional) {
  KVATTN_REQUIRE_GPU();
  const Case c{kFive, 7, {0, 90, 3}, 2, 1.0f, 32};
  const checks::MlaInputs<float> f(c, 9);
  cuda_tests::MlaDecoder decoder;
  std::vector<float> with, without, lse;
  decoder.run(f.cache, f.seqs, c.shape, f.q, checks::mla_params(c), with, &lse);
  decoder.run(f.cache, f.seqs, c.shape, f.q, checks::mla_params(c), without, nullptr);
  EXPECT_EQ(with, without);
}

TEST(CudaMlaDecode, NullPointersAreRejected) {
  KVATTN_REQUIRE_GPU();
  const Case c{kOdd, 7, {3, 9}, 1};
  const checks::MlaInputs<float> f(c, 2);
  cuda_tests::MlaDecoder decoder;
  std::vector<float> out, lse;
  using Null = cuda_tests::MlaDecoder::Null;
  EXPECT_THROW(decoder.run(f.cache, f.seqs, c.shape, f.q, checks::mla_params(c), out, &lse, Null::q), kvattn::invalid_argument);
  EXPECT_THROW(decoder.run(f.cache, f.seqs, c.shape, f.q, checks::mla_params(c), out, &lse, Null::out), kvattn::invalid_argument);
  // The decoder is still usable.
  decoder.run(f.cache, f.seqs, c.shape, f.q, checks::mla_params(c), out, &lse);
  const policy_checks::Values values = checks::policy_values(c);
  checks::expect_mla_decode_matches(f.cache, f.seqs, c.shape, f.q, c.queries, out, lse, c.q_scale,
                                    [&](std::size_t b) { return policy_checks::options<kvattn::Plain>(values, b); });
}

// ---- score policies ----------------------------------------------------------------------------

TEST(CudaMlaDecodePolicies, SinksJoinTheDenominatorOnce) {
  KVATTN_REQUIRE_GPU();
  using kvattn::Sinks;
  check_kernel<float, Sinks>({kOdd, 7, {0, 1, 33, 250}, 1});                     // context 0: out 0, lse = sink
  check_kernel<float, Sinks>({kV2Lite, 16, {1000, 3}, 2, 1.0f, 64});             // 16 chunks, one sink
  check_kernel<float, Sinks>({kFive, 7, {300, 2, 0}, 3, 1.0f, 1});               // chunks of one token, rows that see nothing
  check_kernel<float, Sinks>({kV2, 16, {700, 5}, 1});                            // 128 heads: 8 row blocks, chunks chosen
}

TEST(CudaMlaDecodePolicies, Alibi) {
  KVATTN_REQUIRE_GPU();
  using kvattn::Alibi;
  check_kernel<float, Alibi>({kFive, 7, {90, 1, 0}, 2});  // 5 heads: slopes of 4 and of 8
  check_kernel<float, Alibi>({kV2Lite, 16, {600, 33}, 1, 1.0f, 96});
}

TEST(CudaMlaDecodePolicies, TreeMasksOverTheNewTokens) {
  KVATTN_REQUIRE_GPU();
  using kvattn::TreeMask;
  check_kernel<float, TreeMask>({kOdd, 16, {100, 40, 16}, 16});           // Q = 16: 48 rows, 3 row blocks
  check_kernel<float, TreeMask>({kFive, 7, {50, 5, 3}, 5});               // sequences shorter than Q
  check_kernel<float, TreeMask>({kOne, 1, {300, 20}, 12, 1.0f, 5});       // the tree across chunks of 5
}

TEST(CudaMlaDecodePolicies, WindowAndSoftCap) {
  KVATTN_REQUIRE_GPU();
  using WindowCap = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap>;
  check_kernel<float, WindowCap>({kFive, 16, {200, 5, 0}, 2, 4.0f, 0, 40, 20.0f});
  check_kernel<float, WindowCap>({kOdd, 7, {0, 1, 60}, 3, 1.0f, 0, 1, 5.0f});      // window 1: the row's own token
  check_kernel<float, WindowCap>({kV2Lite, 16, {1500, 3}, 2, 1.0f, 64, 150, 30.0f});  // chunks outside the window
}

TEST(CudaMlaDecodePolicies, GptOssWindowSoftCapAndSinks) {
  KVATTN_REQUIRE_GPU();
  using Gpt = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;
  check_kernel<float, Gpt>({kFive, 16, {200, 5, 0}, 1, 4.0f, 0, 40, 20.0f});
  check_kernel<float, Gpt>({kV2Lite, 16, {1500, 3}, 2, 1.0f, 100, 150, 30.0f});  // split, chunks outside the window
  check_kernel<bf16, Gpt>({kV2Lite, 7, {800, 1, 0}, 2, 1.0f, 32, 300, 30.0f});
  check_kernel<kvattn::fp8_e4m3_latent, Gpt>({kBlockRope16, 16, {200, 5, 0}, 1, 4.0f, 0, 40, 20.0f});
  check_kernel<kvattn::fp8_e4m3_latent, Gpt>({kV2, 7, {700, 2, 0}, 2, 1.0f, 64, 150, 30.0f});  // split, chunks outside the window
}

// ---- argument checks (no GPU needed) -----------------------------------------------------------

// No KVATTN_REQUIRE_GPU: every check throws before the device is touched.
TEST(CudaMlaDecodeArguments, BadInputIsRejectedBeforeAnyDeviceWork) {
  const kvattn::GqaShape gqa = kvattn::GqaShape::gqa(4, 2, 8);
  kvattn::DecodeParams p;
  using cuda_tests::mla_decode_without_device;

  EXPECT_NO_THROW(mla_decode_without_device(kOdd, 0, kOdd, p, false));  // an empty batch: nothing to do
  EXPECT_THROW(mla_decode_without_device(gqa, 0, kOdd, p, false), kvattn::shape_error);
  MlaShape other = kOdd;
  other.latent_dim = 41;
  try {
    mla_decode_without_device(kOdd, 0, other, p, false);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("latent_dim=41"), std::string::npos) << e.what();
  }
  other = kOdd;
  other.rope_dim = 8;
  EXPECT_THROW(mla_decode_without_device(kOdd, 0, other, p, false), kvattn::shape_error);
  other = kOdd;
  other.heads = 0;
  EXPECT_THROW(mla_decode_without_device(kOdd, 0, other, p, false), kvattn::shape_error);

  p.queries_per_seq = 0;
  try {
    mla_decode_without_device(kOdd, 0, kOdd, p, false);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("queries_per_seq=0"), std::string::npos) << e.what();
  }
  p.queries_per_seq = 1;
  p.chunk_tokens = -1;
  EXPECT_THROW(mla_decode_without_device(kOdd, 0, kOdd, p, false), kvattn::invalid_argument);
  p.chunk_tokens = 0;
  for (float bad : {-1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    p.scale = bad;
    EXPECT_THROW(mla_decode_without_device(kOdd, 0, kOdd, p, false), kvattn::invalid_argument) << bad;
  }
  p.scale = 0.0f;
  p.queries_per_seq = 65535 * 16 / kV2.heads + 1;  // more row blocks than a grid holds
  try {
    mla_decode_without_device(kV2, 0, kV2, p, false);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("query rows per sequence"), std::string::npos) << e.what();
  }
  p.queries_per_seq = 1;
  try {  // a view that does not read the plan's page table
    mla_decode_without_device(kOdd, 2, kOdd, p, false);
    ADD_FAILURE() << "no error";
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("batch=2"), std::string::npos) << e.what();
  }
}

TEST(CudaMlaDecodeArguments, QuantizedLatentFormatsAreCheckedBeforeAnyDeviceWork) {
  using cuda_tests::mla_decode_without_device;
  kvattn::DecodeParams p;
  EXPECT_NO_THROW(mla_decode_without_device<kvattn::fp8_e4m3_latent>(kBlockRope16, 0, kBlockRope16, p, false));
  EXPECT_NO_THROW(mla_decode_without_device<kvattn::int8_latent>(kV2, 0, kV2, p, false));
  MlaShape other = kBlockRope16;
  other.rope_dim = 8;
  EXPECT_THROW(mla_decode_without_device<kvattn::int8_latent>(kBlockRope16, 0, other, p, false), kvattn::shape_error);
  EXPECT_THROW(mla_decode_without_device<kvattn::int8_latent>(kV2, 2, kV2, p, false), kvattn::invalid_argument);
  p.chunk_tokens = -1;
  EXPECT_THROW(mla_decode_without_device<kvattn::fp8_e4m3_latent>(kV2, 0, kV2, p, false), kvattn::invalid_argument);
}

TEST(CudaMlaDecodeArguments, QuantizedLatentFormatsStageTilesInFp32) {
  // Their codes are dequantized into fp32 tiles: a block takes the shared memory of an fp32
  // cache's, in one chunk or in the same chunks (a bf16 cache's, with 2-byte tiles, less).
  for (const MlaShape& s : {kV2, kBlockRope16, kBlocksHuge})
    for (int optin : {166912, 232448}) {  // an A100's and an H100's bytes per block
      SCOPED_TRACE(testing::Message() << "latent=" << s.latent_dim << " optin=" << optin);
      const std::size_t fp32 = cuda_tests::mla_block_shared_bytes<float>(s, optin);
      EXPECT_EQ(cuda_tests::mla_block_shared_bytes<kvattn::fp8_e4m3_latent>(s, optin), fp32);
      EXPECT_EQ(cuda_tests::mla_block_shared_bytes<kvattn::int8_latent>(s, optin), fp32);
      if (s.latent_dim <= 512) {
        EXPECT_LT(cuda_tests::mla_block_shared_bytes<bf16>(s, optin), fp32);
      }
    }
}

}  // namespace
