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

// The LANES partial sums of a . b (d floats): fused multiply-adds in d order, one lane per d % LANES.
static inline vec dot_lanes(const float* a, const float* b, int64_t d) {
    const int64_t body = d - d % LANES;
    vec acc = vzero();
    for (int64_t i = 0; i < body; i += LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    if (body < d) acc = vfma(vload_tail(a + body, d - body), vload_tail(b + body, d - body), acc);
    return acc;
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

// Output slices (LANES floats each) one pass over the keys accumulates: SLICES x GROUP accumulators stay in registers
// (16 of the 32 AVX-512 ones; 8 of the 16 AVX2 ones).
static const int64_t SLICES = LANES == 16 ? 4 : 2;

// One pass over the keys in order for NS output slices from column d0 (the last slice only `tail` floats wide when
// tail > 0): out[r][d0 ...] = sum_j s_r[j] v[j] / total[r], the sum one fused multiply-add per
// key in key order; in the first pass (d0 = 0) also total[r] += s_r[j], key by key.
template <int C, int NS>
static void weigh(const Row* rows, const float* v, const Shapes& a, int64_t d0, int64_t tail, float* total) {
    const bool first = d0 == 0;
    vec acc[C][NS];
    for (int r = 0; r < C; ++r)
        for (int x = 0; x < NS; ++x) acc[r][x] = vzero();
    for (int64_t j = 0; j < a.K; ++j) {
        const float* vj = v + j * a.vs_k + d0;
        vec vv[NS];
        for (int x = 0; x < NS; ++x)
            vv[x] = (x == NS - 1 && tail) ? vload_tail(vj + x * LANES, tail) : vload(vj + x * LANES);
        for (int r = 0; r < C; ++r) {
            const vec w = vset1(rows[r].s[j]);
            for (int x = 0; x < NS; ++x) acc[r][x] = vfma(w, vv[x], acc[r][x]);  // masked keys: + 0 exactly
        }
        if (first)
            for (int r = 0; r < C; ++r) total[r] += rows[r].s[j];
    }
    for (int r = 0; r < C; ++r) {
        const vec inv = vset1(total[r]);
        for (int x = 0; x < NS; ++x) {
            float* o = rows[r].out + d0 + x * LANES;
            if (x == NS - 1 && tail) vstore_tail(o, vdiv(acc[r][x], inv), tail);
            else vstore(o, vdiv(acc[r][x], inv));
        }
    }
}

// Rows rows[0..C) of one KV head (k, v at that head): scores (each a dot product in d order, its LANES partial sums
// added by vsum_many's tree, scaled, masked), the row's maximum, exponentials, and the values weighted and the
// exponentials summed key by key in key order.
//
// Scores go LANES keys at a time, the block's keys read from memory once for all C rows: key j is always slot
// j % LANES of block j / LANES, and every slot's sum takes the same tree, so a key's score is the same whatever the
// number of keys (a step has fewer than the tree verifying it); the slots past the last key hold zero sums and the
// score -inf. The values go key by key, each weighting SLICES output slices of every row at once (weigh). On the
// default target's shapes (9 heads on 3 KV heads, head dim 64, keys and values cold; medians of 150 alternating calls
// on 2 AMD EPYC cores) 1 / 5 / 8 queries took 50-59 / 78-81 / 97-123 us over 300 keys and 104-130 / 270-297 /
// 398-423 over 1900, against 62-69 / 87-92 / 109-135 and 160-210 / 310-338 / 458-467 with one vsum per key and one
// pass over the keys per output slice (whose four accumulator chains left the FMA unit waiting).
template <int C>
static void attend_group(const Row* rows, const float* k, const float* v, const Shapes& a) {
    const int64_t K = a.K, padded = (K + LANES - 1) / LANES * LANES;
    vec best[C];
    for (int r = 0; r < C; ++r) best[r] = vset1(-INFINITY);
    for (int64_t j0 = 0; j0 < K; j0 += LANES) {
        const int64_t nk = K - j0 < LANES ? K - j0 : LANES;
        for (int r = 0; r < C; ++r) {  // the block's keys (LANES x D floats) stay in L1 from the first row on
            vec part[LANES];
            for (int64_t jj = 0; jj < nk; ++jj) part[jj] = dot_lanes(rows[r].q, k + (j0 + jj) * a.ks_k, a.D);
            for (int64_t jj = nk; jj < LANES; ++jj) part[jj] = vzero();
            float* s = rows[r].s + j0;
            const vec m = nk == LANES ? vload(rows[r].mask + j0) : vload_tail(rows[r].mask + j0, nk);
            vstore(s, vadd(vmul(vsum_many(part), vset1(a.scale)), m));
            for (int64_t jj = nk; jj < LANES; ++jj) s[jj] = -INFINITY;
            best[r] = vmax(best[r], vload(s));
        }
    }
    for (int r = 0; r < C; ++r) {  // the row's maximum (exact in any order), then exp(score - maximum)
        float lanes[LANES], top = -INFINITY;
        vstore(lanes, best[r]);
        for (int64_t l = 0; l < LANES; ++l) top = lanes[l] > top ? lanes[l] : top;
        float* s = rows[r].s;
        const vec shift = vset1(top);
        for (int64_t j = 0; j < padded; j += LANES) vstore(s + j, vexp_nonpositive(vsub(vload(s + j), shift)));
    }
    // The denominator is summed one key at a time, in key order, in the first pass: a tree node's keys sit at other
    // cache positions than in a vanilla step (its masked siblings in between), and a sum in vector lanes would group
    // them differently; key by key, the masked ones add exact zeros and change nothing. Each output value is likewise
    // its fused multiply-adds over the keys in key order, whichever pass and slot computes it.
    float total[C] = {};
    for (int64_t d0 = 0; d0 < a.Dv; d0 += SLICES * LANES) {
        const int64_t width = a.Dv - d0 < SLICES * LANES ? a.Dv - d0 : SLICES * LANES;
        const int64_t slices = (width + LANES - 1) / LANES, tail = width % LANES;  // the last slice tail floats wide
        switch (slices) {  // a constant count: the accumulators stay in registers
            case 1: weigh<C, 1>(rows, v, a, d0, tail, total); break;
            case 2: weigh<C, 2>(rows, v, a, d0, tail, total); break;
#if defined(__AVX512F__)
            case 3: weigh<C, 3>(rows, v, a, d0, tail, total); break;
            default: weigh<C, 4>(rows, v, a, d0, tail, total); break;
#endif
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
