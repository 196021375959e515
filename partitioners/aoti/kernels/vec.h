// The vector vocabulary every kvexport CPU kernel is written in: 8-float
// vectors on x86 with AVX2 and FMA. The kernels say what they compute (load,
// fma, total, exp); only this file says how, so a kernel reads the same on
// every instruction set and a new one is a new section here.
//
// AVX-512 builds use the same 8-float vectors (AVX512VL gives them 32
// registers instead of 16): on the AMD EPYC the kernels were measured on, the
// 16-float vectors read weights 5-10% slower at 1-4 rows and no faster at 8
// (Zen 4 splits them in two). What differs by instruction set is the register
// count the tiles are sized by. (The exceptions, bound by arithmetic, not
// reads: rows_linear.cpp's vdpbf16ps tiles of 4 rows or more and
// int8_linear.cpp's VNNI tiles of 2 rows or more are 512-bit.)

#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "kvexport's kernels need AVX2 with FMA"
#endif

namespace kv {

typedef __m256 vec;
constexpr int LANES = 8;
#ifdef __AVX512VL__
constexpr int REGISTERS = 32;
#else
constexpr int REGISTERS = 16;
#endif

static inline vec zero() { return _mm256_setzero_ps(); }
// every vector of a register tile set to 0
template <int A, int B>
static inline void clear(vec (&tile)[A][B]) {
#pragma GCC unroll 8
  for (int i = 0; i < A; i++)
#pragma GCC unroll 8
    for (int j = 0; j < B; j++) tile[i][j] = zero();
}
static inline vec broadcast(float x) { return _mm256_set1_ps(x); }
static inline vec load(const float* p) { return _mm256_loadu_ps(p); }
static inline void store(float* p, vec a) { _mm256_storeu_ps(p, a); }

// the lanes below n (0..8) set, the rest clear
static inline __m256i first_lanes(int n) {
  static const int32_t mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256((const __m256i*)(mask + 8 - n));
}
// the first n (1..8) floats at p, zeros after: never reads past p + n
static inline vec load_first(const float* p, int n) { return _mm256_maskload_ps(p, first_lanes(n)); }
// writes the first n (1..8) lanes of a to p: never writes past p + n
static inline void store_first(float* p, vec a, int n) { _mm256_maskstore_ps(p, first_lanes(n), a); }
// a with its lanes from n on cleared
static inline vec keep_first(vec a, int n) { return _mm256_and_ps(a, _mm256_castsi256_ps(first_lanes(n))); }

static inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }    // a * b + c
static inline vec fnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b

// the sum of the 8 lanes
static inline float total(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// scale times the sums of four vectors' lanes, to out[0..3], in one pass
static inline void total4(vec a0, vec a1, vec a2, vec a3, float scale, float* out) {
  const vec pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
  _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
}

// e^x for x <= 0 (scores minus their max): 2^n * p(r) with r = x - n ln 2,
// the polynomial of Cephes' expf (about 1 ulp); under -87 it is 0
static inline vec exp_nonpositive(vec x) {
  const vec low = broadcast(-87.0f);
  const vec underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = max(x, low);
  const vec n = _mm256_round_ps(mul(x, broadcast(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = fnma(n, broadcast(0.693359375f), x);
  r = fnma(n, broadcast(-2.12194440e-4f), r);
  vec p = broadcast(1.9875691500e-4f);
  p = fma(p, r, broadcast(1.3981999507e-3f));
  p = fma(p, r, broadcast(8.3334519073e-3f));
  p = fma(p, r, broadcast(4.1665795894e-2f));
  p = fma(p, r, broadcast(1.6666665459e-1f));
  p = fma(p, r, broadcast(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, broadcast(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, mul(p, _mm256_castsi256_ps(scale)));
}

// 8 bf16 values at p as floats (a bf16 is a float's upper half)
static inline vec load(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// the first n (1..8) bf16 values at p, zeros after: never reads past p + n
static inline vec load_first(const uint16_t* p, int n) {
  uint16_t part[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; i++) part[i] = p[i];
  return load(part);
}

// 8 fp16 values at p as floats (F16C: every AVX2 CPU has it)
static inline vec load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// VNNI, where a build has it (build.py compiles int8_linear.cpp a second
// time with it): acc + the sums of 4 products of unsigned bytes u by signed
// bytes s in each int32 lane (vpdpbusd), exact
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
// whether this CPU has the VNNI of this build's instruction set
static inline bool has_vnni() {
#ifdef __AVX512VL__
  return __builtin_cpu_supports("avx512vnni");
#else
  return __builtin_cpu_supports("avxvnni");
#endif
}

// whether this CPU has AVX512-BF16's vdpbf16ps and this build's instruction
// set can call it (build.py compiles rows_linear.cpp a second time with it for
// AVX-512 only)
static inline bool has_bf16_dot() {
#ifdef __AVX512VL__
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// fetches the cache line at p into L2 ahead of its use: weights streamed a
// few rows ahead overlap the reads with the arithmetic (T0 and NTA hints
// measured slower). Written as an asm statement: GCC counts _mm_prefetch as
// no effect at all and deletes a loop that only prefetches (it deleted every
// prefetch of int8_linear.cpp's tiles once they moved into such a loop, and
// the products from memory ran 1.2 x slower). The statement takes the address
// ("p", printed as one by %a0), not the memory at it: an "m" operand tells
// GCC the statement reads a char there, which may be any object, so a loop
// kept a register tile's accumulators in memory as well, storing each at
// every step (rows_linear.cpp's 8-row tiles ran 1.6-1.8 x slower)
static inline void prefetch_l2(const void* p) { __asm__ volatile("prefetcht1 %a0" : : "p"(p)); }

}  // namespace kv
