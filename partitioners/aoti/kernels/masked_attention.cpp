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
// the two kernels over 30 layers' pools evicted between calls). A row over
// 256 cells or more takes all its kv heads together, cell block by cell
// block, so its reads run along the pools (row_heads).
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
#include <type_traits>
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

// the cells c < C that a mask row sees (row[c * m_sc] set), in order, into cells; returns how many
inline int64_t visible(const bool* row, int64_t m_sc, int64_t C, int64_t* cells) {
  int64_t n = 0;
  for (int64_t c = 0; c < C; c++)
    if (row[c * m_sc]) cells[n++] = c;
  return n;
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

// f(std::integral_constant<int, g>()) for a tile of g heads (1..HEADS_MAX): its size as a template argument
template <typename F>
inline void tile_of(int64_t g, F f) {
  if (g == 1)
    f(std::integral_constant<int, 1>());
  else if (g == 2)
    f(std::integral_constant<int, 2>());
  else if constexpr (HEADS_MAX == 4) {
    if (g == 3)
      f(std::integral_constant<int, 3>());
    else
      f(std::integral_constant<int, 4>());
  }
}

// scale * q_g . k[cells[c]] for the G query rows q + g * q_sh and the 4 cells cells[0..4), into p + g * ps + c:
// each key vector loaded once for the G heads. Always inlined: called as a function of its own from
// row_heads, GCC kept 3 of its 8 accumulators on the stack (the register test)
template <int G, typename E>
__attribute__((always_inline)) inline void score4(const float* q, int64_t q_sh, const E* kh, int64_t k_sc,
                                                 const int64_t* cells, int64_t D, float scale, float* p, int64_t ps) {
  const E* rows[4] = {kh + cells[0] * k_sc, kh + cells[1] * k_sc, kh + cells[2] * k_sc, kh + cells[3] * k_sc};
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
  for (int g = 0; g < G; g++) total4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], scale, p + g * ps);
}

// scale * q_g . k[cells[j]] for the G query rows q + g * q_sh and cells[0..n), into p + g * ps + j; four
// cells at a time, each key vector loaded once for the G heads
template <int G, typename E>
inline void scores(const float* q, int64_t q_sh, const E* kh, int64_t k_sc, const int64_t* cells, int64_t n, int64_t D,
                   float scale, float* p, int64_t ps) {
  for (int64_t i = 0; i < AHEAD && i < n; i++) fetch_row(kh + cells[i] * k_sc, D);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t i = j + AHEAD; i < j + AHEAD + 4 && i < n; i++) fetch_row(kh + cells[i] * k_sc, D);
    score4<G>(q, q_sh, kh, k_sc, cells + j, D, scale, p + j, ps);
  }
  for (; j < n; j++)
    for (int g = 0; g < G; g++) p[g * ps + j] = scale * dot(q + g * q_sh, kh + cells[j] * k_sc, D);
}

