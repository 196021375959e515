// Products of a few fp32 rows by a packed integer weight (passes/packed_weights.py:
// 4- or 8-bit codes in row lanes of int32 words, a float scale and offset per
// group), out[m, n] = sum_k x[m, k] * (scale[n, g(k)] * code[n, k] + offset[n, g(k)]),
// for AOTInductor packages on x86 CPUs (build.py builds it; the compiled methods
// call it through its shim in shims.cpp).
//
// Why: inductor's code for such a product unpacks every code again for every
// input row and multiplies in a reduction per row. Here a vector of words is
// loaded once; each lane is unpacked in registers (a shift, a mask and a
// convert) into 8 codes, which a register tile of MR input rows multiplies:
// the unpacking is paid once per MR rows, and codes are never written to
// memory. The products with the codes are summed per group and scaled once a
// group; the offsets multiply each row's sum over the group (computed once a
// call), so a code costs one FMA per row and no scale or offset of its own.
//
// A thread walks its own band of word rows; word row r holds weight rows
// r, R + r, 2R + r, ... (one per lane), so a tile of LT lanes makes LT output
// columns. The tile sizes follow the vector registers (vec.h).

#include <omp.h>

#include <vector>

#include "kernels.h"
#include "vec.h"

using namespace kv;

namespace {

constexpr int64_t PREFETCH_ROWS = 4;  // how far ahead word rows are fetched into L2
constexpr int MR_MAX = REGISTERS == 32 ? 8 : 4;

// lanes per tile for MR rows: the most (a power of two, up to 8) whose
// accumulators, the MR rows' vectors and three temporaries fit the registers
template <int MR>
constexpr int lanes_per_tile() {
  int lt = 8;
  while (lt > 1 && MR * lt + MR + 3 > REGISTERS) lt /= 2;
  return lt;
}

// lane LANE of 8 words: codes of BITS bits as int32
template <int BITS, int LANE>
inline __m256i codes_of(__m256i words) {
  const __m256i shifted = LANE ? _mm256_srli_epi32(words, BITS * LANE) : words;
  if constexpr (BITS * (LANE + 1) == 32) return shifted;  // the top lane: the shift cleared the rest
  return _mm256_and_si256(shifted, _mm256_set1_epi32((1 << BITS) - 1));
}

// lanes LANE0 + J.. of 8 words as float codes, each times the MR rows
template <int BITS, int MR, int LT, int LANE0, int J>
inline void multiply(__m256i words, const vec (&xv)[MR], vec (&acc)[MR][LT]) {
  const vec codes = _mm256_cvtepi32_ps(codes_of<BITS, LANE0 + J>(words));
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++) acc[i][J] = fma(xv[i], codes, acc[i][J]);
  if constexpr (J + 1 < LT) multiply<BITS, MR, LT, LANE0, J + 1>(words, xv, acc);
}

