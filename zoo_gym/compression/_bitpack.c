/* BitDelta packing on the CPU in one pass: sign bits and group sums of |x| (Liu et al., 2024).
 *
 * `pack(x, group, bits, bits_at, sums, sums_at)` reads the float32 values x (n,) once and
 * writes, for every value, its sign bit into `bits` from byte `bits_at` on, and for every group
 * of `group` values the float32 sum of |x| into `sums` from index `sums_at` on.
 *
 * Bit layout (as `zoo_gym.compression.bitdelta`): value 8i + j is bit 7 - j of byte i, 1 when
 * the value is >= 0 (so 0 and -0.0 give 1, NaN gives 0); unused low bits of the last byte are 0.
 *
 * Each group's sum performs the additions of PyTorch's CPU `torch.sum` over a contiguous float32
 * row (`cascade_sum` in aten/src/ATen/native/cpu/SumKernel.cpp, 8-lane vectors), in the same
 * order, so the sums equal that call's bit for bit: vector v (values 8v .. 8v + 7) is added
 * lane-wise into accumulator v % 4; after every block of 16 quads (64 vectors) the four
 * accumulators are added into a second level and cleared; at the end of the row the second
 * level is added into the first, then the vectors after the last whole quad into accumulator 0,
 * then accumulators 1, 2 and 3 into accumulator 0, and its 8 lanes into 0.0 from left to right.
 * For groups up to 8192 values (256 quads) the levels above the second only ever add a sum to
 * zero, which is exact, so two levels give the same bits. A partial last group is summed as if
 * padded with zeros, as the torch path pads it. The file must be compiled without -ffast-math
 * (which would let the compiler reorder the additions); -ffp-contract=off keeps it from fusing
 * operations, although the pass only adds.
 *
 * Two kernels compute the same additions: a portable one and, on x86 with GCC or Clang, an
 * AVX2 one chosen at run time when the CPU has AVX2. Only the width of the machine
 * instructions differs; each lane of an accumulator sees the same additions in the same order.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define BITPACK_HAVE_AVX2 1
#include <immintrin.h>
#endif

#define LANES 8       /* floats per vector of PyTorch's x86 cascade_sum */
#define ILP 4         /* interleaved accumulators (vectors per quad) */
#define BLOCK 16      /* quads per first-level block */
#define MAX_GROUP 8192

typedef float (*group_fn)(const float *x, Py_ssize_t group, unsigned char *bits);

static unsigned char reversed_bits[256]; /* byte b with its bit order reversed */

/* Add |x| of vector x (8 values) lane-wise into acc and store its sign byte. */
static inline void portable_vector(float *acc, const float *x, unsigned char *byte)
{
    unsigned int b = 0;
    for (int l = 0; l < LANES; l++) {
        b |= (unsigned int)(x[l] >= 0.0f) << (LANES - 1 - l);
        acc[l] += fabsf(x[l]);
    }
    *byte = (unsigned char)b;
}

/* One whole group: store its group / 8 sign bytes in bits and return its sum of |x|. */
static float portable_group(const float *x, Py_ssize_t group, unsigned char *bits)
{
    float acc[ILP][LANES] = {{0.0f}};
    float level[ILP][LANES] = {{0.0f}};
    const Py_ssize_t vectors = group / LANES;
    const Py_ssize_t quads = vectors / ILP;
    Py_ssize_t v = 0;
    for (Py_ssize_t b = 0; b < quads / BLOCK; b++) {
        for (int j = 0; j < BLOCK; j++, v += ILP)
            for (int k = 0; k < ILP; k++)
                portable_vector(acc[k], x + (v + k) * LANES, bits + v + k);
        for (int k = 0; k < ILP; k++) {
            for (int l = 0; l < LANES; l++) {
                level[k][l] += acc[k][l];
                acc[k][l] = 0.0f;
            }
        }
    }
    for (; v < quads * ILP; v += ILP)
        for (int k = 0; k < ILP; k++)
            portable_vector(acc[k], x + (v + k) * LANES, bits + v + k);
    for (int k = 0; k < ILP; k++)
        for (int l = 0; l < LANES; l++)
            acc[k][l] += level[k][l];
    for (; v < vectors; v++)
        portable_vector(acc[0], x + v * LANES, bits + v);
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < LANES; l++)
            acc[0][l] += acc[k][l];
    float total = 0.0f;
    for (int l = 0; l < LANES; l++)
        total += acc[0][l];
    return total;
}

