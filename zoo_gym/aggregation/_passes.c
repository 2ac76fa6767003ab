/* Passes over the rows of a column chunk on the CPU: sums of rows and shifted Gram products.
 *
 * The chunk x (m, c) holds m updates, each contiguous along the columns (its rows may lie any
 * fixed number of bytes apart, as in a column range of an (m, d) tensor).
 *
 * x's values are float32, or float16 or bfloat16 (read as float32 exactly), or float64 for
 * `row_sum` (`kind` 'f', 'e', 'b', 'd').
 *
 * `row_sum(x, kind, rows, weights, scale, out)`: for each column j, the float64 sum over t of
 * x[rows[t], j] (weights None: each value converted to float64 and added, rows in the given
 * order, the sum multiplied by `scale` once) or of weights[t] * x[rows[t], j] (one fused
 * multiply-add per row, rows in order), rounded to float32 into out[j]. The plain sum adds in
 * the order NumPy's float64 += float32 row by row does, so its bits are those of
 * `_core._add_rows`' NumPy path. Blocks of columns keep their float64 sums in L1 while every
 * row is added, and the next block of each row is requested while this one is added (the
 * rows are more streams than the hardware prefetcher follows).
 *
 * `gram(x, kind, ref, extra, g)`: adds to g (k, k) float64 the lower triangle (i >= j) of
 * S S^T, where S = x - 1 x[ref] (float32: row i is x[i] - x[ref], as `_core._shifted_product`
 * shifts), with the `extra` row (a (c,) float32 point, or the string "origin" for zeros)
 * shifted the same way as row m, k = m + 1 (k = m without one). With AVX-512: the shifted
 * rows go a block of columns at a time into a scratch that stays in L2 (each row shifted by
 * the first tile that reads it); the products run on
 * tiles of 4 x 4 pairs of rows, 16 columns per step, 16 float32 accumulators in registers,
 * one fused multiply-add per pair and step; at the end of each block (at most 1,024 columns,
 * 64 products per lane) a tile's 16 x 16 lanes are summed by a fixed tree into 16 float32
 * sums and added into g in float64. The next block's input rows are requested into L2 while
 * a block is multiplied, so reading the chunk overlaps the products. Only the tiles on or
 * below the diagonal run (for m = 50: 1,456 products per column against the 1,275 of the
 * triangle and the 2,500 of the whole product). The result depends only on the chunk and
 * its column blocks, not on threads or timing.
 *
 * For BitDelta rows (a value is +scale where its sign bit is set, else -scale; see
 * `zoo_gym.aggregation._sign_gram`) three functions read the packed sign bits and the group
 * scales without decoding a value: `sign_pack` lays a chunk's groups out as 64-bit words in
 * blocks that stay in L2, `sign_distances` adds each pair's squared distance, the sum over the
 * groups of size (a - b)^2 + 4 a b h (h: the popcount of the XOR of the two rows' bits), and
 * `sign_sum` sums chosen rows (each +-scale added, exact in float64 for float16 scales, or one
 * fused multiply-add per row).
 *
 * Compile without -ffast-math and with -ffp-contract=off: the float64 sums must be added in
 * the order stated above.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../core/_bits.h"
#include "../core/_floats.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PASSES_HAVE_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
#endif

#define SUM_BLOCK 256      /* columns of a block of float64 sums (2 KiB) */
#define GRAM_BLOCK 1024     /* columns of the shifted scratch, at most */
#define GRAM_SCRATCH (1 << 20) /* bytes of the shifted scratch, at most (it stays in L2) */
#define LINE 64

static int have_avx512 = 0;
static int have_popcount512 = 0; /* AVX-512 with VPOPCNTDQ */

/* ---- row_sum ---------------------------------------------------------------------------- */

#if defined(PASSES_HAVE_X86) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* x[j] of a row of `kind` values ('f' float32, 'd' float64, 'e' float16, 'b' bfloat16) */
#define VALUE(kind, x, j)                                                                      \
    ((kind) == 'f'   ? (double)((const float *)(x))[j]                                         \
     : (kind) == 'd' ? ((const double *)(x))[j]                                                \
     : (kind) == 'e' ? (double)half_to_float(((const uint16_t *)(x))[j])                          \
                     : (double)bfloat_to_float(((const uint16_t *)(x))[j]))

/* acc[j] += x[j] (w NULL) or acc[j] = fma(*w, x[j], acc[j]) for j < len */
#define ADD_ROW(kind)                                                                          \
    do {                                                                                       \
        if (w == NULL)                                                                         \
            for (Py_ssize_t j = 0; j < len; j++)                                               \
                acc[j] += VALUE(kind, x, j);                                                   \
        else                                                                                   \
            for (Py_ssize_t j = 0; j < len; j++)                                               \
                acc[j] = fma(*w, VALUE(kind, x, j), acc[j]);                                   \
    } while (0)

CLONES static void add_row(double *restrict acc, const char *restrict x, char kind,
                           Py_ssize_t len, const double *w)
{
    switch (kind) {
    case 'f':
        ADD_ROW('f');
        break;
    case 'd':
        ADD_ROW('d');
        break;
    case 'e':
        ADD_ROW('e');
        break;
    default:
        ADD_ROW('b');
    }
}

CLONES static void round_sums(float *restrict out, const double *restrict acc, Py_ssize_t len,
                              double scale)
{
    for (Py_ssize_t j = 0; j < len; j++)
        out[j] = (float)(acc[j] * scale);
}

static void run_row_sum(const char *x, Py_ssize_t stride, char kind, int size, Py_ssize_t c,
                        const int64_t *rows, Py_ssize_t k, const double *weights, double scale,
                        float *out)
{
    double acc[SUM_BLOCK] __attribute__((aligned(64)));
    for (Py_ssize_t j0 = 0; j0 < c; j0 += SUM_BLOCK) {
        const Py_ssize_t len = c - j0 < SUM_BLOCK ? c - j0 : SUM_BLOCK;
        memset(acc, 0, sizeof(double) * (size_t)len);
        const Py_ssize_t next = j0 + SUM_BLOCK < c ? j0 + SUM_BLOCK : -1;
        for (Py_ssize_t t = 0; t < k; t++) {
            const char *row = x + rows[t] * stride;
            if (next >= 0) { /* this row's next block, for the next pass over the rows */
                const Py_ssize_t bytes = (c - next < SUM_BLOCK ? c - next : SUM_BLOCK) * size;
                for (Py_ssize_t b = 0; b < bytes; b += LINE)
                    __builtin_prefetch(row + next * size + b, 0, 2);
            }
            add_row(acc, row + j0 * size, kind, len, weights == NULL ? NULL : &weights[t]);
        }
        round_sums(out + j0, acc, len, weights == NULL ? scale : 1.0);
    }
}

