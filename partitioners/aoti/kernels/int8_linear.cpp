// Products of a few fp32 rows by a weight of 4- or 8-bit codes in blocks
// (passes/packed_weights.py: weight rows in panels of 8, each panel's codes
// block by block, 4 codes of each of its 8 rows a vector; a float scale and
// offset per group, fp32 or fp16) with int8 activations (--qact int8), for
// AOTInductor packages on x86 CPUs (build.py builds it; compiled methods call
// it through its shim in shims.cpp):
//
//   out[m, n] = sum_k xq[m, k] * (scale[n, g(k)] * code[n, k] + offset[n, g(k)])
//
// where xq is x rounded per row in blocks of 32 to int8 codes q times a step
// (step = the block's largest magnitude / 127, q = round(x / step)): exactly
// passes/packed_weights.py's int8_rows, so a package's eager reference
// computes the same codes. With two terms (--qact int8x2, int8x2_rows), xq
// is that plus the rounding error x - xq rounded the same way: each row
// becomes two rows of int8 codes, multiplied as any others in the same pass
// (about 15 bits of each activation for twice the integer products; the
// weight is still read once). With int16 codes (--qact int16, int16_rows:
// step = largest magnitude / 32767), the products are madd's (or VNNI's
// vpdpwssd's) int16 pairs; panel_rows_wide below says how. Each block's
// product is an integer dot product, 32 code pairs summed exactly in int32
// (maddubs then madd on AVX2; 4-bit codes: int16 sums over the block, then
// one madd), then scaled by the block's step and the group's scale (two
// terms: each by its step, summed, then scaled once); the offsets multiply
// each row's sum of xq over a group (both terms), computed once a call.
// Summing the two terms a block, not at the end, and their offsets as one
// took 8 rows of 4-bit codes from 136-140 to 125-129 us in cache (a 4096 x
// 576 weight, a scratch A/B on Zen 4).
//
// 4-bit codes are unpacked in registers (a mask, and a shift and a mask, of
// 32 bytes give two quads of the panel's 8 rows). A thread walks its own band
// of panels.
//
// Weight rows go across the lanes: one dot product takes a vector of a
// panel's codes (4 of each of its 8 rows) against 4 codes of a row
// broadcast, and 8 of them finish a block for the panel's 8 weight rows at
// once, so a block ends in one convert, one scale (8 scales, one load) and
// one FMA for 8 weight rows, and the results are 8 outputs side by side. A
// pass takes up to MR_MAX rows (8 sessions: one pass); over more (prefill
// slices: passes of even size) a thread's panels go by in chunks that stay
// in L2 while every pass of rows reads them. (Before this layout, a vector
// held one weight row's codes along K, and every block took a convert, a
// scale and an FMA per weight row: the arithmetic took twice as long in
// cache at one row, bench/packed_kernel.py.) The VNNI build on AVX-512 puts
// two panels in one 512-bit vector over 2 rows or more (the pair tiling),
// int16 codes too, and one row's int16 codes by 8-bit ones in 512-bit
// vectors one panel at a time (WideRow).
//
// This file compiles twice (build.py). Built plain, the products are
// maddubs then madd (AVX2): 8-bit codes, unsigned, are flipped to code - 128
// (signed), whose magnitude and sign feed maddubs (255 * 127 twice would
// saturate its int16 sums), and 128 * scale joins the group's offset. Built
// with KV_VNNI, they are one vpdpbusd (unsigned by signed bytes, four
// products summed straight into int32: nothing saturates, 8-bit codes stay
// as they are). kvexport_int8_linear, in the plain build, calls the VNNI
// build where the CPU has it. Both sum the same integers exactly.

#include <omp.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

using namespace kv;

