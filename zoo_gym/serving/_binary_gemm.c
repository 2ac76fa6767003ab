/* The 1-bit product of BitDelta variants on the CPU: out += x @ (scale * sign)^T per variant.
 *
 * `accumulate(x, out, rows, starts, bits, scales, in_features, group, scale_kind, threads)` adds,
 * for every variant k and every index i in [starts[k], starts[k + 1]) of rows (R,) int64, with
 * r = rows[i],
 *
 *     out[r, o] += sum_i' x[r, i'] * scale_k[(o * in + i') / group] * sign_k(o * in + i')
 *
 * to out (X, out_features) float32 for x (X, in) float32, where sign_k(f) is +1 when bit
 * 7 - f % 8 of byte f / 8 of bits[k] is set and -1 otherwise (the layout of
 * `zoo_gym.compression.bitdelta`) and scale_k are the variant's group scales (float16, bfloat16
 * or float32: `scale_kind` 0, 1 or 2). Groups run over the row-major flattened (out, in) weight
 * and may span rows. The products go straight into the rows of the base's output: no buffer,
 * no gather.
 *
 * On x86 CPUs with AVX-512, where rows hold whole groups of a multiple of 32 weights (groups
 * of 128 and layer inputs a multiple of 128, as in every layer of Qwen2.5), 16 or 32 outputs
 * run at once, one per lane, by nibble tables (the LUT-GEMM of [Park et al., 2024]): for each
 * 4 inputs of a row of x the 16 sums sum_k (bit 3 - k of p ? x_k : -x_k) are one register,
 * and a permute picks, for each of 16 outputs, the entry its 4 sign bits select (the rows'
 * bits interleaved by dwords when the variant was loaded, `lanes`, or transposed here 64 bytes
 * at a time), so one permute, one shift and one add cover 64 weights;
 * each group's 16 sums are then scaled by their rows' scales (32 outputs share each load of a
 * table). The other outputs are 2 * (sum of x over set bits) - (sum of x) per
 * group: one masked add per 16 weights, eight or four outputs sharing each load of x.
 * Elsewhere, byte tables (the binary GEMM of BitDelta [Liu et al., 2024]): for each row of x and
 * each byte column j (inputs 8j .. 8j + 7) the 256 sums T_j[p] = sum_k (bit 7 - k of p ?
 * x[8j + k] : -x[8j + k]) are built once (as the sums of two 16-entry nibble tables), so each
 * output reads one float per 8 weights. The sums are float32 and are not added in the order of a
 * dense matmul: results agree with `x @ W^T` to rounding.
 *
 * Needs in % 8 == 0 and group % 8 == 0 (no byte straddles two rows or two groups). The GIL is
 * released; the outputs are split among `threads` threads (each adds to its own columns): an
 * OpenMP team where the build has OpenMP, POSIX threads otherwise.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>

#include "../core/_floats.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GEMM_HAVE_AVX512 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#endif

#define TABLE 256
/* bytes of signs requested ahead of the nibble kernel's reads: without it one thread read them
 * at 3.0 GB/s from memory, with 8 KiB at 5.0 (LM head, 30 variants) */
#define PREFETCH 8192
#define MAX_THREADS 64

/* What a kernel keeps of one row of x: its byte-column tables (portable) or x with each 8
 * values reversed, the prefix sums over byte columns and the scales of four outputs
 * (AVX-512). */
typedef struct {
    float *table;    /* (in / 8, 256) portable, (in / 4, 16) AVX-512 where `nibbles` */
    float *reversed; /* (in + 8,) */
    double *prefix;  /* (in / 8 + 1,) */
    float *scales;   /* (in,): 32 outputs' scales, at most in / 32 groups each */
    int nibbles;     /* build the 16-entry tables of each 4 inputs (AVX-512) */
    int lanes;       /* the bits of each whole block of 16 rows interleaved by dwords */
} row_t;

typedef void (*prepare_fn)(const float *x, Py_ssize_t in, row_t *row);
/* One output: sum over the groups g that row o of the weight touches of
 * scale[g] * sum_i sign_i * x_i, for the packed bytes `bits` of row o (in / 8 of them). */
typedef float (*output_fn)(const row_t *row, const unsigned char *bits, Py_ssize_t o,
                           Py_ssize_t in, Py_ssize_t group, const void *scales, int kind);

/* Adds outputs o0 .. o1 of a row of x to its output row y, as many as the kernel's blocks take;
 * returns the first output it did not add (the variant's bits and scales whole). */
typedef Py_ssize_t (*block_fn)(row_t *row, const unsigned char *bits, Py_ssize_t o0,
                               Py_ssize_t o1, Py_ssize_t in, Py_ssize_t group,
                               const void *scales, int kind, float *y);

typedef struct {
    prepare_fn prepare;
    output_fn output;
    block_fn block; /* NULL where the kernel has none */
    const char *name;
} kernel_t;

