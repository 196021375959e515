// The AOTInductor C shims of kvexport's kernels: what a compiled method's
// generated code calls for the custom ops kvexport::rows_linear,
// kvexport::masked_attention, kvexport::packed_linear and kvexport::int8_linear (the backend's passes
// emit them). Each shim reads its tensor handles, checks them against what the
// math takes (the compile guarantees them; a shim checks rather than trusts),
// says on stderr why it refuses any, allocates the result and calls the math
// (rows_linear.cpp, masked_attention.cpp, packed_linear.cpp, int8_linear.cpp). Built only into
// the static archive AOTInductor links.

#include <algorithm>
#include <memory>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels.h"

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

namespace {

// generated code reports only that a shim failed: the reason goes to stderr
AOTITorchError refuse(const char* kernel, const char* why) {
  std::fprintf(stderr, "kvexport %s: refused its operands: %s\n", kernel, why);
  return AOTI_TORCH_FAILURE;
}

struct Operand {
  int64_t dims = 0;
  int32_t dtype = 0;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  void* data = nullptr;
};

// false when a handle cannot be read
bool read(AtenTensorHandle handle, Operand& o) {
  return !(aoti_torch_get_dim(handle, &o.dims) || aoti_torch_get_dtype(handle, &o.dtype) ||
           aoti_torch_get_sizes(handle, &o.sizes) || aoti_torch_get_strides(handle, &o.strides) ||
           aoti_torch_get_data_ptr(handle, &o.data));
}

// a new contiguous CPU tensor of the given dtype and sizes, and its data
AOTITorchError new_tensor(int32_t dtype, int dims, const int64_t* size, AtenTensorHandle* out, void** data) {
  int64_t stride[4];
  int64_t step = 1;
  for (int i = dims - 1; i >= 0; i--) {
    stride[i] = step;
    step *= size[i];
  }
  if (aoti_torch_empty_strided(dims, size, stride, dtype, aoti_torch_device_type_cpu(), 0, out))
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_get_data_ptr(*out, data)) {
    aoti_torch_delete_tensor_object(*out);
    *out = nullptr;
    return AOTI_TORCH_FAILURE;
  }
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError new_fp32(int dims, const int64_t* size, AtenTensorHandle* out, void** data) {
  return new_tensor(aoti_torch_dtype_float32(), dims, size, out, data);
}

// bf16 <-> fp32: a bf16 is a float's upper half; rounding to nearest even, as torch does
inline float from_bf16(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // NaN stays NaN
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// ----------------------------------------------------------- masked attention
// Rows that see most of the view in common (one session's rows, T >= 4) are
// faster through sdpa's blocked products, which load a block of keys once for
// every row; the kernel takes each row alone (bench/attention_kernels.py, 30
// layers' pools on an Intel Xeon: 8 rows over 1024 cells 7.32 ms on the
// kernel against 5.73, 16 rows 12.65 against 8.86; even at 8 over 100).
constexpr int64_t DENSE_MIN_ROWS = 4;
// the kernel gathers each row's cells alone: over more rows (a dynamic prefill
// of several sessions) sdpa's blocked products win
constexpr int64_t SPARSE_MAX_ROWS = 16;
// one session's slice takes the causal path from this many rows: under it the
// two calls and the merge cost more than the masked half saves
// (bench/attention_kernels.py: a slice of 256 rows over 1024 earlier cells
// 6.5 ms against 7.6 through the mask; a build that took every slice spent
// 1.13 ms against 1.00 on 128 rows over 128 cells)
constexpr int64_t CAUSAL_MIN_ROWS = 256;

bool dense(const Operand& mask, int64_t T, int64_t C) {
  int64_t visible = 0;
  for (int64_t t = 0; t < T; t++) {
    const uint8_t* row = (const uint8_t*)mask.data + t * mask.strides[0];
    if (mask.strides[1] == 1) {
      for (int64_t c = 0; c < C; c++) visible += row[c];  // vectorized
    } else {
      for (int64_t c = 0; c < C; c++) visible += row[c * mask.strides[1]];
    }
  }
  return 2 * visible > T * C;
}

// torch's own CPU sdpa (the call inductor makes for sdpa), with the mask as
// the additive float mask it takes, into out
AOTITorchError attend_with_sdpa(AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
                                const Operand& mask, int64_t T, int64_t C, double scale, AtenTensorHandle out) {
  const int64_t size[2] = {T, C};
  AtenTensorHandle additive, result = nullptr, logsumexp = nullptr;
  void* data;
  if (new_fp32(2, size, &additive, &data)) return AOTI_TORCH_FAILURE;
  for (int64_t t = 0; t < T; t++)
    for (int64_t c = 0; c < C; c++)
      ((float*)data)[t * C + c] =
          ((const bool*)mask.data)[t * mask.strides[0] + c * mask.strides[1]] ? 0.0f : -INFINITY;
  AOTITorchError error = aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(
      query, key, value, 0.0, 0, &additive, &scale, &result, &logsumexp);
  if (!error) error = aoti_torch_copy_(out, result, 0);
  for (AtenTensorHandle t : {additive, result, logsumexp})
    if (t) aoti_torch_delete_tensor_object(t);
  return error;
}

// ------------------------------------------------- one session's slice, causal
// A prompt slice of one session attends over the session's earlier cells (its
// history, which every row sees) and over its own cells causally (row t sees
// the slice's first t + 1). Through the mask, sdpa scores every row against
// every cell and then drops half of the slice's own; here the history is
// scored densely and the own cells by sdpa's causal blocks, which skip the
// masked half, and the two results merge by their log-sum-exps.
// (bench/prefill.py: a 2048-token prompt in 512-token slices)
// A step of several sessions' slices (a server's prefill of many prompts) is
// a run of such slices, one after another: through the mask, every row would
// be scored against every session's cells; here each slice sees its own.
struct CausalSlice {
  int64_t first = 0;             // the step's row where the slice begins
  std::vector<int64_t> history;  // cells every row sees, in cell order
  std::vector<int64_t> own;      // own[t]: the cell row first + t is the first to see (own[0]: one every row sees)
};

// at most this many slices a step: past it (rows that each start a slice, as
// under a sliding window) the calls would cost more than the mask's extra scores
constexpr size_t MAX_SLICES = 64;
// several slices are taken apart when SLICE_CELL_COST x the cells their rows
// see, plus SLICE_CALL_CELLS a slice for its two calls, is under what the mask
// scores (T x C): scored through the mask a cell cost about 10 ns, apart about
// 45 (causal blocks, gathered cells), and a slice's calls about 20 us
// (bench/attention_kernels.py, several sessions' slices, on an Intel Xeon:
// 20 one-row slices over 300 cells each 0.89 ms apart against 2.03 through the
// mask, over 30 cells each 0.39 apart against 0.18; 16 prompts of 220 rows 17
// against 129)
constexpr int64_t SLICE_CELL_COST = 4;
constexpr int64_t SLICE_CALL_CELLS = 2048;

// whether the mask's rows are a run of causal slices, and their cells: a
// slice's first row sees its history and one own cell, and each next row what
// the one before saw and one cell more; a row that does not begins the next
// slice. Row by row in byte operations the compiler vectorizes (every layer
// checks its mask: 512 rows over 2048 cells are a megabyte); a mask with
// strided cells, or a row that sees nothing, is taken as no slices
bool causal_slices(const Operand& mask, int64_t T, int64_t C, std::vector<CausalSlice>& slices, int64_t& visible) {
  if (mask.strides[1] != 1) return false;
  slices.clear();
  int64_t seen = 0;
  visible = 0;
  for (int64_t t = 0; t < T; t++) {
    const uint8_t* row = (const uint8_t*)mask.data + t * mask.strides[0];
    if (t > 0) {
      const uint8_t* before = row - mask.strides[0];
      uint8_t lost = 0;
      int64_t count = 0, added = 0;  // added: the sum of the new cells' indices
      for (int64_t c = 0; c < C; c++) {
        lost |= before[c] & (uint8_t)~row[c];
        count += row[c];
        added += (int64_t)(row[c] & (uint8_t)~before[c]) * c;
      }
      if (!lost && count == seen + 1) {  // with nothing lost, one more cell is exactly one new cell
        slices.back().own.push_back(added);
        seen = count;
        visible += seen;
        continue;
      }
    }
    if (slices.size() == MAX_SLICES) return false;
    slices.emplace_back();
    CausalSlice& slice = slices.back();
    slice.first = t;
    for (int64_t c = 0; c < C; c++)
      if (row[c]) slice.history.push_back(c);
    if (slice.history.empty()) return false;
    seen = (int64_t)slice.history.size();
    visible += seen;
    slice.own.push_back(slice.history.back());
    slice.history.pop_back();
  }
  return true;
}

// the pool's rows at `cells` as a [1, Hkv, n, D] tensor: a view where the
// cells are consecutive (a session's cells usually are), else a gathered copy
AOTITorchError pool_part(AtenTensorHandle pool, const Operand& o, const std::vector<int64_t>& cells,
                         AtenTensorHandle* out) {
  const int64_t n = (int64_t)cells.size(), Hkv = o.sizes[1], D = o.sizes[3];
  bool consecutive = true;
  for (int64_t i = 1; i < n && consecutive; i++) consecutive = cells[i] == cells[0] + i;
  const int64_t size[4] = {1, Hkv, n, D};
  if (consecutive) {
    int64_t offset;
    if (aoti_torch_get_storage_offset(pool, &offset)) return AOTI_TORCH_FAILURE;
    return aoti_torch__reinterpret_tensor(pool, 4, size, o.strides, offset + cells[0] * o.strides[2], out);
  }
  void* data;
  if (new_tensor(o.dtype, 4, size, out, &data)) return AOTI_TORCH_FAILURE;
  const int64_t bytes = o.dtype == aoti_torch_dtype_float32() ? 4 : 2;
  for (int64_t h = 0; h < Hkv; h++)
    for (int64_t i = 0; i < n; i++)
      std::memcpy((char*)data + ((h * n + i) * D) * bytes,
                  (const char*)o.data + (h * o.strides[1] + cells[i] * o.strides[2]) * bytes, D * bytes);
  return AOTI_TORCH_SUCCESS;
}

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return from_bf16(x); }
inline void narrow(float x, float* to) { *to = x; }
inline void narrow(float x, uint16_t* to) { *to = to_bf16(x); }

// out [H, T, D] = the parts' results ([1, H, T, D] of E) weighted by
// e^(their log-sum-exp [1, H, T], fp32), normalized; a head's rows `head` apart
template <typename E>
void merge(const Operand* result, const Operand* lse, int parts, int64_t H, int64_t T, int64_t D, E* out, int64_t head) {
  for (int64_t h = 0; h < H; h++)
    for (int64_t t = 0; t < T; t++) {
      float w[2] = {1.0f, 0.0f};
      if (parts == 2) {
        const float a = ((const float*)lse[0].data)[h * lse[0].strides[1] + t * lse[0].strides[2]];
        const float b = ((const float*)lse[1].data)[h * lse[1].strides[1] + t * lse[1].strides[2]];
        const float top = a > b ? a : b, ea = std::exp(a - top), eb = std::exp(b - top);
        w[0] = ea / (ea + eb);
        w[1] = eb / (ea + eb);
      }
      const E* r[2];
      int64_t step[2];
      for (int p = 0; p < parts; p++) {
        r[p] = (const E*)result[p].data + h * result[p].strides[1] + t * result[p].strides[2];
        step[p] = result[p].strides[3];
      }
      E* o = out + h * head + t * D;
      if (parts == 1)
        for (int64_t d = 0; d < D; d++) narrow(widen(r[0][d * step[0]]), o + d);
      else
        for (int64_t d = 0; d < D; d++) narrow(w[0] * widen(r[0][d * step[0]]) + w[1] * widen(r[1][d * step[1]]), o + d);
    }
}

// out's rows of the slice = the attention of their queries over the slice's
// history and own cells
AOTITorchError attend_causal_slice(AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
                                   const Operand* o, const CausalSlice& slice, double scale, void* out_data) {
  const int64_t H = o[0].sizes[1], T = o[0].sizes[2], D = o[0].sizes[3], rows = (int64_t)slice.own.size();
  std::vector<AtenTensorHandle> handles;  // every handle made here, deleted at the end
  // the slice's queries: a view of its rows
  AtenTensorHandle q = query;
  int64_t offset = 0;
  AOTITorchError error = aoti_torch_get_storage_offset(query, &offset);
  if (!error && rows != T) {
    const int64_t size[4] = {1, H, rows, D};
    error = aoti_torch__reinterpret_tensor(query, 4, size, o[0].strides, offset + slice.first * o[0].strides[2], &q);
    if (!error) handles.push_back(q);
  }
  // parts[0]: the own cells (causal), parts[1]: the history (dense) where there is one
  Operand result[2], lse[2];
  const int parts = slice.history.empty() ? 1 : 2;
  for (int p = 0; p < parts && !error; p++) {
    const std::vector<int64_t>& cells = p == 0 ? slice.own : slice.history;
    AtenTensorHandle k = nullptr, v = nullptr, r = nullptr, l = nullptr;
    error = pool_part(key, o[1], cells, &k);
    if (k) handles.push_back(k);
    if (!error) error = pool_part(value, o[2], cells, &v);
    if (v) handles.push_back(v);
    if (!error)
      error = aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, p == 0, nullptr, &scale, &r, &l);
    for (AtenTensorHandle t : {r, l})
      if (t) handles.push_back(t);
    if (!error && !(read(r, result[p]) && read(l, lse[p]))) error = AOTI_TORCH_FAILURE;
  }
  if (!error && o[0].dtype == aoti_torch_dtype_float32())
    merge<float>(result, lse, parts, H, rows, D, (float*)out_data + slice.first * D, T * D);
  else if (!error)
    merge<uint16_t>(result, lse, parts, H, rows, D, (uint16_t*)out_data + slice.first * D, T * D);
  for (AtenTensorHandle t : handles) aoti_torch_delete_tensor_object(t);
  return error;
}

