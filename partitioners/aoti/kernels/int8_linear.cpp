// Products of a few fp32 rows by a weight of 4- or 8-bit codes in blocks
// (passes/packed_weights.py: codes along K, a float scale and offset per group)
// with int8 activations (--qact int8), for AOTInductor packages on x86 CPUs
// (build.py builds it; compiled methods call it through its shim in shims.cpp):
//
//   out[m, n] = sum_k xq[m, k] * (scale[n, g(k)] * code[n, k] + offset[n, g(k)])
//
// where xq is x rounded per row in blocks of 32 to int8 codes q times a step
// (step = the block's largest magnitude / 127, q = round(x / step)): exactly
// passes/packed_weights.py's int8_rows, so a package's eager reference
// computes the same codes. Each block's product is an integer dot product,
// 32 code pairs summed exactly in int32 (maddubs then madd on AVX2), then
// scaled once by the block's step times the group's scale; the offsets
// multiply each row's sum of xq over a group, computed once a call.
//
// 4-bit codes are unpacked in registers (a mask and a shift of 16 bytes make
// the block's 32 unsigned bytes). A thread walks its own band of weight rows.
//
// Two tilings. Over a few rows (fewer than PANEL_FROM_ROWS), a register tile
// of MR rows by LT weight rows: each vector holds 8 lanes of one block's
// products for one (row, weight row) pair, so every block ends in a convert,
// a scale and an FMA per pair, and the lanes are summed at the end. 4-bit
// codes go two blocks a vector: a weight row's 32 bytes of two blocks,
// masked and shifted, are the low and the high codes of both, and the rows'
// codes are laid out to match, so a pair of blocks takes one unpacking, one
// convert, one scale and one FMA (a fifth less time than a block at a time,
// hot in cache, 1 to 4 rows on AVX-512 with and without VNNI). Over more
// rows (8 sessions, prefill slices) the rows go across the lanes instead: x's
// codes are laid out in panels of 8 rows, each 4 codes of a row side by side
// (32 bytes a column of 4 codes), and one dot product takes 4 codes of a weight
// row broadcast to every lane against 4 codes of each of the panel's 8 rows.
// Eight of them finish a block for 8 rows at once, exact in int32, and the
// block's convert, scale and FMA serve all 8: about twice the products per
// instruction of the first tiling, and of fp32 FMAs.
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

#include <vector>

#include "kernels.h"
#include "vec.h"

using namespace kv;

