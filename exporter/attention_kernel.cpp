// Attention of a few query rows over a cell pool through the contract's mask,
// reading only the cells each row may see, for AOTInductor packages on x86
// CPUs (exporter/row_kernel.py builds it with the row kernel; the compiled
// forward_<N> methods call it through `aoti_torch_cpu_masked_attention`).
//
// Why not sdpa: sdpa scores every row against every cell of the pool view and
// then masks. With 8 sessions in one step each row sees its own session's
// cells, an eighth of the view, so 7/8 of that work is thrown away; with one
// session sdpa's per-head matrix products cost more in call overhead than the
// few hundred dot products do. Here each (row, kv head) task gathers the row's
// visible cells once, and every query head of the group scores them, takes an
// exact softmax (max-subtracted, a vectorized exp) and sums the values.
//
// Semantics are sdpa's with a boolean mask and GQA: out[h, t] =
// softmax(scale * q[h, t] . k[h / G, c] over visible c) . v[h / G, c];
// a row that sees no cell gets zeros, as torch's CPU sdpa gives.

#include <omp.h>

#include <cmath>
#include <vector>

#include "kernel_vec.h"

namespace {

// e^x for x <= 0 (scores minus their max): 2^n * p(r) with r = x - n ln 2,
// the polynomial of Cephes' expf (about 1 ulp); under -87 it is 0
inline vec exp_nonpositive(vec x) {
  const vec low = _mm256_set1_ps(-87.0f);
  const vec underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  vec p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

inline float dot(const float* a, const float* b, int64_t D) {
  vec s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  for (; d < D; d += 8) {
    const int n = D - d < 8 ? (int)(D - d) : 8;
    s0 = _mm256_fmadd_ps(load_first(a + d, n), load_first(b + d, n), s0);
  }
  return total(_mm256_add_ps(s0, s1));
}

// scale * q . k for four cells at once: four independent FMA chains, summed
// across lanes together
inline void dot4(const float* q, const float* k, const int64_t* cells, int64_t k_sc, int64_t D, float scale,
                 float* out) {
  const float* rows[4] = {k + cells[0] * k_sc, k + cells[1] * k_sc, k + cells[2] * k_sc, k + cells[3] * k_sc};
  vec a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const int n = D - d < 8 ? (int)(D - d) : 8;
    const vec qv = n == 8 ? _mm256_loadu_ps(q + d) : load_first(q + d, n);
    a0 = _mm256_fmadd_ps(qv, n == 8 ? _mm256_loadu_ps(rows[0] + d) : load_first(rows[0] + d, n), a0);
    a1 = _mm256_fmadd_ps(qv, n == 8 ? _mm256_loadu_ps(rows[1] + d) : load_first(rows[1] + d, n), a1);
    a2 = _mm256_fmadd_ps(qv, n == 8 ? _mm256_loadu_ps(rows[2] + d) : load_first(rows[2] + d, n), a2);
    a3 = _mm256_fmadd_ps(qv, n == 8 ? _mm256_loadu_ps(rows[3] + d) : load_first(rows[3] + d, n), a3);
  }
  const vec pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
  _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
}

}  // namespace

