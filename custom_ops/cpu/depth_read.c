/* Fused CPU kernels of the depth read (docs/method.md §2, §7), fp32, one pass over each token's rows.
 *
 * Each exported function splits the tokens over `threads` OpenMP threads; linked against the
 * libgomp that torch has already loaded, they share torch's thread pool (no oversubscription).
 * A thread touches only its own tokens and its own query-gradient partial; the partials are
 * summed in thread order after the parallel region (dq: the sum, [C, r] or [r]).
 * Pointers: sources are S row-major [n, d] (value) / [n, r] (key) matrices with unit column
 * stride and their own row strides (elements); sliced keys are the last r columns of the value.
 * Outputs and gradients are contiguous. Small per-token reductions accumulate in double, the
 * d-length products in float on independent 16-lane chains (vectorised, tree-like rounding).
 * Output rows are built one at a time, each summed over its input rows column chunk by column
 * chunk in registers and stored once (mix_row): a token's S source rows and C output rows start
 * at the same offset within a 4 KB page whenever their tensors are page-aligned (every row at
 * d=1024 fp32), so a loop over column chunks of all C outputs at once competes for the same L1
 * sets (measured 3.7x slower for the forward). The forward's rows summed in place instead (o =
 * a_0 v_0, then += a_s v_s: o read and written S times) measured 1.15-1.7x its time.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16 /* float lanes of one vector step (one AVX-512 register, two AVX2) */

/* Half a W-lane step as one GCC vector (one AVX2 register, the width gcc picks on AVX-512
 * parts too); vl loads one from any float address. Written as vectors: gcc 12 scalarised the
 * same loops over float arrays (the W-lane tail of a dot: element by element via the stack). */
#define H (W / 2) /* floats of one vh */
typedef float vh __attribute__((vector_size(2 * W)));
typedef float vh_u __attribute__((vector_size(2 * W), aligned(4), may_alias));

static inline vh vl(const float *p) { return *(const vh_u *)p; }

/* Rows that the next operation does not read, written around the caches: a normal store first
 * reads the line it fills (read-for-ownership) and evicts a line the step still uses; a
 * non-temporal store does neither. For output rows read back only sublayers later (phase-1 sites
 * after the first, the merge's d_out1, which waits for the block read's backward). Needs 32-byte
 * aligned rows (d a multiple of 8 and an aligned tensor, as torch allocates); else, and without
 * AVX, plain stores. The thread ends its work with nt_fence (the stores are weakly ordered). */
#ifdef __AVX__
#include <immintrin.h>
static inline int nt_row(const float *p, int64_t d) {
    return ((uintptr_t)p & 31) == 0 && d % H == 0;
}
static inline void nt_store(float *p, vh x) { _mm256_stream_ps(p, (__m256)x); }
static inline void nt_fence(void) { _mm_sfence(); }
#else
static inline int nt_row(const float *p, int64_t d) { (void)p; (void)d; return 0; }
static inline void nt_store(float *p, vh x) { *(vh_u *)p = x; }
static inline void nt_fence(void) {}
#endif

/* tail + the H lanes of x summed in a tree (halves added): the end of every dot product. */
static inline float lanes_plus(vh x, double tail) {
    float t[H];
    memcpy(t, &x, sizeof t);
    for (int h = H / 2; h > 0; h /= 2)
        for (int l = 0; l < h; l++) t[l] += t[l + h];
    return (float)(tail + t[0]);
}

/* <a, b>: four independent W-lane float chains (the FMA latency hidden; each two half vectors),
 * added lane-wise, then the W lanes summed in a tree (halves added), plus the tail (n mod W)
 * in double. */
