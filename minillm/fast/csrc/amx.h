/* What the products on Intel's matrix units (AMX) share: bf16_amx.c and quantized_amx.c. Included only where the
 * compiler targets AMX (Linux, AVX-512).
 *
 * Eight tile registers of 16 rows by 64 bytes, configured by each thread (ldtilecfg). Both products use the
 * usual split: tiles 0-3 accumulate, 4-5 hold two A operands, 6-7 two B operands. Linux hands a process the
 * tile registers only when it asks (arch_prctl); without that the first tile instruction kills it.
 */
#ifndef MINILLM_AMX_H
#define MINILLM_AMX_H

#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {  /* the tile configuration ldtilecfg reads (palette 1): each tile's rows and bytes a row */
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* 1 once Linux granted this process the tile registers (asked at the first call). */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* This thread's tiles as 16 rows of 64 bytes each; *saved keeps the caller's configuration for amx_restore: a
 * library that keeps one loaded between its calls (oneDNN, PyTorch's brgemm) finds it as it left it. */
static void amx_configure(tile_config *saved) {
    tile_config mine = {.palette = 1};
    _tile_storeconfig(saved);
    for (int t = 0; t < 8; t++) mine.rows[t] = 16, mine.bytes_per_row[t] = 64;
    _tile_loadconfig(&mine);
}

static void amx_restore(const tile_config *saved) {
    if (saved->palette) _tile_loadconfig(saved);
    else _tile_release();
}

/* r[i] <- column i of the 16x16 matrix whose rows are r[0..15]: pairs, then quads, then 128-bit lanes swapped
 * (three rounds of 16 shuffles). A finished accumulator tile holds outputs by rows; y wants rows by outputs. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
}

#endif
