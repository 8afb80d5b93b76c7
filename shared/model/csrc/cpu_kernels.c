/* pdserve's CPU kernels for decode steps: shared.model.cpu_kernels compiles this file on first use (its _FLAGS:
   -O3 -ffp-contract=off -fopenmp ..., -march=native or PDSERVE_KERNEL_ARCH) and binds it through ctypes;
   shared.model.ops chooses, call by call, between these and the portable torch path. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

/* Scratch is small (KBs to a few MB); running out of it is fatal and said so, never a NULL dereference. */
static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) { fputs("pdserve cpu_kernels: out of memory\n", stderr); abort(); }
    return p;
}

static void *xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size);
    if (!p) { fputs("pdserve cpu_kernels: out of memory\n", stderr); abort(); }
    return p;
}

#define TILE 64  /* rows whose scores stay in cache between the softmax and p.V (64: batch-256 decode attention over
                    four layers' pools 4.5 % faster than 32, 32 heads 6.6 %; 96 and 128 between) */
#define HB 4     /* heads per register block */
#define CW 16    /* output dims per register block */
#define DW 8     /* query dims per register block: one 8-float vector */
#define SPAN 8     /* 8-value steps of a score pass between its asks for cache lines (attend_tiles) */
#define PV_SPAN 8  /* rows of a p.V pass between its asks for the next tile's lines */
#define SPANS(dim) (((dim) / DW + SPAN - 1) / SPAN)
#define AHEAD 8    /* rows the score pass asks for into L1 ahead of the one it scores (attend_tiles) */

/* GCC/Clang vector extensions: AVX2 registers on x86, NEON pairs on Arm (built with -march=native) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) ((v8) * (const v8u *)(p))
#define STORE(p, v) (*(v8u *)(p) = (v))

/* Fused multiply-adds are written out, never left to the compiler (built with -ffp-contract=off): whether
   GCC contracts `acc += a * b` depends on the loop around it and the target, so one row computed by two
   code paths (alone, or in a four-row pass beside other requests) could round differently. Spelled out,
   a row's bits are the source's on every compiler and ISA. fmaf is exact by C99, as is x86's vfmadd (the same
   bits): where the CPU has FMA the intrinsic is spelled out, since GCC turns the lane loop into one vfmadd
   only in simple loops and into 8 scalar ones inside the kernels' register blocks (measured: 3-4x slower). */
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__FMA__) && defined(__AVX__)
static inline v8 vfma(v8 a, v8 b, v8 c) {  /* a * b + c, rounded once per lane */
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
static inline v8 vfma(v8 a, v8 b, v8 c) {  /* a * b + c, rounded once per lane */
    v8 r;
    for (int e = 0; e < DW; e++) r[e] = fmaf(a[e], b[e], c[e]);
    return r;
}
#endif
static inline v8 splat(float f) { v8 r = {f, f, f, f, f, f, f, f}; return r; }

/* AVX512-BF16's vdpbf16ps: 16 bf16 products an instruction, summed into 8 fp32 lanes (the attention scores of
   bf16 queries over bf16 rows; the indexer's dots). */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8ui __attribute__((vector_size(32)));
typedef uint32_t v8uiu __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16)));

/* e^x of eight lanes x <= 0 (the softmax's score minus the running max), within 1 ulp of glibc's expf (every
   float in [-87, 0] compared): 2^n e^r with
   n = x / ln 2 rounded to nearest and |r| <= ln 2 / 2, r in two steps (ln 2 as a short high part and the rest),
   e^r by Cephes' degree-6 polynomial. Below -87 it gives 0 (expf: at most 1.6e-38 there; -inf 0), at 0 exactly
   1, NaN for NaN. Spelled with vfma, so every ISA computes the same bits. (expf a lane at a time, its sum kept in
   memory, took a sixth of a 4-head decode's attention.) */
static inline v8 vexp(v8 x) {
    const v8 lo = splat(-87.f), magic = splat(12582912.f);  /* 1.5 * 2^23: adding it rounds to an integer */
    v8 t = vfma(x, splat(1.44269504088896341f), magic), n = t - magic;
    v8 r = vfma(n, splat(-0.693359375f), x);
    r = vfma(n, splat(2.12194440e-4f), r);
    v8 p = splat(1.9875691500e-4f);
    p = vfma(p, r, splat(1.3981999507e-3f));
    p = vfma(p, r, splat(8.3334519073e-3f));
    p = vfma(p, r, splat(4.1665795894e-2f));
    p = vfma(p, r, splat(1.6666665459e-1f));
    p = vfma(p, r, splat(5.0000001201e-1f));
    v8 y = vfma(p, r * r, r) + splat(1.f);
    v8 pow2 = (v8)((((v8i)t - 0x4b400000) + 127) << 23);
    return (v8)(~(v8i)(x < lo) & (v8i)(y * pow2));
}

/* silu(g) = g / (1 + e^-g) of eight lanes, by vexp where it holds (x <= 0): e = e^-|g|, g / (1 + e) for g >= 0 and
   g e / (1 + e) below (the same value; e^|g| would overflow past 88). Every ISA computes the same bits; within
   2 ulp of the scalar g / (1 + expf(-g)) this replaced (one libm call a value; with the combine below in eight
   lanes too, a 256-row call of the tiny model's experts 0.91 -> 0.75 ms). Below -87 the exp flushes to 0: -0
   where silu is under 1e-35. NaN stays NaN, +inf gives +inf, -inf NaN (as torch's silu). */
static inline v8 vsilu(v8 g) {
    v8 e = vexp(-(v8)((v8i)g & 0x7fffffff));
    v8i negative = g < splat(0.f);
    v8 num = (v8)((negative & (v8i)(g * e)) | (~negative & (v8i)g));
    return num / (splat(1.f) + e);
}

/* An 8-lane vector's sum as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): sum4's order for one vector. */
static inline float hsum8(v8 a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* One value of a bf16 or fp32 array as fp32. */
static inline float widen(const void *p, int bf16, int64_t k) {
    if (!bf16) return ((const float *)p)[k];
    uint32_t u = (uint32_t)((const uint16_t *)p)[k] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t narrow(float f) {  /* fp32 -> bf16 bits, round to nearest even (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) {  /* f rounded to bf16 precision, kept fp32: torch's .to(bfloat16) */
    uint16_t h = narrow(f);
    return widen(&h, 1, 0);
}

/* Rows handled eight values at a time, each lane computing exactly what the scalar code computes for its value. */
static inline v8 vsel(v8i m, v8 a, v8 b) { return (v8)((m & (v8i)a) | (~m & (v8i)b)); }  /* m ? a : b per lane */

static inline v8 round_bf16x8(v8 f) {  /* round_bf16 of each lane (NaN: the canonical one, as narrow) */
    v8ui u = (v8ui)f, r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return vsel(f != f, (v8)((v8ui){0} + 0x7fc00000u), (v8)r);
}

static inline void put8(void *y, int y_bf16, int64_t k, v8 v) {  /* put of eight values */
    if (!y_bf16) {
        STORE((float *)y + k, v);
        return;
    }
    v8h h = __builtin_convertvector((v8ui)round_bf16x8(v) >> 16, v8h);
    memcpy((uint16_t *)y + k, &h, sizeof h);
}

static inline void put4(void *y, int y_bf16, int64_t k, v8 v) {  /* put of lanes 0-3 */
    if (!y_bf16) {
        memcpy((float *)y + k, &v, 4 * sizeof(float));
        return;
    }
    v8h h = __builtin_convertvector((v8ui)round_bf16x8(v) >> 16, v8h);
    memcpy((uint16_t *)y + k, &h, 4 * sizeof(uint16_t));
}

/* put of the four values at src, in four lanes (a matmul pass's outputs for one input row: gathering them into an
   8-lane register first, a lane at a time, took a sixth of a 4,096-row linear at k = 256). */
typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t v4ui __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));
static inline void put4_from(void *y, int y_bf16, int64_t k, const float *src) {
    if (!y_bf16) {
        memcpy((float *)y + k, src, 4 * sizeof(float));
        return;
    }
    v4f v;
    memcpy(&v, src, sizeof v);
    v4i nan = v != v;  /* round_bf16x8's rounding and NaN, four lanes (an unsigned compare for NaN cost 12 %) */
    v4ui u = (v4ui)v, h = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~(v4ui)nan) | ((v4ui)nan & 0x7fc0u);
    v4h b = __builtin_convertvector(h, v4h);
    memcpy((uint16_t *)y + k, &b, sizeof b);
}

/* Eight bf16 values as fp32 (exact: the bits moved up). */
static inline v8 bf16x8(const uint8_t *p) {
#if defined(__AVX2__)
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    uint16_t h[8];
    memcpy(h, p, sizeof h);
    v8i x = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]};
    return (v8)(x << 16);
#endif
}

/* Weights stored fp32 or bf16 (a bf16 model's, widened exactly in registers: the same products as its fp32
   copies'). */
static inline v8 wload(const void *w, int bf16, int64_t i) {
    return bf16 ? bf16x8((const uint8_t *)w + 2 * i) : LOAD((const float *)w + i);
}

/* How pool rows are stored: fp32 or bf16 rows as they are, or C8 MLA rows (shared.kvcache.layout.Int8LatentRows,
   bytes: int8 latent [latent] | fp32 scale per `group` latent dims [groups] | bf16 rope key [rope]). */
enum { ROWS_F32 = 0, ROWS_BF16 = 1, ROWS_C8 = 2 };
typedef struct {
    int kind;
    int64_t latent, group, groups, rope;  /* C8 rows only */
    int64_t elem, bytes;  /* bytes per stride element (4, 2, 1) and per row */
    int gshift;  /* C8: log2(group) (a power of two; latent, group and rope whole 8-value vectors) */
} RowFormat;

/* Eight int8 values as fp32 (exact). */
static inline v8 i8x8(const uint8_t *p) {
#if defined(__AVX2__)
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    int8_t b[8];
    memcpy(b, p, sizeof b);
    v8 r = {b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]};
    return r;
#endif
}

/* Eight values d..d+7 of a pool row as fp32, read in place: fp32 as stored, bf16 widened; of a C8 row the rope
   key's (d >= latent), widened from bf16 (its int8 latent is read by attend_tiles, scale per group). */
static inline v8 row_load(const void *row, const int kind, const RowFormat *f, int64_t d) {
    if (kind == ROWS_F32) return LOAD((const float *)row + d);
    if (kind == ROWS_BF16) return bf16x8((const uint8_t *)row + 2 * d);
    return bf16x8((const uint8_t *)row + f->latent + 4 * f->groups + 2 * (d - f->latent));
}

/* The scale of the C8 latent group holding dim d of a row. */
static inline float c8_scale(const void *row, const RowFormat *f, int64_t d) {
    float s;
    memcpy(&s, (const uint8_t *)row + f->latent + 4 * (d >> f->gshift), sizeof s);
    return s;
}

/* Ask for a row's cache lines ahead of its use (attention: rows a few ahead of the score pass; the indexer: the
   next tile's keys): rows sit in scattered blocks, past what the hardware prefetcher follows. */
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b);
}

/* The rows of the context positions [t0, t0 + TILE) of table row trow that count (below `count`, kept by the
   mask), in place: how many. A position naming no block or a slot outside the pool sets *bad and is skipped. */
static inline int tile_rows(const void *pool, const RowFormat *fmt, int64_t row_stride, int64_t num_slots,
                            const int64_t *trow, int64_t bs, const uint8_t *mrow, int64_t t0, int64_t count,
                            const void **rows, int32_t *bad) {
    const int64_t end = t0 + (count - t0 < TILE ? count - t0 : TILE);
    int used = 0;
    for (int64_t t = t0; t < end;) {  /* a block's positions at a time: one division a block, not a position */
        const int64_t b = t / bs, blk = trow[b], stop = (b + 1) * bs < end ? (b + 1) * bs : end;
        for (; t < stop; t++) {
            if (mrow && !mrow[t]) continue;
            int64_t slot = blk * bs + (t - b * bs);
            if (blk < 0 || slot >= num_slots) {
                *bad = 1;
                continue;
            }
            rows[used++] = (const char *)pool + slot * row_stride * fmt->elem;
        }
    }
    return used;
}

/* The context tiles of one query (its heads padded to hp, in qp): the running max, sum and p.V accumulators
   (mx, sum, acc) over the count positions of table row trow. `tiles` holds two tiles' row pointers: the next
   tile's are found first, so the score pass can ask for the cache lines of the rows AHEAD rows past the two it
   is at, into the next tile near this one's end (rows sit in scattered blocks, past what the hardware prefetcher
   follows). Measured on a decode step's rows (64 queries x 64 picks of 1,152 bytes, out of cache): 8 rows ahead
   beat a whole tile ahead (32 rows, more than L1 holds) by 10 %, 2 / 4 / 12 / 16 / 24 rows ahead by less; the
   score pass of the first head block first touches a row at about the same rate whatever the head count.
   after_trow / after_mrow / after_count: the query this thread runs next (NULL: none): during the last tile its
   first tile's rows stand in for the next tile's, so they are on their way before it starts (each thread takes
   its next query as it starts one; measured on decode steps' rows out of cache, 64-256 queries of 160-1,024
   positions: 3-12 % faster). Its
   own always-inlined function, called with a constant row format: the outlined OpenMP region would otherwise
   get one copy of the loops that tests the format at every 8-value step. */
#if HAVE_DPBF16
/* part[jj][hh] += the pair-order dots of bf16 query rows qb[h0 + hh] (dim apart) with bf16 rows a (jj 0) and b
   (jj 1) over dims [d0, d1), 16 a vdpbf16ps (d1 - d0 a multiple of 16; a[d], b[d] are dim d's values). */
static inline __attribute__((always_inline)) void
pair_scores_bf16(const uint16_t *qb, int64_t h0, int64_t dim, const uint16_t *a, const uint16_t *b, int64_t d0,
                 int64_t d1, v8 part[2][HB]) {
    for (int64_t d = d0; d < d1; d += 2 * DW) {
        __m256bh rv0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(a + d));
        __m256bh rv1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(b + d));
        for (int hh = 0; hh < HB; hh++) {
            __m256bh qv = (__m256bh)_mm256_loadu_si256((const __m256i *)(qb + (h0 + hh) * dim + d));
            part[0][hh] = (v8)_mm256_dpbf16_ps((__m256)part[0][hh], qv, rv0);
            part[1][hh] = (v8)_mm256_dpbf16_ps((__m256)part[1][hh], qv, rv1);
        }
    }
}
#endif

/* Rows' cache lines asked for ahead of their use a few at a time, paced through the arithmetic: the score pass
   takes this tile's rows AHEAD rows on into L1 a line an 8-value step, and the next tile's (or the following
   query's first) into L2 through the score pass and p.V, rather than in a burst of whole rows (a burst fills the
   core's miss buffers and the loads behind it wait). Measured on batch-256 decode attention over four layers'
   pools out of cache, 4 heads, one thread: 192 positions 1.17-1.2x faster (pacing only the L1 lines: 1.05x), 136
   positions 1.2x with attend_tiles' window; the engine's batch-256 decode steps 1.1x. A step of step_lines asks
   for `per` lines, and one more each time `credit` (the fraction `extra` / `steps` carried) passes a whole; the
   score and p.V loops call it every SPAN steps or PV_SPAN rows (every step: its state took registers from the
   arithmetic, 1.17x slower in cache). */
typedef struct {
    const void *const *rows;
    int n, at;              /* rows [n]; the next line's row */
    int64_t off, bytes;     /* the next line's offset in it; a row's bytes */
    int64_t per, extra, steps, credit;
} LineCursor;

static inline LineCursor line_cursor(const void *const *rows, int n, int64_t bytes) {
    return (LineCursor){rows, n, 0, 0, bytes, 0, 0, 1, 0};
}

static inline int64_t lines_left(const LineCursor *c) {
    return (int64_t)(c->n - c->at) * ((c->bytes + 63) / 64) - c->off / 64;
}

/* The next `lines` of c to be asked for over the next `steps` calls of step_lines. */
static inline void pace(LineCursor *c, int64_t lines, int64_t steps) {
    c->steps = steps > 0 ? steps : 1;
    c->per = lines / c->steps;
    c->extra = lines % c->steps;
    c->credit = 0;
}

/* The next k lines of c (fewer where it ends), into L1 or L2, a row's run at a time. */
static inline __attribute__((always_inline)) void ask_lines(LineCursor *c, int64_t k, const int to_l1) {
    while (k > 0 && c->at < c->n) {
        const char *row = c->rows[c->at];
        const int64_t end = c->off + 64 * k < c->bytes ? c->off + 64 * k : c->bytes;
        for (int64_t o = c->off; o < end; o += 64) {
            if (to_l1) __builtin_prefetch(row + o, 0, 3);
            else __builtin_prefetch(row + o, 0, 2);
        }
        k -= (end - c->off + 63) / 64;
        c->off = end;
        if (c->off >= c->bytes) { c->off = 0; c->at++; }
    }
}

static inline __attribute__((always_inline)) void step_lines(LineCursor *c, const int to_l1) {
    int64_t k = c->per;
    c->credit += c->extra;
    if (c->credit >= c->steps) { c->credit -= c->steps; k++; }
    ask_lines(c, k, to_l1);
}

/* One of `calls` even shares of what c has left, into L2 at once (p.V's bf16 blocks). */
static inline void share_lines(LineCursor *c, int64_t calls) {
    ask_lines(c, calls > 0 ? (lines_left(c) + calls - 1) / calls : 0, 0);
}

/* The rows AHEAD past rows j .. j + k - 1 of this tile (into the next tile's near its end), in soon[], as a
   cursor paced over `steps` calls: the score pass's L1 lines. */
static inline LineCursor rows_soon(const void *const *rows, int used, const void *const *next, int next_used, int j,
                                   int k, const void **soon, int64_t bytes, int64_t steps) {
    int n = 0;
    for (int f = j + AHEAD; f < j + AHEAD + k; f++)
        if (f < used || f - used < next_used) soon[n++] = f < used ? rows[f] : next[f - used];
    LineCursor c = line_cursor(soon, n, bytes);
    pace(&c, lines_left(&c), steps);
    return c;
}

#if HAVE_DPBF16
/* acc[hh, c] += sum_j p[hh, j] row_j[c] for HB heads (p: [HB][TILE] fp32, 0 past `used`; acc: [HB][out_dim]),
   p rounded to bf16 and the rows' bf16 values taken in pairs of rows by vdpbf16ps: 16 products an instruction
   where the fp32 pass does 8 and widens every value first. DeepSeek's own attention rounds its probabilities to
   bf16 before p.V; the products are exact and summed in fp32, two rows at a time. `pb`: [HB][TILE] bf16 scratch.
   Two rows' 16 values interleave (vpunpck, within 128-bit lanes) to the pairs of dims {0-3, 8-11} and
   {4-7, 12-15}: the accumulators are loaded and stored in that order. */
static inline __attribute__((always_inline)) void
pv_block_bf16(const uint32_t *pairs, const void *const *rows, int used, int64_t out_dim, int64_t c0, float *acc,
              const int blocks) {
    __m256 a[HB][4];  /* blocks (1 or 2) x 16 dims of HB heads: 8 or 16 accumulator chains */
    for (int hh = 0; hh < HB; hh++)
        for (int b = 0; b < blocks; b++) {
            const float *at = acc + hh * out_dim + c0 + 16 * b;
            __m256 lo = _mm256_loadu_ps(at), hi = _mm256_loadu_ps(at + 8);
            a[hh][2 * b] = _mm256_permute2f128_ps(lo, hi, 0x20);
            a[hh][2 * b + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
        }
    for (int j = 0; j < used; j += 2) {
        const uint16_t *x0 = (const uint16_t *)rows[j] + c0, *x1 = (const uint16_t *)rows[j + 1 < used ? j + 1 : j] + c0;
        __m256bh v[4];
        for (int b = 0; b < blocks; b++) {
            __m256i r0 = _mm256_loadu_si256((const __m256i *)(x0 + 16 * b));
            __m256i r1 = j + 1 < used ? _mm256_loadu_si256((const __m256i *)(x1 + 16 * b)) : _mm256_setzero_si256();
            v[2 * b] = (__m256bh)_mm256_unpacklo_epi16(r0, r1);
            v[2 * b + 1] = (__m256bh)_mm256_unpackhi_epi16(r0, r1);
        }
        for (int hh = 0; hh < HB; hh++) {
            __m256bh pv = (__m256bh)_mm256_set1_epi32((int)pairs[(hh * TILE + j) / 2]);
            for (int k = 0; k < 2 * blocks; k++) a[hh][k] = _mm256_dpbf16_ps(a[hh][k], pv, v[k]);
        }
    }
    for (int hh = 0; hh < HB; hh++)
        for (int b = 0; b < blocks; b++) {
            float *at = acc + hh * out_dim + c0 + 16 * b;
            _mm256_storeu_ps(at, _mm256_permute2f128_ps(a[hh][2 * b], a[hh][2 * b + 1], 0x20));
            _mm256_storeu_ps(at + 8, _mm256_permute2f128_ps(a[hh][2 * b], a[hh][2 * b + 1], 0x31));
        }
}

static inline __attribute__((always_inline)) void
pv_bf16(const float *p, const void *const *rows, int used, int64_t out_dim, float *acc, uint16_t *pb,
        LineCursor *later) {
    for (int hh = 0; hh < HB; hh++)
        for (int j = 0; j < used; j += DW)  /* lanes past used hold 0: an odd last row pairs with a zero */
            _mm_storeu_si128((__m128i *)(pb + hh * TILE + j), (__m128i)_mm256_cvtneps_pbh((__m256)LOAD(p + hh * TILE + j)));
    const uint32_t *pairs = (const uint32_t *)pb;
    int64_t c0 = 0;
    for (; c0 + 2 * CW <= out_dim; c0 += 2 * CW) {
        share_lines(later, (out_dim - c0) / (2 * CW));
        pv_block_bf16(pairs, rows, used, out_dim, c0, acc, 2);
    }
    for (; c0 < out_dim; c0 += CW) pv_block_bf16(pairs, rows, used, out_dim, c0, acc, 1);
}
#endif

/* Lane k of the result: the sum of the lanes of v[k / HB][k % HB] (2 x HB = 8 vectors, pairwise). */
static inline v8 lane_sums(v8 v[2][HB]) {
#if defined(__AVX__) && HB == 4
    __m256 t0 = _mm256_hadd_ps((__m256)v[0][0], (__m256)v[0][1]), t1 = _mm256_hadd_ps((__m256)v[0][2], (__m256)v[0][3]);
    __m256 t2 = _mm256_hadd_ps((__m256)v[1][0], (__m256)v[1][1]), t3 = _mm256_hadd_ps((__m256)v[1][2], (__m256)v[1][3]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8 r;
    for (int k = 0; k < 2 * HB; k++) {
        float sc = 0.f;
        for (int dd = 0; dd < DW; dd++) sc += v[k / HB][k % HB][dd];
        r[k] = sc;
    }
    return r;
#endif
}

#if HAVE_DPBF16
/* part[jj][hh] += the pair-order dots of bf16 query rows qb[h0 + hh] with the four bf16 rows r[jj] over all
   dim dims: 16 independent chains (each row's the same sums as pair_scores_bf16's), enough to hide
   vdpbf16ps's latency where two rows' 8 chains wait on it. */
static inline __attribute__((always_inline)) void
quad_scores_bf16(const uint16_t *qb, int64_t h0, int64_t dim, const uint16_t *const r[4], v8 part[4][HB]) {
    for (int64_t d = 0; d < dim; d += 2 * DW) {
        __m256bh rv[4];
        for (int jj = 0; jj < 4; jj++) rv[jj] = (__m256bh)_mm256_loadu_si256((const __m256i *)(r[jj] + d));
        for (int hh = 0; hh < HB; hh++) {
            __m256bh qv = (__m256bh)_mm256_loadu_si256((const __m256i *)(qb + (h0 + hh) * dim + d));
            for (int jj = 0; jj < 4; jj++) part[jj][hh] = (v8)_mm256_dpbf16_ps((__m256)part[jj][hh], qv, rv[jj]);
        }
    }
}
#endif

/* AVX-512 without changing a sum's order: two rows' 8 lanes (scores) or 16 more output dims (p.V) side by side in
   one 16-lane register, every lane's FMA chain the 8-lane path's, so a row's bits are the same on every ISA, at
   twice the values an instruction; four rows (or 32 dims) by HB heads keep 8 chains in flight, as the 8-lane
   path's two rows (16 dims) do. */
#if defined(__AVX512F__)
#define HAVE_ZMM_ATTEND 1
/* Values d..d+7 of rows a (lanes 0-7) and b (lanes 8-15): fp32 as stored, bf16 widened exactly. */
static inline __m512 rows_side_by_side(const void *a, const void *b, const int kind, int64_t d) {
    if (kind == ROWS_F32)
        return _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castpd256_pd512(_mm256_loadu_pd((const double *)((const float *)a + d))),
            _mm256_loadu_pd((const double *)((const float *)b + d)), 1));
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)a + d))),
                                        _mm_loadu_si128((const __m128i *)((const uint16_t *)b + d)), 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Lane 4 jj + hh: the lanes of z[k] summed in lanes_in_order's order, times scale, where z[k] holds head hh = k % 4's
   8 lanes for rows jj = 2 (k / 4) (lanes 0-7) and 2 (k / 4) + 1 (lanes 8-15): the two 8 x 8 blocks transposed
   by shuffles (each column one lane of the 16 sums), then added column by column from zero: the bits of 16 scalar
   chains of additions in far fewer instructions (skipping the scalar sums made a hot-cache call 12 % faster; the
   transpose ~7 %). Written for HB = 4. */
