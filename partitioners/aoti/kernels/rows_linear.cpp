// Products of a few rows by a weight matrix, out[m, n] = sum_k x[m, k] *
// w[n, k] accumulated in fp32, for AOTInductor packages on x86 CPUs (build.py
// builds it; the compiled methods call it through its shim in shims.cpp):
// fp32 rows by an fp32 weight, or bf16 rows by a bf16 weight (read as bf16,
// half the bytes; the shim rounds the result to bf16 as torch's linear does).
//
// Why not the BLAS: over 2-16 rows a step is bound by reading the weights once,
// but the BLAS's small-row GEMM reads them at half the memory's rate or less
// on some CPUs (bench/floor.py). Here each thread walks its own contiguous band
// of weight rows once; a register tile of MR input rows by NR weight rows does
// MR x NR vector FMAs per MR + NR loads, and the weight rows 8 rows ahead
// are prefetched into L2, so the reads overlap the arithmetic.
//
// bf16 products: widened in registers (a shift) and multiplied by fp32 FMAs,
// 8 products an instruction; or, in this file's second build (KV_BF16, for
// CPUs with AVX512-BF16, which the first build's entry calls from 3 rows
// where the CPU has it), by vdpbf16ps: 16 products of bf16 pairs an
// instruction (32 in the 512-bit tiles of 4 rows or more), each pair summed
// into an fp32 lane. Both products of bf16 values are exact in fp32; the two
// builds differ only in the order of the fp32 sums.
//
// The instruction set is the compiled package's (the build passes inductor's
// own -m flags); the tiles are sized by its vector registers (vec.h).

#include <omp.h>

#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

using namespace kv;

constexpr int64_t PREFETCH_ROWS = 8;  // how far ahead the weight rows are fetched into L2
// Every tile prefetches, whatever its row count. Over one fp32 row the
// prefetch once measured 15-30% slower on an AVX-512 AMD EPYC; measured again
// on the same kind of machine (one binary with both forms, alternating, six
// runs, a SmolLM2 step's products), it was 8-22% faster with AVX-512 code and
// with AVX2 code, and bf16 tiles were 1.4-1.7 x faster with it.
constexpr int64_t BAND = 64;           // weight rows a thread takes at a time
// vdpbf16ps tiles of this many rows or more take 512-bit vectors: 32 products
// an instruction. Over every linear of a SmolLM2 bf16 step (a scratch A/B,
// both builds in one process, alternating) they ran on Zen 4, which splits a
// 512-bit instruction in two, 0.83-0.92 x the time of 256-bit tiles at 4-6
// rows with the weights in cache and 0.92-0.98 x at 8-16 rows from memory
// (1.01-1.04 x at 4-6 rows from memory); over one row the reads bound the step.
// (An earlier A/B that kept Zen 4 on 256-bit tiles timed both with every
// accumulator stored at every step, which vec.h's prefetch_l2 now avoids.)
constexpr int WIDE_FROM = 4;
// Rows a tile takes at most: 8 with 32 registers (8 x 3 tiles), 4 with 16
// (4 x 3: 12 accumulators, 3 weight rows and an x row fill the 16), where 8
// rows take two passes over each band, the second from L2. 8 x 1 tiles, which
// AVX2 took before, load their 8 x rows again for every weight row, from L2
// once they outgrow L1 (8 rows of a 1B model's 2048 floats are 64 KB), and
// keep only 8 accumulators in flight. Over a Llama 3.2 1B layer's products
// from memory on a Zen 4 (bench/ab_kernels.py --isa avx2), 4 x 3 tiles took
// 0.56-0.70 x the time of 8 x 1 ones at 8 and 16 rows, fp32 and bf16, and
// 0.86 x the time of 4 x 2 ones at 4 bf16 rows (fp32: 1.04); over
// SmolLM2-sized products 0.86-0.96 x at 8-16 rows. 8 x 1 tiles walking K in
// L1-sized slices took 0.57-0.67 x for fp32 (0.91-1.00 x for bf16), and 4 x 3
// ones beat them by 1.10 x (fp32) and 1.29 x (bf16) at 8 rows.
constexpr int MR_MAX = REGISTERS == 16 ? 4 : 8;

// weight rows per tile: as many as leave a register for the x row
template <int MR>
constexpr int weight_rows() {
  return MR == 1 ? 8 : ((REGISTERS - 1) / (MR + 1) > 8 ? 8 : (REGISTERS - 1) / (MR + 1));
}

