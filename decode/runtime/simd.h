// Vector helpers shared by the native decoding kernels (rows_kernel.cpp, attention_kernel.cpp): one `vec` of LANES
// float32 lanes, AVX-512 where the compiler targets it (-march=native), else AVX2 + FMA.
#pragma once

#include <immintrin.h>
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
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
static inline void vstore_tail(float* p, vec a, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), a); }
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2(vec n) {  // 2^n for integral n in [-126, 127], built in the exponent bits
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
static inline vec vzero_below(vec a, vec x, float lo) {  // a where x >= lo, 0 elsewhere
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), a);
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
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
static inline void vstore_tail(float* p, vec a, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane), a);
}
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2(vec n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline vec vzero_below(vec a, vec x, float lo) {
    return _mm256_and_ps(a, _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ));
}
#else
#error "the native kernels need AVX2 and FMA (or AVX-512F)"
#endif
