// CPU emulation of the format kernels: the very same quant_math.cuh primitives, run on host memory, so a
// machine without a GPU can prove the bit manipulation against the torch reference (tests/test_formats_host.py).
// Loops follow the kernels' semantics (row amax, SR element index, transposition, accumulation order).
//
// Floating point: this file is compiled with -ffp-contract=off (setup.py; GCC's default in C++, also with
// -std=c++17, is to contract a*b+c into an FMA wherever the target has one, e.g. aarch64 hosts) for baseline x86-64
// (no FMA instructions); the primitives keep every operation a separate rounding. host_exhaustive_check
// "no_contraction" checks it.
#include <cmath>
#include <initializer_list>
#include <vector>

#include "formats.h"
#include "quant_math.cuh"

#if defined(__FAST_MATH__)
#error "formats_host.cpp must not be built with -ffast-math: the emulation must round like docs/NUMERICS.md"
#endif

namespace ep_comm {
namespace host {

namespace qm = ::ep_comm::qm;

void nvfp4_quantize(const float* x, int64_t num_rows, int64_t hidden, const float* amax_in, float e4m3_max,
                    bool four_over_six, uint8_t* data, uint8_t* scales, float* amax_out) {
  const int64_t num_blocks = hidden / 16;
  for (int64_t row = 0; row < num_rows; ++row) {
    const float* x_row = x + row * hidden;
    float amax = 0.0f;
    if (amax_in != nullptr) {
      amax = amax_in[row];
    } else {
      for (int64_t i = 0; i < hidden; ++i) amax = qm::qm_max(amax, qm::qm_abs(x_row[i]));
    }
    if (amax_out != nullptr) amax_out[row] = amax;
    const qm::Nvfp4Outer outer = qm::nvfp4_outer_scales(amax, e4m3_max);
    for (int64_t b = 0; b < num_blocks; ++b) {
      qm::nvfp4_quantize_block16_outer(x_row + b * 16, outer, amax, e4m3_max, four_over_six,
                                       data + row * (hidden / 2) + b * 8, scales + row * num_blocks + b);
    }
  }
}

void nvfp4_dequantize(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t num_rows,
                      int64_t hidden, float e4m3_max, float* out) {
  const int64_t num_blocks = hidden / 16;
  for (int64_t row = 0; row < num_rows; ++row) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float final_scale = qm::nvfp4_dequant_scale(scales[row * num_blocks + b], amax[row], e4m3_max);
      const uint8_t* codes = data + row * (hidden / 2) + b * 8;
      uint32_t words[2] = {0u, 0u};
      for (int k = 0; k < 8; ++k) words[k / 4] |= static_cast<uint32_t>(codes[k]) << (8 * (k % 4));
      qm::nvfp4_block_decode(words[0], words[1], final_scale, out + row * hidden + b * 16);  // the kernels' decode
    }
  }
}

// One MX block: x[32] -> 32 codes + scale; SR index of element j is index0 + j.
void nvfp4_four_over_six_errors(const float* x, int64_t num_rows, int64_t hidden, const float* amax, float e4m3_max,
                                float* err6, float* err4) {
  const int64_t num_blocks = hidden / 16;
  const float six_m = qm::qm_mul(6.0f, e4m3_max);
  for (int64_t row = 0; row < num_rows; ++row) {
    const qm::Nvfp4Outer outer = qm::nvfp4_outer_scales(amax[row], e4m3_max);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* block = x + row * hidden + b * 16;
      const float base = qm::qm_mul(qm::qm_div(qm::block_amax16(block), 6.0f), outer.s_enc);
      const uint8_t s6 = qm::e4m3_encode(qm::qm_min(base, 448.0f));
      const uint8_t s4 = qm::e4m3_encode(qm::qm_min(qm::qm_mul(1.5f, base), 448.0f));
      uint32_t nibbles[2];
      err6[row * num_blocks + b] = qm::nvfp4_candidate(block, s6, outer.s_dec, amax[row], six_m, nibbles);
      err4[row * num_blocks + b] = qm::nvfp4_candidate(block, s4, outer.s_dec, amax[row], six_m, nibbles);
    }
  }
}