// the ways a step's attention goes: the kernel (a few rows), sdpa through the
// mask, or sdpa over each causal slice's cells
enum Route { KERNEL = 0, MASK = 1, SLICES = 2 };

// which way the rows of `mask` [T, C] go (`slices` filled when by slices): one
// session's slice from CAUSAL_MIN_ROWS rows and several sessions' slices past
// a static method's rows when that scores far fewer cells, by slices; over more
// rows than a static method takes (a prefill of several sessions), and over 4+
// fp32 rows that see most cells, sdpa through the mask; else the kernel
Route route(const Operand& mask, int64_t T, int64_t C, bool fp32, std::vector<CausalSlice>& slices) {
  int64_t visible;
  if ((T >= CAUSAL_MIN_ROWS || T > SPARSE_MAX_ROWS) && C > 0 && causal_slices(mask, T, C, slices, visible) &&
      (slices.size() == 1 ? T >= CAUSAL_MIN_ROWS
                           : SLICE_CELL_COST * visible + SLICE_CALL_CELLS * (int64_t)slices.size() < T * C))
    return SLICES;
  if (T > SPARSE_MAX_ROWS || (T >= DENSE_MIN_ROWS && fp32 && dense(mask, T, C))) return MASK;
  return KERNEL;
}

// why masked_attention cannot take these operands, or nullptr
const char* attention_problem(const Operand* o) {
  for (int i = 0; i < 4; i++)
    if (o[i].dims != (i == 3 ? 2 : 4)) return "query, key and value must be 4-d and the mask 2-d";
  const bool fp32 = o[0].dtype == aoti_torch_dtype_float32(), bf16 = o[0].dtype == aoti_torch_dtype_bfloat16();
  if (!(fp32 || bf16) || o[1].dtype != o[0].dtype || o[2].dtype != o[0].dtype || o[3].dtype != aoti_torch_dtype_bool())
    return "query, key and value must be all float32 or all bfloat16, and the mask bool";
  const int64_t *q = o[0].sizes, *k = o[1].sizes, *v = o[2].sizes, *m = o[3].sizes;
  if (q[0] != 1 || k[0] != 1 || v[0] != 1) return "the batch dim must be 1";
  if (k[1] < 1 || q[1] % k[1]) return "the query heads must be a multiple of the key heads";
  if (k[3] != q[3] || v[1] != k[1] || v[2] != k[2] || v[3] != q[3]) return "key and value must be [1, Hkv, C, D]";
  if (m[0] != q[2] || m[1] != k[2]) return "the mask must be [T, C]";
  if (q[3] > 1 && (o[0].strides[3] != 1 || o[1].strides[3] != 1 || o[2].strides[3] != 1))
    return "query, key and value need unit stride along D";
  return nullptr;
}