/* One variant's operands: its bits, its scales and its entries of `rows`. */
typedef struct {
    const unsigned char *bits;
    const void *scales;
    Py_ssize_t first, last;
} variant_t;

typedef struct {
    const float *x;
    float *out;
    const int64_t *rows;
    const variant_t *variants;
    Py_ssize_t n_variants, in, out_features, group, o0, o1;
    int scale_kind;
    const kernel_t *kernel;
    row_t row; /* this thread's buffers */
} job_t;

static float scale_at(const void *scales, int kind, Py_ssize_t g)
{
    if (kind == 2)
        return ((const float *)scales)[g];
    const uint16_t raw = ((const uint16_t *)scales)[g];
    return kind == 0 ? half_to_float(raw) : bfloat_to_float(raw);
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

#ifdef GEMM_HAVE_AVX512
/* The tables of the nibbles of x (in,) in the order a dword of packed bits shifts them out:
 * nibble n of dword d (bytes 4d .. 4d + 3; the low nibble of a byte first) is table 8d + n,
 * over the inputs 8 * (4d + n / 2) + (n even ? 4 : 0) + 0 .. 3, and entry p of a table is
 * sum_k (bit 3 - k of p ? x_k : -x_k) (bit 7 - j of a byte is input j). */
AVX512 static void nibble_tables(const float *x, Py_ssize_t in, float *tables)
{
    const __m512 one = _mm512_set1_ps(1.0f), minus = _mm512_set1_ps(-1.0f);
    const __m512 s0 = _mm512_mask_blend_ps(0xff00, minus, one);
    const __m512 s1 = _mm512_mask_blend_ps(0xf0f0, minus, one);
    const __m512 s2 = _mm512_mask_blend_ps(0xcccc, minus, one);
    const __m512 s3 = _mm512_mask_blend_ps(0xaaaa, minus, one);
    for (Py_ssize_t q = 0; q < in / 4; q++) {
        const float *v = x + 8 * (4 * (q / 8) + q % 8 / 2) + (q % 2 == 0 ? 4 : 0);
        const __m512 lo = _mm512_fmadd_ps(s1, _mm512_set1_ps(v[1]),
                                          _mm512_mul_ps(s0, _mm512_set1_ps(v[0])));
        const __m512 hi = _mm512_fmadd_ps(s3, _mm512_set1_ps(v[3]),
                                          _mm512_mul_ps(s2, _mm512_set1_ps(v[2])));
        _mm512_storeu_ps(tables + 16 * q, _mm512_add_ps(lo, hi));
    }
}
#endif

#ifdef GEMM_HAVE_AVX512
/* x with the 8 values of each byte column reversed (lane l of a mask is then bit l of the
 * byte, as AVX-512 reads masks) and the float64 prefix sums of the byte columns (each
 * column's 8 values added pairwise, so the chain of dependent adds is in / 8 long). */
AVX512 static void prepare_masked(const float *x, Py_ssize_t in, row_t *row)
{
    const __m512i reverse = _mm512_set_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    Py_ssize_t i = 0;
    for (; i + 16 <= in; i += 16)
        _mm512_storeu_ps(row->reversed + i, _mm512_permutexvar_ps(reverse, _mm512_loadu_ps(x + i)));
    for (; i < in; i++) /* the last 8 when in % 16 == 8 */
        row->reversed[i] = x[i - i % 8 + 7 - i % 8];
    double sum = 0.0;
    row->prefix[0] = 0.0;
    for (Py_ssize_t j = 0; j < in / 8; j++) {
        const float *v = x + 8 * j;
        sum += (((double)v[0] + v[1]) + ((double)v[2] + v[3])) +
               (((double)v[4] + v[5]) + ((double)v[6] + v[7]));
        row->prefix[j + 1] = sum;
    }
    if (row->nibbles)
        nibble_tables(x, in, row->table);
}

/* The 16-bit mask of the two bytes at p (lane l: bit l). */
AVX512 static inline __mmask16 mask_at(const unsigned char *p)
{
    return _load_mask16((__mmask16 *)(void *)p);
}

AVX512 static inline float scale_fast(const void *scales, int kind, Py_ssize_t g)
{
    return kind == 0 ? _cvtsh_ss(((const uint16_t *)scales)[g]) : scale_at(scales, kind, g);
}

/* 2 * (sum of x over set bits) - (sum of all x), per group: one masked add per 16 weights,
 * the group's vector scaled into the row's total, one horizontal sum per output. */
AVX512 static float output_avx512(const row_t *row, const unsigned char *bits, Py_ssize_t o,
                                  Py_ssize_t in, Py_ssize_t group, const void *scales, int kind)
{
    const float *x = row->reversed;
    __m512 total = _mm512_setzero_ps();
    double whole = 0.0;
    for (Py_ssize_t j = 0, g = o * in / group; j < in / 8; g++) {
        const Py_ssize_t end = group_end(g, o, in, group), first = j;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (; j + 4 <= end; j += 4) {
            a0 = _mm512_mask_add_ps(a0, mask_at(bits + j), a0,
                                    _mm512_loadu_ps(x + 8 * j));
            a1 = _mm512_mask_add_ps(a1, mask_at(bits + j + 2), a1,
                                    _mm512_loadu_ps(x + 8 * j + 16));
        }
        for (; j < end; j++) /* one byte: lanes 8 .. 15 stay off (x is padded by 8 floats) */
            a0 = _mm512_mask_add_ps(a0, _cvtu32_mask16(bits[j]), a0, _mm512_loadu_ps(x + 8 * j));
        const float scale = scale_fast(scales, kind, g);
        total = _mm512_fmadd_ps(_mm512_set1_ps(scale), _mm512_add_ps(a0, a1), total);
        whole += (double)scale * (row->prefix[end] - row->prefix[first]);
    }
    return (float)(2.0 * (double)_mm512_reduce_add_ps(total) - whole);
}

/* The float32 scales of `n` consecutive groups from group g, into `to`. */
AVX512 static void scales_run(const void *scales, int kind, Py_ssize_t g, Py_ssize_t n, float *to)
{
    for (Py_ssize_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const uint16_t *from = (const uint16_t *)scales + g + i;
        __m512 v;
        if (kind == 0) {
            v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, from));
        } else if (kind == 1) {
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, from));
            v = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        } else {
            v = _mm512_maskz_loadu_ps(m, (const float *)scales + g + i);
        }
        _mm512_mask_storeu_ps(to + i, m, v);
    }
}

