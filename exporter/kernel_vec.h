// The 8-float vector helpers kvexport's CPU kernels share (row_kernel.cpp,
// attention_kernel.cpp): AVX2 with FMA, the AVX-512 builds included.

#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "kvexport's kernels need AVX2 with FMA"
#endif

typedef __m256 vec;

// the first n (1..8) floats at p, zeros after: never reads past p + n
static inline vec load_first(const float* p, int n) {
  static const int32_t mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i*)(mask + 8 - n)));
}

// the sum of the 8 lanes
static inline float total(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
