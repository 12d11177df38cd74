/*
 * gmlx few-row sgemm interposer.
 *
 * MLX's CPU backend sends every float32 matmul to cblas_sgemm, decode's one-row
 * products (x @ W.T, x of shape (1, K)) and a speculative verify's few-row ones
 * included. OpenBLAS packs the weight matrix for those calls and so reads it at well
 * under the rate of a matrix-vector kernel. This library defines cblas_sgemm; loaded
 * RTLD_GLOBAL before OpenBLAS and before mlx, it receives every call. One-row calls
 * (M == 1 or N == 1, any layout) and x @ W.T or x @ W calls of 2-8 rows run the
 * streaming kernels below, which read W once for all rows; everything else goes to the
 * real sgemm unchanged. gmlx stores Linear weights input-major on CPU (x @ W, W's
 * columns contiguous), the layout whose kernels need no register transposes.
 *
 * Why not simply call cblas_sgemv: its dot products sum in another order, so its
 * results differ from sgemm's in the last bits (measured on OpenBLAS 0.3.21).
 * OpenBLAS's sgemm computes each output as a chain of fused multiply-adds over k,
 * restarted at every K block, and adds each block's sum into C with one more fma:
 *   c = beta * c  (c = 0 when beta == 0; untouched when beta == 1)
 *   for each K block: acc = 0; for k in block: acc = fma(w, v, acc); c = fma(alpha, acc, c)
 * The K blocks are GEMM_Q long until fewer than 2 * GEMM_Q remain; the rest is cut
 * in two halves, rounded up to GEMM_UNROLL_M by the single-thread driver and not
 * rounded by the threaded one, which runs when M * N * K exceeds a build constant.
 * Its 4-column micro-kernel (our rows 0-3 of a 4-8 row product under the single-thread
 * driver) sums each block in two chains instead, even and odd k (see PAIRS below).
 * The kernels reproduce that order exactly, so routed results are bit-identical.
 * The block constants and each row's order depend on the BLAS build and the CPU, so
 * gmlx_interposer_init measures them against the real sgemm and then self-checks
 * every layout; if anything disagrees, that case passes through.
 *
 * Build: cc -O2 -fPIC -shared -ffp-contract=off gemm_interposer.c -ldl -lm -lpthread
 * (-ffp-contract=off matters: a compiler-fused multiply-add would change results).
 */
#define _GNU_SOURCE
#include <assert.h>
#include <dlfcn.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { ROW_MAJOR = 101, COL_MAJOR = 102 };
enum { NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113, CONJ_NO_TRANS = 114 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef int (*get_threads_fn)(void);
typedef void (*set_threads_fn)(int);

static sgemm_fn real_sgemm;           /* the loaded BLAS's own cblas_sgemm */
static get_threads_fn blas_get_threads; /* openblas_get_num_threads */
static set_threads_fn blas_set_threads; /* openblas_set_num_threads */
static atomic_long num_routed, num_passed;
static atomic_int is_routing;         /* 1 once calibrated and switched on */
static int init_status = -2;          /* see gmlx_interposer_init */

/* The real sgemm's K blocking, measured by calibrate(). */
static struct {
    long q;             /* GEMM_Q: the K block length */
    long unroll;        /* the single-thread driver rounds the half split up to this */
    double threshold;   /* M*N*K above which the threaded driver runs */
    int calib_threads;  /* BLAS threads when calibrated: 1 means the threaded rule is unknown */
    int alpha_mode;     /* 1: c = fma(alpha, acc, c); 0: c + alpha*acc; -1: route alpha == 1 only */
} blk;

/* How sgemm sums one output over one K block. CHAIN: a single fma chain in k order.
 * PAIRS: two chains, even and odd k, over the block's whole groups of 8 k, the rest run
 * into the even chain, the two added at the end (OpenBLAS's 4-column micro-kernel: our
 * rows 0-3 of a 4-7 row product, in the columns its full-width tiles cover). */
enum { CHAIN = 0, PAIRS = 1, NUM_ORDERS = 2 };
#define MAX_ROWS 8

/* One routed product of num_rows rows: for r < num_rows and j < n,
 *   out[r*ldo_row + j*ldo] = alpha * sum_k w(j, k) v[r*incv_row + k*incv] + beta * out,
 * with w(j, k) = w[j*sj + k*sk]; sk == 1 (rows contiguous) or sj == 1 (columns contiguous).
 * Several rows share each pass over w, so the weights are read once for all of them.
 * Row r sums in order tile_orders[r] for j < n rounded down to 8, tail_orders[r] after. */
typedef struct {
    long n, k;
    int num_rows;
    const float *v;
    long incv, incv_row;
    const float *w;
    long sj, sk;
    float *out;
    long ldo, ldo_row;
    float alpha, beta;
    int is_threaded;    /* reproduce the threaded driver's K split */
    int num_threads;    /* the BLAS's thread count, which ours follows */
    const unsigned char *tile_orders, *tail_orders;
} Product;

static const unsigned char all_chain[MAX_ROWS];

/* Per driver (0: single-thread, 1: threaded) and row count 2..MAX_ROWS: whether x @ W.T
 * (and x @ W) products of that many rows are routed, and each row's orders, from calibrate_rows. */
static struct {
    unsigned char is_ok[2][MAX_ROWS + 1][2][2];  /* [driver][rows][op(A) transposed][op(B) transposed] */
    unsigned char orders[2][MAX_ROWS + 1][2][MAX_ROWS];  /* [driver][rows][tile, tail][row] */
} multi;

/* Row-major layouts (after mapping col-major calls) whose routing passed the self-check,
 * indexed [N == 1][op(A) transposed][op(B) transposed]. */
static unsigned char is_layout_ok[2][2][2];

/* Length of the next K block when `left` values of k remain (OpenBLAS level3 drivers). */
static long next_block(long left, int is_threaded)
{
    if (left >= 2 * blk.q) return blk.q;
    if (left <= blk.q) return left;
    if (is_threaded) return (left + 1) / 2;
    return (left / 2 + blk.unroll - 1) / blk.unroll * blk.unroll;
}

static inline float start_value(const Product *p, int r, long j)
{
    if (p->beta == 0.0f) return 0.0f;  /* C is not read */
    float c = p->out[r * p->ldo_row + j * p->ldo];
    return p->beta == 1.0f ? c : p->beta * c;
}

static inline float add_block(float c, float acc, float alpha)
{
    return blk.alpha_mode == 0 ? c + alpha * acc : fmaf(alpha, acc, c);
}

/* One K block of one output in the given order. */
static float block_sum(const Product *p, const float *w, const float *v, long k0, long len, int order)
{
    float even = 0.0f, odd = 0.0f;
    long k = k0;
    if (order == PAIRS)
        for (const long end8 = k0 + len / 8 * 8; k < end8; k += 2) {
            even = fmaf(w[k * p->sk], v[k * p->incv], even);
            odd = fmaf(w[(k + 1) * p->sk], v[(k + 1) * p->incv], odd);
        }
    for (; k < k0 + len; k++) even = fmaf(w[k * p->sk], v[k * p->incv], even);
    return order == PAIRS ? even + odd : even;
}

/* Outputs [j0, j1) one at a time: any strides; the reference for the vector kernels. */
static void rows_scalar(const Product *p, long j0, long j1)
{
    for (int r = 0; r < p->num_rows; r++)
        for (long j = j0; j < j1; j++) {
            const int order = j < (p->n & ~7L) ? p->tile_orders[r] : p->tail_orders[r];
            float c = start_value(p, r, j);
            for (long k0 = 0, len; k0 < p->k; k0 += len) {
                len = next_block(p->k - k0, p->is_threaded);
                c = add_block(c, block_sum(p, p->w + j * p->sj, p->v + r * p->incv_row, k0, len, order),
                              p->alpha);
            }
            p->out[r * p->ldo_row + j * p->ldo] = c;
        }
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __m256 add_block8(__m256 c, __m256 acc, float alpha)
{
    __m256 a = _mm256_set1_ps(alpha);
    return blk.alpha_mode == 0 ? _mm256_add_ps(c, _mm256_mul_ps(a, acc))
                               : _mm256_fmadd_ps(a, acc, c);
}

/* 8 rows x 8 k of contiguous rows, transposed in registers: c_i holds w(j..j+7, k+i). */
#define TRANSPOSE_8X8(w, sj, k, c0, c1, c2, c3, c4, c5, c6, c7)                                  \
    do {                                                                                      \
        __m256 r0 = _mm256_loadu_ps((w) + (k)), r1 = _mm256_loadu_ps((w) + (sj) + (k));         \
        __m256 r2 = _mm256_loadu_ps((w) + 2 * (sj) + (k)), r3 = _mm256_loadu_ps((w) + 3 * (sj) + (k)); \
        __m256 r4 = _mm256_loadu_ps((w) + 4 * (sj) + (k)), r5 = _mm256_loadu_ps((w) + 5 * (sj) + (k)); \
        __m256 r6 = _mm256_loadu_ps((w) + 6 * (sj) + (k)), r7 = _mm256_loadu_ps((w) + 7 * (sj) + (k)); \
        __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);               \
        __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);               \
        __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);               \
        __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);               \
        __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);      \
        __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);      \
        __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);      \
        __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);      \
        c0 = _mm256_permute2f128_ps(s0, s4, 0x20), c4 = _mm256_permute2f128_ps(s0, s4, 0x31);  \
        c1 = _mm256_permute2f128_ps(s1, s5, 0x20), c5 = _mm256_permute2f128_ps(s1, s5, 0x31);  \
        c2 = _mm256_permute2f128_ps(s2, s6, 0x20), c6 = _mm256_permute2f128_ps(s2, s6, 0x31);  \
        c3 = _mm256_permute2f128_ps(s3, s7, 0x20), c7 = _mm256_permute2f128_ps(s3, s7, 0x31);  \
    } while (0)

