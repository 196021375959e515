/* Times every OpenMP parallel region a process opens (bench/regions.py
 * builds it and loads it with LD_PRELOAD): for each region's function, how
 * many times it ran, the region's time from the call to its return, the
 * calling thread's own work, and how long the calling thread and the others
 * waited for the last one to finish. Only for measurement: it stands between
 * the program and libgomp's GOMP_parallel.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define MAX_THREADS 64
#define SLOTS 4096

typedef void (*region_fn)(void*);

static void (*real_parallel)(region_fn, void*, unsigned, unsigned);
static int (*thread_num)(void);

struct call {
  region_fn fn;
  void* data;
  uint64_t end[MAX_THREADS];
};

static struct {
  uintptr_t fn;
  long calls;
  double region_ns, caller_ns, caller_waits_ns, others_wait_ns;
} stats[SLOTS];

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void timed(void* p) {
  struct call* c = p;
  c->fn(c->data);
  const int me = thread_num();
  if (me < MAX_THREADS) c->end[me] = now_ns();
}

void GOMP_parallel(region_fn fn, void* data, unsigned threads, unsigned flags) {
  if (!real_parallel) {  /* the libgomp the program already loaded (torch's), not another copy */
    void* gomp = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
    real_parallel = dlsym(gomp, "GOMP_parallel");
    thread_num = dlsym(gomp, "omp_get_thread_num");
  }
  struct call c = {fn, data, {0}};
  const uint64_t start = now_ns();
  real_parallel(timed, &c, threads, flags);
  const uint64_t stop = now_ns();
  uint64_t last = c.end[0];
  int ran = 0;
  for (int t = 0; t < MAX_THREADS; t++)
    if (c.end[t]) {
      ran++;
      last = c.end[t] > last ? c.end[t] : last;
    }
  unsigned h = (unsigned)(((uintptr_t)fn >> 4) % SLOTS);
  while (stats[h].fn && stats[h].fn != (uintptr_t)fn) h = (h + 1) % SLOTS;
  stats[h].fn = (uintptr_t)fn;
  stats[h].calls++;
  stats[h].region_ns += (double)(stop - start);
  stats[h].caller_ns += (double)(c.end[0] - start);
  stats[h].caller_waits_ns += (double)(last - c.end[0]);
  for (int t = 1; t < MAX_THREADS; t++)
    if (c.end[t]) stats[h].others_wait_ns += (double)(last - c.end[t]) / (ran - 1);
}

/* every region function so far, a line each: address, calls, then ns per call of the region, of the calling
 * thread's work, of its wait for the last thread, of the other threads' mean wait; the counts restart */
int omp_regions_dump(const char* path) {
  FILE* f = fopen(path, "w");
  if (!f) return -1;
  for (int i = 0; i < SLOTS; i++)
    if (stats[i].fn) {
      const double n = (double)stats[i].calls;
      fprintf(f, "%lx %ld %.0f %.0f %.0f %.0f\n", (unsigned long)stats[i].fn, stats[i].calls, stats[i].region_ns / n,
              stats[i].caller_ns / n, stats[i].caller_waits_ns / n, stats[i].others_wait_ns / n);
      stats[i].fn = 0;
      stats[i].calls = 0;
      stats[i].region_ns = stats[i].caller_ns = stats[i].caller_waits_ns = stats[i].others_wait_ns = 0;
    }
  return fclose(f);
}
