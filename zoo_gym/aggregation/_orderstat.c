/* Per-coordinate median, trimmed mean and Bulyan's closest-to-median mean of a column chunk
 * (n, c) in one pass over it (CPU).
 *
 * The chunk's rows are the n updates, each contiguous along the columns (its rows may lie
 * any fixed number of bytes apart). For every tile of W consecutive columns (one vector: 16
 * float32 with AVX-512, 8 with AVX2, 4 in the portable kernel, half as many float64), the n row
 * vectors are copied into a cache-resident tile (each row's loads requested PREFETCH_TILES
 * tiles ahead: n streams are more than the hardware prefetcher follows) and sorted by a sorting
 * network with vector min/max, which sorts the W columns at once without a transpose:
 * Batcher's odd-even merge sort for the next power of two, with the wires above n dropped (an
 * input padded with +inf there would keep them, so their comparators never act), and with the
 * comparators dropped that cannot reach the sorted positions the rule reads (`network`).
 * While the tile is in cache the kernel forms the results of its columns:
 *
 * - median: the mean of the values at sorted positions lo = (n - 1) / 2 and hi = n / 2, their
 *   sum formed in float64, halved, plus 0.0 (so that a zero median is +0.0 whatever the signs
 *   of the zeros in the column), rounded to float32; each row's count of columns in which its
 *   value lies in [v_lo, v_hi] (it holds a middle position);
 * - trimmed mean (f >= 1): the sorted values at positions f .. n - f - 1, each converted to
 *   float64 and summed in the order of PyTorch's CPU `torch.sum` over a contiguous float64 row
 *   (see `torch_sum`), divided by n - 2f and rounded to float32; each row's count of columns
 *   in which its value lies outside [v_f, v_(n-f-1)] (it was dropped);
 * - Bulyan's second step (`closest`, on the rows Krum chose, read where they lie): the mean of
 *   the beta values closest to the median. The beta-th smallest distance from the median is
 *   the least, over the windows of beta consecutive sorted values, of the greater distance of
 *   the window's two ends (the beta closest values lie in one window), so only the sort is
 *   needed; the kept values are then added over the rows in order in float64. Each row's
 *   count of columns in which it was kept.
 *
 * A column whose window of sorted positions (the middle ones, or the kept ones) starts or ends
 * inside a run of equal values (a tie) leaves which rows hold those positions to shares: each
 * member of a run covering positions [a, b) gets |[a, b) n window| / (b - a), as
 * `_select.window_shares` defines them. Such a column is left out of the counts; the kernel
 * counts, per tied column, the values below and up to each end of the window, and at the end of
 * the chunk sums each row's shares over the tied columns, in column order and in the order of
 * torch.sum over a row (as `_select` sums the matrix of shares it forms). A chunk that holds a
 * NaN is handed back (-1): the caller runs it through the NumPy steps.
 *
 * For BitDelta columns with float16 scales, `sign_rule` forms the same results, counts and tie
 * shares without sorting the values or decoding them: it sorts each group's n scales once (a
 * radix sort on their float16 bits) and reads each column's sorted positions off its sign bits
 * in that order (see `sign_cuts_group` and `zoo_gym.aggregation._signs`). Its tie shares go
 * out as one code per row and tied column, summed per row by `tie_rows`. Two kernels give the
 * same bits: a portable one, and an AVX-512 one taking 32 columns per vector in 16-bit lanes.
 *
 * Three kernels perform the same operations: a portable one (GCC/Clang vector extensions,
 * lowered to whatever the target has) and, on x86 with GCC or Clang, AVX2 and AVX-512 ones
 * chosen at run time from what the CPU supports. Only the machine instructions differ. The
 * file must be compiled without -ffast-math (which would reorder the float64 additions) and
 * with -ffp-contract=off (which keeps a multiply and an add from being fused).
 */

#ifndef ORDERSTAT_TEMPLATE

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../core/_bits.h"
#include "../core/_floats.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ORDERSTAT_HAVE_X86 1
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
/* vectors pass between always-inlined helpers only: no call ABI is involved */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define LANE_BYTES 64 /* the most bytes of one tile row (AVX-512: 16 float32 or 8 float64) */
#define PREFETCH_TILES 8 /* tiles ahead that each row's loads are requested */

/* Vectors of each width B bytes: a tile row of float32 (f32_B) or float64 (f64_B) values, the
 * comparison masks of the same width (i32_B, i64_B), and half a row of float32 (h32_B), which
 * float64 arithmetic takes half by half so that no vector is wider than the machine's. */
#define VECTORS(B)                                                                             \
    typedef float f32_##B __attribute__((vector_size(B)));                                     \
    typedef int32_t i32_##B __attribute__((vector_size(B)));                                   \
    typedef float h32_##B __attribute__((vector_size(B / 2)));                                 \
    typedef double f64_##B __attribute__((vector_size(B)));                                    \
    typedef int64_t i64_##B __attribute__((vector_size(B)));
VECTORS(16) /* portable: SSE2, NEON, ... */
VECTORS(32) /* AVX2 */
VECTORS(64) /* AVX-512 */

enum { MEDIAN = 0, TRIMMED = 1, CLOSEST = 2 };

/* Row r of a chunk: rows[r] of x where the kernel reads chosen rows, else r */
#define ROW(rows, r) ((rows) == NULL ? (Py_ssize_t)(r) : (Py_ssize_t)(rows)[r])

/* A kernel runs one rule over a chunk: see `chunk` in the template below. */
typedef Py_ssize_t (*kernel_fn)(const char *x, Py_ssize_t stride, const int64_t *rows, int n,
                                Py_ssize_t c, int f, const int32_t *pairs, Py_ssize_t npairs,
                                float *out, int64_t *counts, double *shares, void *work);

/* A column whose window of sorted positions [p, q) starts or ends inside a run of equal
 * values: the values at its ends and the share of the window each member of their runs
 * holds (`_select.window_shares`). */
typedef struct {
    double first, last, s_first, s_last;
    Py_ssize_t col;
    double med; /* Bulyan: the column's median, from which the distances are taken */
} tied_column;

/* The additions of PyTorch's `multi_row_sum` cascade: a level step of 2^power quads. */
static int level_power(Py_ssize_t quads)
{
    int log = 0;
    while (((Py_ssize_t)1 << log) < quads)
        log++;
    return log / 4 > 4 ? log / 4 : 4;
}

/* The share of the window [p, q) that each of a run of equal values at sorted positions
 * [below, upto) holds: |[below, upto) n [p, q)| / (upto - below), divided in float64. */
static double overlap(Py_ssize_t below, Py_ssize_t upto, int p, int q)
{
    const Py_ssize_t from = below > p ? below : p, to = upto < q ? upto : q;
    return (double)(to > from ? to - from : 0) / (double)(upto - below);
}

/* The float64 sum of x[0 .. k - 1] with the additions of PyTorch's CPU `torch.sum` over a
 * contiguous float64 row (`cascade_sum` in aten/src/ATen/native/cpu/SumKernel.cpp: its AVX2
 * kernel, 4-lane vectors, 4 of them at a time): value m of each quad of 16 values goes to
 * accumulator m; every 2^p quads (p = max(4, ceil(log2(quads)) / 4)) the accumulators cascade
 * into up to three levels above (`multi_row_sum`); at the end the levels are added into the
 * first in turn, the 1 to 3 vectors after the last whole quad into accumulators 0..3,
 * accumulators 4..15 into 0..3 a vector at a time, and the sum is 0.0 plus the values after
 * the last whole vector, then plus accumulators 0, 1, 2 and 3. Below 4 values: 0.0 plus the
 * values in order (`scalar_inner_sum`, the same additions). */
static double torch_sum(const double *x, Py_ssize_t k)
{
    double acc[4][16];
    memset(acc, 0, sizeof(acc));
    const Py_ssize_t vectors = k / 4, quads = vectors / 4;
    const int power = level_power(quads);
    const Py_ssize_t step = (Py_ssize_t)1 << power, mask = step - 1;
    Py_ssize_t i = 0;
    while (i + step <= quads) {
        for (Py_ssize_t j = 0; j < step; j++, i++)
            for (int m = 0; m < 16; m++)
                acc[0][m] += x[16 * i + m];
        for (int level = 1; level < 4; level++) {
            for (int m = 0; m < 16; m++) {
                acc[level][m] += acc[level - 1][m];
                acc[level - 1][m] = 0.0;
            }
            if ((i & (mask << (level * power))) != 0)
                break;
        }
    }
    for (; i < quads; i++)
        for (int m = 0; m < 16; m++)
            acc[0][m] += x[16 * i + m];
    for (int level = 1; level < 4; level++)
        for (int m = 0; m < 16; m++)
            acc[0][m] += acc[level][m];
    for (Py_ssize_t v = quads * 4; v < vectors; v++)
        for (int l = 0; l < 4; l++)
            acc[0][l] += x[4 * v + l];
    for (int m = 4; m < 16; m++)
        acc[0][m % 4] += acc[0][m];
    double total = 0.0;
    for (Py_ssize_t r = vectors * 4; r < k; r++)
        total += x[r];
    for (int l = 0; l < 4; l++)
        total += acc[0][l];
    return total;
}

/* The instantiations: each dtype (float32, float64) for each instruction set. */
#define ORDERSTAT_TEMPLATE 1

#define ATTR
#define T float
#define V f32_16
#define VI i32_16
#define VD f64_16
#define VH h32_16
#define SUFFIX f32_portable
#include "_orderstat.c" /* this file, as the template */
#define T double
#define V f64_16
#define VI i64_16
#define VD f64_16
#define VH f64_16
#define SUFFIX f64_portable
#include "_orderstat.c"
#undef ATTR

#ifdef ORDERSTAT_HAVE_X86
#define ATTR __attribute__((target("avx2")))
#define VMIN(x, y) ((V)_mm256_min_ps((__m256)(x), (__m256)(y)))
#define VMAX(x, y) ((V)_mm256_max_ps((__m256)(x), (__m256)(y)))
#define T float
#define V f32_32
#define VI i32_32
#define VD f64_32
#define VH h32_32
#define SUFFIX f32_avx2
#include "_orderstat.c"
#define VMIN(x, y) ((V)_mm256_min_pd((__m256d)(x), (__m256d)(y)))
#define VMAX(x, y) ((V)_mm256_max_pd((__m256d)(x), (__m256d)(y)))
#define T double
#define V f64_32
#define VI i64_32
#define VD f64_32
#define VH f64_32
#define SUFFIX f64_avx2
#include "_orderstat.c"
#undef ATTR

#define ATTR __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))
/* AVX-512 compares into mask registers: the default INSIDE would go lane by lane */
#define VMIN(x, y) ((V)_mm512_min_ps((__m512)(x), (__m512)(y)))
#define VMAX(x, y) ((V)_mm512_max_ps((__m512)(x), (__m512)(y)))
#define INSIDE(v, low, high)                                                                   \
    ((VI)_mm512_movm_epi32(_mm512_cmp_ps_mask((__m512)(v), (__m512)(low), _CMP_GE_OQ) &        \
                           _mm512_cmp_ps_mask((__m512)(v), (__m512)(high), _CMP_LE_OQ)))
#define AVX512_CMP(a, b, op) ((VI)_mm512_movm_epi32(_mm512_cmp_ps_mask((__m512)(a), (__m512)(b), op)))
#define LESS(a, b) AVX512_CMP(a, b, _CMP_LT_OQ)
#define LESS_EQ(a, b) AVX512_CMP(a, b, _CMP_LE_OQ)
#define EQUAL(a, b) AVX512_CMP(a, b, _CMP_EQ_OQ)
#define T float
#define V f32_64
#define VI i32_64
#define VD f64_64
#define VH h32_64
#define SUFFIX f32_avx512
#include "_orderstat.c"
#define VMIN(x, y) ((V)_mm512_min_pd((__m512d)(x), (__m512d)(y)))
#define VMAX(x, y) ((V)_mm512_max_pd((__m512d)(x), (__m512d)(y)))
#define INSIDE(v, low, high)                                                                   \
    ((VI)_mm512_movm_epi64(_mm512_cmp_pd_mask((__m512d)(v), (__m512d)(low), _CMP_GE_OQ) &      \
                           _mm512_cmp_pd_mask((__m512d)(v), (__m512d)(high), _CMP_LE_OQ)))