/* t[j] lane l = dword j of r[l]: a 16 x 16 transpose of dwords (unpacks of dwords and of
 * quadwords within 128-bit lanes, then two shuffles of 128-bit lanes). */
AVX512 static void transpose16(const __m512i *r, __m512i *t)
{
    __m512i u[16];
    for (int g = 0; g < 4; g++) {
        const __m512i *q = r + 4 * g;
        const __m512i s0 = _mm512_unpacklo_epi32(q[0], q[1]);
        const __m512i s1 = _mm512_unpackhi_epi32(q[0], q[1]);
        const __m512i s2 = _mm512_unpacklo_epi32(q[2], q[3]);
        const __m512i s3 = _mm512_unpackhi_epi32(q[2], q[3]);
        /* u[4g + m], 128-bit lane c: dword 4c + m of rows 4g .. 4g + 3 */
        u[4 * g] = _mm512_unpacklo_epi64(s0, s2);
        u[4 * g + 1] = _mm512_unpackhi_epi64(s0, s2);
        u[4 * g + 2] = _mm512_unpacklo_epi64(s1, s3);
        u[4 * g + 3] = _mm512_unpackhi_epi64(s1, s3);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xee);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xee);
        t[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        t[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        t[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* Adds to a[h][0 .. 3] the table entries that the 8 nibbles of each lane of v[h] select from
 * the 8 tables at t, for the `blocks` blocks of 16 outputs h (one permute per 64 weights: the
 * index is the low 4 bits of each lane; each table loaded once for the blocks). */
AVX512 static inline __attribute__((always_inline)) void
nibbles8(const __m512i *v, const float *t, __m512 (*a)[4], const int blocks)
{
    for (int n = 0; n < 8; n++) {
        const __m512 table = _mm512_loadu_ps(t + 16 * n);
        for (int h = 0; h < blocks; h++) {
            const __m512i index = n ? _mm512_srli_epi32(v[h], 4 * n) : v[h];
            a[h][n % 4] = _mm512_add_ps(a[h][n % 4], _mm512_permutexvar_ps(index, table));
        }
    }
}

/* Adds outputs o0 .. o1 (16 x `blocks` at a time, as many as fit; returns where it stopped) to
 * y where each row holds `per_row` whole groups of a multiple of 32 weights: lane l of block h
 * is output o + 16h + l, a dword of packed bits of each of its 16 rows (one load where the
 * blocks' bits are interleaved, `row->lanes`; otherwise 64 bytes of each row transposed at
 * once, gathered where fewer are left) and each of its 8 nibbles selects the sum
 * of its 4 signed inputs from that nibble's table (the LUT-GEMM of [Park et al., 2024] on 16
 * rows at once); each group's sums are scaled by the rows' scales, gathered from their
 * converted run. */
AVX512 static inline __attribute__((always_inline)) Py_ssize_t
rows_lut(row_t *row, const unsigned char *bits, Py_ssize_t o0, Py_ssize_t o1, Py_ssize_t in,
         Py_ssize_t group, const void *scales, int kind, float *y, const int blocks)
{
    const Py_ssize_t row_bytes = in / 8, per_row = in / group, dwords = group / 32;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i offsets = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)row_bytes));
    const __m512i firsts = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)per_row));
    float *sc = row->scales; /* sc[l * per_row + k]: the scale of row o + l's group k */
    __m512i chunk[16], v[2][16], now[2];
    Py_ssize_t o = o0;
    for (; o + 16 * blocks <= o1; o += 16 * blocks) {
        const unsigned char *b = bits + o * row_bytes;
        scales_run(scales, kind, o * per_row, 16 * blocks * per_row, sc);
        __m512 total[2], a[2][4];
        for (int h = 0; h < blocks; h++) {
            total[h] = _mm512_setzero_ps();
            a[h][0] = a[h][1] = a[h][2] = a[h][3] = _mm512_setzero_ps();
        }
        for (Py_ssize_t d = 0; d < row_bytes / 4; d++) {
            const int whole = 4 * (d - d % 16 + 16) <= row_bytes; /* 64 bytes left of the row */
            for (int h = 0; h < blocks; h++) { /* the blocks' bytes, PREFETCH ahead of use */
                const Py_ssize_t at =
                    row->lanes ? 16 * h * row_bytes + 64 * d : 64 * (d * blocks + h);
                _mm_prefetch((const char *)b + at + PREFETCH, _MM_HINT_T0);
            }
            for (int h = 0; h < blocks; h++) {
                const unsigned char *mine = b + 16 * h * row_bytes;
                if (row->lanes) {
                    now[h] = _mm512_loadu_si512(mine + 64 * d);
                    continue;
                }
                if (d % 16 == 0 && whole) {
                    for (int l = 0; l < 16; l++)
                        chunk[l] = _mm512_loadu_si512(mine + l * row_bytes + 4 * d);
                    transpose16(chunk, v[h]);
                }
                now[h] = whole ? v[h][d % 16] : _mm512_i32gather_epi32(offsets, mine + 4 * d, 1);
            }
            nibbles8(now, row->table + 128 * d, a, blocks);
            if ((d + 1) % dwords == 0) {
                const __m512i k = _mm512_set1_epi32((int)(d / dwords));
                for (int h = 0; h < blocks; h++) {
                    const __m512i at = _mm512_add_epi32(
                        _mm512_add_epi32(firsts, k), _mm512_set1_epi32((int)(16 * h * per_row)));
                    const __m512 scale = _mm512_i32gather_ps(at, sc, 4);
                    const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[h][0], a[h][1]),
                                                     _mm512_add_ps(a[h][2], a[h][3]));
                    total[h] = _mm512_fmadd_ps(scale, sum, total[h]);
                    a[h][0] = a[h][1] = a[h][2] = a[h][3] = _mm512_setzero_ps();
                }
            }
        }
        for (int h = 0; h < blocks; h++)
            _mm512_storeu_ps(y + o + 16 * h,
                             _mm512_add_ps(_mm512_loadu_ps(y + o + 16 * h), total[h]));
    }
    return o;
}

