/* gyre-ray's float32 GEMM for a few rows: y[M][N] = x[M][K] * W^T, W packed in panels of 8 columns.
 *
 * Built and loaded by gyre_ray/model/native_gemm.py (gcc, once per machine; see its docstring).
 * Rows go in chunks of about 384 KB of x (kept in L2 while every panel passes; 7% faster at 1,024
 * rows here). A decode step multiplies one row per running request by every weight matrix; at 4-16 rows MKL's
 * sgemm reaches well under the FMA rate of an AVX2 core (docs/engine.md). Here every 24 columns of
 * the weight (3 panels, packed so the kernel reads them front to back) are loaded once per block of
 * 4 rows and multiplied into 12 register accumulators: 12 FMAs per 3 weight loads and 4 broadcasts.
 *
 * Packed layout (native_gemm.pack): panel p holds columns 8p .. 8p+7 as wp[p][k][0..7]; the last
 * panel is zero-padded. Only the kernels carry target("avx2,fma"), so the library loads on any
 * x86-64 and `gyre_small_gemm_supported` says whether they may run.
 */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#define LANES 8
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (384 * 1024)
#endif

int gyre_small_gemm_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* R (1..4) rows of x times NP (1..3) panels into y (row stride ldy), `cols` <= 8 NP real columns.
 * R and NP are constants at every call, so the loops unroll and the accumulators stay in registers
 * (with a bound known only at run time gcc keeps them on the stack: half the speed). */
static inline __attribute__((target("avx2,fma"), always_inline)) void block(
    const int R, const int NP, int cols, int K, const float *x, ptrdiff_t ldx, const float *w,
    ptrdiff_t panel, float *y, ptrdiff_t ldy) {
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 3
        for (int j = 0; j < NP; j++) acc[r][j] = _mm256_setzero_ps();
    }
    for (int k = 0; k < K; k++) {
        __m256 wv[3];
#pragma GCC unroll 3
        for (int j = 0; j < NP; j++) wv[j] = _mm256_loadu_ps(w + j * panel + LANES * k);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 3
            for (int j = 0; j < NP; j++) acc[r][j] = _mm256_fmadd_ps(s, wv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (cols == LANES * NP) {
#pragma GCC unroll 3
            for (int j = 0; j < NP; j++) _mm256_storeu_ps(y + r * ldy + LANES * j, acc[r][j]);
        } else { /* the zero-padded last panel: write only the real columns */
            float tmp[3 * LANES];
#pragma GCC unroll 3
            for (int j = 0; j < NP; j++) _mm256_storeu_ps(tmp + LANES * j, acc[r][j]);
            memcpy(y + r * ldy, tmp, sizeof(float) * (size_t)cols);
        }
    }
}

#define BLOCK(R, NP) block(R, NP, cols, K, xm, ldx, w, panel, ym, ldy)
#define BY_PANELS(R)                  \
    switch (np) {                     \
    case 3: BLOCK(R, 3); break;       \
    case 2: BLOCK(R, 2); break;       \
    default: BLOCK(R, 1); break;      \
    }

/* Every row of x times the `np` panels at w (their `cols` real columns), 4 rows at a time. */
static __attribute__((target("avx2,fma"))) void panels(
    int np, int M, int cols, int K, const float *x, ptrdiff_t ldx, const float *w, float *y, ptrdiff_t ldy) {
    const ptrdiff_t panel = (ptrdiff_t)LANES * K;
    for (int m = 0; m < M; m += 4) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (M - m < 4 ? M - m : 4) {
        case 4: BY_PANELS(4); break;
        case 3: BY_PANELS(3); break;
        case 2: BY_PANELS(2); break;
        default: BY_PANELS(1); break;
        }
    }
}

/* y = x * W^T: x (M x K, row stride ldx), y (M x N, row stride ldy), wp the packed W (N x K). */
__attribute__((target("avx2,fma"))) void gyre_small_gemm(
    int M, int N, int K, const float *x, ptrdiff_t ldx, const float *wp, float *y, ptrdiff_t ldy) {
    const int total = (N + LANES - 1) / LANES;
    /* Rows in chunks of about CHUNK_BYTES of x, so a chunk stays in L2 while every panel passes. */
    int chunk = (int)(CHUNK_BYTES / (sizeof(float) * (size_t)K)) & ~3;
    if (chunk < 4) chunk = 4;
    for (int m = 0; m < M; m += chunk) {
        const int rows = M - m < chunk ? M - m : chunk;
        for (int p = 0; p < total; p += 3) {
            const int np = total - p < 3 ? total - p : 3;
            const int cols = N - LANES * p < LANES * np ? N - LANES * p : LANES * np;
            panels(np, rows, cols, K, x + m * ldx, ldx, wp + (ptrdiff_t)p * LANES * K, y + m * ldy + LANES * p, ldy);
        }
    }
}

/* The core's float32 FMA peak, for rooflines (benchmarks/bench_gemm.py): 12 independent register
 * chains of `iterations` FMAs each, nothing loaded; returns a sum so nothing is optimised away. */
__attribute__((target("avx2,fma"))) float gyre_fma_loop(long iterations) {
    __m256 acc[12];
    const __m256 scale = _mm256_set1_ps(1.0000001f), shift = _mm256_set1_ps(0.999999f);
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long n = 0; n < iterations; n++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], scale, shift);
    }
    float out[LANES], total = 0.0f;
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) {
        _mm256_storeu_ps(out, acc[i]);
        total += out[0];
    }
    return total;
}