// q[h, t, d] at q + h * q_sh + t * q_st + d (likewise k, v over [kv head, cell, d]),
// mask[t, c] at mask + t * m_st + c * m_sc, out [H, T, D] contiguous
extern "C" void kvexport_masked_attention(const float* q, int64_t q_sh, int64_t q_st, const float* k, int64_t k_sh,
                                          int64_t k_sc, const float* v, int64_t v_sh, int64_t v_sc, const bool* mask,
                                          int64_t m_st, int64_t m_sc, float* out, int64_t H, int64_t Hkv, int64_t T,
                                          int64_t C, int64_t D, float scale) {
  const int64_t group = H / Hkv;
#pragma omp parallel
  {
    std::vector<int64_t> cells(C);
    std::vector<float> p(C + 8);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * Hkv; task++) {
      const int64_t t = task / Hkv, kvh = task % Hkv;
      int64_t n = 0;
      for (int64_t c = 0; c < C; c++)
        if (mask[t * m_st + c * m_sc]) cells[n++] = c;
      const float* kh = k + kvh * k_sh;
      const float* vh = v + kvh * v_sh;
      for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
        float* o = out + (h * T + t) * D;
        if (n == 0) {
          for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
          continue;
        }
        const float* qh = q + h * q_sh + t * q_st;
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) dot4(qh, kh, cells.data() + j, k_sc, D, scale, &p[j]);
        for (; j < n; j++) p[j] = scale * dot(qh, kh + cells[j] * k_sc, D);
        float top = -INFINITY;
        for (j = 0; j < n; j++) top = p[j] > top ? p[j] : top;
        vec sum = _mm256_setzero_ps();
        const vec shift = _mm256_set1_ps(top);
        for (j = 0; j + 8 <= n; j += 8) {
          const vec e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&p[j]), shift));
          _mm256_storeu_ps(&p[j], e);
          sum = _mm256_add_ps(sum, e);
        }
        if (j < n) {
          const int rest = (int)(n - j);
          vec e = exp_nonpositive(_mm256_sub_ps(load_first(&p[j], rest), shift));
          e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rest),
                                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
          _mm256_storeu_ps(&p[j], e);
          sum = _mm256_add_ps(sum, e);
        }
        const vec inverse = _mm256_set1_ps(1.0f / total(sum));
        // the values' weighted sum, 64 dims at a time in 8 registers
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          vec a[8];
          for (int b = 0; b < 8; b++) a[b] = _mm256_setzero_ps();
          if (D - d0 >= 64) {
            for (int64_t i = 0; i < n; i++) {
              const vec w = _mm256_set1_ps(p[i]);
              const float* row = vh + cells[i] * v_sc + d0;
#pragma GCC unroll 8
              for (int b = 0; b < 8; b++) a[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * b), a[b]);
            }
            for (int b = 0; b < 8; b++) _mm256_storeu_ps(o + d0 + 8 * b, _mm256_mul_ps(a[b], inverse));
          } else {
            const int blocks = (int)((D - d0 + 7) / 8);
            for (int64_t i = 0; i < n; i++) {
              const vec w = _mm256_set1_ps(p[i]);
              const float* row = vh + cells[i] * v_sc + d0;
              for (int b = 0; b < blocks; b++) {
                const int width = D - d0 - 8 * b < 8 ? (int)(D - d0 - 8 * b) : 8;
                a[b] = _mm256_fmadd_ps(w, load_first(row + 8 * b, width), a[b]);
              }
            }
            for (int b = 0; b < blocks; b++) {
              alignas(32) float lanes[8];
              _mm256_store_ps(lanes, _mm256_mul_ps(a[b], inverse));
              for (int64_t d = d0 + 8 * b; d < D && d < d0 + 8 * b + 8; d++) o[d] = lanes[d - d0 - 8 * b];
            }
          }
        }
      }
    }
  }
}

#ifdef KVEXPORT_AOTI_SHIM
// The C shim for kvexport::masked_attention (passes/masked_attention.py):
// query [1, H, T, D], key and value [1, Hkv, C, D] (views of the pools, any
// strides with unit stride along D), mask [T, C] bool; returns [1, H, T, D].
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

// Rows that see most of the view in common (one session's rows, T >= 4) are
// faster through sdpa's blocked products (bench/attention_kernels.py: 8 rows
// over 1024 cells, 0.23 ms against 0.29): the kernel pays for each row alone.
constexpr int64_t DENSE_MIN_ROWS = 4;

static bool dense(const void* mask, const int64_t* strides, int64_t T, int64_t C) {
  int64_t visible = 0;
  for (int64_t t = 0; t < T; t++) {
    const uint8_t* row = (const uint8_t*)mask + t * strides[0];
    if (strides[1] == 1) {
      for (int64_t c = 0; c < C; c++) visible += row[c];  // vectorized
    } else {
      for (int64_t c = 0; c < C; c++) visible += row[c * strides[1]];
    }
  }
  return 2 * visible > T * C;
}