/* acc[r] = fma(col, v_r[kk], acc[r]) for every row r: rows [0, num_pairs) sum in PAIRS
 * order (odd kk into their odd chain), the rest in one chain. Rows inner: the rows'
 * chains interleave, so the scheduler never fills with one row's dependent fmas. */
#define ROWS_STEP(col, kk, is_odd)                                                            \
    do {                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < num_rows; r++) {                          \
            const __m256 b = _mm256_broadcast_ss(p->v + r * p->incv_row + (kk) * inc);          \
            if ((is_odd) && r < num_pairs) odd[r] = _mm256_fmadd_ps(col, b, odd[r]);          \
            else even[r] = _mm256_fmadd_ps(col, b, even[r]);                                  \
        }                                                                                     \
    } while (0)

/* Contiguous rows (sk == 1, x @ W.T): one 8-row tile of W at a time, transposed in
 * registers 8 k at a time; lane i of row r's accumulator sums output (r, j+i), so each
 * 8x8 block of W is loaded once for all rows. Whole tiles only: the rest is scalar.
 * One tile at a time: two tiles in flight (two chains per row) measured no faster. */
AVX2 static inline __attribute__((always_inline)) long dot_tiles(const Product *p, long j0, long j1,
                                                                  const int num_rows, const int num_pairs)
{
    const long sj = p->sj, inc = p->incv;
    long j = j0;
    for (; j + 8 <= j1; j += 8) {
        const float *w = p->w + j * sj;
        __m256 c[MAX_ROWS], even[MAX_ROWS], odd[MAX_ROWS];
        for (int r = 0; r < num_rows; r++) {
            float cbuf[8];
            for (int i = 0; i < 8; i++) cbuf[i] = start_value(p, r, j + i);
            c[r] = _mm256_loadu_ps(cbuf);
        }
        for (long k0 = 0, len; k0 < p->k; k0 += len) {
            len = next_block(p->k - k0, p->is_threaded);
            const long end = k0 + len;
            for (int r = 0; r < num_rows; r++) even[r] = odd[r] = _mm256_setzero_ps();
            long k = k0;
            for (; k + 8 <= end; k += 8) {
                __m256 x0, x1, x2, x3, x4, x5, x6, x7;
                TRANSPOSE_8X8(w, sj, k, x0, x1, x2, x3, x4, x5, x6, x7);
                ROWS_STEP(x0, k, 0); ROWS_STEP(x1, k + 1, 1);
                ROWS_STEP(x2, k + 2, 0); ROWS_STEP(x3, k + 3, 1);
                ROWS_STEP(x4, k + 4, 0); ROWS_STEP(x5, k + 5, 1);
                ROWS_STEP(x6, k + 6, 0); ROWS_STEP(x7, k + 7, 1);
            }
            for (; k < end; k++) {  /* the block's last len % 8 k: the even chain in both orders */
                __m256 col = _mm256_set_ps(w[7 * sj + k], w[6 * sj + k], w[5 * sj + k], w[4 * sj + k],
                                           w[3 * sj + k], w[2 * sj + k], w[sj + k], w[k]);
                ROWS_STEP(col, k, 0);
            }
            for (int r = 0; r < num_rows; r++)
                c[r] = add_block8(c[r], r < num_pairs ? _mm256_add_ps(even[r], odd[r]) : even[r], p->alpha);
        }
        for (int r = 0; r < num_rows; r++) {
            float cbuf[8];
            _mm256_storeu_ps(cbuf, c[r]);
            for (int i = 0; i < 8; i++) p->out[r * p->ldo_row + (j + i) * p->ldo] = cbuf[i];
        }
    }
    return j;
}

/* dot_tiles with the row count and pair rows constant, so each instance keeps its
 * accumulators in registers (a runtime row count measured ~1.5x slower). */
#define DOT(m, pairs) \
    AVX2 static long dot_##m##_##pairs(const Product *p, long j0, long j1) { return dot_tiles(p, j0, j1, m, pairs); }