// acc plus the products of MR x rows by NR weight rows over the vector steps
// from k, every STRIDE-th (the last one loaded masked if K ends within it),
// each weight row's line fetched PREFETCH_ROWS rows ahead
template <int STRIDE, int MR, int NR, typename TX, typename TW>
static inline void steps(const TX* x, int64_t ldx, const TW* w, int64_t K, int64_t k, vec (&acc)[MR][NR]) {
  const TW* ahead = w + PREFETCH_ROWS * K;
  for (; k + LANES <= K; k += STRIDE * LANES) {
    vec wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) {
      wv[j] = load(w + j * K + k);
      prefetch_l2(ahead + j * K + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      vec xv = load(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; j++) acc[i][j] = fma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const int rest = (int)(K - k);
    vec wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) wv[j] = load_first(w + j * K + k, rest);
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      vec xv = load_first(x + i * ldx + k, rest);
#pragma GCC unroll 8
      for (int j = 0; j < NR; j++) acc[i][j] = fma(xv, wv[j], acc[i][j]);
    }
  }
}

// MR rows of x (stride ldx) by NR rows of w (stride K) into out (stride N).
// Every loop over the accumulators is unrolled, the tail's and the sums' too:
// with the sums' loop rolled, GCC keeps the tile in memory as well, stores it
// after the products and reads it back for the sums (8 rows of a bf16 step's
// products ran 1.16 x slower in cache, 1.06 x from memory)
template <int MR, int NR, typename TX, typename TW>
static inline void tile(const TX* x, int64_t ldx, const TW* w, int64_t K, float* out, int64_t N) {
  vec acc[MR][NR];
  clear(acc);
  int64_t k = 0;
  // One row (a batch-1 step, where the reads bound the time; weight rows of
  // SHORT_ROW_BYTES or more, shorter ones go row_by_row below): each weight
  // vector goes into its FMA as it is loaded, and each weight row's cache
  // line is prefetched once. Loading a step's NR weight vectors first, as
  // steps() does, took 17 of AVX2's 16 registers over bf16 (8
  // accumulators, 8 widened weights, x), so GCC kept an accumulator on the
  // stack, stored and read back every step; and a prefetch per vector asked
  // for each line 2 (fp32) or 4 (bf16) times. Over a Llama 3.2 1B layer's
  // products from memory on a Zen 3 (bench/ab_kernels.py --isa avx2 --rows
  // 1) this took 0.90 x the time for bf16 and 0.95 x for fp32; with the
  // weight in cache 0.76 and 0.80 x. Tiles of more rows reuse each loaded
  // weight vector MR times, and prefetching once a line measured 1.03-1.06 x
  // slower for them (bf16 at 2-8 rows), so they keep steps().
  if constexpr (MR == 1) {
    constexpr int STEPS = 64 / (LANES * sizeof(TW));  // vectors a weight row's cache line holds
    const TW* ahead = w + PREFETCH_ROWS * K;
    for (; k + STEPS * LANES <= K; k += STEPS * LANES) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; j++) prefetch_l2(ahead + j * K + k);
#pragma GCC unroll 4
      for (int s = 0; s < STEPS; s++) {
        const vec xv = load(x + k + s * LANES);
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) acc[0][j] = fma(xv, load(w + j * K + k + s * LANES), acc[0][j]);
      }
    }
  }
  steps<1>(x, ldx, w, K, k, acc);
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) out[i * N + j] = total(acc[i][j]);
}

// Weight rows shorter than this many bytes sum each product's vector steps
// in two accumulators, the even steps' and the odd ones', added before the
// lanes' total; a single x row walks them one weight row at a time
// (row_by_row), every tile of more rows in two passes (tile_halves): the same
// sums in the same order, so a row's outputs do not depend on the rows
// batched with it. On a Zen 3 (AVX2), one row's 8-row tile read SmolLM2's
// bf16 rows of 576 values (1152 bytes: 8 interleaved streams of 18 lines)
// slower than one stream a thread: a SmolLM2 bf16 batch-1 step took 0.855
// and 0.89 x the time (two bench/ab_decode.py runs; 8 sessions 1.005 and
// 0.986 x), its 1536 x 576 and 576 x 576 products alone 0.88-0.95 x (2 and
// 8 rows: 1.05 x). One accumulator a row, as the tile keeps, capped one row
// at its FMAs' latency (27 GB/s on two cores with the weight in cache); two
// lift that to 38. Two streams a thread (two weight rows, or a row's two
// halves) gained nothing, and longer rows (fp32 K 576, bf16 K 1536, the 1B
// shape's K 2048 and 8192) ran 1.09-1.20 x slower one at a time: they keep
// the tile.
constexpr int64_t SHORT_ROW_BYTES = 2048;

// tile's product over short weight rows: the even steps' sums, then the odd
// ones', added (row_by_row's order)
template <int MR, int NR, typename TX, typename TW>
static inline void tile_halves(const TX* x, int64_t ldx, const TW* w, int64_t K, float* out, int64_t N) {
  vec even[MR][NR], odd[MR][NR];
  clear(even);
  clear(odd);
  steps<2>(x, ldx, w, K, 0, even);
  steps<2>(x, ldx, w, K, LANES, odd);
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) out[i * N + j] = total(add(even[i][j], odd[i][j]));
}