namespace {

constexpr int BLOCK = 32;
constexpr int QUADS = BLOCK / 4;  // a block's quads: 4 codes each
constexpr int PANEL = 8;  // weight rows a panel of the format holds
constexpr int MR_MAX = REGISTERS == 32 ? 8 : 4;  // rows a pass over the weight takes at most
// how many panels ahead (8 weight rows each) codes are fetched into L2. Over
// one pass of rows (a decode step), 4: every linear of a SmolLM2 step from
// memory ran 2-8% faster than at 8 (1 and 8 rows, one and two terms;
// 1B-shaped weights 3%; a 131072 x 576 weight alike), and 16 ran 14% slower
// (scratch A/Bs on Zen 4, the VNNI build). Over several passes (a prompt's
// slice, whose chunks each pass reads again from L2), 8: 4 was up to 2%
// slower at 64 rows. None at all ran a one-row step's linears 1.5 x slower
constexpr int64_t PREFETCH_ONE_PASS = 4, PREFETCH_PASSES = 8;
// over more than MR_MAX rows, a thread's panels go by in chunks of this many
// bytes, each read from memory once and from L2 by every pass of rows
constexpr int64_t CHUNK_BYTES = 192 << 10;
// the same fp32 constants as int8_rows' (a double rounded to float, as torch rounds a Python scalar)
const float INV_127 = (float)(1.0 / 127.0), INV_32767 = (float)(1.0 / 32767.0);
const float SMALLEST_TOP = (float)1e-30;
// the kernel's `qact` argument: contract/schemes.py's QACT index of the activations' rounding (1: int8)
constexpr int64_t INT8X2 = 2, INT16 = 3, INT8_PEAK = 4;

typedef __m256i ivec;

// x's rows as int8 codes (M * terms rows of K; int16 codes: M rows of 2 K
// bytes), each block's step (M * terms rows of K / 32), and each row of x's
// sum of step * codes over each group and both terms [M, groups]. The codes
// and steps go in passes of rows (as the products take them): a pass of n
// rows holds its codes quad by quad (4 codes of each of its rows, row by
// row) and its steps block by block, so a tile finds a row's operands at a
// fixed distance from one pointer
//
// With peaks (--qact int8-peak, int8_peak_rows), each row's peak blocks
// (those whose largest magnitude is the row's largest) also round their
// rounding error: codes2 and steps2 hold those second codes in the layout of
// codes and steps (zero codes elsewhere), the sums count them, and
// peak_blocks says, for each pass and block, whether any row of the pass has
// a second term there
struct Rows {
  std::vector<int8_t> codes, codes2;
  std::vector<float> steps, steps2, sums;
  std::vector<uint8_t> peak_blocks;  // [passes, blocks]; empty without peaks
  int64_t per_pass;
  bool one_pass;  // all rows in one pass
};

// the largest magnitude of the 32 floats at p (at least SMALLEST_TOP), and them as 4 vectors in v
inline float block_top(const float* p, vec (&v)[4]) {
  const vec sign = broadcast(-0.0f);
  for (int i = 0; i < 4; i++) v[i] = load(p + 8 * i);
  vec top = max(max(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                max(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float largest = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  return largest > SMALLEST_TOP ? largest : SMALLEST_TOP;
}

// the sum of the 32 int32 codes in q, exact
inline int32_t code_sum(const ivec (&q)[4]) {
  const ivec pairs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}

// the 32 values v rounded to codes of `step` (round half to even, as torch.round)
inline void round_codes(const vec (&v)[4], float step, ivec (&q)[4]) {
  const vec s = broadcast(step);
  for (int i = 0; i < 4; i++)
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// block b of row p (32 floats at p): its codes as 32 bytes in K order, its
// step, and the sum of its codes (exact); with `error`, also the rounding
// error p - q * step there, as int8x2_rows computes it (an fp32 multiply,
// then a subtraction)
inline ivec block_codes(const float* p, float& step, int32_t& sum, float* error = nullptr) {
  const ivec order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  vec v[4];
  step = block_top(p, v) * INV_127;
  const vec s = broadcast(step);
  ivec q[4];
  round_codes(v, step, q);
  if (error)
    for (int i = 0; i < 4; i++) {
      vec back = mul(_mm256_cvtepi32_ps(q[i]), s);
      // rounded here, as torch rounds it: without the barrier the compiler fuses the multiply and the
      // subtraction into one FMA, a different error, and a block's second codes differ from the definition's
      asm("" : "+x"(back));
      store(error + 8 * i, _mm256_sub_ps(v[i], back));
    }
  sum = code_sum(q);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                                     order);
}

// the block of 32 floats at p as int16 codes (int16_rows: step = largest
// magnitude / 32767), in K order in out; its step and the sum of its codes
inline void block_codes16(const float* p, float& step, int32_t& sum, ivec (&out)[2]) {
  vec v[4];
  step = block_top(p, v) * INV_32767;
  ivec q[4];
  round_codes(v, step, q);
  sum = code_sum(q);
  // packs interleaves 128-bit lanes: 0xd8 puts the four quarters back in order
  out[0] = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
  out[1] = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
}

// x's M rows as int8 codes, in passes of per_pass rows; with two terms, 2 M
// rows: row 2m holds row m's codes, row 2m + 1 those of its rounding error;
// `wide`: M rows of int16 codes (a quad is 8 bytes); `peaks`: M rows, and
// second codes on each row's peak blocks
Rows quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t groups, int terms, int64_t per_pass,
              bool wide = false, bool peaks = false) {
  const int64_t blocks = K / BLOCK, per_group = blocks / groups, R = M * terms;
  const int64_t passes = (R + per_pass - 1) / per_pass;
  Rows r{std::vector<int8_t>(R * K * (wide ? 2 : 1)),
         std::vector<int8_t>(peaks ? R * K : 0),
         std::vector<float>(R * blocks),
         std::vector<float>(peaks ? R * blocks : 0),
         std::vector<float>(M * groups, 0.0f),
         std::vector<uint8_t>(peaks ? passes * blocks : 0),
         per_pass,
         per_pass >= R};
  // code row `row`'s block b from the 32 floats at p (and their rounding error into `error`, if given); with
  // `second`, into codes2 and steps2
  const auto put = [&](int64_t row, int64_t b, const float* p, float* error, bool second = false) {
    // its pass: from row `first`, n rows
    const int64_t first = row / per_pass * per_pass, n = R - first < per_pass ? R - first : per_pass;
    float step;
    int32_t sum;
    if (wide) {
      alignas(32) int64_t quads[QUADS];
      ivec codes[2];
      block_codes16(p, step, sum, codes);
      _mm256_store_si256((ivec*)quads, codes[0]);
      _mm256_store_si256((ivec*)quads + 1, codes[1]);
      int64_t* pass = (int64_t*)(r.codes.data() + first * K * 2) + b * QUADS * n + row - first;
      for (int j = 0; j < QUADS; j++) pass[j * n] = quads[j];
    } else {
      alignas(32) int32_t quads[QUADS];
      _mm256_store_si256((ivec*)quads, block_codes(p, step, sum, error));
      int32_t* pass = (int32_t*)((second ? r.codes2 : r.codes).data() + first * K) + b * QUADS * n + row - first;
      for (int j = 0; j < QUADS; j++) pass[j * n] = quads[j];
    }
    (second ? r.steps2 : r.steps)[first * blocks + b * n + row - first] = step;
    r.sums[row / terms * groups + b / per_group] += step * (float)sum;
  };
  const auto row = [&](int64_t m) {
    alignas(32) float error[BLOCK];
    float peak = 0.0f;  // the row's largest block top (int8_peak_rows' amax of the tops)
    if (peaks)
      for (int64_t b = 0; b < blocks; b++) {
        vec v[4];
        const float top = block_top(x + m * ldx + b * BLOCK, v);
        peak = top > peak ? top : peak;
      }
    for (int64_t b = 0; b < blocks; b++) {
      const float* p = x + m * ldx + b * BLOCK;
      vec v[4];
      const bool second = terms == 2 || (peaks && !(block_top(p, v) < peak));  // lt(top, amax(tops)) masks it off
      put(m * terms, b, p, second ? error : nullptr);
      if (terms == 2) put(m * terms + 1, b, error, nullptr);
      if (peaks && second) put(m, b, error, nullptr, true);
    }
  };
  if (M >= 32) {
#pragma omp parallel for
    for (int64_t m = 0; m < M; m++) row(m);
  } else {  // no omp region at all: one that an if clause keeps to one thread cost about half of a one-row call's 0.9 us here
    for (int64_t m = 0; m < M; m++) row(m);
  }
  // a pass's block takes the second products where any of its rows has a second step (a peak block's is
  // never 0: its top is at least SMALLEST_TOP)
  for (int64_t pass = 0; pass < (peaks ? passes : 0); pass++) {
    const int64_t first = pass * per_pass, n = R - first < per_pass ? R - first : per_pass;
    for (int64_t b = 0; b < blocks; b++)
      for (int64_t i = 0; i < n; i++) r.peak_blocks[pass * blocks + b] |= r.steps2[first * blocks + b * n + i] != 0.0f;
  }
  return r;
}

#ifdef KV_VNNI
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif
// what the products take an 8-bit code as: code - SHIFT (maddubs needs them signed)
constexpr float SHIFT_8BIT = VNNI ? 0.0f : 128.0f;

// 8 scales or offsets at p (8 weight rows of a panel, one group) as floats
inline vec load8(const float* p) { return load(p); }
inline vec load8(const uint16_t* p) { return load_half(p); }

// acc + each lane's sums of maddubs' int16 pairs, held where GCC cannot see
// into it, so each row's products are added as they come: without that GCC
// computed a block's products for every row (64 with 8 rows of 8-bit codes)
// before adding any, and kept most of them and the tile's accumulators on the
// stack (8 rows ran 1.08-1.14 x slower, both builds). VNNI sums in its own
// instruction.
inline ivec add_pairs(ivec acc, ivec pairs) {
  ivec sum = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  __asm__("" : "+v"(sum));
  return sum;
}

// acc + b in each int16 lane, held like add_pairs' sums (the same reason)
inline ivec add16(ivec acc, ivec b) {
  ivec sum = _mm256_add_epi16(acc, b);
  __asm__("" : "+v"(sum));
  return sum;
}

// each byte's low and high nibbles as bytes: 4-bit codes unpacked in registers
inline void nibbles(ivec bytes, ivec& low, ivec& high) {
  low = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
  high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
}

// acc + each lane's 4 8-bit weight codes w (unsigned; code - 128 as signed
// bytes on maddubs) times 4 codes x, exact
inline ivec dot_quad8(ivec acc, ivec w, ivec x) {
#ifdef KV_VNNI
  return dot_u8s8(acc, w, x);
#else  // |w| <= 128, |x| <= 127: maddubs' pairs stay within int16
  const ivec pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return add_pairs(acc, pairs);
#endif
}

// acc[i] plus the offset terms of a panel's 8 weight rows (their offsets,
// and SHIFT_8BIT times their scales for 8 bits) by row i's sums of xq per
// group (`groups` apart), for MR rows at once: each group's offsets are
// loaded once, and the rows' sums are MR independent chains of FMAs (one
// row at a time was a chain of `groups` dependent FMAs, which took as long as
// the products themselves over 8 rows of 4-bit codes in groups of 32)
template <int BITS, bool WIDE, int MR, typename S>
inline void fma_offsets(const S* offset, const S* scale, const float* sums, int64_t groups, vec (&acc)[MR]) {
  constexpr bool shifted = BITS == 8 && !WIDE && SHIFT_8BIT != 0.0f;  // int16 products take codes as they are
  for (int64_t g = 0; g < groups; g++) {
    const vec o = shifted ? fma(broadcast(SHIFT_8BIT), load8(scale + g * PANEL), load8(offset + g * PANEL))
                          : load8(offset + g * PANEL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i] = fma(o, broadcast(sums[i * groups + g]), acc[i]);
  }
}

// the arithmetic of add_block below on 256-bit vectors and, for the pair
// tiling, on 512-bit ones
inline vec to_float(ivec a) { return _mm256_cvtepi32_ps(a); }
template <typename V>
V splat(float x);
template <>
inline vec splat<vec>(float x) {
  return broadcast(x);
}
#if defined(KV_VNNI) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr bool PAIRS = true;
typedef __m512i wivec;
typedef __m512 wvec;
using kv::fma, kv::mul;  // beside these overloads, not hidden by them
inline wvec to_float(wivec a) { return _mm512_cvtepi32_ps(a); }
inline wvec mul(wvec a, wvec b) { return _mm512_mul_ps(a, b); }
inline wvec fma(wvec a, wvec b, wvec c) { return _mm512_fmadd_ps(a, b, c); }
template <>
inline wvec splat<wvec>(float x) {
  return _mm512_set1_ps(x);
}
#else
constexpr bool PAIRS = false;
#endif

// acc plus a block's products for one row of x: the dot products of its
// code row (dots, step) and with two terms of its rounding error's
// (error_dots, error_step; ignored with one), each times its step and, unless
// ONE_GROUP (a weight with one scale a row, applied at the end), the group's
// scales s. Two terms are summed before the scales: one multiply a block
// fewer than scaling each
template <bool ONE_GROUP, int TERMS, typename V, typename IV>
inline V add_block(V acc, IV dots, float step, IV error_dots, float error_step, V s) {
  if constexpr (TERMS == 1)
    return fma(to_float(dots), ONE_GROUP ? splat<V>(step) : mul(splat<V>(step), s), acc);
  else if constexpr (ONE_GROUP)
    return fma(to_float(error_dots), splat<V>(error_step), fma(to_float(dots), splat<V>(step), acc));
  else
    return fma(fma(to_float(error_dots), splat<V>(error_step), mul(to_float(dots), splat<V>(step))), s, acc);
}

// stores a panel's results of x's rows m0..m0+MR
template <int MR>
inline void store_rows(const vec (&result)[MR], int64_t m0, float* out, int64_t N, int64_t column) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++) store(out + (m0 + i) * N + column, result[i]);
}

// ---- the row tiling: a panel's 8 weight rows across the lanes

// where panels p0.. and code rows m0.. (x's rows m0 / TERMS ..) find their
// operands (x's codes, steps and sums; the panels' codes, scales and
// offsets), for every tiling below; WIDE: x's codes are int16
template <int BITS, int MR, int TERMS, typename S, bool WIDE = false, bool PEAK = false>
struct Operands {
  static constexpr int64_t CODE_BYTES = WIDE ? 2 : 1;
  static constexpr int64_t BLOCK_BYTES = PANEL * BLOCK * BITS / 8;  // a panel's codes of one block
  int64_t blocks, groups, per_group, panel_bytes, table;             // table: a panel's scales (or offsets)
  int64_t ahead;                                                      // panels fetch_ahead fetches ahead
  const uint8_t* codes;
  const S *scales, *offsets;
  const int8_t *x_codes, *x_codes2;  // x_codes2: the second codes of peak blocks (PEAK: int8-peak), else null
  const float *steps, *steps2, *sums;
  const uint8_t* peak_blocks;  // PEAK: whether block b of these rows has second codes

