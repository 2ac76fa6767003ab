/* The 1-bit product of BitDelta variants on the CPU: y = x @ (scale * sign)^T per variant.
 *
 * `product(x, out, starts, bits, scales, in_features, group, scale_kind, threads)` writes, for
 * every variant k and every row r in [starts[k], starts[k + 1]) of x (R, in) float32,
 *
 *     out[r, o] = sum_i x[r, i] * scale_k[(o * in + i) / group] * sign_k(o * in + i)
 *
 * into out (R, out_features) float32, where sign_k(f) is +1 when bit 7 - f % 8 of byte f / 8 of
 * bits[k] is set and -1 otherwise (the layout of `zoo_gym.compression.bitdelta`) and scale_k
 * are the variant's group scales (float16, bfloat16 or float32: `scale_kind` 0, 1 or 2).
 * Groups run over the row-major flattened (out, in) weight and may span rows.
 *
 * Lookup tables (the binary GEMM of BitDelta [Liu et al., 2024] and of LUT-GEMM [Park et al.,
 * 2024]): for each row of x and each byte column j (inputs 8j .. 8j + 7) the 256 sums
 * T_j[p] = sum_k (bit 7 - k of p ? x[8j + k] : -x[8j + k]) are built once (as the sums of two
 * 16-entry nibble tables), so each output reads one float per 8 weights instead of 8 products.
 * A group's lookups are added, then multiplied by its scale. On x86 CPUs with AVX-512 the
 * lookups of 16 consecutive bytes (128 weights) run as one gather. The sums are float32 and
 * are not added in the order of a dense matmul: results agree with `x @ W^T` to rounding.
 *
 * Needs in % 8 == 0 and group % 8 == 0 (no byte straddles two rows or two groups). The GIL is
 * released; the outputs are split among `threads` POSIX threads.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GEMM_HAVE_AVX512 1
#include <immintrin.h>
#endif

#define TABLE 256
#define MAX_THREADS 64

/* What a kernel keeps of one row of x: its byte-column tables (portable) or x with each 8
 * values reversed and the prefix sums over byte columns (AVX-512). */
typedef struct {
    float *table;    /* (in / 8, 256) */
    float *reversed; /* (in,) */
    double *prefix;  /* (in / 8 + 1,) */
} row_t;

typedef void (*prepare_fn)(const float *x, Py_ssize_t in, row_t *row);
/* One output: sum over the groups g that row o of the weight touches of
 * scale[g] * sum_i sign_i * x_i, for the packed bytes `bits` of row o (in / 8 of them). */
typedef float (*output_fn)(const row_t *row, const unsigned char *bits, Py_ssize_t o,
                           Py_ssize_t in, Py_ssize_t group, const void *scales, int kind);

/* Outputs o .. o + 3 into y[0 .. 3] where every row meets its groups at the same columns. */
typedef void (*outputs4_fn)(const row_t *row, const unsigned char *bits, Py_ssize_t o,
                            Py_ssize_t in, Py_ssize_t group, const void *scales, int kind,
                            float *y);

typedef struct {
    prepare_fn prepare;
    output_fn output;
    outputs4_fn outputs4; /* NULL where the kernel has none */
    const char *name;
} kernel_t;

/* One variant's operands. */
typedef struct {
    const unsigned char *bits;
    const void *scales;
    Py_ssize_t row0, row1; /* rows of x */
} variant_t;

typedef struct {
    const float *x;
    float *out;
    const variant_t *variants;
    Py_ssize_t n_variants, in, out_features, group, o0, o1;
    int scale_kind;
    const kernel_t *kernel;
    row_t row; /* this thread's buffers */
} job_t;