// ---------------------------------------------------------------- rows linear
// Over a prefill slice's rows a bf16 product runs on torch's fp32 GEMM (the
// BLAS's blocked products), its operands widened: the rows once, the weight a
// panel at a time, small enough to stay in L2 between its widening and its
// product where the width allows (a panel holds at least MIN_PANEL_COLUMNS
// weight rows, so over wide ones it outgrows L2). The row kernel reads the
// weight once, as a few rows want; over many rows the BLAS's fp32 products
// run faster. Compiled code calls this shim over such rows only where torch
// has no fast bf16 GEMM of its own (an AVX2 CPU: kernels/build.py,
// fast_bf16_gemm). bench/bf16_products.py, SmolLM2's linears over 512 rows
// on an AMD EPYC (AVX2, no AVX-512): this shim 99-128 GFLOPS, the row kernel
// 88-95, torch's fp32 GEMM 127-167, its bf16 GEMM 19-21.
constexpr int64_t BLAS_MIN_ROWS = 128;
constexpr int64_t PANEL_VALUES = 1 << 18;  // fp32 values of a widened weight panel (1 MB)
// every panel's product packs all the rows again: panels narrower than this
// spend more on that than they save in L2. The 1B shape's down projection (K
// 8192) had panels of 32 rows; with 128 its products ran 1.26-1.36 x as fast on
// a Zen 4 (AVX2 code, a scratch A/B), a layer's 0.94-0.97 x the time
// (bench/ab_kernels.py --shim --rows 512 --dtype bf16 --isa avx2).
constexpr int64_t MIN_PANEL_COLUMNS = 128;