DOT(1, 0) DOT(2, 0) DOT(3, 0) DOT(4, 0) DOT(5, 0) DOT(6, 0) DOT(7, 0) DOT(8, 0)
DOT(4, 4) DOT(5, 4) DOT(6, 4) DOT(7, 4) DOT(8, 4) DOT(8, 8)
typedef long (*dot_fn)(const Product *, long, long);
static const dot_fn dot_by_rows[MAX_ROWS + 1][3] = {  /* [rows][pair rows / 4] */
    {NULL}, {dot_1_0}, {dot_2_0}, {dot_3_0}, {dot_4_0, dot_4_4}, {dot_5_0, dot_5_4},
    {dot_6_0, dot_6_4}, {dot_7_0, dot_7_4}, {dot_8_0, dot_8_4, dot_8_8}};

/* The number of leading PAIRS rows when the orders are PAIRS for a prefix of 0, 4 or 8
 * rows and CHAIN after it, as OpenBLAS's 4-column tiles give; -1 for any other pattern. */
static int num_pair_rows(const unsigned char *orders, int num_rows)
{
    int n = 0;
    while (n < num_rows && orders[n] == PAIRS) n++;
    for (int r = n; r < num_rows; r++)
        if (orders[r] != CHAIN) return -1;
    return n % 4 == 0 && dot_by_rows[num_rows][n / 4] ? n : -1;
}

static long rows_avx2_dot(const Product *p, long j0, long j1)
{
    const int num_pairs = num_pair_rows(p->tile_orders, p->num_rows);
    if (num_pairs < 0) return j0;  /* an order the vector kernels lack: all scalar */
    return dot_by_rows[p->num_rows][num_pairs / 4](p, j0, j1);
}

/* Eight k into the even chain e and the odd chain o; with e and o the same variable,
 * one chain in k order. */
#define AXPY_8K(e, o)                                                       \
    do {                                                                    \
        e = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), b0, e);                 \
        o = _mm256_fmadd_ps(_mm256_loadu_ps(w + sk + i), b1, o);            \
        e = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * sk + i), b2, e);        \
        o = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * sk + i), b3, o);        \
        e = _mm256_fmadd_ps(_mm256_loadu_ps(w + 4 * sk + i), b4, e);        \
        o = _mm256_fmadd_ps(_mm256_loadu_ps(w + 5 * sk + i), b5, o);        \
        e = _mm256_fmadd_ps(_mm256_loadu_ps(w + 6 * sk + i), b6, e);        \
        o = _mm256_fmadd_ps(_mm256_loadu_ps(w + 7 * sk + i), b7, o);        \
    } while (0)

/* Contiguous columns (sj == 1, x @ W), one row: acc[j - j0] = output j's fma chain over
 * k in [k0, k0 + len), from zero, for j in [j0, j1) (whole 8s). Each k adds one fma to
 * every output of a chunk of columns, eight k per pass over the chunk's accumulators
 * (kept in L1/L2), so W is read row after row, in long contiguous runs. Rows under ~2 KB
 * make eight short streams a pass, which the prefetchers follow worse: a 256 x 8192
 * weight reads ~1.3x slower this way than row-major (the transposing kernel). */
#define CHUNK 4096
AVX2 static void axpy_block(const Product *p, long k0, long len, long j0, long j1, float *acc)
{
    const long sk = p->sk, inc = p->incv, end = k0 + len;
    for (long j = j0; j < j1; j += CHUNK) {
        const long m = j1 - j < CHUNK ? j1 - j : CHUNK;
        float *a = acc + (j - j0);
        memset(a, 0, sizeof(float) * m);
        long k = k0;
        for (; k + 8 <= end; k += 8) {
            const float *w = p->w + k * sk + j, *v = p->v + k * inc;
            const __m256 b0 = _mm256_broadcast_ss(v), b1 = _mm256_broadcast_ss(v + inc);
            const __m256 b2 = _mm256_broadcast_ss(v + 2 * inc), b3 = _mm256_broadcast_ss(v + 3 * inc);
            const __m256 b4 = _mm256_broadcast_ss(v + 4 * inc), b5 = _mm256_broadcast_ss(v + 5 * inc);
            const __m256 b6 = _mm256_broadcast_ss(v + 6 * inc), b7 = _mm256_broadcast_ss(v + 7 * inc);
            for (long i = 0; i < m; i += 8) {
                __m256 t = _mm256_loadu_ps(a + i);
                AXPY_8K(t, t);
                _mm256_storeu_ps(a + i, t);
            }
        }
        for (; k < end; k++) {
            const float *w = p->w + k * sk + j;
            const __m256 b = _mm256_broadcast_ss(p->v + k * inc);
            for (long i = 0; i < m; i += 8)
                _mm256_storeu_ps(a + i, _mm256_fmadd_ps(_mm256_loadu_ps(w + i), b, _mm256_loadu_ps(a + i)));
        }
    }
}

/* Several rows of x @ W (sj == 1), one K block: acc[r * acc_row + (j - j0)] = row r's
 * sum for output j over k in [k0, k0 + len), in row r's tile order (one chain, or even/odd
 * k pairs over the block's whole groups of 8 k added at the end), for j in [j0, j1) (whole
 * 8s). W is read from memory once for all rows, eight k (a whole group) at a time over a
 * chunk of its columns, which stays in L1 while each row in turn adds it into its own
 * chains, kept in L1 as well. */
#define ROWS_CHUNK 256
_Static_assert(MAX_ROWS * ROWS_CHUNK <= CHUNK, "rows_avx2_axpy's buffers hold every row's chunk");
AVX2 static void axpy_rows_block(const Product *p, long k0, long len, long j0, long j1, float *acc, long acc_row)
{
    float even[MAX_ROWS][ROWS_CHUNK] __attribute__((aligned(32)));  /* 16 KB of stack in all */
    float odd[MAX_ROWS][ROWS_CHUNK] __attribute__((aligned(32)));
    const long sk = p->sk, inc = p->incv, end8 = k0 + len / 8 * 8, end = k0 + len;
    const int num_rows = p->num_rows;
    for (long j = j0; j < j1; j += ROWS_CHUNK) {
        const long m = j1 - j < ROWS_CHUNK ? j1 - j : ROWS_CHUNK;
        for (int r = 0; r < num_rows; r++) {
            memset(even[r], 0, sizeof(float) * m);
            memset(odd[r], 0, sizeof(float) * m);
        }
        long k = k0;
        for (; k < end8; k += 8) {  /* rows outer: a row's 8 broadcasts stay in registers */
            const float *w = p->w + k * sk + j;
            for (int r = 0; r < num_rows; r++) {
                const float *v = p->v + r * p->incv_row + k * inc;
                const __m256 b0 = _mm256_broadcast_ss(v), b1 = _mm256_broadcast_ss(v + inc);
                const __m256 b2 = _mm256_broadcast_ss(v + 2 * inc), b3 = _mm256_broadcast_ss(v + 3 * inc);
                const __m256 b4 = _mm256_broadcast_ss(v + 4 * inc), b5 = _mm256_broadcast_ss(v + 5 * inc);
                const __m256 b6 = _mm256_broadcast_ss(v + 6 * inc), b7 = _mm256_broadcast_ss(v + 7 * inc);
                if (p->tile_orders[r] == PAIRS) {
                    for (long i = 0; i < m; i += 8) {
                        __m256 e = _mm256_load_ps(even[r] + i), o = _mm256_load_ps(odd[r] + i);
                        AXPY_8K(e, o);
                        _mm256_store_ps(even[r] + i, e);
                        _mm256_store_ps(odd[r] + i, o);
                    }
                } else {
                    for (long i = 0; i < m; i += 8) {
                        __m256 e = _mm256_load_ps(even[r] + i);
                        AXPY_8K(e, e);
                        _mm256_store_ps(even[r] + i, e);
                    }
                }
            }
        }
        for (; k < end; k++) {  /* the block's last len % 8 k: the even chain in both orders */
            const float *w = p->w + k * sk + j;
            for (long i = 0; i < m; i += 8) {
                const __m256 w0 = _mm256_loadu_ps(w + i);
                for (int r = 0; r < num_rows; r++) {
                    const __m256 b = _mm256_broadcast_ss(p->v + r * p->incv_row + k * inc);
                    _mm256_store_ps(even[r] + i, _mm256_fmadd_ps(w0, b, _mm256_load_ps(even[r] + i)));
                }
            }
        }
        for (int r = 0; r < num_rows; r++)
            for (long i = 0; i < m; i += 8) {
                __m256 t = _mm256_load_ps(even[r] + i);
                if (p->tile_orders[r] == PAIRS) t = _mm256_add_ps(t, _mm256_load_ps(odd[r] + i));
                _mm256_storeu_ps(acc + r * acc_row + (j - j0) + i, t);
            }
    }
}