static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) {
        f = (float)mant * (1.0f / 16777216.0f); /* zero or subnormal: mant * 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static float scale_at(const void *scales, int kind, Py_ssize_t g)
{
    if (kind == 2)
        return ((const float *)scales)[g];
    uint16_t raw = ((const uint16_t *)scales)[g];
    if (kind == 0)
        return half_to_float(raw);
    uint32_t bits = (uint32_t)raw << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* T_j for every byte column j of the row x (in,), as the sums of two nibble tables. */
static void prepare_portable(const float *x, Py_ssize_t in, row_t *row)
{
    for (Py_ssize_t j = 0; j < in / 8; j++) {
        const float *v = x + 8 * j;
        float hi[16], lo[16];
        for (int n = 0; n < 16; n++) {
            hi[n] = ((n & 8) ? v[0] : -v[0]) + ((n & 4) ? v[1] : -v[1]) +
                    ((n & 2) ? v[2] : -v[2]) + ((n & 1) ? v[3] : -v[3]);
            lo[n] = ((n & 8) ? v[4] : -v[4]) + ((n & 4) ? v[5] : -v[5]) +
                    ((n & 2) ? v[6] : -v[6]) + ((n & 1) ? v[7] : -v[7]);
        }
        float *t = row->table + TABLE * j;
        for (int h = 0; h < 16; h++)
            for (int l = 0; l < 16; l++)
                t[16 * h + l] = hi[h] + lo[l];
    }
}

/* The first group of row o and the byte column where the next group starts. */
static inline Py_ssize_t group_end(Py_ssize_t g, Py_ssize_t o, Py_ssize_t in, Py_ssize_t group)
{
    Py_ssize_t end = ((g + 1) * group - o * in) / 8;
    return end < in / 8 ? end : in / 8;
}

static float output_portable(const row_t *row, const unsigned char *bits, Py_ssize_t o,
                             Py_ssize_t in, Py_ssize_t group, const void *scales, int kind)
{
    float total = 0.0f;
    for (Py_ssize_t j = 0, g = o * in / group; j < in / 8; g++) {
        const Py_ssize_t end = group_end(g, o, in, group);
        float a0 = 0.0f, a1 = 0.0f;
        for (; j + 2 <= end; j += 2) {
            a0 += row->table[TABLE * j + bits[j]];
            a1 += row->table[TABLE * (j + 1) + bits[j + 1]];
        }
        if (j < end)
            a0 += row->table[TABLE * j + bits[j]];
        j = end;
        total += scale_at(scales, kind, g) * (a0 + a1);
    }
    return total;
}

/* x with the 8 values of each byte column reversed (lane l of a mask is then bit l of the
 * byte, as AVX-512 reads masks) and the float64 prefix sums of the byte columns. */
static void prepare_masked(const float *x, Py_ssize_t in, row_t *row)
{
    double sum = 0.0;
    row->prefix[0] = 0.0;
    for (Py_ssize_t j = 0; j < in / 8; j++) {
        for (int k = 0; k < 8; k++) {
            row->reversed[8 * j + k] = x[8 * j + 7 - k];
            sum += x[8 * j + k];
        }
        row->prefix[j + 1] = sum;
    }
}

#ifdef GEMM_HAVE_AVX512
/* 2 * (sum of x over set bits) - (sum of all x), per group: one masked add per 16 weights,
 * the group's vector scaled into the row's total, one horizontal sum per output. */
__attribute__((target("avx512f,avx512bw,f16c"))) static float
output_avx512(const row_t *row, const unsigned char *bits, Py_ssize_t o, Py_ssize_t in,
              Py_ssize_t group, const void *scales, int kind)
{
    const float *x = row->reversed;
    __m512 total = _mm512_setzero_ps();
    double whole = 0.0;
    for (Py_ssize_t j = 0, g = o * in / group; j < in / 8; g++) {
        const Py_ssize_t end = group_end(g, o, in, group), first = j;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        uint16_t m[2];
        for (; j + 4 <= end; j += 4) {
            memcpy(m, bits + j, 4);
            a0 = _mm512_mask_add_ps(a0, _cvtu32_mask16(m[0]), a0, _mm512_loadu_ps(x + 8 * j));
            a1 = _mm512_mask_add_ps(a1, _cvtu32_mask16(m[1]), a1, _mm512_loadu_ps(x + 8 * j + 16));
        }
        for (; j < end; j++) /* one byte: lanes 8 .. 15 stay off (x is padded by 8 floats) */
            a0 = _mm512_mask_add_ps(a0, _cvtu32_mask16(bits[j]), a0, _mm512_loadu_ps(x + 8 * j));
        float scale = kind == 0 ? _cvtsh_ss(((const uint16_t *)scales)[g])
                                : scale_at(scales, kind, g);
        total = _mm512_fmadd_ps(_mm512_set1_ps(scale), _mm512_add_ps(a0, a1), total);
        whole += (double)scale * (row->prefix[end] - row->prefix[first]);
    }
    return (float)(2.0 * (double)_mm512_reduce_add_ps(total) - whole);
}
#endif

#ifdef GEMM_HAVE_AVX512
__attribute__((target("avx512f,avx512bw,f16c"))) static inline float
scale_fast(const void *scales, int kind, Py_ssize_t g)
{
    return kind == 0 ? _cvtsh_ss(((const uint16_t *)scales)[g]) : scale_at(scales, kind, g);
}

/* Four outputs o .. o + 3 at once where every row meets its groups at the same columns
 * (in % group == 0, or group % in == 0: one group per row); each x vector is loaded once for
 * the four rows and eight accumulators are in flight. */
__attribute__((target("avx512f,avx512bw,f16c"))) static void
outputs4_avx512(const row_t *row, const unsigned char *bits, Py_ssize_t o, Py_ssize_t in,
                Py_ssize_t group, const void *scales, int kind, float *y)
{
    const float *x = row->reversed;
    const Py_ssize_t row_bytes = in / 8, seg = in % group == 0 ? group / 8 : row_bytes;
    const Py_ssize_t per_row = in % group == 0 ? in / group : 0;
    __m512 t[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    double whole[4] = {0.0, 0.0, 0.0, 0.0};
    for (Py_ssize_t first = 0, k = 0; first < row_bytes; first += seg, k++) {
        __m512 a[4][2];
        for (int r = 0; r < 4; r++)
            a[r][0] = a[r][1] = _mm512_setzero_ps();
        Py_ssize_t j = first;
        for (; j + 4 <= first + seg; j += 4) {
            const __m512 x0 = _mm512_loadu_ps(x + 8 * j), x1 = _mm512_loadu_ps(x + 8 * j + 16);
            for (int r = 0; r < 4; r++) {
                uint32_t m;
                memcpy(&m, bits + r * row_bytes + j, 4);
                a[r][0] = _mm512_mask_add_ps(a[r][0], _cvtu32_mask16(m & 0xffffu), a[r][0], x0);
                a[r][1] = _mm512_mask_add_ps(a[r][1], _cvtu32_mask16(m >> 16), a[r][1], x1);
            }
        }
        for (; j < first + seg; j++) { /* one byte: lanes 8 .. 15 stay off */
            const __m512 x0 = _mm512_loadu_ps(x + 8 * j);
            for (int r = 0; r < 4; r++)
                a[r][0] = _mm512_mask_add_ps(a[r][0], _cvtu32_mask16(bits[r * row_bytes + j]),
                                             a[r][0], x0);
        }
        const double sum = row->prefix[first + seg] - row->prefix[first];
        for (int r = 0; r < 4; r++) {
            const Py_ssize_t g = per_row ? (o + r) * per_row + k : (o + r) * in / group;
            const float scale = scale_fast(scales, kind, g);
            t[r] = _mm512_fmadd_ps(_mm512_set1_ps(scale), _mm512_add_ps(a[r][0], a[r][1]), t[r]);
            whole[r] += (double)scale * sum;
        }
    }
    for (int r = 0; r < 4; r++)
        y[r] = (float)(2.0 * (double)_mm512_reduce_add_ps(t[r]) - whole[r]);
}
#endif

static const kernel_t portable_kernel = {prepare_portable, output_portable, NULL, "portable"};
#ifdef GEMM_HAVE_AVX512
static const kernel_t avx512_kernel = {prepare_masked, output_avx512, outputs4_avx512, "avx512"};
#endif
static const kernel_t *best_kernel = &portable_kernel;

/* out[r, o] for o in [o0, o1) of every row r of one variant. */
static void variant_rows(const job_t *job, const variant_t *v)
{
    const Py_ssize_t in = job->in, row_bytes = in / 8, group = job->group;
    row_t *mine = (row_t *)&job->row;
    for (Py_ssize_t r = v->row0; r < v->row1; r++) {
        job->kernel->prepare(job->x + r * in, in, mine);
        float *y = job->out + r * job->out_features;
        Py_ssize_t o = job->o0;
        if (job->kernel->outputs4 != NULL && (in % group == 0 || group % in == 0))
            for (; o + 4 <= job->o1; o += 4)
                job->kernel->outputs4(mine, v->bits + o * row_bytes, o, in, group, v->scales,
                                      job->scale_kind, y + o);
        for (; o < job->o1; o++)
            y[o] = job->kernel->output(&job->row, v->bits + o * row_bytes, o, in, group,
                                       v->scales, job->scale_kind);
    }
}

static void *run_job(void *arg)
{
    const job_t *job = (const job_t *)arg;
    for (Py_ssize_t k = 0; k < job->n_variants; k++)
        variant_rows(job, &job->variants[k]);
    return NULL;
}

/* Split the outputs among the threads (the first runs on the caller's) and wait. */
static int run_jobs(job_t *jobs, int threads)
{
    pthread_t ids[MAX_THREADS];
    int started = 0, failed = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, run_job, &jobs[t]) != 0) {
            failed = 1;
            break;
        }
        started = t;
    }
    if (!failed)
        run_job(&jobs[0]);
    for (int t = 1; t <= started; t++)
        pthread_join(ids[t], NULL);
    return failed ? -1 : 0;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t need,
                      const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

