// Attention of a few query rows over a cell pool through the contract's mask,
// reading only the cells each row may see, for AOTInductor packages on x86
// CPUs (build.py builds it; the compiled forward_<N> methods call it through
// its shim in shims.cpp).
//
// Why not sdpa: sdpa scores every row against every cell of the pool view and
// then masks. With 8 sessions in one step each row sees its own session's
// cells, an eighth of the view, so 7/8 of that work is thrown away; with one
// session sdpa's per-head matrix products cost more in call overhead than the
// few hundred dot products do. Here each (row, kv head) task gathers the row's
// visible cells once, and the group's query heads score them together (each
// key and value vector loaded once for up to 4 heads), take an exact softmax
// (max-subtracted, a vectorized exp) and sum the values. One session's rows
// (a speculative check) see the same cells: a thread then takes one kv
// head's rows in turn, so its keys and values stay in L2. A
// decode step of one session has fewer such tasks than the threads can share
// evenly (SmolLM2: 3 on 2 threads, one thread doing two), so there the row's
// cells are split among the threads instead and the partial softmaxes merged:
// 1.25-1.4 x faster over 512-1024 cells, the same over 96 (a scratch A/B of
// the two kernels over 30 layers' pools evicted between calls).
//
// Semantics are sdpa's with a boolean mask and GQA: out[h, t] =
// softmax(scale * q[h, t] . k[h / G, c] over visible c) . v[h / G, c];
// a row that sees no cell gets zeros, as torch's CPU sdpa gives.
//
// The pools are fp32 or bf16 (a bf16 package's); bf16 keys and values are
// read as bf16, half the bytes, and widened in registers. Queries, scores,
// the softmax and the sums are fp32 either way (the shim widens a bf16
// query and rounds the result to bf16, as torch's bf16 sdpa does).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "vec.h"

using namespace kv;

namespace {

// the fewest cells a part of a row's cells takes (attend_by_cells)
constexpr int64_t SPLIT_MIN_CELLS = 32;

// how many cells ahead of the one being read their key or value rows are
// fetched into L2. A decode step's pools come from memory (the weights'
// stream evicts them) and a row of one kv head is a few lines, a cell's
// pool row apart: the hardware prefetchers left each row's read waiting on
// memory. bench/attention_kernels.py's decode rows (30 layers' pools evicted
// before each step, an AMD EPYC Zen 4): one row over 1024 cells 2.45 ms a
// step against 3.80 without, 8 sessions' rows over 1024 each 17.9 against
// 27.9. Into L2 rather than L1: more reads fly at once (a scratch driver,
// one row over 1000 cells: 2.4 ms into L2, 3.1 into L1)
constexpr int64_t AHEAD = 16;

// the row of D values at `row` fetched into L2
template <typename E>
inline void fetch_row(const E* row, int64_t D) {
  const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63, last = (uintptr_t)(row + D) - 1;
  for (uintptr_t line = first; line <= last; line += 64) prefetch_l2((const void*)line);
}

// the first n (1..8) values at p as floats, all 8 when n is 8
template <typename E>
inline vec load_upto(const E* p, int n) { return n == LANES ? load(p) : load_first(p, n); }

template <typename E>
inline float dot(const float* a, const E* b, int64_t D) {
  vec s0 = zero(), s1 = zero();
  int64_t d = 0;
  for (; d + 2 * LANES <= D; d += 2 * LANES) {
    s0 = fma(load(a + d), load(b + d), s0);
    s1 = fma(load(a + d + LANES), load(b + d + LANES), s1);
  }
  for (; d < D; d += LANES) {
    const int n = D - d < LANES ? (int)(D - d) : LANES;
    s0 = fma(load_first(a + d, n), load_first(b + d, n), s0);
  }
  return total(add(s0, s1));
}

// scale * q . k for four cells at once: four independent FMA chains, summed
// across lanes together
template <typename E>
inline void dot4(const float* q, const E* k, const int64_t* cells, int64_t k_sc, int64_t D, float scale, float* out) {
  const E* rows[4] = {k + cells[0] * k_sc, k + cells[1] * k_sc, k + cells[2] * k_sc, k + cells[3] * k_sc};
  vec a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += LANES) {
    const int n = D - d < LANES ? (int)(D - d) : LANES;
    const vec qv = load_upto(q + d, n);
    a0 = fma(qv, load_upto(rows[0] + d, n), a0);
    a1 = fma(qv, load_upto(rows[1] + d, n), a1);
    a2 = fma(qv, load_upto(rows[2] + d, n), a2);
    a3 = fma(qv, load_upto(rows[3] + d, n), a3);
  }
  total4(a0, a1, a2, a3, scale, out);
}