/* ---- gram ------------------------------------------------------------------------------- */

#ifdef PASSES_HAVE_X86

typedef struct {
    const char *x;      /* the chunk's first value */
    char kind;          /* its values: 'f' float32, 'e' float16, 'b' bfloat16 */
    int size;           /* bytes per value */
    Py_ssize_t stride;  /* bytes between rows */
    Py_ssize_t m, c;    /* rows, columns */
    Py_ssize_t ref;     /* the reference row */
    const float *extra; /* the extra point, NULL for the origin or none */
    int has_extra;
    Py_ssize_t k, kp;   /* rows of S (m + has_extra), padded to a multiple of 4 */
    Py_ssize_t block;   /* columns of the scratch */
    float *s;           /* (kp, block) the shifted rows, padding rows zero */
    double *g;          /* (k, k) */
} gram_t;

/* The next block's input, requested line by line while a block is multiplied */
typedef struct {
    const char *x;
    Py_ssize_t stride, row, rows, offset, bytes;
} cursor_t;

static inline void advance(cursor_t *p)
{
    if (p->row >= p->rows)
        return;
    _mm_prefetch(p->x + p->row * p->stride + p->offset, _MM_HINT_T1);
    p->offset += LINE;
    if (p->offset >= p->bytes) {
        p->offset = 0;
        p->row++;
    }
}

/* 16 values of `kind` from p as float32, the lanes outside `mask` zero */
AVX512 static inline __m512 load16(const char *p, char kind, __mmask16 mask)
{
    if (kind == 'f')
        return _mm512_maskz_loadu_ps(mask, p);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    if (kind == 'e')
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Step t's mask of the columns of a block of w */
static inline __mmask16 step_mask(Py_ssize_t w, Py_ssize_t t)
{
    const Py_ssize_t left = w - 16 * t;
    return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
}

/* Rows r0..r1 - 1 of S <- those of the block of columns [c0, c0 + w) shifted, zeros up to
 * a multiple of 16 (the padding rows from k on stay zero) */
AVX512 static void shift_rows(const gram_t *q, Py_ssize_t c0, Py_ssize_t w, Py_ssize_t r0,
                              Py_ssize_t r1)
{
    const char *base = q->x + q->ref * q->stride + c0 * q->size;
    const Py_ssize_t steps = (w + 15) / 16;
    for (Py_ssize_t i = r0; i < r1 && i < q->k; i++) {
        float *dst = q->s + i * q->block;
        const char *src = i < q->m ? q->x + i * q->stride + c0 * q->size : NULL;
        const float *point = i >= q->m && q->extra != NULL ? q->extra + c0 : NULL;
        for (Py_ssize_t t = 0; t < steps; t++) {
            const __mmask16 mask = step_mask(w, t);
            const __m512 r = load16(base + 16 * t * q->size, q->kind, mask);
            const __m512 v = src != NULL     ? load16(src + 16 * t * q->size, q->kind, mask)
                             : point != NULL ? _mm512_maskz_loadu_ps(mask, point + 16 * t)
                                             : _mm512_setzero_ps();
            _mm512_store_ps(dst + 16 * t, _mm512_sub_ps(v, r));
        }
    }
}

/* lanes lo or hi of a and b: [a_lo, b_lo] and [a_hi, b_hi] per level of the tree */
AVX512 static inline __m512 fold(__m512 a, __m512 b, __m512i lo, __m512i hi)
{
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

/* The 16 lane sums of a[0..15], in order, by a fixed tree (four levels of folds) */
AVX512 static __m512 lane_sums(__m512 a[16])
{
    /* level 1: [a0..7 | b0..7] + [a8..15 | b8..15]: 8 partial sums of each */
    const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                          30, 31);
    /* level 2: of [a 8 | b 8] and [c 8 | d 8]: [a 4 | b 4 | c 4 | d 4] */
    const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                          31);
    /* level 3: of [4 each of a..d] and [4 each of e..h]: [2 each of a..h] */
    const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i hi3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                          31);
    /* level 4: of [2 each of a..h] and [2 each of i..p]: [a..p] */
    const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i hi4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                          31);
    __m512 b[8], c[4], d[2];
    for (int t = 0; t < 8; t++)
        b[t] = fold(a[2 * t], a[2 * t + 1], lo1, hi1);
    for (int t = 0; t < 4; t++)
        c[t] = fold(b[2 * t], b[2 * t + 1], lo2, hi2);
    for (int t = 0; t < 2; t++)
        d[t] = fold(c[2 * t], c[2 * t + 1], lo3, hi3);
    return fold(d[0], d[1], lo4, hi4);
}

/* Rows i0..i0+3 times rows j0..j0+3 of S over the w columns of the block from c0, added
 * into g (the pairs below or on the diagonal only); the cursor advanced one line per step.
 * Where `shifting`, rows i0..i0+3 (all rows of x) are shifted into S on the way, from x: the
 * tiles (i, 0) are the first to read rows i of a block, so that the shift needs no pass of
 * its own over S. */
AVX512 static inline __attribute__((always_inline)) void
tile_body(const gram_t *q, Py_ssize_t i0, Py_ssize_t j0, Py_ssize_t c0, Py_ssize_t w,
          cursor_t *next, const int shifting)
{
    float *a[4];
    const char *src[4];
    for (int i = 0; i < 4; i++) {
        a[i] = q->s + (i0 + i) * q->block;
        src[i] = q->x + (i0 + i) * q->stride + c0 * q->size;
    }
    const char *base = q->x + q->ref * q->stride + c0 * q->size;
    const int size = q->size; /* read once: the stores into S could alias q for the compiler */
    const char kind = q->kind;
    const float *b0 = q->s + j0 * q->block, *b1 = b0 + q->block, *b2 = b1 + q->block,
                *b3 = b2 + q->block;
    __m512 acc[16];
    for (int t = 0; t < 16; t++)
        acc[t] = _mm512_setzero_ps();
    const Py_ssize_t steps = (w + 15) / 16;
    for (Py_ssize_t t = 0; t < steps; t++) {
        const Py_ssize_t o = 16 * t;
        const __m512 y0 = _mm512_load_ps(b0 + o), y1 = _mm512_load_ps(b1 + o),
                     y2 = _mm512_load_ps(b2 + o), y3 = _mm512_load_ps(b3 + o);
        __m512 r = _mm512_setzero_ps();
        __mmask16 mask = 0xFFFF;
        if (shifting) {
            mask = step_mask(w, t);
            r = load16(base + o * size, kind, mask);
        }
        for (int i = 0; i < 4; i++) {
            __m512 v;
            if (shifting) {
                v = _mm512_sub_ps(load16(src[i] + o * size, kind, mask), r);
                _mm512_store_ps(a[i] + o, v);
            } else {
                v = _mm512_load_ps(a[i] + o);
            }
            acc[4 * i] = _mm512_fmadd_ps(v, y0, acc[4 * i]);
            acc[4 * i + 1] = _mm512_fmadd_ps(v, y1, acc[4 * i + 1]);
            acc[4 * i + 2] = _mm512_fmadd_ps(v, y2, acc[4 * i + 2]);
            acc[4 * i + 3] = _mm512_fmadd_ps(v, y3, acc[4 * i + 3]);
        }
        advance(next);
    }
    float sums[16] __attribute__((aligned(64)));
    _mm512_store_ps(sums, lane_sums(acc));
    for (int i = 0; i < 4 && i0 + i < q->k; i++)
        for (int j = 0; j < 4 && j0 + j <= i0 + i; j++)
            q->g[(i0 + i) * q->k + j0 + j] += (double)sums[4 * i + j];
}