#ifdef BITPACK_HAVE_AVX2
/* The AVX2 kernel: one 8-lane register per accumulator, the same additions as above. */
#define AVX2_VECTOR(acc, v)                                                            \
    do {                                                                               \
        const __m256 y = _mm256_loadu_ps(x + (v) * LANES);                             \
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(y, zero, _CMP_GE_OQ));          \
        bits[v] = reversed_bits[m];                                                    \
        acc = _mm256_add_ps(acc, _mm256_and_ps(y, magnitude));                         \
    } while (0)

__attribute__((target("avx2"))) static float avx2_group(const float *x, Py_ssize_t group,
                                                        unsigned char *bits)
{
    const __m256 zero = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero;
    __m256 o0 = zero, o1 = zero, o2 = zero, o3 = zero;
    const Py_ssize_t vectors = group / LANES;
    const Py_ssize_t quads = vectors / ILP;
    Py_ssize_t v = 0;
    for (Py_ssize_t b = 0; b < quads / BLOCK; b++) {
        for (int j = 0; j < BLOCK; j++, v += ILP) {
            AVX2_VECTOR(a0, v);
            AVX2_VECTOR(a1, v + 1);
            AVX2_VECTOR(a2, v + 2);
            AVX2_VECTOR(a3, v + 3);
        }
        o0 = _mm256_add_ps(o0, a0);
        o1 = _mm256_add_ps(o1, a1);
        o2 = _mm256_add_ps(o2, a2);
        o3 = _mm256_add_ps(o3, a3);
        a0 = a1 = a2 = a3 = zero;
    }
    for (; v < quads * ILP; v += ILP) {
        AVX2_VECTOR(a0, v);
        AVX2_VECTOR(a1, v + 1);
        AVX2_VECTOR(a2, v + 2);
        AVX2_VECTOR(a3, v + 3);
    }
    a0 = _mm256_add_ps(a0, o0);
    a1 = _mm256_add_ps(a1, o1);
    a2 = _mm256_add_ps(a2, o2);
    a3 = _mm256_add_ps(a3, o3);
    for (; v < vectors; v++)
        AVX2_VECTOR(a0, v);
    a0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3);
    float lanes[LANES];
    _mm256_storeu_ps(lanes, a0);
    float total = 0.0f;
    for (int l = 0; l < LANES; l++)
        total += lanes[l];
    return total;
}
#endif

/* The kernels this build has, by name; `usable` is filled in when the module loads. */
static const char *const kernel_names[] = {
    "portable",
#ifdef BITPACK_HAVE_AVX2
    "avx2",
#endif
};
static const group_fn kernel_fns[] = {
    portable_group,
#ifdef BITPACK_HAVE_AVX2
    avx2_group,
#endif
};
#define N_KERNELS ((int)(sizeof(kernel_fns) / sizeof(kernel_fns[0])))
static int usable[N_KERNELS];
static int best = 0;

/* Signs and sums of x (n,): whole groups in place, a partial last group through a copy padded
 * with zeros (whose sign bits are then cleared). */
static void pack_tensor(const float *x, Py_ssize_t n, Py_ssize_t group, unsigned char *bits,
                        float *sums, group_fn fn)
{
    const Py_ssize_t full = n / group;
    for (Py_ssize_t g = 0; g < full; g++)
        sums[g] = fn(x + g * group, group, bits + g * (group / LANES));
    const Py_ssize_t tail = n - full * group;
    if (tail == 0)
        return;
    float padded[MAX_GROUP];
    unsigned char padded_bits[MAX_GROUP / LANES];
    memcpy(padded, x + full * group, (size_t)tail * sizeof(float));
    memset(padded + tail, 0, (size_t)(group - tail) * sizeof(float));
    sums[full] = fn(padded, group, padded_bits);
    const Py_ssize_t nbytes = (tail + LANES - 1) / LANES;
    if (tail % LANES)
        padded_bits[nbytes - 1] &= (unsigned char)(0xFF << (LANES - tail % LANES));
    memcpy(bits + full * (group / LANES), padded_bits, (size_t)nbytes);
}