inline float largest(const float* p, int64_t n) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; j++) top = p[j] > top ? p[j] : top;
  return top;
}

// p[0..n) = e^(p - top) in place (top: their largest); returns their sum
inline float exp_below(float* p, int64_t n, float top) {
  vec sum = zero();
  const vec shift = broadcast(top);
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    const vec e = exp_nonpositive(sub(load(p + j), shift));
    store(p + j, e);
    sum = add(sum, e);
  }
  if (j < n) {
    const int rest = (int)(n - j);
    const vec e = keep_first(exp_nonpositive(sub(load_first(p + j, rest), shift)), rest);
    store_first(p + j, e, rest);
    sum = add(sum, e);
  }
  return total(sum);
}

// query heads a tile scores and sums together (one kv head's, of one row):
// each key and value row loaded once serves them all
constexpr int HEADS_MAX = REGISTERS == 32 ? 4 : 2;

// scale * q_g . k[cells[j]] for the G query rows q + g * q_sh and cells[0..n), into p + g * ps + j; four
// cells at a time, each key vector loaded once for the G heads
template <int G, typename E>
inline void scores(const float* q, int64_t q_sh, const E* kh, int64_t k_sc, const int64_t* cells, int64_t n, int64_t D,
                   float scale, float* p, int64_t ps) {
  for (int64_t i = 0; i < AHEAD && i < n; i++) fetch_row(kh + cells[i] * k_sc, D);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t i = j + AHEAD; i < j + AHEAD + 4 && i < n; i++) fetch_row(kh + cells[i] * k_sc, D);
    const E* rows[4] = {kh + cells[j] * k_sc, kh + cells[j + 1] * k_sc, kh + cells[j + 2] * k_sc,
                        kh + cells[j + 3] * k_sc};
    vec acc[G][4];
    clear(acc);
    for (int64_t d = 0; d < D; d += LANES) {
      const int w = D - d < LANES ? (int)(D - d) : LANES;
      vec key[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++) key[c] = load_upto(rows[c] + d, w);
#pragma GCC unroll 4
      for (int g = 0; g < G; g++) {
        const vec qv = load_upto(q + g * q_sh + d, w);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[g][c] = fma(qv, key[c], acc[g][c]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) total4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], scale, p + g * ps + j);
  }
  for (; j < n; j++)
    for (int g = 0; g < G; g++) p[g * ps + j] = scale * dot(q + g * q_sh, kh + cells[j] * k_sc, D);
}

