// Attention of a few query tokens over the KV cache on the CPU, for decoding: out (N, H, Dv) from q (H, N, D),
// k (KVH, K, D), v (KVH, K, Dv) and an additive mask (N, K) shared by every head; query head h reads KV head
// h / (H / KVH) (grouped-query attention). float32 throughout; the last dimension of every tensor is contiguous,
// the others are given as strides. Built with the few-row linear kernel (decode/runtime/native_rows.py), called
// through ctypes (decode/runtime/native_attention.py).
//
// Why: the target's tree verification must compute each of its tokens exactly as a vanilla decoding step computes
// it, bit for bit, or a near-tie between the two best logits can flip a greedy token and the output is no longer
// the target's own. The linear layers are (rows_kernel.cpp); aten's CPU attention is not: on the default target a
// token's logits differed by up to 2e-5 between a step and a 2-8 token verification, all of it from attention (the
// norms and projections before it agreed bitwise). Here one (head, query) pair is one fixed sequence of operations
// over the keys in order (dot products, the row's maximum, exponentials, their sum, the weighted values) that reads
// nothing of the other queries, whatever N, the thread count or which thread takes it.
//
// Cost: for one token on the default target (9 heads on 3 KV heads, ~300 keys) about as much as aten's kernel per
// layer or less, as it skips that kernel's blocking and thread dispatch for a few rows of work.

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

#include "simd.h"

// exp(x) lane by lane for x <= 0 (a score minus its row's maximum): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the
// Cephes single-precision minimax polynomial (about 1 ulp), times 2^n. Below -87 (and for the mask's -3.4e38) 0.
static inline vec vexp_nonpositive(vec x) {
    const float lo = -87.0f;
    const vec xc = vmax(x, vset1(lo));
    const vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
    vec r = vfma(n, vset1(-0.693359375f), xc);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    const vec y = vadd(vfma(vmul(p, r), r, r), vset1(1.0f));  // p r^2 + r + 1
    return vzero_below(vmul(y, vpow2(n)), x, lo);
}