/* 32 outputs at a time (each table load serves both blocks of 16), then 16. */
AVX512 static Py_ssize_t rows16(row_t *row, const unsigned char *bits, Py_ssize_t o0,
                                Py_ssize_t o1, Py_ssize_t in, Py_ssize_t group,
                                const void *scales, int kind, float *y)
{
    const Py_ssize_t o = rows_lut(row, bits, o0, o1, in, group, scales, kind, y, 2);
    return rows_lut(row, bits, o, o1, in, group, scales, kind, y, 1);
}

/* Adds outputs o0 .. o1 (eight at a time, as many as fit; returns where it stopped) to y where
 * each row holds `per_row` whole groups of `seg` bytes (seg even). One load of x serves the
 * eight rows, eight accumulators are in flight, each mask is read from the packed bytes, each
 * group's sum is scaled once into its row's total (the eight rows' scales converted at once);
 * `seg` is a constant where the caller inlines it. */
AVX512 static inline __attribute__((always_inline)) Py_ssize_t
rows8(row_t *row, const unsigned char *bits, Py_ssize_t o0, Py_ssize_t o1, Py_ssize_t in,
      Py_ssize_t per_row, Py_ssize_t seg, const void *scales, int kind, float *y)
{
    const float *x = row->reversed;
    const Py_ssize_t row_bytes = in / 8;
    float *sc = row->scales; /* sc[r * per_row + k]: the scale of row o + r's group k */
    Py_ssize_t o = o0;
    for (; o + 8 <= o1; o += 8) {
        const unsigned char *b = bits + o * row_bytes;
        scales_run(scales, kind, o * per_row, 8 * per_row, sc);
        __m512 t[8];
        for (int r = 0; r < 8; r++)
            t[r] = _mm512_setzero_ps();
        for (Py_ssize_t k = 0; k < per_row; k++) {
            __m512 a[8];
            for (int r = 0; r < 8; r++)
                a[r] = _mm512_setzero_ps();
            for (Py_ssize_t j = k * seg; j < (k + 1) * seg; j += 2) {
                const __m512 xv = _mm512_loadu_ps(x + 8 * j);
                for (int r = 0; r < 8; r++)
                    a[r] = _mm512_mask_add_ps(a[r], mask_at(b + r * row_bytes + j), a[r], xv);
            }
            for (int r = 0; r < 8; r++)
                t[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r * per_row + k]), a[r], t[r]);
        }
        for (int r = 0; r < 8; r++) {
            double whole = 0.0;
            for (Py_ssize_t k = 0; k < per_row; k++)
                whole += (double)sc[r * per_row + k] *
                         (row->prefix[(k + 1) * seg] - row->prefix[k * seg]);
            y[o + r] += (float)(2.0 * (double)_mm512_reduce_add_ps(t[r]) - whole);
        }
    }
    return o;
}