#if HB != 4
#error "in_order_sums16 and quad_scores_zmm hold HB = 4 heads"
#endif
static inline __m512 in_order_sums16(const __m512 z[8], float scale) {
    __m512 t[8], u[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm512_unpacklo_ps(z[k], z[k + 1]);
        t[k + 1] = _mm512_unpackhi_ps(z[k], z[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44);
        u[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
        u[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44);
        u[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    /* column l (lanes l, l + 4 of each 8-lane half: u[l % 4]'s 128-bit lane l / 4 and lane 2 + l / 4, with
       u[4 + l % 4]'s), its lanes (row jj, head hh) at 4 jj + hh */
    __m512 sum = _mm512_setzero_ps();
    for (int l = 0; l < DW; l++) {
        const int a = l % 4, half = l / 4;
        sum = _mm512_add_ps(sum, _mm512_shuffle_f32x4(u[a], u[4 + a], half ? 0xDD : 0x88));
    }
    return _mm512_mul_ps(sum, _mm512_set1_ps(scale));
}

/* Scores of query rows qp[h0 + hh] (dim apart) against rows r[jj] (jj < 4), lane 4 jj + hh: each the 8-lane
   scores loop's chains (attend_tiles), two rows a register, summed as lanes_in_order sums them. */
static inline __attribute__((always_inline)) __m512
quad_scores_zmm(const float *qp, int64_t h0, int64_t dim, const void *const r[4], const int kind, float scale,
                LineCursor *soon, LineCursor *later) {
    __m512 acc[2][HB];
    for (int p = 0; p < 2; p++)
        for (int hh = 0; hh < HB; hh++) acc[p][hh] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < dim; d0 += SPAN * DW) {
        step_lines(soon, 1);
        step_lines(later, 0);
        for (int64_t d = d0; d < d0 + SPAN * DW && d < dim; d += DW) {
            __m512 rv0 = rows_side_by_side(r[0], r[1], kind, d), rv1 = rows_side_by_side(r[2], r[3], kind, d);
            for (int hh = 0; hh < HB; hh++) {
                __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)(qp + (h0 + hh) * dim + d))));
                acc[0][hh] = _mm512_fmadd_ps(qv, rv0, acc[0][hh]);
                acc[1][hh] = _mm512_fmadd_ps(qv, rv1, acc[1][hh]);
            }
        }
    }
    const __m512 z[8] = {acc[0][0], acc[0][1], acc[0][2], acc[0][3], acc[1][0], acc[1][1], acc[1][2], acc[1][3]};
    return in_order_sums16(z, scale);
}

/* acc[hh, c] += sum_j p[hh, j] row_j[c] for the 32 x `blocks` (1 or 2) dims from c0 of HB heads (p: [HB][TILE],
   acc: [HB][out_dim]): the 8-lane p.V's chains (one per output lane, rows in order), 16 lanes a register. bf16 rows
   take one 64-byte load per 32 dims, widened exactly by interleaving zero words below them (vpunpck{l,h}wd: one
   shuffle per 16 values where widen-and-shift takes two instructions and a 256-bit load), which leaves dims
   {0-3, 8-11, 16-19, 24-27} in the first register and {4-7, 12-15, 20-23, 28-31} in the second: the products and
   each dim's chain are the same, so are the sums; the accumulators stay in that order for the whole query (zero
   and the softmax's rescaling do not care) and block_order_to_dims puts them back at its end (32 heads 6 %
   faster). Two blocks at once keep 16 chains in flight, each probability broadcast once for four registers. A
   row's step asks for the next of `later`'s lines. */