void nvfp4_fast_decided(const float* x, int64_t num_rows, int64_t hidden, const float* amax, float e4m3_max,
                        bool four_over_six, uint8_t* decided) {
  const int64_t num_blocks = hidden / 16;
  for (int64_t row = 0; row < num_rows; ++row) {
    const qm::Nvfp4Outer outer = qm::nvfp4_outer_scales(amax[row], e4m3_max);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* block = x + row * hidden + b * 16;
      uint8_t decision;
      if (four_over_six) {  // the fast 4/6 path alone: what nvfp4_quantize_block16_words runs before the formula
        const qm::Nvfp4BlockFast fast =
            qm::nvfp4_four_six_block16_fast(block, qm::block_amax16(block), outer, amax[row], nullptr);
        decision = fast.exact_tie ? 2 : (fast.decided ? 1 : 0);
      } else {
        uint32_t words[2];
        uint8_t scale;
        bool fast = false;
        qm::nvfp4_quantize_block16_words(block, qm::block_amax16(block), outer, amax[row], e4m3_max, false, words,
                                         &scale, &fast);
        decision = fast ? 1 : 0;
      }
      decided[row * num_blocks + b] = decision;
    }
  }
}

// One MX block through the kernels' own block encoders (quant_math.cuh); element j of a stochastic block draws
// rbits(key, index0 + j), index0 % 32 == 0.
static void mxfp8_block(const float* x, bool stochastic, uint32_t key, int64_t index0, uint8_t* codes,
                        uint8_t* scale_out) {
  uint32_t words[8];
  *scale_out = stochastic ? qm::mxfp8_encode32_stochastic(x, key, index0, words) : qm::mxfp8_encode32_nearest(x, words);
  for (int j = 0; j < 32; ++j) codes[j] = static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4)));
}

void mxfp8_quantize(const float* x, int64_t num_rows, int64_t hidden, bool stochastic, uint64_t seed,
                    uint8_t* data, uint8_t* scales) {
  const uint32_t key = qm::sr_key(seed);
  const int64_t total_blocks = num_rows * (hidden / 32);
  for (int64_t block = 0; block < total_blocks; ++block) {
    mxfp8_block(x + block * 32, stochastic, key, block * 32, data + block * 32, scales + block);
  }
}

void mxfp8_dequantize(const uint8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden, float* out) {
  const int64_t total_blocks = num_rows * (hidden / 32);
  for (int64_t block = 0; block < total_blocks; ++block) {
    const float multiplier = qm::ue8m0_to_float(scales[block]);
    for (int j = 0; j < 32; ++j) out[block * 32 + j] = qm::qm_mul(qm::e4m3_decode(data[block * 32 + j]), multiplier);
  }
}

void nvfp4_to_mxfp8_transposed(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t num_rows,
                               int64_t hidden, float e4m3_max, bool stochastic, uint64_t seed, uint8_t* out_data,
                               uint8_t* out_scales) {
  std::vector<float> dense(static_cast<size_t>(num_rows * hidden));
  nvfp4_dequantize(data, scales, amax, num_rows, hidden, e4m3_max, dense.data());
  const uint32_t key = qm::sr_key(seed);
  float column[32];
  for (int64_t k = 0; k < hidden; ++k) {
    for (int64_t rb = 0; rb < num_rows; rb += 32) {
      for (int j = 0; j < 32; ++j) column[j] = dense[static_cast<size_t>((rb + j) * hidden + k)];
      mxfp8_block(column, stochastic, key, k * num_rows + rb, out_data + k * num_rows + rb,
                  out_scales + k * (num_rows / 32) + rb / 32);
    }
  }
}

void rht(const float* x, int64_t num_rows, int64_t hidden, uint32_t sign_mask, bool inverse, float* out) {
  float chunk[32];
  for (int64_t c = 0; c < num_rows * hidden / 32; ++c) {
    for (int j = 0; j < 32; ++j) chunk[j] = x[c * 32 + j];
    if (inverse) {
      qm::rht32_inverse(chunk, sign_mask);
    } else {
      qm::rht32_forward(chunk, sign_mask);
    }
    for (int j = 0; j < 32; ++j) out[c * 32 + j] = chunk[j];
  }
}