namespace {

constexpr int BLOCK = 32;
constexpr int MR_MAX = REGISTERS == 32 ? 8 : 4;
constexpr int LT = 4;  // weight rows per tile for one or two rows; half as many for more
// how far ahead weight rows are fetched into L2: 8 rows made one-row products
// of 8-bit codes 10-18% faster than 4 (a SmolLM2 step from memory, the VNNI
// build, both distances in one binary, alternating); 4-bit ones moved within
// the noise
constexpr int64_t PREFETCH_ROWS = 8;
constexpr int PANEL = 8;           // rows across the lanes of the panel tiling
constexpr int64_t PANEL_FROM_ROWS = 8;  // the panel tiling from this many rows (bench/packed_kernel.py)
constexpr int PT = REGISTERS == 32 ? 2 : 1;  // panels per register tile
constexpr int PL = REGISTERS == 32 ? 4 : 2;  // weight rows per panel tile
constexpr int64_t CHUNK_PANELS = 16;  // panels a thread takes per pass over its weight rows (kept in L2)
// the same fp32 constants as int8_rows' (a double rounded to float, as torch rounds a Python scalar)
const float INV_127 = (float)(1.0 / 127.0);
const float SMALLEST_TOP = (float)1e-30;

typedef __m256i ivec;

// x's rows as int8 codes [M, K], each block's step [M, K / 32] and each row's
// sum of xq over each group [M, groups]. Laid out for 4-bit codes (paired),
// each pair of blocks b, b + 1 holds codes 0-15 of both, then codes 16-31 of
// both (what a weight row's 32 bytes of the pair give, masked and shifted),
// and pair_steps holds the pair's steps as [step b x 4, step b + 1 x 4].
struct Rows {
  std::vector<int8_t> codes;
  std::vector<float> steps, sums, pair_steps;
};

// block b of row p (32 floats at p): its codes as 32 bytes in K order, its
// step, and the sum of its codes (exact)
inline ivec block_codes(const float* p, float& step, int32_t& sum) {
  const vec sign = broadcast(-0.0f);
  const ivec order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const vec v[4] = {load(p), load(p + 8), load(p + 16), load(p + 24)};
  vec top = max(max(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                max(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float largest = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  step = (largest > SMALLEST_TOP ? largest : SMALLEST_TOP) * INV_127;
  const vec s = broadcast(step);
  ivec q[4];
  for (int i = 0; i < 4; i++)
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const ivec pairs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  sum = _mm_cvtsi128_si32(t);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                                     order);
}

Rows quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t groups, bool paired) {
  const int64_t blocks = K / BLOCK, per_group = blocks / groups, pairs = paired ? blocks / 2 : 0;
  Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * groups, 0.0f),
         std::vector<float>(M * pairs * LANES)};
  for (int64_t m = 0; m < M; m++) {
    ivec previous = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; b++) {
      float step;
      int32_t sum;
      const ivec bytes = block_codes(x + m * ldx + b * BLOCK, step, sum);
      int8_t* at = r.codes.data() + m * K + b * BLOCK;
      if (b % 2 == 1 && b / 2 < pairs) {  // the pair's codes 0-15, then its codes 16-31
        _mm256_storeu_si256((ivec*)(at - BLOCK), _mm256_permute2x128_si256(previous, bytes, 0x20));
        _mm256_storeu_si256((ivec*)at, _mm256_permute2x128_si256(previous, bytes, 0x31));
        _mm256_storeu_ps(r.pair_steps.data() + (m * pairs + b / 2) * LANES,
                         _mm256_blend_ps(broadcast(r.steps[m * blocks + b - 1]), broadcast(step), 0xf0));
      } else {
        _mm256_storeu_si256((ivec*)at, bytes);
      }
      previous = bytes;
      r.steps[m * blocks + b] = step;
      r.sums[m * groups + b / per_group] += step * (float)sum;
    }
  }
  return r;
}

// x's rows in panels of PANEL rows (the last one padded with zero rows):
// codes [panels, blocks, 8 quads, PANEL rows, 4], steps [panels, blocks,
// PANEL] and sums of step * codes [panels, groups, PANEL]
Rows quantize_panels(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t groups) {
  const int64_t blocks = K / BLOCK, per_group = blocks / groups, panels = (M + PANEL - 1) / PANEL;
  Rows r{std::vector<int8_t>(panels * PANEL * K, 0), std::vector<float>(panels * blocks * PANEL, 0.0f),
         std::vector<float>(panels * groups * PANEL, 0.0f)};
#pragma omp parallel for if (M >= 4 * PANEL)
  for (int64_t m = 0; m < M; m++) {
    const int64_t p = m / PANEL, lane = m % PANEL;
    for (int64_t b = 0; b < blocks; b++) {
      float step;
      int32_t sum;
      alignas(32) int32_t quads[BLOCK / 4];
      _mm256_store_si256((ivec*)quads, block_codes(x + m * ldx + b * BLOCK, step, sum));
      int32_t* column = (int32_t*)(r.codes.data() + (p * blocks + b) * PANEL * BLOCK) + lane;
      for (int q = 0; q < BLOCK / 4; q++) column[q * PANEL] = quads[q];
      r.steps[(p * blocks + b) * PANEL + lane] = step;
      r.sums[(p * groups + b / per_group) * PANEL + lane] += step * (float)sum;
    }
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

// each byte's low and high nibbles as bytes: 4-bit codes unpacked in registers
inline void nibbles(ivec bytes, ivec& low, ivec& high) {
  low = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
  high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
}

// a block's 32 codes of weight row `row` as bytes in K order: unsigned, but
// code - 128 for 8 bits on maddubs
template <int BITS>
inline ivec codes_of(const uint8_t* row, int64_t b) {
  if constexpr (BITS == 4) {
    // the 16 bytes in both halves (a load), the upper half shifted down a nibble, both masked
    const ivec both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(row + b * (BLOCK / 2))));
    return _mm256_and_si256(_mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xf0), _mm256_set1_epi8(15));
  } else if constexpr (VNNI) {
    return _mm256_loadu_si256((const ivec*)(row + b * BLOCK));
  } else {
    return _mm256_xor_si256(_mm256_loadu_si256((const ivec*)(row + b * BLOCK)), _mm256_set1_epi8((char)0x80));
  }
}