/* Adds outputs o .. o + 3 to y where every row meets its groups at the same columns (in % group
 * == 0: `in / group` groups per row, or group % in == 0: one group per row). Each load of x
 * serves the four rows, eight accumulators are in flight, and each group's sum is scaled
 * once. */
AVX512 static void outputs4_avx512(row_t *row, const unsigned char *bits, Py_ssize_t o,
                                   Py_ssize_t in, Py_ssize_t group, const void *scales, int kind,
                                   float *y)
{
    const float *x = row->reversed;
    const Py_ssize_t row_bytes = in / 8, per_row = in % group == 0 ? in / group : 1;
    const Py_ssize_t seg = row_bytes / per_row;
    float *sc = row->scales; /* sc[r * per_row + k]: the scale of row o + r's group k */
    if (in % group == 0)
        scales_run(scales, kind, o * per_row, 4 * per_row, sc);
    else
        for (int r = 0; r < 4; r++)
            sc[r] = scale_fast(scales, kind, (o + r) * in / group);
    __m512 t[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (Py_ssize_t k = 0; k < per_row; k++) {
        const Py_ssize_t first = k * seg;
        __m512 a[4][2];
        for (int r = 0; r < 4; r++)
            a[r][0] = a[r][1] = _mm512_setzero_ps();
        Py_ssize_t j = first;
        for (; j + 4 <= first + seg; j += 4) {
            const __m512 x0 = _mm512_loadu_ps(x + 8 * j), x1 = _mm512_loadu_ps(x + 8 * j + 16);
            for (int r = 0; r < 4; r++) {
                const unsigned char *b = bits + r * row_bytes + j;
                a[r][0] = _mm512_mask_add_ps(a[r][0], mask_at(b),
                                             a[r][0], x0);
                a[r][1] = _mm512_mask_add_ps(a[r][1], mask_at(b + 2),
                                             a[r][1], x1);
            }
        }
        for (; j < first + seg; j++) { /* one byte: lanes 8 .. 15 stay off */
            const __m512 x0 = _mm512_loadu_ps(x + 8 * j);
            for (int r = 0; r < 4; r++)
                a[r][0] = _mm512_mask_add_ps(a[r][0], _cvtu32_mask16(bits[r * row_bytes + j]),
                                             a[r][0], x0);
        }
        for (int r = 0; r < 4; r++)
            t[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r * per_row + k]),
                                   _mm512_add_ps(a[r][0], a[r][1]), t[r]);
    }
    for (int r = 0; r < 4; r++) {
        double whole = 0.0;
        for (Py_ssize_t k = 0; k < per_row; k++)
            whole += (double)sc[r * per_row + k] *
                     (row->prefix[(k + 1) * seg] - row->prefix[k * seg]);
        y[r] += (float)(2.0 * (double)_mm512_reduce_add_ps(t[r]) - whole);
    }
}

/* Adds outputs o0 .. o1 of row x to y, as many as the blocks above take (returns where they
 * stopped): sixteen at a time by nibble tables where rows hold whole groups of a multiple of
 * 32 weights, eight at a time by masked adds where they hold whole groups of an even number of
 * bytes (the constant 16 bytes of groups of 128 inlined), then four at a time where rows meet
 * their groups at the same columns. */
AVX512 static Py_ssize_t block_avx512(row_t *row, const unsigned char *bits, Py_ssize_t o0,
                                      Py_ssize_t o1, Py_ssize_t in, Py_ssize_t group,
                                      const void *scales, int kind, float *y)
{
    const Py_ssize_t row_bytes = in / 8;
    Py_ssize_t o = o0;
    if (row->nibbles)
        o = rows16(row, bits, o, o1, in, group, scales, kind, y);
    if (in % group == 0 && group % 16 == 0) {
        if (group == 128)
            o = rows8(row, bits, o, o1, in, in / group, 16, scales, kind, y);
        else
            o = rows8(row, bits, o, o1, in, in / group, group / 8, scales, kind, y);
    }
    if (in % group == 0 || group % in == 0)
        for (; o + 4 <= o1; o += 4)
            outputs4_avx512(row, bits + o * row_bytes, o, in, group, scales, kind, y + o);
    return o;
}
#endif