static float dot(const float *a, const float *b, int64_t n) {
    vh acc[8] = {{0}};
    int64_t j = 0;
    for (; j + 4 * W <= n; j += 4 * W)
        for (int u = 0; u < 8; u++) acc[u] += vl(a + j + u * H) * vl(b + j + u * H);
    for (; j + W <= n; j += W) {
        acc[0] += vl(a + j) * vl(b + j);
        acc[1] += vl(a + j + H) * vl(b + j + H);
    }
    double s = 0;
    for (; j < n; j++) s += (double)a[j] * b[j];
    vh x = ((acc[0] + acc[2]) + (acc[4] + acc[6])) + ((acc[1] + acc[3]) + (acc[5] + acc[7]));
    return lanes_plus(x, s);
}

/* sum_j k[j]^2 in double (no overflow or underflow for any fp32 k), in 8 double lanes. */
static double sumsq(const float *k, int64_t n) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] += (double)k[j + l] * k[j + l];
    double s = 0;
    for (; j < n; j++) s += (double)k[j] * k[j];
    for (int l = 0; l < 8; l++) s += lane[l];
    return s;
}

/* A routing weight below fp32's smallest normal as 0. A subnormal weight (a source's logit 87 or
 * more behind the best) multiplies a whole row at many times the cost (x86 microcode assists;
 * standard AttnRes at d=1024 with logits of sd 32, benchmarks.cpu_kernels: read forward 7.22 ->
 * 2.55 ms, backward 17.51 -> 6.60 ms, against 2.22 and 6.18 ms at logits of sd 1), and what it
 * carries is below 2^-126 of the row: the contract (custom_ops.api) lets such weights flush. */
static inline float flush(float a) { return a < FLT_MIN ? 0.0f : a; }

/* Hint row [0, n) of floats into L2: the next token's, while this one is computed (the reads
 * and the merge backward measured 0.68-0.95x of their time with the hardware prefetchers alone,
 * the merge forward the same). */
static void prefetch_row(const float *row, int64_t n) {
    for (int64_t b = 0; b < n; b += 16) __builtin_prefetch(row + b, 0, 2);
}

/* rstd of one key row and its logits against the C queries: l[c] = rstd * <q_c, k>.
 * The RMSNorms' overflow policy (custom_ops.reference.key_rmsnorm): a row whose sum of squares
 * reaches 2^120 is normalised from k * 2^-72 without eps. In double the sum needs no scaling
 * (that is this sum times 2^-144, exactly), but the fp32 dot may overflow there: that rare row
 * takes its logits in double. */
static float key_logits(const float *k, const float *q, int64_t C, int64_t r, double eps,
                        float *l) {
    double ss = sumsq(k, r);
    if (ss >= 0x1p120) {
        double rstd = 1.0 / sqrt(ss / (double)r);
        for (int64_t c = 0; c < C; c++) {
            double s = 0;
            for (int64_t j = 0; j < r; j++) s += (double)q[c * r + j] * k[j];
            l[c] = (float)(rstd * s);
        }
        return (float)rstd;
    }
    float rstd = (float)(1.0 / sqrt(ss / (double)r + eps));
    for (int64_t c = 0; c < C; c++) l[c] = rstd * dot(q + c * r, k, r);
    return rstd;
}

static const float *key_row(const float *const *vp, const int64_t *vs, const float *const *kp,
                            const int64_t *ks, int sliced, int64_t s, int64_t i, int64_t d,
                            int64_t r) {
    return sliced ? vp[s] + i * vs[s] + (d - r) : kp[s] + i * ks[s];
}

/* The key terms of a row's gradient: those of sum_c dl[c] l[c] (l[c] = rstd <q_c, k>, the
 * RMSNorm backward): dk = sum_c b[c] q_c - coef k with b[c] = dl[c] rstd, coef = rstd^2
 * sum_c dl[c] l[c] / r; and dq_c += b[c] k (dq [C, r]). */
typedef struct {
    const float *q, *b, *k;
    float coef;
    float *dq;
    int64_t r;
} keyterms;

static keyterms key_terms(const float *k, float rstd, const float *l, const float *dl,
                          const float *q, int64_t C, int64_t r, float *b, float *dq) {
    double gl = 0;
    for (int64_t c = 0; c < C; c++) gl += (double)dl[c] * l[c];
    for (int64_t c = 0; c < C; c++) b[c] = dl[c] * rstd;
    return (keyterms){q, b, k, (float)(gl * rstd * rstd / (double)r), dq, r};
}