// o + g * o_sh = inverse[g] * sum_i p[g * ps + i] * v[cells[i]] for the G heads: each value vector loaded once
// for them all, DV vectors of dims at a time (as many as leave registers for the loads). Over cells i0..i1 of
// the n: the sums start from zero at i0 == 0 and otherwise from what o holds (the earlier cells'), and are
// scaled by inverse at i1 == n, so a row's cells taken a block at a time sum exactly as all at once. With
// `fetch`, the value rows AHEAD cells on are fetched into L2 as it goes
template <int G, typename E>
inline void weighted_values(const float* p, int64_t ps, const int64_t* cells, int64_t i0, int64_t i1, int64_t n,
                            const E* vh, int64_t v_sc, int64_t D, const float* inverse, float* o, int64_t o_sh,
                            bool fetch) {
  constexpr int DV = G * 8 <= REGISTERS - 8 ? 8 : G * 4 <= REGISTERS - 8 ? 4 : 2;
  const bool first = i0 == 0, last = i1 == n;
  if (fetch)
    for (int64_t i = i0; i < i0 + AHEAD && i < n; i++) fetch_row(vh + cells[i] * v_sc, D);
  int64_t d0 = 0;
  for (; d0 + DV * LANES <= D; d0 += DV * LANES) {
    vec acc[G][DV];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
      for (int b = 0; b < DV; b++) acc[g][b] = first ? zero() : load(o + g * o_sh + d0 + LANES * b);
    for (int64_t i = i0; i < i1; i++) {
      if (fetch && d0 == 0 && i + AHEAD < n) fetch_row(vh + cells[i + AHEAD] * v_sc, D);  // later passes find them in L2
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
      for (int b = 0; b < DV; b++)
        store(o + g * o_sh + d0 + LANES * b, last ? mul(acc[g][b], broadcast(inverse[g])) : acc[g][b]);
  }
  for (; d0 < D; d0 += LANES) {  // the dims past the last whole DV vectors, a vector at a time
    const int w = D - d0 < LANES ? (int)(D - d0) : LANES;
    vec acc[G];
    for (int g = 0; g < G; g++) acc[g] = first ? zero() : load_first(o + g * o_sh + d0, w);
    for (int64_t i = i0; i < i1; i++) {
      const vec value = load_upto(vh + cells[i] * v_sc + d0, w);
      for (int g = 0; g < G; g++) acc[g] = fma(broadcast(p[g * ps + i]), value, acc[g]);
    }
    for (int g = 0; g < G; g++) store_first(o + g * o_sh + d0, last ? mul(acc[g], broadcast(inverse[g])) : acc[g], w);
  }
}

// the score rows p + h * ps (n scores each) of `heads` heads as e^(score - the row's largest); with tops and
// sums, each row's largest and sum go there and inverse[h] is 1 (a partial softmax), else 1 / the sum
inline void softmax_rows(float* p, int64_t ps, int64_t n, int64_t heads, float* inverse, float* tops, float* sums) {
  for (int64_t h = 0; h < heads; h++) {
    const float top = largest(p + h * ps, n), sum = exp_below(p + h * ps, n, top);
    if (tops) {
      tops[h] = top;
      sums[h] = sum;
    }
    inverse[h] = tops ? 1.0f : 1.0f / sum;
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
  softmax_rows(p, ps, n, G, inverse, tops, sums);
  weighted_values<G>(p, ps, cells, 0, n, n, vh, v_sc, D, inverse, o, o_sh, true);
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
    tile_of(h1 - h < HEADS_MAX ? h1 - h : HEADS_MAX, [&](auto g) {
      head_tile<decltype(g)::value>(qh, q_sh, kh, k_sc, vh, v_sc, cells, n, D, scale, p, ps, oh, o_sh, th, sh);
    });
  }
}

// row_heads: how many cells ahead of the ones being read a cell's key or
// value rows of every kv head are fetched into L2, how many cells a block
// takes (its scores, then its values, kv head by kv head), the fewest cells
// a row takes it over (shorter rows go kv head by kv head: heads), and the
// most scores it holds (every head's over the row's cells, in floats; past
// that too, kv head by kv head)
constexpr int64_t ROW_AHEAD = 16, BLOCK = 16, ROW_MIN_CELLS = 256, ROW_SCORES_MAX = 1 << 18;

// every query head of one row (query rows q + h * q_sh) over cells[0..n), into o + h * o_sh, as head_tile
// (tops and sums: each head's partial softmax, or null), with the same sums in the same order. A cell's key
// rows (and value rows) of every kv head lie side by side in the pools, so the cells go by in blocks, each
// block's rows of every kv head together: the reads run along the pools, where a walk kv head by kv head
// reads a third (a fifth, ...) of each cell's row, a pool row apart, as many times over. python
// bench/ab_attention.py (decode rows from memory, 30 layers, a Zen 3): SmolLM2's heads over 1024 cells a
// session 0.90-0.99 x the time at 1 session, 0.93-0.97 at 8 (4 runs); the 1B shape's 0.85-0.87 at 8 and
// 0.97-1.01 at 1 (2 runs). A run's rows over 160 cells, on the walk below either way, vary 0.93-1.03.
// Over 160 cells a session the 1B shape's 8 sessions took 1.07 x (1.2 x in blocks of 4 cells): rows under
// ROW_MIN_CELLS keep the walk kv head by kv head. p: H * ps floats, ps >= n + LANES; inverse: H floats
template <typename E>
void row_heads(const float* q, int64_t q_sh, const E* k, int64_t k_sh, int64_t k_sc, const E* v, int64_t v_sh,
               int64_t v_sc, const int64_t* cells, int64_t n, int64_t D, int64_t H, int64_t Hkv, float scale,
               float* p, int64_t ps, float* inverse, float* o, int64_t o_sh, float* tops, float* sums) {
  const int64_t group = H / Hkv;
  const auto fetch_cell = [&](const E* pool, int64_t sh, int64_t sc, int64_t cell) {
    for (int64_t kvh = 0; kvh < Hkv; kvh++) fetch_row(pool + kvh * sh + cell * sc, D);
  };
  // each kv head's group, HEADS_MAX heads at a time: f(first head, heads)
  const auto by_tiles = [&](int64_t kvh, auto f) {
    for (int64_t h = kvh * group; h < (kvh + 1) * group; h += HEADS_MAX)
      f(h, std::min<int64_t>(HEADS_MAX, (kvh + 1) * group - h));
  };
  for (int64_t i = 0; i < ROW_AHEAD && i < n; i++) fetch_cell(k, k_sh, k_sc, cells[i]);
  const int64_t whole = n / 4 * 4;  // the cells scored 4 at a time
  for (int64_t j0 = 0; j0 < whole; j0 += BLOCK) {
    const int64_t j1 = std::min(whole, j0 + BLOCK);
    for (int64_t i = j0 + ROW_AHEAD; i < j1 + ROW_AHEAD && i < n; i++) fetch_cell(k, k_sh, k_sc, cells[i]);
    for (int64_t kvh = 0; kvh < Hkv; kvh++)
      by_tiles(kvh, [&](int64_t h, int64_t g) {
        const float* qh = q + h * q_sh;
        const E* kh = k + kvh * k_sh;
        tile_of(g, [&](auto G) {
          for (int64_t j = j0; j < j1; j += 4)
            score4<decltype(G)::value>(qh, q_sh, kh, k_sc, cells + j, D, scale, p + h * ps + j, ps);
        });
      });
  }
  for (int64_t j = whole; j < n; j++)
    for (int64_t h = 0; h < H; h++) p[h * ps + j] = scale * dot(q + h * q_sh, k + h / group * k_sh + cells[j] * k_sc, D);
  softmax_rows(p, ps, n, H, inverse, tops, sums);
  for (int64_t i = 0; i < ROW_AHEAD && i < n; i++) fetch_cell(v, v_sh, v_sc, cells[i]);
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    const int64_t i1 = std::min(n, i0 + BLOCK);
    for (int64_t i = i0 + ROW_AHEAD; i < i1 + ROW_AHEAD && i < n; i++) fetch_cell(v, v_sh, v_sc, cells[i]);
    for (int64_t kvh = 0; kvh < Hkv; kvh++)
      by_tiles(kvh, [&](int64_t h, int64_t g) {
        tile_of(g, [&](auto G) {
          weighted_values<decltype(G)::value>(p + h * ps, ps, cells, i0, i1, n, v + kvh * v_sh, v_sc, D, &inverse[h],
                                              o + h * o_sh, o_sh, false);
        });
      });
  }
}