#undef AXPY_8K

/* Outputs [j0, j1) of x @ W (sj == 1), any row count, chunk by chunk, each row's blocks
 * added in k order; returns where the whole 8s of the tile region end (the rest is
 * scalar). One row takes the wide-chunk kernel, several the one that feeds every row. */
AVX2 static long rows_avx2_axpy(const Product *p, long j0, long j1)
{
    float acc[CHUNK] __attribute__((aligned(32)));  /* 32 KB of stack in all */
    float c[CHUNK] __attribute__((aligned(32)));
    const int num_rows = p->num_rows;
    const long chunk = num_rows == 1 ? CHUNK : ROWS_CHUNK;  /* row r's columns at r * chunk */
    const long n8 = p->n & ~7L, end = j0 + (((j1 < n8 ? j1 : n8) - j0) & ~7L);
    for (long j = j0; j < end; j += chunk) {
        const long m = end - j < chunk ? end - j : chunk;
        for (int r = 0; r < num_rows; r++)
            for (long i = 0; i < m; i++) c[r * chunk + i] = start_value(p, r, j + i);
        for (long k0 = 0, len; k0 < p->k; k0 += len) {
            len = next_block(p->k - k0, p->is_threaded);
            if (num_rows == 1) axpy_block(p, k0, len, j, j + m, acc);
            else axpy_rows_block(p, k0, len, j, j + m, acc, chunk);
            for (int r = 0; r < num_rows; r++)
                for (long i = 0; i < m; i += 8) {
                    float *cr = c + r * chunk + i;
                    _mm256_store_ps(cr, add_block8(_mm256_load_ps(cr), _mm256_load_ps(acc + r * chunk + i), p->alpha));
                }
        }
        for (int r = 0; r < num_rows; r++)
            for (long i = 0; i < m; i++) p->out[r * p->ldo_row + (j + i) * p->ldo] = c[r * chunk + i];
    }
    return end;
}

/* out = each row's blocks added in k order onto its start value (partial holds block b
 * of row r at (b * num_rows + r) * n): what the column-split kernels do per output. */
AVX2 static void add_blocks(const Product *p, const float *partial, int num_blocks)
{
    const long n = p->n, n8 = n & ~7L;
    for (int r = 0; r < p->num_rows; r++) {
        float *out = p->out + r * p->ldo_row;
        long j = 0;
        if (p->ldo == 1)
            for (; j < n8; j += 8) {
                float cbuf[8];
                for (int i = 0; i < 8; i++) cbuf[i] = start_value(p, r, j + i);
                __m256 c = _mm256_loadu_ps(cbuf);
                for (int b = 0; b < num_blocks; b++)
                    c = add_block8(c, _mm256_loadu_ps(partial + (b * p->num_rows + r) * n + j), p->alpha);
                _mm256_storeu_ps(out + j, c);
            }
        for (; j < n; j++) {
            float c = start_value(p, r, j);
            for (int b = 0; b < num_blocks; b++) c = add_block(c, partial[(b * p->num_rows + r) * n + j], p->alpha);
            out[j * p->ldo] = c;
        }
    }
}

static int has_avx2(void)
{
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return known;
}
#endif

static void run_rows(const Product *p, long j0, long j1)
{
#if defined(__x86_64__)
    if (has_avx2()) {
        if (p->sk == 1 && p->sj != 1) j0 = rows_avx2_dot(p, j0, j1);
        else if (p->sj == 1 && p->sk != 1) j0 = rows_avx2_axpy(p, j0, j1);
    }
#endif
    rows_scalar(p, j0, j1);
}

/* Split the columns across threads when the product is big enough to pay for it.
 * Helper threads persist between calls: a decode step makes one routed call per
 * weight matrix (63 a token on a 120M model), each ~0.1-0.4 ms, and a thread created
 * and joined per call cost ~50 us of each (1024x1024, 2 threads: 136 -> 87 us with
 * the weights in cache). A helper spins briefly after its span (the next product
 * usually follows within microseconds), then sleeps until woken. */
#define MAX_THREADS 16
#define SPIN_NS 200000  /* how long an idle helper polls before it sleeps */
/* n * k below which one thread does it all. Smaller splits pay in isolation (256x768:
 * 17 us split, 31 alone), but on a 2-core box a spinning helper takes the core the
 * Python thread builds the next graph on; a tiny model's decode showed no gain. */
#define MIN_THREADED_NK (1 << 20)