#define AVX512_CMP(a, b, op)                                                                   \
    ((VI)_mm512_movm_epi64(_mm512_cmp_pd_mask((__m512d)(a), (__m512d)(b), op)))
#define LESS(a, b) AVX512_CMP(a, b, _CMP_LT_OQ)
#define LESS_EQ(a, b) AVX512_CMP(a, b, _CMP_LE_OQ)
#define EQUAL(a, b) AVX512_CMP(a, b, _CMP_EQ_OQ)
#define T double
#define V f64_64
#define VI i64_64
#define VD f64_64
#define VH f64_64
#define SUFFIX f64_avx512
#include "_orderstat.c"
#undef ATTR
#endif

#undef ORDERSTAT_TEMPLATE

/* ---- the module ------------------------------------------------------------------------ */

typedef struct {
    const char *name;
    kernel_fn fns[2][3]; /* [dtype: float32, float64][rule: median, trimmed, closest] */
} kernel_set;

static const kernel_set kernel_sets[] = {
    {"portable",
     {{median_f32_portable, trimmed_f32_portable, closest_f32_portable},
      {median_f64_portable, trimmed_f64_portable, closest_f64_portable}}},
#ifdef ORDERSTAT_HAVE_X86
    {"avx2",
     {{median_f32_avx2, trimmed_f32_avx2, closest_f32_avx2},
      {median_f64_avx2, trimmed_f64_avx2, closest_f64_avx2}}},
    {"avx512",
     {{median_f32_avx512, trimmed_f32_avx512, closest_f32_avx512},
      {median_f64_avx512, trimmed_f64_avx512, closest_f64_avx512}}},
#endif
};
#define N_KERNELS ((int)(sizeof(kernel_sets) / sizeof(kernel_sets[0])))
static int usable[N_KERNELS];
static int best = 0;

/* Batcher's odd-even merge sort (Knuth, TAOCP 5.3.4, algorithm M) for the next power of two
 * above n wires, without the comparators on wires >= n, then without those that cannot
 * reach wires lo .. hi: the (i, j) pairs, i < j, in the order they act. */
static PyObject *orderstat_network(PyObject *self, PyObject *args)
{
    Py_ssize_t n, lo, hi;
    if (!PyArg_ParseTuple(args, "nnn:network", &n, &lo, &hi))
        return NULL;
    if (n < 1 || n > (1 << 24) || lo < 0 || hi < lo || hi >= n) {
        PyErr_Format(PyExc_ValueError,
                     "network needs 1 <= n <= 2^24 and 0 <= lo <= hi < n, got n=%zd lo=%zd "
                     "hi=%zd",
                     n, lo, hi);
        return NULL;
    }
    Py_ssize_t wires = 1, log = 0;
    while (wires < n) {
        wires <<= 1;
        log++;
    }
    /* Batcher's count is (log^2 - log + 4) 2^(log - 2) - 1 */
    const Py_ssize_t bound = (log * log - log + 4) * wires / 4 + 1;
    int32_t *pairs = PyMem_Malloc(sizeof(int32_t) * 2 * (size_t)bound);
    uint8_t *needed = PyMem_Calloc((size_t)n, 1);
    if (pairs == NULL || needed == NULL) {
        PyMem_Free(pairs);
        PyMem_Free(needed);
        return PyErr_NoMemory();
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t p = wires / 2; p >= 1; p /= 2) {
        Py_ssize_t q = wires / 2, r = 0, d = p;
        for (;;) {
            for (Py_ssize_t i = 0; i + d < n; i++) {
                if ((i & p) == r) {
                    pairs[2 * count] = (int32_t)i;
                    pairs[2 * count + 1] = (int32_t)(i + d);
                    count++;
                }
            }
            if (q == p)
                break;
            d = q - p;
            q /= 2;
            r = p;
        }
    }
    for (Py_ssize_t w = lo; w <= hi; w++)
        needed[w] = 1;
    Py_ssize_t kept = 0;
    for (Py_ssize_t k = count - 1; k >= 0; k--) { /* backwards: keep, then compact */
        const int32_t i = pairs[2 * k], j = pairs[2 * k + 1];
        if (needed[i] || needed[j]) {
            needed[i] = needed[j] = 1;
            pairs[2 * (count - 1 - kept)] = i;
            pairs[2 * (count - 1 - kept) + 1] = j;
            kept++;
        }
    }
    PyObject *result = PyBytes_FromStringAndSize((const char *)(pairs + 2 * (count - kept)),
                                                 (Py_ssize_t)(2 * kept * sizeof(int32_t)));
    PyMem_Free(pairs);
    PyMem_Free(needed);
    return result;
}

static int kernel_index(const char *name)
{
    if (name == NULL)
        return best;
    for (int k = 0; k < N_KERNELS; k++) {
        if (strcmp(name, kernel_sets[k].name) == 0) {
            if (usable[k])
                return k;
            PyErr_Format(PyExc_ValueError, "kernel %s is not supported by this CPU", name);
            return -1;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown kernel %s; see `kernels`", name);
    return -1;
}

/* The element format of a buffer: 'f' (float32), 'd' (float64), 'q' (int64), 'B' or 0. */
static char format_of(const Py_buffer *view)
{
    const char *f = view->format == NULL ? "B" : view->format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (f[1] != '\0')
        return 0;
    if ((f[0] == 'f' && view->itemsize == 4) || (f[0] == 'd' && view->itemsize == 8))
        return f[0];
    if ((f[0] == 'q' || f[0] == 'l') && view->itemsize == 8)
        return 'q';
    if ((f[0] == 'B' || f[0] == '?') && view->itemsize == 1)
        return 'B';
    return 0;
}

/* Checks of the arguments; 0 when they are usable, -1 with an exception set otherwise. */
static int check_args(const Py_buffer *x, Py_ssize_t n, Py_ssize_t f, const Py_buffer *pairs,
                      const Py_buffer *out, const Py_buffer *counts, const Py_buffer *shares,
                      int rule)
{
    const char fx = format_of(x);
    if (x->ndim != 2 || (fx != 'f' && fx != 'd') || x->strides[1] != x->itemsize) {
        PyErr_SetString(PyExc_TypeError,
                        "x must be a 2-d float32 or float64 array (n, c), each row contiguous");
        return -1;
    }
    const Py_ssize_t c = x->shape[1];
    if (format_of(out) != 'f' || format_of(counts) != 'q' || format_of(shares) != 'd' ||
        out->len / 4 < c || counts->len / 8 != n || shares->len / 8 != n) {
        PyErr_Format(PyExc_TypeError,
                     "out must be float32 (>= %zd,), counts int64 (%zd,), shares float64 (%zd,)",
                     c, n, n);
        return -1;
    }
    if (n < 1 || n > (1 << 24) || (rule == TRIMMED && (f < 1 || 2 * f >= n))) {
        PyErr_Format(PyExc_ValueError, "n = %zd rows and f = %zd: need n >= 1 and 1 <= f < n / 2",
                     n, f);
        return -1;
    }
    if (rule == CLOSEST && (f < 1 || f > n)) {
        PyErr_Format(PyExc_ValueError, "n = %zd rows and beta = %zd: need 1 <= beta <= n", n, f);
        return -1;
    }
    const int32_t *p = (const int32_t *)pairs->buf;
    for (Py_ssize_t k = 0; k < pairs->len / 4; k++) {
        if (p[k] < 0 || p[k] >= n || (k % 2 == 1 && p[k - 1] >= p[k])) {
            PyErr_SetString(PyExc_ValueError, "pairs is not a network for these n rows");
            return -1;
        }
    }
    if (pairs->len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "pairs must hold int32 (i, j) pairs");
        return -1;
    }
    return 0;
}

/* Bytes of the work buffer a kernel needs for n rows and c columns: the tile, its unsorted
 * copy (n vectors each) and the per-lane counts (up to 2n vectors: `closest` counts in
 * float64-wide lanes), the tied columns and a row of their shares (c each), and room to align
 * the start to 64 bytes. The caller keeps one per thread: a
 * kernel allocates nothing (blocks freed from several threads would raise glibc's mmap
 * threshold, and the heap would then keep the decoded chunks' memory). */
static Py_ssize_t work_size(Py_ssize_t n, Py_ssize_t c)
{
    return (4 * n + 1) * LANE_BYTES + c * (Py_ssize_t)(sizeof(tied_column) + sizeof(double));
}

static int check_work(const Py_buffer *work, Py_ssize_t n, Py_ssize_t c)
{
    if (work->len < work_size(n, c)) {
        PyErr_Format(PyExc_ValueError, "work holds %zd bytes; %zd rows x %zd columns need %zd",
                     work->len, n, c, work_size(n, c));
        return -1;
    }
    return 0;
}

static PyObject *orderstat_work_size(PyObject *self, PyObject *args)
{
    Py_ssize_t n, c;
    if (!PyArg_ParseTuple(args, "nn:work_size", &n, &c))
        return NULL;
    if (n < 0 || c < 0 || n > (1 << 24) || c > PY_SSIZE_T_MAX / 64) {
        PyErr_Format(PyExc_ValueError, "work_size needs 0 <= n <= 2^24 rows, c >= 0 columns");
        return NULL;
    }
    return PyLong_FromSsize_t(work_size(n, c));
}

/* The chosen rows of `closest` (None: all rows of x): an int64 array of indices into x's
 * rows into `view`; their number, or -1 with an exception set */
static Py_ssize_t chosen_rows(PyObject *rows_obj, const Py_buffer *x, Py_buffer *view)
{
    if (rows_obj == Py_None)
        return x->ndim == 2 ? x->shape[0] : 0;
    if (PyObject_GetBuffer(rows_obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const int64_t *r = (const int64_t *)view->buf;
    const Py_ssize_t k = view->len / 8;
    int bad = format_of(view) != 'q' || x->ndim != 2;
    for (Py_ssize_t i = 0; i < k && !bad; i++)
        bad = r[i] < 0 || r[i] >= x->shape[0];
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "rows must be int64 indices of x's rows");
        PyBuffer_Release(view);
        return -1;
    }
    return k;
}

static PyObject *run_rule(PyObject *args, int rule)
{
    PyObject *x_obj, *pairs_obj, *out_obj, *counts_obj, *shares_obj, *work_obj;
    PyObject *rows_obj = Py_None;
    Py_ssize_t f = 0;
    const char *kernel = NULL;
    if (rule == MEDIAN) {
        if (!PyArg_ParseTuple(args, "OOOOOO|z:median", &x_obj, &pairs_obj, &out_obj,
                              &counts_obj, &shares_obj, &work_obj, &kernel))
            return NULL;
    } else if (rule == TRIMMED) {
        if (!PyArg_ParseTuple(args, "OnOOOOO|z:trimmed", &x_obj, &f, &pairs_obj, &out_obj,
                              &counts_obj, &shares_obj, &work_obj, &kernel))
            return NULL;
    } else if (!PyArg_ParseTuple(args, "OnOOOOO|zO:closest", &x_obj, &f, &pairs_obj, &out_obj,
                                 &counts_obj, &shares_obj, &work_obj, &kernel, &rows_obj)) {
        return NULL;
    }
    const int k = kernel_index(kernel);
    if (k < 0)
        return NULL;
    Py_buffer views[6];
    PyObject *objs[6] = {x_obj, pairs_obj, out_obj, counts_obj, shares_obj, work_obj};
    const int modes[6] = {PyBUF_STRIDES | PyBUF_FORMAT, PyBUF_SIMPLE,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE};
    int got = 0;
    for (; got < 6; got++)
        if (PyObject_GetBuffer(objs[got], &views[got], modes[got]) < 0)
            break;
    PyObject *result = NULL;
    Py_buffer rows_view = {0};
    const Py_ssize_t n = got == 6 ? chosen_rows(rows_obj, &views[0], &rows_view) : -1;
    if (n >= 0 && check_args(&views[0], n, f, &views[1], &views[2], &views[3], &views[4], rule) == 0 &&
        check_work(&views[5], n, views[0].shape[1]) == 0) {
        const Py_ssize_t c = views[0].shape[1];
        const int64_t *rows = rows_obj == Py_None ? NULL : (const int64_t *)rows_view.buf;
        const int dtype = format_of(&views[0]) == 'd';
        /* within `work`, 64-byte aligned: see work_size */
        char *work = (char *)views[5].buf;
        work += (LANE_BYTES - (uintptr_t)work % LANE_BYTES) % LANE_BYTES;
        kernel_fn fn = kernel_sets[k].fns[dtype][rule];
        Py_ssize_t tied;
        Py_BEGIN_ALLOW_THREADS
        tied = fn((const char *)views[0].buf, views[0].strides[0], rows, (int)n, c, (int)f,
                  (const int32_t *)views[1].buf, views[1].len / 8, (float *)views[2].buf,
                  (int64_t *)views[3].buf, (double *)views[4].buf, work);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(tied);
    }
    if (rows_view.obj != NULL)
        PyBuffer_Release(&rows_view);
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    return result;
}

static PyObject *orderstat_median(PyObject *self, PyObject *args)
{
    return run_rule(args, MEDIAN);
}

static PyObject *orderstat_trimmed(PyObject *self, PyObject *args)
{
    return run_rule(args, TRIMMED);
}

static PyObject *orderstat_closest(PyObject *self, PyObject *args)
{
    return run_rule(args, CLOSEST);
}

/* ---- order statistics from the sign bits of BitDelta columns ----------------------------- */

/* One group's rows in ascending order of scale (stable), with what the kernels read of it. */
typedef struct {
    int n;
    int32_t *order;   /* n: the rows by ascending scale */
    float *ascending; /* n: their scales (a zero as +0.0) */
    int64_t *units;   /* n: the same scales in units of 2^-24 (integers below 2^40) */
    int32_t *run_lo;  /* n: the first place of each place's run of equal scales */
    int32_t *run_hi;  /* n: its last place */
    int32_t *spare;   /* n: the order after the first pass of the sort */
} scale_order;

/* The float16 bits of a scale (a float16 value >= 0 held as float32, -0.0 taken as 0), or -1
 * if it is not one. */
static int half_key(float s)
{
    uint32_t b;
    memcpy(&b, &s, 4);
    if (b == 0x80000000u)
        b = 0;
    if (b > 0x477FE000u) /* negative, above 65504, Inf or NaN */
        return -1;
    const double u = (double)s * 16777216.0;
    if ((double)(int64_t)u != u)
        return -1; /* not a multiple of 2^-24 */
    if (u < 1024.0)
        return (int)u; /* zero and the subnormals: m x 2^-24 has the bits m */
    if (b & 0x1fffu)
        return -1; /* more than float16's 10 bits of mantissa */
    return (int)((((b >> 23) - 112) << 10) | ((b >> 13) & 0x3ffu));
}

/* The sort keys of groups g0 .. g0 + count - 1 of scales (n, groups) float32, read row by
 * row: keys[(g - g0) n + i] the float16 bits of row i's scale of group g. Returns -1 if one
 * is not a float16 value >= 0. */
static int scale_keys(const Py_buffer *scales, Py_ssize_t g0, Py_ssize_t count, uint16_t *keys)
{
    const Py_ssize_t n = scales->shape[0];
    const Py_ssize_t s0 = scales->strides[0] / 4, s1 = scales->strides[1] / 4;
    const float *base = (const float *)scales->buf + g0 * s1;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (Py_ssize_t g = 0; g < count; g++) {
            const int key = half_key(base[i * s0 + g * s1]);
            if (key < 0)
                return -1;
            keys[g * n + i] = (uint16_t)key;
        }
    }
    return 0;
}