  Operands(const Rows& rows, int64_t m0, const uint8_t* data, const S* scale, const S* offset, int64_t p0, int64_t K,
           int64_t groups)
      : blocks(K / BLOCK), groups(groups), per_group(K / BLOCK / groups), panel_bytes(K / BLOCK * BLOCK_BYTES),
        table(groups * PANEL), ahead(rows.one_pass ? PREFETCH_ONE_PASS : PREFETCH_PASSES),
        codes(data + p0 * panel_bytes), scales(scale + p0 * table), offsets(offset + p0 * table),
        x_codes(rows.codes.data() + m0 * K * CODE_BYTES), x_codes2(PEAK ? rows.codes2.data() + m0 * K : nullptr),
        steps(rows.steps.data() + m0 * blocks), steps2(PEAK ? rows.steps2.data() + m0 * blocks : nullptr),
        sums(rows.sums.data() + m0 / TERMS * groups),
        // (a tile's rows are one pass's: its first row m0 starts the pass)
        peak_blocks(PEAK ? rows.peak_blocks.data() + m0 / rows.per_pass * blocks : nullptr) {}

  // panel t's codes of block b, and its 8 scales or offsets of group g
  const uint8_t* block(int64_t b, int64_t t) const { return codes + t * panel_bytes + b * BLOCK_BYTES; }
  const S* scale8(int64_t t, int64_t g) const { return scales + t * table + g * PANEL; }
  const S* offset8(int64_t t, int64_t g) const { return offsets + t * table + g * PANEL; }
  // quad j (codes 4j..4j+3) of code row i (SECOND: of its second codes): where it is, and as one int32
  // (int16 codes: int64), the broadcast of a quad
  template <bool SECOND = false>
  const int32_t* quad(int i, int64_t j) const {
    return (const int32_t*)((SECOND ? x_codes2 : x_codes) + (j * MR + i) * 4 * CODE_BYTES);
  }
  template <bool SECOND = false>
  int32_t four(int i, int64_t j) const {
    int32_t four;
    std::memcpy(&four, quad<SECOND>(i, j), 4);
    return four;
  }
  int64_t four16(int i, int64_t j) const {
    int64_t four;
    std::memcpy(&four, quad(i, j), 8);
    return four;
  }
  template <bool SECOND = false>
  float step(int i, int64_t b) const {
    return (SECOND ? steps2 : steps)[b * MR + i];
  }
  // PEAK: whether block b takes second products (a row of these has a peak there)
  bool peak(int64_t b) const { return peak_blocks[b]; }