#define U 4 /* vectors per step of mix_cols (2 U on long rows): one accumulator each */

static inline void vs_(float *p, vh x) { *(vh_u *)p = x; }

/* Columns [j, j + u H) of mix_row, u <= 2 U (inlined with u = 2 U, U and 1):
 * acc = sum_c a[c] x[c] - coef k + sum_c b[c] q_c, dq_c += b[c] k, each column stored once
 * (non-temporal when nt). */
static inline __attribute__((always_inline)) void mix_cols(
    float *restrict out, int64_t j, int u, int64_t C, const float *const *x, int64_t xo,
    const float *a, const keyterms *kt, int nt) {
    vh acc[2 * U];
    for (int v = 0; v < u; v++) acc[v] = (vh){0};
    for (int64_t c = 0; x && c < C; c++)
        if (x[c])
            for (int v = 0; v < u; v++) acc[v] += a[c] * vl(x[c] + xo + j + v * H);
    if (kt) {
        const float *k = kt->k + j;
        for (int v = 0; v < u; v++) acc[v] -= kt->coef * vl(k + v * H);
        for (int64_t c = 0; c < C; c++) {
            const float *q = kt->q + c * kt->r + j;
            float *dq = kt->dq + c * kt->r + j, b = kt->b[c];
            for (int v = 0; v < u; v++) {
                acc[v] += b * vl(q + v * H);
                vs_(dq + v * H, vl(dq + v * H) + b * vl(k + v * H));
            }
        }
    }
    for (int v = 0; v < u; v++) {
        if (nt) nt_store(out + j + v * H, acc[v]);
        else vs_(out + j + v * H, acc[v]);
    }
}

/* One output or gradient row [0, n), written once: out = sum_c a[c] x[c][xo:] (left to right;
 * x or an x[c] NULL: zero), plus the key terms kt (NULL: none) over the same columns; nt: with
 * non-temporal stores (only on nt_row's rows: no column tail). Steps of 2 U vectors
 * on rows of 512 columns or more (standard AttnRes's key terms at d = 1024: read backward 0.92x;
 * at d = 128 they measured up to 1.1x slower), then U, then single vectors and columns. Inlined:
 * as a call per row, the d = 128 read backward measured 1.09x. */
static inline __attribute__((always_inline)) void mix_row(
    float *out, int64_t n, int64_t C, const float *const *x, int64_t xo, const float *a,
    const keyterms *kt, int nt) {
    int64_t j = 0;
    if (n >= 512)
        for (; j + 2 * U * H <= n; j += 2 * U * H) mix_cols(out, j, 2 * U, C, x, xo, a, kt, nt);
    for (; j + U * H <= n; j += U * H) mix_cols(out, j, U, C, x, xo, a, kt, nt);
    for (; j + H <= n; j += H) mix_cols(out, j, 1, C, x, xo, a, kt, nt);
    for (; j < n; j++) { /* the last n mod H columns */
        float acc = 0.0f;
        for (int64_t c = 0; x && c < C; c++)
            if (x[c]) acc += a[c] * x[c][xo + j];
        if (kt) {
            acc -= kt->coef * kt->k[j];
            for (int64_t c = 0; c < C; c++) {
                acc += kt->b[c] * kt->q[c * kt->r + j];
                kt->dq[c * kt->r + j] += kt->b[c] * kt->k[j];
            }
        }
        out[j] = acc;
    }
}

#define FUSED 8 /* most gradient rows dots_mix takes in one pass */

/* dots_mix with m rows x[0..m) (weights w), m a constant once inlined: the accumulators stay in
 * registers (2 m + 2 vectors). */