static const kernel_t portable_kernel = {prepare_portable, output_portable, NULL, "portable"};
#ifdef GEMM_HAVE_AVX512
static const kernel_t avx512_kernel = {prepare_masked, output_avx512, block_avx512, "avx512"};
#endif
static const kernel_t *best_kernel = &portable_kernel;

/* Adds to out[r, o] for o in [o0, o1) of every row r of one variant. */
static void variant_rows(job_t *job, const variant_t *v)
{
    const Py_ssize_t in = job->in, row_bytes = in / 8, group = job->group;
    for (Py_ssize_t i = v->first; i < v->last; i++) {
        const Py_ssize_t r = (Py_ssize_t)job->rows[i];
        job->kernel->prepare(job->x + r * in, in, &job->row);
        float *y = job->out + r * job->out_features;
        Py_ssize_t o = job->o0;
        if (job->kernel->block != NULL)
            o = job->kernel->block(&job->row, v->bits, o, job->o1, in, group, v->scales,
                                   job->scale_kind, y);
        for (; o < job->o1; o++)
            y[o] += job->kernel->output(&job->row, v->bits + o * row_bytes, o, in, group,
                                        v->scales, job->scale_kind);
    }
}

static void *run_job(void *arg)
{
    job_t *job = (job_t *)arg;
    for (Py_ssize_t k = 0; k < job->n_variants; k++)
        variant_rows(job, &job->variants[k]);
    return NULL;
}

#ifdef _OPENMP
/* Run the jobs on the OpenMP team: where torch was imported first it is torch's own (the
 * process loads one libgomp), whose workers spin for a while after each of its operations.
 * Threads of our own ran beside those spinning workers: in the 0.5B model a step's products
 * took 823 ms, against 640 ms with the workers told not to spin. A smaller team than asked
 * for takes the jobs in turn. */
static int run_jobs(job_t *jobs, int threads)
{
#pragma omp parallel num_threads(threads)
    for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads())
        run_job(&jobs[t]);
    return 0;
}
#else
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
#endif

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
    Py_ssize_t x_rows, n_rows, in, out_features, group;
    int scale_kind, threads, lanes;
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
        Py_ssize_t first = PyLong_AsSsize_t(PyList_GET_ITEM(starts, taken));
        Py_ssize_t last = PyLong_AsSsize_t(PyList_GET_ITEM(starts, taken + 1));
        if (PyErr_Occurred())
            break;
        if (first < previous || last < first || last > s->n_rows) {
            PyErr_SetString(PyExc_ValueError, "starts must rise within the entries of rows");
            break;
        }
        previous = last;
        if (get_buffer(PyList_GET_ITEM(bits, taken), &views[2 * taken], 0, weights / 8,
                       "bits") < 0)
            break;
        if (get_buffer(PyList_GET_ITEM(scales, taken), &views[2 * taken + 1], 0,
                       n_scales * scale_bytes, "scales") < 0) {
            PyBuffer_Release(&views[2 * taken]);
            break;
        }
        variants[taken] = (variant_t){views[2 * taken].buf, views[2 * taken + 1].buf, first, last};
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
    return (size_t)TABLE * (size_t)(in / 8) + (size_t)in + 8 + 2 * (size_t)(in / 8 + 1) +
           (size_t)in;
}

/* Where thread t of `threads` starts among `out` outputs: on a block of 32 (whole blocks of 16
 * interleaved rows stay with one thread), the last thread ending at out. */
static Py_ssize_t split(Py_ssize_t out, int t, int threads)
{
    return t == threads ? out : out * t / threads / 32 * 32;
}