// one x row by short weight rows [n0, n1), one weight row at a time, in
// address order: the even steps' products into one accumulator, the odd
// ones' into another; each cache line of the row PREFETCH_ROWS ahead fetched once
template <typename TX, typename TW>
static void row_by_row(const TX* x, const TW* w, int64_t K, float* out, int64_t n0, int64_t n1) {
  constexpr int LINE = 64 / (LANES * sizeof(TW));  // vectors a cache line holds
  constexpr int STEPS = LINE < 2 ? 2 : LINE;       // vectors an iteration takes, an even count
  for (int64_t n = n0; n < n1; n++) {
    const TW* row = w + n * K;
    const TW* ahead = row + PREFETCH_ROWS * K;
    vec acc[2] = {zero(), zero()};
    int64_t k = 0;
    for (; k + STEPS * LANES <= K; k += STEPS * LANES) {
#pragma GCC unroll 4
      for (int s = 0; s < STEPS; s += LINE) prefetch_l2(ahead + k + s * LANES);
#pragma GCC unroll 4
      for (int s = 0; s < STEPS; s++) acc[s % 2] = fma(load(x + k + s * LANES), load(row + k + s * LANES), acc[s % 2]);
    }
    for (int s = 0; k < K; s++, k += LANES) {
      const int rest = (int)(K - k);
      acc[s % 2] = rest >= LANES ? fma(load(x + k), load(row + k), acc[s % 2])
                                 : fma(load_first(x + k, rest), load_first(row + k, rest), acc[s % 2]);
    }
    out[n] = total(add(acc[0], acc[1]));
  }
}

#if defined(KV_BF16) && defined(__AVX512BF16__)
// vdpbf16ps at two widths: Dot256 takes 16 bf16 values a vector (8 pairs,
// each summed into an fp32 lane), Dot512 32; `first` loads the first n
// values at p, zeros after, never reading past p + n
struct Dot256 {
  typedef __m256 acc;
  typedef __m256bh pairs;
  static constexpr int VALUES = 16;
  static acc zero() { return _mm256_setzero_ps(); }
  static pairs load(const uint16_t* p) { return (pairs)_mm256_loadu_si256((const __m256i*)p); }
  static pairs first(const uint16_t* p, int64_t n) { return (pairs)_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p); }
  static acc dot(acc a, pairs x, pairs w) { return _mm256_dpbf16_ps(a, x, w); }
  static float sum(acc a) { return total(a); }
};
struct Dot512 {
  typedef __m512 acc;
  typedef __m512bh pairs;
  static constexpr int VALUES = 32;
  static acc zero() { return _mm512_setzero_ps(); }
  static pairs load(const uint16_t* p) { return (pairs)_mm512_loadu_si512((const void*)p); }
  static pairs first(const uint16_t* p, int64_t n) { return (pairs)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p); }
  static acc dot(acc a, pairs x, pairs w) { return _mm512_dpbf16_ps(a, x, w); }
  static float sum(acc a) { return _mm512_reduce_add_ps(a); }
};

