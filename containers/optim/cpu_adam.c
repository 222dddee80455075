/* One Adam/AdamW update in one pass over the storage a container keeps on a CPU: fp32 or bf16
 * gradients, fp32 masters (and a bf16 copy of them) or bf16 parameters with 16-bit remainders,
 * fp32 or bf16 moments. The arithmetic is fp32 and, operation for operation and rounding for
 * rounding, that of the vector loop of torch's fused CPU kernel (`torch._fused_adam(w)_`);
 * `cpu_adam.py` builds this file, checks that claim against the installed torch before using
 * it, and says why it exists. Compiled with -ffp-contract=off: every fused multiply-add below
 * is written out, and no other may be formed. */
#define _DEFAULT_SOURCE /* syscall() under -std=c99 */
#include <math.h>
#include <stdint.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef union {
  float f;
  uint32_t u;
} Bits;

static inline float widen(uint16_t b) {
  Bits x;
  x.u = (uint32_t)b << 16;
  return x.f;
}

/* To bf16, rounding to nearest even as torch's copy does; NaN becomes 0xFFFF (its vector path). */
static inline uint16_t narrow(float f) {
  Bits x;
  x.f = f;
  uint32_t r = (x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16;
  return f != f ? (uint16_t)0xFFFF : (uint16_t)r;
}

typedef struct {
  float factor, sign, wd, decay, coeff, b2, c2, bc2s, eps, neg_step;
  int small;
} Consts;

enum { MASTER = 0, MASTER_AND_PARAM = 1, REMAINDER = 2 };

/* Always inlined with constant kinds, so each combination is its own vectorized loop. */
static inline __attribute__((always_inline)) void update(
    int64_t n, float *restrict master, int16_t *restrict rem, uint16_t *restrict param,
    const void *restrict grad, void *restrict exp_avg, void *restrict exp_avg_sq,
    const Consts *k, const int bf16_grad, const int bf16_moments, const int mode, const int l2) {
  const float factor = k->factor, sign = k->sign, wd = k->wd, decay = k->decay;
  const float coeff = k->coeff, b2 = k->b2, c2 = k->c2, bc2s = k->bc2s, eps = k->eps;
  const float neg_step = k->neg_step;
  const int small = k->small;
  const uint16_t *g16 = grad;
  const float *g32 = grad;
  uint16_t *m16 = exp_avg, *v16 = exp_avg_sq;
  float *m32 = exp_avg, *v32 = exp_avg_sq;
  for (int64_t i = 0; i < n; i++) {
    /* (x 1.0f is exact: no branch for an unscaled or minimized gradient) */
    float g = (bf16_grad ? widen(g16[i]) : g32[i]) * factor * sign;
    float p;
    if (mode == REMAINDER) {
      /* the master's bits: the parameter's, shifted up, plus the signed remainder */
      Bits x;
      x.u = ((uint32_t)param[i] << 16) + (uint32_t)(int32_t)rem[i];
      p = x.f;
    } else {
      p = master[i];
    }
    if (l2)
      g = fmaf(p, wd, g); /* Adam's L2 term, contracted as torch's build contracts it */
    else
      p = p * decay; /* AdamW (1.0f without weight decay) */
    float m = bf16_moments ? widen(m16[i]) : m32[i];
    float v = bf16_moments ? widen(v16[i]) : v32[i];
    /* m.lerp_(g, 1 - beta1), from the nearer end */
    m = fmaf(coeff, g - m, small ? m : g);
    v = fmaf(c2 * g, g, v * b2);
    p = p + neg_step * m / (sqrtf(v) / bc2s + eps);
    if (bf16_moments) {
      m16[i] = narrow(m);
      v16[i] = narrow(v);
    } else {
      m32[i] = m;
      v32[i] = v;
    }
    if (mode == REMAINDER) {
      /* round half away from zero into the parameter; what is left is the remainder */
      Bits x;
      x.f = p;
      int32_t high = (int32_t)(x.u + 0x8000u) >> 16;
      rem[i] = (int16_t)(x.u - ((uint32_t)high << 16));
      param[i] = (uint16_t)high;
    } else {
      master[i] = p;
      if (mode == MASTER_AND_PARAM) param[i] = narrow(p);
    }
  }
}

#define CASE(g, m, mode, l2)                                                                  \
  case (g) | (m) << 1 | (mode) << 2 | (l2) << 4:                                             \
    update(n, master, rem, param, grad, exp_avg, exp_avg_sq, k, g, m, mode, l2);             \
    return 0;
#define CASES_MODE(g, m, l2) CASE(g, m, MASTER, l2) CASE(g, m, MASTER_AND_PARAM, l2) CASE(g, m, REMAINDER, l2)
#define CASES_MOMENTS(g, l2) CASES_MODE(g, 0, l2) CASES_MODE(g, 1, l2)
#define CASES(l2) CASES_MOMENTS(0, l2) CASES_MOMENTS(1, l2)

/* The argument layout below; cpu_adam.py refuses a library whose number differs from its own. */
int oc_adam_abi(void) { return 3; }

/* The scalars in double, then each rounded once to float, as torch's kernel has them. */
static Consts constants(const double *hyper, int flags) {
  const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], wd = hyper[3];
  const double eps = hyper[4], step = hyper[5];
  const int adamw = flags & 1;
  const double bc1 = 1 - pow(beta1, step), bc2 = 1 - pow(beta2, step);
  const float w = (float)(1 - beta1);
  Consts k;
  k.factor = (float)hyper[6];
  k.sign = (flags & 2) ? -1.0f : 1.0f;
  k.wd = (float)wd;
  k.decay = adamw && wd != 0.0 ? (float)(1 - lr * wd) : 1.0f;
  k.small = fabsf(w) < 0.5f;
  k.coeff = k.small ? w : w - 1.0f;
  k.b2 = (float)beta2;
  k.c2 = (float)(1 - beta2);
  k.bc2s = (float)sqrt(bc2);
  k.eps = (float)eps;
  k.neg_step = (float)(-(lr / bc1));
  return k;
}