static int compute(const Py_buffer *x, Py_buffer *out, const int64_t *rows,
                   const variant_t *variants, Py_ssize_t n, const shape_t *s)
{
    const int threads = s->threads;
    const size_t per_thread = row_floats(s->in);
    const int nibbles = best_kernel->block != NULL && s->in % s->group == 0 && s->group % 32 == 0;
    if (s->lanes && !nibbles) {
        PyErr_SetString(PyExc_ValueError,
                        "bits interleaved by lanes need the AVX-512 kernel and rows of whole "
                        "groups of a multiple of 32 weights; pass them row by row");
        return -1;
    }
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
        float *scales = (float *)(void *)(prefix + s->in / 8 + 1);
        jobs[t] = (job_t){x->buf,
                          out->buf,
                          rows,
                          variants,
                          n,
                          s->in,
                          s->out_features,
                          s->group,
                          split(s->out_features, t, threads),
                          split(s->out_features, t + 1, threads),
                          s->scale_kind,
                          best_kernel,
                          {mine, reversed, prefix, scales, nibbles, s->lanes}};
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

/* x (X, in) and out (X, out) float32 and rows (R,) int64 within [0, X). */
static int take_rows(const Py_buffer *x, const Py_buffer *out, const Py_buffer *rows, shape_t *s)
{
    s->x_rows = x->len / (4 * s->in);
    s->n_rows = rows->len / 8;
    s->out_features = s->x_rows ? out->len / (4 * s->x_rows) : 0;
    if (x->len != 4 * s->in * s->x_rows || out->len != 4 * s->out_features * s->x_rows ||
        rows->len != 8 * s->n_rows || (s->x_rows == 0 && s->n_rows > 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "x must be (X, in) and out (X, out) float32 and rows (R,) int64");
        return -1;
    }
    const int64_t *index = rows->buf;
    for (Py_ssize_t i = 0; i < s->n_rows; i++)
        if (index[i] < 0 || index[i] >= s->x_rows) {
            PyErr_SetString(PyExc_ValueError, "rows must index rows of x and out");
            return -1;
        }
    return 0;
}

static PyObject *run_variants(const Py_buffer *x, Py_buffer *out, const Py_buffer *rows,
                              PyObject *starts, PyObject *bits, PyObject *scales,
                              const shape_t *s)
{
    PyObject *result = NULL;
    const Py_ssize_t n = PyList_GET_SIZE(bits);
    variant_t *variants = PyMem_Malloc(sizeof(variant_t) * (size_t)(n + 1));
    Py_buffer *views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(2 * n + 1));
    if (variants == NULL || views == NULL) {
        PyErr_NoMemory();
    } else if (take_variants(starts, bits, scales, s, variants, views) == n) {
        if (compute(x, out, rows->buf, variants, n, s) == 0)
            result = Py_NewRef(Py_None);
        for (Py_ssize_t k = 0; k < n; k++) {
            PyBuffer_Release(&views[2 * k]);
            PyBuffer_Release(&views[2 * k + 1]);
        }
    }
    PyMem_Free(variants);
    PyMem_Free(views);
    return result;
}