/* Sorts one group's rows by their keys (n) into `so`, by a stable two-pass radix sort. */
static void sort_scales(const uint16_t *restrict keys, scale_order *so)
{
    const int n = so->n;
    int32_t low[257] = {0}, high[257] = {0};
    for (int i = 0; i < n; i++) {
        low[(keys[i] & 255) + 1]++;
        high[(keys[i] >> 8) + 1]++;
    }
    for (int k = 0; k < 256; k++) {
        low[k + 1] += low[k];
        high[k + 1] += high[k];
    }
    for (int i = 0; i < n; i++)
        so->spare[low[keys[i] & 255]++] = i;
    for (int k = 0; k < n; k++) {
        const int32_t i = so->spare[k];
        so->order[high[keys[i] >> 8]++] = i;
    }
    for (int r = 0; r < n; r++) {
        const uint16_t key = keys[so->order[r]];
        so->ascending[r] = half_to_float(key);
        so->units[r] = (int64_t)((double)so->ascending[r] * 16777216.0);
        so->run_lo[r] = r > 0 && key == keys[so->order[r - 1]] ? so->run_lo[r - 1] : r;
    }
    for (int r = n - 1; r >= 0; r--) {
        const int same = r < n - 1 && keys[so->order[r]] == keys[so->order[r + 1]];
        so->run_hi[r] = same ? so->run_hi[r + 1] : r;
    }
}

/* What one call of `sign_rule` shares among its groups. */
typedef struct {
    const uint8_t *signs;  /* n rows of packed sign bits (set: +scale), most significant first */
    Py_ssize_t stride;     /* bytes from one row to the next */
    Py_ssize_t nbytes;     /* bytes of a row */
    int n, p, q, rule;     /* the window [p, q) of sorted positions */
    int64_t *counts;       /* (n,): each row's count over the untied columns */
    uint8_t *codes;        /* (n, cap): each row's code of its share in the t-th tied column */
    Py_ssize_t cap;
    double *table;         /* 4 per tied column: the shares the codes index */
    Py_ssize_t ntied;      /* tied columns so far */
    int16_t *c_table;      /* 32 n: C of each place in a block (AVX-512 kernel, ties) */
} sign_call;

/* The share of the window a run of equal values at sorted positions [below, upto) holds in a
 * tied column, as the t-th tied column's entries of the table: 0, 1, the run of the first
 * value in the window, of the last. */
static void add_tied(sign_call *sc, Py_ssize_t bf, Py_ssize_t uf, Py_ssize_t bl, Py_ssize_t ul)
{
    double *shares = sc->table + 4 * sc->ntied++;
    shares[0] = 0.0, shares[1] = 1.0;
    shares[2] = overlap(bf, uf, sc->p, sc->q);
    shares[3] = overlap(bl, ul, sc->p, sc->q);
}

/* Values at four sorted positions of w columns of BitDelta values in one group, from their
 * signs (see `zoo_gym.aggregation._signs`): `sorted` (n, w) holds the rows' sign bytes (1:
 * negative) in ascending order of their scales, ascending[r] the scale of place r. With
 * C(r) the negatives among the first r + 1 places and N = C(n - 1), place r sits at sorted
 * position N - C(r) (negative) or N + r - C(r) (positive) in each column; the value of the
 * place sitting at pos[t] goes to out[t]; where `kept` is given, the float64 sum of the values
 * at positions [wp, wq) is added to it (float16 values: exact in any order). `counts` holds
 * 2 w int32: N, then C(r), per column. */
#if defined(ORDERSTAT_HAVE_X86) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void sign_cuts_group(const uint8_t *restrict sorted, int n, int w,
                            const float *restrict ascending, const int pos[4],
                            uint32_t *const out[4], double *restrict kept, int wp, int wq,
                            int32_t *restrict counts)
{
    /* all in 32-bit lanes (the values as their bits, -s being s with the sign bit set), the
     * four cut positions as masks, so that the loop over the columns is vectorised */
    int32_t *restrict total = counts, *restrict below = counts + w;
    for (int j = 0; j < w; j++)
        total[j] = below[j] = 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *restrict b = sorted + (Py_ssize_t)i * w;
        for (int j = 0; j < w; j++)
            total[j] += b[j];
    }
    const int32_t p0 = pos[0], p1 = pos[1], p2 = pos[2], p3 = pos[3];
    uint32_t *restrict o0 = out[0], *restrict o1 = out[1], *restrict o2 = out[2],
                       *restrict o3 = out[3];
    for (int r = 0; r < n; r++) {
        const uint8_t *restrict b = sorted + (Py_ssize_t)r * w;
        uint32_t bits;
        memcpy(&bits, &ascending[r], 4);
        for (int j = 0; j < w; j++) {
            const int32_t neg = b[j];
            below[j] += neg;
            const int32_t at = total[j] - below[j] + (r & (neg - 1));
            const uint32_t v = bits | ((uint32_t)neg << 31);
            const uint32_t m0 = -(uint32_t)(at == p0), m1 = -(uint32_t)(at == p1);
            const uint32_t m2 = -(uint32_t)(at == p2), m3 = -(uint32_t)(at == p3);
            o0[j] = (o0[j] & ~m0) | (v & m0);
            o1[j] = (o1[j] & ~m1) | (v & m1);
            o2[j] = (o2[j] & ~m2) | (v & m2);
            o3[j] = (o3[j] & ~m3) | (v & m3);
        }
        if (kept == NULL)
            continue;
        const double s64 = (double)ascending[r];
        for (int j = 0; j < w; j++) {
            const int32_t neg = b[j];
            const int32_t at = total[j] - below[j] + (r & (neg - 1));
            const double v = neg ? -s64 : s64;
            kept[j] += (at >= wp) & (at < wq) ? v : 0.0;
        }
    }
}

/* Buffers of the portable kernel for groups of up to w columns. */
typedef struct {
    int32_t *counts; /* 2 w: `sign_cuts_group`'s totals and running counts */
    int32_t *ends;   /* 4 w: the values below and up to first, below and up to last */
    int32_t *tied;   /* w: -1 in the tied columns, else 0 */
    uint32_t *cuts;  /* 4 w: values at positions p - 1, p, q - 1, q, as bits */
    double *kept;    /* w: sums of the values at positions [p, q) */
    uint8_t *signs;  /* n w: the group's sign bytes, its rows in ascending order of scale */
} sign_work;

/* 1 for each value of eight packed sign bits (most significant first) that is negative. */
static uint8_t negative_bytes[256][8];

static void fill_negative_bytes(void)
{
    for (int v = 0; v < 256; v++)
        for (int k = 0; k < 8; k++)
            negative_bytes[v][k] = ((v >> (7 - k)) & 1) == 0;
}

/* Bits bit .. bit + w - 1 of the packed signs `packed` as bytes, 1 where negative, into out. */
static void unpack_negatives(const uint8_t *packed, Py_ssize_t bit, int w, uint8_t *out)
{
    int j = 0;
    for (; j < w && (bit + j) % 8 != 0; j++)
        out[j] = ((packed[(bit + j) >> 3] >> (7 - (bit + j) % 8)) & 1) == 0;
    for (; j + 8 <= w; j += 8)
        memcpy(out + j, negative_bytes[packed[(bit + j) >> 3]], 8);
    for (; j < w; j++)
        out[j] = ((packed[(bit + j) >> 3] >> (7 - (bit + j) % 8)) & 1) == 0;
}