void widen(const uint16_t* from, int64_t rows, int64_t width, int64_t stride, float* to) {
#pragma omp parallel for
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < width; k++) to[r * width + k] = from_bf16(from[r * stride + k]);
}

// fp32 data as a [rows, cols] tensor with these strides (torch's view of memory the shim owns)
AOTITorchError view(float* data, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
                    AtenTensorHandle* out) {
  const int64_t size[2] = {rows, cols}, stride[2] = {row_stride, col_stride};
  return aoti_torch_create_tensor_from_blob(data, 2, size, stride, 0, aoti_torch_dtype_float32(),
                                            aoti_torch_device_type_cpu(), 0, out);
}

// result [M, N] = x [M, K] (rows ldx apart) times w [N, K] transposed, both
// bf16, on torch's fp32 GEMM: each panel's product into its columns of result
AOTITorchError bf16_on_blas(const uint16_t* x, int64_t ldx, const uint16_t* w, float* result, int64_t M, int64_t N,
                            int64_t K) {
  const int64_t P = std::min(N, std::max<int64_t>(MIN_PANEL_COLUMNS, PANEL_VALUES / K));
  std::unique_ptr<float[]> rows(new float[M * K]), panel(new float[P * K]);  // widened into: not zeroed first
  widen(x, M, K, ldx, rows.get());
  AtenTensorHandle a;
  if (view(rows.get(), M, K, K, 1, &a)) return AOTI_TORCH_FAILURE;
  AOTITorchError error = AOTI_TORCH_SUCCESS;
  for (int64_t n0 = 0; n0 < N && error == AOTI_TORCH_SUCCESS; n0 += P) {
    const int64_t p = std::min(P, N - n0);
    widen(w + n0 * K, p, K, K, panel.get());
    AtenTensorHandle b = nullptr, c = nullptr;
    error = view(panel.get(), K, p, 1, K, &b);  // the panel transposed: [K, p]
    if (error == AOTI_TORCH_SUCCESS) error = view(result + n0, M, p, N, 1, &c);
    if (error == AOTI_TORCH_SUCCESS) error = aoti_torch_cpu_mm_out(c, a, b);
    if (b) aoti_torch_delete_tensor_object(b);
    if (c) aoti_torch_delete_tensor_object(c);
  }
  aoti_torch_delete_tensor_object(a);
  return error;
}