// the 32 products of a block summed in 8 int32 lanes
template <int BITS>
inline vec dot(ivec w, ivec q) {
#ifdef KV_VNNI
  return _mm256_cvtepi32_ps(dot_u8s8(_mm256_setzero_si256(), w, q));
#else
  const ivec ones = _mm256_set1_epi16(1);
  ivec pairs;
  if constexpr (BITS == 4)
    pairs = _mm256_maddubs_epi16(w, q);  // unsigned codes by signed codes: at most 2 * 15 * 127 a pair
  else
    pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w));  // |w| <= 128, |q| <= 127
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
#endif
}

// a pair of blocks' 64 products, 4-bit codes by int8 codes: lanes 0-3 sum
// block b's, lanes 4-7 block b + 1's (low: codes 0-15 of both blocks, high:
// codes 16-31 of both, the rows' codes in the same order)
inline vec dot_pair(ivec low, ivec high, ivec q_low, ivec q_high) {
#ifdef KV_VNNI
  return _mm256_cvtepi32_ps(dot_u8s8(dot_u8s8(_mm256_setzero_si256(), low, q_low), high, q_high));
#else
  // each int16 sums 4 products of codes <= 15 and |q| <= 127: at most 7620, no saturation
  const ivec sums = _mm256_add_epi16(_mm256_maddubs_epi16(low, q_low), _mm256_maddubs_epi16(high, q_high));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, _mm256_set1_epi16(1)));
#endif
}

// acc plus the offset terms of a weight row (its offsets, and SHIFT_8BIT
// times its scales for 8 bits) by a row's sums of xq per group, 8 groups a vector
template <int BITS>
inline vec fma_offsets(const float* offset, const float* scale, const float* sums, int64_t groups, vec acc) {
  constexpr bool shifted = BITS == 8 && SHIFT_8BIT != 0.0f;
  int64_t g = 0;
  for (; g + LANES <= groups; g += LANES) {
    const vec o = shifted ? fma(broadcast(SHIFT_8BIT), load(scale + g), load(offset + g)) : load(offset + g);
    acc = fma(o, load(sums + g), acc);
  }
  if (g < groups) {
    const int left = (int)(groups - g);
    const vec o = shifted ? fma(broadcast(SHIFT_8BIT), load_first(scale + g, left), load_first(offset + g, left))
                          : load_first(offset + g, left);
    acc = fma(o, load_first(sums + g, left), acc);
  }
  return acc;
}