/* The portable kernel: one group's w columns of either rule from their signs, bits bit ..
 * bit + w - 1 of each row, its rows in the order `so`. Its results into out (w,) float32,
 * each row's count of the columns in which it holds the window [p, q) (median) or lies
 * outside it (trimmed) into the counts, but for the tied columns (the window starts or ends
 * inside a run of equal values): their shares to the table and each row's code of its share
 * (0 outside the window, 1 inside, 2 equal to first, 3 equal to last) to the codes, one
 * column of them per tied column; the tie logic of `chunk` above. */
#if defined(ORDERSTAT_HAVE_X86) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void sign_rule_group(sign_call *sc, Py_ssize_t bit, int w, const scale_order *so,
                            float *out, const sign_work *sw)
{
    const int n = sc->n, p = sc->p, q = sc->q, rule = sc->rule;
    const int32_t *restrict order = so->order;
    const float *restrict ascending = so->ascending;
    const int pos[4] = {p >= 1 ? p - 1 : p, p, q - 1, q < n ? q : q - 1};
    uint32_t *rows[4];
    for (int t = 0; t < 4; t++)
        rows[t] = sw->cuts + t * w;
    double *restrict kept = sw->kept;
    for (int j = 0; j < w; j++)
        kept[j] = 0.0;
    /* the rows in ascending order of scale, together: the passes below read them in turn */
    uint8_t *restrict sorted = sw->signs;
    for (int r = 0; r < n; r++)
        unpack_negatives(sc->signs + order[r] * sc->stride, bit, w, sorted + (Py_ssize_t)r * w);
    sign_cuts_group(sorted, n, w, ascending, pos, rows, rule == TRIMMED ? kept : NULL, p, q,
                    sw->counts);
    const float *before = (const float *)rows[0], *first = (const float *)rows[1],
                *last = (const float *)rows[2], *after = (const float *)rows[3];
    int32_t *restrict tied = sw->tied;
    int any = 0;
    for (int j = 0; j < w; j++) {
        const double zero = 0.0;
        out[j] = rule == MEDIAN ? (float)(((double)first[j] + (double)last[j]) * 0.5 + zero)
                                : (float)(kept[j] / (double)(q - p));
        const int tie = (p >= 1 && before[j] == first[j]) || (q < n && after[j] == last[j]);
        tied[j] = -tie;
        any |= tie;
    }
    /* each row's count over the untied columns (and, with ties, the counts of the values
     * below and up to each cut value) */
    const int32_t *restrict total = sw->counts;
    int32_t *restrict below = sw->counts + w, *restrict e = sw->ends;
    for (int j = 0; j < w; j++)
        below[j] = e[j] = e[w + j] = e[2 * w + j] = e[3 * w + j] = 0;
    for (int r = 0; r < n; r++) {
        const uint8_t *restrict b = sorted + (Py_ssize_t)r * w;
        int32_t hits = 0;
        for (int j = 0; j < w; j++) {
            const int32_t neg = b[j];
            below[j] += neg;
            const int32_t at = total[j] - below[j] + (r & (neg - 1));
            const int32_t in = (at >= p) & (at < q);
            hits += (rule == MEDIAN ? in : 1 - in) & ~tied[j];
        }
        sc->counts[order[r]] += hits;
        if (!any)
            continue;
        const float s = ascending[r];
        int32_t *restrict below_first = e, *restrict upto_first = e + w,
                          *restrict below_last = e + 2 * w, *restrict upto_last = e + 3 * w;
        const float *restrict low = first, *restrict high = last;
        for (int j = 0; j < w; j++) {
            const float v = b[j] ? -s : s;
            below_first[j] += v < low[j];
            upto_first[j] += v <= low[j];
            below_last[j] += v < high[j];
            upto_last[j] += v <= high[j];
        }
    }
    if (!any)
        return;
    /* each row's share in the group's tied columns as a code: 0 outside the window, 1
     * inside, 2 equal to first, 3 equal to last */
    for (int r = 0; r < n; r++) {
        const uint8_t *restrict b = sorted + (Py_ssize_t)r * w;
        uint8_t *restrict code = sc->codes + order[r] * sc->cap + sc->ntied;
        uint32_t bits;
        memcpy(&bits, &ascending[r], 4);
        for (int j = 0, t = 0; j < w; j++) {
            if (!tied[j])
                continue;
            uint32_t vb = bits | ((uint32_t)b[j] << 31);
            float v;
            memcpy(&v, &vb, 4);
            const int32_t inside = (v > first[j]) & (v < last[j]);
            const int32_t at_first = v == first[j], at_last = v == last[j];
            code[t++] = (uint8_t)(inside + 3 * at_last * (1 - at_first) + 2 * at_first);
        }
    }
    for (int j = 0; j < w; j++)
        if (tied[j])
            add_tied(sc, e[j], e[w + j], e[2 * w + j], e[3 * w + j]);
}

/* The word of values b .. b + 63 of a row of `nbytes` packed sign bytes, bit t set where
 * value b + t is negative (its sign bit clear); bits past the row are set. */
static inline uint64_t negative_word(const uint8_t *row, Py_ssize_t nbytes, Py_ssize_t b)
{
    return ~bits_at(row, nbytes, b);
}

#ifdef ORDERSTAT_HAVE_X86
/* The AVX-512 kernel: the same results as the portable one, 32 columns of a group at a time
 * in 16-bit lanes (n <= 8192), each row's signs of them one 32-bit mask. Two passes over the
 * rows in scale order per block: the first finds the places at the four cut positions (and a
 * trimmed mean's kept sum, exact in 64-bit integers of 2^-24), the second each row's count
 * and, in the tied columns, its code. In a tied column the run of values equal to a cut value
 * is the places of the cut's run of equal scales with the cut's sign (both signs where the
 * scale is zero), so its sorted positions follow from C at the run's two ends. */
#define SIGN512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,popcnt")))

SIGN512 static inline __attribute__((always_inline)) __m512i
sorted_at(__m512i negatives, __m512i c, __mmask32 neg, __m512i r)
{
    const __m512i base = _mm512_sub_epi16(negatives, c);
    return _mm512_mask_add_epi16(base, (__mmask32)~neg, base, r);
}

/* Places at the four cut positions (cuts[t][j]) and, for a trimmed mean, the kept sums in
 * units of 2^-24 (kept[j]), of a block's columns: words[i] row i's negatives, nneg (32,) the
 * columns' N. */
SIGN512 static inline __attribute__((always_inline)) void
cuts_of_rule512(const sign_call *sc, const scale_order *so, const uint32_t *words,
                const int16_t *nneg, const int pos[4], int16_t cuts[4][32], int64_t kept[32],
                const int trimmed)
{
    const int n = sc->n;
    const int32_t *restrict order = so->order;
    const int64_t *restrict units = so->units;
    const __m512i one = _mm512_set1_epi16(1), negatives = _mm512_loadu_si512(nneg);
    const __m512i t0 = _mm512_set1_epi16((int16_t)pos[0]), t1 = _mm512_set1_epi16((int16_t)pos[1]);
    const __m512i t2 = _mm512_set1_epi16((int16_t)pos[2]), t3 = _mm512_set1_epi16((int16_t)pos[3]);
    const __m512i wp = _mm512_set1_epi16((int16_t)sc->p);
    const __m512i width = _mm512_set1_epi16((int16_t)(sc->q - sc->p));
    __m512i c = _mm512_setzero_si512(), r = c, i0 = c, i1 = c, i2 = c, i3 = c;
    __m512i k0 = c, k1 = c, k2 = c, k3 = c;
    for (int s = 0; s < n; s++) {
        const __mmask32 neg = words[order[s]];
        c = _mm512_mask_add_epi16(c, neg, c, one);
        const __m512i at = sorted_at(negatives, c, neg, r);
        i0 = _mm512_mask_mov_epi16(i0, _mm512_cmpeq_epi16_mask(at, t0), r);
        i1 = _mm512_mask_mov_epi16(i1, _mm512_cmpeq_epi16_mask(at, t1), r);
        i2 = _mm512_mask_mov_epi16(i2, _mm512_cmpeq_epi16_mask(at, t2), r);
        i3 = _mm512_mask_mov_epi16(i3, _mm512_cmpeq_epi16_mask(at, t3), r);
        if (trimmed) {
            const __mmask32 in = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(at, wp), width);
            const __mmask32 minus = in & neg, plus = in & ~neg;
            const __m512i u = _mm512_set1_epi64(units[s]);
            k0 = _mm512_mask_sub_epi64(k0, (__mmask8)minus, k0, u);
            k0 = _mm512_mask_add_epi64(k0, (__mmask8)plus, k0, u);
            k1 = _mm512_mask_sub_epi64(k1, (__mmask8)(minus >> 8), k1, u);
            k1 = _mm512_mask_add_epi64(k1, (__mmask8)(plus >> 8), k1, u);
            k2 = _mm512_mask_sub_epi64(k2, (__mmask8)(minus >> 16), k2, u);
            k2 = _mm512_mask_add_epi64(k2, (__mmask8)(plus >> 16), k2, u);
            k3 = _mm512_mask_sub_epi64(k3, (__mmask8)(minus >> 24), k3, u);
            k3 = _mm512_mask_add_epi64(k3, (__mmask8)(plus >> 24), k3, u);
        }
        r = _mm512_add_epi16(r, one);
    }
    _mm512_storeu_si512(cuts[0], i0);
    _mm512_storeu_si512(cuts[1], i1);
    _mm512_storeu_si512(cuts[2], i2);
    _mm512_storeu_si512(cuts[3], i3);
    _mm512_storeu_si512(kept, k0);
    _mm512_storeu_si512(kept + 8, k1);
    _mm512_storeu_si512(kept + 16, k2);
    _mm512_storeu_si512(kept + 24, k3);
}

SIGN512 static void block_cuts512(const sign_call *sc, const scale_order *so,
                                  const uint32_t *words, const int16_t *nneg, const int pos[4],
                                  int16_t cuts[4][32], int64_t kept[32])
{
    if (sc->rule == TRIMMED)
        cuts_of_rule512(sc, so, words, nneg, pos, cuts, kept, 1);
    else
        cuts_of_rule512(sc, so, words, nneg, pos, cuts, kept, 0);
}

/* Each row's count over a block's untied columns (`untied`, a mask of them). */
SIGN512 static void block_counts512(sign_call *sc, const scale_order *so, const uint32_t *words,
                                    const int16_t *nneg, uint32_t untied)
{
    const int n = sc->n;
    const int32_t *restrict order = so->order;
    const __m512i one = _mm512_set1_epi16(1), negatives = _mm512_loadu_si512(nneg);
    const __m512i wp = _mm512_set1_epi16((int16_t)sc->p);
    const __m512i width = _mm512_set1_epi16((int16_t)(sc->q - sc->p));
    const uint32_t flip = sc->rule == MEDIAN ? 0 : ~0u; /* a trimmed mean counts the dropped */
    __m512i c = _mm512_setzero_si512(), r = c;
    for (int s = 0; s < n; s++) {
        const int32_t row = order[s];
        const __mmask32 neg = words[row];
        c = _mm512_mask_add_epi16(c, neg, c, one);
        const __m512i at = sorted_at(negatives, c, neg, r);
        const uint32_t in = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(at, wp), width);
        sc->counts[row] += __builtin_popcount((in ^ flip) & untied);
        r = _mm512_add_epi16(r, one);
    }
}

/* A block's cut values in a tied column: the run of equal scales of the place at a cut
 * ([lo, lo + len)), whether the cut value is negative, or zero (equal to either sign). */
typedef struct {
    int16_t lo[2][32], len[2][32];
    uint32_t negative[2], zero[2];
} tie_runs;