/* `update` for `kinds` as `oc_adam` takes them, the L2 bit as bit 4; -1 for unknown kinds. */
static int dispatch(int64_t n, float *master, int16_t *rem, uint16_t *param, const void *grad,
                    void *exp_avg, void *exp_avg_sq, const Consts *k, int kinds) {
  switch (kinds) {
    CASES(0)
    CASES(1)
    default:
      return -1;
  }
}

/* hyper: lr, beta1, beta2, weight_decay, eps, step, factor, in double as torch's kernel takes
 * them; flags: bit 0 AdamW, bit 1 maximize; kinds: bit 0 bf16 gradients, bit 1 bf16 moments,
 * bits 2-3 the mode. Returns 1 (nothing written) where *found_inf is set, -1 for unknown kinds,
 * else 0. */
int oc_adam(int64_t n, float *master, int16_t *rem, uint16_t *param, const void *grad,
            void *exp_avg, void *exp_avg_sq, const double *hyper, int flags, int kinds,
            const float *found_inf) {
  if (found_inf && *found_inf != 0.0f) return 1;
  const int l2 = !(flags & 1) && hyper[3] != 0.0;
  const Consts k = constants(hyper, flags);
  return dispatch(n, master, rem, param, grad, exp_avg, exp_avg_sq, &k, kinds | l2 << 4);
}

enum { LANES = 64 };

/* The OpenMP runtime torch steps with, if `cpu_spans.py` found and checked it: its
 * GOMP_parallel, omp_get_thread_num and omp_get_num_threads (this file links no runtime of its
 * own, so there is never a second one). Without it every call runs on the calling thread. */
typedef void (*Body)(void *);
static void (*run_parallel)(Body, void *, unsigned, unsigned);
static int (*thread_num)(void);
static int (*team_size)(void);

void oc_use_runtime(void (*parallel)(Body, void *, unsigned, unsigned), int (*num)(void),
                    int (*size)(void)) {
  run_parallel = parallel;
  thread_num = num;
  team_size = size;
}

/* Work cut into shares (`first[s]` .. `first[s + 1]` of the spans): thread t of a team of n
 * takes shares t, t + n, ... */
