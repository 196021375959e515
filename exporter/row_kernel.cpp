// fp32 products of a few rows by a weight matrix, out[m, n] = sum_k x[m, k] * w[n, k],
// for AOTInductor packages on x86 CPUs (exporter/row_kernel.py builds it; the
// compiled methods call it through `aoti_torch_cpu_rows_linear`).
//
// Why not the BLAS: over 2-16 rows a step is bound by reading the weights once,
// but the BLAS's small-row GEMM reads them at half the memory's rate or less
// on some CPUs (bench/floor.py). Here each thread walks its own contiguous band
// of weight rows once; a register tile of MR input rows by NR weight rows does
// MR x NR vector FMAs per MR + NR loads, and the weight rows 8 rows ahead
// are prefetched into L2, so the reads overlap the arithmetic.
//
// The instruction set is the compiled package's (the build passes inductor's
// own -m flags). Vectors are 8 floats wide on both: with AVX-512 the tiles
// use its 32 registers (ymm16-31 through AVX512VL), not its wider vectors,
// which read the weights 5-10% slower for 1-4 rows on the AMD EPYC this was
// measured on (Zen 4 splits them in two), and no faster for 8.

#include <omp.h>

#include "kernel_vec.h"

#ifdef __AVX512VL__
constexpr int LANES = 8, REGISTERS = 32;
#else
constexpr int LANES = 8, REGISTERS = 16;
#endif
static inline vec load(const float* p) { return _mm256_loadu_ps(p); }
static inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec zero() { return _mm256_setzero_ps(); }

constexpr int64_t PREFETCH_ROWS = 8;  // how far ahead the weight rows are fetched into L2
constexpr int64_t BAND = 64;           // weight rows a thread takes at a time
constexpr int MR_MAX = REGISTERS == 32 ? 8 : 4;

// weight rows per tile: as many as leave registers for the loads
template <int MR>
constexpr int weight_rows() {
  return MR == 1 ? 8 : ((REGISTERS - 2) / (MR + 1) > 8 ? 8 : (REGISTERS - 2) / (MR + 1));
}

// MR rows of x (stride ldx) by NR rows of w (stride K) into out (stride N)
template <int MR, int NR>
static inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t N) {
  vec acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) acc[i][j] = zero();
  const float* ahead = w + PREFETCH_ROWS * K;
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    vec wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++) {
      wv[j] = load(w + j * K + k);
      _mm_prefetch((const char*)(ahead + j * K + k), _MM_HINT_T1);
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
    for (int j = 0; j < NR; j++) wv[j] = load_first(w + j * K + k, rest);
    for (int i = 0; i < MR; i++) {
      vec xv = load_first(x + i * ldx + k, rest);
      for (int j = 0; j < NR; j++) acc[i][j] = fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) out[i * N + j] = total(acc[i][j]);
}

// MR rows of x by weight rows [n0, n1)
template <int MR>
static void band(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = weight_rows<MR>();
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<MR, NR>(x, ldx, w + n * K, K, out + n, N);
  for (; n < n1; n++) tile<MR, 1>(x, ldx, w + n * K, K, out + n, N);
}

template <int MR>
static void band_of(int rows, const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t N, int64_t n0,
                    int64_t n1) {
  if constexpr (MR > 1) {
    if (rows < MR) return band_of<MR - 1>(rows, x, ldx, w, K, out, N, n0, n1);
  }
  band<MR>(x, ldx, w, K, out, N, n0, n1);
}

// x: [M, K] with row stride ldx; w: [N, K] contiguous; out: [M, N] contiguous
extern "C" void kvexport_rows_linear(const float* x, int64_t ldx, const float* w, float* out, int64_t M, int64_t N,
                                     int64_t K) {
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

#ifdef KVEXPORT_AOTI_SHIM
// The C shim AOTInductor's generated code calls for kvexport::rows_linear
// (passes/row_kernel_linear.py): returns a new [M, N] tensor, or an error for
// operands the kernel does not take (the compile guarantees them; this
// checks rather than trusts).
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

extern "C" AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                     AtenTensorHandle* ret0) {
  int64_t x_dims = 0, w_dims = 0;
  int32_t x_dtype = 0, w_dtype = 0;
  int64_t *x_sizes, *x_strides, *w_sizes, *w_strides;
  void *x_data, *w_data, *out_data;
  if (aoti_torch_get_dim(x, &x_dims) || aoti_torch_get_dim(weight, &w_dims) || x_dims != 2 || w_dims != 2)
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_get_dtype(x, &x_dtype) || aoti_torch_get_dtype(weight, &w_dtype) ||
      x_dtype != aoti_torch_dtype_float32() || w_dtype != aoti_torch_dtype_float32())
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_get_sizes(x, &x_sizes) || aoti_torch_get_strides(x, &x_strides) ||
      aoti_torch_get_sizes(weight, &w_sizes) || aoti_torch_get_strides(weight, &w_strides))
    return AOTI_TORCH_FAILURE;
  const int64_t M = x_sizes[0], K = x_sizes[1], N = w_sizes[0];
  if (w_sizes[1] != K || (K > 1 && (x_strides[1] != 1 || w_strides[1] != 1)) || (N > 1 && w_strides[0] != K) ||
      (M > 1 && x_strides[0] < K))
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_get_data_ptr(x, &x_data) || aoti_torch_get_data_ptr(weight, &w_data)) return AOTI_TORCH_FAILURE;
  const int64_t size[2] = {M, N}, stride[2] = {N, 1};
  AtenTensorHandle out;
  if (aoti_torch_empty_strided(2, size, stride, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, &out))
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_get_data_ptr(out, &out_data)) {
    aoti_torch_delete_tensor_object(out);
    return AOTI_TORCH_FAILURE;
  }
  if (M > 0 && N > 0) kvexport_rows_linear((const float*)x_data, M > 1 ? x_strides[0] : K, (const float*)w_data,
                                           (float*)out_data, M, N, K);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}
#endif