typedef struct {
    Py_ssize_t rows, in, out_features, group;
    int scale_kind, threads;
} shape_t;

/* Check and hold the buffers of every variant; returns how many were taken (-1 on error). */
static Py_ssize_t take_variants(PyObject *starts, PyObject *bits, PyObject *scales,
                                const shape_t *s, variant_t *variants, Py_buffer *views)
{
    const Py_ssize_t n = PyList_GET_SIZE(bits);
    const Py_ssize_t weights = s->out_features * s->in;
    const Py_ssize_t n_scales = (weights + s->group - 1) / s->group;
    const Py_ssize_t scale_bytes = s->scale_kind == 2 ? 4 : 2;
    Py_ssize_t taken = 0, previous = 0;
    for (; taken < n; taken++) {
        Py_ssize_t row0 = PyLong_AsSsize_t(PyList_GET_ITEM(starts, taken));
        Py_ssize_t row1 = PyLong_AsSsize_t(PyList_GET_ITEM(starts, taken + 1));
        if (PyErr_Occurred())
            break;
        if (row0 < previous || row1 < row0 || row1 > s->rows) {
            PyErr_SetString(PyExc_ValueError, "starts must rise within the rows of x");
            break;
        }
        previous = row1;
        if (get_buffer(PyList_GET_ITEM(bits, taken), &views[2 * taken], 0, weights / 8,
                       "bits") < 0)
            break;
        if (get_buffer(PyList_GET_ITEM(scales, taken), &views[2 * taken + 1], 0,
                       n_scales * scale_bytes, "scales") < 0) {
            PyBuffer_Release(&views[2 * taken]);
            break;
        }
        variants[taken] = (variant_t){views[2 * taken].buf, views[2 * taken + 1].buf, row0, row1};
    }
    if (taken == n)
        return n;
    for (Py_ssize_t k = 0; k < taken; k++) {
        PyBuffer_Release(&views[2 * k]);
        PyBuffer_Release(&views[2 * k + 1]);
    }
    return -1;
}

