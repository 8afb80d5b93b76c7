/* pdserve's W8A8 kernels for the CPU: int8 x int8 -> int32 matmuls with the dynamic per-token activation
   quantization fused in, and the routed (+ shared) experts of a W8A8 MoE in one call. Built on first use by
   shared.model.int8_kernels (cpu_kernels.build_library: -O3 -march=native or PDSERVE_KERNEL_ARCH) and bound
   through ctypes.

   The instruction set is chosen when the file is compiled for the CPU it runs on:
   * AVX-512 VNNI (vpdpbusd, u8 x s8 -> s32): activations are stored as u8 = q + 128 and the weights' row sums
     (times 128) are subtracted afterwards;
   * AVX2 (vpmaddubsw + vpmaddwd): |q| as u8 times the weight with q's sign (vpsignb), never saturating because
     the quantizer keeps |q| <= 127 and weights are >= -127;
   * portable C otherwise.
   Every path sums the same integers exactly in int32, so all give the same bits, and a row's result never
   depends on the rows that share its call. Weights are read in place ([N, K] int8, row-major): no packed
   copy is kept. */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define ISA_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define ISA_AVX2 1
#include <immintrin.h>
#endif

#define CHUNK 64      /* K bytes per step (one zmm); quantized rows are padded to a multiple of it */
#define MR 4          /* rows per register tile */
#define NR 4          /* weight rows (output columns) per register tile */
#define COLS_TASK 32  /* output columns per task */
#define ROWS_TASK 256 /* activation rows per task: their quantized bytes stay in L2 */

static void *xmalloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p) { fputs("pdserve int8_kernels: out of memory\n", stderr); abort(); }
    return p;
}

/* 2: AVX-512 VNNI, 1: AVX2, 0: portable C -- what this build multiplies with. */
int32_t int8_isa(void) {
#if defined(ISA_VNNI)
    return 2;
#elif defined(ISA_AVX2)
    return 1;
#else
    return 0;
#endif
}

static inline int64_t padded(int64_t k) { return (k + CHUNK - 1) / CHUNK * CHUNK; }

static inline float widen(const void *p, int bf16, int64_t i) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t narrow(float f) {  /* fp32 -> bf16 bits, round to nearest even (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7fc0 : r;
}

static inline float round_bf16(float f) {
    uint32_t u = (uint32_t)narrow(f) << 16;
    memcpy(&f, &u, 4);
    return f;
}

/* What this ISA's tile reads for quantized value q: u8 q + 128 for VNNI, s8 q otherwise. */
static inline uint8_t stored(int32_t q) {
#if defined(ISA_VNNI)
    return (uint8_t)(q + 128);
#else
    return (uint8_t)(int8_t)q;
#endif
}
static const int32_t STORED_ZERO =
#if defined(ISA_VNNI)
    128;
#else
    0;
#endif

#if defined(ISA_VNNI)
/* 16 values of a bf16 or fp32 row as fp32; lanes outside `mask` are 0 and never read. */
static inline __m512 load16(const void *x, int bf16, int64_t i, __mmask16 mask) {
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)x + i);
    __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
#endif

/* shared.quant.int8.quantize_activation for one row, bit for bit: scale = max(amax / 127, 1e-12) in fp32,
   q = round_half_even(x / scale) clamped to +-127 (NaN -> 0, as the int8 cast gives on x86). Writes the k
   values as this ISA stores them, padded to kp with zeros, and returns the scale. */
