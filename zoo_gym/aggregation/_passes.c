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
 * Compile without -ffast-math and with -ffp-contract=off: the float64 sums must be added in
 * the order stated above.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../core/_floats.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PASSES_HAVE_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
#endif

#define SUM_BLOCK 512      /* columns of a block of float64 sums (4 KiB) */
#define GRAM_BLOCK 1024     /* columns of the shifted scratch, at most */
#define GRAM_SCRATCH (1 << 20) /* bytes of the shifted scratch, at most (it stays in L2) */
#define LINE 64

static int have_avx512 = 0;

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

static PyMethodDef passes_methods[] = {
    {"row_sum", passes_row_sum, METH_VARARGS, row_sum_doc},
    {"gram", passes_gram, METH_VARARGS, gram_doc},
    {NULL, NULL, 0, NULL},
};

static int passes_exec(PyObject *module)
{
#ifdef PASSES_HAVE_X86
    __builtin_cpu_init();
    have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("fma");
#endif
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