static inline float dot(const float* a, const float* b, int64_t d) {
    const int64_t body = d - d % LANES;
    vec acc = vzero();
    for (int64_t i = 0; i < body; i += LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    if (body < d) acc = vfma(vload_tail(a + body, d - body), vload_tail(b + body, d - body), acc);
    return vsum(acc);
}

struct Shapes {  // what one KV head's group of queries reads: keys, head dims, key/value row strides, scale
    int64_t K, D, Dv, ks_k, vs_k;
    float scale;
};

// Query rows that read the same KV head go through it in groups of up to GROUP, so that each key and value row is
// loaded once per group, not once per query. A query's own sequence of operations is the same in any group.
static const int GROUP = 4;

struct Row {
    const float* q;     // (D,)
    const float* mask;  // (K,)
    float* out;         // (Dv,)
    float* s;           // scores, then their exponentials: K rounded up to LANES, the padding at -inf
};

// Rows rows[0..C) of one KV head (k, v at that head): scores (each a dot product in d order, scaled, masked), the
// row's maximum, exponentials, and the values weighted and the exponentials summed key by key in key order.
template <int C>
static void attend_group(const Row* rows, const float* k, const float* v, const Shapes& a) {
    const int64_t K = a.K, padded = (K + LANES - 1) / LANES * LANES;
    float top[C];
    for (int r = 0; r < C; ++r) top[r] = -INFINITY;
    for (int64_t j = 0; j < K; ++j) {
        const float* kj = k + j * a.ks_k;
        for (int r = 0; r < C; ++r) {
            const float sc = dot(rows[r].q, kj, a.D) * a.scale + rows[r].mask[j];
            rows[r].s[j] = sc;
            top[r] = sc > top[r] ? sc : top[r];
        }
    }
    for (int r = 0; r < C; ++r) {
        float* s = rows[r].s;
        for (int64_t j = K; j < padded; ++j) s[j] = -INFINITY;
        const vec shift = vset1(top[r]);
        for (int64_t j = 0; j < padded; j += LANES) vstore(s + j, vexp_nonpositive(vsub(vload(s + j), shift)));
    }
    // The denominator is summed one key at a time, in key order, with the first slice of the values: a tree node's
    // keys sit at other cache positions than in a vanilla step (its masked siblings in between), and a sum in
    // vector lanes would group them differently; key by key, the masked ones add exact zeros and change nothing.
    float total[C] = {};
    for (int64_t d0 = 0; d0 < a.Dv; d0 += LANES) {  // each LANES-wide slice of the outputs: the keys in order
        const int64_t width = a.Dv - d0 < LANES ? a.Dv - d0 : LANES;
        vec acc[C];
        for (int r = 0; r < C; ++r) acc[r] = vzero();
        for (int64_t j = 0; j < K; ++j) {
            const float* vj = v + j * a.vs_k + d0;
            const vec vv = width == LANES ? vload(vj) : vload_tail(vj, width);
            for (int r = 0; r < C; ++r) acc[r] = vfma(vset1(rows[r].s[j]), vv, acc[r]);  // masked keys: + 0 exactly
            if (d0 == 0)
                for (int r = 0; r < C; ++r) total[r] += rows[r].s[j];
        }
        for (int r = 0; r < C; ++r) {
            const vec o = vdiv(acc[r], vset1(total[r]));
            if (width == LANES) vstore(rows[r].out + d0, o);
            else vstore_tail(rows[r].out + d0, o, width);
        }
    }
}

// -> 0 on success, 1 on arguments it does not take. threads: the caller's torch thread count (used only where
// there is enough work to share; which thread takes a pair never changes its result).
extern "C" int vlm_tree_attention(const float* q, const float* k, const float* v, const float* mask, float* out,
                                  int64_t H, int64_t KVH, int64_t N, int64_t K, int64_t D, int64_t Dv,
                                  int64_t qs_h, int64_t qs_n, int64_t ks_h, int64_t ks_k, int64_t vs_h, int64_t vs_k,
                                  int64_t ms_n, float scale, int threads) {
    if (H < 1 || KVH < 1 || H % KVH != 0 || N < 1 || K < 1 || D < 1 || Dv < 1 || threads < 1) return 1;
    const Shapes a{K, D, Dv, ks_k, vs_k, scale};
    const int64_t rep = H / KVH, per_kv = rep * N, groups = (per_kv + GROUP - 1) / GROUP;
    const int64_t padded = (K + LANES - 1) / LANES * LANES;
    const int use = H * N * K * (D + Dv) >= (1 << 18) ? threads : 1;  // ~0.5 MFLOP: less is not worth a wake-up
#pragma omp parallel num_threads(use)
    {
        std::vector<float> scores(GROUP * padded);
#pragma omp for schedule(static)
        for (int64_t w = 0; w < KVH * groups; ++w) {  // (KV head, group of its query rows)
            const int64_t g = w / groups, first = (w % groups) * GROUP;
            const int c = (int)(per_kv - first < GROUP ? per_kv - first : GROUP);
            Row rows[GROUP];
            for (int r = 0; r < c; ++r) {  // row first + r of this KV head: head g * rep + x, query i
                const int64_t x = (first + r) / N, i = (first + r) % N, h = g * rep + x;
                rows[r] = Row{q + h * qs_h + i * qs_n, mask + i * ms_n, out + (i * H + h) * Dv, scores.data() + r * padded};
            }
            const float *kg = k + g * ks_h, *vg = v + g * vs_h;
            switch (c) {
                case 1: attend_group<1>(rows, kg, vg, a); break;
                case 2: attend_group<2>(rows, kg, vg, a); break;
                case 3: attend_group<3>(rows, kg, vg, a); break;
                default: attend_group<4>(rows, kg, vg, a); break;
            }
        }
    }
    return 0;
}