typedef struct {
  int64_t shares;
  const int64_t *first, *spans;
  const void *const *ptrs, *const *more;
  float *master;
  int16_t *rem;
  char *exp_avg, *exp_avg_sq;
  const Consts *k;
  int kinds, bf16;
  double *out;
} Job;

static void in_team(Body body, Job *job, int threads) {
  if (run_parallel && threads > 1 && job->shares > 1)
    run_parallel(body, job, (unsigned)threads, 0);
  else
    body(job);
}

static void me(int *t, int *n) {
  *t = run_parallel ? thread_num() : 0;
  *n = run_parallel ? team_size() : 1;
}

static void spans_body(void *arg) {
  const Job *j = arg;
  const int64_t size = (j->kinds & 2) ? 2 : 4; /* a moment's bytes */
  int t, n;
  me(&t, &n);
  for (int64_t s = t; s < j->shares; s += n)
    for (int64_t i = j->first[s]; i < j->first[s + 1]; i++) {
      const int64_t len = j->spans[2 * i], at = j->spans[2 * i + 1];
      dispatch(len, j->master ? j->master + at : 0, j->rem ? j->rem + at : 0,
               (uint16_t *)j->more[i], j->ptrs[i], j->exp_avg + at * size,
               j->exp_avg_sq + at * size, j->k, j->kinds);
    }
}

/* `oc_adam` over spans of flat buffers, cut into `shares` stepped by up to `threads` threads:
 * span i is `spans[2i]` elements from element `spans[2i + 1]` of `master` (or `rem`), `exp_avg`
 * and `exp_avg_sq`, its gradient at `grads[i]` and its parameter at `params[i]`. */
int oc_adam_spans(int64_t shares, const int64_t *first, const int64_t *spans,
                  const void *const *grads, const void *const *params, float *master,
                  int16_t *rem, void *exp_avg, void *exp_avg_sq, const double *hyper, int flags,
                  int kinds, const float *found_inf, int threads) {
  if (found_inf && *found_inf != 0.0f) return 1;
  if ((kinds & 0xC) > (REMAINDER << 2) || kinds & ~0xF) return -1;
  const int l2 = !(flags & 1) && hyper[3] != 0.0;
  const Consts k = constants(hyper, flags);
  Job job = {shares, first, spans, grads, params, master, rem, exp_avg, exp_avg_sq, &k,
             kinds | l2 << 4, 0, 0};
  in_team(spans_body, &job, threads);
  return 0;
}

/* The sum of squares of `n` fp32 or (`bf16`) bf16 values in double: fp32 over 64 lanes (four
 * vectors' worth, so the additions do not wait on each other) of 256 elements, each lane's sum
 * then added in fp64 (always inlined: each dtype its own loop). */
static inline __attribute__((always_inline)) double squares(int64_t n, const void *x,
                                                            const int bf16) {
  const uint16_t *x16 = x;
  const float *x32 = x;
  double lanes[LANES] = {0};
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    float acc[LANES] = {0};
    for (int b = 0; b < 256; b += LANES)
      for (int l = 0; l < LANES; l++) {
        const float y = bf16 ? widen(x16[i + b + l]) : x32[i + b + l];
        acc[l] += y * y;
      }
    for (int l = 0; l < LANES; l++) lanes[l] += acc[l];
  }
  for (; i < n; i++) {
    const float y = bf16 ? widen(x16[i]) : x32[i];
    lanes[0] += y * y;
  }
  double total = 0.0;
  for (int l = 0; l < LANES; l++) total += lanes[l];
  return total;
}

static void squares_body(void *arg) {
  const Job *j = arg;
  int t, n;
  me(&t, &n);
  for (int64_t s = t; s < j->shares; s += n) {
    double total = 0.0;
    for (int64_t i = j->first[s]; i < j->first[s + 1]; i++)
      total += j->bf16 ? squares(j->spans[i], j->ptrs[i], 1) : squares(j->spans[i], j->ptrs[i], 0);
    j->out[s] = total;
  }
}