// o + g * o_sh = inverse[g] * sum_i p[g * ps + i] * v[cells[i]] for the G heads: each value vector loaded once
// for them all, DV vectors of dims at a time (as many as leave registers for the loads)
template <int G, typename E>
inline void weighted_values(const float* p, int64_t ps, const int64_t* cells, int64_t n, const E* vh, int64_t v_sc,
                            int64_t D, const float* inverse, float* o, int64_t o_sh) {
  constexpr int DV = G * 8 <= REGISTERS - 8 ? 8 : G * 4 <= REGISTERS - 8 ? 4 : 2;
  for (int64_t i = 0; i < AHEAD && i < n; i++) fetch_row(vh + cells[i] * v_sc, D);
  int64_t d0 = 0;
  for (; d0 + DV * LANES <= D; d0 += DV * LANES) {
    vec acc[G][DV];
    clear(acc);
    for (int64_t i = 0; i < n; i++) {
      if (d0 == 0 && i + AHEAD < n) fetch_row(vh + cells[i + AHEAD] * v_sc, D);  // later passes find them in L2
      const E* row = vh + cells[i] * v_sc + d0;
      vec weight[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; g++) weight[g] = broadcast(p[g * ps + i]);
#pragma GCC unroll 8
      for (int b = 0; b < DV; b++) {
        const vec value = load(row + LANES * b);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) acc[g][b] = fma(weight[g], value, acc[g][b]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int b = 0; b < DV; b++) store(o + g * o_sh + d0 + LANES * b, mul(acc[g][b], broadcast(inverse[g])));
  }
  for (; d0 < D; d0 += LANES) {  // the dims past the last whole DV vectors, a vector at a time
    const int w = D - d0 < LANES ? (int)(D - d0) : LANES;
    vec acc[G];
    for (int g = 0; g < G; g++) acc[g] = zero();
    for (int64_t i = 0; i < n; i++) {
      const vec value = load_upto(vh + cells[i] * v_sc + d0, w);
      for (int g = 0; g < G; g++) acc[g] = fma(broadcast(p[g * ps + i]), value, acc[g]);
    }
    for (int g = 0; g < G; g++) store_first(o + g * o_sh + d0, mul(acc[g], broadcast(inverse[g])), w);
  }
}

// G query heads of one kv head (query rows q + g * q_sh) over cells[0..n), into o + g * o_sh: with `tops` and
// `sums` null, the exact softmax's weighted values; otherwise each head's partial softmax (its largest score
// to tops[g], its sum of e^(s - largest) to sums[g], the values weighted by those, unnormalized). p: G * ps
// floats, ps >= n + LANES
template <int G, typename E>
void head_tile(const float* q, int64_t q_sh, const E* kh, int64_t k_sc, const E* vh, int64_t v_sc,
               const int64_t* cells, int64_t n, int64_t D, float scale, float* p, int64_t ps, float* o, int64_t o_sh,
               float* tops, float* sums) {
  scores<G>(q, q_sh, kh, k_sc, cells, n, D, scale, p, ps);
  float inverse[G];
  for (int g = 0; g < G; g++) {
    const float top = largest(p + g * ps, n), sum = exp_below(p + g * ps, n, top);
    if (tops) {
      tops[g] = top;
      sums[g] = sum;
    }
    inverse[g] = tops ? 1.0f : 1.0f / sum;
  }
  weighted_values<G>(p, ps, cells, n, vh, v_sc, D, inverse, o, o_sh);
}

// query heads h0..h1 of one kv head, HEADS_MAX at a time (arguments as head_tile's, per head h - h0)
template <typename E>
void heads(int64_t h0, int64_t h1, const float* q, int64_t q_sh, const E* kh, int64_t k_sc, const E* vh, int64_t v_sc,
           const int64_t* cells, int64_t n, int64_t D, float scale, float* p, int64_t ps, float* o, int64_t o_sh,
           float* tops, float* sums) {
  for (int64_t h = h0; h < h1; h += HEADS_MAX) {
    const int64_t i = h - h0;
    const float* qh = q + i * q_sh;
    float* oh = o + i * o_sh;
    float* th = tops ? tops + i : nullptr;
    float* sh = sums ? sums + i : nullptr;
    const int64_t g = h1 - h < HEADS_MAX ? h1 - h : HEADS_MAX;
    if (g == 1)
      head_tile<1>(qh, q_sh, kh, k_sc, vh, v_sc, cells, n, D, scale, p, ps, oh, o_sh, th, sh);
    else if (g == 2)
      head_tile<2>(qh, q_sh, kh, k_sc, vh, v_sc, cells, n, D, scale, p, ps, oh, o_sh, th, sh);
    else if constexpr (HEADS_MAX == 4) {
      if (g == 3)
        head_tile<3>(qh, q_sh, kh, k_sc, vh, v_sc, cells, n, D, scale, p, ps, oh, o_sh, th, sh);
      else
        head_tile<4>(qh, q_sh, kh, k_sc, vh, v_sc, cells, n, D, scale, p, ps, oh, o_sh, th, sh);
    }
  }
}

// E: the pools' element type, float or uint16_t (bf16's raw values)
// Each (row, kv head) task on one thread: every query head of the group
// scores the row's visible cells, one exact softmax, the values summed.
template <typename E>
void attend_by_heads(const float* q, int64_t q_sh, int64_t q_st, const E* k, int64_t k_sh, int64_t k_sc, const E* v,
                     int64_t v_sh, int64_t v_sc, const bool* mask, int64_t m_st, int64_t m_sc, float* out, int64_t H,
                     int64_t Hkv, int64_t T, int64_t C, int64_t D, float scale) {
  const int64_t group = H / Hkv, ps = C + LANES;
  // Rows that see the same cells (one session's) take one kv head's rows in turn, so its keys and values
  // stay in L2 from row to row; rows of different sessions take a row's kv heads in turn, whose keys and
  // values lie side by side in each cell.
  int64_t first = 0, both = 0;
  for (int64_t c = 0; c < C; c++) {
    first += mask[c * m_sc];
    both += mask[c * m_sc] && mask[(T - 1) * m_st + c * m_sc];
  }
  const bool by_kv_head = T > 1 && 2 * both > first;
#pragma omp parallel
  {
    std::vector<int64_t> cells(C);
    std::vector<float> p(std::min<int64_t>(group, HEADS_MAX) * ps);
    int64_t n = 0, gathered = -1;  // the row whose visible cells `cells` holds (a row's kv heads follow each other)
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * Hkv; task++) {
      const int64_t kvh = by_kv_head ? task / T : task % Hkv, t = by_kv_head ? task % T : task / Hkv;
      if (t != gathered) {
        n = 0;
        for (int64_t c = 0; c < C; c++)
          if (mask[t * m_st + c * m_sc]) cells[n++] = c;
        gathered = t;
      }
      float* o = out + (kvh * group * T + t) * D;  // head h's row at o + (h - kvh * group) * T * D
      if (n == 0) {
        for (int64_t h = 0; h < group; h++)
          for (int64_t d = 0; d < D; d++) o[h * T * D + d] = 0.0f;
        continue;
      }
      heads(kvh * group, (kvh + 1) * group, q + kvh * group * q_sh + t * q_st, q_sh, k + kvh * k_sh, k_sc,
            v + kvh * v_sh, v_sc, cells.data(), n, D, scale, p.data(), ps, o, T * D, nullptr, nullptr);
    }
  }
}