static inline __attribute__((always_inline)) void dots_mix_m(
    const float *v, const float *const *x, const float *w, int m, int64_t d, int64_t head,
    float *da, float *g) {
    vh acc[FUSED][2];
    for (int u = 0; u < m; u++) acc[u][0] = acc[u][1] = (vh){0};
    int64_t j = 0;
    for (; j + W <= head; j += W) {
        vh v0 = vl(v + j), v1 = vl(v + j + H), g0 = {0}, g1 = {0};
        for (int u = 0; u < m; u++) {
            vh x0 = vl(x[u] + j), x1 = vl(x[u] + j + H);
            acc[u][0] += v0 * x0;
            acc[u][1] += v1 * x1;
            g0 += w[u] * x0;
            g1 += w[u] * x1;
        }
        vs_(g + j, g0);
        vs_(g + j + H, g1);
    }
    for (int64_t k = j; k < head; k++) { /* the head's last head mod W columns */
        float t = 0.0f;
        for (int u = 0; u < m; u++) t += w[u] * x[u][k];
        g[k] = t;
    }
    for (; j + W <= d; j += W) { /* past the head: the dots alone */
        vh v0 = vl(v + j), v1 = vl(v + j + H);
        for (int u = 0; u < m; u++) {
            acc[u][0] += v0 * vl(x[u] + j);
            acc[u][1] += v1 * vl(x[u] + j + H);
        }
    }
    for (int u = 0; u < m; u++) {
        double tail = 0;
        for (int64_t k = j; k < d; k++) tail += (double)v[k] * x[u][k];
        da[u] = lanes_plus(acc[u][0] + acc[u][1], tail);
    }
}

/* One pass over a source row v [d] and the C gradient rows dh (NULL: zero) that its token's
 * sites receive: da[c] = <dh_c, v> and g[0, head) = sum_c a[c] dh_c (left to right), the part
 * of v's gradient that needs no da. Each dh row is read once for both, where separate dots and
 * mix_row read it twice (C <= FUSED; more rows: the two passes). Per dot two H-lane chains,
 * their lanes summed in a tree, the tail (d mod W) in double. */
static void dots_mix(const float *v, const float *const *dh, int64_t C, const float *a,
                     int64_t d, int64_t head, float *da, float *g) {
    if (C > FUSED) {
        for (int64_t c = 0; c < C; c++) da[c] = dh[c] ? dot(dh[c], v, d) : 0.0f;
        mix_row(g, head, C, dh, 0, a, NULL, 0);
        return;
    }
    const float *x[FUSED];
    float w[FUSED], got[FUSED];
    int m = 0, at[FUSED];
    for (int64_t c = 0; c < C; c++) {
        da[c] = 0.0f;
        if (dh[c]) x[m] = dh[c], w[m] = a[c], at[m++] = (int)c;
    }
    switch (m) { /* each case its own unrolled copy */
    case 0: memset(g, 0, sizeof(float) * head); break;
    case 1: dots_mix_m(v, x, w, 1, d, head, got, g); break;
    case 2: dots_mix_m(v, x, w, 2, d, head, got, g); break;
    case 3: dots_mix_m(v, x, w, 3, d, head, got, g); break;
    case 4: dots_mix_m(v, x, w, 4, d, head, got, g); break;
    case 5: dots_mix_m(v, x, w, 5, d, head, got, g); break;
    case 6: dots_mix_m(v, x, w, 6, d, head, got, g); break;
    case 7: dots_mix_m(v, x, w, 7, d, head, got, g); break;
    default: dots_mix_m(v, x, w, 8, d, head, got, g); break;
    }
    for (int u = 0; u < m; u++) da[at[u]] = got[u];
}

/* The key part of a source's gradient row (its columns from head on if sliced, else its own row
 * gk), each column written once; the value part before them came from dots_mix. */
static void key_grad(const float *const *dh, int64_t C, const float *a, int64_t head, int sliced,
                     const keyterms *kt, float *g, float *gk) {
    if (sliced) mix_row(g + head, kt->r, C, dh, head, a, kt, 0);
    else mix_row(gk, kt->r, C, NULL, 0, NULL, kt, 0);
}

