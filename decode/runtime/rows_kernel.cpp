// Few-row CPU linear product for decoding: y (M, N) = x (M, K) @ w (N, K)^T, x and y float32, w float32 or
// bfloat16 (widened to float32 as it is loaded), 1 <= M, row-major and contiguous. Built at first use by decode/runtime/native_rows.py with -O3 -march=native -fopenmp and called
// through ctypes.
//
// Why: a decoding step or a small tree verification multiplies 1-16 rows by every weight of the target. That is
// bound by streaming the weights from memory (the default target's 538 MB), yet on a 2-core AMD EPYC MKL's GEMM
// took 29 ms for one or two rows and 88 ms for eight, where this kernel takes 15 and 17 (up to 12 rows in one pass
// with AVX-512). Each thread streams its own contiguous block of weight rows once, prefetching ahead into L2, and
// multiplies a tile of weight vectors with all M input rows while they are in registers.
//
// Exactness: element (m, n) is always the same sequence of fused multiply-adds over k (LANES partial sums in
// k order, then one fixed horizontal sum), whatever M, the thread count or the split of N. A row's result is
// therefore bitwise the same whether it is computed alone (a vanilla decoding step) or with other rows (a tree
// verification), which tests/test_native_rows.py checks.

#include <omp.h>
#include <stdint.h>

#include "simd.h"

// Weight vectors: float32 as they are, or LANES bfloat16 values (the high halves of float32s) widened exactly to
// float32. A bfloat16 weight streams half the bytes, and the few-row products of decoding are bound by that stream:
// a draft's weights (it may run in any precision: the target's verification keeps decoding lossless) use it.
typedef uint16_t bf16;
static inline vec wload(const float* p) { return vload(p); }
static inline vec wload_tail(const float* p, int64_t n) { return vload_tail(p, n); }
static inline vec wload(const bf16* p) {
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#endif
}
static inline vec wload_tail(const bf16* p, int64_t n) {  // the first n < LANES values, zeros after
    bf16 part[LANES] = {0};
    for (int64_t i = 0; i < n; ++i) part[i] = p[i];
    return wload(part);
}

// input rows per pass over the weights (their accumulators held in registers: 24 of the 32 AVX-512 ones, 8 of 16)
#if defined(__AVX512F__)
static const int MAX_BLOCK = 12;
#else
static const int MAX_BLOCK = 8;
#endif
// Weight floats ahead of the current load that are prefetched into L2 (16 KB). The hardware prefetchers alone stop
// keeping the stream ahead once the core is busy multiplying several rows: on a 2-core AMD EPYC, 4-5 rows through
// the default target's weights took 22-25 ms without this and 14 ms with it, 8 rows 35 against 21, one row 18
// against 15 (benchmarks/results/linear-kernels-ab-native-cpu.json has the model-level effect).
// Counted in bytes (16 KB), so that a bfloat16 weight looks as far ahead in memory as a float32 one.
static const int64_t PREFETCH_BYTES = 16384;

// Weight rows [n, n + R) against M input rows in one pass: each k step loads R weight vectors and M input vectors
// for M * R fused multiply-adds. One weight row at a time (R = 1) needed M + 1 loads for M of them, and from 5
// input rows on the cores waited on loads rather than on memory: on a 2-core AMD EPYC the default target's weights
// took 22.0 ms for 8 rows and 28.5 for 9 (two passes) against 17.3 for one; tiled, 17.6 and 20.2 against 17.2
// (benchmarks/results/native-kernel-ab-tiles-cpu.json). Element (m, n) gets the same sequence of FMAs whatever R is.
template <int M, int R, typename W>
static void rows_tile(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n) {
    constexpr int64_t PREFETCH = PREFETCH_BYTES / (int64_t)sizeof(W);
    const int64_t body = K - K % LANES;
    const W* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n + r) * K;
    vec acc[M][R];
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = vzero();
    for (int64_t k = 0; k < body; k += LANES) {
        vec wv[R];
        for (int r = 0; r < R; ++r) {
            _mm_prefetch((const char*)(wr[r] + k + PREFETCH), _MM_HINT_T1);  // a hint: never faults past the end
            wv[r] = wload(wr[r] + k);
        }
        for (int m = 0; m < M; ++m) {
            const vec xv = vload(x + m * K + k);
            for (int r = 0; r < R; ++r) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
        }
    }
    if (body < K) {
        vec wv[R];
        for (int r = 0; r < R; ++r) wv[r] = wload_tail(wr[r] + body, K - body);
        for (int m = 0; m < M; ++m) {
            const vec xv = vload_tail(x + m * K + body, K - body);
            for (int r = 0; r < R; ++r) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
        }
    }
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) y[m * N + n + r] = vsum(acc[m][r]);
}