  // fetches into L2, `ahead` panels ahead of P panels, their codes of block b
  // and, at the first block of a cache line of groups, their tables
  template <int P>
  void fetch_ahead(int64_t b) const {
    const int64_t line = 64 / (PANEL * (int64_t)sizeof(S));  // groups a cache line of a table holds
#pragma GCC unroll 4
    for (int t = 0; t < P; t++)
      for (int64_t at = 0; at < BLOCK_BYTES; at += 64) prefetch_l2(block(b, ahead + t) + at);
    const int64_t g = b / per_group;
    if (b % per_group == 0 && g % line == 0)
#pragma GCC unroll 4
      for (int t = 0; t < P; t++) {
        prefetch_l2(scale8(ahead + t, g));
        prefetch_l2(offset8(ahead + t, g));
      }
  }

  // each row of x's result for panel t: acc (its weight's scale per row, if ONE_GROUP, applied here) plus the offset terms
  template <bool ONE_GROUP>
  void finish(int t, vec (&result)[MR / TERMS]) const {
    if constexpr (ONE_GROUP)
#pragma GCC unroll 8
      for (int i = 0; i < MR / TERMS; i++) result[i] = mul(result[i], load8(scale8(t, 0)));
    fma_offsets<BITS, WIDE>(offset8(t, 0), scale8(t, 0), sums, groups, result);
  }
};

// code rows m0..m0+MR by panels p0..p0+P (weight rows 8 p0 ..), into out; a
// weight with one group a row (ONE_GROUP) is scaled once at the end. With two
// terms (TERMS 2: m0 and MR even), code rows 2m and 2m + 1 are x's row m's
// two terms: their products are summed in registers a block, and stored
// once, to row m
template <int BITS, int MR, int P, bool ONE_GROUP, int TERMS, typename S, bool PEAK = false>
inline void panel_rows(const Rows& rows, int64_t m0, const uint8_t* data, const S* scale, const S* offset, int64_t p0,
                       int64_t K, int64_t groups, float* out, int64_t N) {
  constexpr int XR = MR / TERMS;  // rows of x
  const Operands<BITS, MR, TERMS, S, false, PEAK> op(rows, m0, data, scale, offset, p0, K, groups);
  vec acc[XR][P];
  clear(acc);
  for (int64_t b = 0; b < op.blocks; b++) {
    op.template fetch_ahead<P>(b);
    // 4-bit codes on maddubs: each int16 lane of sums16 sums the block's products, 2 a maddubs and 16 in
    // all, at most 16 * 15 * 127 = 30480 (no saturation), and goes into dots as int32 once, at the block's
    // end: one madd and one add a block and row where there was one of each a vector. 4 and 8 rows of
    // 4-bit codes ran 0.88-0.90 x the time from memory and from L2, 1 row 0.98-1.0 x (it runs at the read
    // rate from memory), on Zen 3 (bench/ab_kernels.py --dtype 4w, with and without --in-cache). Without
    // add16's hold 4 and 8 rows ran 1.25 x slower than with it. The block's products of the rows' codes
    // (SECOND: of their second codes, int8-peak's, where a row has them), into acc
    const auto block = [&](auto second) __attribute__((always_inline)) {
      constexpr bool SECOND = decltype(second)::value;
      ivec dots[MR][P], sums16[MR][P];
#pragma GCC unroll 8
      for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int t = 0; t < P; t++) dots[i][t] = sums16[i][t] = _mm256_setzero_si256();
      // quad q: codes 4q..4q+3 of the block (4 bits: and 16 + 4q .., the high nibbles)
#pragma GCC unroll 8
      for (int q = 0; q < BITS; q++) {  // a block is BITS vectors of a panel
        ivec x[MR], xh[MR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
          x[i] = _mm256_set1_epi32(op.template four<SECOND>(i, b * QUADS + q));
          if constexpr (BITS == 4) xh[i] = _mm256_set1_epi32(op.template four<SECOND>(i, b * QUADS + QUADS / 2 + q));
        }
#pragma GCC unroll 4
        for (int t = 0; t < P; t++) {
          const ivec w = _mm256_loadu_si256((const ivec*)(op.block(b, t) + q * 32));
          if constexpr (BITS == 4) {
            ivec low, high;
            nibbles(w, low, high);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
#ifdef KV_VNNI
              dots[i][t] = dot_u8s8(dot_u8s8(dots[i][t], low, x[i]), high, xh[i]);
#else
              sums16[i][t] =
                  add16(add16(sums16[i][t], _mm256_maddubs_epi16(low, x[i])), _mm256_maddubs_epi16(high, xh[i]));
#endif
            }
          } else {
            const ivec codes8 = VNNI ? w : _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) dots[i][t] = dot_quad8(dots[i][t], codes8, x[i]);
          }
        }
      }
      if constexpr (BITS == 4 && !VNNI)
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
          for (int t = 0; t < P; t++) dots[i][t] = _mm256_madd_epi16(sums16[i][t], _mm256_set1_epi16(1));
#pragma GCC unroll 4
      for (int t = 0; t < P; t++) {
        const vec s = ONE_GROUP ? zero() : load8(op.scale8(t, b / op.per_group));
#pragma GCC unroll 8
        for (int i = 0; i < MR; i += TERMS)
          acc[i / TERMS][t] =
              add_block<ONE_GROUP, TERMS>(acc[i / TERMS][t], dots[i][t], op.template step<SECOND>(i, b),
                                          dots[i + TERMS - 1][t], op.template step<SECOND>(i + TERMS - 1, b), s);
      }
    };
    block(std::false_type{});
    if constexpr (PEAK)
      if (op.peak(b)) block(std::true_type{});
  }