static struct {
    pthread_mutex_t busy;          /* one routed threaded call at a time uses the helpers */
    pthread_mutex_t lock;          /* guards sleeping helpers and the wake-up */
    pthread_cond_t wake;
    atomic_uint generation;        /* bumped once per job */
    atomic_int num_pending;        /* helpers not yet done with the current job */
    atomic_int num_sleeping;
    const Product *job;
    long per;                      /* columns per span; span i is [i*per, (i+1)*per) */
    int is_ksplit;                 /* the job is split by K blocks (ksplit), not columns */
    int num_helpers;               /* helper i runs span i + 1; reset in a forked child */
    unsigned start_generation[MAX_THREADS];  /* the generation each helper was started at */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static void run_span(const Product *p, long per, int span)
{
    const long j0 = span * per, j1 = (span + 1) * per;
    if (j0 < p->n) run_rows(p, j0, j1 < p->n ? j1 : p->n);
}

/* x @ W with W's columns contiguous (a weight stored input-major, K x N), of any row
 * count, split by K blocks rather than by columns: each block's chains are independent until
 * they are added in order, so each thread reads whole blocks of rows, front to back,
 * into its own partial sums, and the caller adds them up. Split by columns, each thread
 * would read half of every row: short runs with gaps, which the prefetchers follow worse. */
#define MAX_BLOCKS 256
#define KSPLIT_MAX_FLOATS (1L << 20)  /* partial sums up to 4 MB */
static struct {
    long k0[MAX_BLOCKS], len[MAX_BLOCKS];
    int owner[MAX_BLOCKS];         /* the thread that sums block b */
    int num_blocks;
    float *partial;                /* num_blocks x rows x n partial sums */
    size_t partial_floats;
} ks;

/* Plan the blocks (held: busy); 0 when the product does not fit the plan. */
static int ksplit_plan(const Product *p, int num_threads)
{
    long load[MAX_THREADS] = {0};
    int nb = 0;
    for (long k0 = 0, len; k0 < p->k; k0 += len, nb++) {
        if (nb == MAX_BLOCKS) return 0;
        len = next_block(p->k - k0, p->is_threaded);
        ks.k0[nb] = k0;
        ks.len[nb] = len;
    }
    if (nb < num_threads) return 0;
    /* Each block in turn to the least loaded thread: blocks are q long but the last two. */
    for (int b = 0; b < nb; b++) {
        int t = 0;
        for (int i = 1; i < num_threads; i++)
            if (load[i] < load[t]) t = i;
        ks.owner[b] = t;
        load[t] += ks.len[b];
    }
    const size_t need = (size_t)nb * p->num_rows * p->n;
    if (need > KSPLIT_MAX_FLOATS) return 0;  /* a huge vocabulary times 8 rows: split by columns */
    if (need > ks.partial_floats) {
        free(ks.partial);
        ks.partial = NULL;
        ks.partial_floats = 0;
        if (posix_memalign((void **)&ks.partial, 64, need * sizeof(float)) != 0) return 0;
        ks.partial_floats = need;
    }
    ks.num_blocks = nb;
    return 1;
}

static void ksplit_span(const Product *p, int thread)
{
#if defined(__x86_64__)
    const long n = p->n, n8 = n & ~7L;
    for (int b = 0; b < ks.num_blocks; b++) {
        if (ks.owner[b] != thread) continue;
        float *acc = ks.partial + (long)b * p->num_rows * n;
        if (p->num_rows == 1) axpy_block(p, ks.k0[b], ks.len[b], 0, n8, acc);
        else axpy_rows_block(p, ks.k0[b], ks.len[b], 0, n8, acc, n);
        for (int r = 0; r < p->num_rows; r++)  /* the last n % 8 columns, in the tail order */
            for (long j = n8; j < n; j++)
                acc[r * n + j] = block_sum(p, p->w + j, p->v + r * p->incv_row, ks.k0[b], ks.len[b],
                                           p->tail_orders[r]);
    }
#else
    (void)p, (void)thread;
#endif
}

static void *helper_main(void *arg)
{
    const int span = (int)(long)arg;
    unsigned seen = pool.start_generation[span];  /* not a load now: the first job may be out */
    for (;;) {
        unsigned gen = atomic_load(&pool.generation);
        for (long t0 = now_ns(); gen == seen && now_ns() - t0 < SPIN_NS; gen = atomic_load(&pool.generation))
            for (int i = 0; i < 64; i++) cpu_relax();
        if (gen == seen) {
            /* Counting ourselves asleep before the last check pairs with the caller
             * bumping the generation before it reads num_sleeping: no lost wake-up. */
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.num_sleeping, 1);
            while ((gen = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.num_sleeping, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = gen;
        if (pool.is_ksplit) ksplit_span(pool.job, span);
        else run_span(pool.job, pool.per, span);
        atomic_fetch_sub(&pool.num_pending, 1);
    }
    return NULL;
}

/* In a forked child the helpers are gone and the mutexes may be held by threads that
 * did not fork: start over. */
static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.num_sleeping, 0);
    pool.num_helpers = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Start helpers until there are `wanted` (held: pool.busy); returns how many exist. */
static int pool_grow(int wanted)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    while (pool.num_helpers < wanted) {
        pthread_t tid;
        pool.start_generation[pool.num_helpers + 1] = atomic_load(&pool.generation);
        if (pthread_create(&tid, NULL, helper_main, (void *)(long)(pool.num_helpers + 1)) != 0) break;
        pthread_detach(tid);
        pool.num_helpers++;
    }
    return pool.num_helpers;
}

static void run_threads(const Product *p)
{
    int num_threads = p->num_threads;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads < 2 || (double)p->n * p->k < MIN_THREADED_NK || p->n < 16 * num_threads ||
        pthread_mutex_trylock(&pool.busy) != 0) {  /* busy: another thread's product has them */
        run_rows(p, 0, p->n);
        return;
    }
    const int num_helpers = pool_grow(num_threads - 1);
    num_threads = num_helpers + 1 < num_threads ? num_helpers + 1 : num_threads;
    long per = (p->n + num_threads - 1) / num_threads;
    per = (per + 7) / 8 * 8;  /* whole 8-row tiles per thread */
    int is_ksplit = 0;
#if defined(__x86_64__)
    is_ksplit = has_avx2() && p->sj == 1 && p->sk != 1 && ksplit_plan(p, num_threads);
#endif
    pool.job = p;
    pool.per = per;
    pool.is_ksplit = is_ksplit;
    atomic_store(&pool.num_pending, num_helpers);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.num_sleeping) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    if (is_ksplit) {
        ksplit_span(p, 0);
        while (atomic_load(&pool.num_pending) > 0) cpu_relax();
#if defined(__x86_64__)
        add_blocks(p, ks.partial, ks.num_blocks);
#endif
    } else {
        run_span(p, per, 0);
        while (atomic_load(&pool.num_pending) > 0) cpu_relax();
    }
    pthread_mutex_unlock(&pool.busy);
}

/* Map a cblas_sgemm call with one row, one column, or 2..MAX_ROWS rows of x @ W.T onto
 * Product; 0 when the call is not routed. */