static inline __attribute__((always_inline)) void
pv_block_zmm(const float *p, const void *const *rows, int used, int64_t c0, float *acc, int64_t out_dim,
             const int kind, const int blocks, LineCursor *later) {
    __m512 a[HB][4];
    for (int hh = 0; hh < HB; hh++)
        for (int k = 0; k < 2 * blocks; k++) a[hh][k] = _mm512_loadu_ps(acc + hh * out_dim + c0 + 16 * k);
    const __m512i zero = _mm512_setzero_si512();
    for (int j = 0; j < used; j++) {
        if (j % PV_SPAN == 0) step_lines(later, 0);
        __m512 r[4];
        for (int b = 0; b < blocks; b++)
            if (kind == ROWS_F32) {
                r[2 * b] = _mm512_loadu_ps((const float *)rows[j] + c0 + 32 * b);
                r[2 * b + 1] = _mm512_loadu_ps((const float *)rows[j] + c0 + 32 * b + 16);
            } else {
                __m512i v = _mm512_loadu_si512((const uint16_t *)rows[j] + c0 + 32 * b);
                r[2 * b] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
                r[2 * b + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
            }
        for (int hh = 0; hh < HB; hh++) {
            __m512 pv = _mm512_set1_ps(p[hh * TILE + j]);
            for (int k = 0; k < 2 * blocks; k++) a[hh][k] = _mm512_fmadd_ps(pv, r[k], a[hh][k]);
        }
    }
    for (int hh = 0; hh < HB; hh++)
        for (int k = 0; k < 2 * blocks; k++) _mm512_storeu_ps(acc + hh * out_dim + c0 + 16 * k, a[hh][k]);
}

/* acc's 32-dim blocks [0, blocks_end) from pv_block_zmm's bf16 order back to dims in order, for `heads` heads. */
static inline void block_order_to_dims(float *acc, int64_t heads, int64_t out_dim, int64_t blocks_end) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t h = 0; h < heads; h++)
        for (int64_t c0 = 0; c0 + 32 <= blocks_end; c0 += 32) {
            float *at = acc + h * out_dim + c0;
            __m512 lo = _mm512_loadu_ps(at), hi = _mm512_loadu_ps(at + 16);
            _mm512_storeu_ps(at, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(at + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
}
#else
#define HAVE_ZMM_ATTEND 0
#endif

/* The largest of scores sh[0 .. used) (NaN skipped, -inf if none): eight lanes at a time, then across them (a
   maximum is the same in any order, but for the sign of a zero max, which the softmax's exps do not see). */
static inline float tile_max_of(const float *sh, int used) {
    v8 m = splat(-INFINITY);
    for (int j = 0; j < used; j += DW) {
        v8i lane = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + j;
        v8 v = vsel(lane < used, LOAD(sh + j), splat(-INFINITY));
        m = vsel(v > m, v, m);
    }
    float best = -INFINITY;
    for (int l = 0; l < DW; l++) best = m[l] > best ? m[l] : best;
    return best;
}

/* A score: the lanes of an 8-lane dot summed in order, times the scale (every scores path but vdpbf16ps'). */
static inline float lanes_in_order(v8 v, float scale) {
    float sc = 0.f;
    for (int dd = 0; dd < DW; dd++) sc += v[dd];
    return sc * scale;
}

/* Intel AMX (TMUL, Sapphire Rapids on): a bf16 tile product, 16 rows by up to 16 columns by 32 pair products
   (TDPBF16PS), in the time vdpbf16ps makes 16 products of one row: a 4-head decode's scores over bf16 rows ran
   at 77-94 GFLOP/s through the ymm pairs. Each output is one fp32 chain over its pairs in order, whatever the
   other rows and columns of the tile are: a row's score is the same however the query is batched. Linux hands
   a process the tile state only when asked (arch_prctl); where it does not, nothing takes this path. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && HAVE_DPBF16 && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
extern long syscall(long number, ...);  /* unistd.h declares it only outside strict C11 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) AmxConfig;

/* 1 once this process may use the tile registers (asked for on first call), else 0. */
static int amx_usable(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* This thread's eight tiles, each 16 rows of 64 bytes (16 fp32 sums, or 32 bf16 values: 16 pairs): amx_scores
   and amx_pv take 0-3 for sums (four chains in flight: a product waits on the last into its tile) and 4-7 for
   their operands. A head group is 16 wide whatever the heads (zeros past them): a product's time goes by its rows. */
static void amx_configure(void) {
    AmxConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A query's bf16 heads qb [hp][dim] as the tile product's second operand: for each group of 16 heads (zeros
   past hp) and 32-dim chunk, 16 rows of dim pairs, each row the group's heads' pairs side by side. */
static void amx_query(const uint16_t *qb, int64_t hp, int64_t dim, uint32_t *qv) {
    const int64_t chunks = dim / 32, groups = (hp + 15) / 16;
    const int cols = 16;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kc = 0; kc < chunks; kc++)
            for (int k = 0; k < 16; k++)
                for (int c = 0; c < cols; c++) {
                    const int64_t h = g * cols + c;
                    uint32_t pair = 0;
                    if (h < hp) memcpy(&pair, qb + h * dim + kc * 32 + 2 * k, sizeof pair);
                    qv[((g * chunks + kc) * 16 + k) * cols + c] = pair;
                }
}

#define AMX_ROWS(r, a) if (sets > r) { _tile_loadd(a, base[r] + kc * 64, stride[r]); _tile_dpbf16ps(r, a, 6); }
#define AMX_OUT(r) if (sets > r) _tile_stored(r, out + r * 16 * cols, 4 * cols);

/* score[h * TILE + j] = scale * (q_h . row_j) for every head h < hp and tile row j < used (at most TILE), in
   16-row sets: each read in place where its rows are evenly spaced (a block's slots), else copied to `copy`
   [TILE][dim] first. */
static void amx_scores(const uint32_t *qv, int64_t hp, int64_t dim, const void *const *rows, int used,
                       int64_t row_stride, float scale, float *score, uint16_t *copy) {
    const int64_t chunks = dim / 32, groups = (hp + 15) / 16;
    const int cols = 16;
    const int sets = (used + 15) / 16;
    const uint8_t *base[TILE / 16];
    int64_t stride[TILE / 16];
    float out[TILE * 16];
    for (int r = 0; r < sets; r++) {
        const int j = 16 * r, n = used - j < 16 ? used - j : 16;
        int even = n == 16;
        base[r] = rows[j];
        stride[r] = row_stride;
        for (int i = 1; even && i < 16; i++) even = (const uint8_t *)rows[j + i] == base[r] + i * row_stride;
        if (!even) {
            uint16_t *to = copy + j * dim;
            for (int i = 0; i < 16; i++) memcpy(to + i * dim, rows[j + (i < n ? i : 0)], sizeof(uint16_t) * dim);
            base[r] = (const uint8_t *)to;
            stride[r] = sizeof(uint16_t) * dim;
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kc = 0; kc < chunks; kc++) {
            _tile_loadd(6, qv + (g * chunks + kc) * 16 * cols, 4 * cols);
            AMX_ROWS(0, 4) AMX_ROWS(1, 5) AMX_ROWS(2, 4) AMX_ROWS(3, 5)
        }
        AMX_OUT(0) AMX_OUT(1) AMX_OUT(2) AMX_OUT(3)
        for (int c = 0; c < cols && g * cols + c < hp; c++)
            for (int j = 0; j < used; j++) score[(g * cols + c) * TILE + j] = out[j * cols + c] * scale;
    }
}
#undef AMX_ROWS
#undef AMX_OUT

#define AMX_PV(r, a, b) if (blocks > r) { \
    _tile_loadd(b, vv + kc * 16 * 2 * out_dim + 32 * (c + r), 4 * out_dim); _tile_dpbf16ps(r, a, b); }
#define AMX_ACC(r, op) if (blocks > r) op(r, acc + h16 * out_dim + 16 * (c + r), 4 * out_dim);

/* acc[h, c] += sum_j p[h, j] row_j[c] for every head h < hp (p: score [hp][TILE] fp32; acc [16-padded hp][out_dim],
   out_dim a multiple of 32) over the tile's `used` rows, as pv_bf16 computes them: p rounded to bf16 (pb:
   [16-padded hp][TILE], zeros past hp and used), the rows' bf16 values in pairs of rows, each product exact and
   summed in fp32. The rows are interleaved in pairs once (vv: [TILE / 2][2 out_dim], a zero row past used; the
   next tile's rows asked for into cache meanwhile), then 16 heads by 64 dims by 32 rows a set of tile products. */
static void amx_pv(const float *score, int64_t hp, const void *const *rows, int used, const void *const *next,
                   int next_used, int64_t row_bytes, int64_t out_dim, float *acc, uint16_t *pb, uint16_t *vv) {
    const int64_t groups = (hp + 15) / 16;
    const int chunks = (used + 31) / 32;
    for (int64_t h = 0; h < 16 * groups; h++)
        for (int j = 0; j < 32 * chunks; j += 16) {
            __m512 p = h < hp ? _mm512_loadu_ps(score + h * TILE + j) : _mm512_setzero_ps();
            p = _mm512_maskz_mov_ps((__mmask16)(j + 16 <= used ? 0xffff : j < used ? (1u << (used - j)) - 1 : 0), p);
            _mm256_storeu_si256((__m256i *)(pb + h * TILE + j), (__m256i)_mm512_cvtneps_pbh(p));
        }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int k = 0; k < 16 * chunks; k++) {
        for (int f = 2 * k; f < 2 * k + 2; f++)
            if (f < next_used) prefetch_row(next[f], row_bytes);
        const uint16_t *a = 2 * k < used ? rows[2 * k] : NULL, *b = 2 * k + 1 < used ? rows[2 * k + 1] : NULL;
        uint16_t *to = vv + (int64_t)k * 2 * out_dim;
        for (int64_t c = 0; c < out_dim; c += 32) {
            __m512i va = a ? _mm512_loadu_si512(a + c) : _mm512_setzero_si512();
            __m512i vb = b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(to + 2 * c, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_storeu_si512(to + 2 * c + 32, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
    const int64_t nb = out_dim / 16;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t h16 = 16 * g;
        _tile_loadd(4, pb + h16 * TILE, 2 * TILE);
        if (chunks > 1) _tile_loadd(5, pb + h16 * TILE + 32, 2 * TILE);
        for (int64_t c = 0; c < nb; c += 4) {
            const int64_t blocks = nb - c < 4 ? nb - c : 4;
            AMX_ACC(0, _tile_loadd) AMX_ACC(1, _tile_loadd) AMX_ACC(2, _tile_loadd) AMX_ACC(3, _tile_loadd)
            int kc = 0;
            AMX_PV(0, 4, 6) AMX_PV(1, 4, 7) AMX_PV(2, 4, 6) AMX_PV(3, 4, 7)
            if (chunks > 1) {
                kc = 1;
                AMX_PV(0, 5, 6) AMX_PV(1, 5, 7) AMX_PV(2, 5, 6) AMX_PV(3, 5, 7)
            }
            AMX_ACC(0, _tile_stored) AMX_ACC(1, _tile_stored) AMX_ACC(2, _tile_stored) AMX_ACC(3, _tile_stored)
        }
    }
}
#undef AMX_PV
#undef AMX_ACC
#else
#define HAVE_AMX 0
#endif

static inline __attribute__((always_inline)) void
attend_tiles(const float *qp, const uint16_t *qb, int64_t hp, int64_t dim, const void *pool, const RowFormat *fmt,
             int64_t row_stride, int64_t num_slots, const int64_t *trow, int64_t bs, const uint8_t *mrow,
             int64_t count, float scale, int64_t out_dim, float *acc, float *mx, float *sum, float *score,
             float *scaled, uint16_t *wide, const void **tiles, int32_t *bad, const int64_t *after_trow,
             const uint8_t *after_mrow, int64_t after_count, const uint32_t *qv, uint16_t *copy, uint16_t *vv,
             uint16_t *pb, const int kind) {
    (void)qb; (void)wide; (void)qv; (void)copy; (void)vv; (void)pb;  /* read where the build has vdpbf16ps / AMX */
    /* C8 with a bf16 query: the tile's int8 latents widened to bf16 once (exact), 16 values an instruction, so
       every head block scores them by vdpbf16ps (measured against widening to fp32 as they are read: 32 heads
       1.17-1.33x faster, 128 heads 1.22x, 4 heads 1.18-1.22x) */
    const int widened = HAVE_DPBF16 && kind == ROWS_C8 && qb;
    int cur = 0, asked = 0;  /* asked: the following query's first rows asked for with this one's next-to-last tile */
    int used = tile_rows(pool, fmt, row_stride, num_slots, trow, bs, mrow, 0, count, tiles, bad);
    for (int f = 0; f < AHEAD && f < used; f++) prefetch_row(tiles[f], fmt->bytes);
    for (int64_t t0 = 0; t0 < count; t0 += TILE, cur ^= 1) {
        const void **rows = tiles + cur * TILE, **next = tiles + (cur ^ 1) * TILE;
        int32_t ignored = 0;  /* the following query's positions are checked when it runs */
        int next_used = t0 + TILE < count
            ? tile_rows(pool, fmt, row_stride, num_slots, trow, bs, mrow, t0 + TILE, count, next, bad)
            : after_trow ? tile_rows(pool, fmt, row_stride, num_slots, after_trow, bs, after_mrow, 0, after_count,
                                     next, &ignored) : 0;
        if (!used) { used = next_used; continue; }
#if HAVE_DPBF16
        for (int j = 0; widened && j < used; j++) {  /* int8 values are bf16 exactly: one widening for every head */
            int f = j + AHEAD;
            if (f < used || f - used < next_used) prefetch_row(f < used ? rows[f] : next[f - used], fmt->bytes);
            const uint8_t *src = rows[j];
            uint16_t *dst = wide + j * fmt->latent;
            for (int64_t d = 0; d < fmt->latent; d += 2 * DW) {  /* 16 values an instruction (zmm) */
                __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + d))));
                _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
#endif
        /* the next tile's rows into L2: half through the first head block's score pass, the rest through its p.V */
        LineCursor later = line_cursor(next, next_used, fmt->bytes);
        if (t0 + TILE >= count) {  /* the last tile: the following query's first rows, less those asked for */
            later.at = asked < next_used ? asked : next_used;
            asked = 0;
        } else if (t0 + 2 * TILE >= count && next_used < TILE && after_trow) {
            /* the next tile is this query's last and short: the following query's first rows fill a tile's worth,
               so a short last tile does not have to ask for a whole tile's rows in its short time */
            const void **window = tiles + 2 * TILE;
            int32_t ignored = 0;
            memcpy(window, next, sizeof(*window) * next_used);
            const int64_t fill = TILE - next_used < after_count ? TILE - next_used : after_count;
            asked = tile_rows(pool, fmt, row_stride, num_slots, after_trow, bs, after_mrow, 0, fill,
                              window + next_used, &ignored);
            later = line_cursor(window, next_used + asked, fmt->bytes);
        }
        for (int64_t h0 = 0; h0 < hp; h0 += HB) {
            const int zmm_rows = HAVE_ZMM_ATTEND && kind != ROWS_C8 && !(HAVE_DPBF16 && kind == ROWS_BF16 && qb);
            const int paced = kind != ROWS_C8 && !(HAVE_DPBF16 && kind == ROWS_BF16 && qb);  /* scored in d steps */
            const int per_pass = zmm_rows ? 4 : 2;
            pace(&later, paced ? lines_left(&later) / 2 : 0, (used + per_pass - 1) / per_pass * SPANS(dim));
#if HAVE_AMX
            if (kind == ROWS_BF16 && qv && h0 == 0)  /* every head's scores, by tile products */
                amx_scores(qv, hp, dim, rows, used, row_stride * fmt->elem, scale, score, copy);
#endif
#if HAVE_DPBF16
            /* bf16: four rows at a time, their lanes summed in a tree (lane_sums). Only generated rows of a bf16
               model come here (prompt rows of bf16 models keep the portable path); fp32 rows keep the in-order
               sums below, which fp32 prompt tokens taking this kernel share with the decodes' */
            for (int j = 0; kind == ROWS_BF16 && qb && !qv && j < used; j += 4) {
                const uint16_t *r[4];
                for (int jj = 0; jj < 4; jj++) r[jj] = rows[j + jj < used ? j + jj : j];
                for (int f = j + AHEAD; h0 == 0 && f < j + AHEAD + 4; f++)  /* this tile's, then the next's */
                    if (f < used || f - used < next_used) prefetch_row(f < used ? rows[f] : next[f - used], fmt->bytes);
                v8 part[4][HB] = {{{0}}};
                quad_scores_bf16(qb, h0, dim, r, part);
                v8 sums[2] = {lane_sums(part) * splat(scale), lane_sums(part + 2) * splat(scale)};
                for (int jj = 0; jj < 4 && j + jj < used; jj++)
                    for (int hh = 0; hh < HB; hh++) score[(h0 + hh) * TILE + j + jj] = sums[jj / 2][jj % 2 * HB + hh];
            }
#endif
            /* fp32 or bf16 rows with AVX-512: the loop below's sums, four rows at a time, two a register */
#if HAVE_ZMM_ATTEND
            for (int j = 0; zmm_rows && j < used; j += 4) {
                const void *r[4], *ahead[4];
                for (int jj = 0; jj < 4; jj++) r[jj] = rows[j + jj < used ? j + jj : j];
                LineCursor soon = rows_soon(rows, used, next, next_used, j, h0 == 0 ? 4 : 0, ahead, fmt->bytes,
                                            SPANS(dim));
                float sums[16];
                _mm512_storeu_ps(sums, quad_scores_zmm(qp, h0, dim, r, kind, scale, &soon, &later));
                for (int jj = 0; jj < 4 && j + jj < used; jj++)
                    for (int hh = 0; hh < HB; hh++) score[(h0 + hh) * TILE + j + jj] = sums[4 * jj + hh];
            }
#endif
            /* scores of HB heads against the tile's rows, two rows at a time: each query chunk loaded
               once for two rows, each row chunk once for HB heads (a row's sums are the same alone) */
            for (int j = 0; !zmm_rows && !(HAVE_DPBF16 && kind == ROWS_BF16 && qb) && j < used; j += 2) {
                const void *r0 = rows[j], *r1 = rows[j + 1 < used ? j + 1 : j], *ahead[2];
                LineCursor soon = rows_soon(rows, used, next, next_used, j, h0 == 0 && !widened ? 2 : 0, ahead,
                                            fmt->bytes, SPANS(dim));
                if (!paced) ask_lines(&soon, lines_left(&soon), 1);  /* C8: the whole rows now (scored by group) */
                v8 part[2][HB] = {{{0}}};
                int64_t d0 = 0;
#if HAVE_DPBF16
                if (kind == ROWS_BF16 && qb) {  /* bf16 query and rows: 16 dims a vdpbf16ps, pairs as stored */
                    pair_scores_bf16(qb, h0, dim, r0, r1, 0, dim, part);
                    d0 = dim;
                }
                if (widened) {  /* C8, bf16 query: per group the bf16 dots of the widened int8 values, times its scale */
                    const uint16_t *w0 = wide + j * fmt->latent, *w1 = wide + (j + 1 < used ? j + 1 : j) * fmt->latent;
                    for (int64_t g0 = 0; g0 < fmt->latent; g0 += fmt->group) {
                        int64_t g1 = g0 + fmt->group < fmt->latent ? g0 + fmt->group : fmt->latent;  /* a partial last */
                        v8 grp[2][HB] = {{{0}}};
                        pair_scores_bf16(qb, h0, dim, w0, w1, g0, g1, grp);
                        v8 s0 = splat(c8_scale(r0, fmt, g0)), s1 = splat(c8_scale(r1, fmt, g0));
                        for (int hh = 0; hh < HB; hh++) {
                            part[0][hh] = vfma(grp[0][hh], s0, part[0][hh]);
                            part[1][hh] = vfma(grp[1][hh], s1, part[1][hh]);
                        }
                    }
                    /* the bf16 rope key as stored: dim d at key[d - latent] */
                    const int64_t rope_at = fmt->latent + 4 * fmt->groups;
                    pair_scores_bf16(qb, h0, dim, (const uint16_t *)((const uint8_t *)r0 + rope_at) - fmt->latent,
                                     (const uint16_t *)((const uint8_t *)r1 + rope_at) - fmt->latent, fmt->latent, dim,
                                     part);
                    d0 = dim;
                }
#endif
                for (int64_t g0 = 0; kind == ROWS_C8 && !widened && g0 < fmt->latent; g0 += fmt->group) {
                    /* per group: the int8 dots, then times the group's scale (one multiply); the rope key after */
                    int64_t g1 = g0 + fmt->group < fmt->latent ? g0 + fmt->group : fmt->latent;
                    v8 grp[2][HB] = {{{0}}};
                    for (int64_t d = g0; d < g1; d += DW) {
                        v8 rv0 = i8x8((const uint8_t *)r0 + d), rv1 = i8x8((const uint8_t *)r1 + d);
                        for (int hh = 0; hh < HB; hh++) {
                            v8 qv = LOAD(qp + (h0 + hh) * dim + d);
                            grp[0][hh] = vfma(qv, rv0, grp[0][hh]);
                            grp[1][hh] = vfma(qv, rv1, grp[1][hh]);
                        }
                    }
                    v8 s0 = splat(c8_scale(r0, fmt, g0)), s1 = splat(c8_scale(r1, fmt, g0));
                    for (int hh = 0; hh < HB; hh++) {
                        part[0][hh] = vfma(grp[0][hh], s0, part[0][hh]);
                        part[1][hh] = vfma(grp[1][hh], s1, part[1][hh]);
                    }
                    d0 = g1;
                }
                for (; d0 < dim; d0 += SPAN * DW) {
                    step_lines(&soon, 1);
                    step_lines(&later, 0);
                    for (int64_t d = d0; d < d0 + SPAN * DW && d < dim; d += DW) {
                        v8 rv0 = row_load(r0, kind, fmt, d), rv1 = row_load(r1, kind, fmt, d);
                        for (int hh = 0; hh < HB; hh++) {
                            v8 qv = LOAD(qp + (h0 + hh) * dim + d);
                            part[0][hh] = vfma(qv, rv0, part[0][hh]);
                            part[1][hh] = vfma(qv, rv1, part[1][hh]);
                        }
                    }
                }
                for (int jj = 0; jj < 2 && j + jj < used; jj++)
                    for (int hh = 0; hh < HB; hh++) score[(h0 + hh) * TILE + j + jj] = lanes_in_order(part[jj][hh], scale);
            }
            /* online softmax: rescale what was accumulated if the running max grew */
            for (int hh = 0; hh < HB; hh++) {
                int64_t h = h0 + hh;
                float *sh = score + h * TILE, tile_max = tile_max_of(sh, used);
                float new_max = tile_max > mx[h] ? tile_max : mx[h];
                float alpha = expf(mx[h] - new_max);  /* 0 on the first tile */
                if (alpha != 1.f) {
                    float *ah = acc + h * out_dim;
                    for (int64_t c = 0; c < out_dim; c++) ah[c] *= alpha;
                }
                sum[h] *= alpha;
                mx[h] = new_max;
                v8 tot = splat(0.f);
                for (int j = 0; j < used; j += DW) {  /* lanes past `used` (stale scores) give 0 */
                    v8i lane = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + j;
                    v8 e = (v8)((v8i)(lane < used) & (v8i)vexp(LOAD(sh + j) - splat(new_max)));
                    STORE(sh + j, e);
                    tot += e;
                }
                sum[h] += hsum8(tot);
            }
            /* C8: each probability times its row's group scales, once a tile (scaled [HB][groups][TILE]) */
            for (int hh = 0; kind == ROWS_C8 && hh < HB; hh++)
                for (int64_t g = 0; g < fmt->groups; g++)
                    for (int j = 0; j < used; j++)
                        scaled[(hh * fmt->groups + g) * TILE + j] =
                            score[(h0 + hh) * TILE + j] * c8_scale(rows[j], fmt, g << fmt->gshift);
#if HAVE_AMX
            if (kind == ROWS_BF16 && qv) {  /* every head's p.V after the last head block's softmax */
                if (h0 + HB >= hp)
                    amx_pv(score, hp, rows, used, next, next_used, fmt->bytes, out_dim, acc, pb, vv);
                continue;
            }
#endif
#if HAVE_DPBF16
            if (kind == ROWS_BF16 && qb) {  /* a bf16 query over bf16 rows: p.V in bf16 pairs, as DeepSeek's */
                pv_bf16(score + h0 * TILE, rows, used, out_dim, acc + h0 * out_dim, (uint16_t *)scaled, &later);
                continue;
            }
#endif
            /* acc[h, c] += sum_j p[h, j] row_j[c], HB x CW accumulators held in registers (C8: int8 values, the
               scale in p; a CW block lies in one group); the next tile's lines left paced over its row steps */
            const int64_t zmm_dims = HAVE_ZMM_ATTEND && kind != ROWS_C8 ? out_dim / (2 * CW) * (2 * CW) : 0;
            pace(&later, lines_left(&later), (used + PV_SPAN - 1) / PV_SPAN
                                             * (zmm_dims / (4 * CW) + zmm_dims / (2 * CW) % 2 + (out_dim - zmm_dims) / CW));
            for (int64_t c0 = 0; c0 < out_dim; c0 += CW) {
#if HAVE_ZMM_ATTEND
                if (c0 + 2 * CW <= zmm_dims) {  /* 64 or 32 dims a block, 16 lanes a register */
                    const int blocks = c0 + 4 * CW <= zmm_dims ? 2 : 1;
                    if (blocks == 2)  /* a constant `blocks` each: the loops unrolled, the registers known */
                        pv_block_zmm(score + h0 * TILE, rows, used, c0, acc + h0 * out_dim, out_dim, kind, 2, &later);
                    else
                        pv_block_zmm(score + h0 * TILE, rows, used, c0, acc + h0 * out_dim, out_dim, kind, 1, &later);
                    c0 += (2 * blocks - 1) * CW;
                    continue;
                }
#endif
                v8 a[HB][2];
                for (int hh = 0; hh < HB; hh++) {
                    a[hh][0] = LOAD(acc + (h0 + hh) * out_dim + c0);
                    a[hh][1] = LOAD(acc + (h0 + hh) * out_dim + c0 + 8);
                }
                const float *pj = kind == ROWS_C8 ? scaled + (c0 >> fmt->gshift) * TILE : score + h0 * TILE;
                const int64_t p_head = kind == ROWS_C8 ? fmt->groups * TILE : TILE;  /* p's stride per head */
                for (int j = 0; j < used; j++) {
                    if (j % PV_SPAN == 0) step_lines(&later, 0);
                    v8 r0, r1;
                    if (kind == ROWS_C8) {
                        r0 = i8x8((const uint8_t *)rows[j] + c0);
                        r1 = i8x8((const uint8_t *)rows[j] + c0 + 8);
                    } else {
                        r0 = row_load(rows[j], kind, fmt, c0);
                        r1 = row_load(rows[j], kind, fmt, c0 + 8);
                    }
                    for (int hh = 0; hh < HB; hh++) {
                        v8 p = splat(pj[hh * p_head + j]);
                        a[hh][0] = vfma(p, r0, a[hh][0]);
                        a[hh][1] = vfma(p, r1, a[hh][1]);
                    }
                }
                for (int hh = 0; hh < HB; hh++) {
                    STORE(acc + (h0 + hh) * out_dim + c0, a[hh][0]);
                    STORE(acc + (h0 + hh) * out_dim + c0 + 8, a[hh][1]);
                }
            }
        }
        used = t0 + TILE < count ? next_used : 0;
    }
#if HAVE_ZMM_ATTEND
    if (kind == ROWS_BF16 && !(HAVE_DPBF16 && qb)) block_order_to_dims(acc, hp, out_dim, out_dim / (2 * CW) * 2 * CW);
#endif
}

/* out[i, h, :out_dim] = softmax_t(scale * q[i, h] . row_t) @ row_t[:out_dim] over the context positions
   t < counts[i] of table row slot_row[i]: row_t is pool slot tables[slot_row[i], t / bs] * bs + t % bs
   (a block table; a list of slots with bs = 1); mask [rows, mask_width], if given, drops positions.
   dim % DW == 0 and out_dim % CW == 0 (the caller checks). Every index is checked against the table
   (table_rows x table_width, mask_width) and the pool (num_slots rows): a query naming anything
   outside them gets no output and the call returns 1 (0: all good). Rows are read in place and widened (bf16,
   C8's int8) in registers as they are read: no fp32 copy of the tile (twice a bf16 tile's bytes, past L1 at 576
   dims). A query whose every value is a bf16 (a bf16 model's) scores bf16 rows by vdpbf16ps where the CPU has it:
   the products exact, summed in pairs as stored (another order than the FMA chain's, to fp32 rounding; the
   choice is the query's own, so its row does not depend on its batch); at every head count it scores C8 rows so
   too, over their int8 latents widened to bf16 once a tile (attend_tiles). Such a query's p.V over bf16 rows
   takes its probabilities rounded to bf16 (pv_bf16), as a bf16 model's attention does everywhere else. */
static int32_t mqa(const float *q, int64_t n, int64_t heads, int64_t dim, const void *pool, const RowFormat *fmt,
                   int64_t row_stride, int64_t num_slots, const int64_t *tables, int64_t table_rows,
                   int64_t table_width, int64_t bs, int64_t mask_width, const int64_t *slot_row,
                   const int64_t *counts, const uint8_t *mask, float scale, int64_t out_dim, float *out,
                   int32_t threads) {
    const int64_t hp = (heads + HB - 1) / HB * HB;  /* heads padded to whole blocks (zero queries) */
    int32_t bad = 0;
    int64_t taken = 0;  /* queries handed out: each thread takes the next one as it starts one */
    /* AMX: bf16 queries over bf16 rows take tile products (amx_scores, amx_pv), all heads in groups of 16 */
#if HAVE_AMX
    const int tiles = fmt->kind == ROWS_BF16 && dim % 32 == 0 && out_dim % 32 == 0 && amx_usable();
#else
    const int tiles = 0;
#endif
    const int64_t h16 = (hp + 15) / 16 * 16, acc_rows = tiles ? h16 : hp;
    #pragma omp parallel num_threads(threads)
    {
        float *qp = xcalloc(hp * dim, sizeof(float));
        uint16_t *qb = xcalloc(hp * dim, sizeof(uint16_t));  /* qp as bf16, where every value is one */
        float *acc = xcalloc(acc_rows * out_dim, sizeof(float));  /* rows past hp stay 0 */
        float *mx = xmalloc(sizeof(float) * hp);
        float *sum = xmalloc(sizeof(float) * hp);
        float *score = xmalloc(sizeof(float) * hp * TILE);
        float *scaled = xmalloc(sizeof(float) * HB * (fmt->kind == ROWS_C8 ? fmt->groups : 1) * TILE);
        uint16_t *wide = xmalloc(sizeof(uint16_t) * (HAVE_DPBF16 && fmt->kind == ROWS_C8 ? TILE * fmt->latent
                                                                                                : 1));
        const void *rows[3 * TILE];  /* two tiles' rows, in place, and the rows asked for ahead (attend_tiles) */
        uint32_t *qv = tiles ? xmalloc(sizeof(uint32_t) * h16 * dim / 2) : NULL;
        uint16_t *copy = tiles ? xmalloc(sizeof(uint16_t) * TILE * dim) : NULL;
        uint16_t *vv = tiles ? xmalloc(sizeof(uint16_t) * TILE * out_dim) : NULL;
        uint16_t *pb = tiles ? xmalloc(sizeof(uint16_t) * h16 * TILE) : NULL;
#if HAVE_AMX
        if (tiles) amx_configure();
#endif
        int32_t local_bad = 0;
        const int64_t limit = table_width * bs < (mask ? mask_width : INT64_MAX) ? table_width * bs : mask_width;
        int64_t i = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
        for (int64_t following; i < n; i = following) {
            following = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);  /* known now: its first rows prefetched */
            if (slot_row[i] < 0 || slot_row[i] >= table_rows || counts[i] < 0 || counts[i] > limit) {
                local_bad = 1;
                continue;
            }
            const int after = following < n && slot_row[following] >= 0 && slot_row[following] < table_rows
                              && counts[following] >= 0 && counts[following] <= limit;
            const int64_t *after_trow = after ? tables + slot_row[following] * table_width : NULL;
            const uint8_t *after_mrow = after && mask ? mask + slot_row[following] * mask_width : NULL;
            const int64_t after_count = after ? counts[following] : 0;
            memcpy(qp, q + i * heads * dim, sizeof(float) * heads * dim);
            int q_bf16 = HAVE_DPBF16 && (fmt->kind == ROWS_BF16 || (fmt->kind == ROWS_C8 && fmt->latent % (2 * DW) == 0))
                         && dim % (2 * DW) == 0;
            if (q_bf16) {  /* every value a bf16 (a bf16 model's query): its bf16 copy */
                v8ui low = {0};
                for (int64_t e = 0; e < heads * dim; e += DW) {
                    v8ui u = (v8ui)LOAD(qp + e);
                    low |= u & 0xffffu;
                    v8h h = __builtin_convertvector(u >> 16, v8h);
                    memcpy(qb + e, &h, sizeof h);
                }
                for (int l = 0; l < DW; l++) q_bf16 &= low[l] == 0;
            }
            const uint16_t *qbf = q_bf16 ? qb : NULL;
#if HAVE_AMX
            if (qbf && qv) amx_query(qb, hp, dim, qv);
#endif
            const int64_t *trow = tables + slot_row[i] * table_width;
            const uint8_t *mrow = mask ? mask + slot_row[i] * mask_width : NULL;
            for (int64_t h = 0; h < hp; h++) { mx[h] = -INFINITY; sum[h] = 0.f; }
            memset(acc, 0, sizeof(float) * acc_rows * out_dim);
            if (fmt->kind == ROWS_BF16)
                attend_tiles(qp, qbf, hp, dim, pool, fmt, row_stride, num_slots, trow, bs, mrow, counts[i], scale,
                             out_dim, acc, mx, sum, score, scaled, wide, rows, &local_bad, after_trow, after_mrow,
                             after_count, qbf ? qv : NULL, copy, vv, pb, ROWS_BF16);
            else if (fmt->kind == ROWS_C8)
                attend_tiles(qp, qbf, hp, dim, pool, fmt, row_stride, num_slots, trow, bs, mrow, counts[i], scale,
                             out_dim, acc, mx, sum, score, scaled, wide, rows, &local_bad, after_trow, after_mrow,
                             after_count, NULL, copy, vv, pb, ROWS_C8);
            else
                attend_tiles(qp, qbf, hp, dim, pool, fmt, row_stride, num_slots, trow, bs, mrow, counts[i], scale,
                             out_dim, acc, mx, sum, score, scaled, wide, rows, &local_bad, after_trow, after_mrow,
                             after_count, NULL, copy, vv, pb, ROWS_F32);
            float *oi = out + i * heads * out_dim;
            for (int64_t h = 0; h < heads; h++) {
                float inv = sum[h] > 0.f ? 1.f / sum[h] : 0.f;
                for (int64_t c = 0; c < out_dim; c++) oi[h * out_dim + c] = acc[h * out_dim + c] * inv;
            }
        }
        if (local_bad) {
            #pragma omp atomic write
            bad = 1;
        }
        free(qp); free(qb); free(acc); free(mx); free(sum); free(score); free(scaled); free(wide); free(qv); free(copy); free(vv); free(pb);
#if HAVE_AMX
        if (tiles) _tile_release();
#endif
    }
    return bad;
}

/* Whether a C8 MLA row (int8 latent | fp32 scale per `group` latent dims | bf16 rope key) is a sane layout that
   fits `row_stride` bytes. */
static int c8_layout_fits(int64_t latent, int64_t group, int64_t groups, int64_t rope, int64_t row_stride) {
    return latent > 0 && group > 0 && rope >= 0 && groups == (latent + group - 1) / group
           && latent + 4 * groups + 2 * rope <= row_stride;
}

/* mqa over fp32 or bf16 rows (row_stride in elements). */
int32_t paged_mqa(const float *q, int64_t n, int64_t heads, int64_t dim,
                  const void *pool, int32_t pool_bf16, int64_t row_stride, int64_t num_slots,
                  const int64_t *tables, int64_t table_rows, int64_t table_width, int64_t bs, int64_t mask_width,
                  const int64_t *slot_row, const int64_t *counts, const uint8_t *mask,
                  float scale, int64_t out_dim, float *out, int32_t threads) {
    RowFormat fmt = {pool_bf16 ? ROWS_BF16 : ROWS_F32, 0, 0, 0, 0, pool_bf16 ? 2 : 4, dim * (pool_bf16 ? 2 : 4), 0};
    return mqa(q, n, heads, dim, pool, &fmt, row_stride, num_slots, tables, table_rows, table_width, bs, mask_width,
               slot_row, counts, mask, scale, out_dim, out, threads);
}

/* mqa over C8 MLA rows read in place (row_stride in bytes): a score sums each latent group's int8 dot times the
   group's scale (one multiply a group), p.V multiplies the int8 values by p times the row's group scale (once a
   tile), the rope key widened from bf16: dequantize-then-attend to fp32 rounding, no value dequantized on its
   own. The layout is checked first: dim = latent + rope, groups = ceil(latent / group), a power-of-two group of
   whole CW blocks, the output within the latent, and a row of latent + 4 groups + 2 rope bytes fits the stride;
   else nothing is read and the call returns 2. */
int32_t paged_mqa_c8(const float *q, int64_t n, int64_t heads, int64_t dim,
                     const uint8_t *pool, int64_t row_stride, int64_t num_slots, int64_t latent, int64_t group,
                     int64_t groups, int64_t rope,
                     const int64_t *tables, int64_t table_rows, int64_t table_width, int64_t bs, int64_t mask_width,
                     const int64_t *slot_row, const int64_t *counts, const uint8_t *mask,
                     float scale, int64_t out_dim, float *out, int32_t threads) {
    if (!c8_layout_fits(latent, group, groups, rope, row_stride) || dim != latent + rope || group & (group - 1)
            || group % CW || latent % DW || out_dim > latent)
        return 2;
    int gshift = 0;
    while ((1L << gshift) < group) gshift++;
    RowFormat fmt = {ROWS_C8, latent, group, groups, rope, 1, latent + 4 * groups + 2 * rope, gshift};
    return mqa(q, n, heads, dim, pool, &fmt, row_stride, num_slots, tables, table_rows, table_width, bs, mask_width,
               slot_row, counts, mask, scale, out_dim, out, threads);
}

/* ---- Prompt rows' attention in its expanded (MHA) form ---- */

#define PQ 4  /* queries a pass: each key vector loaded once for four */
#define PK 4  /* key (scores) or output-dim (p.V) vectors a pass: PQ x PK = 16 chains in flight */

/* The scores of queries q[0..PQ) (qk dims each, `qs` apart) against keys [j0, j0 + 8 PK) of keys_t ([qk][kstride],
   keys transposed: dim d of key j at d kstride + j): sc[qq][j - j0], each one fused multiply-add chain over the dims
   in order (a key's score does not depend on the keys beside it). Keys past a query's count are scored as stored
   (its softmax leaves them out) up to the row's end, then read as 0: whole vectors where the row holds them
   (element by element, a pass at a ragged end took most of the time). */
static inline __attribute__((always_inline)) void
prompt_scores(const float *q, int64_t qs, int64_t qk, const float *keys_t, int64_t kstride, int64_t j0,
              float sc[PQ][8 * PK]) {
    v8 acc[PQ][PK] = {{{0}}};
    if (j0 + 8 * PK <= kstride) {
        for (int64_t d = 0; d < qk; d++) {
            const float *row = keys_t + d * kstride + j0;
            v8 kv[PK];
            for (int m = 0; m < PK; m++) kv[m] = LOAD(row + 8 * m);
            for (int qq = 0; qq < PQ; qq++) {
                v8 qv = splat(q[qq * qs + d]);
                for (int m = 0; m < PK; m++) acc[qq][m] = vfma(qv, kv[m], acc[qq][m]);
            }
        }
    } else {  /* the tile's last keys: the same chains, the missing keys 0 */
        for (int64_t d = 0; d < qk; d++) {
            const float *row = keys_t + d * kstride + j0;
            v8 kv[PK];
            for (int m = 0; m < PK; m++) {
                kv[m] = splat(0.f);
                for (int e = 0; e < DW && j0 + 8 * m + e < kstride; e++) kv[m][e] = row[8 * m + e];
            }
            for (int qq = 0; qq < PQ; qq++) {
                v8 qv = splat(q[qq * qs + d]);
                for (int m = 0; m < PK; m++) acc[qq][m] = vfma(qv, kv[m], acc[qq][m]);
            }
        }
    }
    for (int qq = 0; qq < PQ; qq++)
        for (int m = 0; m < PK; m++) STORE(sc[qq] + 8 * m, acc[qq][m]);
}

/* Folds one query's scores sc[0..seen) of a key tile (its first `count` visible) into its running max *mx and sum
   *sm: sc becomes the probabilities e^(s - max), 0 past count (seen rounded up to whole vectors); returns the
   factor its accumulated p.V takes (e^(old max - new max): 0 on its first keys, 1 where the max holds). */
static inline float prompt_softmax(float *sc, int64_t seen, int64_t count, float *mx, float *sm) {
    v8 most = splat(-INFINITY);  /* the max in 8 lanes (a scalar loop's chain of compares cost a fifth) */
    for (int64_t j = 0; j < count; j += DW) {
        v8i in = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + (int32_t)j < (int32_t)count;
        v8 v = LOAD(sc + j);
        most = vsel(in & (v > most), v, most);
    }
    float tile_max = -INFINITY;
    for (int l = 0; l < DW; l++) tile_max = most[l] > tile_max ? most[l] : tile_max;
    const float new_max = tile_max > *mx ? tile_max : *mx;
    const float alpha = *mx == -INFINITY ? 0.f : vexp(splat(*mx - new_max))[0];
    v8 tot = splat(0.f);
    for (int64_t j = 0; j < seen; j += DW) {
        v8i lane = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + (int32_t)j;
        v8 e = (v8)((v8i)(lane < (int32_t)count) & (v8i)vexp(LOAD(sc + j) - splat(new_max)));
        STORE(sc + j, e);
        tot += e;
    }
    *sm = *sm * alpha + hsum8(tot);
    *mx = new_max;
    return alpha;
}

/* acc[qq][c0 .. c0 + 8 PK) = alpha[qq] acc + sum_j p[qq][j] values[j][c], j < keys in order (a probability of 0,
   a key past the query's count, leaves a finite sum's bits as they are): PQ x PK chains. */
static inline __attribute__((always_inline)) void
prompt_pv(const float *p, int64_t pstride, const float *values, int64_t vs, int64_t keys, int64_t c0,
          const float alpha[PQ], float *const acc[PQ]) {
    v8 a[PQ][PK];
    for (int qq = 0; qq < PQ; qq++)
        for (int m = 0; m < PK; m++) a[qq][m] = LOAD(acc[qq] + c0 + 8 * m) * splat(alpha[qq]);
    for (int64_t j = 0; j < keys; j++) {
        v8 vv[PK];
        for (int m = 0; m < PK; m++) vv[m] = LOAD(values + j * vs + c0 + 8 * m);
        for (int qq = 0; qq < PQ; qq++) {
            v8 pv = splat(p[qq * pstride + j]);
            for (int m = 0; m < PK; m++) a[qq][m] = vfma(pv, vv[m], a[qq][m]);
        }
    }
    for (int qq = 0; qq < PQ; qq++)
        for (int m = 0; m < PK; m++) STORE(acc[qq] + c0 + 8 * m, a[qq][m]);
}

/* One key tile of prompt rows' attention in its expanded form (shared.model.attention.expanded_attention), folded
   into each query's online softmax. Group g (a head of request g % requests) holds queries q[g] [n][qk] (scaled),
   the tile's keys transposed keys_t[g] [qk][kstride] and values[g] [kstride][v_dim]; query s of request r sees
   the tile's first visible[r][s] keys (causal: up to its position; at most `seen`). State per (g, s): running
   max mx, sum sm and unnormalized output acc [v_dim] (fp32), started by the call with `first`; a query that
   sees no key of the tile keeps its state. Every score is one fused multiply-add chain over the dims in order
   and every output one over the tile's keys in order: a query's bits are the same whichever queries share the
   call (its pass's other queries add exact zeros past its count). v_dim % 32 == 0 (the caller checks). */
void prompt_attention_tile(const float *q, int64_t groups, int64_t requests, int64_t n, int64_t qk,
                           const float *keys_t, int64_t kstride, const float *values, int64_t v_dim, int64_t seen,
                           const int64_t *visible, int32_t first, float *mx, float *sm, float *acc, int32_t threads) {
    const int64_t passes = (n + PQ - 1) / PQ, padded = (seen + 8 * PK - 1) / (8 * PK) * (8 * PK);
    #pragma omp parallel num_threads(threads)
    {
        float *sc = xmalloc(sizeof(float) * PQ * padded), *qbuf = xmalloc(sizeof(float) * PQ * qk);
        float *spare = xmalloc(sizeof(float) * v_dim);  /* a short pass's missing queries' output, unread */
        #pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < groups * passes; item++) {
            const int64_t g = item / passes, s0 = item % passes * PQ;
            int64_t count[PQ], most = 0;
            float alpha[PQ], *out[PQ];
            for (int qq = 0; qq < PQ; qq++) {
                const int64_t s = s0 + qq;
                count[qq] = 0;
                out[qq] = spare;
                if (s >= n) {
                    memset(qbuf + qq * qk, 0, sizeof(float) * qk);
                    continue;
                }
                const int64_t v = visible[(g % requests) * n + s];
                count[qq] = v < 0 ? 0 : v > seen ? seen : v;
                most = count[qq] > most ? count[qq] : most;
                out[qq] = acc + (g * n + s) * v_dim;
                memcpy(qbuf + qq * qk, q + (g * n + s) * qk, sizeof(float) * qk);
                if (first) {
                    mx[g * n + s] = -INFINITY;
                    sm[g * n + s] = 0.f;
                    memset(out[qq], 0, sizeof(float) * v_dim);
                }
            }
            if (!most) continue;
            for (int64_t j0 = 0; j0 < most; j0 += 8 * PK) {
                float blk[PQ][8 * PK];
                prompt_scores(qbuf, qk, qk, keys_t + g * qk * kstride, kstride, j0, blk);
                for (int qq = 0; qq < PQ; qq++) memcpy(sc + qq * padded + j0, blk[qq], sizeof blk[qq]);
            }
            for (int qq = 0; qq < PQ; qq++) {
                alpha[qq] = 1.f;  /* no key seen: p all 0, the state as it is */
                if (!count[qq]) memset(sc + qq * padded, 0, sizeof(float) * padded);
                else alpha[qq] = prompt_softmax(sc + qq * padded, (most + DW - 1) / DW * DW, count[qq],
                                                mx + g * n + s0 + qq, sm + g * n + s0 + qq);
            }
            for (int64_t c0 = 0; c0 < v_dim; c0 += 8 * PK)
                prompt_pv(sc, padded, values + g * kstride * v_dim, v_dim, most, c0, alpha, out);
        }
        free(sc);
        free(qbuf);
        free(spare);
    }
}