#pragma GCC unroll 4
  for (int t = 0; t < P; t++) {
    vec result[XR];
#pragma GCC unroll 8
    for (int i = 0; i < XR; i++) result[i] = acc[i][t];
    op.template finish<ONE_GROUP>(t, result);
    store_rows(result, m0 / TERMS, out, N, (p0 + t) * PANEL);
  }
}

// ---- int16 activations (--qact int16): a panel's 8 weight rows across the lanes, in pairs of codes
//
// A code pair of a weight row times a pair of x's int16 codes is one int32
// lane of madd (or of VNNI's vpdpwssd), signed 16-bit by signed 16-bit, so
// the weight's codes are widened to 16 bits as they are (0..255 or 0..15:
// no sign trick, no shift, SHIFT_8BIT does not apply). A panel's vector of
// codes (4 of each of its 8 rows) widens, by unpacking against zero within
// each 128-bit half, into rows 0, 1, 4, 5 and rows 2, 3, 6, 7; each takes a
// row's 4 codes broadcast as 8 bytes, and the two halves' lanes (two code
// pairs of each weight row) sum with one hadd at the block's end, which
// leaves the 8 rows in order (Wide<1>; Wide<2> and WideRow below say how
// theirs go). A block's sums stay within int32: 32 products of at most 255 x
// 32767.

// acc + each int32 lane's two products of int16 pairs, exact
inline ivec dot16(ivec acc, ivec w, ivec x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  ivec sum = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
  __asm__("" : "+v"(sum));  // add_pairs' hold, for its reason
  return sum;
#endif
}

// the wide products' vector operations over P panels: one panel's 8 weight
// rows in 256-bit vectors; two panels' in 512-bit ones (Wide<2>, the pair
// tiling's below)
template <int P>
struct Wide;
template <>
struct Wide<1> {
  static constexpr int P = 1;            // panels a tile takes
  static constexpr bool HALVES = true;   // codes widen to two vectors, each its own products
  typedef ivec I;
  typedef vec F;
  static I codes(const uint8_t* a, const uint8_t*) { return _mm256_loadu_si256((const ivec*)a); }
  static I none() { return _mm256_setzero_si256(); }
  static void split(I bytes, I& low, I& high) { nibbles(bytes, low, high); }  // 4-bit codes
  static I widen_low(I codes) { return _mm256_unpacklo_epi8(codes, none()); }
  static I widen_high(I codes) { return _mm256_unpackhi_epi8(codes, none()); }
  static I four(int64_t codes) { return _mm256_set1_epi64x(codes); }
  static I dot(I acc, I w, I x) { return dot16(acc, w, x); }
  static I pair_sums(I low, I high) { return _mm256_hadd_epi32(low, high); }  // each weight row's two lanes, in order
  static F fzero() { return zero(); }
  template <typename S>
  static F scales(const S* a, const S*) { return load8(a); }
  static vec panel(F a, int) { return a; }  // panel t's 8 lanes
};