static int make_product(Product *p, int order, int trans_a, int trans_b, int M, int N, int K,
                       float alpha, const float *A, int lda, const float *B, int ldb,
                       float beta, float *C, int ldc)
{
    if (order == COL_MAJOR) {  /* C' = op(B)' op(A)' in row-major: swap the operands */
        int t = trans_a; trans_a = trans_b; trans_b = t;
        t = M; M = N; N = t;
        const float *x = A; A = B; B = x;
        t = lda; lda = ldb; ldb = t;
    } else if (order != ROW_MAJOR) {
        return 0;
    }
    int is_ta = trans_a == TRANS || trans_a == CONJ_TRANS;
    int is_tb = trans_b == TRANS || trans_b == CONJ_TRANS;
    if (!is_ta && trans_a != NO_TRANS && trans_a != CONJ_NO_TRANS) return 0;
    if (!is_tb && trans_b != NO_TRANS && trans_b != CONJ_NO_TRANS) return 0;
    /* Empty products, K == 0 (C = beta*C) and alpha == 0 keep the BLAS's own path;
     * so do bad leading dimensions, which the BLAS reports through xerbla. */
    if (M <= 0 || N <= 0 || K <= 0 || alpha == 0.0f) return 0;
    if (lda < (is_ta ? M : K) || ldb < (is_tb ? K : N) || ldc < N) return 0;
    if (alpha != 1.0f && blk.alpha_mode < 0) return 0;
    int num_threads = blas_get_threads();
    if (num_threads > 1 && blk.calib_threads == 1) return 0;
    const int is_threaded = num_threads > 1 && (double)M * N * K > blk.threshold;
    if (M == 1 || N == 1) {
        if (!is_layout_ok[M != 1][is_ta][is_tb]) return 0;
    } else {  /* several rows of x @ W.T or x @ W, at the calibrated thread count */
        if (M > MAX_ROWS || num_threads != blk.calib_threads) return 0;
        if (!multi.is_ok[is_threaded][M][is_ta][is_tb]) return 0;
    }
    if (N != 1) {  /* M rows of C: v = rows of op(A), w(j, k) = op(B)[k][j] */
        *p = (Product){.n = N, .num_rows = M, .v = A, .incv = is_ta ? lda : 1, .incv_row = is_ta ? 1 : lda,
                      .w = B, .sj = is_tb ? ldb : 1, .sk = is_tb ? 1 : ldb, .out = C, .ldo = 1,
                      .ldo_row = ldc, .tile_orders = all_chain, .tail_orders = all_chain};
        if (M > 1) {
            p->tile_orders = multi.orders[is_threaded][M][0];
            p->tail_orders = multi.orders[is_threaded][M][1];
        }
    } else {  /* one column of C: v = column of op(B), w(j, k) = op(A)[j][k] */
        *p = (Product){.n = M, .num_rows = 1, .v = B, .incv = is_tb ? 1 : ldb, .w = A,
                      .sj = is_ta ? 1 : lda, .sk = is_ta ? lda : 1, .out = C, .ldo = ldc,
                      .tile_orders = all_chain, .tail_orders = all_chain};
    }
    p->k = K;
    p->alpha = alpha;
    p->beta = beta;
    p->is_threaded = is_threaded;
    p->num_threads = num_threads;
    return 1;
}

void cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int,
                 float, float *, int);

/* The loaded BLAS's sgemm when init was not called (e.g. LD_PRELOAD): the first
 * other loaded object that defines cblas_sgemm. */