// torch's own CPU sdpa (the call inductor makes for sdpa), with the mask as
// the additive float mask it takes, into out
static AOTITorchError attend_with_sdpa(AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
                                       const void* mask, const int64_t* strides, int64_t T, int64_t C, double scale,
                                       AtenTensorHandle out) {
  const int64_t size[2] = {T, C}, stride[2] = {C, 1};
  AtenTensorHandle additive, result = nullptr, logsumexp = nullptr;
  void* data;
  if (aoti_torch_empty_strided(2, size, stride, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, &additive))
    return AOTI_TORCH_FAILURE;
  AOTITorchError error = aoti_torch_get_data_ptr(additive, &data);
  if (!error) {
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = 0; c < C; c++)
        ((float*)data)[t * C + c] = ((const bool*)mask)[t * strides[0] + c * strides[1]] ? 0.0f : -INFINITY;
    error = aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, 0, &additive, &scale,
                                                                     &result, &logsumexp);
  }
  if (!error) error = aoti_torch_copy_(out, result, 0);
  for (AtenTensorHandle t : {additive, result, logsumexp})
    if (t) aoti_torch_delete_tensor_object(t);
  return error;
}

extern "C" AOTITorchError aoti_torch_cpu_masked_attention(AtenTensorHandle query, AtenTensorHandle key,
                                                          AtenTensorHandle value, AtenTensorHandle mask, double scale,
                                                          AtenTensorHandle* ret0) {
  AtenTensorHandle operands[4] = {query, key, value, mask};
  int64_t *sizes[4], *strides[4];
  void* data[4];
  for (int i = 0; i < 4; i++) {
    int64_t dims = 0;
    int32_t dtype = 0;
    if (aoti_torch_get_dim(operands[i], &dims) || dims != (i == 3 ? 2 : 4)) return AOTI_TORCH_FAILURE;
    if (aoti_torch_get_dtype(operands[i], &dtype) ||
        dtype != (i == 3 ? aoti_torch_dtype_bool() : aoti_torch_dtype_float32()))
      return AOTI_TORCH_FAILURE;
    if (aoti_torch_get_sizes(operands[i], &sizes[i]) || aoti_torch_get_strides(operands[i], &strides[i]) ||
        aoti_torch_get_data_ptr(operands[i], &data[i]))
      return AOTI_TORCH_FAILURE;
  }
  const int64_t H = sizes[0][1], T = sizes[0][2], D = sizes[0][3], Hkv = sizes[1][1], C = sizes[1][2];
  if (sizes[0][0] != 1 || sizes[1][0] != 1 || sizes[2][0] != 1 || Hkv < 1 || H % Hkv || sizes[1][3] != D ||
      sizes[2][1] != Hkv || sizes[2][2] != C || sizes[2][3] != D || sizes[3][0] != T || sizes[3][1] != C)
    return AOTI_TORCH_FAILURE;
  if (D > 1 && (strides[0][3] != 1 || strides[1][3] != 1 || strides[2][3] != 1)) return AOTI_TORCH_FAILURE;
  const int64_t size[4] = {1, H, T, D}, stride[4] = {H * T * D, T * D, D, 1};
  AtenTensorHandle out;
  void* out_data;
  if (aoti_torch_empty_strided(4, size, stride, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, &out))
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_get_data_ptr(out, &out_data)) {
    aoti_torch_delete_tensor_object(out);
    return AOTI_TORCH_FAILURE;
  }
  if (T >= DENSE_MIN_ROWS && dense(data[3], strides[3], T, C)) {
    const AOTITorchError error = attend_with_sdpa(query, key, value, data[3], strides[3], T, C, scale, out);
    if (error) aoti_torch_delete_tensor_object(out);
    else *ret0 = out;
    return error;
  }
  if (H > 0 && T > 0 && D > 0)
    kvexport_masked_attention((const float*)data[0], strides[0][1], strides[0][2], (const float*)data[1], strides[1][1],
                              strides[1][2], (const float*)data[2], strides[2][1], strides[2][2], (const bool*)data[3],
                              strides[3][0], strides[3][1], (float*)out_data, H, Hkv, T, C, D, (float)scale);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}
#endif