// why rows_linear cannot take these operands, or nullptr
const char* rows_problem(const Operand& x, const Operand& w) {
  if (x.dims != 2 || w.dims != 2) return "x and weight must be 2-d";
  if (x.dtype != w.dtype || (x.dtype != aoti_torch_dtype_float32() && x.dtype != aoti_torch_dtype_bfloat16()))
    return "x and weight must both be float32 or both bfloat16";
  const int64_t M = x.sizes[0], K = x.sizes[1], N = w.sizes[0];
  if (w.sizes[1] != K) return "x is [M, K] and weight must be [N, K]";
  if (K > 1 && (x.strides[1] != 1 || w.strides[1] != 1)) return "x and weight need unit stride along K";
  if ((N > 1 && w.strides[0] != K) || (M > 1 && x.strides[0] < K)) return "weight must be contiguous, x's rows apart";
  return nullptr;
}

// ------------------------------------------------------------- packed linear
// why packed_linear cannot take these operands, or nullptr
const char* packed_problem(const Operand& x, const Operand& words, const Operand& scale, const Operand& offset,
                           int64_t bits, int64_t rows) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8";
  if (x.dims != 2 || words.dims != 2 || scale.dims != 2 || offset.dims != 2)
    return "x, words, scale and offset must be 2-d";
  if (x.dtype != aoti_torch_dtype_float32() || scale.dtype != aoti_torch_dtype_float32() ||
      offset.dtype != aoti_torch_dtype_float32() || words.dtype != aoti_torch_dtype_int32())
    return "x, scale and offset must be float32 and words int32";
  const int64_t M = x.sizes[0], K = x.sizes[1], R = words.sizes[0], lanes = 32 / bits, groups = scale.sizes[1];
  if (words.sizes[1] != K) return "x is [M, K] and words must be [R, K]";
  if (scale.sizes[0] != lanes * R || offset.sizes[0] != lanes * R || offset.sizes[1] != groups)
    return "scale and offset must be [32 / bits * R, groups]";
  if (groups < 1 || K % (8 * groups)) return "K must be a multiple of 8 * groups";
  if (rows < 1 || rows > lanes * R) return "rows must be within 1..32 / bits * R";
  if (x.strides[1] != 1 || (M > 1 && x.strides[0] < K)) return "x needs unit stride along K, rows apart";
  if (words.strides[1] != 1 || (R > 1 && words.strides[0] != K) || scale.strides[1] != 1 ||
      scale.strides[0] != groups || offset.strides[1] != 1 || offset.strides[0] != groups)
    return "words, scale and offset must be contiguous";
  return nullptr;
}

}  // namespace