/* The byte shuffle that moves the lanes of `mask` (16 bits) to the front, in order. */
static __m128i front_shuffle(uint32_t mask)
{
    uint8_t idx[16];
    int k = 0;
    for (int j = 0; j < 16; j++)
        if (mask >> j & 1)
            idx[k++] = (uint8_t)j;
    while (k < 16)
        idx[k++] = 0x80;
    __m128i v;
    memcpy(&v, idx, 16);
    return v;
}

/* Counts and codes of a block with tied columns (`untied` a mask of the others, `tied` of
 * them): the counts as `block_counts512`, each row's code in each tied column (the t-th
 * tied column's at codes[row, ntied + t]; up to 32 bytes past the block's last are
 * overwritten) and C of each place into the call's c_table (place s: 32 values at 32 s). */
SIGN512 static void block_ties512(sign_call *sc, const scale_order *so, const uint32_t *words,
                                  const int16_t *nneg, uint32_t untied, uint32_t tied,
                                  const tie_runs *tr)
{
    const int n = sc->n;
    const int32_t *restrict order = so->order;
    const __m512i one = _mm512_set1_epi16(1), negatives = _mm512_loadu_si512(nneg);
    const __m512i wp = _mm512_set1_epi16((int16_t)sc->p);
    const __m512i width = _mm512_set1_epi16((int16_t)(sc->q - sc->p));
    const __m512i lof = _mm512_loadu_si512(tr->lo[0]), lenf = _mm512_loadu_si512(tr->len[0]);
    const __m512i lol = _mm512_loadu_si512(tr->lo[1]), lenl = _mm512_loadu_si512(tr->len[1]);
    const __m256i b1 = _mm256_set1_epi8(1), b2 = _mm256_set1_epi8(2), b3 = _mm256_set1_epi8(3);
    const uint32_t flip = sc->rule == MEDIAN ? 0 : ~0u;
    const __m128i front_lo = front_shuffle(tied & 0xffffu), front_hi = front_shuffle(tied >> 16);
    const int count_lo = __builtin_popcount(tied & 0xffffu);
    int16_t *restrict c_table = sc->c_table;
    __m512i c = _mm512_setzero_si512(), r = c;
    for (int s = 0; s < n; s++) {
        const int32_t row = order[s];
        const __mmask32 neg = words[row];
        c = _mm512_mask_add_epi16(c, neg, c, one);
        _mm512_storeu_si512(c_table + 32 * (Py_ssize_t)s, c);
        const __m512i at = sorted_at(negatives, c, neg, r);
        const __mmask32 in = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(at, wp), width);
        sc->counts[row] += __builtin_popcount(((uint32_t)in ^ flip) & untied);
        const __mmask32 at_first = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(r, lof), lenf) &
                                   (~(neg ^ tr->negative[0]) | tr->zero[0]);
        const __mmask32 at_last = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(r, lol), lenl) &
                                  (~(neg ^ tr->negative[1]) | tr->zero[1]);
        __m256i code = _mm256_maskz_mov_epi8(in, b1);
        code = _mm256_mask_mov_epi8(code, at_last, b3);
        code = _mm256_mask_mov_epi8(code, at_first, b2);
        uint8_t *dst = sc->codes + row * sc->cap + sc->ntied;
        _mm_storeu_si128((__m128i *)dst,
                         _mm_shuffle_epi8(_mm256_castsi256_si128(code), front_lo));
        _mm_storeu_si128((__m128i *)(dst + count_lo),
                         _mm_shuffle_epi8(_mm256_extracti128_si256(code, 1), front_hi));
        r = _mm512_add_epi16(r, one);
    }
}

/* Sorted positions [below, upto) of the run of values equal to the cut value at sorted
 * position `at` (N negatives in the column) whose place's run of equal scales is [lo, hi],
 * C(lo - 1) = c_lo and C(hi) = c_hi. */
static void run_bounds(int at, int nneg, int lo, int hi, int c_lo, int c_hi, int zero,
                       Py_ssize_t *below, Py_ssize_t *upto)
{
    if (zero) { /* -0.0 == +0.0: both signs, lo = 0 */
        *below = nneg - c_hi, *upto = nneg + hi + 1 - c_hi;
    } else if (at < nneg) { /* negative: places r at N - C(r) */
        *below = nneg - c_hi, *upto = nneg - c_lo;
    } else { /* positive: places r at N + r - C(r) */
        *below = nneg + lo - c_lo, *upto = nneg + hi + 1 - c_hi;
    }
}

/* One block of wb <= 32 columns of a group: words[i] row i's negatives in them, nneg (32,)
 * their counts. */
SIGN512 static void sign_block512(sign_call *sc, const scale_order *so, const uint32_t *words,
                                  const int16_t *nneg, int wb, float *out)
{
    const int n = sc->n, p = sc->p, q = sc->q;
    const int pos[4] = {p >= 1 ? p - 1 : p, p, q - 1, q < n ? q : q - 1};
    int16_t cuts[4][32];
    int64_t kept[32];
    block_cuts512(sc, so, words, nneg, pos, cuts, kept);
    uint32_t tied = 0;
    for (int j = 0; j < wb; j++) {
        float v[4];
        for (int t = 0; t < 4; t++) {
            const float s = so->ascending[cuts[t][j]];
            v[t] = pos[t] < nneg[j] ? -s : s;
        }
        const double zero = 0.0;
        out[j] = sc->rule == MEDIAN
                     ? (float)(((double)v[1] + (double)v[2]) * 0.5 + zero)
                     : (float)((double)kept[j] * (1.0 / 16777216.0) / (double)(q - p));
        if ((p >= 1 && v[0] == v[1]) || (q < n && v[3] == v[2]))
            tied |= 1u << j;
    }
    const uint32_t untied = ~tied & (wb == 32 ? ~0u : (1u << wb) - 1);
    if (tied == 0) {
        block_counts512(sc, so, words, nneg, untied);
        return;
    }
    tie_runs tr = {.negative = {0, 0}, .zero = {0, 0}};
    for (int j = 0; j < 32; j++) {
        for (int e = 0; e < 2; e++) {
            const int place = cuts[1 + e][j], lo = so->run_lo[place];
            const int real = j < wb; /* the lanes past the block never match */
            tr.lo[e][j] = (int16_t)(real ? lo : 0);
            tr.len[e][j] = (int16_t)(real ? so->run_hi[place] - lo + 1 : 0);
            tr.negative[e] |= (uint32_t)(pos[1 + e] < nneg[j]) << j;
            tr.zero[e] |= (uint32_t)(so->ascending[place] == 0.0f) << j;
        }
    }
    block_ties512(sc, so, words, nneg, untied, tied, &tr);
    for (int j = 0; j < wb; j++) {
        if (!(tied >> j & 1))
            continue;
        Py_ssize_t b[2], u[2];
        for (int e = 0; e < 2; e++) {
            const int lo = tr.lo[e][j], hi = lo + tr.len[e][j] - 1;
            const int c_lo = lo > 0 ? sc->c_table[32 * (lo - 1) + j] : 0;
            run_bounds(pos[1 + e], nneg[j], lo, hi, c_lo, sc->c_table[32 * hi + j],
                       (tr.zero[e] >> j) & 1, &b[e], &u[e]);
        }
        add_tied(sc, b[0], u[0], b[1], u[1]);
    }
}

/* One group's w columns, bits bit .. bit + w - 1 of each row, its rows in the order `so`:
 * the negatives of 64 columns of each row at a time as two words (`words`, 2 n), then each
 * half as a block. */
SIGN512 static void sign_group512(sign_call *sc, Py_ssize_t bit, int w, const scale_order *so,
                                  float *out, uint32_t *words)
{
    const int n = sc->n;
    const __m512i one = _mm512_set1_epi16(1);
    for (int c = 0; c < w; c += 64) {
        __m512i n0 = _mm512_setzero_si512(), n1 = n0;
        for (int i = 0; i < n; i++) {
            const uint64_t x = negative_word(sc->signs + i * sc->stride, sc->nbytes, bit + c);
            words[i] = (uint32_t)x;
            words[n + i] = (uint32_t)(x >> 32);
            n0 = _mm512_mask_add_epi16(n0, (__mmask32)x, n0, one);
            n1 = _mm512_mask_add_epi16(n1, (__mmask32)(x >> 32), n1, one);
        }
        int16_t nneg[2][32];
        _mm512_storeu_si512(nneg[0], n0);
        _mm512_storeu_si512(nneg[1], n1);
        const int left = w - c;
        sign_block512(sc, so, words, nneg[0], left < 32 ? left : 32, out + c);
        if (left > 32)
            sign_block512(sc, so, words + n, nneg[1], left < 64 ? left - 32 : 32, out + c + 32);
    }
}
#endif

enum { SIGN_PORTABLE = 0, SIGN_AVX512 = 1 };
static const char *const sign_kernel_names[] = {"portable", "avx512"};
static int sign_usable[2] = {1, 0};