static float quantize_row(const void *x, int bf16, int64_t off, int64_t k, uint8_t *dst, int64_t kp,
                          int8_t *q_out) {
    float amax = 0.f;
    int nan = 0;
    int64_t i0 = 0;
#if defined(ISA_VNNI)  /* 16 values a step; max is exact in any order, the rest is per element */
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 unord = 0;
    for (; i0 + 16 <= k; i0 += 16) {
        __m512 v = load16(x, bf16, off + i0, 0xffff);
        unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    amax = _mm512_reduce_max_ps(vmax);
    nan = unord != 0;
#endif
    for (int64_t i = i0; i < k; i++) {
        float a = fabsf(widen(x, bf16, off + i));
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    float scale = nan ? NAN : amax / 127.0f;
    const float lo = (float)1e-12;
    if (scale < lo) scale = lo;  /* torch.clamp(min=): NaN stays NaN */
    i0 = 0;
#if defined(ISA_VNNI)
    {
        const __m512 vs = _mm512_set1_ps(scale), hi = _mm512_set1_ps(127.f), neg = _mm512_set1_ps(-127.f);
        for (; i0 < k; i0 += 16) {
            __mmask16 mask = k - i0 >= 16 ? 0xffff : (__mmask16)((1u << (k - i0)) - 1);
            __m512 v = _mm512_div_ps(load16(x, bf16, off + i0, mask), vs);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);  /* NaN -> 0 */
            v = _mm512_min_ps(_mm512_max_ps(v, neg), hi);
            __m512i q = _mm512_cvtps_epi32(v);
            if (q_out) _mm_mask_storeu_epi8(q_out + i0, mask, _mm512_cvtepi32_epi8(q));
            if (dst) _mm_mask_storeu_epi8(dst + i0, mask, _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
        }
    }
#endif
    for (int64_t i = i0; i < k; i++) {
        float v = rintf(widen(x, bf16, off + i) / scale);
        int32_t q = v != v ? 0 : v > 127.f ? 127 : v < -127.f ? -127 : (int32_t)v;
        if (dst) dst[i] = stored(q);
        if (q_out) q_out[i] = (int8_t)q;
    }
    if (dst) memset(dst + k, STORED_ZERO, (size_t)(kp - k));
    return scale;
}

/* x [m, k] (bf16 or fp32, row stride ldx) -> q int8 [m, k], scale [m]: the fused quantizer on its own (the
   tests compare it with quantize_activation). */
void quantize_rows(const void *x, int32_t bf16, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *scale,
                   int32_t threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++) scale[r] = quantize_row(x, bf16, r * ldx, k, NULL, 0, q + r * k);
}

/* ---- the register tile: acc[r][c] = sum_k q[r][k] * w[c][k] for up to MR x NR ---- */

#if defined(ISA_VNNI)
/* 4 accumulators -> [sum a, sum b, sum c, sum d] */
static inline __m128i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* acc += u8 x . s8 w in 32-bit lanes; as inline asm because GCC's builtin makes it copy the accumulator on every
   use (the tied destination), which halved the tile's speed. */
#define DPBUSD(acc, xv, wv) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(xv), "v"(wv))

/* 128 * (row sums of the NR weight rows): the u8 offset's share of each column, subtracted from the sums. */
static inline __m128i weight_offsets(const int8_t *const *w, int64_t k) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i s[NR];
    for (int c = 0; c < NR; c++) s[c] = _mm512_setzero_si512();
    int64_t k0 = 0;
    for (; k0 + CHUNK <= k; k0 += CHUNK)
        for (int c = 0; c < NR; c++) { __m512i v = _mm512_loadu_si512(w[c] + k0); DPBUSD(s[c], ones, v); }
    if (k0 < k) {
        __mmask64 mask = (~0ULL) >> (CHUNK - (k - k0));
        for (int c = 0; c < NR; c++) { __m512i v = _mm512_maskz_loadu_epi8(mask, w[c] + k0); DPBUSD(s[c], ones, v); }
    }
    return _mm_slli_epi32(reduce4(s[0], s[1], s[2], s[3]), 7);
}

/* GCC keeps a 2-D accumulator array in registers only with copies between iterations: the full 4 x 4 tile is
   spelled out (16 named accumulators, the 4 weight chunks pinned in registers). */