extern "C" AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle words,
                                                       AtenTensorHandle scale, AtenTensorHandle offset, int64_t bits,
                                                       int64_t rows, AtenTensorHandle* ret0) {
  Operand a, w, s, o;
  if (!read(x, a) || !read(words, w) || !read(scale, s) || !read(offset, o))
    return refuse("packed_linear", "a tensor handle could not be read");
  if (const char* why = packed_problem(a, w, s, o, bits, rows)) return refuse("packed_linear", why);
  const int64_t M = a.sizes[0], K = a.sizes[1];
  const int64_t size[2] = {M, rows};
  AtenTensorHandle out;
  void* out_data;
  if (new_fp32(2, size, &out, &out_data)) return refuse("packed_linear", "the result could not be allocated");
  if (M > 0)
    kvexport_packed_linear((const float*)a.data, M > 1 ? a.strides[0] : K, (const int32_t*)w.data,
                           (const float*)s.data, (const float*)o.data, (float*)out_data, M, rows, K, w.sizes[0],
                           s.sizes[1], bits);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

namespace {

// why int8_linear cannot take these operands, or nullptr
const char* int8_problem(const Operand& x, const Operand& data, const Operand& scale, const Operand& offset,
                         int64_t bits, int64_t qact) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8";
  if (qact < 1 || qact > 4) return "qact must be 1 (int8), 2 (int8x2), 3 (int16) or 4 (int8-peak)";
  if (x.dims != 2 || data.dims != 2 || scale.dims != 2 || offset.dims != 2)
    return "x, data, scale and offset must be 2-d";
  if (x.dtype != aoti_torch_dtype_float32() || data.dtype != aoti_torch_dtype_uint8())
    return "x must be float32 and data uint8";
  if (scale.dtype != offset.dtype ||
      (scale.dtype != aoti_torch_dtype_float32() && scale.dtype != aoti_torch_dtype_float16()))
    return "scale and offset must both be float32 or both float16";
  // the blocks format: weight rows in panels of 8 (data [N / 8, K * bits], tables [N / 8, groups * 8])
  const int64_t M = x.sizes[0], K = x.sizes[1], panels = data.sizes[0], groups = scale.sizes[1] / 8;
  if (K % 32) return "K must be a multiple of 32";
  if (data.sizes[1] != K * bits) return "x is [M, K] and data must be [N / 8, K * bits]";
  if (scale.sizes[0] != panels || offset.sizes[0] != panels || scale.sizes[1] % 8 || offset.sizes[1] != scale.sizes[1])
    return "scale and offset must be [N / 8, groups * 8]";
  if (groups < 1 || K % (32 * groups)) return "K must be a multiple of 32 * groups";
  if (x.strides[1] != 1 || (M > 1 && x.strides[0] < K)) return "x needs unit stride along K, rows apart";
  if (data.strides[1] != 1 || (panels > 1 && data.strides[0] != data.sizes[1]) || scale.strides[1] != 1 ||
      scale.strides[0] != scale.sizes[1] || offset.strides[1] != 1 || offset.strides[0] != offset.sizes[1])
    return "data, scale and offset must be contiguous";
  return nullptr;
}

}  // namespace