void s2f6_quantize(const float* x, int64_t num_rows, int64_t hidden, bool hadamard, uint32_t sign_mask,
                   int8_t* data, uint8_t* scales) {
  float chunk[32];
  for (int64_t c = 0; c < num_rows * hidden / 32; ++c) {
    for (int j = 0; j < 32; ++j) chunk[j] = x[c * 32 + j];
    if (hadamard) qm::rht32_forward(chunk, sign_mask);
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = qm::qm_max(amax, qm::qm_abs(chunk[j]));
    const uint8_t scale = qm::ue8m0_s2f6_scale(amax);
    for (int j = 0; j < 32; ++j) data[c * 32 + j] = qm::s2f6_encode(chunk[j], scale);
    scales[c] = scale;
  }
}

void s2f6_dequantize(const int8_t* data, const uint8_t* scales, int64_t num_rows, int64_t hidden, bool hadamard,
                     uint32_t sign_mask, float* out) {
  float chunk[32];
  for (int64_t c = 0; c < num_rows * hidden / 32; ++c) {
    for (int j = 0; j < 32; ++j) chunk[j] = qm::s2f6_decode(data[c * 32 + j], scales[c]);
    if (hadamard) qm::rht32_inverse(chunk, sign_mask);
    for (int j = 0; j < 32; ++j) out[c * 32 + j] = chunk[j];
  }
}

void s2f6_dequantize_accumulate(const int8_t* data, const uint8_t* scales, int64_t num_src_rows, int64_t hidden,
                                const int64_t* row_index, const float* weights, int64_t num_out_rows,
                                int64_t num_terms, bool hadamard, uint32_t sign_mask, float* out) {
  const int64_t chunks = hidden / 32;
  float acc[32];
  for (int64_t m = 0; m < num_out_rows; ++m) {
    for (int64_t c = 0; c < chunks; ++c) {
      for (int j = 0; j < 32; ++j) acc[j] = 0.0f;
      for (int64_t t = 0; t < num_terms; ++t) {
        const int64_t src = row_index[m * num_terms + t];
        if (src < 0 || src >= num_src_rows) continue;
        const float w = weights != nullptr ? weights[m * num_terms + t] : 1.0f;
        const uint8_t scale = scales[src * chunks + c];
        for (int j = 0; j < 32; ++j) {
          const float v = qm::s2f6_decode(data[src * hidden + c * 32 + j], scale);
          acc[j] = qm::qm_add(acc[j], qm::qm_mul(w, v));
        }
      }
      if (hadamard) qm::rht32_inverse(acc, sign_mask);
      for (int j = 0; j < 32; ++j) out[m * hidden + c * 32 + j] = acc[j];
    }
  }
}