/* out [C, n, d], lse [C, n]; work: S*C + S floats. Each output row is summed over the S source
 * rows column chunk by column chunk in registers and stored once (mix_row; the S rows stay in
 * L1 / L2 across the C queries). */
static void read_fwd_range(int64_t S, int64_t C, int64_t n, int64_t d, int64_t r, int sliced,
              const float *const *vp, const int64_t *vs, const float *const *kp,
              const int64_t *ks, const float *q, double eps, float *out, float *lse,
              int64_t t0, int64_t t1) {
    float *l = malloc(sizeof(float) * S * C);
    const float **v = malloc(sizeof(float *) * S);
    float *w = malloc(sizeof(float) * S); /* one site's weights */
    for (int64_t i = t0; i < t1; i++) {
        for (int64_t s = 0; s < S; s++) {
            key_logits(key_row(vp, vs, kp, ks, sliced, s, i, d, r), q, C, r, eps, l + s * C);
            v[s] = vp[s] + i * vs[s];
        }
        for (int64_t c = 0; c < C; c++) {
            float m = -INFINITY;
            for (int64_t s = 0; s < S; s++) m = fmaxf(m, l[s * C + c]);
            double z = 0;
            for (int64_t s = 0; s < S; s++) {
                l[s * C + c] = expf(l[s * C + c] - m);
                z += l[s * C + c];
            }
            lse[c * n + i] = m + (float)log(z);
            float inv_z = (float)(1.0 / z);
            for (int64_t s = 0; s < S; s++) l[s * C + c] = flush(l[s * C + c] * inv_z);
        }
        if (i + 1 < t1)
            for (int64_t s = 0; s < S; s++) prefetch_row(vp[s] + (i + 1) * vs[s], d);
        for (int64_t c = 0; c < C; c++) {
            float *dst = out + (c * n + i) * d;
            for (int64_t s = 0; s < S; s++) w[s] = l[s * C + c];
            /* site 0's row is read next: cached; the others around the caches */
            mix_row(dst, d, S, v, 0, w, NULL, c > 0 && nt_row(dst, d));
        }
    }
    nt_fence();
    free(w);
    free(v);
    free(l);
}

/* dst[0, m) += src[0, m): the sum each column of an accumulated gradient gets (acc). */
static void add_row(float *restrict dst, const float *restrict src, int64_t m) {
    for (int64_t j = 0; j < m; j++) dst[j] += src[j];
}

/* Backward of read_fwd. dout: C contiguous [n, d] gradients, one per query (the table or any
 * entry may be NULL: zero); dlse [C, n] may be NULL. gv: S contiguous [n, d];
 * gk: S contiguous [n, r] (unused if sliced); dq [C, r] partial of this call, accumulated.
 * acc: gv and gk get each source's gradient added to what they hold (a row made whole in a
 * scratch row first, then added: the sum of a separate gradient and the buffer, bit for bit). */