AVX512 static void tile(const gram_t *q, Py_ssize_t i0, Py_ssize_t j0, Py_ssize_t c0,
                        Py_ssize_t w, cursor_t *next)
{
    tile_body(q, i0, j0, c0, w, next, 0);
}

AVX512 static void tile_shifting(const gram_t *q, Py_ssize_t i0, Py_ssize_t c0, Py_ssize_t w,
                                 cursor_t *next)
{
    tile_body(q, i0, 0, c0, w, next, 1);
}

AVX512 static void run_gram(gram_t *q)
{
    const Py_ssize_t tiles = q->kp / 4;
    for (Py_ssize_t c0 = 0; c0 < q->c; c0 += q->block) {
        const Py_ssize_t w = q->c - c0 < q->block ? q->c - c0 : q->block;
        const Py_ssize_t next0 = c0 + q->block;
        const Py_ssize_t nw = q->c - next0 < q->block ? q->c - next0 : q->block;
        cursor_t next = {q->x + next0 * q->size, q->stride, 0, nw > 0 ? q->m : 0, 0,
                         nw * q->size};
        shift_rows(q, c0, w, 0, 4);
        for (Py_ssize_t it = 0; it < tiles; it++) {
            const Py_ssize_t i0 = 4 * it;
            if (it > 0 && i0 + 4 <= q->m) {
                tile_shifting(q, i0, c0, w, &next);
            } else {
                if (it > 0) /* the extra row or padding among these: shifted apart */
                    shift_rows(q, c0, w, i0, i0 + 4);
                tile(q, i0, 0, c0, w, &next);
            }
            for (Py_ssize_t jt = 1; jt <= it; jt++)
                tile(q, i0, 4 * jt, c0, w, &next);
        }
    }
}

#endif /* PASSES_HAVE_X86 */

/* ---- the module ------------------------------------------------------------------------- */

/* x's rows and columns from a 2-d buffer of `kind` values ('f' float32, 'd' float64, 'e'
 * float16, 'b' bfloat16 as 2-byte integers) contiguous along each row; `kinds` lists the
 * kinds allowed; -1 with an exception set otherwise */
static int chunk_shape(const Py_buffer *x, char kind, const char *kinds, Py_ssize_t *m,
                       Py_ssize_t *c)
{
    const int size = kind == 'd' ? 8 : (kind == 'f' ? 4 : 2);
    if (kind == '\0' || strchr(kinds, kind) == NULL) {
        PyErr_Format(PyExc_ValueError, "kind must be one of '%s'", kinds);
        return -1;
    }
    if (x->ndim != 2 || x->itemsize != size) {
        PyErr_Format(PyExc_ValueError, "x must be a 2-d array of %d-byte values", size);
        return -1;
    }
    if (x->strides[1] != x->itemsize || x->strides[0] < 0) {
        PyErr_SetString(PyExc_ValueError, "x's rows must be contiguous and in order");
        return -1;
    }
    *m = x->shape[0];
    *c = x->shape[1];
    return 0;
}

PyDoc_STRVAR(row_sum_doc,
             "row_sum(x, kind, rows, weights, scale, out)\n\n"
             "out (c,) float32 <- the float64 sum of x[rows[t]] over t (rows int64), rows added\n"
             "in order: each converted and added, the sum times `scale` (weights None), or\n"
             "one fused multiply-add of weights[t] (float64) per row. x (m, c) with contiguous\n"
             "rows of `kind` values: 'f' float32, 'd' float64, 'e' float16, 'b' bfloat16 (as\n"
             "2-byte integers). The GIL is released.");