// one row's heads over cells[0..n), into o + h * o_sh (tops, sums as row_heads'): row_heads where every
// head's scores fit in ROW_SCORES_MAX, else kv head by kv head; p grows to what it takes
template <typename E>
void attend_row(const float* q, int64_t q_sh, const E* k, int64_t k_sh, int64_t k_sc, const E* v, int64_t v_sh,
                int64_t v_sc, const int64_t* cells, int64_t n, int64_t D, int64_t H, int64_t Hkv, float scale,
                std::vector<float>& p, float* o, int64_t o_sh, float* tops, float* sums) {
  const int64_t ps = n + LANES, group = H / Hkv;
  const int64_t rows = n >= ROW_MIN_CELLS && H * ps <= ROW_SCORES_MAX ? H : std::min(group, (int64_t)HEADS_MAX);
  if ((int64_t)p.size() < rows * ps + H) p.resize(rows * ps + H);  // the scores, then row_heads' H inverses
  if (rows == H)
    return row_heads(q, q_sh, k, k_sh, k_sc, v, v_sh, v_sc, cells, n, D, H, Hkv, scale, p.data(), ps, p.data() + H * ps,
                     o, o_sh, tops, sums);
  for (int64_t kvh = 0; kvh < Hkv; kvh++) {
    const int64_t h0 = kvh * group;
    heads(h0, h0 + group, q + h0 * q_sh, q_sh, k + kvh * k_sh, k_sc, v + kvh * v_sh, v_sc, cells, n, D, scale, p.data(),
          ps, o + h0 * o_sh, o_sh, tops ? tops + h0 : nullptr, sums ? sums + h0 : nullptr);
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
  const int64_t threads = omp_get_max_threads();
  // rows that see different cells (several sessions'), long ones (judged by the first row's), as many as the
  // threads share evenly or nearly: a row a task, its kv heads together (attend_row)
  if (!by_kv_head && first >= ROW_MIN_CELLS && (T % threads == 0 || T >= 4 * threads)) {
#pragma omp parallel
    {
      std::vector<int64_t> cells(C);
      std::vector<float> p;
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; t++) {
        const int64_t n = visible(mask + t * m_st, m_sc, C, cells.data());
        float* o = out + t * D;  // head h's row at o + h * T * D
        if (n == 0) {
          for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++) o[h * T * D + d] = 0.0f;
          continue;
        }
        attend_row(q + t * q_st, q_sh, k, k_sh, k_sc, v, v_sh, v_sc, cells.data(), n, D, H, Hkv, scale, p, o, T * D,
                   nullptr, nullptr);
      }
    }
    return;
  }