static int sign_kernel_index(const char *name)
{
    if (name == NULL)
        return sign_usable[SIGN_AVX512] ? SIGN_AVX512 : SIGN_PORTABLE;
    for (int k = 0; k < 2; k++) {
        if (strcmp(name, sign_kernel_names[k]) == 0) {
            if (sign_usable[k])
                return k;
            PyErr_Format(PyExc_ValueError, "sign kernel %s is not supported by this CPU", name);
            return -1;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown sign kernel %s; see `sign_kernels`", name);
    return -1;
}

/* The checks of sign_rule's arguments (views: signs, scales, out, counts, codes, table). */
static int sign_args_ok(const Py_buffer *v, Py_ssize_t bit, Py_ssize_t m, Py_ssize_t phase,
                        Py_ssize_t group, int rule, int f, Py_ssize_t ntied)
{
    const Py_buffer *neg = &v[0], *sc = &v[1], *codes = &v[4];
    if (neg->ndim != 2 || format_of(neg) != 'B' || neg->strides[1] != 1 || sc->ndim != 2 ||
        format_of(sc) != 'f' || sc->strides[0] % 4 != 0 || sc->strides[1] % 4 != 0 ||
        codes->ndim != 2 || format_of(codes) != 'B')
        return 0;
    const Py_ssize_t n = neg->shape[0];
    return bit >= 0 && m >= 1 && bit + m <= 8 * neg->shape[1] && n >= 1 && n <= 8192 &&
           group >= 1 && phase >= 0 && phase < group && sc->shape[0] == n &&
           sc->shape[1] == (phase + m + group - 1) / group && format_of(&v[2]) == 'f' &&
           v[2].len == 4 * m && format_of(&v[3]) == 'q' && v[3].len == 8 * n &&
           codes->shape[0] == n && 0 <= ntied && ntied + m + 32 <= codes->shape[1] &&
           format_of(&v[5]) == 'd' && 4 * (ntied + m) <= v[5].len / 8 &&
           (rule == MEDIAN || (rule == TRIMMED && f >= 1 && 2 * f < n));
}

/* Groups whose sort keys `sign_groups` forms at a time: at most 128 KiB of them. */
static Py_ssize_t key_groups(Py_ssize_t n, Py_ssize_t groups)
{
    const Py_ssize_t most = 65536 / n > 1 ? 65536 / n : 1;
    return groups < most ? groups : most;
}

/* Where `sign_groups`'s sort keys start in its buffer: after the scale order (40 n bytes) and
 * the portable kernel's work (44 w, then 8 w + n w), at a multiple of 8. */
static Py_ssize_t keys_offset(Py_ssize_t n, Py_ssize_t w)
{
    return (40 * n + (44 * w + 7) / 8 * 8 + w * (8 + n) + 7) / 8 * 8;
}

/* Bytes of `sign_groups`'s buffers for n rows, groups of up to w columns and `groups` groups:
 * then the keys and the AVX-512 kernel's C of each place (32 n int16). */
static Py_ssize_t sign_block_size(Py_ssize_t n, Py_ssize_t w, Py_ssize_t groups)
{
    return keys_offset(n, w) + 2 * n * key_groups(n, groups) + 64 * n;
}

/* Every group of a sign_rule call; 0, or -1 if a scale is not a float16 value. */
static int sign_groups(sign_call *sc, const Py_buffer *scales, Py_ssize_t bit, Py_ssize_t m,
                       Py_ssize_t phase, Py_ssize_t group, float *out, int kernel, char *block)
{
    const int n = sc->n;
    const Py_ssize_t w = group < m ? group : m, groups = scales->shape[1];
    scale_order so = {.n = n, .units = (int64_t *)block};
    so.order = (int32_t *)(so.units + n);
    so.run_lo = so.order + n;
    so.run_hi = so.run_lo + n;
    so.spare = so.run_hi + n;
    so.ascending = (float *)(so.spare + n);
    uint32_t *words = (uint32_t *)(so.ascending + n); /* 2 n */
    sign_work sw = {.counts = (int32_t *)(block + 40 * (Py_ssize_t)n)};
    sw.ends = sw.counts + 2 * w;
    sw.tied = sw.ends + 4 * w;
    sw.cuts = (uint32_t *)(sw.tied + w);
    sw.kept = (double *)(block + 40 * (Py_ssize_t)n + (44 * w + 7) / 8 * 8);
    sw.signs = (uint8_t *)(sw.kept + w);
    uint16_t *keys = (uint16_t *)(block + keys_offset(n, w));
    sc->c_table = (int16_t *)(keys + n * key_groups(n, groups)); /* 32 n */
    const Py_ssize_t batch = key_groups(n, groups);
    for (Py_ssize_t g = 0; g < groups; g++) {
        if (g % batch == 0 && scale_keys(scales, g, groups - g < batch ? groups - g : batch, keys))
            return -1;
        sort_scales(keys + (g % batch) * n, &so);
        const Py_ssize_t c0 = g * group - phase < 0 ? 0 : g * group - phase;
        const Py_ssize_t c1 = (g + 1) * group - phase > m ? m : (g + 1) * group - phase;
#ifdef ORDERSTAT_HAVE_X86
        if (kernel == SIGN_AVX512) {
            sign_group512(sc, bit + c0, (int)(c1 - c0), &so, out + c0, words);
            continue;
        }
#endif
        sign_rule_group(sc, bit + c0, (int)(c1 - c0), &so, out + c0, &sw);
    }
    return 0;
}

/* sign_rule(signs, bit, m, phase, group, scales, rule, f, out, counts, codes, table, ntied,
 *           kernel=None) */
static PyObject *orderstat_sign_rule(PyObject *self, PyObject *args)
{
    PyObject *objs[6];
    Py_ssize_t bit, m, phase, group, ntied;
    int rule, f;
    const char *kernel_name = NULL;
    if (!PyArg_ParseTuple(args, "OnnnnOiiOOOOn|z:sign_rule", &objs[0], &bit, &m, &phase,
                          &group, &objs[1], &rule, &f, &objs[2], &objs[3], &objs[4], &objs[5],
                          &ntied, &kernel_name))
        return NULL;
    const int kernel = sign_kernel_index(kernel_name);
    if (kernel < 0)
        return NULL;
    Py_buffer views[6];
    const int writable = PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT;
    const int modes[6] = {PyBUF_STRIDES | PyBUF_FORMAT, PyBUF_STRIDES | PyBUF_FORMAT,
                          writable, writable, writable, writable};
    int got = 0;
    for (; got < 6; got++)
        if (PyObject_GetBuffer(objs[got], &views[got], modes[got]) < 0)
            break;
    PyObject *result = NULL;
    if (got == 6 && !sign_args_ok(views, bit, m, phase, group, rule, f, ntied)) {
        PyErr_SetString(PyExc_ValueError,
                        "sign_rule needs signs (n, bytes) uint8 holding bits [bit, bit + m), "
                        "scales (n, groups) float32, out (m,) float32, counts (n,) int64, "
                        "codes (n, >= ntied + m + 32) uint8, table (>= 4 (ntied + m),) float64, "
                        "1 <= n <= 8192, 0 <= phase < group, "
                        "rule 0 (median) or 1 (trimmed, 1 <= f < n / 2)");
    } else if (got == 6) {
        const Py_ssize_t n = views[0].shape[0], w = group < m ? group : m;
        char *block = PyMem_RawMalloc((size_t)sign_block_size(n, w, views[1].shape[1]));
        if (block == NULL) {
            PyErr_NoMemory();
        } else {
            sign_call sc = {.signs = (const uint8_t *)views[0].buf,
                            .stride = views[0].strides[0],
                            .nbytes = views[0].shape[1],
                            .n = (int)n,
                            .p = rule == MEDIAN ? (int)((n - 1) / 2) : f,
                            .q = rule == MEDIAN ? (int)(n / 2 + 1) : (int)n - f,
                            .rule = rule,
                            .counts = (int64_t *)views[3].buf,
                            .codes = (uint8_t *)views[4].buf,
                            .cap = views[4].shape[1],
                            .table = (double *)views[5].buf,
                            .ntied = ntied};
            int bad;
            Py_BEGIN_ALLOW_THREADS
            bad = sign_groups(&sc, &views[1], bit, m, phase, group, (float *)views[2].buf,
                              kernel, block);
            Py_END_ALLOW_THREADS
            PyMem_RawFree(block);
            if (bad)
                PyErr_SetString(PyExc_ValueError,
                                "sign_rule: a scale is not a float16 value >= 0 (held as "
                                "float32); decode those columns instead");
            else
                result = PyLong_FromSsize_t(sc.ntied);
        }
    }
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    return result;
}

#ifdef ORDERSTAT_HAVE_X86
/* row[t] = table[4 t + (code[t] & 3)] for the first 8 k of t < ntied (returned), 8 at a time. */
SIGN512 static Py_ssize_t shares_of_codes512(const uint8_t *code, const double *table,
                                            Py_ssize_t ntied, double *row)
{
    const __m256i step = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), three = _mm256_set1_epi32(3);
    Py_ssize_t t = 0;
    for (; t + 8 <= ntied; t += 8) {
        const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(code + t)));
        const __m256i at = _mm256_add_epi32(_mm256_and_si256(codes, three), step);
        _mm512_storeu_pd(row + t, _mm512_i32gather_pd(at, table + 4 * t, 8));
    }
    return t;
}
#endif

/* tie_rows(codes, table, ntied, shares, row): each row's torch.sum of its shares in the
 * ntied tied columns, in order: the share of code k in the t-th of them is table[4 t + k], the
 * code codes[r, t] (gathered into `row`, >= ntied float64). */
static PyObject *orderstat_tie_rows(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    Py_ssize_t ntied;
    if (!PyArg_ParseTuple(args, "OOnOO:tie_rows", &objs[0], &objs[1], &ntied, &objs[2],
                          &objs[3]))
        return NULL;
    Py_buffer views[4];
    int got = 0;
    for (; got < 4; got++)
        if (PyObject_GetBuffer(objs[got], &views[got],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got >= 2 ? PyBUF_WRITABLE : 0)) < 0)
            break;
    PyObject *result = NULL;
    if (got == 4) {
        const Py_buffer *mat = &views[0];
        const Py_ssize_t n = mat->ndim == 2 ? mat->shape[0] : 0;
        const Py_ssize_t cap = mat->ndim == 2 ? mat->shape[1] : 0;
        const int ok = mat->ndim == 2 && format_of(mat) == 'B' && ntied >= 0 && ntied <= cap &&
                       format_of(&views[1]) == 'd' && 4 * ntied <= views[1].len / 8 &&
                       format_of(&views[2]) == 'd' && views[2].len == 8 * n &&
                       format_of(&views[3]) == 'd' && views[3].len >= 8 * ntied;
        if (!ok) {
            PyErr_SetString(PyExc_ValueError,
                            "tie_rows needs codes (n, >= ntied) uint8, table (>= 4 ntied,) "
                            "float64, shares (n,) float64, row (>= ntied,) float64");
        } else {
            const uint8_t *codes = (const uint8_t *)mat->buf;
            const double *table = (const double *)views[1].buf;
            double *out = (double *)views[2].buf, *row = (double *)views[3].buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t r = 0; r < n; r++) {
                const uint8_t *code = codes + r * cap;
                Py_ssize_t t = 0;
#ifdef ORDERSTAT_HAVE_X86
                if (sign_usable[SIGN_AVX512])
                    t = shares_of_codes512(code, table, ntied, row);
#endif
                for (; t < ntied; t++)
                    row[t] = table[4 * t + (code[t] & 3)];
                out[r] = torch_sum(row, ntied);
            }
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    return result;
}

PyDoc_STRVAR(sign_rule_doc,
             "sign_rule(signs, bit, m, phase, group, scales, rule, f, out, counts, codes, table,\n"
             "          ntied, kernel=None)\n--\n\n"
             "median (rule 0) or trimmed (rule 1) of m columns of BitDelta values from their\n"
             "sign bits bit .. bit + m - 1 of each row of signs (n, bytes) uint8 (set: +scale),\n"
             "the first being value phase of its group; scales (n, groups) float32 (float16\n"
             "values >= 0) each row's scale of each group. Into out (m,) float32, the rows'\n"
             "counts over the untied columns added to counts (n,) int64; for the t-th tied\n"
             "column from ntied on, the shares a row may hold in it into table[4 t:4 t + 4]\n"
             "(0, 1, the runs at the cuts) and each row's code of its share into codes[:, t]\n"
             "(n, cap) uint8. kernel: one of `sign_kernels` (the last by default). Returns\n"
             "ntied plus the number of tied columns.");

PyDoc_STRVAR(tie_rows_doc,
             "tie_rows(codes, table, ntied, shares, row)\n--\n\n"
             "shares (n,) float64: each row's torch.sum over t < ntied of table[4 t + code], code\n"
             "= codes[r, t]; row: a float64 buffer of >= ntied values.");

PyDoc_STRVAR(network_doc,
             "network(n, lo, hi)\n--\n\n"
             "The sorting network the kernels run for n rows, as bytes of int32 (i, j) pairs\n"
             "(i < j; afterwards wire i holds the smaller value): Batcher's odd-even merge sort\n"
             "for n wires, keeping only the comparators that can reach sorted positions lo..hi.");

PyDoc_STRVAR(median_doc,
             "median(x, pairs, out, counts, shares, work, kernel=None)\n--\n\n"
             "Per-column median of x (n, c) float32 or float64 (rows contiguous) into out[:c]\n"
             "float32: (v_lo + v_hi) in float64, times 0.5, plus 0.0, rounded. counts (n,) int64\n"
             "gets each row's number of columns whose middle positions it holds, but for the\n"
             "columns whose middle cuts split a run of equal values (ties): shares (n,) float64\n"
             "is set to each row's sum of its shares of their middle positions. Returns the\n"
             "number of such columns, or -1 if x holds a NaN (counts and shares untouched).\n"
             "pairs: network(n, max(lo - 1, 0), min(hi + 1, n - 1)); work: a writable buffer\n"
             "of work_size(n, c) bytes.");

PyDoc_STRVAR(trimmed_doc,
             "trimmed(x, f, pairs, out, counts, shares, work, kernel=None)\n--\n\n"
             "Per-column mean of x (n, c) without its f smallest and f largest values, into\n"
             "out[:c] float32: the kept values in float64, added in torch.sum's order, divided by\n"
             "n - 2f. counts (n,) int64 gets each row's number of dropped values, but for the\n"
             "columns whose cuts split a run of equal values (ties): shares (n,) float64 is set\n"
             "to each row's sum of its shares of their kept positions. Returns the number of\n"
             "such columns, or -1 if x holds a NaN (counts and shares untouched).\n"
             "pairs: network(n, f - 1, n - f); work: a writable buffer of work_size(n, c)\n"
             "bytes.");