extern "C" AOTITorchError aoti_torch_cpu_int8_linear(AtenTensorHandle x, AtenTensorHandle data,
                                                     AtenTensorHandle scale, AtenTensorHandle offset, int64_t bits,
                                                     int64_t qact, AtenTensorHandle* ret0) {
  Operand a, d, s, o;
  if (!read(x, a) || !read(data, d) || !read(scale, s) || !read(offset, o))
    return refuse("int8_linear", "a tensor handle could not be read");
  if (const char* why = int8_problem(a, d, s, o, bits, qact)) return refuse("int8_linear", why);
  const int64_t M = a.sizes[0], K = a.sizes[1], N = d.sizes[0] * 8;
  const int64_t size[2] = {M, N};
  AtenTensorHandle out;
  void* out_data;
  if (new_fp32(2, size, &out, &out_data)) return refuse("int8_linear", "the result could not be allocated");
  if (M > 0 && N > 0)
    kvexport_int8_linear((const float*)a.data, M > 1 ? a.strides[0] : K, (const uint8_t*)d.data, s.data, o.data,
                         (float*)out_data, M, N, K, s.sizes[1] / 8, bits,
                         s.dtype == aoti_torch_dtype_float16() ? 16 : 32, qact);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

extern "C" AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                     AtenTensorHandle* ret0) {
  Operand a, w;
  if (!read(x, a) || !read(weight, w)) return refuse("rows_linear", "a tensor handle could not be read");
  if (const char* why = rows_problem(a, w)) return refuse("rows_linear", why);
  const int64_t M = a.sizes[0], K = a.sizes[1], N = w.sizes[0];
  const int64_t size[2] = {M, N};
  AtenTensorHandle out;
  void* out_data;
  if (new_tensor(a.dtype, 2, size, &out, &out_data)) return refuse("rows_linear", "the result could not be allocated");
  if (M > 0 && N > 0 && a.dtype == aoti_torch_dtype_float32()) {
    kvexport_rows_linear((const float*)a.data, M > 1 ? a.strides[0] : K, (const float*)w.data, (float*)out_data, M, N,
                         K);
  } else if (M > 0 && N > 0) {  // bf16: rows and weight read as bf16, summed in fp32, the result rounded
    std::unique_ptr<float[]> result(new float[M * N]);  // every value written below: not zeroed first
    const int64_t ldx = M > 1 ? a.strides[0] : K;
    if (M < BLAS_MIN_ROWS) {
      kvexport_rows_linear_bf16((const uint16_t*)a.data, ldx, (const uint16_t*)w.data, result.get(), M, N, K);
    } else if (bf16_on_blas((const uint16_t*)a.data, ldx, (const uint16_t*)w.data, result.get(), M, N, K)) {
      aoti_torch_delete_tensor_object(out);
      return refuse("rows_linear", "torch's fp32 product failed");
    }
    uint16_t* rounded = (uint16_t*)out_data;
    if (M * N >= (1 << 16)) {
#pragma omp parallel for
      for (int64_t i = 0; i < M * N; i++) rounded[i] = to_bf16(result[i]);
    } else {  // no omp region at all: one that an if clause keeps to one thread costs about half a microsecond
      for (int64_t i = 0; i < M * N; i++) rounded[i] = to_bf16(result[i]);
    }
  }
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

extern "C" AOTITorchError aoti_torch_cpu_masked_attention(AtenTensorHandle query, AtenTensorHandle key,
                                                          AtenTensorHandle value, AtenTensorHandle mask, double scale,
                                                          AtenTensorHandle* ret0) {
  const AtenTensorHandle handles[4] = {query, key, value, mask};
  Operand o[4];
  for (int i = 0; i < 4; i++)
    if (!read(handles[i], o[i])) return refuse("masked_attention", "a tensor handle could not be read");
  if (const char* why = attention_problem(o)) return refuse("masked_attention", why);
  const int64_t H = o[0].sizes[1], T = o[0].sizes[2], D = o[0].sizes[3], Hkv = o[1].sizes[1], C = o[1].sizes[2];
  const int64_t size[4] = {1, H, T, D};
  AtenTensorHandle out;
  void* out_data;
  if (new_tensor(o[0].dtype, 4, size, &out, &out_data))
    return refuse("masked_attention", "the result could not be allocated");
  std::vector<CausalSlice> slices;
  const Route way = D > 0 ? route(o[3], T, C, o[0].dtype == aoti_torch_dtype_float32(), slices) : KERNEL;
  if (way == SLICES) {
    for (const CausalSlice& slice : slices)
      if (attend_causal_slice(query, key, value, o, slice, scale, out_data)) {
        aoti_torch_delete_tensor_object(out);
        return refuse("masked_attention", "torch's sdpa failed on a causal slice");
      }
    *ret0 = out;
    return AOTI_TORCH_SUCCESS;
  }
  if (way == MASK) {
    const AOTITorchError error = attend_with_sdpa(query, key, value, o[3], T, C, scale, out);
    if (error) {
      aoti_torch_delete_tensor_object(out);
      return refuse("masked_attention", "torch's sdpa failed on the rows");
    }
    *ret0 = out;
    return AOTI_TORCH_SUCCESS;
  }
  if (o[0].dtype == aoti_torch_dtype_bfloat16()) {  // bf16: the query widened, the pools read as bf16, the result rounded
    if (H > 0 && T > 0 && D > 0) {
      std::vector<float> q(H * T * D), result(H * T * D);
      const uint16_t* query16 = (const uint16_t*)o[0].data;
      for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++)
          for (int64_t d = 0; d < D; d++)
            q[(h * T + t) * D + d] = from_bf16(query16[h * o[0].strides[1] + t * o[0].strides[2] + d * o[0].strides[3]]);
      kvexport_masked_attention_bf16(q.data(), T * D, D, (const uint16_t*)o[1].data, o[1].strides[1], o[1].strides[2],
                                     (const uint16_t*)o[2].data, o[2].strides[1], o[2].strides[2],
                                     (const bool*)o[3].data, o[3].strides[0], o[3].strides[1], result.data(), H, Hkv, T,
                                     C, D, (float)scale);
      for (int64_t i = 0; i < H * T * D; i++) ((uint16_t*)out_data)[i] = to_bf16(result[i]);
    }
    *ret0 = out;
    return AOTI_TORCH_SUCCESS;
  }
  if (H > 0 && T > 0 && D > 0)
    kvexport_masked_attention((const float*)o[0].data, o[0].strides[1], o[0].strides[2], (const float*)o[1].data,
                              o[1].strides[1], o[1].strides[2], (const float*)o[2].data, o[2].strides[1],
                              o[2].strides[2], (const bool*)o[3].data, o[3].strides[0], o[3].strides[1],
                              (float*)out_data, H, Hkv, T, C, D, (float)scale);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

// the way masked_attention takes a bool mask [T, C] (a Route) and how many
// slices it finds: for tests, which cannot tell the ways apart by their results
extern "C" int32_t kvexport_masked_attention_route(const bool* mask, int64_t row_stride, int64_t cell_stride, int64_t T,
                                                   int64_t C, int32_t fp32, int64_t* slices) {
  int64_t sizes[2] = {T, C}, strides[2] = {row_stride, cell_stride};
  Operand o;
  o.dims = 2;
  o.sizes = sizes;
  o.strides = strides;
  o.data = (void*)mask;
  std::vector<CausalSlice> found;
  const Route way = route(o, T, C, fp32 != 0, found);
  *slices = way == SLICES ? (int64_t)found.size() : 0;
  return way;
}