// Fewer tasks than threads can share (a row or two over many cells): each
// row's visible cells split into `parts` runs of as many, one task a run
// (visible cells bunched at one end of the view, as a sliding window's are,
// still split evenly). A task scores its run for every head and keeps each
// head's partial softmax (its largest score, its sum of e^(s - largest) and
// the values weighted by them); the runs merge exactly after.
template <typename E>
void attend_by_cells(const float* q, int64_t q_sh, int64_t q_st, const E* k, int64_t k_sh, int64_t k_sc, const E* v,
                     int64_t v_sh, int64_t v_sc, const bool* mask, int64_t m_st, int64_t m_sc, float* out, int64_t H,
                     int64_t Hkv, int64_t T, int64_t C, int64_t D, float scale, int64_t parts) {
  const int64_t group = H / Hkv;
  std::vector<int64_t> cells(T * C), seen(T, 0);  // each row's visible cells, and how many
  for (int64_t t = 0; t < T; t++)
    for (int64_t c = 0; c < C; c++)
      if (mask[t * m_st + c * m_sc]) cells[t * C + seen[t]++] = c;
  // per (row, part, head): the partial's largest score, its sum, its D weighted values
  std::vector<float> tops(T * parts * H, -INFINITY), sums(T * parts * H, 0.0f), partial(T * parts * H * D);
  const int64_t ps = C / parts + 1 + LANES;
#pragma omp parallel
  {
    std::vector<float> p(std::min<int64_t>(group, HEADS_MAX) * ps);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * parts; task++) {
      const int64_t t = task / parts, part = task % parts;
      const int64_t j0 = seen[t] * part / parts, n = seen[t] * (part + 1) / parts - j0;
      if (n == 0) continue;
      for (int64_t kvh = 0; kvh < Hkv; kvh++) {
        const int64_t h0 = kvh * group, at = task * H + h0;
        heads(h0, h0 + group, q + h0 * q_sh + t * q_st, q_sh, k + kvh * k_sh, k_sc, v + kvh * v_sh, v_sc,
              &cells[t * C + j0], n, D, scale, p.data(), ps, &partial[at * D], D, &tops[at], &sums[at]);
      }
    }
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      float* o = out + (h * T + t) * D;
      float top = -INFINITY;
      for (int64_t part = 0; part < parts; part++) top = std::max(top, tops[(t * parts + part) * H + h]);
      for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
      if (top == -INFINITY) continue;  // the row sees no cell: zeros
      float sum = 0.0f;
      for (int64_t part = 0; part < parts; part++) {
        const int64_t at = (t * parts + part) * H + h;
        if (tops[at] == -INFINITY) continue;
        const float w = std::exp(tops[at] - top);
        sum += w * sums[at];
        for (int64_t d = 0; d < D; d++) o[d] += w * partial[at * D + d];
      }
      for (int64_t d = 0; d < D; d++) o[d] /= sum;
    }
}