/* C8 MLA rows at `slots` (pool rows `row_stride` bytes apart, num_slots of them) decoded into out [n, latent + rope]
   as Int8LatentRows.decode computes them in torch: to bf16 (out_bf16) -- int8 times its group's scale rounded to
   bf16, the exact product rounded to bf16 once; the bf16 rope key as stored -- or to fp32 (int8 times the fp32
   scale, rounded once; the rope key widened). One pass instead of a gather and five tensor passes (the portable
   sparse attention of prompt rows decodes k rows per query). Returns 1 (nothing trusted) where a slot is outside
   the pool, 2 where the layout does not fit the stride. */
int32_t c8_rows_decode(const uint8_t *pool, int64_t row_stride, int64_t num_slots, int64_t latent, int64_t group,
                       int64_t groups, int64_t rope, const int64_t *slots, int64_t n, void *out, int32_t out_bf16,
                       int32_t threads) {
    if (!c8_layout_fits(latent, group, groups, rope, row_stride)) return 2;
    const int64_t dim = latent + rope;
    int32_t bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) if (n * dim >= (1 << 18))
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) {
            #pragma omp atomic write
            bad = 1;
            continue;
        }
        const uint8_t *r = pool + slots[i] * row_stride;
        const uint8_t *sc = r + latent, *rk = r + latent + 4 * groups;
        for (int64_t g = 0; g < groups; g++) {
            float s;
            memcpy(&s, sc + 4 * g, sizeof s);
            int64_t c0 = g * group, c1 = c0 + group < latent ? c0 + group : latent;
            if (out_bf16) {
                float sb = round_bf16(s);
                uint16_t *o = (uint16_t *)out + i * dim;
                for (int64_t c = c0; c < c1; c++) o[c] = narrow((float)(int8_t)r[c] * sb);
            } else {
                float *o = (float *)out + i * dim;
                for (int64_t c = c0; c < c1; c++) o[c] = (float)(int8_t)r[c] * s;
            }
        }
        if (out_bf16) memcpy((uint16_t *)out + i * dim + latent, rk, 2 * (size_t)rope);
        else for (int64_t c = 0; c < rope; c++) ((float *)out)[i * dim + latent + c] = widen(rk, 1, c);
    }
    return bad;
}

/* ---- Lightning-indexer scores over the cached keys (fp32, bf16 or C8's FP8) ---- */

#define KT 64    /* keys decoded per tile, shared by the queries of a run */
#define IH 8     /* indexer heads per register block */
#define RUN 16   /* at most this many consecutive queries of one table row share a decoded tile */

typedef float v4 __attribute__((vector_size(16)));

/* The sums of four 8-lane vectors, each as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): AVX's horizontal
   adds where the CPU has them, the same additions in the same order elsewhere (the same bits on every ISA). */
static inline v4 sum4(v8 a, v8 b, v8 c, v8 d) {
#if defined(__AVX__)
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a, (__m256)b), _mm256_hadd_ps((__m256)c, (__m256)d));
    return (v4)_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#else
    v8 x[4] = {a, b, c, d};
    v4 r;
    for (int k = 0; k < 4; k++)
        r[k] = ((x[k][0] + x[k][1]) + (x[k][2] + x[k][3])) + ((x[k][4] + x[k][5]) + (x[k][6] + x[k][7]));
    return r;
#endif
}
typedef uint8_t v8b __attribute__((vector_size(8)));

/* Eight FP8 e4m3 bytes as fp32, exactly and without branches. With F16C: each byte sign-extended to 16 bits and
   shifted by 7 puts its exponent and mantissa in fp16's places and a copy of the sign in bit 15 (bit 14, another
   copy, cleared): an fp16 of the value times 2^-8 (e4m3's subnormals fp16's), widened by the converter (exact,
   whatever the denormal mode) and scaled back by an exact multiply. Elsewhere the same values by integer
   arithmetic: exponent and mantissa moved to fp32's places and rebiased (7 -> 127), subnormals (exponent 0)
   mantissa * 2^-9, the sign bit moved. The codec never stores NaN (it saturates at 448). */
static inline v8 e4m3x8(const uint8_t *p) {
#if defined(__AVX2__) && defined(__F16C__)
    __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i half = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xbf80));
    return (v8)_mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
#else
    v8b bytes;
    memcpy(&bytes, p, sizeof bytes);
    v8i x = __builtin_convertvector(bytes, v8i);
    v8i m = x & 0x7f;
    v8i normal = (m << 20) + (120 << 23);
    v8 sub = __builtin_convertvector(m, v8) * splat(0x1p-9f);
    v8i is_normal = m >= 8;  /* all ones where true */
    return (v8)((is_normal & normal) | (~is_normal & (v8i)sub) | ((x & 0x80) << 24));
#endif
}

/* Index keys as the kernel reads them: fp32 or bf16 values as they are (the pool's `PlainRows`), or C8
   (shared.kvcache.layout.Fp8KeyRows: FP8 e4m3 [dim] | fp32 scale, the scale applied to the dot). */
enum { KEYS_F32 = 0, KEYS_BF16 = 1, KEYS_FP8 = 2 };

/* The indexer's dot products run in lane order: the 8 keys of a block in the 8 lanes of a vector, each lane's
   dot one chain over its key's dims in pairs (2p, 2p + 1), adding the product of dim 2p + 1, then that of dim
   2p, one rounding each. That is what AVX512-BF16's vdpbf16ps computes on bf16 pairs as stored when every value
   is a bf16 (its products are exact in fp32; measured on Zen 4: a pair's second product first, 0 of 1.6M lanes
   otherwise) and no value or sum is subnormal (it flushes those). DeepSeek's numerics give such values: queries
   and keys on the FP8 grid times a power of two, C8's FP8 keys with their scale applied after the dot. Where
   every value of a query and of a key tile is a bf16 within 2^-50 .. 2^51 (products exact, every partial sum a
   multiple of 2^-114: never subnormal) and the CPU has the instruction, it computes the dots (16 products an
   instruction); elsewhere fused multiply-adds in the same order compute them: the same bits whichever runs, on
   every ISA, so a query's scores depend neither on its batch nor on the CPU. A key a lane leaves nothing to sum
   across lanes: the scale, ReLU and head weight apply to 8 keys at once (summing each dot's 8 lanes, the layout
   before, took a quarter of the kernel). */
#define DP 16  /* dims are padded to whole 16-dim blocks (zeros) */

/* Lanes whose fp32 bits are a bf16 of magnitude 0 or 2^-50 .. 2^51 (all ones), as the fast path needs. */
static inline v8ui pair_exact(v8ui u) {
    v8ui e = (u >> 23) & 0xff;
    return (v8ui)(((u & 0xffff) == 0) & (((u & 0x7fffffff) == 0) | ((e - 77) <= 100)));
}

/* Values d0 .. d0 + 7 of a key row stored as `kind` (zeros past dim). */
static inline v8 key_values(const uint8_t *src, int32_t kind, int64_t d0, int64_t dim) {
    if (d0 >= dim) return splat(0.f);
    if (kind == KEYS_FP8) return e4m3x8(src + d0);
    if (kind == KEYS_BF16) return bf16x8(src + 2 * d0);
    return LOAD((const float *)src + d0);
}

typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint16_t v16hu __attribute__((vector_size(32), aligned(2)));

#if HAVE_DPBF16 && defined(__AVX512BW__)
#define FP8_PAIRS 1
/* 32 FP8 e4m3 values straight to bf16 bits in 16-bit lanes, in place order (pairs as stored): each magnitude's
   bits moved to bf16's places (exponent rebiased 7 -> 127: mag << 4 + 120 << 7), zeros and subnormals
   (m * 2^-9) from a table, the sign moved up. The same bits as through fp32 (e4m3x8), about a third of the
   operations. */
static inline void fp8_pairs32(const uint8_t *src, uint32_t *b) {
    static const uint16_t small_bits[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
    __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3c00));
    __mmask32 small = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));  /* exponent 0 */
    if (small) bits = _mm512_mask_permutexvar_epi16(bits, small, mag, _mm512_loadu_si512(small_bits));
    bits = _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
    _mm512_storeu_si512(b, bits);
}
#else
#define FP8_PAIRS 0
#endif

/* A row stored as `kind` (a key's, or a query's fp32) as bf16 pairs b [dp / 2] (word p: dim 2p low, dim 2p + 1
   high, truncated; zeros past dim); whether every value is pair_exact (then they are exact). FP8 values always
   are (e4m3: 4 significant bits, 2^-9 .. 448); bf16 rows are checked and copied as stored. */
static inline int row_pairs(const uint8_t *src, int32_t kind, int64_t dim, int64_t dp, uint32_t *b) {
    if (kind == KEYS_BF16 && dim % DP == 0) {
        v16h bad = {0};
        for (int64_t d0 = 0; d0 < dp; d0 += DP) {
            v16h h = *(const v16hu *)(src + 2 * d0), e = (h >> 7) & 0xff;
            bad |= (v16h)(((h & 0x7fff) != 0) & ((v16h)(e - 77) > 100));
            *(v16hu *)(b + d0 / 2) = h;
        }
        for (int l = 0; l < 16; l++)
            if (bad[l]) return 0;
        return 1;
    }
    int64_t d0 = 0;
#if FP8_PAIRS
    if (kind == KEYS_FP8)
        for (; d0 + 2 * DP <= dim; d0 += 2 * DP) fp8_pairs32(src + d0, b + d0 / 2);
#endif
    v8ui all = {0};
    all = ~all;
    for (; d0 < dp; d0 += DW) {
        v8ui u = (v8ui)key_values(src, kind, d0, dim);
        if (kind != KEYS_FP8) all &= pair_exact(u);
        v8ui even = __builtin_shufflevector(u, u, 0, 2, 4, 6, 0, 2, 4, 6);
        v8ui odd = __builtin_shufflevector(u, u, 1, 3, 5, 7, 1, 3, 5, 7);
        v8ui words = (odd & 0xffff0000u) | (even >> 16);
        memcpy(b + d0 / 2, &words, 4 * sizeof(uint32_t));
    }
    for (int l = 0; l < DW; l++)
        if (!all[l]) return 0;
    return 1;
}