// rows m0..m0+MR by weight rows n0..n0+L (L <= LT); a weight with one group
// a row (ONE_GROUP) is scaled once at the end
template <int BITS, int MR, int L, bool ONE_GROUP>
inline void tile(const Rows& rows, const uint8_t* data, const float* scale, const float* offset, int64_t m0,
                 int64_t n0, int64_t K, int64_t groups, float* out, int64_t N) {
  const int64_t blocks = K / BLOCK, per_group = blocks / groups, row_bytes = K * BITS / 8;
  const int8_t* codes = rows.codes.data() + m0 * K;
  const float* steps = rows.steps.data() + m0 * blocks;
  const uint8_t* weights = data + n0 * row_bytes;
  const float* scales = scale + n0 * groups;
  vec acc[MR][L], s[L];
  clear(acc);
  int64_t b = 0, g = 0, left = per_group;  // block b is in group g, which has `left` blocks from b on
  if constexpr (BITS == 4) {  // two blocks at a time: half the unpacking, converts and scaling
    const int64_t pairs = blocks / 2;
    for (; b + 2 <= blocks; b += 2) {
      ivec low[L], high[L];
      vec ws[L];
      const int64_t g0 = g;
      if (--left == 0) g++, left = per_group;
      const int64_t g1 = g;
      if (--left == 0) g++, left = per_group;
#pragma GCC unroll 8
      for (int j = 0; j < L; j++) {
        nibbles(_mm256_loadu_si256((const ivec*)(weights + j * row_bytes + b * (BLOCK / 2))), low[j], high[j]);
        prefetch_l2(weights + (j + PREFETCH_ROWS) * row_bytes + b * (BLOCK / 2));
        ws[j] = _mm256_blend_ps(broadcast(scales[j * groups + g0]), broadcast(scales[j * groups + g1]), 0xf0);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; i++) {
        const ivec q_low = _mm256_loadu_si256((const ivec*)(codes + i * K + b * BLOCK));
        const ivec q_high = _mm256_loadu_si256((const ivec*)(codes + i * K + b * BLOCK + BLOCK));
        const vec steps = load(rows.pair_steps.data() + ((m0 + i) * pairs + b / 2) * LANES);
#pragma GCC unroll 8
        for (int j = 0; j < L; j++) acc[i][j] = fma(dot_pair(low[j], high[j], q_low, q_high), mul(steps, ws[j]), acc[i][j]);
      }
    }
  }
  if (b < blocks)  // the blocks left one at a time (all of them for 8 bits)
#pragma GCC unroll 8
    for (int j = 0; j < L; j++) s[j] = broadcast(scales[j * groups + g]);
  for (; b < blocks; b++) {
    ivec w[L];
#pragma GCC unroll 8
    for (int j = 0; j < L; j++) {
      w[j] = codes_of<BITS>(weights + j * row_bytes, b);
      prefetch_l2(weights + (j + PREFETCH_ROWS) * row_bytes + b * (BLOCK * BITS / 8));
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      const ivec q = _mm256_loadu_si256((const ivec*)(codes + i * K + b * BLOCK));
      const vec step = broadcast(steps[i * blocks + b]);
#pragma GCC unroll 8
      for (int j = 0; j < L; j++) acc[i][j] = fma(dot<BITS>(w[j], q), ONE_GROUP ? step : mul(step, s[j]), acc[i][j]);
    }
    if (--left == 0 && ++g < groups) {  // the next group's scales
      left = per_group;
#pragma GCC unroll 8
      for (int j = 0; j < L; j++) s[j] = broadcast(scales[j * groups + g]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < L; j++) {
    const int64_t n = n0 + j;
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
      out[(m0 + i) * N + n] = total(fma_offsets<BITS>(offset + n * groups, scale + n * groups,
                                                     rows.sums.data() + (m0 + i) * groups, groups,
                                                     ONE_GROUP ? mul(acc[i][j], s[j]) : acc[i][j]));
  }
}

template <int BITS, int MR, int L>
void rows_of(int rows, const Rows& r, const uint8_t* data, const float* scale, const float* offset, int64_t m0,
             int64_t n0, int64_t K, int64_t groups, float* out, int64_t N) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_of<BITS, MR - 1, L>(rows, r, data, scale, offset, m0, n0, K, groups, out, N);
  }
  if constexpr (BITS == 8) {  // 8w's scale per row
    if (groups == 1) return tile<BITS, MR, L, true>(r, data, scale, offset, m0, n0, K, groups, out, N);
  }
  tile<BITS, MR, L, false>(r, data, scale, offset, m0, n0, K, groups, out, N);
}

// weight rows n0..n0+L by every row
template <int BITS, int L>
void columns(const Rows& r, const uint8_t* data, const float* scale, const float* offset, int64_t M, int64_t n0,
             int64_t K, int64_t groups, float* out, int64_t N) {
  for (int64_t m = 0; m < M; m += MR_MAX) {
    const int count = (int)(M - m < MR_MAX ? M - m : MR_MAX);
    rows_of<BITS, MR_MAX, L>(count, r, data, scale, offset, m, n0, K, groups, out, N);
  }
}

// ---- the panel tiling: 8 rows across the lanes

// acc + 4 unsigned weight codes (the same in every lane) times 4 codes of each
// lane's row, summed per lane, exact
inline ivec dot4(ivec acc, ivec w, ivec x) {
#ifdef KV_VNNI
  return dot_u8s8(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// a weight row's codes of one block, ready to broadcast 4 at a time: 4 bits
// unpacked in registers (low nibbles: codes 0-15, high: 16-31, in both halves)
template <int BITS>
struct BlockCodes {
  ivec low, high;
  const uint8_t* bytes;
  inline void read(const uint8_t* row, int64_t b) {
    if constexpr (BITS == 4) {
      const ivec both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(row + b * (BLOCK / 2))));
      nibbles(both, low, high);
    } else {
      bytes = row + b * BLOCK;
    }
  }
  // codes 4Q..4Q+3 in every lane
  template <int Q>
  inline ivec quad() const {
    if constexpr (BITS == 4) {
      return _mm256_shuffle_epi32(Q < 4 ? low : high, (Q % 4) * 0x55);
    } else {
      int32_t four;
      __builtin_memcpy(&four, bytes + 4 * Q, 4);
      return _mm256_set1_epi32(four);
    }
  }
};

