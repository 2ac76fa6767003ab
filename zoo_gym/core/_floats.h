/* The 16-bit floating formats as float32, exactly, for the package's C extensions (included by
 * `zoo_gym/aggregation/_orderstat.c`, `zoo_gym/aggregation/_passes.c` and
 * `zoo_gym/serving/_binary_gemm.c`). */

#ifndef ZOO_GYM_FLOATS_H
#define ZOO_GYM_FLOATS_H

#include <stdint.h>
#include <string.h>

/* The value of a float16 (binary16) */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F)
        bits = sign | 0x7F800000u | (man << 13);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else { /* zero or subnormal: man * 2^-24, exact in float32 */
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The value of a bfloat16: the high half of a float32 */
static inline float bfloat_to_float(uint16_t b)
{
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#endif
