/* Fused CPU kernels of the depth read (SPEC §2, §7), fp32, one pass over each token's rows.
 *
 * Each exported function splits the tokens over `threads` OpenMP threads; linked against the
 * libgomp that torch has already loaded, they share torch's thread pool (no oversubscription).
 * A thread touches only its own tokens and its own query-gradient partial; the partials are
 * summed in thread order after the parallel region (dq: the sum, [C, r] or [r]).
 * Pointers: sources are S row-major [n, d] (value) / [n, r] (key) matrices with unit column
 * stride and their own row strides (elements); sliced keys are the last r columns of the value.
 * Outputs and gradients are contiguous. Small per-token reductions accumulate in double, the
 * d-length products in float on independent 16-lane chains (vectorised, tree-like rounding).
 * Rows are processed one at a time: a token's S source rows and C output rows start at the same
 * offset within a 4 KB page whenever their tensors are page-aligned (every row at d=1024 fp32),
 * so a loop over column chunks of all of them at once competes for the same L1 sets (measured
 * 3.7x slower for the forward).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16 /* float lanes of one vector step (one AVX-512 register, two AVX2) */

/* <a, b>: four independent W-lane float chains (the FMA latency hidden), combined pairwise to
 * W/2 lanes, which are summed in double with the tail. */