template <typename E>
void attend(const float* q, int64_t q_sh, int64_t q_st, const E* k, int64_t k_sh, int64_t k_sc, const E* v,
            int64_t v_sh, int64_t v_sc, const bool* mask, int64_t m_st, int64_t m_sc, float* out, int64_t H,
            int64_t Hkv, int64_t T, int64_t C, int64_t D, float scale) {
  const int64_t threads = omp_get_max_threads();
  // split a row's cells when the (row, kv head) tasks would leave threads idle or unevenly loaded, and the
  // runs stay long enough to be worth a thread
  if (T * Hkv < 2 * threads && C >= SPLIT_MIN_CELLS * 2) {
    const int64_t parts = std::min((threads + T - 1) / T, C / SPLIT_MIN_CELLS);
    if (parts > 1)
      return attend_by_cells(q, q_sh, q_st, k, k_sh, k_sc, v, v_sh, v_sc, mask, m_st, m_sc, out, H, Hkv, T, C, D,
                             scale, parts);
  }
  attend_by_heads(q, q_sh, q_st, k, k_sh, k_sc, v, v_sh, v_sc, mask, m_st, m_sc, out, H, Hkv, T, C, D, scale);
}

}  // namespace

// q[h, t, d] at q + h * q_sh + t * q_st + d (likewise k, v over [kv head, cell, d]),
// mask[t, c] at mask + t * m_st + c * m_sc, out [H, T, D] contiguous
void kvexport_masked_attention(const float* q, int64_t q_sh, int64_t q_st, const float* k, int64_t k_sh, int64_t k_sc,
                               const float* v, int64_t v_sh, int64_t v_sc, const bool* mask, int64_t m_st,
                               int64_t m_sc, float* out, int64_t H, int64_t Hkv, int64_t T, int64_t C, int64_t D,
                               float scale) {
  attend(q, q_sh, q_st, k, k_sh, k_sc, v, v_sh, v_sc, mask, m_st, m_sc, out, H, Hkv, T, C, D, scale);
}

// the same over bf16 keys and values (their raw 16-bit values)
void kvexport_masked_attention_bf16(const float* q, int64_t q_sh, int64_t q_st, const uint16_t* k, int64_t k_sh,
                                    int64_t k_sc, const uint16_t* v, int64_t v_sh, int64_t v_sc, const bool* mask,
                                    int64_t m_st, int64_t m_sc, float* out, int64_t H, int64_t Hkv, int64_t T,
                                    int64_t C, int64_t D, float scale) {
  attend(q, q_sh, q_st, k, k_sh, k_sc, v, v_sh, v_sc, mask, m_st, m_sc, out, H, Hkv, T, C, D, scale);
}