static int find_other_sgemm(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    Dl_info self;
    if (!info->dlpi_name || !info->dlpi_name[0]) return 0;
    if (!dladdr((void *)find_other_sgemm, &self) || strcmp(self.dli_fname, info->dlpi_name) == 0)
        return 0;
    void *h = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    void *f = dlsym(h, "cblas_sgemm");
    dlclose(h);
    if (!f || f == (void *)cblas_sgemm) return 0;
    *(void **)data = f;
    return 1;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    Product p;
    if (atomic_load_explicit(&is_routing, memory_order_relaxed) &&
        make_product(&p, order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
        run_threads(&p);
        atomic_fetch_add_explicit(&num_routed, 1, memory_order_relaxed);
        return;
    }
    if (!real_sgemm) {
        void *f = NULL;
        dl_iterate_phdr(find_other_sgemm, &f);
        real_sgemm = (sgemm_fn)f;
        if (!real_sgemm) abort();  /* no BLAS at all: nothing sane to compute with */
    }
    atomic_fetch_add_explicit(&num_passed, 1, memory_order_relaxed);
    real_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* ---- calibration: measure the real sgemm's K blocking, then self-check ---- */

/* Deterministic values in [-1, 1), exact in float. */
static void fill(float *x, long n, unsigned seed)
{
    unsigned s = seed * 2654435761u + 12345u;
    for (long i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)(s >> 8) / 8388608.0f - 1.0f;
    }
}

/* 1 when the routed kernel and the real sgemm agree bit for bit on one call; the
 * operands get `pad` extra elements per leading dimension. */
static int agrees(int order, int ta, int tb, int M, int N, int K, float alpha, float beta, int pad)
{
    int is_row = order == ROW_MAJOR, is_ta = ta == TRANS, is_tb = tb == TRANS;
    /* stored shapes: rows x cols of A, B, C as laid out in memory */
    long a_outer = is_row ? (is_ta ? K : M) : (is_ta ? M : K);
    long a_inner = is_row ? (is_ta ? M : K) : (is_ta ? K : M);
    long b_outer = is_row ? (is_tb ? N : K) : (is_tb ? K : N);
    long b_inner = is_row ? (is_tb ? K : N) : (is_tb ? N : K);
    long c_outer = is_row ? M : N, c_inner = is_row ? N : M;
    int lda = a_inner + pad, ldb = b_inner + pad, ldc = c_inner + pad;
    long na = a_outer * lda, nb = b_outer * ldb, nc = c_outer * ldc;
    float *buf = malloc(sizeof(float) * (na + nb + 2 * nc));
    if (!buf) return 0;
    float *a = buf, *b = a + na, *c1 = b + nb, *c2 = c1 + nc;
    fill(a, na, M * 7 + K);
    fill(b, nb, N * 13 + K);
    fill(c1, nc, 99);
    if (beta == 0.0f) for (long i = 0; i < nc; i++) c1[i] = NAN;  /* must not be read */
    memcpy(c2, c1, sizeof(float) * nc);
    real_sgemm(order, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c1, ldc);
    Product p;
    int ok = make_product(&p, order, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c2, ldc);
    if (ok) {
        run_threads(&p);
        ok = memcmp(c1, c2, sizeof(float) * nc) == 0;
    }
    free(buf);
    return ok;
}

/* The common decode call, x @ W.T with W of shape (n, k). */
static int agrees_nt(int n, int k)
{
    return agrees(ROW_MAJOR, NO_TRANS, TRANS, 1, n, k, 1.0f, 0.0f, 0);
}

static int calibrate_single(void)
{
    blk.q = 1L << 30, blk.unroll = 1, blk.threshold = INFINITY, blk.alpha_mode = 1;
    if (!agrees_nt(16, 64)) return 0;  /* not a plain fma chain: nothing to reproduce */
    long k = 128;
    while (k <= 16384 && agrees_nt(16, k)) k *= 2;
    if (k > 16384) return 0;
    long lo = k / 2, hi = k;  /* one block up to lo, split at hi */
    while (hi - lo > 1) {
        long mid = (lo + hi) / 2;
        if (agrees_nt(16, mid)) lo = mid; else hi = mid;
    }
    blk.q = lo;
    for (blk.unroll = 1; blk.unroll <= 64; blk.unroll *= 2) {
        int ok = agrees_nt(16, 2 * blk.q + blk.q / 2 + 3);
        for (long kk = blk.q + 1; ok && kk < 2 * blk.q; kk += 1 + blk.q / 64) ok = agrees_nt(16, kk);
        if (ok) return 1;
    }
    return 0;
}

/* Which K split the threaded driver uses, and from which M*N*K on. */
static int calibrate_threaded(void)
{
    long k = blk.q + 1;  /* a K whose split differs between the two drivers */
    while (k < 2 * blk.q && (k + 1) / 2 == (k / 2 + blk.unroll - 1) / blk.unroll * blk.unroll) k++;
    if (k >= 2 * blk.q) return 0;
    blk.threshold = 0.0;  /* assume threaded, find the smallest n where that holds */
    const long n_default = 262144 / k + 1;  /* OpenBLAS's default: 65536 * 4 */
    if (agrees_nt(n_default, k) && !agrees_nt(n_default - 1, k)) {
        blk.threshold = 262144.0;
        return 1;
    }
    long n = 16;  /* enough outputs that a wrong split cannot agree by chance */
    while (n * k <= (1L << 23) && !agrees_nt(n, k)) n *= 2;
    if (n * k > (1L << 23)) {
        blk.threshold = INFINITY;  /* never threaded */
        return agrees_nt(n / 2, k);
    }
    if (n == 16) return 0;  /* threaded already at the smallest probe: not OpenBLAS's rule */
    long lo = n / 2, hi = n;
    while (hi - lo > 1) {
        long mid = (lo + hi) / 2;
        if (agrees_nt(mid, k)) hi = mid; else lo = mid;
    }
    /* The threshold lies in [(hi-1)*k, hi*k); OpenBLAS uses a multiple of 65536. */
    double t = ceil((double)(hi - 1) * k / 65536.0) * 65536.0;
    if (t >= (double)hi * k) return 0;
    blk.threshold = t;
    return 1;
}

/* Which order each row of an m-row x @ W.T follows under one driver, in the full
 * 8-column tiles and in the tail, on shapes that driver runs; a row count where some
 * row follows neither order stays unrouted. */
static void calibrate_rows(int is_threaded)
{
    static const long single_shapes[][2] = {{16, 9}, {67, 63}, {203, 655}, {523, 321}, {1030, 60}, {99, 1000}};
    static const long threaded_shapes[][2] = {{525, 655}, {1030, 321}, {301, 2048}, {4103, 70}};
    const long (*shapes)[2] = is_threaded ? threaded_shapes : single_shapes;
    const int num_shapes = is_threaded ? 4 : 6;
    for (int m = 2; m <= MAX_ROWS; m++) {
        unsigned char can[2][MAX_ROWS];  /* [tile, tail][row]: bit o set while order o matches */
        memset(can, (1 << NUM_ORDERS) - 1, sizeof(can));
        int num_probed = 0;
        for (int s = 0; s < num_shapes; s++) {
            const long n = shapes[s][0], k = shapes[s][1], n8 = n & ~7L;
            if (((double)m * n * k > blk.threshold) != is_threaded) continue;
            float *buf = malloc(sizeof(float) * (m * k + n * k + 2 * m * n));
            if (!buf) return;
            float *x = buf, *w = x + m * k, *c_real = w + n * k, *c_ours = c_real + m * n;
            fill(x, m * k, m + k);
            fill(w, n * k, n + 3 * k);
            real_sgemm(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0f, x, k, w, k, 0.0f, c_real, n);
            for (int o = 0; o < NUM_ORDERS; o++) {
                unsigned char orders[MAX_ROWS];
                memset(orders, o, sizeof(orders));
                Product p = {.n = n, .k = k, .num_rows = m, .v = x, .incv = 1, .incv_row = k, .w = w,
                            .sj = k, .sk = 1, .out = c_ours, .ldo = 1, .ldo_row = n, .alpha = 1.0f,
                            .beta = 0.0f, .is_threaded = is_threaded, .num_threads = blas_get_threads(),
                            .tile_orders = orders, .tail_orders = orders};
                run_threads(&p);
                for (int r = 0; r < m; r++) {
                    const float *real = c_real + r * n, *ours = c_ours + r * n;
                    if (memcmp(real, ours, sizeof(float) * n8) != 0) can[0][r] &= ~(1 << o);
                    if (memcmp(real + n8, ours + n8, sizeof(float) * (n - n8)) != 0) can[1][r] &= ~(1 << o);
                }
            }
            free(buf);
            num_probed++;
        }
        int is_ok = num_probed > 0;
        for (int region = 0; region < 2; region++)
            for (int r = 0; r < m; r++) {
                is_ok = is_ok && can[region][r] != 0;
                multi.orders[is_threaded][m][region][r] = (can[region][r] & (1 << CHAIN)) ? CHAIN : PAIRS;
            }
#if defined(__x86_64__)
        is_ok = is_ok && num_pair_rows(multi.orders[is_threaded][m][0], m) >= 0;  /* else all scalar: slow */
#endif
        /* x @ W sums in the same orders (the BLAS packs either layout into the same
         * panels); self_check_rows confirms each layout. */
        memset(multi.is_ok[is_threaded][m], is_ok, sizeof(multi.is_ok[is_threaded][m]));
    }
}

/* Routed row counts against the real sgemm in row-major and column-major calls, op(A)
 * plain and transposed, padded, general alpha and beta; a miss unroutes that case. */
static void self_check_rows(void)
{
    for (int m = 2; m <= MAX_ROWS; m++)
        for (int is_ta = 0; is_ta < 2; is_ta++)
            for (int is_tb = 0; is_tb < 2; is_tb++)
            for (int d = 0; d < 2; d++) {
                unsigned char *ok = &multi.is_ok[d][m][is_ta][is_tb];
                /* shapes each driver runs here: small for the single one, above the threshold */
                const long n = d ? 523 : 43, ks[] = {d ? 1000 : 7, blk.q + 1, d ? 2 * blk.q + 3 : 300};
                const int ta = is_ta ? TRANS : NO_TRANS, tb = is_tb ? TRANS : NO_TRANS;
                for (int i = 0; i < 3 && *ok; i++) {
                    float alpha = blk.alpha_mode < 0 ? 1.0f : (i == 1 ? 0.75f : 1.0f);
                    float beta = (float[]){0.0f, 1.0f, -0.5f}[i];
                    *ok = agrees(ROW_MAJOR, ta, tb, m, n, ks[i], alpha, beta, i)
                          && agrees(COL_MAJOR, tb, ta, n, m, ks[i], alpha, beta, 2 - i);
                }
            }
}

/* Every layout, both drivers, odd sizes and padded leading dimensions; a layout
 * that disagrees anywhere is not routed. */
static int self_check(void)
{
    const int orders[] = {ROW_MAJOR, COL_MAJOR}, trans[] = {NO_TRANS, TRANS};
    const long q = blk.q;
    const int ks[] = {7, (int)q + 1, (int)(2 * q + 3)};
    /* rows enough for the threaded driver (and ours) with a K of two uneven halves */
    const int n_big = isinf(blk.threshold) ? 64 : (int)(blk.threshold / (2 * q - 1)) + 9;
    const float alphas[] = {1.0f, 0.75f}, betas[] = {0.0f, 1.0f, -0.5f};
    memset(is_layout_ok, 1, sizeof(is_layout_ok));
    for (int o = 0; o < 2; o++)
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++)
                for (int one_col = 0; one_col < 2; one_col++) {
                    /* the row-major layout this call maps onto */
                    int is_col = orders[o] == COL_MAJOR, rn1 = is_col ? !one_col : one_col;
                    unsigned char *ok = &is_layout_ok[rn1][is_col ? b : a][is_col ? a : b];
                    for (int ki = 0; ki < 3 && *ok; ki++)
                        for (int s = 0; s < 3 && *ok; s++) {
                            int n = (int[]){1, 5, 19}[s], k = ks[ki];
                            float alpha = blk.alpha_mode < 0 ? 1.0f : alphas[s % 2];
                            float beta = betas[(s + ki) % 3];
                            *ok = agrees(orders[o], trans[a], trans[b], one_col ? n : 1,
                                         one_col ? 1 : n, k, alpha, beta, (s + o) % 3);
                        }
                    if (is_col) continue;  /* the big ones once per row-major layout */
                    if (*ok) *ok = agrees(ROW_MAJOR, trans[a], trans[b], one_col ? n_big : 1,
                                          one_col ? 1 : n_big, 2 * q - 1, 1.0f, 0.0f, 1);
                    if (*ok) *ok = agrees(ROW_MAJOR, trans[a], trans[b], one_col ? 48 : 1,
                                          one_col ? 1 : 48, 20 * q + q + 1, 1.0f, 1.0f, 0);
                    /* big enough for our own two-thread split (by K blocks for x @ W) */
                    if (*ok) *ok = agrees(ROW_MAJOR, trans[a], trans[b], one_col ? 1031 : 1,
                                          one_col ? 1 : 1031, 3 * q + 77, 1.0f, 1.0f, 1);
                }
    int num_ok = 0;
    for (int i = 0; i < 8; i++) num_ok += ((unsigned char *)is_layout_ok)[i];
    return num_ok > 0;
}