// MR input rows by lanes [LANE0, LANE0 + LT) of word row r, over all of K.
// Per group, the rows' products with the codes are summed first and scaled
// once; the offsets multiply the rows' group sums (xsum, [MR][groups]):
// sum_k x w = sum_g scale_g sum_{k in g} x code + sum_g offset_g sum_{k in g} x
template <int BITS, int MR, int LT, int LANE0>
inline void tile(const float* x, int64_t ldx, const float* xsum, const int32_t* row, const float* scale,
                 const float* offset, int64_t R, int64_t r, int64_t K, int64_t G, int64_t groups, float* out,
                 int64_t N) {
  vec sums[MR][LT];
  clear(sums);
  const int32_t* ahead = row + PREFETCH_ROWS * K;
  const int64_t lane_stride = R * groups;
  const float* s = scale + (LANE0 * R + r) * groups;  // lane j's scale of group g at s[j * lane_stride + g]
  for (int64_t g = 0; g < groups; g++) {
    vec acc[MR][LT];
    clear(acc);
    for (int64_t k = g * G; k < (g + 1) * G; k += LANES) {
      const __m256i words = _mm256_loadu_si256((const __m256i*)(row + k));
      prefetch_l2(ahead + k);
      vec xv[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; i++) xv[i] = load(x + i * ldx + k);
      multiply<BITS, MR, LT, LANE0, 0>(words, xv, acc);
    }
#pragma GCC unroll 8
    for (int j = 0; j < LT; j++) {
      const vec sj = broadcast(s[j * lane_stride + g]);
#pragma GCC unroll 8
      for (int i = 0; i < MR; i++) sums[i][j] = fma(acc[i][j], sj, sums[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < LT; j++) {
    const int64_t n = (LANE0 + j) * R + r;
    if (n >= N) break;  // padding rows of the last lanes
    const float* o = offset + n * groups;
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      float shift = 0.0f;
      for (int64_t g = 0; g < groups; g++) shift += o[g] * xsum[i * groups + g];
      out[i * N + n] = total(sums[i][j]) + shift;
    }
  }
}

// tiles of LT lanes from LANE0 on, while their weight rows exist
template <int BITS, int MR, int LT, int LANE0>
inline void lane_tiles(const float* x, int64_t ldx, const float* xsum, const int32_t* row, const float* scale,
                       const float* offset, int64_t R, int64_t r, int64_t K, int64_t G, int64_t groups, float* out,
                       int64_t N) {
  if (LANE0 * R + r >= N) return;
  tile<BITS, MR, LT, LANE0>(x, ldx, xsum, row, scale, offset, R, r, K, G, groups, out, N);
  if constexpr (LANE0 + LT < 32 / BITS)
    lane_tiles<BITS, MR, LT, LANE0 + LT>(x, ldx, xsum, row, scale, offset, R, r, K, G, groups, out, N);
}

// MR input rows by every lane of word row r
template <int BITS, int MR>
inline void word_row(const float* x, int64_t ldx, const float* xsum, const int32_t* words, const float* scale,
                     const float* offset, int64_t R, int64_t r, int64_t K, int64_t G, int64_t groups, float* out,
                     int64_t N) {
  constexpr int LANES_OF = 32 / BITS, LT = lanes_per_tile<MR>() < LANES_OF ? lanes_per_tile<MR>() : LANES_OF;
  lane_tiles<BITS, MR, LT, 0>(x, ldx, xsum, words + r * K, scale, offset, R, r, K, G, groups, out, N);
}

template <int BITS, int MR>
void rows_of(int rows, const float* x, int64_t ldx, const float* xsum, const int32_t* words, const float* scale,
             const float* offset, int64_t R, int64_t r, int64_t K, int64_t G, int64_t groups, float* out, int64_t N) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_of<BITS, MR - 1>(rows, x, ldx, xsum, words, scale, offset, R, r, K, G, groups, out, N);
  }
  word_row<BITS, MR>(x, ldx, xsum, words, scale, offset, R, r, K, G, groups, out, N);
}

template <int BITS>
void product(const float* x, int64_t ldx, const int32_t* words, const float* scale, const float* offset, float* out,
             int64_t M, int64_t N, int64_t K, int64_t R, int64_t groups) {
  const int64_t G = K / groups;
  std::vector<float> xsum(M * groups);  // each row's sum over each group, for the offsets
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      float sum = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; k++) sum += x[m * ldx + k];
      xsum[m * groups + g] = sum;
    }
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t first = R * me / threads, last = R * (me + 1) / threads;
    for (int64_t r = first; r < last; r++)
      for (int64_t m = 0; m < M; m += MR_MAX) {
        const int rows = (int)(M - m < MR_MAX ? M - m : MR_MAX);
        rows_of<BITS, MR_MAX>(rows, x + m * ldx, ldx, xsum.data() + m * groups, words, scale, offset, R, r, K, G, groups,
                              out + m * N, N);
      }
  }
}

}  // namespace

// x: [M, K] (row stride ldx); words: int32 [R, K] contiguous, lanes = 32 / bits;
// scale, offset: [lanes * R, groups] contiguous, K a multiple of 8 * groups;
// out: [M, N] contiguous, N <= lanes * R
void kvexport_packed_linear(const float* x, int64_t ldx, const int32_t* words, const float* scale,
                            const float* offset, float* out, int64_t M, int64_t N, int64_t K, int64_t R,
                            int64_t groups, int64_t bits) {
  if (bits == 4)
    product<4>(x, ldx, words, scale, offset, out, M, N, K, R, groups);
  else
    product<8>(x, ldx, words, scale, offset, out, M, N, K, R, groups);
}