#define PIN(v) __asm__("" : "+v"(v))
#define DP_ROW(r, xv)                                                             \
    DPBUSD(a##r##0, xv, w0); DPBUSD(a##r##1, xv, w1); DPBUSD(a##r##2, xv, w2); DPBUSD(a##r##3, xv, w3);

static void tile4(const uint8_t *const *x, const int8_t *const *w, int64_t k, __m128i off, int32_t out[MR][NR]) {
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
            a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const uint8_t *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    const int8_t *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3];
    int64_t k0 = 0;
    for (; k0 + CHUNK <= k; k0 += CHUNK) {
        __m512i w0 = _mm512_loadu_si512(p0 + k0), w1 = _mm512_loadu_si512(p1 + k0);
        __m512i w2 = _mm512_loadu_si512(p2 + k0), w3 = _mm512_loadu_si512(p3 + k0);
        PIN(w0); PIN(w1); PIN(w2); PIN(w3);
        __m512i v0 = _mm512_loadu_si512(x0 + k0);
        DP_ROW(0, v0)
        __m512i v1 = _mm512_loadu_si512(x1 + k0);
        DP_ROW(1, v1)
        __m512i v2 = _mm512_loadu_si512(x2 + k0);
        DP_ROW(2, v2)
        __m512i v3 = _mm512_loadu_si512(x3 + k0);
        DP_ROW(3, v3)
    }
    if (k0 < k) {  /* the weights' tail is masked (never read past a row); x is padded */
        __mmask64 mask = (~0ULL) >> (CHUNK - (k - k0));
        __m512i w0 = _mm512_maskz_loadu_epi8(mask, p0 + k0), w1 = _mm512_maskz_loadu_epi8(mask, p1 + k0);
        __m512i w2 = _mm512_maskz_loadu_epi8(mask, p2 + k0), w3 = _mm512_maskz_loadu_epi8(mask, p3 + k0);
        __m512i v0 = _mm512_loadu_si512(x0 + k0), v1 = _mm512_loadu_si512(x1 + k0);
        __m512i v2 = _mm512_loadu_si512(x2 + k0), v3 = _mm512_loadu_si512(x3 + k0);
        DP_ROW(0, v0) DP_ROW(1, v1) DP_ROW(2, v2) DP_ROW(3, v3)
    }
    _mm_storeu_si128((__m128i *)out[0], _mm_sub_epi32(reduce4(a00, a01, a02, a03), off));
    _mm_storeu_si128((__m128i *)out[1], _mm_sub_epi32(reduce4(a10, a11, a12, a13), off));
    _mm_storeu_si128((__m128i *)out[2], _mm_sub_epi32(reduce4(a20, a21, a22, a23), off));
    _mm_storeu_si128((__m128i *)out[3], _mm_sub_epi32(reduce4(a30, a31, a32, a33), off));
}

/* One row at a time (the 1-3 rows left over): the same sums. */
static void tile1(const uint8_t *x, const int8_t *const *w, int64_t k, __m128i off, int32_t out[NR]) {
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00;
    const int8_t *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3];
    int64_t k0 = 0;
    for (; k0 + CHUNK <= k; k0 += CHUNK) {
        __m512i w0 = _mm512_loadu_si512(p0 + k0), w1 = _mm512_loadu_si512(p1 + k0);
        __m512i w2 = _mm512_loadu_si512(p2 + k0), w3 = _mm512_loadu_si512(p3 + k0);
        __m512i v0 = _mm512_loadu_si512(x + k0);
        DP_ROW(0, v0)
    }
    if (k0 < k) {
        __mmask64 mask = (~0ULL) >> (CHUNK - (k - k0));
        __m512i w0 = _mm512_maskz_loadu_epi8(mask, p0 + k0), w1 = _mm512_maskz_loadu_epi8(mask, p1 + k0);
        __m512i w2 = _mm512_maskz_loadu_epi8(mask, p2 + k0), w3 = _mm512_maskz_loadu_epi8(mask, p3 + k0);
        __m512i v0 = _mm512_loadu_si512(x + k0);
        DP_ROW(0, v0)
    }
    _mm_storeu_si128((__m128i *)out, _mm_sub_epi32(reduce4(a00, a01, a02, a03), off));
}