static void read_bwd_range(int64_t S, int64_t C, int64_t n, int64_t d, int64_t r, int sliced,
              const float *const *vp, const int64_t *vs, const float *const *kp,
              const int64_t *ks, const float *q, double eps, const float *lse,
              const float *const *dout, const float *dlse, float *const *gv,
              float *const *gk, int acc, float *dq, int64_t t0, int64_t t1) {
    float *l = malloc(sizeof(float) * (S * C * 3 + S + C + (acc ? S * d + r : 0)));
    float *a = l + S * C, *dl = a + S * C, *rstd = dl + S * C, *b = rstd + S;
    float *rows = b + C, *krow = rows + S * d; /* acc: each source's gradient row, a key's */
    const float **dh = malloc(sizeof(float *) * C);
    for (int64_t i = t0; i < t1; i++) {
        for (int64_t c = 0; c < C; c++) dh[c] = dout && dout[c] ? dout[c] + i * d : NULL;
        for (int64_t s = 0; s < S; s++)
            rstd[s] = key_logits(key_row(vp, vs, kp, ks, sliced, s, i, d, r), q, C, r, eps,
                                 l + s * C);
        /* e^{l - lse} sums to 1 only up to rounding, and da - D amplifies that error for a
         * dominant source: renormalised, the gradients are as exact as the eager ones. */
        for (int64_t c = 0; c < C; c++) {
            double z = 0;
            for (int64_t s = 0; s < S; s++) {
                a[s * C + c] = expf(l[s * C + c] - lse[c * n + i]);
                z += a[s * C + c];
            }
            for (int64_t s = 0; s < S; s++) a[s * C + c] = flush((float)(a[s * C + c] / z));
        }
        if (i + 1 < t1) {
            for (int64_t s = 0; s < S; s++) prefetch_row(vp[s] + (i + 1) * vs[s], d);
            for (int64_t c = 0; c < C; c++)
                if (dh[c]) prefetch_row(dh[c] + d, d);
        }
        int64_t head = sliced ? d - r : d; /* a source's columns that are not its key */
        for (int64_t s = 0; s < S; s++) /* dl holds da = <dh_c, v_s> until rescaled below */
            dots_mix(vp[s] + i * vs[s], dh, C, a + s * C, d, head, dl + s * C,
                     acc ? rows + s * d : gv[s] + i * d);
        for (int64_t c = 0; c < C; c++) {
            double big_d = 0;
            for (int64_t s = 0; s < S; s++) big_d += (double)a[s * C + c] * dl[s * C + c];
            float extra = dlse ? dlse[c * n + i] : 0.0f;
            for (int64_t s = 0; s < S; s++)
                dl[s * C + c] = a[s * C + c] * (dl[s * C + c] - (float)big_d + extra);
        }
        for (int64_t s = 0; s < S; s++) {
            const float *k = key_row(vp, vs, kp, ks, sliced, s, i, d, r);
            keyterms kt = key_terms(k, rstd[s], l + s * C, dl + s * C, q, C, r, b, dq);
            if (!acc) {
                key_grad(dh, C, a + s * C, head, sliced, &kt, gv[s] + i * d,
                         sliced ? NULL : gk[s] + i * r);
                continue;
            }
            key_grad(dh, C, a + s * C, head, sliced, &kt, rows + s * d, sliced ? NULL : krow);
            add_row(gv[s] + i * d, rows + s * d, d);
            if (!sliced) add_row(gk[s] + i * r, krow, r);
        }
    }
    free(dh);
    free(l);
}

/* Phase-2 merge weights of token i: returns w2 (the partial's share), sets *w1_out (out1's);
 * *logit, *rstd set. Both shares come from their own exponential: w1 = 1 - w2 would lose a
 * share below 2^-24 (the out1 term of h and its gradients) to rounding. */
static float merge_weight(const float *k, const float *q, int64_t r, double eps, float lse1,
                          float *logit, float *rstd, float *w1_out) {
    *rstd = key_logits(k, q, 1, r, eps, logit);
    float m = lse1 > *logit ? lse1 : *logit;
    float w1 = expf(lse1 - m), w2 = expf(*logit - m);
    *w1_out = flush(w1 / (w1 + w2));
    return flush(w2 / (w1 + w2));
}

/* h [n, d] = w1 out1 + w2 pv; norm [n, d] = RMSNorm(h) (norm_eps) when norm != NULL. */
static void merge_fwd_range(int64_t n, int64_t d, int64_t r, const float *o1, int64_t o1s, const float *lse1,
               const float *pv, int64_t pvs, const float *pk, int64_t pks, const float *q,
               double eps, double norm_eps, float *h, float *norm, int64_t t0, int64_t t1) {
    (void)n; /* rows are addressed through their strides; n is the tensors' row count */
    for (int64_t i = t0; i < t1; i++) {
        if (i + 1 < t1) {
            prefetch_row(o1 + (i + 1) * o1s, d);
            prefetch_row(pv + (i + 1) * pvs, d);
        }
        float logit, rstd;
        float w1, w2 = merge_weight(pk + i * pks, q, r, eps, lse1[i], &logit, &rstd, &w1);
        const float *a = o1 + i * o1s, *b = pv + i * pvs;
        float *hi = h + i * d;
        for (int64_t j = 0; j < d; j++) hi[j] = w1 * a[j] + w2 * b[j];
        if (norm) {
            float hr = (float)(1.0 / sqrt((double)dot(hi, hi, d) / (double)d + norm_eps));
            float *ni = norm + i * d;
            for (int64_t j = 0; j < d; j++) ni[j] = hi[j] * hr;
        }
    }
}