/* Each share's sum of squares into `out[s]`: fp32 or (`bf16`) bf16 spans, `spans[i]`
 * elements at `ptrs[i]`, read once (a square beyond fp32's range is inf, as in an fp32 norm). */
void oc_sum_squares(int64_t shares, const int64_t *first, const int64_t *spans,
                    const void *const *ptrs, int bf16, double *out, int threads) {
  Job job = {shares, first, spans, ptrs, 0, 0, 0, 0, 0, 0, 0, bf16, out};
  in_team(squares_body, &job, threads);
}

/* Each thread of a team of `threads` writes its thread id (Linux's; 0 elsewhere) into
 * `tids[number]`: the check that the runtime is torch's, whose threads exist before the probe
 * (a second runtime starts threads of its own). */
static void probe_body(void *arg) {
  int t, n;
  me(&t, &n);
#ifdef __linux__
  ((int64_t *)arg)[t] = (int64_t)syscall(SYS_gettid);
#else
  ((int64_t *)arg)[t] = 0;
#endif
}

void oc_team_probe(int64_t *tids, int threads) {
  if (run_parallel) run_parallel(probe_body, tids, (unsigned)threads, 0);
}

enum { BLOCK = 32, SPAN = 64 * BLOCK };

/* Decode one block of `n` codes (always inlined: n = BLOCK is its own vectorized loop). */
static inline __attribute__((always_inline)) void decode(
    int n, const int8_t *restrict m_code, float m_scale, const uint8_t *restrict v_code,
    float v_top, const float *restrict values, float *restrict m, float *restrict v) {
  for (int i = 0; i < n; i++) m[i] = (float)m_code[i] * m_scale;
  for (int i = 0; i < n; i++) v[i] = values[v_code[i]] * v_top;
}

/* Code one block of `n` stepped moments as moment_codes.py codes it; its scales out. */
static inline __attribute__((always_inline)) void encode(
    int n, const float *restrict m, const float *restrict v, int8_t *restrict m_code,
    float *restrict m_scale, uint8_t *restrict v_code, float *restrict v_top,
    const float *restrict thresholds, const uint64_t *restrict pairs) {
  /* the largest |m| and v, compared as bits: non-negative floats order as their bits, NaN
   * above all (it wins, as in torch's amax) */
  uint32_t top_bits = 0, peak_bits = 0;
  for (int i = 0; i < n; i++) {
    Bits a, q;
    a.f = m[i];
    q.f = v[i];
    const uint32_t ma = a.u & 0x7FFFFFFFu, va = q.u & 0x7FFFFFFFu;
    top_bits = ma > top_bits ? ma : top_bits;
    peak_bits = va > peak_bits ? va : peak_bits;
  }
  Bits top, peak, lowest;
  top.u = top_bits;
  peak.u = peak_bits;
  /* the smallest power of two >= top / 127 (2^-126 at least): its exponent, one up unless
   * it is a power of two (as frexp and ldexp find it in moment_codes.py) */
  Bits t, power;
  t.f = top.f / 127.0f;
  t.f = t.f < 0x1p-126f ? 0x1p-126f : t.f;
  power.u = (t.u & 0x7F800000u) + ((t.u & 0x007FFFFFu) ? 0x00800000u : 0u);
  const float inverse = 1.0f / power.f; /* exact */
  *m_scale = power.f;
  *v_top = peak.f;
  for (int i = 0; i < n; i++) {
    const float q = nearbyintf(m[i] * inverse); /* m / power, exactly */
    m_code[i] = (int8_t)(q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q));
  }
  const float floor = peak.f < 0x1p-126f ? 0x1p-126f : peak.f, per_octave = 254.0f / 40.0f;
  lowest.f = thresholds[254];
  for (int i = 0; i < n; i++) {
    const float ratio = v[i] / floor;
    Bits x, q;
    x.f = ratio;
    q.f = v[i];
    const float log2_under = (float)(int32_t)x.u * 0x1p-23f - 127.0f; /* <= log2(ratio) */
    int c0 = (int)(-log2_under * per_octave + 0.5f) + 1;
    c0 = c0 < 1 ? 1 : c0;
    c0 = c0 > 255 ? 255 : c0;
    /* the thresholds either side of c0, in one load: (thresholds[c0 - 1], thresholds[c0]) */
    Bits above, below_t;
    above.u = (uint32_t)pairs[c0];
    below_t.u = (uint32_t)(pairs[c0] >> 32);
    int code = c0 + (below_t.f > ratio) - (above.f <= ratio);
    /* below the window (ratios >= 0 order as their bits): 255; v not > 0 (or NaN): 0; as
     * masks, which vectorize */
    const int below = -((int32_t)x.u < (int32_t)lowest.u);
    const int keep = -(((int32_t)q.u > 0) & ((int32_t)q.u <= 0x7F800000));
    code = (code & ~below) | (255 & below);
    v_code[i] = (uint8_t)(code & keep);
  }
}

