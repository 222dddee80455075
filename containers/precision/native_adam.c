/* Mixed-precision Adam/AdamW in one pass over every tensor of a flat group, and the sum of
   squares of low-precision gradients: see containers/native_adam.py, which builds this file.

   The arithmetic is that of the vector path of torch's CPU fused Adam kernel, operation for
   operation and in fp32 (built with -ffp-contract=off, so only the explicit fmaf fuses), so
   a step equals the eager flat path (cast, multiply, torch._fused_adamw_, cast back) bit for
   bit. */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 256

typedef struct {
  void *const *grads;      /* per tensor: its low-precision gradient (contiguous) */
  void *const *params;     /* per tensor: its low-precision parameter (contiguous) */
  const int64_t *offsets;  /* per tensor: where it starts in the flat buffers */
  const int64_t *blocks;   /* per block: tensor, first element, end element */
  int64_t num_blocks;
  float *master, *exp_avg, *exp_avg_sq;
  int fp16, adamw, decay, maximize, threads;
  int grads_fp32; /* the gradients are fp32 (summed over micro-batches), not the params' dtype */
  /* factor (unscale x clip), weight decay (AdamW: 1 - lr * wd), 1 - beta1, beta2, 1 - beta2,
     sqrt of bias correction 2, eps, -lr / bias correction 1 */
  float factor, wd, w1, beta2, w2, bc2_sqrt, eps, neg_step;
  double sums[MAX_THREADS]; /* square_sum: each thread's part */
} Job;

static inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as c10::BFloat16 */
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return f != f ? (uint16_t)0x7fc0 : r;
}

/* One tensor's elements lo..hi. DECAY (0 none, 1 AdamW, 2 Adam's L2) and SMALL (|1 - beta1|
   < 0.5, which picks torch's form of lerp) are literals at every use, the scalars are locals
   and the pointers `restrict`: the loop vectorizes only without branches or aliasing. */
#define ADAM_LOOP(TG, LOAD, T, STORE, DECAY, SMALL)                                        \
  do {                                                                                     \
    const TG *restrict g = (const TG *)j->grads[t];                                        \
    T *restrict p = (T *)j->params[t];                                                     \
    float *restrict m = j->master + off, *restrict a = j->exp_avg + off;                   \
    float *restrict v = j->exp_avg_sq + off;                                               \
    const float factor = j->factor * (j->maximize ? -1.0f : 1.0f), wd = j->wd;           \
    const float w1 = j->w1, w1m = j->w1 - 1.0f, beta2 = j->beta2, w2 = j->w2;              \
    const float bc2_sqrt = j->bc2_sqrt, eps = j->eps, neg_step = j->neg_step;              \
    (void)wd, (void)w1, (void)w1m;                                                         \
    for (int64_t i = lo; i < hi; i++) {                                                    \
      float grad = LOAD(g[i]) * factor;                                                    \
      float x = m[i];                                                                      \
      if (DECAY == 1) x = x * wd;                                                          \
      if (DECAY == 2) grad = fmaf(x, wd, grad);                                            \
      float e = a[i];                                                                      \
      e = SMALL ? fmaf(w1, grad - e, e) : fmaf(w1m, grad - e, grad);                       \
      float s = fmaf(w2 * grad, grad, v[i] * beta2);                                       \
      a[i] = e;                                                                            \
      v[i] = s;                                                                            \
      float d = sqrtf(s) / bc2_sqrt + eps;                                                 \
      x = x + neg_step * e / d;                                                            \
      m[i] = x;                                                                            \
      p[i] = STORE(x);                                                                     \
    }                                                                                      \
  } while (0)

#define F16_LOAD(h) ((float)(h))
#define F16_STORE(x) ((_Float16)(x))

#define F32_LOAD(x) (x)

#define ADAM_DTYPE(TG, LOAD, T, STORE)                                                     \
  do {                                                                                     \
    const int small = fabsf(j->w1) < 0.5f, decay = j->decay ? (j->adamw ? 1 : 2) : 0;      \
    if (small && decay == 0) ADAM_LOOP(TG, LOAD, T, STORE, 0, 1);                          \
    else if (small && decay == 1) ADAM_LOOP(TG, LOAD, T, STORE, 1, 1);                     \
    else if (small) ADAM_LOOP(TG, LOAD, T, STORE, 2, 1);                                   \
    else if (decay == 0) ADAM_LOOP(TG, LOAD, T, STORE, 0, 0);                              \
    else if (decay == 1) ADAM_LOOP(TG, LOAD, T, STORE, 1, 0);                              \
    else ADAM_LOOP(TG, LOAD, T, STORE, 2, 0);                                              \
  } while (0)

static void adam_blocks(const Job *j, int64_t first, int64_t last, int thread) {
  (void)thread;
  for (int64_t b = first; b < last; b++) {
    const int64_t t = j->blocks[3 * b], lo = j->blocks[3 * b + 1], hi = j->blocks[3 * b + 2];
    const int64_t off = j->offsets[t];
    if (j->grads_fp32 && j->fp16)
      ADAM_DTYPE(float, F32_LOAD, _Float16, F16_STORE);
    else if (j->grads_fp32)
      ADAM_DTYPE(float, F32_LOAD, uint16_t, to_bf16);
    else if (j->fp16)
      ADAM_DTYPE(_Float16, F16_LOAD, _Float16, F16_STORE);
    else
      ADAM_DTYPE(uint16_t, from_bf16, uint16_t, to_bf16);
  }
}