static int calibrate(void)
{
    int threads = blas_get_threads();
    blk.calib_threads = threads;
    memset(is_layout_ok, 1, sizeof(is_layout_ok));  /* until self_check decides */
    blas_set_threads(1);
    int ok = calibrate_single();
    if (ok) {  /* general alpha: fused add, else plain add, else only alpha == 1 */
        blk.alpha_mode = 1;
        if (!agrees(ROW_MAJOR, NO_TRANS, TRANS, 1, 9, 100, 0.75f, 1.0f, 0)) {
            blk.alpha_mode = 0;
            if (!agrees(ROW_MAJOR, NO_TRANS, TRANS, 1, 9, 100, 0.75f, 1.0f, 0)) blk.alpha_mode = -1;
        }
    }
    if (ok) calibrate_rows(0);
    blas_set_threads(threads);
    if (ok && threads > 1) ok = calibrate_threaded();
    if (ok && threads > 1) calibrate_rows(1);
    if (ok) self_check_rows();
    return ok && self_check();
}

/* ---- the Python-facing API ---- */

/* Bind the real sgemm of the BLAS at `blas_path` (already loaded or loadable) and
 * calibrate. Returns 0: routing on; 1: every call passes through (the BLAS is not
 * OpenBLAS, or its order could not be reproduced); 2: passes through, as this CPU
 * has no vector kernel here (the scalar one would be slower than sgemm); -1: no
 * cblas_sgemm there. */
int gmlx_interposer_init(const char *blas_path)
{
    void *h = dlopen(blas_path, RTLD_NOW | RTLD_GLOBAL);
    /* Plain names, or the scipy_ prefix of the OpenBLAS wheels numpy and scipy ship. */
    const char *prefix = h && dlsym(h, "cblas_sgemm") ? "" : "scipy_";
    char name[64];
    snprintf(name, sizeof(name), "%scblas_sgemm", prefix);
    sgemm_fn f = h ? (sgemm_fn)dlsym(h, name) : NULL;
    if (!f || f == cblas_sgemm) return init_status = -1;
    real_sgemm = f;
    snprintf(name, sizeof(name), "%sopenblas_get_num_threads", prefix);
    blas_get_threads = (get_threads_fn)dlsym(h, name);
    snprintf(name, sizeof(name), "%sopenblas_set_num_threads", prefix);
    blas_set_threads = (set_threads_fn)dlsym(h, name);
    atomic_store(&is_routing, 0);
#if defined(__x86_64__)
    if (!has_avx2()) return init_status = 2;
#else
    return init_status = 2;
#endif
    if (!blas_get_threads || !blas_set_threads || !calibrate()) return init_status = 1;
    atomic_store(&is_routing, 1);
    return init_status = 0;
}

/* Turn routing off (0) or back on (1, only after a successful init); returns the state. */
int gmlx_interposer_set_routing(int on)
{
    atomic_store(&is_routing, on && init_status == 0);
    return atomic_load(&is_routing);
}

int gmlx_interposer_is_routing(void) { return atomic_load(&is_routing); }

void gmlx_interposer_counts(long *routed, long *passed)
{
    *routed = atomic_load(&num_routed);
    *passed = atomic_load(&num_passed);
}

/* Bit i set when row-major layout i = 4*(N == 1) + 2*transA + transB is routed. */
int gmlx_interposer_layouts(void)
{
    int mask = 0;
    for (int i = 0; i < 8; i++) mask |= ((unsigned char *)is_layout_ok)[i] << i;
    return mask;
}

/* Bit m set when x @ W.T products of m rows (2..8) are routed under the single-thread
 * driver (is_threaded 0) or the threaded one (1). For 2 <= m <= 8, orders gets m letters
 * for the full tiles, '/', m for the tail: 'c' one fma chain, 'p' even/odd pairs. */
int gmlx_interposer_rows(int is_threaded, int m, char *orders)
{
    const int d = is_threaded != 0;
    int mask = 0;
    for (int r = 2; r <= MAX_ROWS; r++) mask |= multi.is_ok[d][r][0][1] << r;
    if (m >= 2 && m <= MAX_ROWS) {
        for (int r = 0; r < m; r++) {
            orders[r] = multi.orders[d][m][0][r] == PAIRS ? 'p' : 'c';
            orders[m + 1 + r] = multi.orders[d][m][1][r] == PAIRS ? 'p' : 'c';
        }
        orders[m] = '/';
        orders[2 * m + 1] = 0;
    }
    return mask;
}

/* Bit m set when products of m rows (2..8) are routed under the driver (is_threaded),
 * with W's rows contiguous (is_tb 1: x @ W.T) or its columns (0: x @ W, a weight
 * stored input-major). */
int gmlx_interposer_rows_routed(int is_threaded, int is_tb)
{
    int mask = 0;
    for (int r = 2; r <= MAX_ROWS; r++) mask |= multi.is_ok[is_threaded != 0][r][0][is_tb != 0] << r;
    return mask;
}

/* The measured blocking: GEMM_Q, the unroll, the threaded threshold (-1: never), the
 * alpha mode and the BLAS threads at calibration. */
void gmlx_interposer_blocking(long *q, long *unroll, double *threshold, int *alpha_mode, int *threads)
{
    *q = blk.q;
    *unroll = blk.unroll;
    *threshold = isinf(blk.threshold) ? -1.0 : blk.threshold;
    *alpha_mode = blk.alpha_mode;
    *threads = blk.calib_threads;
}