/* Backward of merge_fwd. gh [n, d] and gn [n, d] (grad of norm) may be NULL; h is the saved
 * output. Writes d_out1, d_pv [n, d], d_lse1 [n], d_pk [n, r] (NULL if sliced: added into the
 * tail of d_pv), accumulates dq [r]. */
static void merge_bwd_range(int64_t n, int64_t d, int64_t r, int sliced, const float *o1, int64_t o1s,
               const float *lse1, const float *pv, int64_t pvs, const float *pk, int64_t pks,
               const float *q, double eps, double norm_eps, const float *h, const float *gh,
               const float *gn, float *d_o1, float *d_lse1, float *d_pv, float *d_pk, float *dq,
               int64_t t0, int64_t t1) {
    (void)n;
    float *buf = calloc((size_t)d, sizeof(float)); /* dh when gn is given, else zeros */
    for (int64_t i = t0; i < t1; i++) {
        if (i + 1 < t1) {
            prefetch_row(o1 + (i + 1) * o1s, d);
            prefetch_row(pv + (i + 1) * pvs, d);
            if (gh) prefetch_row(gh + (i + 1) * d, d);
            if (gn) {
                prefetch_row(gn + (i + 1) * d, d);
                prefetch_row(h + (i + 1) * d, d);
            }
        }
        float logit, rstd;
        const float *k = pk + i * pks;
        float w1, w2 = merge_weight(k, q, r, eps, lse1[i], &logit, &rstd, &w1);
        const float *dh = gh ? gh + i * d : buf; /* the gradient reaching h */
        if (gn) {
            const float *hi = h + i * d, *gy = gn + i * d;
            float hr = (float)(1.0 / sqrt((double)dot(hi, hi, d) / (double)d + norm_eps));
            /* y = h hr: dh += hr (gy - y mean(gy y)) = hr (gy - h hr^2 <gy, h> / d) */
            float cy = dot(gy, hi, d) * hr * hr / (float)d;
            for (int64_t j = 0; j < d; j++)
                buf[j] = (gh ? gh[i * d + j] : 0.0f) + hr * (gy[j] - hi[j] * cy);
            dh = buf;
        }
        const float *a = o1 + i * o1s, *b = pv + i * pvs;
        float dl = w1 * w2 * (dot(dh, b, d) - dot(dh, a, d));
        d_lse1[i] = -dl;
        float *go = d_o1 + i * d, *gp = d_pv + i * d;
        int64_t head = sliced ? d - r : d; /* the partial's key columns: written with their terms */
        if (nt_row(go, d)) /* read by the block read's backward, sublayers later */
            for (int64_t j = 0; j < d; j += H) nt_store(go + j, w1 * vl(dh + j));
        else
            for (int64_t j = 0; j < d; j++) go[j] = w1 * dh[j];
        for (int64_t j = 0; j < head; j++) gp[j] = w2 * dh[j];
        float bq;
        keyterms kt = key_terms(k, rstd, &logit, &dl, q, 1, r, &bq, dq);
        const float *row = dh;
        if (sliced) mix_row(gp + head, r, 1, &row, head, &w2, &kt, 0);
        else mix_row(d_pk + i * r, r, 1, NULL, 0, NULL, &kt, 0);
    }
    nt_fence();
    free(buf);
}

