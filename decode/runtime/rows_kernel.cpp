// Few-row CPU linear product for decoding: y (M, N) = x (M, K) @ w (N, K)^T, float32, 1 <= M, row-major and
// contiguous. Built at first use by decode/runtime/native_rows.py with -O3 -march=native -fopenmp and called
// through ctypes.
//
// Why: a decoding step or a small tree verification multiplies 1-16 rows by every weight of the target. That is
// bound by streaming the weights from memory (the default target's 538 MB), yet on a 2-core AMD EPYC MKL's GEMM
// took 29 ms for one or two rows and 88 ms for eight, where this kernel takes 15 and 21. Each thread streams its
// own contiguous block of weight rows once, prefetching ahead into L2, and multiplies every weight vector with all
// M input rows while it is in registers.
//
// Exactness: element (m, n) is always the same sequence of fused multiply-adds over k (LANES partial sums in
// k order, then one fixed horizontal sum), whatever M, the thread count or the split of N. A row's result is
// therefore bitwise the same whether it is computed alone (a vanilla decoding step) or with other rows (a tree
// verification), which tests/test_native_rows.py checks.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__)
typedef __m512 vec;
static const int64_t LANES = 16;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vload_tail(const float* p, int64_t n) {  // the first n < LANES floats, zeros after
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
static const int64_t LANES = 8;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vload_tail(const float* p, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#else
#error "rows_kernel.cpp needs AVX2 and FMA (or AVX-512F)"
#endif

static const int MAX_BLOCK = 8;  // input rows per pass over the weights (accumulators held in registers)
// Weight floats ahead of the current load that are prefetched into L2 (16 KB). The hardware prefetchers alone stop
// keeping the stream ahead once the core is busy multiplying several rows: on a 2-core AMD EPYC, 4-5 rows through
// the default target's weights took 22-25 ms without this and 14 ms with it, 8 rows 35 against 21, one row 18
// against 15 (benchmarks/results/linear-kernels-ab-native-cpu.json has the model-level effect).
static const int64_t PREFETCH = 4096;

// Weight rows [n0, n1) against M input rows: one pass over that block of w.
template <int M>
static void rows_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const int64_t body = K - K % LANES;
    for (int64_t n = n0; n < n1; ++n) {
        const float* wr = w + n * K;
        vec acc[M];
        for (int m = 0; m < M; ++m) acc[m] = vzero();
        for (int64_t k = 0; k < body; k += LANES) {
            _mm_prefetch((const char*)(wr + k + PREFETCH), _MM_HINT_T1);  // a hint: never faults past the end
            const vec wv = vload(wr + k);
            for (int m = 0; m < M; ++m) acc[m] = vfma(wv, vload(x + m * K + k), acc[m]);
        }
        if (body < K) {
            const vec wv = vload_tail(wr + body, K - body);
            for (int m = 0; m < M; ++m) acc[m] = vfma(wv, vload_tail(x + m * K + body, K - body), acc[m]);
        }
        for (int m = 0; m < M; ++m) y[m * N + n] = vsum(acc[m]);
    }
}

static void rows_any(const float* x, const float* w, float* y, int64_t m, int64_t K, int64_t N, int64_t n0,
                     int64_t n1) {
    switch (m) {
        case 1: rows_block<1>(x, w, y, K, N, n0, n1); break;
        case 2: rows_block<2>(x, w, y, K, N, n0, n1); break;
        case 3: rows_block<3>(x, w, y, K, N, n0, n1); break;
        case 4: rows_block<4>(x, w, y, K, N, n0, n1); break;
        case 5: rows_block<5>(x, w, y, K, N, n0, n1); break;
        case 6: rows_block<6>(x, w, y, K, N, n0, n1); break;
        case 7: rows_block<7>(x, w, y, K, N, n0, n1); break;
        default: rows_block<8>(x, w, y, K, N, n0, n1); break;
    }
}

// -> 0 on success, 1 on arguments it does not take. threads: the caller's torch thread count.
extern "C" int vlm_rows_linear(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                               int threads) {
    if (M < 1 || K < 1 || N < 1 || threads < 1) return 1;
    if (threads > N) threads = (int)N;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t per = (N + T - 1) / T;  // one contiguous block of weight rows per thread
        const int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        for (int64_t m0 = 0; m0 < M && n0 < n1; m0 += MAX_BLOCK) {  // more than 8 rows: another pass
            const int64_t m = M - m0 < MAX_BLOCK ? M - m0 : MAX_BLOCK;
            rows_any(x + m0 * K, w, y + m0 * N, m, K, N, n0, n1);
        }
    }
    return 0;
}

// The vector width this build uses (16: AVX-512, 8: AVX2); recorded with the kernel choices.
extern "C" int vlm_rows_lanes(void) { return (int)LANES; }
