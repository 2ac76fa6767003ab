/* Per-coordinate median and trimmed mean of a column chunk (n, c) in one pass over it (CPU).
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
 *   in which its value lies outside [v_f, v_(n-f-1)] (it was dropped).
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
 * shares without sorting or decoding: from each column's sign bytes and its group's scales in
 * ascending order (see `sign_cuts_group` and `zoo_gym.aggregation._signs`).
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

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

enum { MEDIAN = 0, TRIMMED = 1 };

/* A kernel runs one rule over a chunk: see `chunk` in the template below. */
typedef Py_ssize_t (*kernel_fn)(const char *x, Py_ssize_t stride, int n, Py_ssize_t c, int f,
                                const int32_t *pairs, Py_ssize_t npairs, float *out,
                                int64_t *counts, double *shares, void *work);

/* A column whose window of sorted positions [p, q) starts or ends inside a run of equal
 * values: the values at its ends and the share of the window each member of their runs
 * holds (`_select.window_shares`). */
typedef struct {
    double first, last, s_first, s_last;
    Py_ssize_t col;
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
    kernel_fn fns[2][2]; /* [dtype: float32, float64][rule: median, trimmed] */
} kernel_set;

static const kernel_set kernel_sets[] = {
    {"portable",
     {{median_f32_portable, trimmed_f32_portable}, {median_f64_portable, trimmed_f64_portable}}},
#ifdef ORDERSTAT_HAVE_X86
    {"avx2", {{median_f32_avx2, trimmed_f32_avx2}, {median_f64_avx2, trimmed_f64_avx2}}},
    {"avx512",
     {{median_f32_avx512, trimmed_f32_avx512}, {median_f64_avx512, trimmed_f64_avx512}}},
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
static int check_args(const Py_buffer *x, Py_ssize_t f, const Py_buffer *pairs,
                      const Py_buffer *out, const Py_buffer *counts, const Py_buffer *shares,
                      int rule)
{
    const char fx = format_of(x);
    if (x->ndim != 2 || (fx != 'f' && fx != 'd') || x->strides[1] != x->itemsize) {
        PyErr_SetString(PyExc_TypeError,
                        "x must be a 2-d float32 or float64 array (n, c), each row contiguous");
        return -1;
    }
    const Py_ssize_t n = x->shape[0], c = x->shape[1];
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
 * copy and the per-lane counts (n vectors each), the tied columns and a row of their shares
 * (c each), and room to align the start to 64 bytes. The caller keeps one per thread: a
 * kernel allocates nothing (blocks freed from several threads would raise glibc's mmap
 * threshold, and the heap would then keep the decoded chunks' memory). */
static Py_ssize_t work_size(Py_ssize_t n, Py_ssize_t c)
{
    return (3 * n + 1) * LANE_BYTES + c * (Py_ssize_t)(sizeof(tied_column) + sizeof(double));
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

static PyObject *run_rule(PyObject *args, int rule)
{
    PyObject *x_obj, *pairs_obj, *out_obj, *counts_obj, *shares_obj, *work_obj;
    Py_ssize_t f = 0;
    const char *kernel = NULL;
    if (rule == MEDIAN) {
        if (!PyArg_ParseTuple(args, "OOOOOO|z:median", &x_obj, &pairs_obj, &out_obj,
                              &counts_obj, &shares_obj, &work_obj, &kernel))
            return NULL;
    } else if (!PyArg_ParseTuple(args, "OnOOOOO|z:trimmed", &x_obj, &f, &pairs_obj, &out_obj,
                                 &counts_obj, &shares_obj, &work_obj, &kernel)) {
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
    if (got == 6 && check_args(&views[0], f, &views[1], &views[2], &views[3], &views[4], rule) == 0 &&
        check_work(&views[5], views[0].shape[0], views[0].shape[1]) == 0) {
        const Py_ssize_t n = views[0].shape[0], c = views[0].shape[1];
        const int dtype = format_of(&views[0]) == 'd';
        /* within `work`, 64-byte aligned: see work_size */
        char *work = (char *)views[5].buf;
        work += (LANE_BYTES - (uintptr_t)work % LANE_BYTES) % LANE_BYTES;
        kernel_fn fn = kernel_sets[k].fns[dtype][rule];
        Py_ssize_t tied;
        Py_BEGIN_ALLOW_THREADS
        tied = fn((const char *)views[0].buf, views[0].strides[0], (int)n, c, (int)f,
                  (const int32_t *)views[1].buf, views[1].len / 8, (float *)views[2].buf,
                  (int64_t *)views[3].buf, (double *)views[4].buf, work);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(tied);
    }
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

/* Values at four sorted positions of w columns of BitDelta values in one group, from their
 * signs (see `zoo_gym.aggregation._signs`): `sorted` (n, w) holds the rows' sign bytes (1:
 * negative) in ascending order of their scales, ascending[r * groups] the scale of row r.
 * With C(r) the negatives among the first r + 1 rows and N = C(n - 1), row r sits at sorted
 * position N - C(r) (negative) or N + r - C(r) (positive) in each column; the value of the
 * row sitting at pos[t] goes to out[t]; where `kept` is given, the float64 sum of the values
 * at positions [wp, wq) is added to it (float16 values: exact in any order). `counts` holds
 * 2 w int32: N, then C(r), per column. */
#if defined(ORDERSTAT_HAVE_X86) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void sign_cuts_group(const uint8_t *restrict sorted, int n, int w,
                            const float *restrict ascending, Py_ssize_t groups, const int pos[4],
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
        memcpy(&bits, &ascending[r * groups], 4);
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
        const double s64 = (double)ascending[r * groups];
        for (int j = 0; j < w; j++) {
            const int32_t neg = b[j];
            const int32_t at = total[j] - below[j] + (r & (neg - 1));
            const double v = neg ? -s64 : s64;
            kept[j] += (at >= wp) & (at < wq) ? v : 0.0;
        }
    }
}

/* Buffers of `sign_rule_group` for groups of up to w columns. */
typedef struct {
    int32_t *counts; /* 2 w: `sign_cuts_group`'s totals and running counts */
    int32_t *ends;   /* 4 w: the values below and up to first, below and up to last */
    int32_t *tied;   /* w: -1 in the tied columns, else 0 */
    uint32_t *cuts;  /* 4 w: values at positions p - 1, p, q - 1, q, as bits */
    double *kept;    /* w: sums of the values at positions [p, q) */
    uint8_t *signs;  /* n w: the group's sign bytes, its rows in ascending order of scale */
} sign_work;

/* One group's w columns of either rule from their signs: bits bit .. bit + w - 1 of each row
 * of `signs` (rows `stride` bytes apart; a set bit is a value >= 0), `order` the group's rows by ascending scale (order[r *
 * groups]) and `ascending` those scales (see `sign_cuts_group`). Its results into out (w,) float32, each row's count of the columns in which it
 * holds the window [p, q) (median) or lies outside it (trimmed) into counts (n,), but for the
 * tied columns (the window starts or ends inside a run of equal values): their indices
 * (col0 + j) go to tied_cols from *ntied on, the shares a row may hold in them to table (4
 * per column: 0, 1, the share of the run equal to first, of the run equal to last), and
 * each row's code of its share (0 .. 3) to codes (n rows of `cap`) at those columns; the
 * tie logic of `chunk` above. */
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

#if defined(ORDERSTAT_HAVE_X86) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void sign_rule_group(const uint8_t *restrict signs, Py_ssize_t stride, Py_ssize_t bit,
                            int n, int w,
                            const int64_t *restrict order, const float *restrict ascending,
                            Py_ssize_t groups, int p, int q, int rule, float *out,
                            int64_t *counts, uint8_t *codes, Py_ssize_t cap, Py_ssize_t col0,
                            int64_t *tied_cols, double *table, Py_ssize_t *ntied,
                            const sign_work *sw)
{
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
        unpack_negatives(signs + order[r * groups] * stride, bit, w, sorted + (Py_ssize_t)r * w);
    sign_cuts_group(sorted, n, w, ascending, groups, pos, rows, rule == TRIMMED ? kept : NULL, p,
                    q, sw->counts);
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
        const int64_t row = order[r * groups];
        const uint8_t *restrict b = sorted + (Py_ssize_t)r * w;
        int32_t hits = 0;
        for (int j = 0; j < w; j++) {
            const int32_t neg = b[j];
            below[j] += neg;
            const int32_t at = total[j] - below[j] + (r & (neg - 1));
            const int32_t in = (at >= p) & (at < q);
            hits += (rule == MEDIAN ? in : 1 - in) & ~tied[j];
        }
        counts[row] += hits;
        if (!any)
            continue;
        const float s = ascending[r * groups];
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
    for (int j = 0; j < w; j++) {
        if (!tied[j])
            continue;
        double *shares = table + 4 * *ntied;
        shares[0] = 0.0, shares[1] = 1.0;
        shares[2] = overlap(e[j], e[w + j], p, q);
        shares[3] = overlap(e[2 * w + j], e[3 * w + j], p, q);
        tied_cols[(*ntied)++] = col0 + j;
    }
    /* each row's share in the group's columns (read for the tied ones only) as a code: 0
     * outside the window, 1 inside, 2 equal to first, 3 equal to last */
    for (int r = 0; r < n; r++) {
        const int64_t row = order[r * groups];
        const uint8_t *restrict b = sorted + (Py_ssize_t)r * w;
        uint8_t *restrict code = codes + row * cap + col0;
        uint32_t bits;
        memcpy(&bits, &ascending[r * groups], 4);
        for (int j = 0; j < w; j++) {
            uint32_t vb = bits | ((uint32_t)b[j] << 31);
            float v;
            memcpy(&v, &vb, 4);
            const int32_t inside = (v > first[j]) & (v < last[j]);
            const int32_t at_first = v == first[j], at_last = v == last[j];
            code[j] = (uint8_t)(inside + 3 * at_last * (1 - at_first) + 2 * at_first);
        }
    }
}

/* sign_rule(signs, bit, m, phase, group, order, ascending, rule, f, out, counts, codes, col0,
 *           tied_cols, table, ntied) */
static PyObject *orderstat_sign_rule(PyObject *self, PyObject *args)
{
    PyObject *objs[8];
    Py_ssize_t bit, m, phase, group, col0, ntied;
    int rule, f;
    if (!PyArg_ParseTuple(args, "OnnnnOOiiOOOnOOn:sign_rule", &objs[0], &bit, &m, &phase, &group,
                          &objs[1], &objs[2], &rule, &f, &objs[3], &objs[4], &objs[5], &col0,
                          &objs[6], &objs[7], &ntied))
        return NULL;
    Py_buffer views[8];
    const int modes[8] = {PyBUF_STRIDES | PyBUF_FORMAT, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT};
    int got = 0;
    for (; got < 8; got++)
        if (PyObject_GetBuffer(objs[got], &views[got], modes[got]) < 0)
            break;
    PyObject *result = NULL;
    if (got == 8) {
        const Py_buffer *neg = &views[0], *ord = &views[1], *asc = &views[2], *mat = &views[5];
        const Py_ssize_t n = neg->ndim == 2 ? neg->shape[0] : 0;
        const Py_ssize_t nbytes = neg->ndim == 2 ? neg->shape[1] : 0;
        const Py_ssize_t groups = ord->ndim == 2 ? ord->shape[1] : 0;
        const Py_ssize_t cap = mat->ndim == 2 ? mat->shape[1] : 0;
        int ok = neg->ndim == 2 && format_of(neg) == 'B' && neg->strides[1] == 1 && bit >= 0 &&
                 m >= 1 && bit + m <= 8 * nbytes &&
                 ord->ndim == 2 && format_of(ord) == 'q' && ord->shape[0] == n &&
                 asc->ndim == 2 && format_of(asc) == 'f' && asc->shape[0] == n &&
                 asc->shape[1] == groups && format_of(&views[3]) == 'f' &&
                 views[3].len == 4 * m && format_of(&views[4]) == 'q' && views[4].len == 8 * n &&
                 mat->ndim == 2 && format_of(mat) == 'B' && mat->shape[0] == n &&
                 0 <= col0 && col0 + m <= cap && format_of(&views[6]) == 'q' && 0 <= ntied &&
                 ntied + m <= views[6].len / 8 && format_of(&views[7]) == 'd' &&
                 4 * (ntied + m) <= views[7].len / 8 && n >= 1 && n <= 8192 && group >= 1 &&
                 phase >= 0 && phase < group && groups == (phase + m + group - 1) / group &&
                 (rule == MEDIAN || (rule == TRIMMED && f >= 1 && 2 * f < n));
        const int64_t *o = (const int64_t *)ord->buf;
        for (Py_ssize_t k = 0; k < n * groups && ok; k++)
            ok = o[k] >= 0 && o[k] < n;
        const Py_ssize_t w = group < m ? group : m;
        char *block = ok ? PyMem_RawMalloc((size_t)w * (11 * 4 + 8 + n) + 8) : NULL;
        if (!ok) {
            PyErr_SetString(PyExc_ValueError,
                            "sign_rule needs signs (n, bytes) uint8 holding bits [bit, bit + m), "
                            "order (n, groups) int64, "
                            "ascending (n, groups) float32, out (m,) float32, counts (n,) int64, "
                            "codes (n, >= col0 + m) uint8, tied_cols (>= ntied + m,) int64, "
                            "table (>= 4 (ntied + m),) float64, "
                            "n <= 8192, 0 <= phase < group, "
                            "rule 0 (median) or 1 (trimmed, 1 <= f < n / 2)");
        } else if (block == NULL) {
            PyErr_NoMemory();
        } else {
            sign_work sw = {.counts = (int32_t *)block};
            sw.ends = sw.counts + 2 * w;
            sw.tied = sw.ends + 4 * w;
            sw.cuts = (uint32_t *)(sw.tied + w);
            sw.kept = (double *)(block + (11 * 4 * w + 7) / 8 * 8);
            sw.signs = (uint8_t *)(sw.kept + w);
            const int p = rule == MEDIAN ? (int)((n - 1) / 2) : f;
            const int q = rule == MEDIAN ? (int)(n / 2 + 1) : (int)n - f;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t g = 0; g < groups; g++) {
                const Py_ssize_t c0 = g * group - phase < 0 ? 0 : g * group - phase;
                const Py_ssize_t c1 = (g + 1) * group - phase > m ? m : (g + 1) * group - phase;
                sign_rule_group((const uint8_t *)neg->buf, neg->strides[0], bit + c0, (int)n,
                                (int)(c1 - c0), o + g, (const float *)asc->buf + g, groups, p, q,
                                rule, (float *)views[3].buf + c0, (int64_t *)views[4].buf,
                                (uint8_t *)mat->buf, cap, col0 + c0, (int64_t *)views[6].buf,
                                (double *)views[7].buf, &ntied, &sw);
            }
            Py_END_ALLOW_THREADS
            PyMem_RawFree(block);
            result = PyLong_FromSsize_t(ntied);
        }
    }
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    return result;
}

/* tie_rows(codes, tied_cols, table, ntied, shares, row): each row's torch.sum of its shares
 * in the columns tied_cols[:ntied], in that order: the share of code k in the t-th of them is
 * table[4 t + k] (gathered into `row`, >= ntied float64). */
static PyObject *orderstat_tie_rows(PyObject *self, PyObject *args)
{
    PyObject *objs[5];
    Py_ssize_t ntied;
    if (!PyArg_ParseTuple(args, "OOOnOO:tie_rows", &objs[0], &objs[1], &objs[2], &ntied, &objs[3],
                          &objs[4]))
        return NULL;
    Py_buffer views[5];
    int got = 0;
    for (; got < 5; got++)
        if (PyObject_GetBuffer(objs[got], &views[got],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got >= 3 ? PyBUF_WRITABLE : 0)) < 0)
            break;
    PyObject *result = NULL;
    if (got == 5) {
        const Py_buffer *mat = &views[0];
        const Py_ssize_t n = mat->ndim == 2 ? mat->shape[0] : 0;
        const Py_ssize_t cap = mat->ndim == 2 ? mat->shape[1] : 0;
        const int64_t *cols = (const int64_t *)views[1].buf;
        int ok = mat->ndim == 2 && format_of(mat) == 'B' && format_of(&views[1]) == 'q' &&
                 ntied >= 0 && ntied <= views[1].len / 8 && format_of(&views[2]) == 'd' &&
                 4 * ntied <= views[2].len / 8 && format_of(&views[3]) == 'd' &&
                 views[3].len == 8 * n && format_of(&views[4]) == 'd' && views[4].len >= 8 * ntied;
        for (Py_ssize_t k = 0; k < ntied && ok; k++)
            ok = cols[k] >= 0 && cols[k] < cap;
        if (!ok) {
            PyErr_SetString(PyExc_ValueError,
                            "tie_rows needs codes (n, cap) uint8, tied_cols (>= ntied,) int64 in "
                            "[0, cap), table (>= 4 ntied,) float64, shares (n,) float64, row (>= "
                            "ntied,) float64");
        } else {
            const uint8_t *codes = (const uint8_t *)mat->buf;
            const double *table = (const double *)views[2].buf;
            double *out = (double *)views[3].buf, *row = (double *)views[4].buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t r = 0; r < n; r++) {
                for (Py_ssize_t k = 0; k < ntied; k++)
                    row[k] = table[4 * k + (codes[r * cap + cols[k]] & 3)];
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
             "sign_rule(signs, bit, m, phase, group, order, ascending, rule, f, out, counts,\n"
             "          codes, col0, tied_cols, table, ntied)\n--\n\n"
             "median (rule 0) or trimmed (rule 1) of m columns of BitDelta values from their\n"
             "sign bits bit .. bit + m - 1 of each row of signs (n, bytes) uint8 (set: +scale),\n"
             "the first being value phase of its group; order (n, groups) int64 each group's\n"
             "rows by ascending scale, ascending (n, groups) float32 those scales. Into out (m,)\n"
             "float32, the rows' counts added to counts\n"
             "(n,) int64; the tied columns' indices (col0 + j) into tied_cols from ntied on, the\n"
             "shares a row may hold in them into table (4 each: 0, 1, the runs at the cuts) and\n"
             "each row's code of its share into codes (n, cap) uint8 at those columns. Returns\n"
             "ntied plus the number of tied columns.");

PyDoc_STRVAR(tie_rows_doc,
             "tie_rows(codes, tied_cols, table, ntied, shares, row)\n--\n\n"
             "shares (n,) float64: each row's torch.sum over t < ntied of table[4 t + code], code\n"
             "= codes[r, tied_cols[t]]; row: a float64 buffer of >= ntied values.");

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

PyDoc_STRVAR(work_size_doc,
             "work_size(n, c)\n--\n\n"
             "Bytes of the work buffer median and trimmed need for n rows and c columns.");

static PyMethodDef orderstat_methods[] = {
    {"network", orderstat_network, METH_VARARGS, network_doc},
    {"median", orderstat_median, METH_VARARGS, median_doc},
    {"trimmed", orderstat_trimmed, METH_VARARGS, trimmed_doc},
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
                                                                 int n, Py_ssize_t c0, int cw,
                                                                 V *t, V *u)
{
    VI nan = {0};
    const char *at = x + c0 * (Py_ssize_t)sizeof(T);
    for (int r = 0; r < n; r++, at += stride) {
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
        const T *xr = (const T *)(x + r * stride);
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
        nan |= NAME(load_tile)(x, stride, n, c0, cw, t, u);
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

ATTR static Py_ssize_t NAME(median)(const char *x, Py_ssize_t stride, int n, Py_ssize_t c,
                                    int f, const int32_t *pairs, Py_ssize_t npairs, float *out,
                                    int64_t *counts, double *shares, void *work)
{
    return NAME(chunk)(x, stride, n, c, f, MEDIAN, pairs, npairs, out, counts, shares, work);
}

ATTR static Py_ssize_t NAME(trimmed)(const char *x, Py_ssize_t stride, int n, Py_ssize_t c,
                                     int f, const int32_t *pairs, Py_ssize_t npairs, float *out,
                                     int64_t *counts, double *shares, void *work)
{
    return NAME(chunk)(x, stride, n, c, f, TRIMMED, pairs, npairs, out, counts, shares, work);
}

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