/* Squares summed in four 8-lane fp32 vectors over runs of 2048 elements, each run's lanes then
   added in fp64. A run whose fp32 sum is not finite is summed again in fp64, so a large finite
   gradient (|g| > 1.8e19) is not taken for an overflow; a non-finite one still makes the sum
   non-finite. GCC's vector extensions: the lanes are explicit whatever the vectorizer does. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef _Float16 f16x8 __attribute__((vector_size(16)));

static inline f32x8 load8_bf16(const void *p) {
  u16x8 h;
  memcpy(&h, p, sizeof h);
  u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f32x8 f;
  memcpy(&f, &w, sizeof f);
  return f;
}

static inline f32x8 load8_fp16(const void *p) {
  f16x8 h;
  memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, f32x8);
}

#define SQUARES(NAME, T, LOAD, LOAD8)                                                      \
  static double NAME(const T *restrict g, int64_t lo, int64_t hi) {                        \
    double total = 0.0;                                                                    \
    for (int64_t r = lo; r < hi; r += 2048) {                                              \
      const int64_t end = r + 2048 < hi ? r + 2048 : hi;                                   \
      f32x8 a = {0}, b = {0}, c = {0}, d = {0};                                            \
      int64_t i = r;                                                                       \
      for (; i + 32 <= end; i += 32) {                                                     \
        const f32x8 w = LOAD8(g + i), x = LOAD8(g + i + 8);                                \
        const f32x8 y = LOAD8(g + i + 16), z = LOAD8(g + i + 24);                          \
        a += w * w;                                                                        \
        b += x * x;                                                                        \
        c += y * y;                                                                        \
        d += z * z;                                                                        \
      }                                                                                    \
      a += b + (c + d);                                                                    \
      float run = 0.0f;                                                                    \
      for (int k = 0; k < 8; k++) run += a[k];                                             \
      for (; i < end; i++) {                                                               \
        const float x = LOAD(g[i]);                                                        \
        run += x * x;                                                                      \
      }                                                                                    \
      if (isfinite(run)) {                                                                 \
        total += run;                                                                      \
      } else {                                                                             \
        for (i = r; i < end; i++) {                                                        \
          const double x = (double)LOAD(g[i]);                                             \
          total += x * x;                                                                  \
        }                                                                                  \
      }                                                                                    \
    }                                                                                      \
    return total;                                                                          \
  }

SQUARES(squares_bf16, uint16_t, from_bf16, load8_bf16)
SQUARES(squares_fp16, _Float16, F16_LOAD, load8_fp16)

static void square_blocks(const Job *j, int64_t first, int64_t last, int thread) {
  double total = 0.0;
  for (int64_t b = first; b < last; b++) {
    const int64_t t = j->blocks[3 * b], lo = j->blocks[3 * b + 1], hi = j->blocks[3 * b + 2];
    total += j->fp16 ? squares_fp16((const _Float16 *)j->grads[t], lo, hi)
                     : squares_bf16((const uint16_t *)j->grads[t], lo, hi);
  }
  ((Job *)j)->sums[thread] = total;
}

/* Thread `thread` of `n` takes the blocks that start in its share of the elements. */
static void run_share(const Job *j, int thread, void (*body)(const Job *, int64_t, int64_t, int)) {
  int64_t total = 0;
  for (int64_t b = 0; b < j->num_blocks; b++) total += j->blocks[3 * b + 2] - j->blocks[3 * b + 1];
  const int64_t from = total * thread / j->threads, to = total * (thread + 1) / j->threads;
  int64_t seen = 0, first = -1, last = 0;
  for (int64_t b = 0; b < j->num_blocks; b++) {
    if (seen >= from && seen < to) {
      if (first < 0) first = b;
      last = b + 1;
    }
    seen += j->blocks[3 * b + 2] - j->blocks[3 * b + 1];
  }
  if (first >= 0) body(j, first, last, thread);
}

/* OpenMP, so the work goes to the thread team torch's own kernels use (the process has one
   libgomp: torch's, loaded first) rather than to new threads that would compete with it.
   Built without OpenMP (torch uses another runtime), one thread takes every share. */
static int run(Job *j, void (*body)(const Job *, int64_t, int64_t, int)) {
  const int n = j->threads < 1 ? 1 : (j->threads > MAX_THREADS ? MAX_THREADS : j->threads);
  j->threads = n;
  for (int t = 0; t < n; t++) j->sums[t] = 0.0;
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
  {
    /* fewer threads than asked: the ones there take the others' shares too */
    const int have = omp_get_num_threads();
    for (int t = omp_get_thread_num(); t < n; t += have) run_share(j, t, body);
  }
#else
  for (int t = 0; t < n; t++) run_share(j, t, body);
#endif
  return 0;
}

int oc_adam(Job *j) { return run(j, adam_blocks); }

double oc_square_sum(Job *j) {
  run(j, square_blocks);
  double total = 0.0;
  for (int t = 0; t < j->threads; t++) total += j->sums[t];
  return total;
}