// rows m0..m0+MR by panels p0..p0+P of 8 weight rows with int16 codes, on
// W's vectors (Wide<1>, Wide<2> or WideRow below: P of them)
template <int BITS, int MR, typename W, bool ONE_GROUP, typename S>
inline void panel_rows_wide(const Rows& rows, int64_t m0, const uint8_t* data, const S* scale, const S* offset,
                            int64_t p0, int64_t K, int64_t groups, float* out, int64_t N) {
  constexpr int P = W::P;
  typedef typename W::I I;
  const Operands<BITS, MR, 1, S, true> op(rows, m0, data, scale, offset, p0, K, groups);
  typename W::F acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++) acc[i] = W::fzero();
  for (int64_t b = 0; b < op.blocks; b++) {
    op.template fetch_ahead<P>(b);
    // HALVES: rows 0, 1, 4, 5 and rows 2, 3, 6, 7 of each panel, two lanes a weight row; WideRow: every row, the
    // even and the odd vectors of codes
    I low[MR], high[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) low[i] = high[i] = W::none();
#pragma GCC unroll 8
    for (int q = 0; q < BITS; q++) {  // a block is BITS vectors of a panel
      const I w = W::codes(op.block(b, 0) + q * 32, op.block(b, P - 1) + q * 32);
      // 8 bits: quad q's codes; 4 bits: the low nibbles (quad q) and the high ones (quad QUADS / 2 + q)
      I codes[BITS == 4 ? 2 : 1];
      if constexpr (BITS == 4)
        W::split(w, codes[0], codes[1]);
      else
        codes[0] = w;
#pragma GCC unroll 2
      for (int h = 0; h < (BITS == 4 ? 2 : 1); h++) {
        if constexpr (W::HALVES) {
          const I w_low = W::widen_low(codes[h]), w_high = W::widen_high(codes[h]);
#pragma GCC unroll 8
          for (int i = 0; i < MR; i++) {
            const I x = W::four(op.four16(i, b * QUADS + h * QUADS / 2 + q));
            low[i] = W::dot(low[i], w_low, x);
            high[i] = W::dot(high[i], w_high, x);
          }
        } else {  // codes already wide (WideRow, 8-bit codes): each vector's products go to low and high in turn
          static_assert(BITS == 8, "WideRow takes 8-bit codes");
#pragma GCC unroll 8
          for (int i = 0; i < MR; i++) {
            const I x = W::four(op.four16(i, b * QUADS + q));
            I& sums = q % 2 ? high[i] : low[i];
            sums = W::dot(sums, codes[h], x);
          }
        }
      }
    }
    const int64_t g = b / op.per_group;
    const typename W::F s = ONE_GROUP ? W::fzero() : W::scales(op.scale8(0, g), op.scale8(P - 1, g));
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      const auto sums = W::pair_sums(low[i], high[i]);
      acc[i] = add_block<ONE_GROUP, 1>(acc[i], sums, op.step(i, b), sums, 0.0f, s);  // one term: the second unused
    }
  }
  for (int t = 0; t < P; t++) {
    vec result[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) result[i] = W::panel(acc[i], t);
    op.template finish<ONE_GROUP>(t, result);
    store_rows(result, m0, out, N, (p0 + t) * PANEL);
  }
}

// ---- the pair tiling (the VNNI build on AVX-512): two panels' 16 weight rows across the lanes of 512-bit vectors
//
// One broadcast of a row's 4 codes, one unpacking of the codes and one
// convert, scale and FMA a block serve 16 weight rows instead of 8. Every
// linear of a SmolLM2 step from memory (a scratch A/B against panel_rows, Zen
// 4) ran 1.06-1.16 x faster over 4-16 rows of 4-bit codes and 1.0-1.07 x of
// 8-bit ones: Zen 4 splits a 512-bit vpdpbusd in two, so the products take as
// long either way, and everything around them half as many instructions. One
// row keeps panel_rows (a single stream through memory).
#if defined(KV_VNNI) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// two panels' 32 bytes at a and b as one vector (a's in the low half)
inline wivec pair_codes(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const ivec*)a)), _mm256_loadu_si256((const ivec*)b), 1);
}
// two panels' 8 scales at a and b as floats
inline wvec pair8(const float* a, const float* b) { return _mm512_insertf32x8(_mm512_castps256_ps512(load(a)), load(b), 1); }
inline wvec pair8(const uint16_t* a, const uint16_t* b) {
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                            _mm_loadu_si128((const __m128i*)b), 1);
  return _mm512_cvtph_ps(h);
}
inline vec low_half(wvec a) { return _mm512_castps512_ps256(a); }
inline vec high_half(wvec a) { return _mm512_extractf32x8_ps(a, 1); }
// acc + each lane's 4 codes of w (unsigned) times the 4 codes at x (signed),
// x broadcast by the dot product itself (its {1to16} memory operand): GCC 12
// broadcasts into a register first, one more instruction a product, and the
// pair tiling ran 2-4% slower so (a scratch A/B on Zen 4, 2-8 rows)
inline wivec dot_broadcast(wivec acc, wivec w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}
// nibbles over two panels
inline void nibbles(wivec bytes, wivec& low, wivec& high) {
  low = _mm512_and_si512(bytes, _mm512_set1_epi8(15));
  high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi8(15));
}

// panel_rows' arithmetic over panels p0 and p0 + 1 at once, the same in every lane
template <int BITS, int MR, bool ONE_GROUP, int TERMS, typename S, bool PEAK = false>
inline void panel_pair_rows(const Rows& rows, int64_t m0, const uint8_t* data, const S* scale, const S* offset,
                            int64_t p0, int64_t K, int64_t groups, float* out, int64_t N) {
  constexpr int XR = MR / TERMS;  // rows of x
  const Operands<BITS, MR, TERMS, S, false, PEAK> op(rows, m0, data, scale, offset, p0, K, groups);
  wvec acc[XR];
#pragma GCC unroll 8
  for (int i = 0; i < XR; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < op.blocks; b++) {
    op.template fetch_ahead<2>(b);
    const auto block = [&](auto second) __attribute__((always_inline)) {  // as panel_rows' block
      constexpr bool SECOND = decltype(second)::value;
      wivec dots[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; i++) dots[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < BITS; q++) {
        const wivec w = pair_codes(op.block(b, 0) + q * 32, op.block(b, 1) + q * 32);
        if constexpr (BITS == 4) {
          wivec low, high;
          nibbles(w, low, high);
#pragma GCC unroll 8
          for (int i = 0; i < MR; i++) {
            const int32_t *x = op.template quad<SECOND>(i, b * QUADS + q),
                          *x_high = op.template quad<SECOND>(i, b * QUADS + QUADS / 2 + q);
            dots[i] = dot_broadcast(dot_broadcast(dots[i], low, x), high, x_high);
          }
        } else {
#pragma GCC unroll 8
          for (int i = 0; i < MR; i++) dots[i] = dot_broadcast(dots[i], w, op.template quad<SECOND>(i, b * QUADS + q));
        }
      }
      const int64_t g = b / op.per_group;
      const wvec s = ONE_GROUP ? _mm512_setzero_ps() : pair8(op.scale8(0, g), op.scale8(1, g));
#pragma GCC unroll 8
      for (int i = 0; i < MR; i += TERMS)
        acc[i / TERMS] = add_block<ONE_GROUP, TERMS>(acc[i / TERMS], dots[i], op.template step<SECOND>(i, b),
                                                     dots[i + TERMS - 1], op.template step<SECOND>(i + TERMS - 1, b), s);
    };
    block(std::false_type{});
    if constexpr (PEAK)
      if (op.peak(b)) block(std::true_type{});
  }
  for (int t = 0; t < 2; t++) {
    vec result[XR];
#pragma GCC unroll 8
    for (int i = 0; i < XR; i++) result[i] = t ? high_half(acc[i]) : low_half(acc[i]);
    op.template finish<ONE_GROUP>(t, result);
    store_rows(result, m0 / TERMS, out, N, (p0 + t) * PANEL);
  }
}