static PyObject *gemm_accumulate(PyObject *self, PyObject *args)
{
    PyObject *x_obj, *out_obj, *rows_obj, *starts, *bits, *scales;
    shape_t s;
    s.lanes = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOnnii|p:accumulate", &x_obj, &out_obj, &rows_obj, &starts,
                          &bits, &scales, &s.in, &s.group, &s.scale_kind, &s.threads, &s.lanes))
        return NULL;
    if (check_shape(&s, starts, bits, scales) < 0)
        return NULL;
    Py_buffer x, out, rows;
    if (get_buffer(x_obj, &x, 0, 0, "x") < 0)
        return NULL;
    if (get_buffer(out_obj, &out, 1, 0, "out") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *result = NULL;
    if (get_buffer(rows_obj, &rows, 0, 0, "rows") == 0) {
        if (take_rows(&x, &out, &rows, &s) == 0)
            result = run_variants(&x, &out, &rows, starts, bits, scales, &s);
        PyBuffer_Release(&rows);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

/* The byte of value (t, c) of a (V, cols) weight whose sign bits are row by row or, with
 * `lanes`, interleaved by dwords within each whole block of 16 rows. */
static Py_ssize_t row_byte(Py_ssize_t t, Py_ssize_t c, Py_ssize_t cols, Py_ssize_t whole,
                           int lanes)
{
    if (!lanes || t >= whole)
        return (t * cols + c) / 8;
    const Py_ssize_t row_bytes = cols / 8;
    return t / 16 * 16 * row_bytes + t % 16 * 4 + c / 32 * 64 + c % 32 / 8;
}

/* out[r] += D_k[ids[r]] for r = rows[i], i in variant k's entries. */
static void add_variant_rows(float *out, const int64_t *ids, const int64_t *rows,
                             const variant_t *v, const shape_t *s, Py_ssize_t whole)
{
    const Py_ssize_t cols = s->in;
    for (Py_ssize_t i = v->first; i < v->last; i++) {
        const Py_ssize_t r = rows[i], t = ids[r];
        float *y = out + r * cols;
        for (Py_ssize_t c = 0; c < cols; c += 8) {
            const unsigned byte = v->bits[row_byte(t, c, cols, whole, s->lanes)];
            const float scale = scale_at(v->scales, s->scale_kind, (t * cols + c) / s->group);
            for (int b = 0; b < 8; b++)
                y[c + b] += (byte >> (7 - b)) & 1 ? scale : -scale;
        }
    }
}

/* out (X, cols) float32, ids (X,) int64 rows of the (V, cols) weights, rows (R,) int64 within
 * [0, X): checked, then every variant's rows added. */
static PyObject *run_rows(Py_buffer *out, const Py_buffer *ids, const Py_buffer *rows,
                          PyObject *starts, PyObject *bits, PyObject *scales, shape_t *s)
{
    const Py_ssize_t cols = s->in, vocab = s->out_features;
    s->x_rows = ids->len / 8;
    s->n_rows = rows->len / 8;
    if (ids->len != 8 * s->x_rows || out->len != 4 * cols * s->x_rows ||
        rows->len != 8 * s->n_rows) {
        PyErr_SetString(PyExc_ValueError, "out must be (X, cols) float32, ids (X,) and rows (R,) "
                                          "int64");
        return NULL;
    }
    const int64_t *index = rows->buf, *token = ids->buf;
    for (Py_ssize_t i = 0; i < s->n_rows; i++)
        if (index[i] < 0 || index[i] >= s->x_rows || token[index[i]] < 0 ||
            token[index[i]] >= vocab) {
            PyErr_SetString(PyExc_ValueError,
                            "rows must index rows of out, and their ids rows of the weights");
            return NULL;
        }
    const Py_ssize_t n = PyList_GET_SIZE(bits);
    variant_t *variants = PyMem_Malloc(sizeof(variant_t) * (size_t)(n + 1));
    Py_buffer *views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(2 * n + 1));
    PyObject *result = NULL;
    if (variants == NULL || views == NULL) {
        PyErr_NoMemory();
    } else if (take_variants(starts, bits, scales, s, variants, views) == n) {
        for (Py_ssize_t k = 0; k < n; k++) {
            add_variant_rows(out->buf, token, index, &variants[k], s, vocab - vocab % 16);
            PyBuffer_Release(&views[2 * k]);
            PyBuffer_Release(&views[2 * k + 1]);
        }
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(variants);
    PyMem_Free(views);
    return result;
}

static PyObject *gemm_add_rows(PyObject *self, PyObject *args)
{
    PyObject *out_obj, *ids_obj, *rows_obj, *starts, *bits, *scales;
    shape_t s = {0};
    if (!PyArg_ParseTuple(args, "OOOOOOnnnip:add_rows", &out_obj, &ids_obj, &rows_obj, &starts,
                          &bits, &scales, &s.out_features, &s.in, &s.group, &s.scale_kind,
                          &s.lanes))
        return NULL;
    s.threads = 1;
    if (check_shape(&s, starts, bits, scales) < 0)
        return NULL;
    if (s.lanes && s.in % 32) {
        PyErr_SetString(PyExc_ValueError, "bits interleaved by lanes need rows of whole dwords");
        return NULL;
    }
    Py_buffer out, ids, rows;
    if (get_buffer(out_obj, &out, 1, 0, "out") < 0)
        return NULL;
    PyObject *result = NULL;
    if (get_buffer(ids_obj, &ids, 0, 0, "ids") == 0) {
        if (get_buffer(rows_obj, &rows, 0, 0, "rows") == 0) {
            result = run_rows(&out, &ids, &rows, starts, bits, scales, &s);
            PyBuffer_Release(&rows);
        }
        PyBuffer_Release(&ids);
    }
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(accumulate_doc,
             "accumulate(x, out, rows, starts, bits, scales, in_features, group, scale_kind,\n"
             "           threads, lanes=False)\n"
             "--\n\n"
             "Add the 1-bit product of each variant k (packed sign bytes bits[k], group\n"
             "scales scales[k]: float16, bfloat16 or float32 for scale_kind 0, 1, 2) with the\n"
             "rows rows[starts[k]] .. rows[starts[k + 1] - 1] of x (X, in) float32 to the same\n"
             "rows of out (X, out) float32, on `threads` threads. `lanes`: each whole block of\n"
             "16 rows of the bits is interleaved by dwords (zoo_gym.serving.packed).");

PyDoc_STRVAR(add_rows_doc,
             "add_rows(out, ids, rows, starts, bits, scales, vocab, cols, group, scale_kind,\n"
             "         lanes)\n"
             "--\n\n"
             "Add row ids[r] of each variant k's (vocab, cols) delta (bits[k], scales[k] as for\n"
             "accumulate, interleaved where `lanes`) to row r of out (X, cols) float32, for\n"
             "r = rows[starts[k]] .. rows[starts[k + 1] - 1]: an embedding's looked-up rows.");

static PyMethodDef gemm_methods[] = {
    {"accumulate", gemm_accumulate, METH_VARARGS, accumulate_doc},
    {"add_rows", gemm_add_rows, METH_VARARGS, add_rows_doc},
    {NULL, NULL, 0, NULL},
};

static int gemm_exec(PyObject *module)
{
#ifdef GEMM_HAVE_AVX512
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        best_kernel = &avx512_kernel;
#endif
#ifdef _OPENMP
    const char *threads = "openmp";
#else
    const char *threads = "posix";
#endif
    if (PyModule_AddStringConstant(module, "threads", threads) < 0)
        return -1;
    return PyModule_AddStringConstant(module, "kernel", best_kernel->name);
}

static PyModuleDef_Slot gemm_slots[] = {
    {Py_mod_exec, gemm_exec},
    {0, NULL},
};

static struct PyModuleDef gemm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zoo_gym.serving._binary_gemm",
    .m_doc = "The 1-bit products of BitDelta variants added to rows of a layer's output (CPU).",
    .m_size = 0,
    .m_methods = gemm_methods,
    .m_slots = gemm_slots,
};

PyMODINIT_FUNC PyInit__binary_gemm(void)
{
    return PyModuleDef_Init(&gemm_module);
}