/* out[c * out_stride + k] = r[k][c] for an 8 x 8 block of 32-bit words held in registers. */
static inline void transpose8(const v8ui r[8], uint32_t *out, int64_t out_stride) {
    v8ui t[8], u[8];
    for (int k = 0; k < 8; k += 2) {  /* words of two rows interleaved, per 128-bit half */
        t[k] = __builtin_shufflevector(r[k], r[k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[k + 1] = __builtin_shufflevector(r[k], r[k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int k = 0; k < 8; k += 4)  /* then pairs of words: columns of four rows */
        for (int s = 0; s < 2; s++) {
            u[k + 2 * s] = __builtin_shufflevector(t[k + s], t[k + s + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[k + 2 * s + 1] = __builtin_shufflevector(t[k + s], t[k + s + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int c = 0; c < 4; c++) {  /* then halves: columns c and c + 4 of all eight rows */
        v8ui lo = __builtin_shufflevector(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        v8ui hi = __builtin_shufflevector(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        memcpy(out + c * out_stride, &lo, sizeof lo);
        memcpy(out + (c + 4) * out_stride, &hi, sizeof hi);
    }
}

/* A tile's keys as the dots read them, a key a lane. As bf16 pairs by pair: the pairs of its rows ([KT][width]
   words, row_pairs' output) transposed 8 keys by 8 words, [width][KT]. */
static inline void tile_columns(const uint32_t *rows, int64_t width, uint32_t *cols) {
    for (int64_t j0 = 0; j0 < KT; j0 += 8)
        for (int64_t c0 = 0; c0 < width; c0 += 8) {
            v8ui r[8];
            for (int k = 0; k < 8; k++) memcpy(&r[k], rows + (j0 + k) * width + c0, sizeof r[k]);
            transpose8(r, cols + c0 * KT + j0, KT);
        }
}

/* As fp32 values by dim, [dp][KT], for the fused multiply-adds: each of the `used` keys' (stored as `kind`)
   next 8 values widened and 8 keys transposed in registers, zeros past `used` (through a row-major fp32 copy
   of the tile, 32 kB, all of L1, it measured 1.4x slower on AVX2 at 16 heads). */
static inline void tile_values(const uint8_t *const *rows, int64_t used, int32_t kind, int64_t dim, int64_t dp,
                               float *cols) {
    for (int64_t j0 = 0; j0 < used; j0 += 8)
        for (int64_t d0 = 0; d0 < dp; d0 += DW) {
            v8ui r[8];
            for (int k = 0; k < 8; k++)
                r[k] = j0 + k < used ? (v8ui)key_values(rows[j0 + k], kind, d0, dim) : (v8ui){0};
            transpose8(r, (uint32_t *)cols + d0 * KT + j0, KT);
        }
}

/* acc[b][hh] (a key a lane: keys j0 + 8b .. j0 + 8b + 7 of the tile) += the lane-order dots of FH heads' fp32
   queries q (dp apart) with the tile's fp32 keys by dim (`keys`: [dp][KT]). FH heads by 16 keys: 8 accumulators,
   2 key vectors and a query value fit AVX2's 16 registers, and each query value serves two key vectors. */
#define FH 4
static inline __attribute__((always_inline)) void
lane_dots(const float *q, const float *keys, int64_t j0, int64_t dp, v8 acc[2][FH]) {
    for (int64_t d = 0; d < dp; d += 2)
        for (int64_t e = d + 1; e >= d; e--) {  /* dim d + 1's product, then dim d's */
            v8 k0 = LOAD(keys + e * KT + j0), k1 = LOAD(keys + e * KT + j0 + DW);
            for (int hh = 0; hh < FH; hh++) {
                v8 qv = splat(q[hh * dp + e]);
                acc[0][hh] = vfma(qv, k0, acc[0][hh]);
                acc[1][hh] = vfma(qv, k1, acc[1][hh]);
            }
        }
}

#if HAVE_DPBF16
/* lane_dots by vdpbf16ps for two key blocks (keys j0 .. j0 + 15): IH heads' query pairs (dp / 2 words apart,
   each broadcast) with the tile's key pairs by pair (`keys`: [dp / 2][KT]); 16 chains, enough to keep the
   instruction's two pipes busy. The same bits as lane_dots where every value is pair_exact. */
static inline __attribute__((always_inline)) void
lane_dots_bf16(const uint32_t *q, const uint32_t *keys, int64_t j0, int64_t dp, v8 acc[2][IH]) {
    const int64_t words = dp / 2;
    __m256 a0[IH], a1[IH];
    for (int hh = 0; hh < IH; hh++) { a0[hh] = (__m256)acc[0][hh]; a1[hh] = (__m256)acc[1][hh]; }
    for (int64_t p = 0; p < words; p++) {
        __m256bh k0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(keys + p * KT + j0));
        __m256bh k1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(keys + p * KT + j0 + 8));
        for (int hh = 0; hh < IH; hh++) {
            __m256bh qv = (__m256bh)_mm256_set1_epi32((int)q[hh * words + p]);
            a0[hh] = _mm256_dpbf16_ps(a0[hh], qv, k0);
            a1[hh] = _mm256_dpbf16_ps(a1[hh], qv, k1);
        }
    }
    for (int hh = 0; hh < IH; hh++) { acc[0][hh] = (v8)a0[hh]; acc[1][hh] = (v8)a1[hh]; }
}
#endif

/* tot (a key a lane) += w[hh] * ReLU(acc[hh] * kscale) for `heads` heads in order. */
static inline v8 weigh_heads(const v8 *acc, int heads, v8 kscale, const float *w, v8 tot) {
    for (int hh = 0; hh < heads; hh++) {
        v8 sc = acc[hh] * kscale;
        tot += splat(w[hh]) * (v8)((v8i)sc & (v8i)(sc > splat(0.f)));  /* ReLU */
    }
    return tot;
}

/* Whether this build has vdpbf16ps: the indexer's exact dots, a bf16 query's attention scores over bf16 rows and
   a bf16 model's experts' gate / up products take it (else fused multiply-adds alone). */
int32_t dots_bf16(void) { return HAVE_DPBF16; }

/* 1 where a bf16 model's decode attention takes AMX tile products (the build has them, Linux granted them). */
int32_t tile_products(void) {
#if HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

/* out[i, t] = sum_h w[i, h] * relu(dot(q[i, h], key_t) * key_scale_t * scale) for the positions t < counts[i]
   of table row slot_row[i] (key_t: row tables[row, t / bs] * bs + t % bs of the pool, rows `row_stride` bytes
   apart, stored as `kind` says; key_scale_t is 1 but for FP8 keys), -inf for counts[i] <= t < t_out; the dots
   in lane order (above), the heads summed in order. Each key is widened once per run of up to RUN consecutive
   queries with the same table row (a prompt chunk's, a verification's). Checks as paged_mqa: returns 1 where a
   query names a row, position or slot outside the table or the pool (its output is then incomplete), 2 where
   dim % DW, the kind, or the row (its values, and an FP8 key's 4-byte scale) does not fit the stride (nothing
   read). */
int32_t index_keys(const float *q, const float *w, int64_t n, int64_t heads, int64_t dim,
                   const uint8_t *pool, int32_t kind, int64_t row_stride, int64_t num_slots,
                   const int64_t *tables, int64_t table_rows, int64_t table_width, int64_t bs,
                   const int64_t *slot_row, const int64_t *counts, int64_t t_out, float scale, float *out,
                   int32_t threads) {
    const int64_t row_bytes = kind == KEYS_FP8 ? dim + 4 : kind == KEYS_BF16 ? 2 * dim : 4 * dim;
    if (dim <= 0 || dim % DW || kind < KEYS_F32 || kind > KEYS_FP8 || row_bytes > row_stride || heads <= 0)
        return 2;
    const int64_t hp = (heads + IH - 1) / IH * IH, dp = (dim + DP - 1) / DP * DP;  /* zero padded */
    int64_t *start = xmalloc(sizeof(int64_t) * (n + 1)), runs = 0;
    for (int64_t i = 0; i < n; i++)
        if (!runs || slot_row[i] != slot_row[i - 1] || i - start[runs - 1] >= RUN) start[runs++] = i;
    start[runs] = n;
    int32_t bad = 0;
    #pragma omp parallel num_threads(threads)
    {
        /* a tile's keys as rows of bf16 pairs (zero padded) and as the columns the dots read (bf16 pairs by pair
           where a query may take the fast path, fp32 values by dim for the others), and a run's queries (heads
           padded with zeros, weight 0; fp32 and bf16 pairs). A lane past a tile's end holds some earlier key's
           values: each lane is its own key's dot, never summed with another's, and never written out. */
        float *keys = xcalloc(KT * dp, sizeof(float)), *ks = xcalloc(KT, sizeof(float));
        uint32_t *rows_b = xcalloc(KT * dp / 2, sizeof(uint32_t)), *keys_b = xcalloc(KT * dp / 2, sizeof(uint32_t));
        uint32_t *qb = xcalloc(RUN * hp * dp / 2, sizeof(uint32_t));
        float *qf = xcalloc(RUN * hp * dp, sizeof(float)), *wp = xcalloc(RUN * hp, sizeof(float));
        int q_exact[RUN];
        const uint8_t *rows_at[KT];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < runs; r++) {
            int64_t i0 = start[r], i1 = start[r + 1], trow_i = slot_row[i0], cmax = 0;
            int64_t limit = table_width * bs < t_out ? table_width * bs : t_out;
            int ok = trow_i >= 0 && trow_i < table_rows;
            for (int64_t i = i0; i < i1; i++) {
                ok &= counts[i] >= 0 && counts[i] <= limit;
                cmax = counts[i] > cmax ? counts[i] : cmax;
            }
            if (!ok) {
                #pragma omp atomic write
                bad = 1;
                continue;
            }
            int any_fast = 0, all_fast = 1;
            for (int64_t i = i0; i < i1; i++) {
                for (int64_t t = counts[i]; t < t_out; t++) out[i * t_out + t] = -INFINITY;
                float *qfi = qf + (i - i0) * hp * dp;
                q_exact[i - i0] = HAVE_DPBF16;
                for (int64_t h = 0; h < hp; h++) {
                    if (h < heads) memcpy(qfi + h * dp, q + (i * heads + h) * dim, sizeof(float) * dim);
                    if (q_exact[i - i0])
                        q_exact[i - i0] = row_pairs((const uint8_t *)(qfi + h * dp), KEYS_F32, dp, dp,
                                                    qb + ((i - i0) * hp + h) * dp / 2);
                    wp[(i - i0) * hp + h] = h < heads ? w[i * heads + h] : 0.f;
                }
                any_fast |= q_exact[i - i0];
                all_fast &= q_exact[i - i0];
            }
            const int64_t *trow = tables + trow_i * table_width;
            for (int64_t t0 = 0; t0 < cmax; t0 += KT) {
                int64_t used = cmax - t0 < KT ? cmax - t0 : KT;
                for (int64_t j = 0; j < used; j++) {
                    int64_t t = t0 + j, slot = trow[t / bs] * bs + t % bs;
                    if (t + KT < cmax) {  /* the next tile's key j, asked for while this one is decoded */
                        int64_t blk = trow[(t + KT) / bs], ahead = blk * bs + (t + KT) % bs;
                        if (blk >= 0 && ahead < num_slots) prefetch_row(pool + ahead * row_stride, row_bytes);
                    }
                    if (trow[t / bs] < 0 || slot >= num_slots) {
                        #pragma omp atomic write
                        bad = 1;
                        used = j;
                        break;
                    }
                    rows_at[j] = pool + slot * row_stride;
                    if (kind == KEYS_FP8) memcpy(ks + j, rows_at[j] + dim, sizeof(float));
                    else ks[j] = 1.0f;
                }
                int tile_exact = any_fast;  /* bf16 pairs for the fast path, fp32 values for the others */
                for (int64_t j = 0; j < used && tile_exact; j++)
                    tile_exact = row_pairs(rows_at[j], kind, dim, dp, rows_b + j * dp / 2);
                if (tile_exact) tile_columns(rows_b, dp / 2, keys_b);
                if (!tile_exact || !all_fast) tile_values(rows_at, used, kind, dim, dp, keys);
                for (int64_t i = i0; i < i1; i++) {
                    int64_t end = counts[i] - t0 < used ? counts[i] - t0 : used;
                    if (end <= 0) continue;
                    const float *qfi = qf + (i - i0) * hp * dp, *wi = wp + (i - i0) * hp;
                    float *oi = out + i * t_out + t0;
                    float tot_keys[KT];
#if HAVE_DPBF16
                    const int fast = tile_exact && q_exact[i - i0];
#endif
                    for (int64_t j0 = 0; j0 < end; j0 += 2 * DW) {  /* 16 keys a pass, a key a lane */
                        v8 tot[2] = {splat(0.f), splat(0.f)};
                        const v8 kscale[2] = {LOAD(ks + j0) * splat(scale), LOAD(ks + j0 + DW) * splat(scale)};
#if HAVE_DPBF16
                        if (fast)
                            for (int64_t h0 = 0; h0 < hp; h0 += IH) {
                                v8 acc[2][IH] = {{{0}}};
                                lane_dots_bf16(qb + ((i - i0) * hp + h0) * dp / 2, keys_b, j0, dp, acc);
                                for (int b = 0; b < 2; b++) tot[b] = weigh_heads(acc[b], IH, kscale[b], wi + h0, tot[b]);
                            }
                        else
#endif
                            for (int64_t h0 = 0; h0 < hp; h0 += FH) {
                                v8 acc[2][FH] = {{{0}}};
                                lane_dots(qfi + h0 * dp, keys, j0, dp, acc);
                                for (int b = 0; b < 2; b++) tot[b] = weigh_heads(acc[b], FH, kscale[b], wi + h0, tot[b]);
                            }
                        STORE(tot_keys + j0, tot[0]);
                        STORE(tot_keys + j0 + DW, tot[1]);
                    }
                    memcpy(oi, tot_keys, sizeof(float) * end);
                }
            }
        }
        free(keys); free(ks); free(rows_b); free(keys_b); free(qf); free(qb); free(wp);
    }
    free(start);
    return bad;
}

/* ---- Top-k of score rows: by value, ties to the earliest position (the indexer's picks) ---- */

/* One (value, position) pair as a key whose ascending order is value descending, then position ascending
   (-0 ranks as +0, as the portable path's stable sort, which sees them equal). */
static inline uint64_t rank_key(float v, uint32_t t) {
    uint32_t u;
    v = v == 0.f ? 0.f : v;
    memcpy(&u, &v, sizeof u);
    uint32_t ascending = u & 0x80000000u ? ~u : u | 0x80000000u;
    return (uint64_t)~ascending << 32 | t;
}

/* a[0..n) sorted ascending (keys are distinct): insertion sort of runs of 16, then merges of doubling runs
   between a and tmp (n values), compares inline (glibc's qsort called a comparison function for every pair:
   topk_rows was 1.4x slower at 8,000 -> 2,048 keys, 2.1x at 100 -> 64). */
static void sort_keys(uint64_t *a, int64_t n, uint64_t *tmp) {
    enum { RUN_LEN = 16 };
    for (int64_t r = 0; r < n; r += RUN_LEN) {
        int64_t end = r + RUN_LEN < n ? r + RUN_LEN : n;
        for (int64_t i = r + 1; i < end; i++) {
            uint64_t v = a[i];
            int64_t j = i;
            for (; j > r && a[j - 1] > v; j--) a[j] = a[j - 1];
            a[j] = v;
        }
    }
    uint64_t *src = a, *dst = tmp;
    for (int64_t width = RUN_LEN; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) dst[o++] = src[i] < src[j] ? src[i++] : src[j++];
            while (i < mid) dst[o++] = src[i++];
            while (j < hi) dst[o++] = src[j++];
        }
        uint64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != a) memcpy(a, src, sizeof(uint64_t) * n);
}

/* Quickselect: afterwards a[0..k) hold the k smallest of a[0..n) (keys are distinct), in any order (rows under
   RADIX_MIN keys: the radix select's counters cost more than its passes save there). */
static void quickselect(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        uint64_t x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        uint64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) { uint64_t s = a[i]; a[i] = a[j]; a[j] = s; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

#define RADIX_MIN 1024
/* Radix select: afterwards a[0..k) hold the k smallest of a[0..n) (keys are distinct), in any order; tmp holds n
   keys of scratch. Keys are counted by 11-bit digits of their high 32 bits (the score's rank), the most
   significant first: the buckets below the one that holds the k-th key are taken whole, that one is narrowed by
   the next digit, and keys equal in all 32 bits are taken in position order (their low bits), which each stable
   pass keeps. Three passes at most and no comparisons between keys (a quickselect's branches were a coin toss:
   1.3x slower at 8,000 keys). */
static void smallest(uint64_t *a, int64_t n, int64_t k, uint64_t *tmp) {
    if (n < RADIX_MIN) {
        quickselect(a, n, k);
        return;
    }
    int64_t taken = 0, nc = n;  /* a[0..taken) chosen; the candidates: a[taken..n) at first, then tmp[0..nc) */
    const uint64_t *cand = a;
    static const int shifts[3] = {53, 42, 32};  /* digits: bits 53..63, 42..52, 32..41 (the rank's 32 bits) */
    for (int pass = 0; pass < 3 && taken < k; pass++) {
        const int shift = shifts[pass], bits = shift == 32 ? 10 : 11;
        int64_t count[2048] = {0};
        for (int64_t i = 0; i < nc; i++) count[(cand[i] >> shift) & ((1u << bits) - 1)]++;
        int64_t need = k - taken, below = 0, b = 0;
        while (below + count[b] < need) below += count[b++];
        int64_t kept = 0, whole = below + count[b] == need;
        for (int64_t i = 0; i < nc; i++) {
            uint64_t key = cand[i];
            int64_t digit = (int64_t)((key >> shift) & ((1u << bits) - 1));
            if (digit < b || (whole && digit == b)) a[taken++] = key;
            else if (digit == b) tmp[kept++] = key;
        }
        cand = tmp;
        nc = kept;
    }
    for (int64_t i = 0; taken < k; i++) a[taken++] = cand[i];  /* equal ranks: the earliest positions */
}

/* out[i] = the position of the largest of logits[i, :v] (fp32), the earliest where several tie (torch's argmax):
   greedy decoding's token, each row in one pass that also checks its values are finite. Returns 1 where some
   value is a NaN or an infinity (out not to be trusted: the caller's sampler sanitizes such rows first), else 0.
   (A batch's argmax plus its finiteness checks in torch were five passes over the logits: ~3 % of a 256-row
   decode step of the tiny model.) */
int32_t greedy_rows(const float *logits, int64_t n, int64_t v, int64_t *out, int32_t threads) {
    int32_t bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad) if (n * v >= (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        const float *row = logits + i * v;
        v8 best = splat(-INFINITY);
        v8i at = {0, 1, 2, 3, 4, 5, 6, 7}, pos = at, odd = {0};
        int64_t j = 0;
        for (; j + DW <= v; j += DW, pos += DW) {  /* per lane: its first largest value and where */
            v8 x = LOAD(row + j);
            v8i more = x > best;
            best = vsel(more, x, best);
            at = (more & pos) | (~more & at);
            odd |= (x - x) != splat(0.f);  /* NaN or an infinity */
        }
        float top = -INFINITY;
        int64_t where = 0;
        for (int l = 0; l < DW; l++)
            if (best[l] > top || (best[l] == top && at[l] < where)) { top = best[l]; where = at[l]; }
        for (; j < v; j++) {
            odd[0] |= !(row[j] - row[j] == 0.f);
            if (row[j] > top) { top = row[j]; where = j; }
        }
        int lanes_odd = 0;
        for (int l = 0; l < DW; l++) lanes_odd |= odd[l] != 0;
        bad |= lanes_odd || top == -INFINITY;
        out[i] = where;
    }
    return bad;
}

/* picks[i, :m] = the positions of the m = min(k, width) largest scores[i, :] (value descending, ties to the
   earliest position), valid[i, j] = that score is finite; picks[i, m:] = 0, valid 0. Width < 2^32. */
void topk_rows(const float *scores, int64_t n, int64_t width, int64_t k, int64_t *picks, uint8_t *valid,
               int32_t threads) {
    const int64_t m = k < width ? k : width;
    #pragma omp parallel num_threads(threads)
    {
        uint64_t *keys = xmalloc(sizeof(uint64_t) * (width ? width : 1));
        uint64_t *tmp = xmalloc(sizeof(uint64_t) * (width ? width : 1));  /* smallest's and sort_keys' scratch */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            const float *row = scores + i * width;
            for (int64_t t = 0; t < width; t++) keys[t] = rank_key(row[t], (uint32_t)t);
            if (m < width) smallest(keys, width, m, tmp);
            sort_keys(keys, m, tmp);
            for (int64_t j = 0; j < k; j++) {
                int64_t t = j < m ? (int64_t)(keys[j] & 0xffffffffu) : 0;
                picks[i * k + j] = t;
                valid[i * k + j] = j < m && isfinite(row[t]);
            }
        }
        free(keys);
        free(tmp);
    }
}

/* ---- MoE: routing + routed experts for a few rows ---- */

/* The dot product of weight row w[off:off + n] (fp32, or bf16 with w_bf16) and b: fused multiply-adds in 8
   lanes, summed in hsum8's order, then the tail in order (a bf16 weight: the bits of its fp32 copy's). */
static inline __attribute__((always_inline)) float wdot(const void *w, int w_bf16, int64_t off, const float *b,
                                                        int64_t n) {
    v8 acc = {0};
    int64_t d = 0;
    for (; d + DW <= n; d += DW) acc = vfma(wload(w, w_bf16, off + d), LOAD(b + d), acc);
    float s = hsum8(acc);
    for (; d < n; d++) s = fmaf(widen(w, w_bf16, off + d), b[d], s);
    return s;
}

static float dot(const float *w, int64_t off, const float *b, int64_t n) { return wdot(w, 0, off, b, n); }

/* out[o][q] = wdot(w, w_bf16, w_off[o], x[q], k) for two weight rows and four input rows (k % DW == 0) in one
   pass: each weight chunk loaded once for the four rows, eight independent sums in registers, each summed in
   hsum8's order (sum4): the bits of wdot() one row at a time. Inlined, so each caller's weight format is a
   constant in its copy. */
static inline __attribute__((always_inline)) void tile_2x4(const void *w, int w_bf16, const int64_t w_off[2],
                                                            const float *const x[4], int64_t k, float out[2][4]) {
    /* named accumulators: GCC keeps a 2-D array of them in memory (measured: half the speed) */
    v8 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    for (int64_t d = 0; d < k; d += DW) {
        v8 wv0 = wload(w, w_bf16, w_off[0] + d), wv1 = wload(w, w_bf16, w_off[1] + d);
        v8 xv0 = LOAD(x0 + d), xv1 = LOAD(x1 + d), xv2 = LOAD(x2 + d), xv3 = LOAD(x3 + d);
        a00 = vfma(wv0, xv0, a00); a01 = vfma(wv0, xv1, a01); a02 = vfma(wv0, xv2, a02); a03 = vfma(wv0, xv3, a03);
        a10 = vfma(wv1, xv0, a10); a11 = vfma(wv1, xv1, a11); a12 = vfma(wv1, xv2, a12); a13 = vfma(wv1, xv3, a13);
    }
    v4 s0 = sum4(a00, a01, a02, a03), s1 = sum4(a10, a11, a12, a13);
    for (int q = 0; q < 4; q++) { out[0][q] = s0[q]; out[1][q] = s1[q]; }
}

/* ---- Wide tiles: a 512-bit register holds two outputs' eight lanes ---- */

/* Where the CPU has AVX-512 (or AVX2 + FMA, below), matmuls of fp32 rows (a bf16 model's on a CPU without bf16
   arithmetic: its linears' fp32 weight copies, its experts' bf16 weights widened as read) run four weight rows by
   twelve input rows a pass: each register holds the eight lanes of two outputs (input rows 2p and 2p + 1, packed
   side by side), each lane the same chain of fused multiply-adds as tile_2x4's and wdot's, summed by sum4: every
   output keeps wdot()'s bits, so a row's result is the same whichever kernel, ISA or batch computes it. Two thirds
   fewer loads per product than tile_2x4 (whose loads, not its multiplies, bound it: ~35 GFLOP/s a core against the
   core's ~130). Six pairs a pass (24 accumulators of the 32 registers) rather than four: each weight load feeds six
   multiply-adds, not four (prompt-sized linears 5-14 % faster on one core, a batch-64 decode step ~4 %). With AVX2
   + FMA only (16 ymm registers) the passes, blocks and packing are the same and wide_tile's register blocks are
   rows2_tile's: two weight rows by up to six input rows, twelve chains, each the same sum. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define HAVE_WIDE 1
#define WIDE_ZMM 1
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_WIDE 1  /* the same passes, blocks and packing; AVX2 register blocks in wide_tile (rows2_tile) */
#define WIDE_ZMM 0
#else
#define HAVE_WIDE 0
#define WIDE_ZMM 0
#endif
#if HAVE_WIDE
#define WP 6  /* input-row pairs per wide pass */
#define WIDE_STATE (64 * WP)  /* floats of chains a pass of four weight rows keeps between its calls */

/* rows[0..n) (fp32, k values each, k % DW == 0) packed for wide_tile: pair p's chunk at d is 16 floats, row 2p's
   d..d+7 then row 2p+1's (an odd n's last pair holds its row twice); pair p starts at xp + 2pk. */
static void pack_pairs(const float *const *rows, int64_t n, int64_t k, float *xp) {
    for (int64_t p = 0; p < (n + 1) / 2; p++) {
        const float *a = rows[2 * p], *b = rows[2 * p + 1 < n ? 2 * p + 1 : 2 * p];
        for (int64_t d = 0; d < k; d += DW) {
            memcpy(xp + 2 * (p * k + d), a + d, DW * sizeof(float));
            memcpy(xp + 2 * (p * k + d) + DW, b + d, DW * sizeof(float));
        }
    }
}

#if WIDE_ZMM
/* Eight weights from w at i (fp32, or bf16 widened exactly: the bits move up) in both halves of a register. */
static inline __attribute__((always_inline)) __m512 wide_weights(const void *w, const int bf16, int64_t i) {
    if (!bf16) return _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)w + i));
    __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The eight outputs of four registers (each two outputs' 8 lanes, as wide_tile holds them), each summed in sum4's
   order ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) by shuffles of whole registers: lanes 0-3 the first
   outputs of a, b, c, d, lanes 8-11 their second ones (4-7 and 12-15 the same again). A third of the
   instructions of four sum4 calls, which took a pass about as long as its multiplies at k = 64. */
static inline __m512 sum4x2(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));  /* pairs of lanes */
    __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x88), _mm512_shuffle_ps(c, d, 0xDD));
    __m512 q = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88), _mm512_shuffle_ps(ab, cd, 0xDD));  /* fours */
    return _mm512_add_ps(q, _mm512_shuffle_f32x4(q, q, 0xB1));  /* lanes 0-3 with 4-7 of each output */
}

#define FMA4(x, c0, c1, c2, c3) do { __m512 xv = _mm512_loadu_ps(x); c0 = _mm512_fmadd_ps(v0, xv, c0); \
    c1 = _mm512_fmadd_ps(v1, xv, c1); c2 = _mm512_fmadd_ps(v2, xv, c2); c3 = _mm512_fmadd_ps(v3, xv, c3); } while (0)

/* out[o][q] = weight row w + off[o] (fp32, or bf16 with bf16) . packed input row q (q < 2P, the P pairs from xp,
   2k floats apart), each the sum wdot() makes, over dims [d0, d1) a call: a call from d0 > 0 goes on from the
   chains `state` holds (16 registers' worth), one ending before k leaves them there, one ending at k sums them
   into out. The chains run in the same order however k is cut: the cut only lets a pass's input chunk stay in
   L1 while every weight row of a block passes it. Inlined with P and bf16 constant, so unused accumulators vanish
   (named: see tile_2x4). */
static inline __attribute__((always_inline)) void wide_tile(const void *w, const int bf16, const int64_t off[4],
                                                             const float *xp, int64_t k, const int P, int64_t d0,
                                                             int64_t d1, float *state, float out[2 * WP][4]) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c04 = c00, c05 = c00;
    __m512 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c14 = c00, c15 = c00;
    __m512 c20 = c00, c21 = c00, c22 = c00, c23 = c00, c24 = c00, c25 = c00;
    __m512 c30 = c00, c31 = c00, c32 = c00, c33 = c00, c34 = c00, c35 = c00;
#define CHAINS(X) X(c00, 0) X(c01, 1) X(c02, 2) X(c03, 3) X(c04, 4) X(c05, 5) X(c10, 6) X(c11, 7) X(c12, 8) \
    X(c13, 9) X(c14, 10) X(c15, 11) X(c20, 12) X(c21, 13) X(c22, 14) X(c23, 15) X(c24, 16) X(c25, 17) X(c30, 18) \
    X(c31, 19) X(c32, 20) X(c33, 21) X(c34, 22) X(c35, 23)
#define LOAD_CHAIN(c, i) c = _mm512_loadu_ps(state + 16 * i);
#define STORE_CHAIN(c, i) _mm512_storeu_ps(state + 16 * i, c);
    if (d0 > 0) { CHAINS(LOAD_CHAIN) }
    for (int64_t d = d0; d < d1; d += DW) {
        __m512 v0 = wide_weights(w, bf16, off[0] + d), v1 = wide_weights(w, bf16, off[1] + d);
        __m512 v2 = wide_weights(w, bf16, off[2] + d), v3 = wide_weights(w, bf16, off[3] + d);
        const float *x = xp + 2 * d;
        FMA4(x, c00, c10, c20, c30);
        if (P > 1) FMA4(x + 2 * k, c01, c11, c21, c31);
        if (P > 2) FMA4(x + 4 * k, c02, c12, c22, c32);
        if (P > 3) FMA4(x + 6 * k, c03, c13, c23, c33);
        if (P > 4) FMA4(x + 8 * k, c04, c14, c24, c34);
        if (P > 5) FMA4(x + 10 * k, c05, c15, c25, c35);
    }
    if (d1 < k) { CHAINS(STORE_CHAIN) return; }
#undef LOAD_CHAIN
#undef STORE_CHAIN
#undef CHAINS
    const __m512 acc[4][WP] = {{c00, c01, c02, c03, c04, c05}, {c10, c11, c12, c13, c14, c15},
                               {c20, c21, c22, c23, c24, c25}, {c30, c31, c32, c33, c34, c35}};
    for (int p = 0; p < P; p++) {
        float s[16];
        _mm512_storeu_ps(s, sum4x2(acc[0][p], acc[1][p], acc[2][p], acc[3][p]));
        memcpy(out[2 * p], s, sizeof out[0]);
        memcpy(out[2 * p + 1], s + 8, sizeof out[0]);
    }
}
#undef FMA4
#else
/* On AVX2 (16 ymm registers) a wide pass runs as register blocks of two weight rows by up to six input rows: 12
   chains (the FMA's latency times its two ports wants at least 8), two weight and one input chunk in registers.
   Each chain is wdot()'s, summed by sum4. Input rows are read from the packed pairs (row 2p's chunk at d, then
   row 2p + 1's). */
#define AX(q) (xp + 2 * ((q) / 2) * k + ((q) % 2) * DW)  /* input row q's packed values, chunk d at AX(q) + 2d */
#define AX_FMA(q) if (R > q) { v8 xv = LOAD(AX(q) + 2 * d); __asm__("" : "+x"(xv)); \
    a0##q = vfma(w0, xv, a0##q); a1##q = vfma(w1, xv, a1##q); }
#define AX_CHAINS(X) X(a00, 0) X(a01, 1) X(a02, 2) X(a03, 3) X(a04, 4) X(a05, 5) \
    X(a10, 6) X(a11, 7) X(a12, 8) X(a13, 9) X(a14, 10) X(a15, 11)
static inline __attribute__((always_inline)) void
rows2_tile(const void *w, const int bf16, int64_t off0, int64_t off1, const float *xp, int64_t k, const int R,
           int64_t d0, int64_t d1, float *st, float out[2 * WP][4], int o, int q0) {
    v8 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a04 = {0}, a05 = {0};
    v8 a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0}, a14 = {0}, a15 = {0};
#define LOAD_CHAIN(c, i) if (i % 6 < R) c = LOAD(st + 8 * i);
#define STORE_CHAIN(c, i) if (i % 6 < R) STORE(st + 8 * i, c);
    if (d0 > 0) { AX_CHAINS(LOAD_CHAIN) }
    for (int64_t d = d0; d < d1; d += DW) {
        v8 w0 = wload(w, bf16, off0 + d), w1 = wload(w, bf16, off1 + d);
        AX_FMA(0) AX_FMA(1) AX_FMA(2) AX_FMA(3) AX_FMA(4) AX_FMA(5)
    }
    if (d1 < k) { AX_CHAINS(STORE_CHAIN) return; }
#undef LOAD_CHAIN
#undef STORE_CHAIN
    const v8 c0[6] = {a00, a01, a02, a03, a04, a05}, c1[6] = {a10, a11, a12, a13, a14, a15};
    for (int q = 0; q < R; q += 2) {
        v4 sums = sum4(c0[q], c1[q], c0[q + 1 < R ? q + 1 : q], c1[q + 1 < R ? q + 1 : q]);
        out[q0 + q][o] = sums[0]; out[q0 + q][o + 1] = sums[1];
        if (q + 1 < R) { out[q0 + q + 1][o] = sums[2]; out[q0 + q + 1][o + 1] = sums[3]; }
    }
}
#undef AX_FMA
#undef AX_CHAINS
#undef AX

/* wide_tile's contract on AVX2: weight rows (0, 1) then (2, 3), each by the P pairs' rows six at a time. */
static inline __attribute__((always_inline)) void wide_tile(const void *w, const int bf16, const int64_t off[4],
                                                             const float *xp, int64_t k, const int P, int64_t d0,
                                                             int64_t d1, float *state, float out[2 * WP][4]) {
    for (int o = 0; o < 4; o += 2)
        for (int q0 = 0; q0 < 2 * P; q0 += 6) {
            float *st = state + (o / 2 * 2 * WP + q0) * 2 * DW;  /* 12 chains per block of six rows */
            const float *x = xp + q0 * k;  /* row q0 starts pair q0 / 2 */
            switch (2 * P - q0 < 6 ? 2 * P - q0 : 6) {
                case 6: rows2_tile(w, bf16, off[o], off[o + 1], x, k, 6, d0, d1, st, out, o, q0); break;
                case 4: rows2_tile(w, bf16, off[o], off[o + 1], x, k, 4, d0, d1, st, out, o, q0); break;
                default: rows2_tile(w, bf16, off[o], off[o + 1], x, k, 2, d0, d1, st, out, o, q0); break;
            }
        }
}
#endif

/* wide_tile for weight rows [r, min(r + 4, r1)) (an end short of four repeats row r1 - 1, not written) and
   pairs [p0, p0 + P) of xp, P <= WP, over dims [d0, d1); state and out as wide_tile's. */
static void wide_pass(const void *w, int bf16, int64_t k, int64_t r, int64_t r1, const float *xp, int64_t p0,
                      int64_t P, int64_t d0, int64_t d1, float *state, float out[2 * WP][4]) {
    int64_t off[4];
    for (int o = 0; o < 4; o++) off[o] = (r + o < r1 ? r + o : r1 - 1) * k;
    const float *x = xp + 2 * p0 * k;
#define WIDE_CASES(B) switch (P) { \
        case 6: wide_tile(w, B, off, x, k, 6, d0, d1, state, out); break; \
        case 5: wide_tile(w, B, off, x, k, 5, d0, d1, state, out); break; \
        case 4: wide_tile(w, B, off, x, k, 4, d0, d1, state, out); break; \
        case 3: wide_tile(w, B, off, x, k, 3, d0, d1, state, out); break; \
        case 2: wide_tile(w, B, off, x, k, 2, d0, d1, state, out); break; \
        default: wide_tile(w, B, off, x, k, 1, d0, d1, state, out); break; }
    if (bf16) WIDE_CASES(1) else WIDE_CASES(0)