/* Tokens [t0, t1) of thread t of nt. */
#define SPLIT(n)                                   \
    int t = omp_get_thread_num(), nt = omp_get_num_threads(); \
    int64_t t0 = (n) * t / nt, t1 = (n) * (t + 1) / nt;

/* The wrapper's contract (each entry point's arguments and what lies behind each pointer),
 * bumped on any change: custom_ops.cpu.build refuses a library that answers another number
 * (benchmarks.cpu_kernels builds other revisions of this file). 2: dq is the summed gradient;
 * 3: read_bwd's dout is a table of C per-query gradients; 4: read_bwd's acc. The exported
 * functions' parameters (order, names, types) are custom_ops.cpu.calls.SIGNATURES, checked against
 * these definitions at load; what lies behind each pointer is custom_ops.cpu.calls._memory,
 * checked before each call. */
int lrattnres_cpu_abi(void) { return 4; }

/* dq = part[0] + part[1] + ... (threads rows of m, in thread order: deterministic); frees part.
 * Rows of threads OpenMP did not start stay zero. */
static void sum_partials(float *part, int threads, int64_t m, float *dq) {
    for (int64_t j = 0; j < m; j++) dq[j] = part[j];
    for (int t = 1; t < threads; t++)
        for (int64_t j = 0; j < m; j++) dq[j] += part[(int64_t)t * m + j];
    free(part);
}

void read_fwd(int64_t S, int64_t C, int64_t n, int64_t d, int64_t r, int sliced,
              const float *const *vp, const int64_t *vs, const float *const *kp,
              const int64_t *ks, const float *q, double eps, float *out, float *lse,
              int threads) {
#pragma omp parallel num_threads(threads)
    {
        SPLIT(n)
        read_fwd_range(S, C, n, d, r, sliced, vp, vs, kp, ks, q, eps, out, lse, t0, t1);
    }
}

void read_bwd(int64_t S, int64_t C, int64_t n, int64_t d, int64_t r, int sliced,
              const float *const *vp, const int64_t *vs, const float *const *kp,
              const int64_t *ks, const float *q, double eps, const float *lse,
              const float *const *dout, const float *dlse, float *const *gv, float *const *gk,
              int acc, float *dq, int threads) {
    float *part = calloc((size_t)threads * C * r, sizeof(float));
#pragma omp parallel num_threads(threads)
    {
        SPLIT(n)
        read_bwd_range(S, C, n, d, r, sliced, vp, vs, kp, ks, q, eps, lse, dout, dlse, gv, gk,
                       acc, part + (int64_t)t * C * r, t0, t1);
    }
    sum_partials(part, threads, C * r, dq);
}

void merge_fwd(int64_t n, int64_t d, int64_t r, const float *o1, int64_t o1s, const float *lse1,
               const float *pv, int64_t pvs, const float *pk, int64_t pks, const float *q,
               double eps, double norm_eps, float *h, float *norm, int threads) {
#pragma omp parallel num_threads(threads)
    {
        SPLIT(n)
        merge_fwd_range(n, d, r, o1, o1s, lse1, pv, pvs, pk, pks, q, eps, norm_eps, h, norm, t0,
                        t1);
    }
}

void merge_bwd(int64_t n, int64_t d, int64_t r, int sliced, const float *o1, int64_t o1s,
               const float *lse1, const float *pv, int64_t pvs, const float *pk, int64_t pks,
               const float *q, double eps, double norm_eps, const float *h, const float *gh,
               const float *gn, float *d_o1, float *d_lse1, float *d_pv, float *d_pk, float *dq,
               int threads) {
    float *part = calloc((size_t)threads * r, sizeof(float));
#pragma omp parallel num_threads(threads)
    {
        SPLIT(n)
        merge_bwd_range(n, d, r, sliced, o1, o1s, lse1, pv, pvs, pk, pks, q, eps, norm_eps, h, gh,
                        gn, d_o1, d_lse1, d_pv, d_pk, part + (int64_t)t * r, t0, t1);
    }
    sum_partials(part, threads, r, dq);
}
