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
// Lane j of the result: the sum of v[j]'s lanes, for j < LANES. Every v[j] is summed by the same tree, ((l0 + l2) +
// (l1 + l3)) within each 4-lane chunk c giving S_c, then (S0 + S2) + (S1 + S3), whatever j: a value does not depend
// on which slot of the block it took. About 3 shuffles and adds per vector, against 8 for one vsum each.
static inline vec vsum_many(const vec* v) {
    vec w[8], x[4];
    for (int i = 0; i < 8; ++i)  // chunk elements (a0+a2, b0+b2, a1+a3, b1+b3) of v[2i] = a, v[2i+1] = b
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // chunk element m: S_c of v[4i + m]
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // chunks (S0 + S2, S1 + S3) of x[0] and x[1], then of x[2] and x[3]; then chunk i: the totals of v[4i..4i+3]
    const vec z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const vec z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
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
// As the AVX-512 one: the same tree for every v[j], S_c within each 4-lane half c, then S0 + S1.
static inline vec vsum_many(const vec* v) {
    vec w[4], x[2];
    for (int i = 0; i < 4; ++i)
        w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
}
#else
#error "the native kernels need AVX2 and FMA (or AVX-512F)"
#endif