#undef WIDE_CASES
}

#define WIDE_KC 512  /* dims a wide pass takes at a time: a group's 12 input rows (24 KiB) stay in L1 */
/* A task's block of weight rows stays in its L2 while every input row passes it, with the next block streaming in
   beside it (BlockAhead): 512 KiB where the inputs fit in L2 too (a decode step's rows: batch 256's linears 3 %
   faster than 1 MiB blocks, the routed experts ~10 %); 1 MiB where they do not, since each block streams every
   input row from memory again (a 4,096-row prefill chunk's k = 4,096 / 5,120 linears 11 % slower at 512 KiB). */
static int64_t wide_block_bytes(int64_t input_bytes) { return input_bytes <= (6 << 20) ? 1 << 19 : 1 << 20; }

/* Weight rows [r0, r1) (4 a pass) by pairs [p0, p0 + P) of xp (n rows packed), each pass's outputs through
   emit(ctx, weight row r, rows, input row q0, inputs, out): out[q][o] for weight row r + o (o < rows) and input
   row q0 + q (q < inputs), one call a pass (a call per output cost more than the pass at small k: 35 GFLOP/s at
   k = 64); the group's input chunk of WIDE_KC dims passed by every weight row before the next chunk (their
   chains kept in `state`, WIDE_STATE floats per 4 weight rows). */
typedef void (*wide_emit)(void *ctx, int64_t r, int rows, int64_t q0, int inputs, float out[2 * WP][4]);

/* The weight block a thread multiplies next, asked for into L2 a few cache lines a pass while it multiplies this
   one: its bytes stream in beside the arithmetic instead of stalling the block's first passes. */
typedef struct {
    const char *at;
    int64_t lines, per_pass;
} BlockAhead;

/* bytes from `next` (NULL: nothing) spread over `passes` wide passes. */
static BlockAhead block_ahead(const void *next, int64_t bytes, int64_t passes) {
    int64_t lines = next ? (bytes + 63) / 64 : 0;
    BlockAhead ba = {next, lines, passes > 0 ? (lines + passes - 1) / passes : lines};
    return ba;
}

/* The wide passes a block of weight rows [r0, r1) at k dims takes with `pairs` packed input pairs. */
static int64_t wide_passes(int64_t rows, int64_t k, int64_t pairs) {
    return (pairs + WP - 1) / WP * ((k + WIDE_KC - 1) / WIDE_KC) * ((rows + 3) / 4);
}

static inline void block_ahead_pass(BlockAhead *ba) {
    for (int64_t i = 0; i < ba->per_pass && ba->lines > 0; i++, ba->lines--, ba->at += 64) __builtin_prefetch(ba->at, 0, 2);
}

static void wide_block(const void *w, int bf16, int64_t k, int64_t r0, int64_t r1, const float *xp, int64_t n,
                       int64_t p0, int64_t P, float *state, wide_emit emit, void *ctx, BlockAhead *ahead) {
    BlockAhead own = {0, 0, 0};  /* the first group's passes: the block's own rows, two passes ahead */
    if (p0 == 0) {
        const int64_t lead = 8 < r1 - r0 ? 8 : r1 - r0, elem = bf16 ? 2 : 4, chunks = (k + WIDE_KC - 1) / WIDE_KC;
        const char *rows = (const char *)w + r0 * k * elem;
        for (int64_t b = 0; b < lead * k * elem; b += 64) __builtin_prefetch(rows + b, 0, 2);
        own = block_ahead(r1 - r0 > lead ? rows + lead * k * elem : NULL, (r1 - r0 - lead) * k * elem,
                          chunks * ((r1 - r0 + 3) / 4));
    }
    for (int64_t d0 = 0; d0 < k; d0 += WIDE_KC) {
        int64_t d1 = d0 + WIDE_KC < k ? d0 + WIDE_KC : k;
        for (int64_t r = r0; r < r1; r += 4) {
            block_ahead_pass(&own);
            block_ahead_pass(ahead);
            float out[2 * WP][4];
            wide_pass(w, bf16, k, r, r1, xp, p0, P, d0, d1, state + (r - r0) / 4 * WIDE_STATE, out);
            if (d1 == k)
                emit(ctx, r, r1 - r < 4 ? (int)(r1 - r) : 4, 2 * p0, n - 2 * p0 < 2 * P ? (int)(n - 2 * p0) : (int)(2 * P),
                     out);
        }
    }
}
#endif

int32_t wide_tiles(void) { return HAVE_WIDE; }

/* DeepSeek's router for one row (spec 7.2): s = sigmoid(x.Wg); choose by s + bias within the
   topk_group groups of best top-2 sums; weights are the unbiased s of the picks, normalized, x scaling.
   Ties go to the lower index. The gate weight fp32, or bf16 with w_bf16 (its fp32 copy's products). */
static void route(const float *x, int64_t dim, const void *gate_w, int w_bf16, const float *bias, int64_t experts,
                  int64_t n_group, int64_t topk_group, int64_t top_k, int norm, float scaling,
                  float *score, float *biased, int64_t *ids, float *wts) {
    for (int64_t e = 0; e < experts; e++) {
        score[e] = 1.f / (1.f + expf(-wdot(gate_w, w_bf16, e * dim, x, dim)));
        biased[e] = score[e] + bias[e];
    }
    if (n_group > 1) {
        int64_t per = experts / n_group;
        float group_score[n_group];
        int keep[n_group];
        for (int64_t g = 0; g < n_group; g++) {
            float a = -INFINITY, b = -INFINITY;  /* best two of the group */
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                if (biased[e] > a) { b = a; a = biased[e]; } else if (biased[e] > b) b = biased[e];
            }
            group_score[g] = a + b;
            keep[g] = 0;
        }
        for (int64_t r = 0; r < topk_group; r++) {
            int64_t best = -1;
            for (int64_t g = 0; g < n_group; g++)
                if (!keep[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
            keep[best] = 1;
        }
        for (int64_t e = 0; e < experts; e++) if (!keep[e / per]) biased[e] = -INFINITY;
    }
    float total = 0.f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++) {
            int taken = 0;
            for (int64_t m = 0; m < j; m++) taken |= ids[m] == e;
            if (!taken && (best < 0 || biased[e] > biased[best])) best = e;
        }
        ids[j] = best;
        wts[j] = score[best];
        total += wts[j];
    }
    for (int64_t j = 0; j < top_k; j++) wts[j] = (norm ? wts[j] / (total + 1e-20f) : wts[j]) * scaling;
}

#if HAVE_DPBF16
/* out[q, r], out[q, r + 1] (r + 1 where two_rows) = weight rows w0, w1 . in[q] for the picks order[k0 .. k1) by
   vdpbf16ps, inputs as bf16 bits (in_ld apart) and bf16 weights: each output's products in pairs as stored (lane
   l of a 16-dim block: dims 2l, 2l + 1), the lanes summed as sum4 does. Four picks a pass, the last 1-3 padded
   with copies of one: every output the same sum whichever pass computes it. cols % 16 == 0. */
static void picks_bf16(const uint16_t *w0, const uint16_t *w1, int two_rows, int64_t r, int64_t cols,
                       const int64_t *order, int64_t k0, int64_t k1, const uint16_t *in, int64_t in_ld, float *out,
                       int64_t out_ld) {
    for (int64_t k = k0; k < k1; k += 4) {
        const uint16_t *x[4];
        for (int q = 0; q < 4; q++) x[q] = in + order[k + q < k1 ? k + q : k1 - 1] * in_ld;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
        for (int64_t d = 0; d < cols; d += 2 * DW) {
#define BF16S(p) ((__m256bh)_mm256_loadu_si256((const __m256i *)(p)))
            __m256bh v0 = BF16S(w0 + d), v1 = BF16S(w1 + d);
            __m256bh x0 = BF16S(x[0] + d), x1 = BF16S(x[1] + d), x2 = BF16S(x[2] + d), x3 = BF16S(x[3] + d);
#undef BF16S
            a00 = _mm256_dpbf16_ps(a00, v0, x0); a01 = _mm256_dpbf16_ps(a01, v0, x1);
            a02 = _mm256_dpbf16_ps(a02, v0, x2); a03 = _mm256_dpbf16_ps(a03, v0, x3);
            a10 = _mm256_dpbf16_ps(a10, v1, x0); a11 = _mm256_dpbf16_ps(a11, v1, x1);
            a12 = _mm256_dpbf16_ps(a12, v1, x2); a13 = _mm256_dpbf16_ps(a13, v1, x3);
        }
        v4 s0 = sum4((v8)a00, (v8)a01, (v8)a02, (v8)a03), s1 = sum4((v8)a10, (v8)a11, (v8)a12, (v8)a13);
        for (int q = 0; q < 4 && k + q < k1; q++) {
            out[order[k + q] * out_ld + r] = s0[q];
            if (two_rows) out[order[k + q] * out_ld + r + 1] = s1[q];
        }
    }
}
#endif

/* out[q, r] = W[e, r, :] . in[q, :] for the picks q of expert e (rows of W in blocks of RB): each
   weight row is read once for all the picks that use it. W fp32, or bf16 with w_bf16 (the same sums); with
   in_bf16 (the inputs as bf16 bits, in_ld apart: a bf16 model's rows) and bf16 weights, by picks_bf16. */
#define RB 16
#if HAVE_WIDE
/* an expert's picks' output rows, weight row `row` of a block being row row0 + row of the expert */
struct picks_out { float *out; const int64_t *order; int64_t out_ld, row0; };
static void put_picks(void *ctx, int64_t r, int rows, int64_t q0, int inputs, float out[2 * WP][4]) {
    struct picks_out *c = ctx;
    for (int q = 0; q < inputs; q++) {
        float *to = c->out + c->order[q0 + q] * c->out_ld + c->row0 + r;
        if (rows == 4) memcpy(to, out[q], 4 * sizeof(float));  /* a fixed size: a move, not a call */
        else memcpy(to, out[q], sizeof(float) * rows);
    }
}

/* n bf16 values widened to fp32 (exact: the bits move up), 16 an instruction; n % 16 == 0. */
static void widen_bf16(const uint16_t *src, int64_t n, float *dst) {
#if WIDE_ZMM
    for (int64_t i = 0; i < n; i += 16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
#else
    for (int64_t i = 0; i < n; i += DW) STORE(dst + i, wload(src, 1, i));
#endif
}

/* expert_gemm's fp32 path by wide tiles: each active expert's picks packed in pairs once (in parallel), then
   tasks of an expert's block of weight rows, each passed by every group of WP of its pairs. */
static void expert_gemm_wide(const void *w, int w_bf16, int64_t rows, int64_t cols, const int64_t *order,
                             const int64_t *start, const int64_t *active, int64_t num_active, const float *in,
                             int64_t in_ld, float *out, int64_t out_ld, int threads) {
    int64_t *first = xmalloc(sizeof(int64_t) * (num_active + 1));  /* each active expert's first pair in xp */
    first[0] = 0;
    for (int64_t a = 0; a < num_active; a++)
        first[a + 1] = first[a] + (start[active[a] + 1] - start[active[a]] + 1) / 2;
    float *xp = xmalloc(sizeof(float) * 2 * first[num_active] * cols);
    const float **ptrs = xmalloc(sizeof(float *) * 2 * first[num_active]);
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t a = 0; a < num_active; a++) {
        int64_t e = active[a], n = start[e + 1] - start[e];
        for (int64_t q = 0; q < n; q++) ptrs[2 * first[a] + q] = in + order[start[e] + q] * in_ld;
        pack_pairs(ptrs + 2 * first[a], n, cols, xp + 2 * first[a] * cols);
    }
    /* blocks of up to wide_block_bytes of fp32 rows (16 rows before): an expert's inputs are read once a block */
    int64_t most = 0;  /* the most picks an expert has */
    for (int64_t a = 0; a < num_active; a++)
        most = start[active[a] + 1] - start[active[a]] > most ? start[active[a] + 1] - start[active[a]] : most;
    int64_t rb = wide_block_bytes(most * cols * 4) / (cols * 4) / 4 * 4;  /* fp32 rows: bf16 ones widened once a block */
    rb = rb < 4 ? 4 : rb > rows ? rows : rb;
    int64_t blocks = (rows + rb - 1) / rb;
    const int64_t tasks = num_active * blocks, row_bytes = cols * (w_bf16 ? 2 : 4);
    int64_t taken = 0;  /* tasks handed out: a thread takes its next as it starts one, to ask for its weights */
    #pragma omp parallel num_threads(threads)
    for (int64_t t = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED), following; t < tasks; t = following) {
        following = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
        int64_t a = t / blocks, e = active[a], n = start[e + 1] - start[e], pairs = first[a + 1] - first[a];
        int64_t r0 = (t % blocks) * rb, r1 = r0 + rb < rows ? r0 + rb : rows;
        const void *block = (const uint8_t *)w + (e * rows + r0) * row_bytes;
        int64_t next_r0 = (following % blocks) * rb, next_rows = (next_r0 + rb < rows ? next_r0 + rb : rows) - next_r0;
        BlockAhead ahead = block_ahead(following < tasks ? (const uint8_t *)w + (active[following / blocks] * rows
                                                                                   + next_r0) * row_bytes : NULL,
                                       next_rows * row_bytes, wide_passes(r1 - r0, cols, pairs));
        int bf16 = w_bf16;
        float *widened = NULL;
        if (bf16 && pairs > WP && cols % 16 == 0) {  /* several groups pass the block: widen it once, not per pass */
            widened = xmalloc(sizeof(float) * (r1 - r0) * cols);  /* (widening takes ports the FMAs need) */
            widen_bf16(block, (r1 - r0) * cols, widened);
            block = widened;
            bf16 = 0;
        }
        float *state = xmalloc(sizeof(float) * ((r1 - r0 + 3) / 4) * WIDE_STATE);
        struct picks_out ctx = {out, order + start[e], out_ld, r0};
        for (int64_t p0 = 0; p0 < pairs; p0 += WP)
            wide_block(block, bf16, cols, 0, r1 - r0, xp + 2 * first[a] * cols, n, p0, pairs - p0 < WP ? pairs - p0 : WP,
                       state, put_picks, &ctx, &ahead);
        free(state); free(widened);
    }
    free(first); free(xp); free(ptrs);
}
#endif

static void expert_gemm(const void *w, int w_bf16, int64_t rows, int64_t cols, const int64_t *order,
                        const int64_t *start, const int64_t *active, int64_t num_active, const float *in,
                        const uint16_t *in_bf16, int64_t in_ld, float *out, int64_t out_ld, int threads) {
    (void)in_bf16;  /* read where the build has vdpbf16ps */
#if HAVE_WIDE
    if (!in_bf16 && cols % DW == 0 && num_active) {  /* fp32 inputs (bf16 ones take picks_bf16) */
        expert_gemm_wide(w, w_bf16, rows, cols, order, start, active, num_active, in, in_ld, out, out_ld, threads);
        return;
    }
#endif
    int64_t blocks = (rows + RB - 1) / RB;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_active * blocks; t++) {
        int64_t e = active[t / blocks], r0 = (t % blocks) * RB, r1 = r0 + RB < rows ? r0 + RB : rows;
        for (int64_t r = r0; r < r1; r += 2) {  /* two weight rows (an odd last one twice) by four picks */
            int64_t off[2] = {(e * rows + r) * cols, (e * rows + (r + 1 < r1 ? r + 1 : r)) * cols};
#if HAVE_DPBF16
            if (in_bf16 && w_bf16) {
                picks_bf16((const uint16_t *)w + off[0], (const uint16_t *)w + off[1], r + 1 < r1, r, cols, order,
                           start[e], start[e + 1], in_bf16, in_ld, out, out_ld);
                continue;
            }
#endif
            int64_t k = start[e];
            for (; k + 4 <= start[e + 1] && cols % DW == 0; k += 4) {
                const float *x[4];
                float sums[2][4];
                for (int q = 0; q < 4; q++) x[q] = in + order[k + q] * in_ld;
                if (w_bf16) tile_2x4(w, 1, off, x, cols, sums);  /* the weight format constant in each copy */
                else tile_2x4(w, 0, off, x, cols, sums);
                for (int o = 0; o < 2 && r + o < r1; o++)
                    for (int q = 0; q < 4; q++) out[order[k + q] * out_ld + r + o] = sums[o][q];
            }
            for (; k < start[e + 1]; k++)
                for (int o = 0; o < 2 && r + o < r1; o++)
                    out[order[k] * out_ld + r + o] = wdot(w, w_bf16, off[o], in + order[k] * in_ld, cols);
        }
    }
}

/* The shared expert, as layers.MLP computes it in a bf16 model when round_out (every linear's output and
   every elementwise result rounded to bf16): adds round(down . (round(silu(round(gate . x))) * round(up . x)))
   to y. gate/up [I, D], down [D, I]. */
static void shared_expert(const float *x, int64_t n, int64_t dim, const float *gate, const float *up,
                          const float *down, int64_t inter, int round_out, float *y, int threads) {
    float *g = xmalloc(sizeof(float) * n * inter), *u = xmalloc(sizeof(float) * n * inter);
    float *o = xmalloc(sizeof(float) * n * dim);
    int64_t *order = xmalloc(sizeof(int64_t) * n), start[2] = {0, n}, active[1] = {0};
    for (int64_t i = 0; i < n; i++) order[i] = i;
    expert_gemm(gate, 0, inter, dim, order, start, active, 1, x, NULL, dim, g, inter, threads);
    expert_gemm(up, 0, inter, dim, order, start, active, 1, x, NULL, dim, u, inter, threads);
    int64_t k = 0;
    for (; k + DW <= n * inter; k += DW) {  /* eight at a time, each lane the scalar loop's value */
        v8 gv = LOAD(g + k), uv = LOAD(u + k);
        if (round_out) { gv = round_bf16x8(gv); uv = round_bf16x8(uv); }
        v8 sv = vsilu(gv);  /* experts_sum's silu */
        STORE(g + k, round_out ? round_bf16x8(round_bf16x8(sv) * uv) : sv * uv);
    }
    for (; k < n * inter; k++) {
        float gv = round_out ? round_bf16(g[k]) : g[k], uv = round_out ? round_bf16(u[k]) : u[k];
        float sv = vsilu(splat(gv))[0];
        g[k] = round_out ? round_bf16(round_bf16(sv) * uv) : sv * uv;
    }
    expert_gemm(down, 0, dim, inter, order, start, active, 1, g, NULL, inter, o, dim, threads);
    for (int64_t k = 0; k < n * dim; k++) y[k] += round_out ? round_bf16(o[k]) : o[k];
    free(g); free(u); free(o); free(order);
}

/* y[i] = sum_j w_ij * round?(down_e . (silu(gate_e . x_i) * (up_e . x_i))) over row i's picks ids[i, j] in j's
   order, skipping ids outside 0..experts-1 (EP: picks another rank holds): fp32; round_out rounds each
   expert's output to bf16 first, as a bf16 model's experts do. gate_up [E, 2I, D] (gate rows first),
   down [E, D, I], fp32 or bf16 (w_bf16). A row's sum depends only on that row and its picks. */
static void experts_sum(const float *x, int64_t n, int64_t dim, const int64_t *ids, const float *wts, int64_t top_k,
                        int64_t experts, const void *gate_up, const void *down, int64_t inter, int w_bf16,
                        int round_out, float *y, int threads) {
    int64_t picks = n * top_k;
    int64_t *order = xmalloc(sizeof(int64_t) * (picks + 1)), *start = xcalloc(experts + 1, sizeof(int64_t));
    int64_t *active = xmalloc(sizeof(int64_t) * (experts + 1)), num_active = 0, valid = 0;
    for (int64_t p = 0; p < picks; p++)  /* picks grouped by expert */
        if (ids[p] >= 0 && ids[p] < experts) { start[ids[p] + 1]++; valid++; }
    for (int64_t e = 0; e < experts; e++) {
        if (start[e + 1]) active[num_active++] = e;
        start[e + 1] += start[e];
    }
    int64_t *fill = xmalloc(sizeof(int64_t) * (experts + 1));
    memcpy(fill, start, sizeof(int64_t) * experts);
    /* the gemms address inputs by slot: a valid pick p gets slot[p], whose input row is x[p / top_k] */
    int64_t *slot = xmalloc(sizeof(int64_t) * (picks + 1));
    /* the slots' input rows: a bf16 model's rows (bf16 values) as bf16 for bf16 weights' vdpbf16ps, else fp32 */
    const int dots = HAVE_DPBF16 && w_bf16 && round_out && dim % (2 * DW) == 0;
    float *xs = dots ? NULL : xmalloc(sizeof(float) * (valid + 1) * dim);
    uint16_t *xb = dots ? xmalloc(sizeof(uint16_t) * (valid + 1) * dim) : NULL;
    for (int64_t p = 0, v = 0; p < picks; p++) {
        slot[p] = ids[p] < 0 || ids[p] >= experts ? -1 : v++;
        if (slot[p] >= 0) order[fill[ids[p]]++] = slot[p];
    }
    #pragma omp parallel for num_threads(threads) schedule(static) if (valid * dim >= 65536)
    for (int64_t p = 0; p < picks; p++) {  /* each slot's row copied, in parallel: a prefill's are many MB */
        int64_t v = slot[p];
        if (v < 0) continue;
        const float *row = x + (p / top_k) * dim;
        if (dots)
            for (int64_t d = 0; d < dim; d += DW) {
                v8h h = __builtin_convertvector((v8ui)LOAD(row + d) >> 16, v8h);
                memcpy(xb + v * dim + d, &h, sizeof h);
            }
        else
            memcpy(xs + v * dim, row, sizeof(float) * dim);
    }
    free(fill);
    float *gu = xmalloc(sizeof(float) * (valid + 1) * 2 * inter), *act = xmalloc(sizeof(float) * (valid + 1) * inter);
    float *o = xmalloc(sizeof(float) * (valid + 1) * dim);
    expert_gemm(gate_up, w_bf16, 2 * inter, dim, order, start, active, num_active, xs, xb, dim, gu, 2 * inter,
                threads);
    free(xb);
    #pragma omp parallel for num_threads(threads) schedule(static) if (valid * inter >= 65536)
    for (int64_t v = 0; v < valid; v++) {
        const float *g = gu + v * 2 * inter, *u = g + inter;
        int64_t c = 0;
        for (; c + DW <= inter; c += DW) STORE(act + v * inter + c, vsilu(LOAD(g + c)) * LOAD(u + c));
        for (; c < inter; c++) {  /* a last partial vector: its lanes alone */
            v8 one = splat(g[c]);
            act[v * inter + c] = vsilu(one)[0] * u[c];
        }
    }
    expert_gemm(down, w_bf16, dim, inter, order, start, active, num_active, act, NULL, inter, o, dim, threads);
    #pragma omp parallel for num_threads(threads) schedule(static) if (n * dim >= 65536)
    for (int64_t i = 0; i < n; i++) {
        int64_t d = 0;
        for (; d + DW <= dim; d += DW) {  /* eight dims at a time, each lane the scalar loop's sum */
            v8 acc = splat(0.f);
            for (int64_t j = 0; j < top_k; j++) {
                int64_t v = slot[i * top_k + j];
                if (v < 0) continue;
                v8 e = LOAD(o + v * dim + d);
                acc = acc + (round_out ? round_bf16x8(e) : e) * splat(wts[i * top_k + j]);
            }
            STORE(y + i * dim + d, acc);
        }
        for (; d < dim; d++) {
            float acc = 0.f;
            for (int64_t j = 0; j < top_k; j++) {
                int64_t v = slot[i * top_k + j];
                if (v < 0) continue;
                float e = o[v * dim + d];
                acc += (round_out ? round_bf16(e) : e) * wts[i * top_k + j];
            }
            y[i * dim + d] = acc;
        }
    }
    free(order); free(start); free(active); free(slot); free(xs); free(gu); free(act); free(o);
}

/* The router alone (route, row by row): ids [n, top_k] and their weights wts [n, top_k] for rows x [n, dim],
   gate weight [experts, dim] fp32 or bf16 (w_bf16). A decode step's rows, routed as moe_routed routes them,
   whatever shape the MoE after it takes (one rank, EP). */
int32_t moe_route(const float *x, int64_t n, int64_t dim, const void *gate_w, int32_t w_bf16, const float *bias,
                  int64_t experts, int64_t n_group, int64_t topk_group, int64_t top_k, int32_t norm, float scaling,
                  int64_t *ids, float *wts, int32_t threads) {
    #pragma omp parallel num_threads(threads)
    {
        float *score = xmalloc(sizeof(float) * experts), *biased = xmalloc(sizeof(float) * experts);
        #pragma omp for
        for (int64_t i = 0; i < n; i++)
            route(x + i * dim, dim, gate_w, w_bf16, bias, experts, n_group, topk_group, top_k, norm, scaling,
                  score, biased, ids + i * top_k, wts + i * top_k);
        free(score); free(biased);
    }
    return 0;
}

