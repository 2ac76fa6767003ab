/* Packed sign bits as words, for the package's C extensions (included by
 * `zoo_gym/aggregation/_orderstat.c` and `zoo_gym/aggregation/_passes.c`).
 *
 * BitDelta packs value 8 i + j of a row as bit 7 - j of byte i (most significant first).
 * `bits_at` returns 64 of them as a word in the other order, bit t holding value b + t, so
 * that a word's bits map onto vector lanes (mask registers take bit t for lane t). */

#ifndef ZOO_GYM_BITS_H
#define ZOO_GYM_BITS_H

#include <stdint.h>
#include <string.h>

/* Values b .. b + 63 of a row of `nbytes` packed bytes as a word, bit t holding value b + t;
 * zeros past the row. */
static inline uint64_t bits_at(const uint8_t *row, Py_ssize_t nbytes, Py_ssize_t b)
{
    const Py_ssize_t k = b >> 3;
    const int off = (int)(b & 7);
    uint8_t bytes[9] = {0};
    uint64_t x;
    if (k + 9 <= nbytes) {
        memcpy(&x, row + k, 8); /* little-endian: byte i at bits 8 i .. 8 i + 7 */
        bytes[8] = row[k + 8];
    } else {
        for (Py_ssize_t i = k; i < nbytes; i++)
            bytes[i - k] = row[i];
        memcpy(&x, bytes, 8);
    }
    x = ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
    x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
    x = ((x >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((x & 0x0F0F0F0F0F0F0F0Full) << 4);
    x >>= off;
    if (off) {
        uint32_t y = bytes[8];
        y = ((y >> 1) & 0x55u) | ((y & 0x55u) << 1);
        y = ((y >> 2) & 0x33u) | ((y & 0x33u) << 2);
        y = ((y >> 4) & 0x0Fu) | ((y & 0x0Fu) << 4);
        x |= (uint64_t)y << (64 - off);
    }
    return x;
}

#endif