int64_t exhaustive_check(ExhaustiveCheck check, uint32_t stride) {
  if (stride == 0) stride = 1;
  int64_t mismatches = 0;
  if (check == ExhaustiveCheck::kE2m1Magnitude) {
    for (uint64_t bits = 0; bits <= 0x7FFFFFFFu; bits += stride) {
      const float a = qm::bits_float(static_cast<uint32_t>(bits));
      float rounded;
      const uint32_t code = qm::e2m1_round_magnitude(a, &rounded);
      const uint8_t expected = qm::e2m1_encode_soft(a);
      if (code != expected || qm::float_bits(rounded) != qm::float_bits(qm::e2m1_decode(expected))) ++mismatches;
      // The fast paths' unclamped rounding in the domain scaled by 2^-6 (a_s = f(a * 2^-6): exactly 2^-6 * a when
      // that is representable, else the tiny values that must round to 0), for every a < 7 ...
      if (a < 7.0f) {
        const float rounded_s = qm::e2m1_round_scaled(qm::qm_mul(a, qm::kE2m1DomainScale));
        if (qm::float_bits(rounded_s) != qm::float_bits(qm::qm_mul(rounded, qm::kE2m1DomainScale))) ++mismatches;
      }
      // ... and its packing: this code in nibble bits % 8 of a word, the other nibbles' codes and every sign drawn
      // from the bits (so each position sees each code next to varied neighbours, and zeros of either sign).
      float r_s[8];
      float x[8];
      uint32_t expected_word = 0;
      for (int k = 0; k < 8; ++k) {
        const bool mine = k == static_cast<int>(bits % 8);
        const uint32_t code_k = mine ? expected : static_cast<uint32_t>((bits >> (2 * k + 3)) & 7u);
        const float value = mine ? rounded : qm::e2m1_decode(static_cast<uint8_t>(code_k));
        const bool negative = ((bits >> (k + 9)) & 1u) != 0;
        r_s[k] = qm::qm_mul(value, qm::kE2m1DomainScale);
        x[k] = negative ? -value : value;  // only x's sign is packed
        expected_word |= (code_k | (negative ? 8u : 0u)) << (4 * k);
      }
      if (!qm::qm_isnan(a) && qm::e2m1_pack8_scaled(r_s, qm::sign_bytes4(x), qm::sign_bytes4(x + 4)) != expected_word) {
        ++mismatches;
      }
      // The one-permute sign bytes of bf16 pairs (the kernels' form) against the fp32 form: x[k] rounded to bf16 by
      // truncation keeps its sign bit.
      uint32_t pairs[4];
      for (int k = 0; k < 4; ++k) pairs[k] = (qm::float_bits(x[2 * k]) >> 16) | (qm::float_bits(x[2 * k + 1]) & 0xFFFF0000u);
      if (qm::sign_bytes4_16bit(pairs[0], pairs[1]) != qm::sign_bytes4(x) ||
          qm::sign_bytes4_16bit(pairs[2], pairs[3]) != qm::sign_bytes4(x + 4)) {
        ++mismatches;
      }
    }
    return mismatches;
  }
  if (check == ExhaustiveCheck::kSrE4m3) {
    // Scale bytes for sr_e4m3_fast: p = 1, the fast form's limits (0: q = 2^7; 156: q = 2^-149), and between.
    const uint8_t fast_scales[8] = {127, 0, 156, 120, 134, 100, 150, 60};
    for (uint64_t bits = 0; bits <= 0x7FFFFFFFu; bits += stride) {
      const float v = qm::bits_float(static_cast<uint32_t>(bits));
      const uint32_t hash = qm::fmix32(static_cast<uint32_t>(bits));
      const uint32_t words[4] = {0u, 0xFFFFu, 0x8000u, hash};
      const uint8_t b = fast_scales[bits % 8];
      const float p = qm::ue8m0_inverse(b);
      for (uint32_t r : words) {
        for (float x : {v, -v}) {
          const uint32_t slow = qm::float_bits(qm::sr_e4m3_definition(x, r));
          if (qm::float_bits(qm::sr_e4m3(x, r)) != slow && !qm::qm_isnan(x)) ++mismatches;
          // The fast form on x itself (p = 1, every |x| <= 448) and on x as an input scaled by another p, where
          // a one-element block passes sr_fast_block_ok.
          if (qm::sr_fast_block_ok(qm::qm_abs(x), 127, 1.0f) &&
              qm::float_bits(qm::sr_e4m3_fast(x, qm::sr_fast_multiplier(127), r & 0xFFFFu)) != slow) {
            ++mismatches;
          }
          if (qm::sr_fast_block_ok(qm::qm_abs(x), b, p) &&
              qm::float_bits(qm::sr_e4m3_fast(x, qm::sr_fast_multiplier(b), r & 0xFFFFu)) !=
                  qm::float_bits(qm::sr_e4m3_definition(qm::qm_mul(x, p), r))) {
            ++mismatches;
          }
        }
      }
      // The per-block form of rbits (rbits_block / rbits_block_word) against rbits itself: block bases
      // bits * 32 with high words 0, the sampled bits, and all ones (the pair's high word changes too).
      const uint32_t key = qm::fmix32(static_cast<uint32_t>(bits) ^ 0x2545F491u);
      for (uint64_t hi : {uint64_t{0}, bits, uint64_t{0xFFFFFFFFu}}) {
        const uint64_t base = (hi << 32) | ((bits * 32u) & 0xFFFFFFFFu);
        const qm::RbitsBlock block = qm::rbits_block(key, base);
        for (uint32_t j = 0; j < 32; ++j) {
          const uint32_t r16 = (qm::rbits_block_word(block, j / 2) >> (16 * (j % 2))) & 0xFFFFu;
          if (r16 != qm::rbits(key, base + j)) ++mismatches;
        }
      }
    }
    return mismatches;
  }
  if (check == ExhaustiveCheck::kS2f6Fast) {
    // The kernels' S2F6 packing per value (plain and RHT-folded) against s2f6_encode, for every fp32 bit pattern
    // (both signs) under scale bytes the value may meet in a block: its own smallest scale (where the clamps are
    // tight), the next, the form boundaries (5/6, 8/9, 253/254) and a few between, whenever admissible.
    const uint8_t scales[12] = {0, 1, 5, 6, 8, 9, 60, 127, 134, 200, 253, 254};
    const float c = qm::bits_float(qm::kRhtScaleBits);
    auto check_value = [&](uint32_t bits, bool plain) {
      const float v = qm::bits_float(bits);
      const float vc = qm::qm_mul(v, c);
      const uint8_t own = qm::ue8m0_s2f6_scale(qm::qm_abs(v));
      const uint8_t own_rht = qm::ue8m0_s2f6_scale(qm::qm_abs(vc));
      const uint8_t tried[4] = {own, static_cast<uint8_t>(own < 0xFE ? own + 1 : own), scales[bits % 12], own_rht};
      for (const uint8_t b : tried) {
        // Admissible: the value could be in a block with scale b (NaN values are in any block).
        if (plain && (qm::qm_isnan(v) || own <= b) &&
            static_cast<uint8_t>(qm::s2f6_code_bits_fast(v, b)) != static_cast<uint8_t>(qm::s2f6_encode(v, b))) {
          ++mismatches;
        }
        if ((qm::qm_isnan(v) || own_rht <= b) &&
            static_cast<uint8_t>(qm::s2f6_rht_code_bits_fast(v, b)) != static_cast<uint8_t>(qm::s2f6_encode(vc, b))) {
          ++mismatches;
        }
      }
    };
    // Zeros, infinities, NaNs, the largest finite, the smallest subnormal and normal, both signs: always checked.
    for (const uint32_t bits : {0x00000000u, 0x7F800000u, 0x7FC00000u, 0x7F7FFFFFu, 0x00000001u, 0x00800000u}) {
      check_value(bits, true);
      check_value(bits | 0x80000000u, true);
    }
    // The RHT form for every |v| < 2^-123 (f(v * c) subnormal, c ~ 2^-2.5), whatever the stride: the case of the
    // fold's proof where the two-multiply and one-multiply forms could split (75M patterns, ~40 s; a mutant
    // that folds from scale 3 instead of 9 is caught here, not by the stride sample).
    if (stride > 1) {
      for (uint32_t bits = 0; bits < 0x02400000u; ++bits) {
        check_value(bits, false);
        check_value(bits | 0x80000000u, false);
      }
    }
    for (uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += stride) check_value(static_cast<uint32_t>(bits), true);
    return mismatches;
  }
  if (check == ExhaustiveCheck::kDivSix) {
    // The fast path's division-free block scale pair: the quotient itself for every a in [0, +Inf], and the scale
    // pair under approx_ok outer scales -- S_enc at its largest for both M (amax = 2^-80: the only S_enc where a
    // subnormal quotient's error could reach the E4M3 grid) and a typical one.
    const qm::Nvfp4Outer outers[3] = {qm::nvfp4_outer_scales(0x1p-80f, 448.0f), qm::nvfp4_outer_scales(0x1p-80f, 256.0f),
                                      qm::nvfp4_outer_scales(1.0f, 448.0f)};
    for (const qm::Nvfp4Outer& outer : outers) {
      if (!outer.approx_ok) ++mismatches;
    }
    for (uint64_t bits = 0; bits <= 0x7F800000u; bits += stride) {
      const float a = qm::bits_float(static_cast<uint32_t>(bits));
      const float q = qm::div_six_markstein(a);
      const float exact = qm::qm_div(a, 6.0f);
      if (a <= qm::kFltMax) {
        if (exact >= 0x1p-126f ? qm::float_bits(q) != qm::float_bits(exact) : !(q < 0x1p-125f && exact < 0x1p-125f)) {
          ++mismatches;
        }
      }
      for (const qm::Nvfp4Outer& outer : outers) {
        if (qm::nvfp4_four_six_scale_pair_fast(a, outer) != qm::nvfp4_four_six_scale_pair(a, outer)) ++mismatches;
      }
    }
    // Every a whose quotient is subnormal (a < 6 * 2^-126, bits below 0x01400000: where the two divisions differ),
    // whatever the stride.
    if (stride > 1) {
      for (uint32_t bits = 0; bits < 0x01400000u; ++bits) {
        const float a = qm::bits_float(bits);
        const float q = qm::div_six_markstein(a);
        const float exact = qm::qm_div(a, 6.0f);
        if (exact >= 0x1p-126f ? qm::float_bits(q) != qm::float_bits(exact) : !(q < 0x1p-125f && exact < 0x1p-125f)) {
          ++mismatches;
        }
        for (const qm::Nvfp4Outer& outer : outers) {
          if (qm::nvfp4_four_six_scale_pair_fast(a, outer) != qm::nvfp4_four_six_scale_pair(a, outer)) ++mismatches;
        }
      }
    }
    // +Inf itself (the stride may skip it).
    for (const qm::Nvfp4Outer& outer : outers) {
      const float inf = qm::bits_float(0x7F800000u);
      if (qm::nvfp4_four_six_scale_pair_fast(inf, outer) != qm::nvfp4_four_six_scale_pair(inf, outer)) ++mismatches;
    }
    return mismatches;
  }
  if (check == ExhaustiveCheck::kNoContraction) {
    // f(a * a) - f(a * a) is 0 for every a when each operation rounds on its own; a compiler that contracts it into
    // fma(a, a, -f(a * a)) gets the product's rounding error instead, nonzero for most a in [1, 2). GCC contracts by
    // default in C++ (also with -std=c++17) wherever the target has FMA instructions (aarch64, x86-64 with -mfma or
    // -march=native): setup.py passes -ffp-contract=off, and this probe fails if a build lost that flag on such a host
    // (checked with g++ 12 -mfma: ~1/3 of the patterns differ without the flag, none with it). The subtrahend's
    // product reads `a` through a volatile so that the compiler cannot merge the two products into one (a product
    // with two uses is not contracted).
    for (uint64_t bits = 0x3F800000u; bits < 0x40000000u; bits += stride) {
      const float a = qm::bits_float(static_cast<uint32_t>(bits));
      volatile float a_again = a;
      const float product = qm::qm_mul(a_again, a);
      if (qm::float_bits(qm::qm_sub(qm::qm_mul(a, a), product)) != 0u) ++mismatches;
    }
    return mismatches;
  }
  if (check == ExhaustiveCheck::kOuterScales) {
    for (const float e4m3_max : {256.0f, 448.0f}) {
      const float six_m = qm::qm_mul(6.0f, e4m3_max);
      for (uint64_t bits = 0x17800000u; bits <= 0x71800000u; bits += stride) {  // 2^-80 .. 2^100
        const float amax = qm::bits_float(static_cast<uint32_t>(bits));
        const qm::Nvfp4Outer outer = qm::nvfp4_outer_scales(amax, e4m3_max);
        const float s_enc = qm::qm_div(six_m, amax);
        if (!outer.approx_ok || qm::float_bits(outer.s_enc) != qm::float_bits(s_enc) ||
            qm::float_bits(outer.s_dec) != qm::float_bits(qm::qm_div(1.0f, s_enc))) {
          ++mismatches;
        }
      }
    }
    return mismatches;
  }
  const float six_m = check == ExhaustiveCheck::kMarkstein1536 ? 1536.0f : 2688.0f;
  const float inv_six_m = qm::qm_div(1.0f, six_m);
  for (uint64_t bits = 0x0D800000u; bits <= 0x7F7FFFFFu; bits += stride) {  // 2^-100 .. FLT_MAX
    const float n = qm::bits_float(static_cast<uint32_t>(bits));
    if (qm::float_bits(qm::div_six_m_markstein(n, six_m, inv_six_m)) != qm::float_bits(qm::qm_div(n, six_m))) {
      ++mismatches;
    }
  }
  return mismatches;
}

void e2m1_encode(const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qm::e2m1_encode(x[i]);
}
void e4m3_encode(const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qm::e4m3_encode(x[i]);
}
void ue8m0_mxfp8_scale(const float* amax, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qm::ue8m0_mxfp8_scale(amax[i]);
}
void ue8m0_s2f6_scale(const float* amax, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qm::ue8m0_s2f6_scale(amax[i]);
}
void rbits(uint64_t seed, const int64_t* index, int64_t n, uint32_t* out) {
  const uint32_t key = qm::sr_key(seed);
  for (int64_t i = 0; i < n; ++i) out[i] = qm::rbits(key, static_cast<uint64_t>(index[i]));
}
void sr_e4m3(const float* x, const uint32_t* random_bits, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qm::e4m3_encode(qm::sr_e4m3(x[i], random_bits[i]));
}
void bf16_round(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = qm::bf16_bits_rn(x[i]);
}

}  // namespace host
}  // namespace ep_comm