/* experts_sum over the top_k experts the router picks for each row, plus the shared expert when shared_gate is
   given; every weight fp32. ids_out [n, top_k] gets the picks. */
int32_t moe_routed(const float *x, int64_t n, int64_t dim, const float *gate_w, const float *bias,
                   int64_t experts, int64_t n_group, int64_t topk_group, int64_t top_k, int32_t norm,
                   float scaling, const float *gate_up, const float *down, int64_t inter, int32_t round_out,
                   const float *shared_gate, const float *shared_up, const float *shared_down, int64_t shared_inter,
                   float *y, int64_t *ids_out, int32_t threads) {
    float *wts = xmalloc(sizeof(float) * n * top_k);
    moe_route(x, n, dim, gate_w, 0, bias, experts, n_group, topk_group, top_k, norm, scaling, ids_out, wts, threads);
    experts_sum(x, n, dim, ids_out, wts, top_k, experts, gate_up, down, inter, 0, round_out, y, threads);
    if (shared_gate) shared_expert(x, n, dim, shared_gate, shared_up, shared_down, shared_inter, round_out, y, threads);
    free(wts);
    return 0;
}

/* The routed experts alone, for picks a router made elsewhere (ids [n, top_k] local to these experts; others
   skipped, as an EP rank's foreign picks): experts_sum. Weights fp32 or bf16 (w_bf16). */
int32_t moe_experts(const float *x, int64_t n, int64_t dim, const int64_t *ids, const float *wts, int64_t top_k,
                    int64_t experts, const void *gate_up, const void *down, int64_t inter, int32_t w_bf16,
                    int32_t round_out, float *y, int32_t threads) {
    experts_sum(x, n, dim, ids, wts, top_k, experts, gate_up, down, inter, w_bf16, round_out, y, threads);
    return 0;
}

/* ---- RMSNorm: y = w * (x / rms(x)), the normalized x rounded to x's dtype before the weight ---- */

static inline void put(void *y, int y_bf16, int64_t k, float v) {  /* store as bf16 bits or as fp32 */
    if (y_bf16) ((uint16_t *)y)[k] = narrow(v);
    else ((float *)y)[k] = v;
}

/* One row: y[yoff + d] = w[d] * round(x[xoff + d] / rms(x)) in x's arithmetic (bf16: the normalized value
   and the product rounded to bf16), stored bf16 or fp32. The squares summed in 8 lanes, then hsum8's order, then
   any last values (one chain of dim additions took a prompt's cache-row writes ~4 us a row); eight values a step
   after, each lane what the scalar code computes for its value. */
static void norm_row(const void *x, int64_t xoff, int bf16, const void *w, int64_t dim, float eps,
                     void *y, int64_t yoff, int y_bf16) {
    v8 lanes = splat(0.f);
    int64_t d = 0;
    for (; d + DW <= dim; d += DW) {
        v8 v = wload(x, bf16, xoff + d);
        lanes = lanes + v * v;
    }
    float ss = hsum8(lanes);
    for (int64_t e = d; e < dim; e++) { float v = widen(x, bf16, xoff + e); ss += v * v; }
    float r = 1.f / sqrtf(ss / (float)dim + eps);
    for (d = 0; d + DW <= dim; d += DW) {
        v8 v = wload(x, bf16, xoff + d) * splat(r);
        put8(y, y_bf16, yoff + d, bf16 ? round_bf16x8(wload(w, 1, d) * round_bf16x8(v)) : LOAD((const float *)w + d) * v);
    }
    for (; d < dim; d++) {
        float v = widen(x, bf16, xoff + d) * r;
        put(y, y_bf16, yoff + d, bf16 ? round_bf16(widen(w, 1, d) * round_bf16(v)) : ((const float *)w)[d] * v);
    }
}

/* x, w and y all bf16 (bf16 != 0) or all fp32; rows of `dim` values. */
void rms_norm(const void *x, const void *w, void *y, int64_t n, int64_t dim, float eps, int32_t bf16,
              int32_t threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (n * dim >= 65536)
    for (int64_t i = 0; i < n; i++) norm_row(x, i * dim, bf16, w, dim, eps, y, i * dim, bf16);
}

/* ---- RoPE: y = x * cos + swap(x) * sin (rope.RopeAngles' widened tables, sign folded into sin) ---- */

/* One rotary vector of d values at x[xoff..] with cos/sin[coff..]; interleaved: swap(x) exchanges pairs
   (2i, 2i+1), else the halves (NeoX). In bf16 each product and the sum is rounded, as torch's bf16 ops
   do; fp32 products are not fused (no fmaf here), so both match torch bit for bit. Eight values a step (a
   NeoX half at a time, so a step's partners are contiguous), one at a time past the last whole step. */
static void rope_row(const void *x, int64_t xoff, int bf16, const void *cos, const void *sin, int64_t coff,
                     int64_t d, int interleaved, void *y, int64_t yoff, int y_bf16) {
    int64_t half = d / 2, k = 0;
    for (int64_t end = interleaved ? d : half; k < d; end = d) {
        for (; k + DW <= end; k += DW) {
            v8 xv = wload(x, bf16, xoff + k);
            v8 sv = interleaved ? __builtin_shufflevector(xv, xv, 1, 0, 3, 2, 5, 4, 7, 6)
                                : wload(x, bf16, xoff + (k < half ? k + half : k - half));
            v8 a = xv * wload(cos, bf16, coff + k), b = sv * wload(sin, bf16, coff + k);
            put8(y, y_bf16, yoff + k, bf16 ? round_bf16x8(round_bf16x8(a) + round_bf16x8(b)) : a + b);
        }
        for (; k < end; k++) {
            int64_t other = interleaved ? (k ^ 1) : (k < half ? k + half : k - half);
            float xv = widen(x, bf16, xoff + k), sv = widen(x, bf16, xoff + other);
            float a = xv * widen(cos, bf16, coff + k), b = sv * widen(sin, bf16, coff + k);
            put(y, y_bf16, yoff + k, bf16 ? round_bf16(round_bf16(a) + round_bf16(b)) : a + b);
        }
    }
}

/* Rows [n, heads, d] of x (strides xs_row, xs_head; the last dim contiguous) into y (ys_row, ys_head; bf16
   or fp32 storage), cos/sin [n, d] in x's dtype. */
void rope(const void *x, int64_t xs_row, int64_t xs_head, void *y, int64_t ys_row, int64_t ys_head, int32_t y_bf16,
          int64_t n, int64_t heads, int64_t d, const void *cos, const void *sin, int32_t interleaved, int32_t bf16) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < heads; h++)
            rope_row(x, i * xs_row + h * xs_head, bf16, cos, sin, i * d, d, interleaved, y, i * ys_row + h * ys_head,
                     y_bf16);
}

/* ---- The lightning indexer's query and key rows: rope, Hadamard rotation, FP8 (ue8m0) fake quantization ---- */

/* DeepSeek's ue8m0 scale of a block whose largest magnitude is amax: 2^ceil(log2(max(amax, 1e-4) / 448)), the
   ceiling taken exactly (amax / 448 = m * 2^e with m in [0.5, 1)). */
static inline float ue8m0_scale(float amax) {
    int e;
    float m = frexpf((amax > 1e-4f ? amax : 1e-4f) / 448.f, &e);
    return ldexpf(1.f, m == 0.5f ? e - 1 : e);
}

/* x / scale clamped to +-448 and rounded to FP8 e4m3 (round to nearest even), back as fp32, eight lanes at a time:
   act_quant_ue8m0's value before its scale, torch's .to(float8_e4m3fn).float(). Normals (|v| >= 2^-6) keep 3
   mantissa bits (rounded in the bits), subnormals are multiples of 2^-9 (nearbyintf's rounding, the sign of a zero
   kept). */
static inline v8 e4m3_scaled8(v8 x, float scale) {
    v8 v = x / splat(scale);
    v = vsel(v > splat(448.f), splat(448.f), vsel(v < splat(-448.f), splat(-448.f), v));
    v8 t = v * splat(512.f), whole;
#if defined(__AVX__)
    whole = (v8)_mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    for (int e = 0; e < DW; e++) whole[e] = nearbyintf(t[e]);
#endif
    v8ui u = (v8ui)v, normal = (u + 0x7ffffu + ((u >> 20) & 1u)) & ~0xfffffu;
    v8 mag = (v8)((v8ui)v & 0x7fffffffu);
    return vsel(mag < splat(0x1p-6f), whole * splat(0x1p-9f), (v8)normal);
}

/* The largest magnitude of n values (n % DW == 0), as a scalar loop of |v| > amax ? |v| : amax takes it (NaN
   skipped, 0 for none): lane by lane, then over the lanes (the maximum does not depend on the order). */
static inline float amax8(const float *row, int64_t n) {
    v8 top = splat(0.f);
    for (int64_t d = 0; d < n; d += DW) {
        v8 mag = (v8)((v8ui)LOAD(row + d) & 0x7fffffffu);
        top = vsel(mag > top, mag, top);
    }
    float amax = 0.f;
    for (int e = 0; e < DW; e++) amax = top[e] > amax ? top[e] : amax;
    return amax;
}

/* One step of the fast Walsh-Hadamard transform (Sylvester order: H = [[H, H], [H, -H]]) on a row of dim fp32
   values, pairs `len` apart: row[k] = a + c, row[k + len] = a - c. Steps of 1, 2 and 4 within each eight-value
   vector, longer ones across vectors: each value the scalar butterfly's. */
static inline void hadamard_step(float *row, int64_t dim, int64_t len) {
    if (len >= DW) {
        for (int64_t b = 0; b < dim; b += 2 * len)
            for (int64_t k = b; k < b + len; k += DW) {
                v8 a = LOAD(row + k), c = LOAD(row + k + len);
                STORE(row + k, a + c);
                STORE(row + k + len, a - c);
            }
        return;
    }
    for (int64_t k = 0; k < dim; k += DW) {
        v8 v = LOAD(row + k), a, c, out;
        if (len == 1) {
            a = __builtin_shufflevector(v, v, 0, 0, 2, 2, 4, 4, 6, 6);
            c = __builtin_shufflevector(v, v, 1, 1, 3, 3, 5, 5, 7, 7);
            out = __builtin_shufflevector(a + c, a - c, 0, 9, 2, 11, 4, 13, 6, 15);
        } else if (len == 2) {
            a = __builtin_shufflevector(v, v, 0, 1, 0, 1, 4, 5, 4, 5);
            c = __builtin_shufflevector(v, v, 2, 3, 2, 3, 6, 7, 6, 7);
            out = __builtin_shufflevector(a + c, a - c, 0, 1, 10, 11, 4, 5, 14, 15);
        } else {
            a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 0, 1, 2, 3);
            c = __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7);
            out = __builtin_shufflevector(a + c, a - c, 0, 1, 2, 3, 12, 13, 14, 15);
        }
        STORE(row + k, out);
    }
}

/* Rows [n, heads, dim] of x (strides xs_row, xs_head in elements; the last dim contiguous; bf16 or fp32, and
   y the same dtype, contiguous [n, heads, dim]) as the indexer's Indexer._quantize(_rope(x)) computes them:
   the first rope_dim values rotated (NeoX halves, cos/sin [n, rope_dim], as rope_row), then, with `quantize`,
   an orthonormal Hadamard rotation of the row (a fast Walsh-Hadamard transform in fp32, scaled by dim^-0.5,
   rounded to x's dtype: DeepSeek's rotate_activation) and an FP8 e4m3 round trip per `block` values with a
   power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (act_quant_ue8m0, then dequantized: exact in bf16).
   Eight values of a row at a time. dim a power of two of at least 8, block a multiple of 8 dividing it, else
   nothing is written and the call returns 2 (0: done). */
int32_t index_rows(const void *x, int64_t xs_row, int64_t xs_head, int32_t bf16, int64_t n, int64_t heads,
                   int64_t dim, const void *cos, const void *sin, int64_t rope_dim, int32_t quantize, int64_t block,
                   void *y, int32_t threads) {
    if (dim < DW || dim & (dim - 1) || block < DW || block % DW || dim % block || rope_dim < 0 || rope_dim > dim)
        return 2;
    #pragma omp parallel num_threads(threads) if (n * heads * dim >= 65536)
    {
        float *row = xmalloc(sizeof(float) * dim);
        const float norm = (float)(1.0 / sqrt((double)dim));  /* dim^-0.5 as fp32: the portable matrix's entry */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < n * heads; r++) {
            int64_t i = r / heads, off = i * xs_row + (r % heads) * xs_head;
            rope_row(x, off, bf16, cos, sin, i * rope_dim, rope_dim, 0, row, 0, 0);
            int64_t d = rope_dim;
            for (; d + DW <= dim; d += DW) STORE(row + d, wload(x, bf16, off + d));
            for (; d < dim; d++) row[d] = widen(x, bf16, off + d);
            if (quantize) {
                for (int64_t len = 1; len < dim; len <<= 1) hadamard_step(row, dim, len);
                for (int64_t d = 0; d < dim; d += DW) {
                    v8 v = LOAD(row + d) * splat(norm);
                    STORE(row + d, bf16 ? round_bf16x8(v) : v);
                }
                for (int64_t b = 0; b < dim; b += block) {
                    float scale = ue8m0_scale(amax8(row + b, block));
                    for (int64_t d = b; d < b + block; d += DW)
                        STORE(row + d, e4m3_scaled8(LOAD(row + d), scale) * splat(scale));
                }
            }
            for (int64_t d = 0; d < dim; d += DW) put8(y, bf16, r * dim + d, LOAD(row + d));
        }
        free(row);
    }
    return 0;
}

/* C8 indexer keys (shared.kvcache.layout.Fp8KeyRows): row i of x [n, dim] (bf16 or fp32) stored at pool slot
   slots[i] (rows of `width` bytes) as FP8 e4m3 bytes | its fp32 scale, as Fp8KeyRows.encode (act_quant_ue8m0,
   one block per row): s = 2^ceil(log2(max(amax, 1e-4) / 448)) (the ceiling taken exactly), q = e4m3(clamp(x / s,
   +-448)) rounded to nearest even, eight values at a time. Returns 1 if a slot is outside the pool (that row is not
   written), 2 where dim is not a multiple of 8 (nothing written). */
int32_t index_key_write_fp8(const void *x, int32_t bf16, int64_t n, int64_t dim, uint8_t *pool, int64_t width,
                            int64_t num_slots, const int64_t *slots) {
    if (dim <= 0 || dim % DW) return 2;
    int32_t bad = 0;
    float *row = xmalloc(sizeof(float) * dim);
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) { bad = 1; continue; }
        for (int64_t d = 0; d < dim; d += DW) STORE(row + d, wload(x, bf16, i * dim + d));
        float scale = ue8m0_scale(amax8(row, dim));
        uint8_t *dst = pool + slots[i] * width;
        for (int64_t d0 = 0; d0 < dim; d0 += DW) {
            v8 q = e4m3_scaled8(LOAD(row + d0), scale);
            for (int e = 0; e < DW; e++) {
                float v = q[e], a = fabsf(v);
                uint32_t u;
                memcpy(&u, &v, sizeof u);
                uint8_t mag = a >= 0x1p-6f ? (uint8_t)(((((u >> 23) & 0xff) - 120) << 3) | ((u >> 20) & 7))
                                           : (uint8_t)(a * 512.f);  /* subnormal: multiples of 2^-9 */
                dst[d0 + e] = (uint8_t)(mag | (u >> 31) << 7);
            }
        }
        memcpy(dst + dim, &scale, sizeof scale);
    }
    free(row);
    return bad;
}

/* ---- MLA's cache row: [kv_norm(c_kv) | rope(k_pe)] of each new token, stored straight at its slot ---- */

/* kv [n, c + r] (x's dtype: bf16 or fp32, contiguous): the kv_a projection of the step's tokens; the row
   of token i goes to pool slot slots[i] (rows of c + r values, bf16 or fp32 storage). Returns 1 if a slot
   is outside the pool (that token is not written), else 0. Rows on `threads` threads where a prompt's are many. */
int32_t mla_kv_write(const void *kv, int32_t bf16, int64_t n, int64_t c, int64_t r, const void *norm_w, float eps,
                     const void *cos, const void *sin, int32_t interleaved, void *pool, int32_t pool_bf16,
                     int64_t num_slots, const int64_t *slots, int32_t threads) {
    int32_t bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad) if (n * (c + r) >= 65536)
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) { bad = 1; continue; }
        int64_t src = i * (c + r), dst = slots[i] * (c + r);
        norm_row(kv, src, bf16, norm_w, c, eps, pool, dst, pool_bf16);
        rope_row(kv, src + c, bf16, cos, sin, i * r, r, interleaved, pool, dst + c, pool_bf16);
    }
    return bad;
}

/* The same rows stored as C8 (shared.kvcache.layout.Int8LatentRows; rows of `width` bytes: int8 latent [c] |
   fp32 scale per `group` latent dims [groups] | bf16 rope key [r]): each row is made in x's dtype as above, then
   encoded as Int8LatentRows.encode does, bit for bit: per group s = max(amax / 127, 1e-12), q = round half to
   even (x / s) clamped to +-127, the rope key rounded to bf16. Returns 1 if a slot is outside the pool. */
int32_t mla_kv_write_c8(const void *kv, int32_t bf16, int64_t n, int64_t c, int64_t r, const void *norm_w,
                        float eps, const void *cos, const void *sin, int32_t interleaved, uint8_t *pool,
                        int64_t width, int64_t num_slots, const int64_t *slots, int64_t group, int64_t groups) {
    int32_t bad = 0;
    void *row = xmalloc(sizeof(float) * (c + r));
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) { bad = 1; continue; }
        norm_row(kv, i * (c + r), bf16, norm_w, c, eps, row, 0, bf16);
        rope_row(kv, i * (c + r) + c, bf16, cos, sin, i * r, r, interleaved, row, c, bf16);
        uint8_t *dst = pool + slots[i] * width;
        for (int64_t g = 0; g < groups; g++) {
            int64_t d0 = g * group, d1 = d0 + group < c ? d0 + group : c;
            float amax = 0.f;
            for (int64_t d = d0; d < d1; d++) {
                float a = fabsf(widen(row, bf16, d));
                amax = a > amax ? a : amax;
            }
            float scale = amax / 127.0f;
            if (!(scale >= 1e-12f)) scale = 1e-12f;
            for (int64_t d = d0; d < d1; d++) {
                float q = nearbyintf(widen(row, bf16, d) / scale);
                ((int8_t *)dst)[d] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
            }
            memcpy(dst + c + 4 * g, &scale, sizeof scale);
        }
        for (int64_t k = 0; k < r; k++) {
            uint16_t b = bf16 ? ((const uint16_t *)row)[c + k] : narrow(((const float *)row)[c + k]);
            memcpy(dst + c + 4 * groups + 2 * k, &b, sizeof b);
        }
    }
    free(row);
    return bad;
}

/* ---- Small matmuls of decode steps ---- */

#if HAVE_WIDE

/* linear_rows by wide tiles: the rows packed in pairs once, the weight split into one block of rows per thread
   (more where a block would outgrow wide_block_bytes), each block passed by every group of WP pairs. */
struct rows_out { void *y; int y_bf16; int64_t m; };  /* a linear's output rows */
static void put_rows(void *ctx, int64_t r, int rows, int64_t q0, int inputs, float out[2 * WP][4]) {
    struct rows_out *c = ctx;
#if WIDE_ZMM
    if (rows == 4 && c->y_bf16) {  /* a pass's outputs rounded 16 at a time (put4_from's bits), 8 bytes a row */
        uint16_t h[2 * WP][4];
        for (int q = 0; q < inputs; q += 4) {
            __m512i u = _mm512_loadu_si512(out[q]);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
            __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
            rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
            _mm256_storeu_si256((__m256i *)h[q], _mm512_cvtepi32_epi16(rounded));
        }
        for (int q = 0; q < inputs; q++) memcpy((uint16_t *)c->y + (q0 + q) * c->m + r, h[q], sizeof h[q]);
        return;
    }
#endif
    for (int q = 0; q < inputs; q++)
        if (rows == 4) {
            put4_from(c->y, c->y_bf16, (q0 + q) * c->m + r, out[q]);
        } else {
            for (int o = 0; o < rows; o++) put(c->y, c->y_bf16, (q0 + q) * c->m + r + o, out[q][o]);
        }
}

/* Enough multiply-adds for a call to share them among threads (a fork and join costs a few microseconds). */
#define PARALLEL_MACS (1 << 18)

/* The rows x [n, k] (bf16 widened exactly, or fp32) packed in pairs for wide_tile as pack_pairs packs them, in
   one parallel pass (prompt-sized calls packed them after widening them, both on one thread: ~15 % of a
   4,096-row call at k = 256). */
static void pack_rows(const void *x, int x_bf16, int64_t n, int64_t k, float *xp, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= PARALLEL_MACS / 16)
    for (int64_t p = 0; p < (n + 1) / 2; p++) {
        int64_t a = 2 * p * k, b = (2 * p + 1 < n ? 2 * p + 1 : 2 * p) * k;
        for (int64_t d = 0; d < k; d += DW) {
            STORE(xp + 2 * (p * k + d), wload(x, x_bf16, a + d));
            STORE(xp + 2 * (p * k + d) + DW, wload(x, x_bf16, b + d));
        }
    }
}

/* A task of linear_rows_wide: weight rows [r0, r1) of one of its weights. */
typedef struct {
    const float *w;
    void *y;
    int64_t m, r0, r1;
} RowTask;

/* The rows of `count` weights (ws[i]: [ms[i], k], y[i]: [n, ms[i]]) cut into tasks of at most `per` rows, each
   within one weight (a cut at a multiple of four of its rows); how many. */
static int64_t row_tasks(const float *const *ws, const int64_t *ms, void *const *ys, int count, int64_t per,
                         RowTask *tasks) {
    int64_t used = 0, at = 0;  /* at: the rows of the weights before this one */
    for (int i = 0; i < count; at += ms[i], i++)
        for (int64_t r0 = 0; r0 < ms[i];) {
            int64_t edge = ((at + r0) / per + 1) * per - at, r1 = (edge + 3) / 4 * 4;
            r1 = r1 < ms[i] ? r1 : ms[i];
            tasks[used++] = (RowTask){ws[i], ys[i], ms[i], r0, r1};
            r0 = r1;
        }
    return used;
}

/* linear_rows for `count` weights on the same rows x, in one call: the rows packed once, the weights' rows split
   evenly among the threads as one range (q_a and kv_a; gate and up: one packing and one fork instead of two). */
static void linear_rows_wide(const void *x, int x_bf16, int64_t n, int64_t k, const float *const *ws,
                             const int64_t *ms, void *const *ys, int count, int y_bf16, int threads) {
    int64_t pairs = (n + 1) / 2, m = 0;
    for (int i = 0; i < count; i++) m += ms[i];
    if (m == 0) return;  /* no weight rows: nothing to write (and no task size to divide by) */
    float *xp = xmalloc(sizeof(float) * 2 * pairs * k);
    pack_rows(x, x_bf16, n, k, xp, threads);
    int64_t per_thread = m * k * (int64_t)sizeof(float) / threads;
    const int64_t block_bytes = wide_block_bytes(n * k * 4);
    int64_t parts = (int64_t)threads * ((per_thread + block_bytes - 1) / block_bytes);
    int64_t per = ((m + parts - 1) / parts + 3) / 4 * 4;
    RowTask *tasks = xmalloc(sizeof(RowTask) * (m / per + 2 * count + 1));
    const int64_t count_tasks = row_tasks(ws, ms, ys, count, per, tasks);
    #pragma omp parallel for num_threads(threads) schedule(static) if (n * m * k >= PARALLEL_MACS)
    for (int64_t b = 0; b < count_tasks; b++) {
        const RowTask *t = tasks + b, *next = b + 1 < count_tasks ? tasks + b + 1 : NULL;
        float *state = xmalloc(sizeof(float) * ((t->r1 - t->r0 + 3) / 4) * WIDE_STATE);
        struct rows_out ctx = {t->y, y_bf16, t->m};
        BlockAhead ahead = block_ahead(next ? next->w + next->r0 * k : NULL,
                                       next ? (next->r1 - next->r0) * k * (int64_t)sizeof(float) : 0,
                                       wide_passes(t->r1 - t->r0, k, pairs));
        for (int64_t p0 = 0; p0 < pairs; p0 += WP)
            wide_block(t->w, 0, k, t->r0, t->r1, xp, n, p0, pairs - p0 < WP ? pairs - p0 : WP, state, put_rows, &ctx,
                       &ahead);
        free(state);
    }
    free(tasks);
    free(xp);
}
#endif