// Weight rows [n0, n1) against M input rows: tiles of R weight rows, then the leftover rows one at a time.
template <int M, typename W>
static void rows_block(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    // M * R accumulators + R weight vectors + 1 input vector stay within 16 registers (AVX2) or 32 (AVX-512)
    constexpr int R = LANES == 16 ? (M == 3 || M == 4 ? 4 : 2) : (M <= 4 ? 2 : 1);
    int64_t n = n0;
    for (; n + R <= n1; n += R) rows_tile<M, R, W>(x, w, y, K, N, n);
    for (; n < n1; ++n) rows_tile<M, 1, W>(x, w, y, K, N, n);
}

template <typename W>
static void rows_any(const float* x, const W* w, float* y, int64_t m, int64_t K, int64_t N, int64_t n0,
                     int64_t n1) {
    switch (m) {
        case 1: rows_block<1, W>(x, w, y, K, N, n0, n1); break;
        case 2: rows_block<2, W>(x, w, y, K, N, n0, n1); break;
        case 3: rows_block<3, W>(x, w, y, K, N, n0, n1); break;
        case 4: rows_block<4, W>(x, w, y, K, N, n0, n1); break;
        case 5: rows_block<5, W>(x, w, y, K, N, n0, n1); break;
        case 6: rows_block<6, W>(x, w, y, K, N, n0, n1); break;
        case 7: rows_block<7, W>(x, w, y, K, N, n0, n1); break;
#if defined(__AVX512F__)
        case 8: rows_block<8, W>(x, w, y, K, N, n0, n1); break;
        case 9: rows_block<9, W>(x, w, y, K, N, n0, n1); break;
        case 10: rows_block<10, W>(x, w, y, K, N, n0, n1); break;
        case 11: rows_block<11, W>(x, w, y, K, N, n0, n1); break;
        default: rows_block<12, W>(x, w, y, K, N, n0, n1); break;
#else
        default: rows_block<8, W>(x, w, y, K, N, n0, n1); break;
#endif
    }
}

// -> 0 on success, 1 on arguments it does not take. threads: the caller's torch thread count.
template <typename W>
static int rows_linear(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int threads) {
    if (M < 1 || K < 1 || N < 1 || threads < 1) return 1;
    if (threads > N) threads = (int)N;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t per = (N + T - 1) / T;  // one contiguous block of weight rows per thread
        const int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        // more rows than one pass takes: passes of equal size (16 rows as 8 + 8 took 37 ms, as 12 + 4 43)
        const int64_t passes = (M + MAX_BLOCK - 1) / MAX_BLOCK, per_pass = (M + passes - 1) / passes;
        for (int64_t m0 = 0; m0 < M && n0 < n1; m0 += per_pass) {
            const int64_t m = M - m0 < per_pass ? M - m0 : per_pass;
            rows_any<W>(x + m0 * K, w, y + m0 * N, m, K, N, n0, n1);
        }
    }
    return 0;
}

extern "C" int vlm_rows_linear(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                               int threads) {
    return rows_linear<float>(x, w, y, M, K, N, threads);
}

extern "C" int vlm_rows_linear_bf16(const float* x, const bf16* w, float* y, int64_t M, int64_t K, int64_t N,
                                    int threads) {
    return rows_linear<bf16>(x, w, y, M, K, N, threads);
}

// The vector width this build uses (16: AVX-512, 8: AVX2); recorded with the kernel choices.
extern "C" int vlm_rows_lanes(void) { return (int)LANES; }