static inline void tile(const int mr, const uint8_t *const *x, const int8_t *const *w, int64_t k, __m128i off,
                        int32_t out[MR][NR]) {
    if (mr == MR) tile4(x, w, k, off, out);
    else for (int r = 0; r < mr; r++) tile1(x[r], w, k, off, out[r]);
}

#elif defined(ISA_AVX2)
static inline __m128i reduce4(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    __m256i s = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

#define HALF 32  /* one ymm of K */

static inline __attribute__((always_inline)) void step(const int mr, const uint8_t *const *x, int64_t k0,
                                                        const __m256i *wv, __m256i acc[MR][NR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < mr; r++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x[r] + k0)), ax = _mm256_abs_epi8(xv);
        for (int c = 0; c < NR; c++) {
            __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[c], xv));  /* |q| * (w with q's sign) */
            acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(p, ones));
        }
    }
}

static inline __attribute__((always_inline)) void tile(const int mr, const uint8_t *const *x, const int8_t *const *w,
                                                        int64_t k, __m128i off, int32_t out[MR][NR]) {
    (void)off;
    __m256i acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < NR; c++) acc[r][c] = _mm256_setzero_si256();
    int64_t k0 = 0;
    for (; k0 + HALF <= k; k0 += HALF) {
        __m256i wv[NR];
        for (int c = 0; c < NR; c++) wv[c] = _mm256_loadu_si256((const __m256i *)(w[c] + k0));
        step(mr, x, k0, wv, acc);
    }
    if (k0 < k) {  /* the weights' tail copied into zeros (never read past a row); x is padded */
        int8_t buf[NR][HALF];
        __m256i wv[NR];
        memset(buf, 0, sizeof(buf));
        for (int c = 0; c < NR; c++) {
            memcpy(buf[c], w[c] + k0, (size_t)(k - k0));
            wv[c] = _mm256_loadu_si256((const __m256i *)buf[c]);
        }
        step(mr, x, k0, wv, acc);
    }
    for (int r = 0; r < mr; r++)
        _mm_storeu_si128((__m128i *)out[r], reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

#else
static inline void tile(const int mr, const uint8_t *const *x, const int8_t *const *w, int64_t k, int off,
                        int32_t out[MR][NR]) {
    (void)off;
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < NR; c++) {
            const int8_t *xr = (const int8_t *)x[r], *wc = w[c];
            int32_t s = 0;
            for (int64_t i = 0; i < k; i++) s += (int32_t)xr[i] * (int32_t)wc[i];
            out[r][c] = s;
        }
}
#endif

/* ---- grouped GEMM driver ---- */

/* One matmul of a call: rows x[r] (quantized, kp bytes each, scales sx[r]) times weight w [n, k] (scales sw):
   out row r at y + r * ldy. */
typedef struct {
    const uint8_t *const *x;
    const float *sx;
    int64_t m;
    const int8_t *w;
    const float *sw;
    void *y;
    int64_t ldy;
} group_t;

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_I32 = 2 };

static void store(const group_t *g, int out_kind, int64_t r, int64_t n0, int nc, const int32_t *acc) {
    if (out_kind == OUT_I32) {
        memcpy((int32_t *)g->y + r * g->ldy + n0, acc, sizeof(int32_t) * nc);
        return;
    }
    float sxr = g->sx[r];
#if defined(ISA_VNNI) || defined(ISA_AVX2)
    if (nc == 4) {  /* the same three roundings, four columns at a time */
        __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)acc)), _mm_set1_ps(sxr)),
                              _mm_loadu_ps(g->sw + n0));
        if (out_kind == OUT_F32) { _mm_storeu_ps((float *)g->y + r * g->ldy + n0, v); return; }
        __m128i u = _mm_castps_si128(v);
        __m128i t = _mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)),
                                  _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1)));
        t = _mm_srli_epi32(t, 16);
        __m128i nanv = _mm_castps_si128(_mm_cmpunord_ps(v, v));
        t = _mm_blendv_epi8(t, _mm_set1_epi32(0x7fc0), nanv);
        _mm_storel_epi64((__m128i *)((uint16_t *)g->y + r * g->ldy + n0), _mm_packus_epi32(t, t));
        return;
    }