/* y[i] = w . x[i] for a few rows: w [m, k] fp32, x [n, k] (bf16 or fp32), y [n, m] rounded to x's dtype
   (as layers.Linear: fp32 products, the output in the input's dtype). Weight rows are read once per four
   input rows, two at a time: eight independent sums in registers. Every output is dot()'s sum, whichever
   pass computes it (a row's bits do not depend on the rows beside it). */
void linear_rows(const void *x, int32_t x_bf16, const float *w, void *y, int64_t n, int64_t k, int64_t m,
                 int32_t threads) {
#if HAVE_WIDE
    if (n >= 2 && k % DW == 0) {
        void *ys[1] = {y};
        linear_rows_wide(x, x_bf16, n, k, &w, &m, ys, 1, x_bf16, threads);
        return;
    }
#endif
    float *xf = xmalloc(sizeof(float) * n * k);
    for (int64_t e = 0; e < n * k; e++) xf[e] = widen(x, x_bf16, e);
    int64_t blocks = (m + RB - 1) / RB;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 32768)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r1 = (b + 1) * RB < m ? (b + 1) * RB : m;
        for (int64_t r = b * RB; r < r1; r += 2) {
            int64_t off[2] = {r * k, (r + 1 < r1 ? r + 1 : r) * k};  /* an odd last row computed twice */
            int64_t i = 0;
            for (; i + 4 <= n && k % DW == 0; i += 4) {
                const float *rows[4] = {xf + i * k, xf + (i + 1) * k, xf + (i + 2) * k, xf + (i + 3) * k};
                float sums[2][4];
                tile_2x4(w, 0, off, rows, k, sums);
                for (int o = 0; o < 2 && r + o < r1; o++)
                    for (int q = 0; q < 4; q++) put(y, x_bf16, (i + q) * m + r + o, sums[o][q]);
            }
            for (; i < n; i++)
                for (int o = 0; o < 2 && r + o < r1; o++)
                    put(y, x_bf16, i * m + r + o, dot(w, off[o], xf + i * k, k));
        }
    }
    free(xf);
}

/* linear_rows for `count` fp32 weights ws[i] [ms[i], k] on the same rows x [n, k] (bf16 or fp32), ys[i] [n, ms[i]]
   in x's dtype, in one call: the rows packed once for all of them (MLA's q_a and kv_a, an MLP's gate and up). Each
   output is linear_rows' (the same sums). Returns 1 (nothing written) where the wide tiles do not run it: n < 2,
   k % 8, or neither AVX-512 nor AVX2 + FMA (the caller multiplies the weights one at a time). */
int32_t linear_rows_many(const void *x, int32_t x_bf16, const float *const *ws, const int64_t *ms, void *const *ys,
                         int32_t count, int64_t n, int64_t k, int32_t threads) {
#if HAVE_WIDE
    if (n >= 2 && k % DW == 0 && count > 0) {
        linear_rows_wide(x, x_bf16, n, k, ws, ms, ys, count, x_bf16, threads);
        return 0;
    }
#endif
    (void)x; (void)x_bf16; (void)ws; (void)ms; (void)ys; (void)count; (void)n; (void)k; (void)threads;
    return 1;
}

#if HAVE_DPBF16
/* Rows [i, i + Q) of x (past n: repeated, not written) against weight rows wr[0..3] = 4b..4b + 3 (past m:
   repeated, not written): Q x 4 chains of 16 exact products a vdpbf16ps, each output's over k in order. */
static inline __attribute__((always_inline)) void
linear_block_bf16(const uint16_t *x, const uint16_t *const wr[4], void *y, int y_bf16, int64_t n, int64_t k,
                  int64_t m, int64_t b, int64_t i, const int Q) {
    const uint16_t *xr[6];
    for (int q = 0; q < Q; q++) xr[q] = x + (i + q < n ? i + q : n - 1) * k;
    v8 part[6][HB] = {{{0}}};  /* part[q][o]: x row i + q, weight row 4b + o */
    for (int64_t d = 0; d < k; d += 2 * DW) {
        __m256bh wv[4];
        for (int o = 0; o < 4; o++) wv[o] = (__m256bh)_mm256_loadu_si256((const __m256i *)(wr[o] + d));
        for (int q = 0; q < Q; q++) {
            __m256bh xv = (__m256bh)_mm256_loadu_si256((const __m256i *)(xr[q] + d));
            for (int o = 0; o < 4; o++) part[q][o] = (v8)_mm256_dpbf16_ps((__m256)part[q][o], wv[o], xv);
        }
    }
    for (int h = 0; h < Q / 2 && i + 2 * h < n; h++) {  /* lanes 0-3: x row i + 2h's four outputs, 4-7: the next's */
        v8 sums = lane_sums(part + 2 * h);
        for (int q = 2 * h; q < 2 * h + 2 && i + q < n; q++) {
            if (4 * b + 4 <= m) {
                put4(y, y_bf16, (i + q) * m + 4 * b, q % 2 ? __builtin_shufflevector(sums, sums, 4, 5, 6, 7, 4, 5, 6, 7) : sums);
            } else {
                for (int o = 0; 4 * b + o < m; o++) put(y, y_bf16, (i + q) * m + 4 * b + o, sums[q % 2 * 4 + o]);
            }
        }
    }
}
#endif

#if HAVE_AMX
/* Rows x [n, k] (bf16, k a multiple of 32) as the second operand of y^T = w x^T: per 16-row block and 32-dim chunk
   256 dwords, 16 rows of dim pairs with the block's 16 x rows' pairs side by side (rows past n: zeros). */
static void amx_pack_rows(const uint16_t *x, int64_t n, int64_t k, int64_t b, uint32_t *xp) {
    const int64_t chunks = k / 32;
    for (int64_t kc = 0; kc < chunks; kc++) {
        uint32_t *to = xp + (b * chunks + kc) * 256;
        for (int i = 0; i < 16; i++) {
            const int64_t row = 16 * b + i;
            uint32_t from[16] = {0};
            if (row < n) memcpy(from, x + row * k + 32 * kc, sizeof from);
            for (int p = 0; p < 16; p++) to[16 * p + i] = from[p];
        }
    }
}

#define AMX_W(t, r) _tile_loadd(t, wb[r] + 64 * kc, ws[r]);
#define AMX_LIN_PUT(t, r, c) if (r < mr && c < nr) { \
        _tile_stored(t, out, 64); \
        for (int j = 0; j < 16 && m0 + 16 * r + j < m; j++) \
            for (int i = 0; i < 16 && n0 + 16 * c + i < n; i++) \
                put(y, y_bf16, (n0 + 16 * c + i) * m + m0 + 16 * r + j, out[16 * j + i]); }

/* linear_rows_bf16 by AMX tile products: y^T = w x^T, 32 weight rows (read in place, a partial last block through
   a zero-padded copy) by 32 x rows (packed once: amx_pack_rows) a task, four sums in tiles over k in 32-dim steps.
   Each output is one fp32 chain over its k pairs in order, whatever the rows beside it: the same bits at any n. */
static void linear_rows_amx(const uint16_t *x, const uint16_t *w, void *y, int y_bf16, int64_t n, int64_t k,
                            int64_t m, int32_t threads) {
    const int64_t chunks = k / 32, nblocks = (n + 15) / 16, mblocks = (m + 15) / 16;
    const int64_t mpairs = (mblocks + 1) / 2, npairs = (nblocks + 1) / 2;
    uint32_t *xp = xmalloc(sizeof(uint32_t) * nblocks * chunks * 256);
    #pragma omp parallel num_threads(threads) if (m * k * (n < 4 ? 4 : n) >= 131072)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) amx_pack_rows(x, n, k, b, xp);
        amx_configure();
        uint16_t *pad = NULL;  /* the last weight block's rows past m as zeros */
        float out[256];
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < mpairs * npairs; task++) {
            const int64_t mp = task / npairs, np = task % npairs, m0 = 32 * mp, n0 = 32 * np;
            const int mr = m - m0 > 16 ? 2 : 1, nr = nblocks - 2 * np > 1 ? 2 : 1;
            const uint8_t *wb[2];
            int64_t ws[2] = {2 * k, 2 * k};
            for (int r = 0; r < mr; r++) {
                const int64_t first = m0 + 16 * r, rows = m - first < 16 ? m - first : 16;
                wb[r] = (const uint8_t *)(w + first * k);
                if (rows < 16) {
                    if (!pad) pad = xcalloc(16 * k, sizeof(uint16_t));
                    memcpy(pad, w + first * k, sizeof(uint16_t) * rows * k);
                    memset(pad + rows * k, 0, sizeof(uint16_t) * (16 - rows) * k);
                    wb[r] = (const uint8_t *)pad;
                }
            }
            if (mr < 2) wb[1] = wb[0];
            const uint32_t *xb0 = xp + 2 * np * chunks * 256, *xb1 = xb0 + (nr > 1 ? chunks * 256 : 0);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t kc = 0; kc < chunks; kc++) {
                AMX_W(4, 0)
                _tile_loadd(6, xb0 + kc * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (mr > 1) { AMX_W(5, 1) _tile_dpbf16ps(1, 5, 6); }
                if (nr > 1) {
                    _tile_loadd(7, xb1 + kc * 256, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    if (mr > 1) _tile_dpbf16ps(3, 5, 7);
                }
            }
            AMX_LIN_PUT(0, 0, 0) AMX_LIN_PUT(1, 1, 0) AMX_LIN_PUT(2, 0, 1) AMX_LIN_PUT(3, 1, 1)
        }
        free(pad);
        _tile_release();
    }
    free(xp);
}
#undef AMX_W
#undef AMX_LIN_PUT
#endif

/* y[i, r] = x[i, :] . w[r, :] for bf16 rows x [n, k] and a bf16 weight [m, k] (a bf16 model's linears on decode
   rows), y bf16 (rounded once) or fp32; k a multiple of 16. 16 exact products a vdpbf16ps summed in fp32 in pairs,
   up to six x rows by four weight rows a register block (24 chains); each output's sums run in the same order
   whatever n is, so a row's result does not depend on its batch. Returns 1 without the instruction or with k
   not a multiple of 16 (nothing written), else 0. */
int32_t linear_rows_bf16(const uint16_t *x, const uint16_t *w, void *y, int32_t y_bf16, int64_t n, int64_t k,
                         int64_t m, int32_t threads) {
#if HAVE_AMX
    if (k % 32 == 0 && amx_usable()) {  /* by k and the machine alone: a row's path never depends on n */
        linear_rows_amx(x, w, y, y_bf16, n, k, m, threads);
        return 0;
    }
#endif
#if HAVE_DPBF16
    if (k % (2 * DW)) return 1;
    int64_t blocks = (m + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k * (n < 4 ? 4 : n) >= 131072)
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *wr[4];
        for (int o = 0; o < 4; o++) wr[o] = w + (4 * b + o < m ? 4 * b + o : m - 1) * k;
        int64_t i = 0;
        for (; i + 6 <= n; i += 6) linear_block_bf16(x, wr, y, y_bf16, n, k, m, b, i, 6);
        if (n - i > 2) linear_block_bf16(x, wr, y, y_bf16, n, k, m, b, i, 4);
        else if (n - i > 0) linear_block_bf16(x, wr, y, y_bf16, n, k, m, b, i, 2);
        if (n - i > 4) linear_block_bf16(x, wr, y, y_bf16, n, k, m, b, i + 4, 2);
    }
    return 0;
#else
    (void)x; (void)w; (void)y; (void)y_bf16; (void)n; (void)k; (void)m; (void)threads;
    return 1;
#endif
}

/* y[i, h, :] = x[i, h, :] @ w[h] per head: x [n, heads, k] (strides xs_row, xs_head; bf16 or fp32),
   w [heads, k, m] fp32 (or bf16: w_bf16), y [n, heads, m] (strides ys_row, ys_head; fp32, or bf16 rounded once).
   MLA's absorbed matmuls (q_nope . W_UK, o_lat . W_UV^T) for generated rows, at any head count. Each output
   is one chain of fused multiply-adds over k in order (fmaf's bits in every lane); up to HR rows of a head
   share each weight load. With wide tiles, fp32 x rows are read and fp32 y rows written where they lie (staged
   through scratch, the copies cost a batch-256 decode step of the tiny model 4 %, batch 64 3 %). */
#define HR 8

/* acc[q, :] = xr[q, :] @ wh for ROWS rows (a constant where inlined); wh fp32, or bf16 with w_bf16 (widened
   exactly as read: the products of its fp32 copy). The weight is streamed in order, four
   of its rows at a time (their pages are read as sequential streams, which strided column blocks were not:
   latency-bound at 8 GFLOP/s); each output's chain of fused multiply-adds still runs over k in order. */
static inline __attribute__((always_inline)) void
head_rows(const float *xr, const void *wh, int w_bf16, float *acc, int64_t k, int64_t m, const int ROWS) {
    memset(acc, 0, sizeof(float) * ROWS * m);
    int64_t j = 0;
    for (; j + 4 <= k; j += 4) {
        const int64_t w0 = j * m, w1 = w0 + m, w2 = w1 + m, w3 = w2 + m;
        int64_t c = 0;
        for (; c + DW <= m; c += DW) {
            v8 r0 = wload(wh, w_bf16, w0 + c), r1 = wload(wh, w_bf16, w1 + c), r2 = wload(wh, w_bf16, w2 + c),
               r3 = wload(wh, w_bf16, w3 + c);
            for (int q = 0; q < ROWS; q++) {
                const float *xq = xr + q * k + j;
                v8 a = LOAD(acc + q * m + c);
                a = vfma(splat(xq[0]), r0, a);
                a = vfma(splat(xq[1]), r1, a);
                a = vfma(splat(xq[2]), r2, a);
                a = vfma(splat(xq[3]), r3, a);
                STORE(acc + q * m + c, a);
            }
        }
        for (; c < m; c++)
            for (int q = 0; q < ROWS; q++)
                for (int u = 0; u < 4; u++) acc[q * m + c] = fmaf(xr[q * k + j + u], widen(wh, w_bf16, (j + u) * m + c), acc[q * m + c]);
    }
    for (; j < k; j++)  /* the last k % 4 weight rows */
        for (int q = 0; q < ROWS; q++)
            for (int64_t c = 0; c < m; c++) acc[q * m + c] = fmaf(xr[q * k + j], widen(wh, w_bf16, j * m + c), acc[q * m + c]);
}

#if WIDE_ZMM
#define HW_FMA(q) if (ROWS > q) { __m512 xb = _mm512_set1_ps(xr[q * xs + j]); \
    a##q##0 = _mm512_fmadd_ps(xb, w0, a##q##0); a##q##1 = _mm512_fmadd_ps(xb, w1, a##q##1); }
#define HW_PUT(q) if (ROWS > q) { _mm512_storeu_ps(acc + q * ys + c0, a##q##0); \
    _mm512_storeu_ps(acc + q * ys + c0 + 16, a##q##1); }

/* head_rows for an fp32 weight where the CPU has AVX-512 (m a multiple of 32): 32 outputs of each of ROWS rows held
   in registers over the whole of k (head_rows reloads its sums every four weight rows: loads, not multiplies,
   bounded it), each output the same chain of fused multiply-adds over k in order: head_rows' bits. Row q of x
   starts at xr + q xs, of the output at acc + q ys. */
static inline __attribute__((always_inline)) void
head_rows_wide(const float *xr, int64_t xs, const float *wh, float *acc, int64_t ys, int64_t k, int64_t m,
               const int ROWS) {
    for (int64_t c0 = 0; c0 < m; c0 += 32) {
        __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        __m512 a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00, a70 = a00, a71 = a00;
        for (int64_t j = 0; j < k; j++) {
            __m512 w0 = _mm512_loadu_ps(wh + j * m + c0), w1 = _mm512_loadu_ps(wh + j * m + c0 + 16);
            HW_FMA(0) HW_FMA(1) HW_FMA(2) HW_FMA(3) HW_FMA(4) HW_FMA(5) HW_FMA(6) HW_FMA(7)
        }
        HW_PUT(0) HW_PUT(1) HW_PUT(2) HW_PUT(3) HW_PUT(4) HW_PUT(5) HW_PUT(6) HW_PUT(7)
    }
}
#undef HW_FMA
#undef HW_PUT
#endif

#if HAVE_DPBF16
/* y rows [i0, i0 + Q) of head h (Q a constant where inlined) for bf16 x and weights: acc[q, c] += x[q, j] w[j, c]
   over pairs of weight rows (j, j + 1) interleaved (vpunpck: dims {0-3, 8-11} and {4-7, 12-15} of each 16) and
   x's pair broadcast, 16 exact products a vdpbf16ps summed in fp32 (pv_block_bf16's pattern); 32 outputs a
   block, 4 x Q chains. k even, m a multiple of 16. */
static inline __attribute__((always_inline)) void
head_rows_bf16(const uint16_t *x, int64_t xs_row, const uint16_t *wh, void *y, int y_bf16, int64_t ys_row,
               int64_t k, int64_t m, const int Q) {
    for (int64_t c0 = 0; c0 < m; c0 += 32) {
        const int blocks = c0 + 32 <= m ? 2 : 1;
        __m256 a[6][4];
        for (int q = 0; q < Q; q++)
            for (int v = 0; v < 4; v++) a[q][v] = _mm256_setzero_ps();
        for (int64_t j = 0; j < k; j += 2) {
            __m256bh wv[4];
            for (int bk = 0; bk < blocks; bk++) {
                __m256i r0 = _mm256_loadu_si256((const __m256i *)(wh + j * m + c0 + 16 * bk));
                __m256i r1 = _mm256_loadu_si256((const __m256i *)(wh + (j + 1) * m + c0 + 16 * bk));
                wv[2 * bk] = (__m256bh)_mm256_unpacklo_epi16(r0, r1);
                wv[2 * bk + 1] = (__m256bh)_mm256_unpackhi_epi16(r0, r1);
            }
            for (int q = 0; q < Q; q++) {
                uint32_t pair;
                memcpy(&pair, x + q * xs_row + j, sizeof pair);
                __m256bh xv = (__m256bh)_mm256_set1_epi32((int)pair);
                for (int v = 0; v < 2 * blocks; v++) a[q][v] = _mm256_dpbf16_ps(a[q][v], xv, wv[v]);
            }
        }
        for (int q = 0; q < Q; q++)
            for (int bk = 0; bk < blocks; bk++) {
                int64_t at = q * ys_row + c0 + 16 * bk;
                put8(y, y_bf16, at, (v8)_mm256_permute2f128_ps(a[q][2 * bk], a[q][2 * bk + 1], 0x20));
                put8(y, y_bf16, at + 8, (v8)_mm256_permute2f128_ps(a[q][2 * bk], a[q][2 * bk + 1], 0x31));
            }
    }
}
#endif

void head_matmul(const void *x, int32_t x_bf16, int64_t xs_row, int64_t xs_head, const void *w, int32_t w_bf16,
                 void *y, int32_t y_bf16, int64_t ys_row, int64_t ys_head, int64_t n, int64_t heads,
                 int64_t k, int64_t m, int32_t threads) {
    const int64_t groups = (n + HR - 1) / HR;
#if HAVE_DPBF16
    if (x_bf16 && w_bf16 && k % 2 == 0 && m % 16 == 0) {  /* bf16 x and weights: vdpbf16ps, four rows a block */
        const int64_t quads = (n + 5) / 6;
        #pragma omp parallel for num_threads(threads) schedule(static) if (n * heads * k * m >= 262144)
        for (int64_t t = 0; t < quads * heads; t++) {
            int64_t h = t / quads, i0 = t % quads * 6, rows = n - i0 < 6 ? n - i0 : 6;
            const uint16_t *xq = (const uint16_t *)x + i0 * xs_row + h * xs_head, *wh = (const uint16_t *)w + h * k * m;
            void *yq = (uint8_t *)y + (i0 * ys_row + h * ys_head) * (y_bf16 ? 2 : 4);
            switch (rows) {
                case 1: head_rows_bf16(xq, xs_row, wh, yq, y_bf16, ys_row, k, m, 1); break;
                case 2: head_rows_bf16(xq, xs_row, wh, yq, y_bf16, ys_row, k, m, 2); break;
                case 3: head_rows_bf16(xq, xs_row, wh, yq, y_bf16, ys_row, k, m, 3); break;
                case 4: head_rows_bf16(xq, xs_row, wh, yq, y_bf16, ys_row, k, m, 4); break;
                case 5: head_rows_bf16(xq, xs_row, wh, yq, y_bf16, ys_row, k, m, 5); break;
                default: head_rows_bf16(xq, xs_row, wh, yq, y_bf16, ys_row, k, m, 6); break;
            }
        }
        return;
    }
#endif
    #pragma omp parallel num_threads(threads) if (n * heads * k * m >= 262144)
    {
        float *scratch_x = xmalloc(sizeof(float) * HR * k), *scratch_y = xmalloc(sizeof(float) * HR * m);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < groups * heads; t++) {
            int64_t h = t / groups, i0 = t % groups * HR, rows = n - i0 < HR ? n - i0 : HR;
            const void *wh = (const uint8_t *)w + h * k * m * (w_bf16 ? 2 : 4);
#if WIDE_ZMM
            if (!w_bf16 && m % 32 == 0) {  /* fp32 x and y in place (strided rows), bf16 ones through scratch */
                const float *xr = x_bf16 ? scratch_x : (const float *)x + i0 * xs_row + h * xs_head;
                const int64_t xs = x_bf16 ? k : xs_row;
                float *acc = y_bf16 ? scratch_y : (float *)y + i0 * ys_row + h * ys_head;
                const int64_t ys = y_bf16 ? m : ys_row;
                for (int q = 0; x_bf16 && q < rows; q++)
                    for (int64_t j = 0; j < k; j++)
                        scratch_x[q * k + j] = widen(x, 1, (i0 + q) * xs_row + h * xs_head + j);
                switch (rows) {
                    case 1: head_rows_wide(xr, xs, wh, acc, ys, k, m, 1); break;
                    case 2: head_rows_wide(xr, xs, wh, acc, ys, k, m, 2); break;
                    case 3: head_rows_wide(xr, xs, wh, acc, ys, k, m, 3); break;
                    case 4: head_rows_wide(xr, xs, wh, acc, ys, k, m, 4); break;
                    case 5: head_rows_wide(xr, xs, wh, acc, ys, k, m, 5); break;
                    case 6: head_rows_wide(xr, xs, wh, acc, ys, k, m, 6); break;
                    case 7: head_rows_wide(xr, xs, wh, acc, ys, k, m, 7); break;
                    default: head_rows_wide(xr, xs, wh, acc, ys, k, m, HR); break;
                }
                for (int q = 0; y_bf16 && q < rows; q++)
                    for (int64_t c = 0; c < m; c++)
                        ((uint16_t *)y)[(i0 + q) * ys_row + h * ys_head + c] = narrow(scratch_y[q * m + c]);
                continue;
            }
#endif
            float *xr = scratch_x, *acc = scratch_y;
            for (int q = 0; q < rows; q++)
                for (int64_t j = 0; j < k; j++) xr[q * k + j] = widen(x, x_bf16, (i0 + q) * xs_row + h * xs_head + j);
            switch (rows) {
                case 1: head_rows(xr, wh, w_bf16, acc, k, m, 1); break;
                case 2: head_rows(xr, wh, w_bf16, acc, k, m, 2); break;
                case 3: head_rows(xr, wh, w_bf16, acc, k, m, 3); break;
                case 4: head_rows(xr, wh, w_bf16, acc, k, m, 4); break;
                case 5: head_rows(xr, wh, w_bf16, acc, k, m, 5); break;
                case 6: head_rows(xr, wh, w_bf16, acc, k, m, 6); break;
                case 7: head_rows(xr, wh, w_bf16, acc, k, m, 7); break;
                default: head_rows(xr, wh, w_bf16, acc, k, m, HR); break;
            }
            for (int q = 0; q < rows; q++)
                for (int64_t c = 0; c < m; c++) {
                    int64_t at = (i0 + q) * ys_row + h * ys_head + c;
                    if (y_bf16) ((uint16_t *)y)[at] = narrow(acc[q * m + c]);
                    else ((float *)y)[at] = acc[q * m + c];
                }
        }
        free(scratch_x);
        free(scratch_y);
    }
}