PyDoc_STRVAR(closest_doc,
             "closest(x, beta, pairs, out, counts, shares, work, kernel=None, rows=None) -> int\n\n"
             "Bulyan's second step on x (float32 or float64, rows contiguous), its n rows\n"
             "`rows` (int64, in that order; None: all) that Krum chose: per column, the mean of\n"
             "the beta values closest to the median\n"
             "(float64) into out (c,) float32; += into counts (n,) int64 each row's columns\n"
             "it was kept in, bar the tied columns; their shares summed per row into shares\n"
             "(n,) float64. pairs: `network(n, 0, n - 1)`. Returns the number of tied\n"
             "columns, or -1 where x holds a NaN. The GIL is released.");

PyDoc_STRVAR(work_size_doc,
             "work_size(n, c)\n--\n\n"
             "Bytes of the work buffer median and trimmed need for n rows and c columns.");

static PyMethodDef orderstat_methods[] = {
    {"network", orderstat_network, METH_VARARGS, network_doc},
    {"median", orderstat_median, METH_VARARGS, median_doc},
    {"trimmed", orderstat_trimmed, METH_VARARGS, trimmed_doc},
    {"closest", orderstat_closest, METH_VARARGS, closest_doc},
    {"work_size", orderstat_work_size, METH_VARARGS, work_size_doc},
    {"sign_rule", orderstat_sign_rule, METH_VARARGS, sign_rule_doc},
    {"tie_rows", orderstat_tie_rows, METH_VARARGS, tie_rows_doc},
    {NULL, NULL, 0, NULL},
};

static int orderstat_exec(PyObject *module)
{
    fill_negative_bytes();
    usable[0] = 1;
#ifdef ORDERSTAT_HAVE_X86
    __builtin_cpu_init();
    usable[1] = __builtin_cpu_supports("avx2") ? 1 : 0;
    usable[2] = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
                    ? 1
                    : 0;
    best = usable[2] ? 2 : (usable[1] ? 1 : 0);
    sign_usable[SIGN_AVX512] = usable[2];
#endif
    int count = 0;
    for (int k = 0; k < N_KERNELS; k++)
        count += usable[k];
    PyObject *names = PyTuple_New(count);
    if (names == NULL)
        return -1;
    for (int k = 0, at = 0; k < N_KERNELS; k++) {
        if (!usable[k])
            continue;
        PyObject *name = PyUnicode_FromString(kernel_sets[k].name);
        if (name == NULL) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, at++, name);
    }
    if (PyModule_AddObject(module, "kernels", names) < 0) {
        Py_DECREF(names);
        return -1;
    }
    PyObject *signs = sign_usable[SIGN_AVX512] ? Py_BuildValue("(ss)", "portable", "avx512")
                                               : Py_BuildValue("(s)", "portable");
    if (signs == NULL || PyModule_AddObject(module, "sign_kernels", signs) < 0) {
        Py_XDECREF(signs);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot orderstat_slots[] = {
    {Py_mod_exec, orderstat_exec},
    {0, NULL},
};

static struct PyModuleDef orderstat_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zoo_gym.aggregation._orderstat",
    .m_doc = "Per-coordinate median and trimmed mean of column chunks by sorting networks (CPU).",
    .m_size = 0,
    .m_methods = orderstat_methods,
    .m_slots = orderstat_slots,
};

PyMODINIT_FUNC PyInit__orderstat(void)
{
    return PyModuleDef_Init(&orderstat_module);
}

#else /* ORDERSTAT_TEMPLATE: the kernels for one dtype T and one instruction set (ATTR) */

/* Defaults (GCC/Clang vector extensions): min and max of x and y, and -1 in the lanes where
 * low <= v <= high; an instruction set may define its own forms before including. */
#ifndef VMIN
#define VMIN(x, y) ((V)(((VI)(y) & (VI)((y) < (x))) | ((VI)(x) & ~(VI)((y) < (x)))))
#define VMAX(x, y) ((V)(((VI)(x) & (VI)((y) < (x))) | ((VI)(y) & ~(VI)((y) < (x)))))
#endif
#ifndef INSIDE
#define INSIDE(v, low, high) ((VI)((v) >= (low)) & (VI)((v) <= (high)))
#define LESS(a, b) ((VI)((a) < (b)))
#define LESS_EQ(a, b) ((VI)((a) <= (b)))
#define EQUAL(a, b) ((VI)((a) == (b)))
#endif

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(base) CAT(base, SUFFIX)
#define W ((int)(sizeof(V) / sizeof(T)))       /* columns per tile */
#define HALVES ((int)(sizeof(V) / sizeof(VH))) /* float64 vectors per tile row */
#define HW (W / HALVES)                         /* columns per float64 vector */

/* Copy columns c0 .. c0 + cw of the n rows into the tile t and its copy u (lanes past cw are
 * 0.0); return the lanes that hold a NaN in some row. */
static inline __attribute__((always_inline)) ATTR VI NAME(load_tile)(const char *x, Py_ssize_t stride,
                                                                 const int64_t *rows, int n,
                                                                 Py_ssize_t c0, int cw, V *t,
                                                                 V *u)
{
    VI nan = {0};
    for (int r = 0; r < n; r++) {
        const char *at = x + ROW(rows, r) * stride + c0 * (Py_ssize_t)sizeof(T);
        V v = {0};
        if (cw == W)
            memcpy(&v, at, sizeof(V)); /* one vector load */
        else
            memcpy(&v, at, (size_t)cw * sizeof(T));
        t[r] = v;
        u[r] = v;
        nan |= (VI)(v != v);
        __builtin_prefetch(at + PREFETCH_TILES * (Py_ssize_t)sizeof(V), 0, 3);
    }
    return nan;
}

/* The comparators in order: wire i gets the smaller value, wire j the larger (of equal values
 * either may go either way: they are the same number but for the sign of a zero). */
static inline __attribute__((always_inline)) ATTR void NAME(sort_tile)(V *t, const int32_t *pairs,
                                                                  Py_ssize_t npairs)
{
    for (Py_ssize_t k = 0; k < npairs; k++) {
        V *a = t + pairs[2 * k], *b = t + pairs[2 * k + 1];
        const V x = *a, y = *b;
        *a = VMIN(x, y);
        *b = VMAX(x, y);
    }
}

/* -1 in the lanes (of those `ok` selects) where v lies inside [low, high] (or, if not
 * `inside`, outside it), else 0. */
static inline __attribute__((always_inline)) ATTR VI NAME(lane_count)(V v, V low, V high, VI ok,
                                                                      int inside)
{
    const VI in = INSIDE(v, low, high);
    return (inside ? in : ~in) & ok;
}

/* Each row's per-lane counts into counts (n,). */
static inline __attribute__((always_inline)) ATTR void NAME(flush_counts)(const VI *lanes, int n,
                                                                          int64_t *counts)
{
    for (int r = 0; r < n; r++) {
        int64_t s = 0;
        for (int l = 0; l < W; l++)
            s -= lanes[r][l]; /* a hit is -1 */
        counts[r] += s;
    }
}

/* Whether any lane of m is nonzero. */
static inline __attribute__((always_inline)) ATTR int NAME(any)(VI m)
{
    VI folded = m;
    int hit = 0;
    for (int l = 0; l < W; l++)
        hit |= folded[l] != 0;
    return hit;
}

/* 0, 1, ..., W - 1. */
static inline __attribute__((always_inline)) ATTR VI NAME(lane_numbers)(void)
{
    VI lane;
    for (int l = 0; l < W; l++)
        lane[l] = l;
    return lane;
}

/* Lanes h * HW .. (h + 1) * HW - 1 of v as float64. */
static inline __attribute__((always_inline)) ATTR VD NAME(half)(V v, int h)
{
    VH part;
    memcpy(&part, (const char *)&v + h * sizeof(VH), sizeof(VH));
    return __builtin_convertvector(part, VD);
}

/* Round `value`, lanes h * HW .. of the tile, to float32 into out, those below lane cw. */
static inline __attribute__((always_inline)) ATTR void NAME(store_half)(VD value, int h, int cw,
                                                                       float *out)
{
    typedef float vout __attribute__((vector_size(HW * sizeof(float))));
    const vout v = __builtin_convertvector(value, vout);
    const int count = cw - h * HW < HW ? cw - h * HW : HW;
    if (count > 0)
        memcpy(out + h * HW, &v, (size_t)count * sizeof(float));
}

/* The float64 sum of t[first .. first + k - 1] per lane (half h of the lanes), in the order of
 * `torch_sum`, with the 16 accumulators of each lane in vectors across the lanes. */
static inline __attribute__((always_inline)) ATTR VD NAME(torch_order_sum)(const V *t, int first,
                                                                          int k, int h)
{
    VD acc[4][16];
    memset(acc, 0, sizeof(acc));
    const V *xs = t + first;
    const Py_ssize_t vectors = k / 4, quads = vectors / 4;
    const int power = level_power(quads);
    const Py_ssize_t step = (Py_ssize_t)1 << power, mask = step - 1;
    Py_ssize_t i = 0;
    while (i + step <= quads) {
        for (Py_ssize_t j = 0; j < step; j++, i++)
            for (int m = 0; m < 16; m++)
                acc[0][m] += NAME(half)(xs[16 * i + m], h);
        for (int level = 1; level < 4; level++) {
            for (int m = 0; m < 16; m++) {
                acc[level][m] += acc[level - 1][m];
                memset(&acc[level - 1][m], 0, sizeof(VD));
            }
            if ((i & (mask << (level * power))) != 0)
                break;
        }
    }
    for (; i < quads; i++)
        for (int m = 0; m < 16; m++)
            acc[0][m] += NAME(half)(xs[16 * i + m], h);
    for (int level = 1; level < 4; level++)
        for (int m = 0; m < 16; m++)
            acc[0][m] += acc[level][m];
    for (Py_ssize_t v = quads * 4; v < vectors; v++)
        for (int l = 0; l < 4; l++)
            acc[0][l] += NAME(half)(xs[4 * v + l], h);
    for (int m = 4; m < 16; m++)
        acc[0][m % 4] += acc[0][m];
    VD total = {0};
    for (Py_ssize_t r = vectors * 4; r < k; r++)
        total += NAME(half)(xs[r], h);
    for (int l = 0; l < 4; l++)
        total += acc[0][l];
    return total;
}

/* Record the tied lanes of a tile (columns c0 + l): the values at the window's ends and the
 * shares of the runs equal to them, from each lane's counts of values below and up to them. */
static inline __attribute__((always_inline)) ATTR Py_ssize_t
NAME(record_ties)(const V *u, int n, V first, V last, VI tie, int p, int q, Py_ssize_t c0,
                  tied_column *tied, Py_ssize_t ntied)
{
    VI below_first = {0}, upto_first = {0}, below_last = {0}, upto_last = {0};
    for (int r = 0; r < n; r++) { /* each hit is -1 */
        below_first += LESS(u[r], first);
        upto_first += LESS_EQ(u[r], first);
        below_last += LESS(u[r], last);
        upto_last += LESS_EQ(u[r], last);
    }
    for (int l = 0; l < W; l++) {
        if (!tie[l])
            continue;
        tied[ntied].first = first[l];
        tied[ntied].last = last[l];
        tied[ntied].s_first = overlap(-below_first[l], -upto_first[l], p, q);
        tied[ntied].s_last = overlap(-below_last[l], -upto_last[l], p, q);
        tied[ntied].col = c0 + l;
        ntied++;
    }
    return ntied;
}