static float dot(const float *a, const float *b, int64_t n) {
    float acc[4][W] = {{0}};
    int64_t j = 0;
    for (; j + 4 * W <= n; j += 4 * W)
        for (int u = 0; u < 4; u++)
            for (int l = 0; l < W; l++) acc[u][l] += a[j + u * W + l] * b[j + u * W + l];
    for (; j + W <= n; j += W)
        for (int l = 0; l < W; l++) acc[0][l] += a[j + l] * b[j + l];
    for (int l = 0; l < W; l++) acc[0][l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    double s = 0;
    for (; j < n; j++) s += (double)a[j] * b[j];
    for (int l = 0; l < W / 2; l++) s += acc[0][l] + acc[0][l + W / 2];
    return (float)s;
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

/* Hint row [0, n) of floats into L2: the next token's, while this one is computed (the reads
 * and the merge backward measured 0.68-0.95x of their time with the hardware prefetchers alone,
 * the merge forward the same). */
static void prefetch_row(const float *row, int64_t n) {
    for (int64_t b = 0; b < n; b += 16) __builtin_prefetch(row + b, 0, 2);
}

/* rstd of one key row and its logits against the C queries: l[c] = rstd * <q_c, k>. */
static float key_logits(const float *k, const float *q, int64_t C, int64_t r, double eps,
                        float *l) {
    float rstd = (float)(1.0 / sqrt(sumsq(k, r) / (double)r + eps));
    for (int64_t c = 0; c < C; c++) l[c] = rstd * dot(q + c * r, k, r);
    return rstd;
}

static const float *key_row(const float *const *vp, const int64_t *vs, const float *const *kp,
                            const int64_t *ks, int sliced, int64_t s, int64_t i, int64_t d,
                            int64_t r) {
    return sliced ? vp[s] + i * vs[s] + (d - r) : kp[s] + i * ks[s];
}

/* out [C, n, d], lse [C, n]; work: S*C floats. Each output row is built in place, o = a_0 v_0,
 * then += a_s v_s (it stays in L1; the S source rows in L2 across the C queries). */
static void read_fwd_range(int64_t S, int64_t C, int64_t n, int64_t d, int64_t r, int sliced,
              const float *const *vp, const int64_t *vs, const float *const *kp,
              const int64_t *ks, const float *q, double eps, float *out, float *lse,
              int64_t t0, int64_t t1) {
    float *l = malloc(sizeof(float) * S * C);
    const float **v = malloc(sizeof(float *) * S);
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
            for (int64_t s = 0; s < S; s++) l[s * C + c] *= inv_z;
        }
        if (i + 1 < t1)
            for (int64_t s = 0; s < S; s++) prefetch_row(vp[s] + (i + 1) * vs[s], d);
        for (int64_t c = 0; c < C; c++) {
            float *o = out + (c * n + i) * d;
            float a = l[c];
            for (int64_t j = 0; j < d; j++) o[j] = a * v[0][j];
            for (int64_t s = 1; s < S; s++) {
                const float *row = v[s];
                a = l[s * C + c];
                for (int64_t j = 0; j < d; j++) o[j] += a * row[j];
            }
        }
    }
    free(v);
    free(l);
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

#define MIX 64 /* columns of one mix_row step: its accumulator (256 bytes) stays in L1 */

static inline void axpy_acc(float *restrict acc, const float *restrict x, float a, int64_t m) {
    for (int64_t l = 0; l < m; l++) acc[l] += a * x[l];
}

/* acc += b q; dq += b k over m columns. */
static inline void key_acc(float *restrict acc, float *restrict dq, const float *restrict q,
                           const float *restrict k, float b, int64_t m) {
    for (int64_t l = 0; l < m; l++) {
        acc[l] += b * q[l];
        dq[l] += b * k[l];
    }
}

/* Columns [j, j + m) of mix_row (m <= MIX; inlined with m = MIX for the vector body). */
static inline __attribute__((always_inline)) void mix_chunk(
    float *restrict out, int64_t j, int64_t m, int64_t C, const float *const *x, int64_t xo,
    const float *a, const keyterms *kt) {
    float acc[MIX];
    for (int l = 0; l < MIX; l++) acc[l] = 0.0f;
    for (int64_t c = 0; x && c < C; c++)
        if (x[c]) axpy_acc(acc, x[c] + xo + j, a[c], m);
    if (kt) {
        axpy_acc(acc, kt->k + j, -kt->coef, m);
        for (int64_t c = 0; c < C; c++)
            key_acc(acc, kt->dq + c * kt->r + j, kt->q + c * kt->r + j, kt->k + j, kt->b[c], m);
    }
    for (int64_t l = 0; l < m; l++) out[j + l] = acc[l];
}

/* One gradient row [0, n), written once: out = sum_c a[c] x[c][xo:] (left to right; x or an
 * x[c] NULL: zero), plus the key terms kt (NULL: none) over the same columns. */
static void mix_row(float *out, int64_t n, int64_t C, const float *const *x, int64_t xo,
                    const float *a, const keyterms *kt) {
    int64_t j = 0;
    for (; j + MIX <= n; j += MIX) mix_chunk(out, j, MIX, C, x, xo, a, kt);
    if (j < n) mix_chunk(out, j, n - j, C, x, xo, a, kt);
}

/* Gradient row of one source v [d] (key: its last r columns if sliced, else its own row gk):
 * the value part sum_c a[c] dh[c] and the key terms, each column written once. */
static void source_grad(const float *const *dh, int64_t C, const float *a, int64_t d,
                        int sliced, const keyterms *kt, float *g, float *gk) {
    int64_t head = sliced ? d - kt->r : d;
    mix_row(g, head, C, dh, 0, a, NULL);
    if (sliced) mix_row(g + head, kt->r, C, dh, head, a, kt);
    else mix_row(gk, kt->r, C, NULL, 0, NULL, kt);
}

/* Backward of read_fwd. dout: C contiguous [n, d] gradients, one per query (the table or any
 * entry may be NULL: zero); dlse [C, n] may be NULL. gv: S contiguous [n, d];
 * gk: S contiguous [n, r] (unused if sliced); dq [C, r] partial of this call, accumulated. */
static void read_bwd_range(int64_t S, int64_t C, int64_t n, int64_t d, int64_t r, int sliced,
              const float *const *vp, const int64_t *vs, const float *const *kp,
              const int64_t *ks, const float *q, double eps, const float *lse,
              const float *const *dout, const float *dlse, float *const *gv,
              float *const *gk, float *dq, int64_t t0, int64_t t1) {
    float *l = malloc(sizeof(float) * (S * C * 3 + S + C));
    float *a = l + S * C, *dl = a + S * C, *rstd = dl + S * C, *b = rstd + S;
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
            for (int64_t s = 0; s < S; s++) a[s * C + c] = (float)(a[s * C + c] / z);
        }
        if (i + 1 < t1) {
            for (int64_t s = 0; s < S; s++) prefetch_row(vp[s] + (i + 1) * vs[s], d);
            for (int64_t c = 0; c < C; c++)
                if (dh[c]) prefetch_row(dh[c] + d, d);
        }
        for (int64_t s = 0; s < S; s++) /* dl holds da = <dh_c, v_s> until rescaled below */
            for (int64_t c = 0; c < C; c++)
                dl[s * C + c] = dh[c] ? dot(dh[c], vp[s] + i * vs[s], d) : 0.0f;
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
            source_grad(dh, C, a + s * C, d, sliced, &kt, gv[s] + i * d,
                        sliced ? NULL : gk[s] + i * r);
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
    float m = fmaxf(lse1, *logit);
    float w1 = expf(lse1 - m), w2 = expf(*logit - m);
    *w1_out = w1 / (w1 + w2);
    return w2 / (w1 + w2);
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
    float *dh = malloc(sizeof(float) * d);
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
        if (gh) memcpy(dh, gh + i * d, sizeof(float) * d);
        else memset(dh, 0, sizeof(float) * d);
        if (gn) {
            const float *hi = h + i * d, *gy = gn + i * d;
            float hr = (float)(1.0 / sqrt((double)dot(hi, hi, d) / (double)d + norm_eps));
            /* y = h hr: dh += hr (gy - y mean(gy y)) = hr (gy - h hr^2 <gy, h> / d) */
            float cy = dot(gy, hi, d) * hr * hr / (float)d;
            for (int64_t j = 0; j < d; j++) dh[j] += hr * (gy[j] - hi[j] * cy);
        }
        const float *a = o1 + i * o1s, *b = pv + i * pvs;
        float dl = w1 * w2 * (dot(dh, b, d) - dot(dh, a, d));
        d_lse1[i] = -dl;
        float *go = d_o1 + i * d, *gp = d_pv + i * d;
        int64_t head = sliced ? d - r : d; /* the partial's key columns: written with their terms */
        for (int64_t j = 0; j < head; j++) {
            go[j] = w1 * dh[j];
            gp[j] = w2 * dh[j];
        }
        for (int64_t j = head; j < d; j++) go[j] = w1 * dh[j];
        float bq;
        keyterms kt = key_terms(k, rstd, &logit, &dl, q, 1, r, &bq, dq);
        const float *row = dh;
        if (sliced) mix_row(gp + head, r, 1, &row, head, &w2, &kt);
        else mix_row(d_pk + i * r, r, 1, NULL, 0, NULL, &kt);
    }
    free(dh);
}

/* Tokens [t0, t1) of thread t of nt. */
#define SPLIT(n)                                   \
    int t = omp_get_thread_num(), nt = omp_get_num_threads(); \
    int64_t t0 = (n) * t / nt, t1 = (n) * (t + 1) / nt;

/* The wrapper's contract (each entry point's arguments and what lies behind each pointer),
 * bumped on any change: custom_ops.cpu.build refuses a library that answers another number
 * (benchmarks.cpu_kernels builds other revisions of this file). 2: dq is the summed gradient;
 * 3: read_bwd's dout is a table of C per-query gradients. */
int lrattnres_cpu_abi(void) { return 3; }

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
              float *dq, int threads) {
    float *part = calloc((size_t)threads * C * r, sizeof(float));
#pragma omp parallel num_threads(threads)
    {
        SPLIT(n)
        read_bwd_range(S, C, n, d, r, sliced, vp, vs, kp, ks, q, eps, lse, dout, dlse, gv, gk,
                       part + (int64_t)t * C * r, t0, t1);
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