// one block's dot products of T panels (codes at `codes`, panel_bytes apart)
// by L weight rows, quad Q onwards, summed into dots
template <int BITS, int T, int L, int Q = 0>
inline void quads(const BlockCodes<BITS> (&w)[L], const int8_t* codes, int64_t panel_bytes, ivec (&dots)[T][L]) {
  if constexpr (Q < BLOCK / 4) {
    ivec xs[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) xs[t] = _mm256_loadu_si256((const ivec*)(codes + t * panel_bytes + Q * 32));
#pragma GCC unroll 8
    for (int j = 0; j < L; j++) {
      const ivec wq = w[j].template quad<Q>();
#pragma GCC unroll 4
      for (int t = 0; t < T; t++) dots[t][j] = dot4(dots[t][j], wq, xs[t]);
    }
    quads<BITS, T, L, Q + 1>(w, codes, panel_bytes, dots);
  }
}

// panels p0..p0+T by weight rows n0..n0+L into out; a weight with one group
// a row (ONE_GROUP) is scaled once at the end
template <int BITS, int T, int L, bool ONE_GROUP>
inline void panel_tile(const Rows& r, const uint8_t* data, const float* scale, const float* offset, int64_t p0,
                       int64_t n0, int64_t M, int64_t K, int64_t groups, bool prefetch, float* out, int64_t N) {
  static_assert(BITS == 4 || VNNI, "8-bit codes take the panel tiling only with VNNI");
  const int64_t blocks = K / BLOCK, per_group = blocks / groups, row_bytes = K * BITS / 8;
  const int64_t panel_bytes = blocks * PANEL * BLOCK;
  const uint8_t* weights = data + n0 * row_bytes;
  vec acc[T][L];
  clear(acc);
  for (int64_t b = 0; b < blocks; b++) {
    BlockCodes<BITS> w[L];
#pragma GCC unroll 8
    for (int j = 0; j < L; j++) {
      w[j].read(weights + j * row_bytes, b);
      if (prefetch) prefetch_l2(weights + (j + PREFETCH_ROWS) * row_bytes + b * (BLOCK * BITS / 8));
    }
    ivec dots[T][L];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
      for (int j = 0; j < L; j++) dots[t][j] = _mm256_setzero_si256();
    quads<BITS, T, L>(w, r.codes.data() + (p0 * blocks + b) * PANEL * BLOCK, panel_bytes, dots);
    const int64_t g = b / per_group;
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
      const vec steps = load(r.steps.data() + ((p0 + t) * blocks + b) * PANEL);
#pragma GCC unroll 8
      for (int j = 0; j < L; j++) {
        const vec s = ONE_GROUP ? steps : mul(steps, broadcast(scale[(n0 + j) * groups + g]));
        acc[t][j] = fma(_mm256_cvtepi32_ps(dots[t][j]), s, acc[t][j]);
      }
    }
  }
  alignas(32) float lanes[PANEL];
  for (int j = 0; j < L; j++) {
    const int64_t n = n0 + j;
    for (int t = 0; t < T; t++) {
      vec total = ONE_GROUP ? mul(acc[t][j], broadcast(scale[n * groups])) : acc[t][j];
      for (int64_t g = 0; g < groups; g++)
        total = fma(broadcast(offset[n * groups + g]), load(r.sums.data() + ((p0 + t) * groups + g) * PANEL), total);
      store(lanes, total);
      const int64_t m0 = (p0 + t) * PANEL;
      for (int i = 0; i < PANEL && m0 + i < M; i++) out[(m0 + i) * N + n] = lanes[i];
    }
  }
}

// panels c0..c1 by weight rows n0..n0+L
template <int BITS, int L, bool ONE_GROUP>
void panel_column(const Rows& r, const uint8_t* data, const float* scale, const float* offset, int64_t c0, int64_t c1,
                  int64_t n0, int64_t M, int64_t K, int64_t groups, float* out, int64_t N) {
  int64_t p = c0;
  for (; p + PT <= c1; p += PT)
    panel_tile<BITS, PT, L, ONE_GROUP>(r, data, scale, offset, p, n0, M, K, groups, p == c0, out, N);
  for (; p < c1; p++) panel_tile<BITS, 1, L, ONE_GROUP>(r, data, scale, offset, p, n0, M, K, groups, p == c0, out, N);
}