#pragma omp parallel
  {
    std::vector<int64_t> cells(C);
    std::vector<float> p(std::min<int64_t>(group, HEADS_MAX) * ps);
    int64_t n = 0, gathered = -1;  // the row whose visible cells `cells` holds (a row's kv heads follow each other)
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * Hkv; task++) {
      const int64_t kvh = by_kv_head ? task / T : task % Hkv, t = by_kv_head ? task % T : task / Hkv;
      if (t != gathered) {
        n = visible(mask + t * m_st, m_sc, C, cells.data());
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
  std::vector<int64_t> cells(T * C), seen(T, 0);  // each row's visible cells, and how many
  for (int64_t t = 0; t < T; t++) seen[t] = visible(mask + t * m_st, m_sc, C, &cells[t * C]);
  // per (row, part, head): the partial's largest score, its sum, its D weighted values
  std::vector<float> tops(T * parts * H, -INFINITY), sums(T * parts * H, 0.0f), partial(T * parts * H * D);
#pragma omp parallel
  {
    std::vector<float> p;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * parts; task++) {
      const int64_t t = task / parts, part = task % parts;
      const int64_t j0 = seen[t] * part / parts, n = seen[t] * (part + 1) / parts - j0;
      if (n == 0) continue;
      const int64_t at = task * H;
      attend_row(q + t * q_st, q_sh, k, k_sh, k_sc, v, v_sh, v_sc, &cells[t * C + j0], n, D, H, Hkv, scale, p,
                 &partial[at * D], D, &tops[at], &sums[at]);
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