// the int16 products over two panels: 512-bit vpdpwssd. AVX-512 has no
// 512-bit hadd: two shuffles and an add put each 128-bit lane's pairs of
// sums in hadd's order. On an Intel Xeon (AVX-512 VNNI) over 8 rows of
// 8-bit codes from memory, one panel at a time took 1.36 x int8's time,
// two 1.10-1.12 x (bench/packed_kernel.py); a 512-token prompt of an 8w
// package ran 1.04-1.18 x faster (int8 still 1.5 x faster: 2 products a
// lane where int8 has 4)
template <>
struct Wide<2> {
  static constexpr int P = 2;
  static constexpr bool HALVES = true;
  typedef wivec I;
  typedef wvec F;
  static I codes(const uint8_t* a, const uint8_t* b) { return pair_codes(a, b); }
  static I none() { return _mm512_setzero_si512(); }
  static void split(I bytes, I& low, I& high) { nibbles(bytes, low, high); }  // 4-bit codes
  static I widen_low(I codes) { return _mm512_unpacklo_epi8(codes, none()); }
  static I widen_high(I codes) { return _mm512_unpackhi_epi8(codes, none()); }
  static I four(int64_t codes) { return _mm512_set1_epi64(codes); }
  static I dot(I acc, I w, I x) { return _mm512_dpwssd_epi32(acc, w, x); }
  static I pair_sums(I low, I high) {
    const wvec l = _mm512_castsi512_ps(low), h = _mm512_castsi512_ps(high);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(l, h, 0x88)),
                            _mm512_castps_si512(_mm512_shuffle_ps(l, h, 0xdd)));
  }
  static F fzero() { return _mm512_setzero_ps(); }
  template <typename S>
  static F scales(const S* a, const S* b) { return pair8(a, b); }
  static vec panel(F a, int t) { return t ? high_half(a) : low_half(a); }
};

// the int16 products of one row by one panel of 8-bit codes in 512-bit
// vectors: a vector's 32 codes (4 of each of the panel's 8 weight rows)
// widen into one vector of words (one vpmovzxbw), weight row r's code pairs
// in lanes 2r and 2r + 1, for one vpdpwssd where Wide<1> takes two unpacks
// and two 256-bit ones; at a block's end each lane pair is summed and the 8
// sums narrowed in order. Still one stream through memory, as every one-row
// tile is. On an Intel Xeon (AVX-512 VNNI), one row from memory took 0.95 x
// Wide<1>'s time on the 1B shape and 0.98 x on llama-small's short rows,
// 1.05 x in cache (bench/ab_kernels.py --dtype 8w --qact int16 --rows 1); an
// 8w SmolLM2 package's batch-1 step 0.96-0.98 x (bench/ab_decode.py, two
// runs). Over 4-bit codes (nibbles split in words) it took 1.03-1.06 x from
// memory (a scratch C harness calling the kernel's entry): those keep
// Wide<1>
struct WideRow {
  static constexpr int P = 1;
  static constexpr bool HALVES = false;
  typedef wivec I;
  typedef vec F;
  static I codes(const uint8_t* a, const uint8_t*) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const ivec*)a)); }
  static I none() { return _mm512_setzero_si512(); }
  static I four(int64_t codes) { return _mm512_set1_epi64(codes); }
  static I dot(I acc, I w, I x) { return _mm512_dpwssd_epi32(acc, w, x); }
  static ivec pair_sums(I low, I high) {
    const I sums = _mm512_add_epi32(low, high);
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(sums, _mm512_shuffle_epi32(sums, _MM_PERM_CDAB)));
  }
  static F fzero() { return zero(); }
  template <typename S>
  static F scales(const S* a, const S*) { return load8(a); }
  static vec panel(F a, int) { return a; }
};
// the int16 tile of one row by one panel of BITS-bit codes
template <int BITS>
using OneRowWide = std::conditional_t<BITS == 8, WideRow, Wide<1>>;
#else
template <int BITS>
using OneRowWide = Wide<1>;
template <int BITS, int MR, bool ONE_GROUP, int TERMS, typename S, bool PEAK = false>
inline void panel_pair_rows(const Rows&, int64_t, const uint8_t*, const S*, const S*, int64_t, int64_t, int64_t, float*,
                            int64_t) {}
#endif