/* Each row's sum of its shares of the window over the tied columns, added in `torch_sum`'s
 * order, into shares (n,): the sum `_select.window_shares(...).sum(1)` forms. */
static inline __attribute__((always_inline)) ATTR void
NAME(tie_shares)(const char *x, Py_ssize_t stride, int n, const tied_column *tied,
                 Py_ssize_t ntied, double *row, double *shares)
{
    for (int r = 0; r < n; r++) {
        const T *xr = (const T *)(x + r * stride); /* the median and trimmed mean read all rows */
        for (Py_ssize_t j = 0; j < ntied; j++) {
            const double v = (double)xr[tied[j].col];
            const tied_column *at = tied + j;
            row[j] = v == at->first  ? at->s_first
                     : v == at->last ? at->s_last
                     : (v > at->first && v < at->last) ? 1.0
                                                       : 0.0;
        }
        shares[r] = torch_sum(row, ntied);
    }
}

/* One chunk (n, c) of either rule; the window of sorted positions [p, q) is the middle
 * (median) or the kept values (trimmed). Returns the number of tied columns, or -1 where a
 * column holds a NaN (then counts and shares are left as they were). */
static inline __attribute__((always_inline)) ATTR Py_ssize_t
NAME(chunk)(const char *x, Py_ssize_t stride, int n, Py_ssize_t c, int f, int rule,
            const int32_t *pairs, Py_ssize_t npairs, float *out, int64_t *counts, double *shares,
            void *work)
{
    V *t = (V *)work, *u = t + n;
    VI *lanes = (VI *)(u + n);
    tied_column *tied = (tied_column *)(lanes + n);
    double *row = (double *)(tied + c);
    const int p = rule == MEDIAN ? (n - 1) / 2 : f, q = rule == MEDIAN ? n / 2 + 1 : n - f;
    const VI lane = NAME(lane_numbers)();
    VI nan = {0};
    Py_ssize_t ntied = 0;
    memset(lanes, 0, (size_t)n * sizeof(VI));
    for (Py_ssize_t c0 = 0; c0 < c; c0 += W) {
        const int cw = c - c0 < W ? (int)(c - c0) : W;
        nan |= NAME(load_tile)(x, stride, NULL, n, c0, cw, t, u);
        NAME(sort_tile)(t, pairs, npairs);
        const V first = t[p], last = t[q - 1];
        VI tie = {0};
        if (p >= 1)
            tie |= EQUAL(t[p - 1], first);
        if (q < n)
            tie |= EQUAL(t[q], last);
        tie &= (VI)(lane < cw);
        for (int h = 0; h < HALVES; h++) {
            const VD zero = {0};
            const VD value = rule == MEDIAN
                                 ? (NAME(half)(first, h) + NAME(half)(last, h)) * 0.5 + zero
                                 : NAME(torch_order_sum)(t, p, q - p, h) / (double)(q - p);
            NAME(store_half)(value, h, cw, out + c0);
        }
        const VI ok = ~tie & (VI)(lane < cw);
        for (int r = 0; r < n; r++)
            lanes[r] += NAME(lane_count)(u[r], first, last, ok, rule == MEDIAN);
        if (NAME(any)(tie))
            ntied = NAME(record_ties)(u, n, first, last, tie, p, q, c0, tied, ntied);
    }
    if (NAME(any)(nan))
        return -1;
    NAME(flush_counts)(lanes, n, counts);
    if (ntied > 0)
        NAME(tie_shares)(x, stride, n, tied, ntied, row, shares);
    return ntied;
}

ATTR static Py_ssize_t NAME(median)(const char *x, Py_ssize_t stride, const int64_t *rows, int n,
                                    Py_ssize_t c, int f, const int32_t *pairs, Py_ssize_t npairs,
                                    float *out, int64_t *counts, double *shares, void *work)
{
    (void)rows; /* all rows */
    return NAME(chunk)(x, stride, n, c, f, MEDIAN, pairs, npairs, out, counts, shares, work);
}

ATTR static Py_ssize_t NAME(trimmed)(const char *x, Py_ssize_t stride, const int64_t *rows,
                                     int n, Py_ssize_t c, int f, const int32_t *pairs,
                                     Py_ssize_t npairs, float *out, int64_t *counts,
                                     double *shares, void *work)
{
    (void)rows; /* all rows */
    return NAME(chunk)(x, stride, n, c, f, TRIMMED, pairs, npairs, out, counts, shares, work);
}

/* ---- Bulyan: the beta values closest to the median ---- */

typedef int64_t NAME(vdi) __attribute__((vector_size(sizeof(VD))));
#define VDI NAME(vdi)
#define DMIN(x, y) ((VD)(((VDI)(x) & (VDI)((x) < (y))) | ((VDI)(y) & ~(VDI)((x) < (y)))))
#define DMAX(x, y) ((VD)(((VDI)(x) & (VDI)((x) > (y))) | ((VDI)(y) & ~(VDI)((x) > (y)))))
#define DABS(x) ((VD)((VDI)(x) & NAME(magnitude)())) /* the sign bit cleared */

/* INT64_MAX in every lane: the bits of a float64 but its sign */
static inline __attribute__((always_inline)) ATTR VDI NAME(magnitude)(void)
{
    VDI m;
    for (int l = 0; l < HW; l++)
        m[l] = INT64_MAX;
    return m;
}

/* The least over the windows of k consecutive sorted values (of t, half h) of the greater
 * distance of their two ends from med: the k-th smallest distance of a value from med (the
 * k values closest to it lie in one window) */
static inline __attribute__((always_inline)) ATTR VD NAME(radius)(const V *t, int n, int k,
                                                                  VD med, int h)
{
    VD least = DMAX(med - NAME(half)(t[0], h), NAME(half)(t[k - 1], h) - med);
    for (int l = 1; l + k <= n; l++) {
        const VD r = DMAX(med - NAME(half)(t[l], h), NAME(half)(t[l + k - 1], h) - med);
        least = DMIN(least, r);
    }
    return least;
}

/* A tied lane's share of the window for a value at distance g from its column's median */
static inline double NAME(closest_share)(const tied_column *at, double g)
{
    return g == at->first  ? at->s_first
           : g == at->last ? at->s_last
           : (g > at->first && g < at->last) ? 1.0
                                             : 0.0;
}

/* A tied lane l of half h of the tile: its window's ends and their runs' shares into tied,
 * and the lane's mean, sum over the rows in order of share x value, into out */
static inline __attribute__((always_inline)) ATTR void
NAME(closest_tie)(const V *u, int n, int beta, double med, double first, double last, int lane,
                  Py_ssize_t col, tied_column *at, float *out)
{
    Py_ssize_t below_last = 0, upto_first = 0, upto_last = 0;
    for (int r = 0; r < n; r++) {
        const double g = fabs((double)u[r][lane] - med);
        upto_first += g <= first;
        below_last += g < last;
        upto_last += g <= last;
    }
    at->first = first;
    at->last = last;
    at->s_first = overlap(0, upto_first, 0, beta); /* nothing is nearer than the nearest */
    at->s_last = overlap(below_last, upto_last, 0, beta);
    at->col = col;
    at->med = med;
    double acc = 0.0;
    for (int r = 0; r < n; r++) {
        const double v = (double)u[r][lane];
        const double term = NAME(closest_share)(at, fabs(v - med)) * v;
        acc = r == 0 ? term : acc + term;
    }
    *out = (float)(acc / (double)beta + 0.0);
}

/* Bulyan's second step on a chunk (n, c) of the chosen rows: per column, the mean of the beta
 * values closest to the median (float64: the median the mean of the middle values, each value's
 * distance |v - med|, the kept values summed over the rows in order, a row left out adding
 * +0.0, divided by beta, plus 0.0: a zero mean is +0.0), rounded to float32; each row's count
 * of columns in which it was kept.
 * Where the beta-th and the next distance tie, the values at the window's ends share its
 * places as `_select.window_shares` gives them, the products share x value summed over the
 * rows in order; such a column is left out of the counts and its shares summed per row at the
 * end, as `chunk` does. Returns the number of tied columns, or -1 where a column holds a NaN. */
ATTR static Py_ssize_t NAME(closest)(const char *x, Py_ssize_t stride, const int64_t *rows,
                                     int n, Py_ssize_t c, int beta, const int32_t *pairs,
                                     Py_ssize_t npairs, float *out, int64_t *counts,
                                     double *shares, void *work)
{
    V *t = (V *)work, *u = t + n;
    VDI *lanes = (VDI *)(u + n); /* per row, HALVES vectors of counts (a hit is -1) */
    tied_column *tied = (tied_column *)(lanes + (Py_ssize_t)n * HALVES);
    double *row = (double *)(tied + c);
    const int lo = (n - 1) / 2, hi = n / 2;
    VI nan = {0};
    Py_ssize_t ntied = 0;
    memset(lanes, 0, (size_t)n * HALVES * sizeof(VDI));
    for (Py_ssize_t c0 = 0; c0 < c; c0 += W) {
        const int cw = c - c0 < W ? (int)(c - c0) : W;
        nan |= NAME(load_tile)(x, stride, rows, n, c0, cw, t, u);
        NAME(sort_tile)(t, pairs, npairs);
        for (int h = 0; h < HALVES; h++) {
            const VD a = NAME(half)(t[lo], h), b = NAME(half)(t[hi], h);
            const VD med = (a + b) * 0.5;
            const VD last = NAME(radius)(t, n, beta, med, h);
            VDI ok, tie = {0};
            for (int l = 0; l < HW; l++)
                ok[l] = h * HW + l < cw ? -1 : 0;
            if (beta < n)
                tie = (VDI)(NAME(radius)(t, n, beta + 1, med, h) == last) & ok;
            ok &= ~tie;
            VD acc = {0};
            for (int r = 0; r < n; r++) {
                const VD v = NAME(half)(u[r], h);
                const VDI keep = (VDI)(DABS(v - med) <= last);
                const VD term = (VD)((VDI)v & keep); /* v, or +0.0 */
                acc = r == 0 ? term : acc + term;
                lanes[r * HALVES + h] += keep & ok;
            }
            const VD zero = {0};
            NAME(store_half)(acc / (double)beta + zero, h, cw, out + c0);
            for (int l = 0; l < HW; l++) {
                if (!tie[l])
                    continue;
                const double first = fmin(fabs(a[l] - med[l]), fabs(b[l] - med[l]));
                NAME(closest_tie)(u, n, beta, med[l], first, last[l], h * HW + l,
                                  c0 + h * HW + l, tied + ntied, out + c0 + h * HW + l);
                ntied++;
            }
        }
    }
    if (NAME(any)(nan))
        return -1;
    for (int r = 0; r < n; r++) {
        int64_t hits = 0;
        for (int h = 0; h < HALVES; h++)
            for (int l = 0; l < HW; l++)
                hits -= lanes[r * HALVES + h][l];
        counts[r] += hits;
    }
    for (int r = 0; r < n && ntied > 0; r++) {
        const T *xr = (const T *)(x + ROW(rows, r) * stride);
        for (Py_ssize_t j = 0; j < ntied; j++)
            row[j] = NAME(closest_share)(tied + j, fabs((double)xr[tied[j].col] - tied[j].med));
        shares[r] = torch_sum(row, ntied);
    }
    return ntied;
}

#undef DABS
#undef DMIN
#undef DMAX
#undef VDI

#undef W
#undef HALVES
#undef HW
#undef NAME
#undef T
#undef V
#undef VI
#undef VD
#undef VH
#undef SUFFIX
#undef AVX512_CMP
#undef VMIN
#undef VMAX
#undef INSIDE
#undef LESS
#undef LESS_EQ
#undef EQUAL

#endif /* ORDERSTAT_TEMPLATE */