template <int BITS, bool ONE_GROUP>
void product_panels(const float* x, int64_t ldx, const uint8_t* data, const float* scale, const float* offset,
                    float* out, int64_t M, int64_t N, int64_t K, int64_t groups) {
  const Rows r = quantize_panels(x, ldx, M, K, groups);
  const int64_t panels = (M + PANEL - 1) / PANEL, bands = (N + PL - 1) / PL;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t first = bands * me / threads, last = bands * (me + 1) / threads;
    // a chunk of panels stays in L2 while the thread's weight rows pass by it
    for (int64_t c0 = 0; c0 < panels; c0 += CHUNK_PANELS) {
      const int64_t c1 = c0 + CHUNK_PANELS < panels ? c0 + CHUNK_PANELS : panels;
      for (int64_t t = first; t < last; t++) {
        const int64_t n0 = t * PL;
        if (n0 + PL <= N) {
          panel_column<BITS, PL, ONE_GROUP>(r, data, scale, offset, c0, c1, n0, M, K, groups, out, N);
        } else {
          for (int64_t n = n0; n < N; n++)
            panel_column<BITS, 1, ONE_GROUP>(r, data, scale, offset, c0, c1, n, M, K, groups, out, N);
        }
      }
    }
  }
}

// ---- the row tiling

template <int BITS>
void product(const float* x, int64_t ldx, const uint8_t* data, const float* scale, const float* offset, float* out,
             int64_t M, int64_t N, int64_t K, int64_t groups) {
  if constexpr (BITS == 4 || VNNI) {
    if (M >= PANEL_FROM_ROWS)
      return groups == 1 ? product_panels<BITS, true>(x, ldx, data, scale, offset, out, M, N, K, groups)
                         : product_panels<BITS, false>(x, ldx, data, scale, offset, out, M, N, K, groups);
  }
  const Rows rows = quantize(x, ldx, M, K, groups, BITS == 4);
  const int64_t bands = (N + LT - 1) / LT;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t first = bands * me / threads, last = bands * (me + 1) / threads;
    for (int64_t t = first; t < last; t++) {
      const int64_t n0 = t * LT;
      if (n0 + LT > N) {  // the last few weight rows, one at a time
        for (int64_t n = n0; n < N; n++) columns<BITS, 1>(rows, data, scale, offset, M, n, K, groups, out, N);
      } else if (M <= 2) {  // one or two rows: all LT weight rows at once, for more independent sums
        rows_of<BITS, 2, LT>((int)M, rows, data, scale, offset, 0, n0, K, groups, out, N);
      } else {
        for (int64_t n = n0; n < n0 + LT; n += LT / 2)
          columns<BITS, LT / 2>(rows, data, scale, offset, M, n, K, groups, out, N);
      }
    }
  }
}

}  // namespace

// x: [M, K] fp32 (row stride ldx), K a multiple of 32; data: uint8 codes in
// blocks, [N, K * bits / 8] contiguous; scale, offset: fp32 [N, groups]
// contiguous, K / groups a multiple of 32; out: [M, N] contiguous
#ifdef KV_VNNI
void kvexport_int8_linear_vnni(
#else
void kvexport_int8_linear_maddubs(
#endif
    const float* x, int64_t ldx, const uint8_t* data, const float* scale, const float* offset, float* out, int64_t M,
    int64_t N, int64_t K, int64_t groups, int64_t bits) {
  if (bits == 4)
    product<4>(x, ldx, data, scale, offset, out, M, N, K, groups);
  else
    product<8>(x, ldx, data, scale, offset, out, M, N, K, groups);
}

#ifndef KV_VNNI
void kvexport_int8_linear(const float* x, int64_t ldx, const uint8_t* data, const float* scale, const float* offset,
                          float* out, int64_t M, int64_t N, int64_t K, int64_t groups, int64_t bits) {
  static const bool vnni = has_vnni();
  (vnni ? kvexport_int8_linear_vnni : kvexport_int8_linear_maddubs)(x, ldx, data, scale, offset, out, M, N, K, groups,
                                                                   bits);
}
#endif