static PyObject *passes_row_sum(PyObject *self, PyObject *args)
{
    PyObject *x_obj, *rows_obj, *weights_obj, *out_obj;
    double scale;
    int kind;
    if (!PyArg_ParseTuple(args, "OCOOdO:row_sum", &x_obj, &kind, &rows_obj, &weights_obj,
                          &scale, &out_obj))
        return NULL;
    Py_buffer x, rows, weights, out;
    if (PyObject_GetBuffer(x_obj, &x, PyBUF_STRIDES) < 0)
        return NULL;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    const int weighted = weights_obj != Py_None;
    if (weighted && PyObject_GetBuffer(weights_obj, &weights, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&rows);
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        if (weighted)
            PyBuffer_Release(&weights);
        PyBuffer_Release(&x);
        PyBuffer_Release(&rows);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t m, c;
    const Py_ssize_t k = rows.len / 8;
    if (chunk_shape(&x, (char)kind, "fdeb", &m, &c) < 0) {
    } else if (out.len != c * 4 || (weighted && weights.len != k * 8)) {
        PyErr_SetString(PyExc_ValueError,
                        "out must hold c float32 values and weights one float64 per row");
    } else {
        const int64_t *r = (const int64_t *)rows.buf;
        int bad = 0;
        for (Py_ssize_t t = 0; t < k; t++)
            bad |= r[t] < 0 || r[t] >= m;
        if (bad) {
            PyErr_SetString(PyExc_IndexError, "a row index is outside x");
        } else {
            Py_BEGIN_ALLOW_THREADS
            run_row_sum((const char *)x.buf, x.strides[0], (char)kind, (int)x.itemsize, c, r, k,
                        weighted ? (const double *)weights.buf : NULL, scale, (float *)out.buf);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&out);
    if (weighted)
        PyBuffer_Release(&weights);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&x);
    return result;
}

PyDoc_STRVAR(gram_doc,
             "gram(x, kind, ref, extra, g)\n\n"
             "g (k, k) float64 += the lower triangle of S S^T, S the rows of x (m, c) as\n"
             "float32 minus row `ref`, with `extra` (None, a (c,) float32 point, or \"origin\")\n"
             "shifted as row m (k = m + 1). x's rows contiguous, of `kind` values: 'f'\n"
             "float32, 'e' float16, 'b' bfloat16 (as 2-byte integers). Needs AVX-512 (`GRAM`).\n"
             "The GIL is released.");

static PyObject *passes_gram(PyObject *self, PyObject *args)
{
    PyObject *x_obj, *extra_obj, *g_obj;
    Py_ssize_t ref;
    int kind;
    if (!PyArg_ParseTuple(args, "OCnOO:gram", &x_obj, &kind, &ref, &extra_obj, &g_obj))
        return NULL;
#ifndef PASSES_HAVE_X86
    PyErr_SetString(PyExc_RuntimeError, "gram needs AVX-512");
    return NULL;
#else
    if (!have_avx512) {
        PyErr_SetString(PyExc_RuntimeError, "gram needs AVX-512");
        return NULL;
    }
    const int origin = PyUnicode_Check(extra_obj);
    const int point = extra_obj != Py_None && !origin;
    Py_buffer x, extra, g;
    if (PyObject_GetBuffer(x_obj, &x, PyBUF_STRIDES) < 0)
        return NULL;
    if (point && PyObject_GetBuffer(extra_obj, &extra, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (PyObject_GetBuffer(g_obj, &g, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        if (point)
            PyBuffer_Release(&extra);
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *result = NULL;
    gram_t q = {0};
    if (chunk_shape(&x, (char)kind, "feb", &q.m, &q.c) == 0) {
        q.x = (const char *)x.buf;
        q.kind = (char)kind;
        q.size = (int)x.itemsize;
        q.stride = x.strides[0];
        q.ref = ref;
        q.has_extra = point || origin;
        q.extra = point ? (const float *)extra.buf : NULL;
        q.k = q.m + q.has_extra;
        q.kp = (q.k + 3) / 4 * 4;
        if (ref < 0 || ref >= q.m)
            PyErr_SetString(PyExc_IndexError, "ref is outside x");
        else if (point && (extra.len != q.c * 4 || extra.itemsize != 4))
            PyErr_SetString(PyExc_ValueError, "extra must hold c float32 values");
        else if (g.len != q.k * q.k * 8)
            PyErr_SetString(PyExc_ValueError, "g must be (k, k) float64, k = rows (+ 1)");
        else {
            Py_ssize_t block = (GRAM_SCRATCH) / (q.kp * 4) / 16 * 16;
            block = block < 256 ? 256 : (block > GRAM_BLOCK ? GRAM_BLOCK : block);
            q.block = block;
            q.g = (double *)g.buf;
            q.s = aligned_alloc(64, (size_t)(q.kp * block) * 4);
            if (q.s == NULL) {
                PyErr_NoMemory();
            } else {
                memset(q.s, 0, (size_t)(q.kp * block) * 4);
                if (q.c > 0) {
                    Py_BEGIN_ALLOW_THREADS
                    run_gram(&q);
                    Py_END_ALLOW_THREADS
                }
                free(q.s);
                result = Py_NewRef(Py_None);
            }
        }
    }
    PyBuffer_Release(&g);
    if (point)
        PyBuffer_Release(&extra);
    PyBuffer_Release(&x);
    return result;
#endif
}

/* ---- distances between BitDelta rows from their sign bits ------------------------------- */

/* Packs one piece of BitDelta columns (m values from bit `bit` of each row of signs, the first
 * being value `phase` of its group; scales (n, groups)) as groups g0 .. of the packed arrays,
 * in blocks of `block` groups: group g in block b = g / block at place l = g % block, with
 * words (nb, n, w, block) uint64, bit t of word v holding value 64 v + t of the group;
 * values (nb, n, block) float64, the scales; sizes (nb, block) float64, the values of each
 * group here (rows i0 .. i1 - 1 only; the sizes where i0 is 0). A block's words and scales
 * of each row are contiguous, the rows one after the other. */
static void pack_piece(const Py_buffer *signs, Py_ssize_t bit, Py_ssize_t m, Py_ssize_t phase,
                       Py_ssize_t group, const Py_buffer *scales, uint64_t *words,
                       double *values, double *sizes, Py_ssize_t w, Py_ssize_t block,
                       Py_ssize_t g0, Py_ssize_t i0, Py_ssize_t i1)
{
    const Py_ssize_t n = signs->shape[0], nbytes = signs->shape[1], groups = scales->shape[1];
    const Py_ssize_t s0 = scales->strides[0] / 4, s1 = scales->strides[1] / 4;
    for (Py_ssize_t g = 0; g < groups && i0 == 0; g++) { /* by the first rows' caller only */
        const Py_ssize_t c0 = g * group - phase < 0 ? 0 : g * group - phase;
        const Py_ssize_t c1 = (g + 1) * group - phase > m ? m : (g + 1) * group - phase;
        sizes[g0 + g] = (double)(c1 - c0);
    }
    for (Py_ssize_t i = i0; i < i1; i++) { /* each row's bytes in order */
        const uint8_t *row = (const uint8_t *)signs->buf + i * signs->strides[0];
        const float *scale = (const float *)scales->buf + i * s0;
        Py_ssize_t b = g0 / block, l = g0 % block, c0 = 0, c1 = group - phase < m ? group - phase : m;
        for (Py_ssize_t g = 0; g < groups; g++) {
            uint64_t *out = words + ((b * n + i) * w) * block + l;
            for (Py_ssize_t v = 0; v < w; v++) {
                const Py_ssize_t from = c0 + 64 * v, left = c1 - from;
                uint64_t x = left > 0 ? bits_at(row, nbytes, bit + from) : 0;
                if (left > 0 && left < 64)
                    x &= (1ull << left) - 1;
                out[v * block] = x;
            }
            values[(b * n + i) * block + l] = (double)scale[g * s1];
            c0 = c1, c1 = c1 + group < m ? c1 + group : m; /* the next group's columns */
            if (++l == block)
                b++, l = 0;
        }
    }
}

/* One pair's squared distance over `count` packed groups (words of a row `ng` apart): with a
 * the scales of row i, b of row k, size the values of a group and h the values whose signs
 * differ, the sum over the groups of size (a - b)^2 + 4 a b h. Portable. */
#if defined(PASSES_HAVE_X86) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("popcnt", "default")))
#endif
static double pair_distance(const uint64_t *pi, const uint64_t *pk, const double *si,
                            const double *sk, const double *sizes, Py_ssize_t w, Py_ssize_t ng,
                            Py_ssize_t count)
{
    double same = 0.0, differ = 0.0;
    for (Py_ssize_t g = 0; g < count; g++) {
        int64_t h = 0;
        for (Py_ssize_t v = 0; v < w; v++)
            h += __builtin_popcountll(pi[v * ng + g] ^ pk[v * ng + g]);
        const double t = si[g] - sk[g];
        same += sizes[g] * t * t;
        differ += si[g] * sk[g] * (double)h;
    }
    return same + 4.0 * differ;
}

#ifdef PASSES_HAVE_X86
#define POPCOUNT512 __attribute__((target("avx512f,avx512dq,avx512vpopcntdq,fma")))

/* The same sums for row i against rows k .. k + 3, 8 groups per step (ng and count multiples
 * of 8): out[kk] = the distance to row k + kk. */
POPCOUNT512 static void pair_distances4(const uint64_t *pi, const uint64_t *pk, const double *si,
                                        const double *sk, const double *sizes, Py_ssize_t w,
                                        Py_ssize_t ng, Py_ssize_t count, double out[4])
{
    __m512d same[4], differ[4];
    for (int kk = 0; kk < 4; kk++)
        same[kk] = differ[kk] = _mm512_setzero_pd();
    const Py_ssize_t row = w * ng; /* words of a row */
    for (Py_ssize_t g = 0; g < count; g += 8) {
        const __m512d a = _mm512_loadu_pd(si + g), size = _mm512_loadu_pd(sizes + g);
        __m512i h[4];
        for (int kk = 0; kk < 4; kk++)
            h[kk] = _mm512_setzero_si512();
        for (Py_ssize_t v = 0; v < w; v++) {
            const __m512i x = _mm512_loadu_si512(pi + v * ng + g);
            for (int kk = 0; kk < 4; kk++) {
                const __m512i y = _mm512_loadu_si512(pk + kk * row + v * ng + g);
                h[kk] = _mm512_add_epi64(h[kk], _mm512_popcnt_epi64(_mm512_xor_si512(x, y)));
            }
        }
        for (int kk = 0; kk < 4; kk++) {
            const __m512d b = _mm512_loadu_pd(sk + kk * ng + g), t = _mm512_sub_pd(a, b);
            same[kk] = _mm512_fmadd_pd(_mm512_mul_pd(size, t), t, same[kk]);
            differ[kk] = _mm512_fmadd_pd(_mm512_mul_pd(a, b), _mm512_cvtepi64_pd(h[kk]), differ[kk]);
        }
    }
    for (int kk = 0; kk < 4; kk++)
        out[kk] = _mm512_reduce_add_pd(same[kk]) + 4.0 * _mm512_reduce_add_pd(differ[kk]);
}

/* The same sums for rows i and i' (pi, pj; si, sj) against rows k .. k + 3: out[0][kk] for
 * row i, out[1][kk] for row i'. Each row k's words are read once for both. */
POPCOUNT512 static void pair_distances8(const uint64_t *pi, const uint64_t *pj,
                                        const uint64_t *pk, const double *si, const double *sj,
                                        const double *sk, const double *sizes, Py_ssize_t w,
                                        Py_ssize_t ng, Py_ssize_t count, double out[2][4])
{
    __m512d acc[2][4];
    for (int ii = 0; ii < 2; ii++)
        for (int kk = 0; kk < 4; kk++)
            acc[ii][kk] = _mm512_setzero_pd();
    const Py_ssize_t row = w * ng;
    const __m512d four = _mm512_set1_pd(4.0);
    for (Py_ssize_t g = 0; g < count; g += 8) {
        __m512i h[2][4];
        for (int ii = 0; ii < 2; ii++)
            for (int kk = 0; kk < 4; kk++)
                h[ii][kk] = _mm512_setzero_si512();
        for (Py_ssize_t v = 0; v < w; v++) {
            const __m512i x0 = _mm512_loadu_si512(pi + v * ng + g);
            const __m512i x1 = _mm512_loadu_si512(pj + v * ng + g);
            for (int kk = 0; kk < 4; kk++) {
                const __m512i y = _mm512_loadu_si512(pk + kk * row + v * ng + g);
                h[0][kk] = _mm512_add_epi64(h[0][kk], _mm512_popcnt_epi64(_mm512_xor_si512(x0, y)));
                h[1][kk] = _mm512_add_epi64(h[1][kk], _mm512_popcnt_epi64(_mm512_xor_si512(x1, y)));
            }
        }
        const __m512d size = _mm512_loadu_pd(sizes + g);
        const __m512d a[2] = {_mm512_loadu_pd(si + g), _mm512_loadu_pd(sj + g)};
        for (int kk = 0; kk < 4; kk++) {
            const __m512d b = _mm512_loadu_pd(sk + kk * ng + g), b4 = _mm512_mul_pd(four, b);
            for (int ii = 0; ii < 2; ii++) {
                const __m512d t = _mm512_sub_pd(a[ii], b);
                acc[ii][kk] = _mm512_fmadd_pd(_mm512_mul_pd(size, t), t, acc[ii][kk]);
                acc[ii][kk] = _mm512_fmadd_pd(_mm512_mul_pd(a[ii], b4),
                                              _mm512_cvtepi64_pd(h[ii][kk]), acc[ii][kk]);
            }
        }
    }
    for (int ii = 0; ii < 2; ii++)
        for (int kk = 0; kk < 4; kk++)
            out[ii][kk] = _mm512_reduce_add_pd(acc[ii][kk]);
}
#endif

/* A block's dist[i, k] for k from k on, k < i (the block's words, scales and sizes; `block`
 * groups a row). */
static void row_pairs(const uint64_t *words, const double *values, const double *sizes,
                      Py_ssize_t n, Py_ssize_t w, Py_ssize_t block, double *dist, Py_ssize_t i,
                      Py_ssize_t k, int vector)
{
    const uint64_t *pi = words + i * w * block;
    const double *si = values + i * block;
#ifdef PASSES_HAVE_X86
    if (vector) {
        for (; k + 4 <= i; k += 4) {
            double d[4];
            pair_distances4(pi, words + k * w * block, si, values + k * block, sizes, w, block,
                            block, d);
            for (int kk = 0; kk < 4; kk++)
                dist[i * n + k + kk] += d[kk];
        }
    }
#endif
    for (; k < i; k++)
        dist[i * n + k] += pair_distance(pi, words + k * w * block, si, values + k * block,
                                         sizes, w, block, block);
}

/* dist[i, k] += the distance of rows i and k (k < i) over the packed groups (nb blocks of
 * `block`, see pack_piece), for the rows i of the pairs (2 q, 2 q + 1), q = first, first +
 * step, ...: block by block, each pair's sum of a block added to dist in turn (a block of
 * all n rows is sized to stay in L2 while every pair reads it). Which kernel adds which pair
 * does not depend on first and step. */
static void sign_pairs(const uint64_t *words, const double *values, const double *sizes,
                       Py_ssize_t nb, Py_ssize_t n, Py_ssize_t w, Py_ssize_t block, double *dist,
                       Py_ssize_t first, Py_ssize_t step, int vector)
{
    vector = vector && block % 8 == 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        const uint64_t *wb = words + b * n * w * block;
        const double *vb = values + b * n * block, *sb = sizes + b * block;
        for (Py_ssize_t i = 2 * first; i < n; i += 2 * step) {
            const Py_ssize_t j = i + 1;
            Py_ssize_t k = 0;
#ifdef PASSES_HAVE_X86
            if (vector && j < n) {
                for (; k + 4 <= i; k += 4) {
                    double d[2][4];
                    pair_distances8(wb + i * w * block, wb + j * w * block, wb + k * w * block,
                                    vb + i * block, vb + j * block, vb + k * block, sb, w, block,
                                    block, d);
                    for (int kk = 0; kk < 4; kk++) {
                        dist[i * n + k + kk] += d[0][kk];
                        dist[j * n + k + kk] += d[1][kk];
                    }
                }
            }
#endif
            row_pairs(wb, vb, sb, n, w, block, dist, i, k, vector);
            if (j < n)
                row_pairs(wb, vb, sb, n, w, block, dist, j, k, vector);
        }
    }
}

/* The element format of a buffer ('B', 'Q' for 8-byte unsigned, 'f', 'd') or 0. */
static char sign_format(const Py_buffer *view)
{
    const char *f = view->format == NULL ? "B" : view->format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (f[1] != '\0')
        return 0;
    if ((f[0] == 'Q' || f[0] == 'L' || f[0] == 'q' || f[0] == 'l') && view->itemsize == 8)
        return 'Q';
    if ((f[0] == 'B' && view->itemsize == 1) || (f[0] == 'f' && view->itemsize == 4) ||
        (f[0] == 'd' && view->itemsize == 8))
        return f[0];
    return 0;
}

PyDoc_STRVAR(sign_pack_doc,
             "sign_pack(signs, bit, m, phase, group, scales, words, values, sizes, g0, i0=0,\n"
             "          i1=n)\n\n"
             "Packs m BitDelta values of each row (bits bit .. of signs (n, bytes) uint8, most\n"
             "significant first; the first value being value phase of its group; scales (n,\n"
             "groups) float32) as groups g0 .. g0 + groups - 1 of blocks of `block` groups:\n"
             "words (nb, n, w, block) uint64 (64 w >= group; bit t of word v: value 64 v + t of\n"
             "the group), values (nb, n, block) float64 (the scales) and sizes (nb, block)\n"
             "float64 (each group's values here); rows i0 .. i1 - 1 of them.");

static PyObject *passes_sign_pack(PyObject *self, PyObject *args)
{
    PyObject *objs[5];
    Py_ssize_t bit, m, phase, group, g0, i0 = 0, i1 = -1;
    if (!PyArg_ParseTuple(args, "OnnnnOOOOn|nn:sign_pack", &objs[0], &bit, &m, &phase, &group,
                          &objs[1], &objs[2], &objs[3], &objs[4], &g0, &i0, &i1))
        return NULL;
    Py_buffer v[5];
    const int writable = PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT;
    const int modes[5] = {PyBUF_STRIDES | PyBUF_FORMAT, PyBUF_STRIDES | PyBUF_FORMAT, writable,
                          writable, writable};
    int got = 0;
    for (; got < 5; got++)
        if (PyObject_GetBuffer(objs[got], &v[got], modes[got]) < 0)
            break;
    PyObject *result = NULL;
    if (got == 5) {
        const Py_ssize_t n = v[0].ndim == 2 ? v[0].shape[0] : -1;
        const int four = v[2].ndim == 4;
        const Py_ssize_t nb = four ? v[2].shape[0] : 0, w = four ? v[2].shape[2] : 0;
        const Py_ssize_t block = four ? v[2].shape[3] : 0;
        const Py_ssize_t groups = v[1].ndim == 2 ? v[1].shape[1] : 0;
        const int ok = n >= 1 && sign_format(&v[0]) == 'B' && v[0].strides[1] == 1 &&
                       sign_format(&v[1]) == 'f' && v[1].shape[0] == n &&
                       v[1].strides[0] % 4 == 0 && v[1].strides[1] % 4 == 0 && group >= 1 &&
                       phase >= 0 && phase < group && m >= 1 && bit >= 0 &&
                       bit + m <= 8 * v[0].shape[1] &&
                       groups == (phase + m + group - 1) / group && sign_format(&v[2]) == 'Q' &&
                       four && v[2].shape[1] == n && 64 * w >= (group < m ? group : m) &&
                       sign_format(&v[3]) == 'd' && v[3].ndim == 3 && v[3].shape[0] == nb &&
                       v[3].shape[1] == n && v[3].shape[2] == block &&
                       sign_format(&v[4]) == 'd' && v[4].len == 8 * nb * block && g0 >= 0 &&
                       g0 + groups <= nb * block && i0 >= 0 && (i1 < 0 || (i0 <= i1 && i1 <= n));
        if (!ok) {
            PyErr_SetString(PyExc_ValueError,
                            "sign_pack needs signs (n, bytes) uint8 holding bits [bit, bit + m), "
                            "scales (n, groups) float32, words (nb, n, w, block) uint64 with 64 w "
                            ">= group, values (nb, n, block) and sizes (nb, block) float64, g0 + "
                            "groups <= nb block");
        } else {
            Py_BEGIN_ALLOW_THREADS
            pack_piece(&v[0], bit, m, phase, group, &v[1], (uint64_t *)v[2].buf,
                       (double *)v[3].buf, (double *)v[4].buf, w, block, g0, i0, i1 < 0 ? n : i1);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

PyDoc_STRVAR(sign_distances_doc,
             "sign_distances(words, values, sizes, dist, first, step, vector=True)\n\n"
             "dist (n, n) float64 [i, k] += the squared distance of rows i and k (k < i) of the\n"
             "packed groups (see sign_pack), for the rows i of the pairs (2 q, 2 q + 1), q =\n"
             "first, first + step, ... (the same bits whatever first and step): the sum over\n"
             "the groups of size (a - b)^2 + 4 a b h, a and b the rows' scales and h the values\n"
             "whose signs differ; 8 groups per step with AVX-512 (`POPCOUNT`) unless vector is\n"
             "False. The GIL is released.");

static PyObject *passes_sign_distances(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    Py_ssize_t first, step;
    int vector = 1;
    if (!PyArg_ParseTuple(args, "OOOOnn|p:sign_distances", &objs[0], &objs[1], &objs[2], &objs[3],
                          &first, &step, &vector))
        return NULL;
#ifdef PASSES_HAVE_X86
    vector = vector && have_popcount512;
#else
    vector = 0;
#endif
    Py_buffer v[4];
    int got = 0;
    for (; got < 4; got++)
        if (PyObject_GetBuffer(objs[got], &v[got],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                                   (got == 3 ? PyBUF_WRITABLE : 0)) < 0)
            break;
    PyObject *result = NULL;
    if (got == 4) {
        const int four = v[0].ndim == 4;
        const Py_ssize_t nb = four ? v[0].shape[0] : 0, n = four ? v[0].shape[1] : 0;
        const Py_ssize_t w = four ? v[0].shape[2] : 0, block = four ? v[0].shape[3] : 0;
        const int ok = n >= 1 && sign_format(&v[0]) == 'Q' && sign_format(&v[1]) == 'd' &&
                       v[1].len == 8 * nb * n * block && sign_format(&v[2]) == 'd' &&
                       v[2].len == 8 * nb * block && sign_format(&v[3]) == 'd' &&
                       v[3].ndim == 2 && v[3].shape[0] == n && v[3].shape[1] == n &&
                       first >= 0 && step >= 1;
        if (!ok) {
            PyErr_SetString(PyExc_ValueError,
                            "sign_distances needs words (nb, n, w, block) uint64, values (nb, n, "
                            "block) and sizes (nb, block) float64, dist (n, n) float64, first >= "
                            "0, step >= 1");
        } else {
            Py_BEGIN_ALLOW_THREADS
            sign_pairs((const uint64_t *)v[0].buf, (const double *)v[1].buf,
                       (const double *)v[2].buf, nb, n, w, block, (double *)v[3].buf, first, step,
                       vector);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&v[i]);
    return result;
}


/* ---- sums of BitDelta rows from their sign bits ----------------------------------------- */

#define SIGN_SUM_BLOCK 2048 /* columns whose float64 sums stay in L1 while every row adds */

/* Bits o .. o + 7 of a row's words (bit t of words[v]: value 64 v + t), as a byte. */
static inline unsigned int byte_at(const uint64_t *words, Py_ssize_t o)
{
    const int r = (int)(o & 63);
    uint64_t x = words[o >> 6] >> r;
    if (r > 56)
        x |= words[(o >> 6) + 1] << (64 - r);
    return (unsigned int)(x & 0xFF);
}

/* Each row's bits of columns c0 .. c1 - 1 into words (bit t of words[v]: column c0 + 64 v +
 * t), a zero word after them. */
static inline void row_words(const uint8_t *row, Py_ssize_t nbytes, Py_ssize_t bit,
                             Py_ssize_t c0, Py_ssize_t c1, uint64_t *words)
{
    for (Py_ssize_t v = 0; 64 * v < c1 - c0; v++)
        words[v] = bits_at(row, nbytes, bit + c0 + 64 * v);
    words[(c1 - c0 + 63) / 64] = 0;
}

/* acc[0 .. c1 - c0) <- the chosen rows' values in columns c0 .. c1 - 1 (+scale where the sign
 * bit is set, else -scale): each row's value added (weights NULL) or multiplied by weights[t]
 * and added in one fused multiply-add, rows in order, a group's columns at a time.
 * `words`: SIGN_SUM_BLOCK / 64 + 2 words of scratch. Portable. */
static void sign_sum_block(const Py_buffer *signs, Py_ssize_t bit, Py_ssize_t phase,
                           Py_ssize_t group, const Py_buffer *scales, const int64_t *rows,
                           const double *weights, Py_ssize_t k, Py_ssize_t c0, Py_ssize_t c1,
                           double *acc, uint64_t *words)
{
    const Py_ssize_t s0 = scales->strides[0] / 4, s1 = scales->strides[1] / 4;
    for (Py_ssize_t t = 0; t < k; t++) {
        row_words((const uint8_t *)signs->buf + rows[t] * signs->strides[0], signs->shape[1],
                  bit, c0, c1, words);
        const float *scale = (const float *)scales->buf + rows[t] * s0;
        for (Py_ssize_t c = c0; c < c1;) {
            const Py_ssize_t g = (phase + c) / group;
            const Py_ssize_t end = (g + 1) * group - phase < c1 ? (g + 1) * group - phase : c1;
            const double s = (double)scale[g * s1];
            for (Py_ssize_t j = c; j < end; j++) {
                const double x = (words[(j - c0) >> 6] >> ((j - c0) & 63)) & 1 ? s : -s;
                acc[j - c0] = weights ? fma(weights[t], x, acc[j - c0]) : acc[j - c0] + x;
            }
            c = end;
        }
    }
}

#ifdef PASSES_HAVE_X86
/* The same with AVX-512, 8 values of one group per step (the same bits). */
AVX512 static void sign_sum_block512(const Py_buffer *signs, Py_ssize_t bit, Py_ssize_t phase,
                                     Py_ssize_t group, const Py_buffer *scales,
                                     const int64_t *rows, const double *weights, Py_ssize_t k,
                                     Py_ssize_t c0, Py_ssize_t c1, double *acc, uint64_t *words)
{
    const Py_ssize_t s0 = scales->strides[0] / 4, s1 = scales->strides[1] / 4;
    for (Py_ssize_t t = 0; t < k; t++) {
        row_words((const uint8_t *)signs->buf + rows[t] * signs->strides[0], signs->shape[1],
                  bit, c0, c1, words);
        const float *scale = (const float *)scales->buf + rows[t] * s0;
        const __m512d w = _mm512_set1_pd(weights ? weights[t] : 1.0);
        for (Py_ssize_t c = c0; c < c1;) {
            const Py_ssize_t g = (phase + c) / group;
            const Py_ssize_t end = (g + 1) * group - phase < c1 ? (g + 1) * group - phase : c1;
            const double s = (double)scale[g * s1];
            const __m512d plus = _mm512_set1_pd(s), minus = _mm512_set1_pd(-s);
            Py_ssize_t j = c;
            for (; j + 8 <= end; j += 8) {
                const __mmask8 set = (__mmask8)byte_at(words, j - c0);
                const __m512d x = _mm512_mask_blend_pd(set, minus, plus);
                const __m512d a = _mm512_loadu_pd(acc + (j - c0));
                _mm512_storeu_pd(acc + (j - c0),
                                 weights ? _mm512_fmadd_pd(w, x, a) : _mm512_add_pd(a, x));
            }
            for (; j < end; j++) {
                const double x = (words[(j - c0) >> 6] >> ((j - c0) & 63)) & 1 ? s : -s;
                acc[j - c0] = weights ? fma(weights[t], x, acc[j - c0]) : acc[j - c0] + x;
            }
            c = end;
        }
    }
}
#endif

PyDoc_STRVAR(sign_sum_doc,
             "sign_sum(signs, bit, m, phase, group, scales, rows, weights, out, vector=True)\n\n"
             "out (m,) float64 <- the sum over t of the values of row rows[t] (int64) of m\n"
             "BitDelta values (bits bit .. of signs (n, bytes) uint8, most significant first:\n"
             "+scale where set, else -scale; the first value being value phase of its group;\n"
             "scales (n, groups) float32): each added, rows in order (weights None; with\n"
             "float16 scales every sum is exact), or times weights[t] (float64) in one fused\n"
             "multiply-add per row; 8 values per step with AVX-512 (`GRAM`) unless vector is\n"
             "False, the same bits. The GIL is released.");

static PyObject *passes_sign_sum(PyObject *self, PyObject *args)
{
    PyObject *objs[5];
    Py_ssize_t bit, m, phase, group;
    int vector = 1;
    if (!PyArg_ParseTuple(args, "OnnnnOOOO|p:sign_sum", &objs[0], &bit, &m, &phase, &group,
                          &objs[1], &objs[2], &objs[3], &objs[4], &vector))
        return NULL;
    const int weighted = objs[3] != Py_None;
    Py_buffer v[5];
    const int modes[5] = {PyBUF_STRIDES | PyBUF_FORMAT, PyBUF_STRIDES | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_FORMAT, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT};
    int got = 0;
    for (; got < 5; got++) {
        if (got == 3 && !weighted)
            continue;
        if (PyObject_GetBuffer(objs[got], &v[got], modes[got]) < 0)
            break;
    }
    PyObject *result = NULL;
    if (got == 5) {
        const Py_ssize_t n = v[0].ndim == 2 ? v[0].shape[0] : -1, k = v[2].len / 8;
        int ok = n >= 1 && sign_format(&v[0]) == 'B' && v[0].strides[1] == 1 &&
                 sign_format(&v[1]) == 'f' && v[1].ndim == 2 && v[1].shape[0] == n &&
                 v[1].strides[0] % 4 == 0 && v[1].strides[1] % 4 == 0 && group >= 1 &&
                 phase >= 0 && phase < group && m >= 1 && bit >= 0 &&
                 bit + m <= 8 * v[0].shape[1] && v[1].shape[1] == (phase + m + group - 1) / group &&
                 sign_format(&v[2]) == 'Q' && (!weighted || (sign_format(&v[3]) == 'd' &&
                                                             v[3].len == 8 * k)) &&
                 sign_format(&v[4]) == 'd' && v[4].len == 8 * m;
        const int64_t *rows = (const int64_t *)v[2].buf;
        for (Py_ssize_t t = 0; t < k && ok; t++)
            ok = rows[t] >= 0 && rows[t] < n;
        double *acc = ok ? PyMem_RawMalloc((size_t)(SIGN_SUM_BLOCK + SIGN_SUM_BLOCK / 64 + 2) * 8)
                         : NULL;
        if (!ok) {
            PyErr_SetString(PyExc_ValueError,
                            "sign_sum needs signs (n, bytes) uint8 holding bits [bit, bit + m), "
                            "scales (n, groups) float32, rows (k,) int64 in [0, n), weights "
                            "None or (k,) float64, out (m,) float64");
        } else if (acc == NULL) {
            PyErr_NoMemory();
        } else {
            const double *w = weighted ? (const double *)v[3].buf : NULL;
            double *out = (double *)v[4].buf;
            uint64_t *words = (uint64_t *)(acc + SIGN_SUM_BLOCK);
#ifdef PASSES_HAVE_X86
            vector = vector && have_avx512;
#else
            vector = 0;
#endif
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t c0 = 0; c0 < m; c0 += SIGN_SUM_BLOCK) {
                const Py_ssize_t c1 = m - c0 < SIGN_SUM_BLOCK ? m : c0 + SIGN_SUM_BLOCK;
                memset(acc, 0, (size_t)SIGN_SUM_BLOCK * 8);
#ifdef PASSES_HAVE_X86
                if (vector)
                    sign_sum_block512(&v[0], bit, phase, group, &v[1], rows, w, k, c0, c1, acc,
                                      words);
                else
#endif
                    sign_sum_block(&v[0], bit, phase, group, &v[1], rows, w, k, c0, c1, acc,
                                   words);
                memcpy(out + c0, acc, (size_t)(c1 - c0) * 8);
            }
            Py_END_ALLOW_THREADS
            PyMem_RawFree(acc);
            result = Py_NewRef(Py_None);
        }
    }
    for (int i = 0; i < got; i++)
        if (i != 3 || weighted)
            PyBuffer_Release(&v[i]);
    return result;
}

static PyMethodDef passes_methods[] = {
    {"row_sum", passes_row_sum, METH_VARARGS, row_sum_doc},
    {"gram", passes_gram, METH_VARARGS, gram_doc},
    {"sign_pack", passes_sign_pack, METH_VARARGS, sign_pack_doc},
    {"sign_distances", passes_sign_distances, METH_VARARGS, sign_distances_doc},
    {"sign_sum", passes_sign_sum, METH_VARARGS, sign_sum_doc},
    {NULL, NULL, 0, NULL},
};

static int passes_exec(PyObject *module)
{
#ifdef PASSES_HAVE_X86
    __builtin_cpu_init();
    have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("fma");
    have_popcount512 = have_avx512 && __builtin_cpu_supports("avx512vpopcntdq");
#endif
    if (PyModule_AddIntConstant(module, "POPCOUNT", have_popcount512) < 0)
        return -1;
    return PyModule_AddIntConstant(module, "GRAM", have_avx512);
}

static PyModuleDef_Slot passes_slots[] = {
    {Py_mod_exec, passes_exec},
    {0, NULL},
};

static struct PyModuleDef passes_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zoo_gym.aggregation._passes",
    .m_doc = "Sums of rows and shifted Gram products of column chunks (CPU).",
    .m_size = 0,
    .m_methods = passes_methods,
    .m_slots = passes_slots,
};

PyMODINIT_FUNC PyInit__passes(void)
{
    return PyModuleDef_Init(&passes_module);
}