/* Adam/AdamW over fp32 rows (`rows` x `cols`: parameters and gradients) whose moments are
 * 8-bit codes in blocks of BLOCK within a row (`containers.optim.moment_codes`): `m_code`
 * (int8) times the block's power of two `m_scale`; `v_code` (uint8) the entry of `values`
 * (256 fractions) times the block's maximum `v_top`. A span of blocks at a time is decoded,
 * stepped with the arithmetic of `update` (fp32 gradients and masters), and coded again as
 * moment_codes.py codes it: `thresholds` are its 256 padded thresholds (+inf, the 254 between
 * codes 1..255 descending, 0), and a second moment's code is the one they bracket (estimated
 * from its exponent bits, within 0.55 of it, then moved by one where they say). Returns 1
 * (nothing written) where *found_inf is set, else 0. */
int oc_adam_coded(int64_t rows, int64_t cols, float *restrict master,
                  const float *restrict grad, int8_t *restrict m_code, float *restrict m_scale,
                  uint8_t *restrict v_code, float *restrict v_top, const double *hyper,
                  int flags, const float *restrict values, const float *restrict thresholds,
                  const float *found_inf) {
  if (found_inf && *found_inf != 0.0f) return 1;
  const int l2 = !(flags & 1) && hyper[3] != 0.0;
  const Consts k = constants(hyper, flags);
  const int64_t blocks = (cols + BLOCK - 1) / BLOCK;
  float m[SPAN], v[SPAN];
  uint64_t pairs[256];
  for (int c = 1; c < 256; c++) {
    Bits above, below;
    above.f = thresholds[c - 1];
    below.f = thresholds[c];
    pairs[c] = (uint64_t)above.u | (uint64_t)below.u << 32;
  }
  pairs[0] = pairs[1]; /* (never read: codes are 1..255 here) */
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t c = 0; c < cols; c += SPAN) {
      const int64_t at = r * cols + c, s = r * blocks + c / BLOCK;
      const int len = (int)(cols - c < SPAN ? cols - c : SPAN);
      int b = 0;
      for (; (b + 1) * BLOCK <= len; b++)
        decode(BLOCK, m_code + at + b * BLOCK, m_scale[s + b], v_code + at + b * BLOCK,
               v_top[s + b], values, m + b * BLOCK, v + b * BLOCK);
      if (b * BLOCK < len)
        decode(len - b * BLOCK, m_code + at + b * BLOCK, m_scale[s + b],
               v_code + at + b * BLOCK, v_top[s + b], values, m + b * BLOCK, v + b * BLOCK);
      if (l2)
        update(len, master + at, 0, 0, grad + at, m, v, &k, 0, 0, MASTER, 1);
      else
        update(len, master + at, 0, 0, grad + at, m, v, &k, 0, 0, MASTER, 0);
      for (b = 0; (b + 1) * BLOCK <= len; b++)
        encode(BLOCK, m + b * BLOCK, v + b * BLOCK, m_code + at + b * BLOCK, m_scale + s + b,
               v_code + at + b * BLOCK, v_top + s + b, thresholds, pairs);
      if (b * BLOCK < len)
        encode(len - b * BLOCK, m + b * BLOCK, v + b * BLOCK, m_code + at + b * BLOCK,
               m_scale + s + b, v_code + at + b * BLOCK, v_top + s + b, thresholds, pairs);
    }
  }
  return 0;
}