#endif
    for (int c = 0; c < nc; c++) {
        float v = (float)acc[c] * sxr * g->sw[n0 + c];  /* (int32 as fp32 * s_x) * s_w, as int_mm(...).float() * sx * sw */
        if (out_kind == OUT_BF16) ((uint16_t *)g->y)[r * g->ldy + n0 + c] = narrow(v);
        else ((float *)g->y)[r * g->ldy + n0 + c] = v;
    }
}

/* Rows [r0, r1) x columns [c0, c1) of one group. */
static void run_task(const group_t *g, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t n, int64_t k,
                     int out_kind) {
    int32_t acc[MR][NR];
    for (int64_t n0 = c0; n0 < c1; n0 += NR) {
        int nc = c1 - n0 < NR ? (int)(c1 - n0) : NR;
        const int8_t *w[NR];
        for (int c = 0; c < NR; c++) w[c] = g->w + (n0 + (c < nc ? c : 0)) * k;  /* missing columns repeat one */
#if defined(ISA_VNNI)
        __m128i off = weight_offsets(w, k);
#elif defined(ISA_AVX2)
        __m128i off = _mm_setzero_si128();
#else
        int off = 0;
#endif
        (void)n;
        int64_t r = r0;
        for (; r + MR <= r1; r += MR) {
            tile(MR, g->x + r, w, k, off, acc);
            for (int i = 0; i < MR; i++) store(g, out_kind, r + i, n0, nc, acc[i]);
        }
        int left = (int)(r1 - r);
        if (left == 3) tile(3, g->x + r, w, k, off, acc);
        else if (left == 2) tile(2, g->x + r, w, k, off, acc);
        else if (left == 1) tile(1, g->x + r, w, k, off, acc);
        for (int i = 0; i < left; i++) store(g, out_kind, r + i, n0, nc, acc[i]);
    }
}

/* Every group's rows times its weight [n, k]: tasks of ROWS_TASK rows x COLS_TASK columns over the threads. */
static void run_groups(const group_t *groups, int64_t count, int64_t n, int64_t k, int out_kind, int threads) {
    int64_t col_tasks = (n + COLS_TASK - 1) / COLS_TASK, tasks = 0;
    int64_t *first = xmalloc(sizeof(int64_t) * (count + 1));
    for (int64_t i = 0; i < count; i++) {
        first[i] = tasks;
        tasks += (groups[i].m + ROWS_TASK - 1) / ROWS_TASK * col_tasks;
    }
    first[count] = tasks;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t gi = 0;
        while (first[gi + 1] <= t) gi++;
        int64_t local = t - first[gi], rt = local / col_tasks, ct = local % col_tasks;
        int64_t r0 = rt * ROWS_TASK, r1 = r0 + ROWS_TASK < groups[gi].m ? r0 + ROWS_TASK : groups[gi].m;
        int64_t c0 = ct * COLS_TASK, c1 = c0 + COLS_TASK < n ? c0 + COLS_TASK : n;
        run_task(&groups[gi], r0, r1, c0, c1, n, k, out_kind);
    }
    free(first);
}

/* Quantize rows of x (bf16 / fp32, row stride ldx) into padded stored rows, or copy given int8 rows. */
static void prepare_rows(const void *x, int32_t x_kind, int64_t m, int64_t k, int64_t ldx, const float *sx_in,
                         uint8_t *xs, int64_t kp, const uint8_t **rows, float *sx, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++) {
        uint8_t *dst = xs + r * kp;
        rows[r] = dst;
        if (x_kind == 2) {
            const int8_t *src = (const int8_t *)x + r * ldx;
            for (int64_t i = 0; i < k; i++) dst[i] = stored(src[i]);
            for (int64_t i = k; i < kp; i++) dst[i] = (uint8_t)STORED_ZERO;
            sx[r] = sx_in ? sx_in[r] : 1.f;
        } else {
            sx[r] = quantize_row(x, x_kind, r * ldx, k, dst, kp, NULL);
        }
    }
}