/* Per-thread buffers of the chosen kernel, in one allocation. */
static size_t row_floats(Py_ssize_t in)
{
    return (size_t)TABLE * (size_t)(in / 8) + (size_t)in + 8 + 2 * (size_t)(in / 8 + 1);
}

static int compute(const Py_buffer *x, Py_buffer *out, const variant_t *variants, Py_ssize_t n,
                   const shape_t *s)
{
    const int threads = s->threads;
    const size_t per_thread = row_floats(s->in);
    float *buffers = PyMem_RawMalloc(sizeof(float) * (size_t)threads * per_thread);
    job_t *jobs = PyMem_RawMalloc(sizeof(job_t) * (size_t)threads);
    if (buffers == NULL || jobs == NULL) {
        PyMem_RawFree(buffers);
        PyMem_RawFree(jobs);
        PyErr_NoMemory();
        return -1;
    }
    for (int t = 0; t < threads; t++) {
        float *mine = buffers + (size_t)t * per_thread;
        float *reversed = mine + (size_t)TABLE * (size_t)(s->in / 8);
        double *prefix = (double *)(void *)(reversed + s->in + 8); /* 8 floats of padding */
        jobs[t] = (job_t){x->buf, out->buf, variants, n, s->in, s->out_features, s->group,
                          s->out_features * t / threads, s->out_features * (t + 1) / threads,
                          s->scale_kind, best_kernel, {mine, reversed, prefix}};
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = run_jobs(jobs, threads);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(buffers);
    PyMem_RawFree(jobs);
    if (failed)
        PyErr_SetString(PyExc_RuntimeError, "could not start a worker thread");
    return failed ? -1 : 0;
}

static int check_shape(const shape_t *s, PyObject *starts, PyObject *bits, PyObject *scales)
{
    if (!PyList_Check(starts) || !PyList_Check(bits) || !PyList_Check(scales) ||
        PyList_GET_SIZE(bits) != PyList_GET_SIZE(scales) ||
        PyList_GET_SIZE(starts) != PyList_GET_SIZE(bits) + 1) {
        PyErr_SetString(PyExc_ValueError, "starts, bits and scales must be lists of n + 1, n, n");
        return -1;
    }
    if (s->in <= 0 || s->in % 8 || s->group <= 0 || s->group % 8) {
        PyErr_SetString(PyExc_ValueError, "in_features and group must be positive multiples of 8");
        return -1;
    }
    if (s->scale_kind < 0 || s->scale_kind > 2 || s->threads < 1 || s->threads > MAX_THREADS) {
        PyErr_SetString(PyExc_ValueError, "scale_kind must be 0, 1 or 2 and threads 1 to 64");
        return -1;
    }
    return 0;
}

static PyObject *gemm_product(PyObject *self, PyObject *args)
{
    PyObject *x_obj, *out_obj, *starts, *bits, *scales;
    shape_t s;
    if (!PyArg_ParseTuple(args, "OOOOOnnii:product", &x_obj, &out_obj, &starts, &bits, &scales,
                          &s.in, &s.group, &s.scale_kind, &s.threads))
        return NULL;
    if (check_shape(&s, starts, bits, scales) < 0)
        return NULL;
    Py_buffer x, out;
    if (get_buffer(x_obj, &x, 0, 0, "x") < 0)
        return NULL;
    s.rows = x.len / (4 * s.in);
    if (get_buffer(out_obj, &out, 1, 4, "out") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    s.out_features = s.rows ? out.len / (4 * s.rows) : 1;
    PyObject *result = NULL;
    const Py_ssize_t n = PyList_GET_SIZE(bits);
    variant_t *variants = PyMem_Malloc(sizeof(variant_t) * (size_t)(n + 1));
    Py_buffer *views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(2 * n + 1));
    if (variants == NULL || views == NULL) {
        PyErr_NoMemory();
    } else if (x.len != 4 * s.in * s.rows || out.len != 4 * s.out_features * s.rows) {
        PyErr_SetString(PyExc_ValueError, "x must be (R, in) and out (R, out) float32");
    } else if (take_variants(starts, bits, scales, &s, variants, views) == n) {
        if (compute(&x, &out, variants, n, &s) == 0)
            result = Py_NewRef(Py_None);
        for (Py_ssize_t k = 0; k < n; k++) {
            PyBuffer_Release(&views[2 * k]);
            PyBuffer_Release(&views[2 * k + 1]);
        }
    }
    PyMem_Free(variants);
    PyMem_Free(views);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(product_doc,
             "product(x, out, starts, bits, scales, in_features, group, scale_kind, threads)\n"
             "--\n\n"
             "Write the 1-bit product of each variant k (packed sign bytes bits[k], group\n"
             "scales scales[k]: float16, bfloat16 or float32 for scale_kind 0, 1, 2) with the\n"
             "rows starts[k] .. starts[k + 1] of x (R, in) float32 into those rows of out\n"
             "(R, out) float32, on `threads` threads.");

static PyMethodDef gemm_methods[] = {
    {"product", gemm_product, METH_VARARGS, product_doc},
    {NULL, NULL, 0, NULL},
};

static int gemm_exec(PyObject *module)
{
#ifdef GEMM_HAVE_AVX512
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        best_kernel = &avx512_kernel;
#endif
    return PyModule_AddStringConstant(module, "kernel", best_kernel->name);
}

static PyModuleDef_Slot gemm_slots[] = {
    {Py_mod_exec, gemm_exec},
    {0, NULL},
};

static struct PyModuleDef gemm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zoo_gym.serving._binary_gemm",
    .m_doc = "The 1-bit product of BitDelta variants with rows of x, by lookup tables (CPU).",
    .m_size = 0,
    .m_methods = gemm_methods,
    .m_slots = gemm_slots,
};

PyMODINIT_FUNC PyInit__binary_gemm(void)
{
    return PyModuleDef_Init(&gemm_module);
}