// rows m0..m0+MR (MR = rows, up to MR_MAX; TERMS 2: both even) by panels p0..p1, P at a time; WIDE: int16 codes
template <int BITS, int MR, int TERMS, bool WIDE, typename S, bool PEAK>
void rows_by_panels(int rows, const Rows& r, int64_t m0, const uint8_t* data, const S* scale, const S* offset,
                    int64_t p0, int64_t p1, int64_t K, int64_t groups, float* out, int64_t N) {
  if constexpr (MR > TERMS) {
    if (rows < MR)
      return rows_by_panels<BITS, MR - TERMS, TERMS, WIDE, S, PEAK>(rows, r, m0, data, scale, offset, p0, p1, K, groups,
                                                                    out, N);
  }
  const bool one_group = BITS == 8 && groups == 1;  // 8w's scale per row
  if constexpr (WIDE) {
    int64_t p = p0;
    if constexpr (PAIRS && MR > 1) {
      for (; p + 2 <= p1; p += 2)
        one_group ? panel_rows_wide<BITS, MR, Wide<2>, true>(r, m0, data, scale, offset, p, K, groups, out, N)
                  : panel_rows_wide<BITS, MR, Wide<2>, false>(r, m0, data, scale, offset, p, K, groups, out, N);
    }
    using One = std::conditional_t<MR == 1, OneRowWide<BITS>, Wide<1>>;
    for (; p < p1; p++)
      one_group ? panel_rows_wide<BITS, MR, One, true>(r, m0, data, scale, offset, p, K, groups, out, N)
                : panel_rows_wide<BITS, MR, One, false>(r, m0, data, scale, offset, p, K, groups, out, N);
    return;
  }
  // one row takes one panel at a time: a single stream through memory. Taking 4 (2 on AVX2) shared the
  // row's broadcasts but ran every linear of a SmolLM2 step from memory 2-8% slower at best in five of six
  // scratch A/Bs (both builds; in cache it was 8% faster, but a model's weights come from memory)
  constexpr int P = REGISTERS == 32 ? (MR == 1 ? 1 : MR == 2 ? 2 : 1) : 1;
  int64_t p = p0;
  if constexpr (PAIRS && MR > 1) {
    for (; p + 2 <= p1; p += 2)
      one_group ? panel_pair_rows<BITS, MR, true, TERMS, S, PEAK>(r, m0, data, scale, offset, p, K, groups, out, N)
                : panel_pair_rows<BITS, MR, false, TERMS, S, PEAK>(r, m0, data, scale, offset, p, K, groups, out, N);
  }
  for (; p + P <= p1; p += P)
    one_group ? panel_rows<BITS, MR, P, true, TERMS, S, PEAK>(r, m0, data, scale, offset, p, K, groups, out, N)
              : panel_rows<BITS, MR, P, false, TERMS, S, PEAK>(r, m0, data, scale, offset, p, K, groups, out, N);
  for (; p < p1; p++)
    one_group ? panel_rows<BITS, MR, 1, true, TERMS, S, PEAK>(r, m0, data, scale, offset, p, K, groups, out, N)
              : panel_rows<BITS, MR, 1, false, TERMS, S, PEAK>(r, m0, data, scale, offset, p, K, groups, out, N);
}

// ---- the entry

template <int BITS, int TERMS, bool WIDE, bool PEAK, typename S>
void product(const float* x, int64_t ldx, const uint8_t* data, const S* scale, const S* offset, float* out,
             int64_t M, int64_t N, int64_t K, int64_t groups) {
  static_assert(MR_MAX % 2 == 0, "a pass takes a row's two terms together");
  const int64_t R = M * TERMS;  // rows of codes
  // passes of even size (two terms: whole rows of x, both terms in one pass)
  const int64_t passes = (R + MR_MAX - 1) / MR_MAX, per_pass = (M + passes - 1) / passes * TERMS;
  const Rows rows = quantize(x, ldx, M, K, groups, TERMS, per_pass, WIDE, PEAK);
  const int64_t panels = N / PANEL, panel_bytes = K * BITS;
  const int64_t chunk = R <= MR_MAX ? panels : (CHUNK_BYTES / panel_bytes > 0 ? CHUNK_BYTES / panel_bytes : 1);
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t first = panels * me / threads, last = panels * (me + 1) / threads;
    for (int64_t c0 = first; c0 < last; c0 += chunk) {
      const int64_t c1 = c0 + chunk < last ? c0 + chunk : last;
      for (int64_t m = 0; m < R; m += per_pass)
        rows_by_panels<BITS, MR_MAX, TERMS, WIDE, S, PEAK>((int)(R - m < per_pass ? R - m : per_pass), rows, m, data,
                                                           scale, offset, c0, c1, K, groups, out, N);
    }
  }
}

// the product for the codes' width and the tables' type; PEAK: int8-peak's second codes (one term)
template <int TERMS, bool WIDE, bool PEAK = false>
void by_format(const float* x, int64_t ldx, const uint8_t* data, const void* scale, const void* offset, float* out,
               int64_t M, int64_t N, int64_t K, int64_t groups, int64_t bits, bool half) {
  if (bits == 4 && half)
    product<4, TERMS, WIDE, PEAK>(x, ldx, data, (const uint16_t*)scale, (const uint16_t*)offset, out, M, N, K, groups);
  else if (bits == 4)
    product<4, TERMS, WIDE, PEAK>(x, ldx, data, (const float*)scale, (const float*)offset, out, M, N, K, groups);
  else if (half)
    product<8, TERMS, WIDE, PEAK>(x, ldx, data, (const uint16_t*)scale, (const uint16_t*)offset, out, M, N, K, groups);
  else
    product<8, TERMS, WIDE, PEAK>(x, ldx, data, (const float*)scale, (const float*)offset, out, M, N, K, groups);
}

}  // namespace

// x: [M, K] fp32 (row stride ldx), K a multiple of 32; data: uint8 codes in
// the blocks format, [N / 8, K * bits] contiguous; scale, offset: [N / 8,
// groups * 8] contiguous, fp32 (scale_bits 32) or fp16 (16), K / groups a
// multiple of 32; out: [M, N] contiguous; N a multiple of 8; qact: how x is
// rounded, contract/schemes.py's QACT index: 1 int8_rows, 2 int8x2_rows, 3
// int16_rows, 4 int8_peak_rows
#ifdef KV_VNNI
void kvexport_int8_linear_vnni(
#else
void kvexport_int8_linear_maddubs(
#endif
    const float* x, int64_t ldx, const uint8_t* data, const void* scale, const void* offset, float* out, int64_t M,
    int64_t N, int64_t K, int64_t groups, int64_t bits, int64_t scale_bits, int64_t qact) {
  (qact == INT8X2      ? by_format<2, false>
   : qact == INT16     ? by_format<1, true>
   : qact == INT8_PEAK ? by_format<1, false, true>
                       : by_format<1, false>)(x, ldx, data, scale, offset, out, M, N, K, groups, bits, scale_bits == 16);
}

#ifndef KV_VNNI
void kvexport_int8_linear(const float* x, int64_t ldx, const uint8_t* data, const void* scale, const void* offset,
                          float* out, int64_t M, int64_t N, int64_t K, int64_t groups, int64_t bits,
                          int64_t scale_bits, int64_t qact) {
  static const bool vnni = has_vnni();
  (vnni ? kvexport_int8_linear_vnni : kvexport_int8_linear_maddubs)(x, ldx, data, scale, offset, out, M, N, K, groups,
                                                                   bits, scale_bits, qact);
}
#endif
