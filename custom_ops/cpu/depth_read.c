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

/* Adds the key gradient of sum_c dl[c] * l[c] (l[c] = rstd <q_c, k>) into g [r] and
 * dl[c] * rstd * k into dq [C, r]. RMSNorm backward: dk = rstd dl^T q - k rstd^2 sum(dl l) / r. */
static void key_grad(const float *k, float rstd, const float *l, const float *dl, const float *q,
                     int64_t C, int64_t r, float *g, float *dq) {
    double gl = 0;
    for (int64_t c = 0; c < C; c++) gl += (double)dl[c] * l[c];
    float coef = (float)(gl * rstd * rstd / (double)r);
    for (int64_t j = 0; j < r; j++) g[j] -= k[j] * coef;
    for (int64_t c = 0; c < C; c++) {
        float a = dl[c] * rstd;
        const float *qc = q + c * r;
        float *dqc = dq + c * r;
        for (int64_t j = 0; j < r; j++) {
            g[j] += a * qc[j];
            dqc[j] += a * k[j];
        }
    }
}

/* For one source row v [d] and its gradient row g [d]: da[c] = <dh_c, v> and g = sum_c w[c]
 * dh_c (left to right) over the C rows dh_c = dh + c*ldh, row at a time. */
static void grad_pass(const float *dh, int64_t ldh, int64_t C, const float *v, int64_t d,
                      const float *w, float *g, float *da) {
    for (int64_t c = 0; c < C; c++) da[c] = dot(dh + c * ldh, v, d);
    float a = w[0];
    for (int64_t j = 0; j < d; j++) g[j] = a * dh[j];
    for (int64_t c = 1; c < C; c++) {
        const float *x = dh + c * ldh;
        a = w[c];
        for (int64_t j = 0; j < d; j++) g[j] += a * x[j];
    }
}

/* Backward of read_fwd. dout [C, n, d] and dlse [C, n] may be NULL. gv: S contiguous [n, d];
 * gk: S contiguous [n, r] (unused if sliced); dq [C, r] partial of this call, accumulated. */
static void read_bwd_range(int64_t S, int64_t C, int64_t n, int64_t d, int64_t r, int sliced,
              const float *const *vp, const int64_t *vs, const float *const *kp,
              const int64_t *ks, const float *q, double eps, const float *lse,
              const float *dout, const float *dlse, float *const *gv, float *const *gk,
              float *dq, int64_t t0, int64_t t1) {
    float *l = malloc(sizeof(float) * (S * C * 3 + S));
    float *a = l + S * C, *dl = a + S * C, *rstd = dl + S * C;
    for (int64_t i = t0; i < t1; i++) {
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
            for (int64_t c = 0; dout && c < C; c++) prefetch_row(dout + (c * n + i + 1) * d, d);
        }
        for (int64_t s = 0; s < S; s++) { /* dl holds da = <dh_c, v_s> until rescaled below */
            float *g = gv[s] + i * d;
            if (dout) {
                grad_pass(dout + i * d, n * d, C, vp[s] + i * vs[s], d, a + s * C, g, dl + s * C);
            } else {
                memset(g, 0, sizeof(float) * d);
                memset(dl + s * C, 0, sizeof(float) * C);
            }
        }
        for (int64_t c = 0; c < C; c++) {
            double big_d = 0;
            for (int64_t s = 0; s < S; s++) big_d += (double)a[s * C + c] * dl[s * C + c];
            float extra = dlse ? dlse[c * n + i] : 0.0f;
            for (int64_t s = 0; s < S; s++)
                dl[s * C + c] = a[s * C + c] * (dl[s * C + c] - (float)big_d + extra);
        }
        for (int64_t s = 0; s < S; s++) {
            const float *k = key_row(vp, vs, kp, ks, sliced, s, i, d, r);
            float *gkey = sliced ? gv[s] + i * d + (d - r) : gk[s] + i * r;
            if (!sliced) memset(gkey, 0, sizeof(float) * r);
            key_grad(k, rstd[s], l + s * C, dl + s * C, q, C, r, gkey, dq);
        }
    }
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
        for (int64_t j = 0; j < d; j++) {
            go[j] = w1 * dh[j];
            gp[j] = w2 * dh[j];
        }
        float *gkey = sliced ? gp + (d - r) : d_pk + i * r;
        if (!sliced) memset(gkey, 0, sizeof(float) * r);
        key_grad(k, rstd, &logit, &dl, q, 1, r, gkey, dq);
    }
    free(dh);
}

/* Tokens [t0, t1) of thread t of nt. */
#define SPLIT(n)                                   \
    int t = omp_get_thread_num(), nt = omp_get_num_threads(); \
    int64_t t0 = (n) * t / nt, t1 = (n) * (t + 1) / nt;

/* The wrapper's contract (each entry point's arguments and what lies behind each pointer),
 * bumped on any change: custom_ops.cpu.build refuses a library that answers another number
 * (benchmarks.cpu_kernels builds other revisions of this file). 2: dq is the summed gradient. */
int lrattnres_cpu_abi(void) { return 2; }

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
              const float *dout, const float *dlse, float *const *gv, float *const *gk,
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
