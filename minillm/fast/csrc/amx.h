/* What the products on Intel's matrix units (AMX) share: bf16_amx.c and quantized_amx.c. Included only where the
 * compiler targets AMX (Linux, AVX-512).
 *
 * Eight tile registers of 16 rows by 64 bytes, configured by each thread (ldtilecfg). Both products use the
 * usual split: tiles 0-3 accumulate, 4-5 hold two A operands, 6-7 two B operands. Linux hands a process the
 * tile registers only when it asks (arch_prctl); without that the first tile instruction kills it. (The 16x16
 * transpose they share is common.h's: attention_bf16.c's loop without the tiles takes it too.)
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

#endif