static int is_float32(const Py_buffer *view)
{
    const char *f = view->format;
    if (view->itemsize != 4 || f == NULL)
        return 0;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    return f[0] == 'f' && f[1] == '\0';
}

static int kernel_index(const char *name)
{
    if (name == NULL)
        return best;
    for (int k = 0; k < N_KERNELS; k++) {
        if (strcmp(name, kernel_names[k]) == 0) {
            if (usable[k])
                return k;
            PyErr_Format(PyExc_ValueError, "kernel %s is not supported by this CPU", name);
            return -1;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown kernel %s; see `kernels`", name);
    return -1;
}

/* Checks of the arguments; 0 when they are usable, -1 with an exception set otherwise. */
static int check_args(const Py_buffer *x, Py_ssize_t group, const Py_buffer *bits,
                      Py_ssize_t bits_at, const Py_buffer *sums, Py_ssize_t sums_at)
{
    if (!is_float32(x) || !is_float32(sums)) {
        PyErr_SetString(PyExc_TypeError, "x and sums must be contiguous float32 buffers");
        return -1;
    }
    if (bits->itemsize != 1) {
        PyErr_SetString(PyExc_TypeError, "bits must be a contiguous byte buffer");
        return -1;
    }
    if (group < LANES || group > MAX_GROUP || group % LANES) {
        PyErr_Format(PyExc_ValueError, "group must be a multiple of 8 from 8 to %d, got %zd",
                     MAX_GROUP, group);
        return -1;
    }
    const Py_ssize_t n = x->len / 4;
    const Py_ssize_t nbytes = (n + LANES - 1) / LANES;
    const Py_ssize_t ngroups = (n + group - 1) / group;
    if (bits_at < 0 || bits_at > bits->len - nbytes || sums_at < 0 ||
        sums_at > sums->len / 4 - ngroups) {
        PyErr_Format(PyExc_ValueError,
                     "%zd values need %zd bytes from offset %zd (bits holds %zd) and %zd sums "
                     "from offset %zd (sums holds %zd)",
                     n, nbytes, bits_at, bits->len, ngroups, sums_at, sums->len / 4);
        return -1;
    }
    return 0;
}

static PyObject *bitpack_pack(PyObject *self, PyObject *args)
{
    PyObject *x_obj, *bits_obj, *sums_obj;
    Py_ssize_t group, bits_at, sums_at;
    const char *kernel = NULL;
    if (!PyArg_ParseTuple(args, "OnOnOn|z:pack", &x_obj, &group, &bits_obj, &bits_at,
                          &sums_obj, &sums_at, &kernel))
        return NULL;
    const int k = kernel_index(kernel);
    if (k < 0)
        return NULL;
    Py_buffer x, bits, sums;
    if (PyObject_GetBuffer(x_obj, &x, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(bits_obj, &bits, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (PyObject_GetBuffer(sums_obj, &sums,
                           PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&bits);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_args(&x, group, &bits, bits_at, &sums, sums_at) == 0) {
        const float *values = (const float *)x.buf;
        unsigned char *out_bits = (unsigned char *)bits.buf + bits_at;
        float *out_sums = (float *)sums.buf + sums_at;
        const Py_ssize_t n = x.len / 4;
        Py_BEGIN_ALLOW_THREADS
        pack_tensor(values, n, group, out_bits, out_sums, kernel_fns[k]);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&bits);
    PyBuffer_Release(&sums);
    return result;
}

PyDoc_STRVAR(pack_doc,
             "pack(x, group, bits, bits_at, sums, sums_at, kernel=None)\n--\n\n"
             "Write the sign bits of the contiguous float32 buffer x (n,) into the byte buffer\n"
             "bits[bits_at : bits_at + ceil(n / 8)] and the float32 sum of |x| over each group\n"
             "of `group` values (a multiple of 8 up to 8192) into\n"
             "sums[sums_at : sums_at + ceil(n / group)], added in the order of torch.sum over a\n"
             "contiguous float32 row on the CPU. `kernel` names one of `kernels` (default: the\n"
             "fastest this CPU runs); all give the same bytes.");

/* gather(sources, starts, count, out): row i of out gets bytes starts[i] .. starts[i] + count
 * - 1 of sources[i]. */
static PyObject *bitpack_gather(PyObject *self, PyObject *args)
{
    PyObject *sources, *starts_obj, *out_obj;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "OOnO:gather", &sources, &starts_obj, &count, &out_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(sources, "gather: sources must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_buffer starts, out;
    if (PyObject_GetBuffer(starts_obj, &starts, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&starts);
        Py_DECREF(seq);
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char *format = starts.format == NULL ? "B" : starts.format;
    PyObject *result = NULL;
    if (starts.itemsize != 8 || strchr("qlQL", format[strlen(format) - 1]) == NULL ||
        starts.len != 8 * n || out.ndim != 2 || out.itemsize != 1 || out.shape[0] != n ||
        out.strides[1] != 1 || count < 0 || count > out.shape[1]) {
        PyErr_SetString(PyExc_ValueError,
                        "gather needs starts (n,) int64 for n sources and out (n, >= count) "
                        "uint8 with contiguous rows");
        goto done;
    }
    const int64_t *at = (const int64_t *)starts.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer src;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &src, PyBUF_SIMPLE) < 0)
            goto done;
        const int fits = at[i] >= 0 && at[i] <= src.len && count <= src.len - at[i];
        if (fits)
            memcpy((char *)out.buf + i * out.strides[0], (const char *)src.buf + at[i],
                   (size_t)count);
        PyBuffer_Release(&src);
        if (!fits) {
            PyErr_Format(PyExc_ValueError, "gather: bytes [%lld, %lld) lie outside source %zd",
                         (long long)at[i], (long long)(at[i] + count), i);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&starts);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(gather_doc,
             "gather(sources, starts, count, out)\n--\n\n"
             "Copy bytes starts[i] .. starts[i] + count - 1 of each buffer sources[i] into row i\n"
             "of out (n, >= count) uint8; starts (n,) int64.");

static PyMethodDef bitpack_methods[] = {
    {"pack", bitpack_pack, METH_VARARGS, pack_doc},
    {"gather", bitpack_gather, METH_VARARGS, gather_doc},
    {NULL, NULL, 0, NULL},
};

static int bitpack_exec(PyObject *module)
{
    for (int b = 0; b < 256; b++) {
        unsigned int r = 0;
        for (int i = 0; i < 8; i++)
            r |= (unsigned int)((b >> i) & 1) << (7 - i);
        reversed_bits[b] = (unsigned char)r;
    }
    usable[0] = 1;
#ifdef BITPACK_HAVE_AVX2
    __builtin_cpu_init();
    usable[1] = __builtin_cpu_supports("avx2") ? 1 : 0;
    best = usable[1] ? 1 : 0;
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
        PyObject *name = PyUnicode_FromString(kernel_names[k]);
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
    return PyModule_AddIntConstant(module, "MAX_GROUP", MAX_GROUP);
}

static PyModuleDef_Slot bitpack_slots[] = {
    {Py_mod_exec, bitpack_exec},
    {0, NULL},
};

static struct PyModuleDef bitpack_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zoo_gym.compression._bitpack",
    .m_doc = "BitDelta sign bits and group sums of |x| in one pass over the values (CPU).",
    .m_size = 0,
    .m_methods = bitpack_methods,
    .m_slots = bitpack_slots,
};

PyMODINIT_FUNC PyInit__bitpack(void)
{
    return PyModuleDef_Init(&bitpack_module);
}