/* y [m, n] = ((q(x) . w^T) * s_x) * s_w for x [m, k] (row stride ldx; x_kind 0 fp32, 1 bf16 -- quantized per
   row here -- or 2: int8 values with scales sx_in, NULL for ones), w [n, k] int8 with scales sw [n] (unused
   for int32 output). out_kind 0: fp32, 1: bf16, 2: the raw int32 sums. */
void w8a8_matmul(const void *x, int32_t x_kind, int64_t ldx, const float *sx_in, int64_t m, int64_t k,
                 const int8_t *w, const float *sw, int64_t n, void *y, int32_t out_kind, int32_t threads) {
    if (m <= 0 || n <= 0) return;
    int64_t kp = padded(k);
    uint8_t *xs = xmalloc((size_t)(m * kp));
    const uint8_t **rows = xmalloc(sizeof(void *) * m);
    float *sx = xmalloc(sizeof(float) * m);
    prepare_rows(x, x_kind, m, k, ldx, sx_in, xs, kp, rows, sx, threads);
    group_t g = {rows, sx, m, w, sw, y, n};
    run_groups(&g, 1, n, k, out_kind, threads);
    free(xs); free((void *)rows); free(sx);
}

/* y [m, n] = (acc as fp32 * sx[r]) * sw[c] (fp32 or bf16): the same epilogue for int32 sums computed elsewhere
   (torch._int_mm where it is faster: small K). */
void w8a8_rescale(const int32_t *acc, int64_t m, int64_t n, const float *sx, const float *sw, void *y,
                  int32_t out_kind, int32_t threads) {
    group_t g = {NULL, sx, m, NULL, sw, y, n};
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * n >= 65536)
    for (int64_t r = 0; r < m; r++) {
        int64_t c = 0;
#if defined(ISA_VNNI)  /* 16 columns a step, the same roundings as store() */
        const __m512 vsx = _mm512_set1_ps(sx[r]);
        for (; c < n; c += 16) {
            __mmask16 mask = n - c >= 16 ? 0xffff : (__mmask16)((1u << (n - c)) - 1);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, acc + r * n + c)),
                                                   vsx), _mm512_maskz_loadu_ps(mask, sw + c));
            if (out_kind == OUT_F32) { _mm512_mask_storeu_ps((float *)y + r * n + c, mask, v); continue; }
            __m512i u = _mm512_castps_si512(v);
            __m512i t = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
            t = _mm512_mask_mov_epi32(_mm512_srli_epi32(t, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                      _mm512_set1_epi32(0x7fc0));
            _mm256_mask_storeu_epi16((uint16_t *)y + r * n + c, mask, _mm512_cvtepi32_epi16(t));
        }
#endif
        for (; c < n; c += NR) store(&g, out_kind, r, c, n - c < NR ? (int)(n - c) : NR, acc + r * n + c);
    }
}

/* ---- W8A8 MoE: routed experts (and the shared expert) of rows x in one call ---- */

/* e^x with Cephes' expf polynomial (about 1 ulp), in + - * and bit operations only, so that the compiler
   vectorizes it and every ISA build (no FMA contraction: -ffp-contract=off) computes the same bits; libm's
   expf is a call per element here. */
static inline float exp_poly(float x) {
    x = x > 88.3762626647949f ? 88.3762626647949f : x < -87.3365447504f ? -87.3365447504f : x;
    float fx = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.f;
    int32_t bits = ((int32_t)fx + 127) << 23;
    float two;
    memcpy(&two, &bits, 4);
    return y * two;
}

static inline float silu(float g) { return g / (1.f + exp_poly(-g)); }

/* y [n, dim] fp32 = sum_j w_ij * round?(down_e . q(silu(gate_e . q(x_i)) * (up_e . q(x_i)))) over the picks
   (ids [n, top_k] local expert ids, wts [n, top_k]), as moe.Experts computes W8A8 experts (gate/up/down
   products in fp32; round_out rounds each expert's output to bf16, the model dtype, before the weighted sum),
   plus, given shared_gate, the shared expert as layers.MLP computes it with W8A8 linears (each linear's
   output and each elementwise result in the model dtype). gate_up [E, 2I, dim] (gate rows first) with
   scales [E, 2I], down [E, dim, I] with scales [E, dim]. An id outside 0..experts-1 is a padding pick
   (contributes nothing) when `padded`; otherwise the call returns 1 and writes nothing. */