// the same over bf16 rows and weight rows with vdpbf16ps, D's values a
// vector, the last K % D::VALUES loaded masked
template <typename D, int MR, int NR>
static inline void tile_dot(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out, int64_t N) {
  typename D::acc acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) acc[i][j] = D::zero();
  const uint16_t* ahead = w + PREFETCH_ROWS * K;
  int64_t k = 0;
  for (; k + D::VALUES <= K; k += D::VALUES) {
    typename D::pairs wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) {
      wv[j] = D::load(w + j * K + k);
      prefetch_l2(ahead + j * K + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      const typename D::pairs xv = D::load(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; j++) acc[i][j] = D::dot(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {
    typename D::pairs wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) wv[j] = D::first(w + j * K + k, K - k);
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      const typename D::pairs xv = D::first(x + i * ldx + k, K - k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; j++) acc[i][j] = D::dot(acc[i][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) out[i * N + j] = D::sum(acc[i][j]);
}
constexpr bool DOT = true;
#else
struct Dot256 {};
struct Dot512 {};
template <typename D, int MR, int NR>
static inline void tile_dot(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t) {}
constexpr bool DOT = false;
#endif

// MR rows of x by weight rows [n0, n1)
template <int MR, typename TX, typename TW>
static void band(const TX* x, int64_t ldx, const TW* w, int64_t K, float* out, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = weight_rows<MR>();
  int64_t n = n0;
  if constexpr (DOT && sizeof(TX) == 2) {
    typedef std::conditional_t<MR >= WIDE_FROM, Dot512, Dot256> D;
    for (; n + NR <= n1; n += NR) tile_dot<D, MR, NR>(x, ldx, w + n * K, K, out + n, N);
    for (; n < n1; n++) tile_dot<D, MR, 1>(x, ldx, w + n * K, K, out + n, N);
  } else if (K * (int64_t)sizeof(TW) < SHORT_ROW_BYTES) {
    if constexpr (MR == 1) {
      row_by_row(x, w, K, out, n0, n1);
    } else {
      for (; n + NR <= n1; n += NR) tile_halves<MR, NR>(x, ldx, w + n * K, K, out + n, N);
      for (; n < n1; n++) tile_halves<MR, 1>(x, ldx, w + n * K, K, out + n, N);
    }
  } else {
    for (; n + NR <= n1; n += NR) tile<MR, NR>(x, ldx, w + n * K, K, out + n, N);
    for (; n < n1; n++) tile<MR, 1>(x, ldx, w + n * K, K, out + n, N);
  }
}

template <int MR, typename TX, typename TW>
static void band_of(int rows, const TX* x, int64_t ldx, const TW* w, int64_t K, float* out, int64_t N, int64_t n0,
                    int64_t n1) {
  if constexpr (MR > 1) {
    if (rows < MR) return band_of<MR - 1>(rows, x, ldx, w, K, out, N, n0, n1);
  }
  band<MR>(x, ldx, w, K, out, N, n0, n1);
}

template <typename TX, typename TW>
static void product(const TX* x, int64_t ldx, const TW* w, float* out, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel
  {
    // an even share of the weight rows per thread, in whole groups of 8, walked
    // in bands small enough that every row tile of x reuses them from cache
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num(), groups = (N + 7) / 8;
    const int64_t first = groups * me / threads * 8, last = groups * (me + 1) / threads * 8;
    for (int64_t n0 = first; n0 < last && n0 < N; n0 += BAND) {
      const int64_t n1 = n0 + BAND < last ? n0 + BAND : (last < N ? last : N);
      for (int64_t m = 0; m < M; m += MR_MAX) {
        const int rows = (int)(M - m < MR_MAX ? M - m : MR_MAX);
        band_of<MR_MAX>(rows, x + m * ldx, ldx, w, K, out + m * N, N, n0, n1);
      }
    }
  }
}

// x: [M, K] with row stride ldx; w: [N, K] contiguous; out: [M, N] contiguous
#ifdef KV_BF16
void kvexport_rows_linear_bf16_dot(const uint16_t* x, int64_t ldx, const uint16_t* w, float* out, int64_t M, int64_t N,
                                   int64_t K) {
  product(x, ldx, w, out, M, N, K);
}
#else
void kvexport_rows_linear(const float* x, int64_t ldx, const float* w, float* out, int64_t M, int64_t N, int64_t K) {
  product(x, ldx, w, out, M, N, K);
}

// the same with x and w in bf16 (their raw 16-bit values). x is widened to
// fp32 once, so a tile loads its rows as they are and only the weight takes a
// shift (one widening for 8 FMAs, where a 4 x 2 tile widened 6 for 8). The products and
// their fp32 sums are those of x widened in the tile.
void kvexport_rows_linear_bf16_shift(const uint16_t* x, int64_t ldx, const uint16_t* w, float* out, int64_t M, int64_t N,
                                     int64_t K) {
  std::vector<float> wide((size_t)(M * K));
  for (int64_t m = 0; m < M; m++) {
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) store(wide.data() + m * K + k, load(x + m * ldx + k));
    if (k < K) store_first(wide.data() + m * K + k, load_first(x + m * ldx + k, (int)(K - k)), (int)(K - k));
  }
  product(wide.data(), K, w, out, M, N, K);
}

// the vdpbf16ps build where this CPU has it (and the package's build can hold
// it) from this many rows; fewer take the shift. Over one and two rows, where
// the weight's reads bound the step, the shift read a Llama 3.2 1B layer's
// bf16 weights faster on a Zen 4 (AVX-512 code: 0.97 and 0.93 x the time,
// bench/ab_kernels.py --rows 1,2,3 --dtype bf16); from 3 rows the two ran
// level, and from 4 the dot products' 512-bit tiles won (1.2-1.5 x at 8 rows
// in a scratch A/B of the two forms).
constexpr int64_t DOT_FROM_ROWS = 3;

void kvexport_rows_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, float* out, int64_t M, int64_t N,
                               int64_t K) {
  static const bool dot = has_bf16_dot();
  (dot && M >= DOT_FROM_ROWS ? kvexport_rows_linear_bf16_dot : kvexport_rows_linear_bf16_shift)(x, ldx, w, out, M, N, K);
}
#endif