int32_t moe_w8a8(const void *x, int32_t bf16, int64_t n, int64_t dim, const int64_t *ids, const float *wts,
                 int64_t top_k, int64_t experts, int32_t padded_ids, int32_t round_out,
                 const int8_t *gate_up, const float *gate_up_scale, const int8_t *down, const float *down_scale,
                 int64_t inter, const int8_t *shared_gate, const float *shared_gate_scale, const int8_t *shared_up,
                 const float *shared_up_scale, const int8_t *shared_down, const float *shared_down_scale,
                 int64_t shared_inter, float *y, int32_t threads) {
    int64_t picks = n * top_k;
    for (int64_t p = 0; p < picks; p++)
        if (!padded_ids && (ids[p] < 0 || ids[p] >= experts)) return 1;
    int64_t kd = padded(dim), ki = padded(inter);
    uint8_t *xs = xmalloc((size_t)(n * kd));
    const uint8_t **xrows = xmalloc(sizeof(void *) * (n > picks ? n : picks));
    float *sx = xmalloc(sizeof(float) * n);
    prepare_rows(x, bf16, n, dim, dim, NULL, xs, kd, xrows, sx, threads);
    const uint8_t **token_rows = xmalloc(sizeof(void *) * n);
    memcpy(token_rows, xrows, sizeof(void *) * n);

    /* picks grouped by expert (stable: in pick order), padding picks dropped */
    int64_t *start = calloc((size_t)experts + 1, sizeof(int64_t)), *order = xmalloc(sizeof(int64_t) * (picks + 1));
    int64_t *pos = xmalloc(sizeof(int64_t) * (picks + 1));
    if (!start) { fputs("pdserve int8_kernels: out of memory\n", stderr); abort(); }
    for (int64_t p = 0; p < picks; p++)
        if (ids[p] >= 0 && ids[p] < experts) start[ids[p] + 1]++;
    for (int64_t e = 0; e < experts; e++) start[e + 1] += start[e];
    int64_t used = start[experts];
    int64_t *fill = xmalloc(sizeof(int64_t) * (experts + 1));
    memcpy(fill, start, sizeof(int64_t) * experts);
    for (int64_t p = 0; p < picks; p++) {
        pos[p] = -1;
        if (ids[p] >= 0 && ids[p] < experts) { pos[p] = fill[ids[p]]; order[fill[ids[p]]++] = p; }
    }
    free(fill);

    float *gu = xmalloc(sizeof(float) * (used * 2 * inter + 1));
    float *o = xmalloc(sizeof(float) * (used * dim + 1));
    uint8_t *as = xmalloc((size_t)(used * ki + 1));
    float *sa = xmalloc(sizeof(float) * (used + 1));
    const uint8_t **arows = xmalloc(sizeof(void *) * (used + 1));
    group_t *groups = xmalloc(sizeof(group_t) * (experts + 1));
    int64_t count = 0;
    const uint8_t **prow = xrows;  /* row pointers in sorted order */
    for (int64_t s = 0; s < used; s++) prow[s] = token_rows[order[s] / top_k];
    for (int64_t e = 0; e < experts; e++) {
        int64_t m = start[e + 1] - start[e];
        if (!m) continue;
        groups[count++] = (group_t){prow + start[e], sx + 0, m, gate_up + e * 2 * inter * dim,
                                    gate_up_scale + e * 2 * inter, gu + start[e] * 2 * inter, 2 * inter};
    }
    /* the scales of sorted rows: gathered into sa's space first (sx is per token) */
    float *psx = xmalloc(sizeof(float) * (used + 1));
    for (int64_t s = 0; s < used; s++) psx[s] = sx[order[s] / top_k];
    for (int64_t i = 0, s = 0; i < count; s += groups[i].m, i++) groups[i].sx = psx + s;
    run_groups(groups, count, 2 * inter, dim, OUT_F32, threads);

    #pragma omp parallel for num_threads(threads) schedule(static) if (used * inter >= 65536)
    for (int64_t s = 0; s < used; s++) {
        float *g = gu + s * 2 * inter;
        for (int64_t c = 0; c < inter; c++) g[c] = silu(g[c]) * g[inter + c];
        sa[s] = quantize_row(g, 0, 0, inter, as + s * ki, ki, NULL);
        arows[s] = as + s * ki;
    }
    for (int64_t i = 0, s = 0; i < count; s += groups[i].m, i++) {
        int64_t e = (groups[i].w - gate_up) / (2 * inter * dim);
        groups[i] = (group_t){arows + s, sa + s, groups[i].m, down + e * dim * inter, down_scale + e * dim,
                              o + s * dim, dim};
    }
    run_groups(groups, count, dim, inter, OUT_F32, threads);

    #pragma omp parallel for num_threads(threads) schedule(static) if (n * dim >= 65536)
    for (int64_t i = 0; i < n; i++) {  /* y_i = ((0 + p_0) + p_1) + ..., picks in order */
        float *yi = y + i * dim;
        memset(yi, 0, sizeof(float) * dim);
        for (int64_t j = 0; j < top_k; j++) {
            int64_t s = pos[i * top_k + j];
            if (s < 0) continue;
            const float *os = o + s * dim;
            float wj = wts[i * top_k + j];
            if (round_out) for (int64_t d = 0; d < dim; d++) yi[d] += round_bf16(os[d]) * wj;
            else for (int64_t d = 0; d < dim; d++) yi[d] += os[d] * wj;
        }
    }

    if (shared_gate) {  /* layers.MLP with W8A8 linears: outputs and elementwise results in the model dtype */
        int64_t ks = padded(shared_inter);
        float *sg = xmalloc(sizeof(float) * n * shared_inter), *su = xmalloc(sizeof(float) * n * shared_inter);
        float *so = xmalloc(sizeof(float) * n * dim), *ssa = xmalloc(sizeof(float) * n);
        uint8_t *sas = xmalloc((size_t)(n * ks));
        const uint8_t **srows = xmalloc(sizeof(void *) * n);
        group_t gg[2] = {{token_rows, sx, n, shared_gate, shared_gate_scale, sg, shared_inter},
                         {token_rows, sx, n, shared_up, shared_up_scale, su, shared_inter}};
        run_groups(gg, 1, shared_inter, dim, OUT_F32, threads);
        run_groups(gg + 1, 1, shared_inter, dim, OUT_F32, threads);
        #pragma omp parallel for num_threads(threads) schedule(static) if (n * shared_inter >= 65536)
        for (int64_t i = 0; i < n; i++) {
            float *a = sg + i * shared_inter, *u = su + i * shared_inter;
            for (int64_t c = 0; c < shared_inter; c++) {
                float gv = round_out ? round_bf16(a[c]) : a[c], uv = round_out ? round_bf16(u[c]) : u[c];
                float sv = silu(gv);
                a[c] = round_out ? round_bf16(round_bf16(sv) * uv) : sv * uv;
            }
            ssa[i] = quantize_row(a, 0, 0, shared_inter, sas + i * ks, ks, NULL);
            srows[i] = sas + i * ks;
        }
        group_t gd = {srows, ssa, n, shared_down, shared_down_scale, so, dim};
        run_groups(&gd, 1, dim, shared_inter, OUT_F32, threads);
        for (int64_t e = 0; e < n * dim; e++) y[e] += round_out ? round_bf16(so[e]) : so[e];
        free(sg); free(su); free(so); free(ssa); free(sas); free((void *)srows);
    }
    free(xs); free((void *)xrows); free(sx); free((void *)token_rows); free(start); free(order); free(pos);
    free(gu); free(o); free(as); free(sa); free((void *)arows); free(groups); free(psx);
    return 0;
}
