/*
 * Optional compiled fast paths of pp1wire.q (dyadic, rows, tree, validate, targetrows, rng):
 * each computes exactly what its numpy path computes, bit for bit, and is qualified
 * against it by the tests. Without this module numpy runs and only speed changes. The
 * method table at the end gives each function's signature.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(_WIN32)
#include <pthread.h>
#endif

static void release_all(Py_buffer *const *views, size_t n) {
    for (size_t i = 0; i < n; i++) PyBuffer_Release(views[i]);
}

/* PyBuffer_Release of each buffer named. */
#define RELEASE(...)                                                                       \
    release_all((Py_buffer *const[]){__VA_ARGS__},                                         \
                sizeof((Py_buffer *const[]){__VA_ARGS__}) / sizeof(Py_buffer *))

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
/* The wide loops of construct_rows: AVX-512 where the CPU has it. */
#define MULTIVERSION512 __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MULTIVERSION
#define MULTIVERSION512
#endif

MULTIVERSION
static uint32_t scan_loop(const uint32_t *restrict bits, size_t n, uint64_t *restrict sum_out,
                          uint32_t *restrict bad_out) {
    uint32_t mx = 0, bad = 0;
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b = bits[i];
        mx = b > mx ? b : mx;
        float v;
        memcpy(&v, &b, sizeof v);
        float c = v * 16777216.0f; /* exact: scaling by a power of two */
        int32_t ci = (int32_t)c;   /* in range whenever max_bits <= 1.0f */
        bad |= ((float)ci != c);
        sum += (uint32_t)ci;
    }
    *sum_out = sum;
    *bad_out = bad;
    return mx;
}

/* Error codes shared with pp1wire.errors.ErrorCode (protocol §9). */
enum {
    E_ROW_LENGTH = 60, E_NON_FINITE = 61, E_NEGATIVE = 62, E_NON_DYADIC = 63,
    E_MASS_MISMATCH = 64, E_ZERO_Q_AT_PROPOSED = 65, E_PROPOSED_OUT_OF_RANGE = 66,
    E_SPARSE_DUPLICATE_ID = 67, E_SPARSE_UNSORTED = 68, E_SPARSE_ID_OUT_OF_RANGE = 69,
    E_SPARSE_ZERO_ENTRY = 70, E_SUPPORT_TOO_LARGE = 71, E_MISSING_Q = 73,
};

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The code of a row holding a bit pattern above 1.0 (its largest as unsigned): a
 * NaN or infinity outranks a negative value, which outranks a finite value above 1
 * (not dyadic24). A refused row's path only, so plain loops. */
static int above_one_code(const uint32_t *bits, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((bits[i] & 0x7F800000u) == 0x7F800000u) return E_NON_FINITE;
    for (size_t i = 0; i < n; i++)
        if (bits[i] & 0x80000000u) return E_NEGATIVE;
    return E_NON_DYADIC;
}

/* The sparse-row checks of validate.validate_sparse, in the same order. */
static int sparse_code(const int32_t *ids, const uint32_t *bits, size_t k, int64_t vocab,
                       size_t max_k, int64_t proposed) {
    if (k == 0) return E_MISSING_Q;
    if (k > max_k) return E_SUPPORT_TOO_LARGE;
    if (proposed < 0 || proposed >= vocab) return E_PROPOSED_OUT_OF_RANGE;
    for (size_t i = 0; i < k; i++)
        if (ids[i] < 0 || (int64_t)ids[i] >= vocab) return E_SPARSE_ID_OUT_OF_RANGE;
    for (size_t i = 1; i < k; i++) {
        if (ids[i] <= ids[i - 1]) {
            /* Not strictly ascending: a duplicate anywhere outranks plain disorder. */
            int32_t sorted[256];
            int32_t *buf = k <= 256 ? sorted : (int32_t *)malloc(k * sizeof(int32_t));
            if (buf == NULL) return -1;
            memcpy(buf, ids, k * sizeof(int32_t));
            qsort(buf, k, sizeof(int32_t), cmp_i32);
            int dup = 0;
            for (size_t j = 1; j < k; j++) dup |= buf[j] == buf[j - 1];
            if (buf != sorted) free(buf);
            return dup ? E_SPARSE_DUPLICATE_ID : E_SPARSE_UNSORTED;
        }
    }
    uint32_t mx = 0;
    for (size_t i = 0; i < k; i++) mx = bits[i] > mx ? bits[i] : mx;
    if (mx > 0x3F800000u) return above_one_code(bits, k);
    uint64_t sum = 0;
    int zero = 0;
    for (size_t i = 0; i < k; i++) {
        float v;
        memcpy(&v, &bits[i], sizeof v);
        float c = v * 16777216.0f;
        int32_t ci = (int32_t)c;
        if ((float)ci != c) return E_NON_DYADIC;
        zero |= ci == 0;
        sum += (uint32_t)ci;
    }
    if (zero) return E_SPARSE_ZERO_ENTRY;
    if (sum != 16777216u) return E_MASS_MISMATCH;
    size_t lo = 0, hi = k;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((int64_t)ids[mid] < proposed) lo = mid + 1; else hi = mid;
    }
    if (lo >= k || (int64_t)ids[lo] != proposed) return E_ZERO_Q_AT_PROPOSED;
    return 0;
}

static PyObject *check_sparse(PyObject *self, PyObject *args) {
    Py_buffer idb, qb;
    long long vocab, proposed;
    Py_ssize_t max_k;
    if (!PyArg_ParseTuple(args, "y*y*LnL", &idb, &qb, &vocab, &max_k, &proposed)) return NULL;
    int code;
    if (idb.len % 4 || qb.len % 4 || idb.len != qb.len) {
        code = E_ROW_LENGTH;
    } else {
        code = sparse_code((const int32_t *)idb.buf, (const uint32_t *)qb.buf,
                           (size_t)idb.len / 4, (int64_t)vocab, (size_t)max_k, (int64_t)proposed);
    }
    RELEASE(&idb, &qb);
    if (code < 0) return PyErr_NoMemory();
    return PyLong_FromLong(code);
}

/* The canonical subtree over 64 leaves: its levels, each pair one addition. */
MULTIVERSION
static double root64(const double *restrict x) {
    double a[32], b[16], c[8], d[4];
    for (int i = 0; i < 32; i++) a[i] = x[2 * i] + x[2 * i + 1];
    for (int i = 0; i < 16; i++) b[i] = a[2 * i] + a[2 * i + 1];
    for (int i = 0; i < 8; i++) c[i] = b[2 * i] + b[2 * i + 1];
    for (int i = 0; i < 4; i++) d[i] = c[2 * i] + c[2 * i + 1];
    return (d[0] + d[1]) + (d[2] + d[3]);
}

#define M24 16777216.0
#define MIN_NORMAL 2.2250738585072014e-308 /* 2**-1022 */

#define DIST_BUCKETS 1024
#define DIST_LAST 1023.0

/* The distance bucket of a logit below the row's maximum: floor((top - x) * scale),
 * at most 1023 (where -inf and far logits land). Monotone in x. The scale is
 * finite and positive, so the product is never NaN. */
static inline uint32_t distance_bucket(double x, double top, double scale) {
    double d = (top - x) * scale;
    if (!(d > 0.0)) return 0;
    return d < DIST_LAST ? (uint32_t)d : (uint32_t)DIST_LAST;
}

/* The distance buckets of 256 logits (vectorized): as distance_bucket. */
MULTIVERSION
static void distance_buckets(const double *restrict x, double top, double scale,
                             uint16_t *restrict out) {
    for (int j = 0; j < 256; j++) {
        double d = (top - x[j]) * scale;
        d = d > 0.0 ? d : 0.0;
        d = d < DIST_LAST ? d : DIST_LAST;
        out[j] = (uint16_t)(int32_t)d;
    }
}

/* The histogram of distance buckets; blocks of buckets computed vectorized,
 * counted in four interleaved parts so that runs of equal buckets (logits
 * cluster) do not wait on each other's stores. */
static void distance_histogram(const double *restrict x, size_t n, double top, double scale,
                               uint32_t *restrict hist) {
    uint32_t part[4][DIST_BUCKETS];
    uint16_t b[256];
    memset(part, 0, sizeof part);
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        distance_buckets(x + i, top, scale, b);
        for (int j = 0; j < 256; j += 4) {
            part[0][b[j]]++;
            part[1][b[j + 1]]++;
            part[2][b[j + 2]]++;
            part[3][b[j + 3]]++;
        }
    }
    for (; i < n; i++) part[0][distance_bucket(x[i], top, scale)]++;
    for (int k = 0; k < DIST_BUCKETS; k++)
        hist[k] = part[0][k] + part[1][k] + part[2][k] + part[3][k];
}

/* Doubles (not NaN) order as these signed integers. */
static inline int64_t order_key(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    return b ^ ((b >> 63) & INT64_MAX);
}

static inline double from_order_key(int64_t k) {
    int64_t b = k ^ ((k >> 63) & INT64_MAX);
    double v;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* Over 64 logits: whether any is a candidate (distance below limit, i.e. bucket
 * at most limit - 1), and the order key of the largest that is not
 * (vectorized: integer keys, since a double max does not vectorize here). */
MULTIVERSION
static int chunk_candidates(const double *restrict x, double top, double scale, double limit,
                            int64_t *restrict out_key) {
    int64_t any = 0;
    int64_t mk = *out_key;
    for (int j = 0; j < 64; j++) {
        double d = (top - x[j]) * scale; /* never NaN: the scale is finite and positive */
        int64_t in = d < limit;
        int64_t b;
        memcpy(&b, &x[j], sizeof b);
        int64_t key = b ^ ((b >> 63) & INT64_MAX);
        int64_t m = -in; /* all ones for a candidate: it does not count here */
        key = (key & ~m) | (INT64_MIN & m);
        mk = key > mk ? key : mk;
        any |= in;
    }
    *out_key = mk;
    return any != 0;
}

/* Candidates for a sparse top-k support from one logits row x (top its maximum): every
 * index at most margin distance buckets past the k-th largest logit's, ascending, into idx
 * (int64), and the largest logit not taken, from which the caller proves the support lies
 * among them or falls back. Count -1: no useful cut (a scale not finite and positive, the
 * k-th logit in the last bucket, fewer than k entries, more candidates than idx holds). */
static PyObject *sparse_candidates(PyObject *self, PyObject *args) {
    Py_buffer xb, ib;
    double top, scale;
    Py_ssize_t k, margin;
    if (!PyArg_ParseTuple(args, "y*ddnnw*", &xb, &top, &scale, &k, &margin, &ib)) return NULL;
    if (xb.len % 8 || ib.len % 8 || k < 1 || margin < 0) {
        RELEASE(&xb, &ib);
        PyErr_SetString(PyExc_ValueError, "sparse_candidates: bad arguments");
        return NULL;
    }
    size_t n = (size_t)xb.len / 8, cap = (size_t)ib.len / 8;
    const double *x = (const double *)xb.buf;
    int64_t *idx = (int64_t *)ib.buf;
    Py_ssize_t count = -1;
    double out_max = -HUGE_VAL;
    Py_BEGIN_ALLOW_THREADS
    uint32_t hist[DIST_BUCKETS];
    uint32_t kth = DIST_BUCKETS;
    if (scale > 0.0 && scale < HUGE_VAL) { /* else no cut: a NaN distance has no bucket */
        distance_histogram(x, n, top, scale, hist);
        size_t acc = 0;
        kth = 0;
        while (kth < DIST_BUCKETS && acc + hist[kth] < (size_t)k) acc += hist[kth++];
    }
    if (kth < DIST_BUCKETS - 1 && (size_t)margin < DIST_BUCKETS - 1 - kth) {
        uint32_t cut = kth + (uint32_t)margin;
        double limit = (double)cut + 1.0; /* bucket <= cut  <=>  distance < cut + 1 */
        size_t c = 0, i = 0;
        int full = 0;
        int64_t out_key = order_key(-HUGE_VAL);
        for (; i < n && !full; i += 64) {
            size_t end = i + 64 <= n ? i + 64 : n;
            if (end - i == 64 && !chunk_candidates(x + i, top, scale, limit, &out_key)) continue;
            for (size_t j = i; j < end; j++) {
                double v = x[j];
                if (distance_bucket(v, top, scale) <= cut) {
                    if (c == cap) {
                        full = 1;
                        break;
                    }
                    idx[c++] = (int64_t)j;
                } else if (order_key(v) > out_key) {
                    out_key = order_key(v);
                }
            }
        }
        out_max = from_order_key(out_key);
        if (!full) count = (Py_ssize_t)c;
    }
    Py_END_ALLOW_THREADS
    RELEASE(&xb, &ib);
    return Py_BuildValue("(nd)", count, out_max);
}

/* ---------------------------------------------------------------------------
 * The row operations of verification (pp1wire.q.targetrows.CompiledRows), protocol
 * §6.5 and §6.6: row_checks (each row's canonical total, or None if it is not a
 * distribution) and draw_rows (each draw by the tree descent: one pass stores the
 * sums of the row's 64-leaf blocks, the descent recomputes the block it ends in),
 * both with the GIL released and the rows shared out to threads; the walk that
 * decides with them is pp1wire.q.walk's. step_simd and draw_total expose the
 * pieces to the tests that qualify them.
 * ------------------------------------------------------------------------- */

enum { K_NONE = 0, K_F32 = 1, K_F64 = 2, K_I32 = 3, K_I64 = 4 };

static void philox10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int i = 0; i < 10; i++) {
        if (i) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = (uint32_t)p1;
        c[2] = n2;
        c[3] = (uint32_t)p0;
    }
}

static uint64_t draw_u53(uint64_t seed, uint32_t gen, uint32_t round, uint32_t pos, int domain) {
    uint32_t c[4] = {pos, round, gen, (uint32_t)domain << 24};
    philox10(c, (uint32_t)seed, (uint32_t)(seed >> 32));
    return ((uint64_t)(c[0] >> 5) << 26) | (uint64_t)(c[1] >> 6);
}

typedef struct {
    const void *p;
    int kind; /* K_F32 or K_F64; K_NONE: the row could not be read */
} vrow_t;

typedef struct {
    const void *q; /* K_F32 values or K_I32 / K_I64 counts */
    int kind;
    const int32_t *ids; /* NULL for a dense row */
    size_t nids;
} vq_t;

/* Leaves [base, base + 64) of the row as binary64, +0.0 past n; returns how many are real. */
static size_t load_block(const vrow_t *r, size_t n, size_t base, double *restrict x) {
    size_t m = base >= n ? 0 : (n - base < 64 ? n - base : 64);
    if (r->kind == K_F32) {
        const float *f = (const float *)r->p + base;
        for (size_t i = 0; i < m; i++) x[i] = (double)f[i];
    } else {
        memcpy(x, (const double *)r->p + base, m * sizeof(double));
    }
    for (size_t i = m; i < 64; i++) x[i] = 0.0;
    return m;
}

/* The root of a 64-leaf block with AVX2, every node the same one addition of its two
 * children as in root64 (only independent additions reordered): level 1 adds
 * unpacklo/unpackhi of two loads, nodes (0, 2, 1, 3); the next adds the two 128-bit
 * halves, back in order; and so on. *sign gets the OR of every leaf's sign bit. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_X86_PATH 1

__attribute__((target("avx2"))) static inline __m256d pairs_unordered(__m256d a, __m256d b) {
    return _mm256_add_pd(_mm256_unpacklo_pd(a, b), _mm256_unpackhi_pd(a, b));
}

__attribute__((target("avx2"))) static inline __m256d halves(__m256d s, __m256d t) {
    return _mm256_add_pd(_mm256_permute2f128_pd(s, t, 0x20), _mm256_permute2f128_pd(s, t, 0x31));
}

/* Levels 1..6 from the 16 leaf vectors. */
__attribute__((target("avx2"))) static double root_of_leaves(const __m256d *v) {
    __m256d l1[8], l2[4], l3[2];
    for (int k = 0; k < 8; k++) l1[k] = pairs_unordered(v[2 * k], v[2 * k + 1]);
    for (int j = 0; j < 4; j++) l2[j] = halves(l1[2 * j], l1[2 * j + 1]);
    for (int i = 0; i < 2; i++) l3[i] = pairs_unordered(l2[2 * i], l2[2 * i + 1]);
    __m256d l4 = halves(l3[0], l3[1]);
    __m128d lo = _mm256_castpd256_pd128(l4), hi = _mm256_extractf128_pd(l4, 1);
    __m128d l5 = _mm_add_pd(_mm_unpacklo_pd(lo, hi), _mm_unpackhi_pd(lo, hi));
    return _mm_cvtsd_f64(l5) + _mm_cvtsd_f64(_mm_unpackhi_pd(l5, l5));
}

__attribute__((target("avx2"))) static double root64_f64_x86(const double *x, uint64_t *sign) {
    __m256d v[16], acc = _mm256_setzero_pd();
    for (int k = 0; k < 16; k++) {
        v[k] = _mm256_loadu_pd(x + 4 * k);
        acc = _mm256_or_pd(acc, v[k]);
    }
    *sign |= (uint64_t)_mm256_movemask_pd(acc);
    return root_of_leaves(v);
}

__attribute__((target("avx2"))) static double root64_f32_x86(const float *f, uint64_t *sign) {
    __m256d v[16];
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < 8; k++) {
        __m256 raw = _mm256_loadu_ps(f + 8 * k);
        acc = _mm256_or_ps(acc, raw);
        v[2 * k] = _mm256_cvtps_pd(_mm256_castps256_ps128(raw));
        v[2 * k + 1] = _mm256_cvtps_pd(_mm256_extractf128_ps(raw, 1));
    }
    *sign |= (uint64_t)_mm256_movemask_ps(acc);
    return root_of_leaves(v);
}

/* The draw's block root in one go (full blocks, dense q of FP32 values or
 * int32 counts, or none): p = v / total, max(p - q, 0), then the block's
 * levels, all in registers. The same IEEE operations as weights_block. */
__attribute__((target("avx2"))) static double weights_root_x86(const void *row, int f32,
                                                               size_t base, double total,
                                                               const void *q, int qkind) {
    __m256d v[16];
    const __m256d t = _mm256_set1_pd(total), zero = _mm256_setzero_pd();
    const __m256d scale = _mm256_set1_pd(1.0 / M24); /* exact: c / 2**24 == c * 2**-24 */
    for (int k = 0; k < 16; k++) {
        size_t at = base + 4 * (size_t)k;
        __m256d p = f32 ? _mm256_cvtps_pd(_mm_loadu_ps((const float *)row + at))
                        : _mm256_loadu_pd((const double *)row + at);
        p = _mm256_div_pd(p, t);
        if (qkind == K_F32) {
            __m256d qv = _mm256_cvtps_pd(_mm_loadu_ps((const float *)q + at));
            p = _mm256_max_pd(_mm256_sub_pd(p, qv), zero);
        } else if (qkind == K_I32) {
            __m128i c = _mm_loadu_si128((const __m128i *)((const int32_t *)q + at));
            __m256d qv = _mm256_mul_pd(_mm256_cvtepi32_pd(c), scale);
            p = _mm256_max_pd(_mm256_sub_pd(p, qv), zero);
        }
        v[k] = p;
    }
    return root_of_leaves(v);
}

/* -1: not asked yet; tests turn the AVX2 path off to qualify the portable one. */
static int avx2_state = -1;

static int have_avx2(void) {
    if (avx2_state < 0) {
        __builtin_cpu_init();
        avx2_state = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return avx2_state;
}
#else
static int avx2_state = 0; /* no AVX2 path in this build */
static int have_avx2(void) { return 0; }
#endif

/* Whether some value is below zero: the OR of the raw bit patterns has its sign bit set only if
 * some value has (a negative, or -0.0, or a negative NaN); then the exact test decides. NaN and
 * infinities need no test of their own: they make the total non-finite. */
#define SIGN_OR(name, value_t, bits_t)                    \
    MULTIVERSION                                           \
    static bits_t name(const value_t *restrict x) {        \
        bits_t acc = 0;                                    \
        for (int i = 0; i < 64; i++) {                     \
            bits_t b;                                      \
            memcpy(&b, &x[i], sizeof b);                   \
            acc |= b;                                      \
        }                                                  \
        return acc >> (8 * sizeof(bits_t) - 1);            \
    }
SIGN_OR(sign_or64, double, uint64_t)
SIGN_OR(sign_or32, float, uint32_t)
#undef SIGN_OR

static int any_negative(const double *restrict x, size_t m) {
    for (size_t i = 0; i < m; i++)
        if (x[i] < 0.0) return 1;
    return 0;
}

MULTIVERSION
static void widen64(const float *restrict f, double *restrict x) {
    for (int i = 0; i < 64; i++) x[i] = (double)f[i];
}

static size_t tree_size(size_t n, int *depth) {
    size_t size = 1;
    *depth = 0;
    while (size < n) {
        size <<= 1;
        (*depth)++;
    }
    return size;
}

/* The canonical tree's root. Leaves arrive in order; a binary counter keeps the pending left
 * children (stack[l] is a complete left subtree of level l), so every addition is exactly one node
 * of the tree: left child + right child. Blocks of 64 leaves are summed first, level by level, so
 * the additions of a level are independent (and vectorize); a block of padding only is +0.0. Also
 * whether some value is negative: with the total's finiteness, what check_target reads, in one
 * pass. */
static double blocks_total(const vrow_t *r, size_t n, size_t first, size_t count, int *bad);

static double row_total(const vrow_t *r, size_t n, int *bad) {
    int depth;
    size_t size = tree_size(n, &depth);
    double x[64];
    if (depth < 6) {
        size_t m = load_block(r, n, 0, x);
        *bad = any_negative(x, m);
        for (size_t width = size; width > 1; width >>= 1)
            for (size_t i = 0; i < width / 2; i++) x[i] = x[2 * i] + x[2 * i + 1];
        return x[0];
    }
    return blocks_total(r, n, 0, size >> 6, bad);
}

/* The root of the subtree over the 64-leaf blocks [first, first + count): count a
 * power of two and first a multiple of it, so the root is a node of the row's
 * canonical tree (blocks past n are padding, +0.0). */
static double blocks_total(const vrow_t *r, size_t n, size_t first, size_t count, int *bad) {
    double x[64];
    double stack[64];
    int badness = 0, top = 0;
    while (((size_t)1 << top) < count) top++;
#ifdef HAVE_X86_PATH
    int x86 = have_avx2();
#endif
    for (size_t blk = first; blk < first + count; blk++) {
        size_t base = blk << 6;
        double carry = 0.0;
#ifdef HAVE_X86_PATH
        if (x86 && base + 64 <= n) {
            uint64_t sign = 0;
            if (r->kind == K_F64) {
                const double *src = (const double *)r->p + base;
                carry = root64_f64_x86(src, &sign);
                if (sign) badness |= any_negative(src, 64);
            } else {
                const float *src = (const float *)r->p + base;
                carry = root64_f32_x86(src, &sign);
                if (sign) {
                    widen64(src, x);
                    badness |= any_negative(x, 64);
                }
            }
            int level = 0;
            for (size_t b = blk - first; b & 1; b >>= 1) carry = stack[level++] + carry;
            stack[level] = carry;
            continue;
        }
#endif
        if (base + 64 <= n && r->kind == K_F64) {
            const double *src = (const double *)r->p + base;
            if (sign_or64(src)) badness |= any_negative(src, 64);
            carry = root64(src);
        } else if (base + 64 <= n) {
            const float *src = (const float *)r->p + base;
            widen64(src, x);
            if (sign_or32(src)) badness |= any_negative(x, 64);
            carry = root64(x);
        } else if (base < n) {
            size_t m = load_block(r, n, base, x);
            badness |= any_negative(x, m);
            carry = root64(x);
        }
        int level = 0;
        for (size_t b = blk - first; b & 1; b >>= 1) carry = stack[level++] + carry;
        stack[level] = carry;
    }
    *bad = badness;
    return stack[top];
}

/* The canonical total of float64 values (tree.total). */
static PyObject *tree_total(PyObject *self, PyObject *args) {
    Py_buffer vb;
    if (!PyArg_ParseTuple(args, "y*", &vb)) return NULL;
    if (vb.len % 8) {
        PyBuffer_Release(&vb);
        PyErr_SetString(PyExc_ValueError, "tree_total: not a float64 buffer");
        return NULL;
    }
    size_t n = (size_t)vb.len / 8;
    double root = 0.0;
    if (n) {
        const vrow_t row = {vb.buf, K_F64};
        int bad;
        Py_BEGIN_ALLOW_THREADS
        root = row_total(&row, n, &bad);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&vb);
    return PyFloat_FromDouble(root);
}

static inline double q_at(const vq_t *q, size_t i) {
    switch (q->kind) {
    case K_F32: return (double)((const float *)q->q)[i];
    case K_I32: return (double)((const int32_t *)q->q)[i] / M24;
    default: return (double)((const int64_t *)q->q)[i] / M24;
    }
}

MULTIVERSION
static void divide_block(double *restrict x, size_t m, double total) {
    for (size_t i = 0; i < m; i++) x[i] = x[i] / total;
}

static inline double clamp0(double d) { return d > 0.0 ? d : 0.0; }

MULTIVERSION
static void p64_f64(const double *restrict v, double total, double *restrict x) {
    for (int i = 0; i < 64; i++) x[i] = v[i] / total;
}

MULTIVERSION
static void p64_f32(const float *restrict v, double total, double *restrict x) {
    for (int i = 0; i < 64; i++) x[i] = (double)v[i] / total;
}

/* max(v / total - q, 0) over 64 leaves, for each row type and each dense q type
 * (FP32 values, or integer counts c with q = c / 2**24, exact). */
#define R64(NAME, VT, QT, QEXPR)                                                           \
    MULTIVERSION                                                                           \
    static void NAME(const VT *restrict v, const QT *restrict q, double total,             \
                     double *restrict x) {                                                 \
        for (int i = 0; i < 64; i++) {                                                     \
            double d = (double)v[i] / total - (QEXPR);                                     \
            x[i] = d > 0.0 ? d : 0.0;                                                      \
        }                                                                                  \
    }
R64(r64_f64_f32, double, float, (double)q[i])
R64(r64_f32_f32, float, float, (double)q[i])
R64(r64_f64_i32, double, int32_t, (double)q[i] / M24)
R64(r64_f32_i32, float, int32_t, (double)q[i] / M24)
R64(r64_f64_i64, double, int64_t, (double)q[i] / M24)
R64(r64_f32_i64, float, int64_t, (double)q[i] / M24)
#undef R64

/* The draw's weights at leaves [base, base + 64): p = v / total, then
 * max(p - q, 0) where the row has a q (residual), +0.0 past n. */
static void weights_block(const vrow_t *r, size_t n, size_t base, double total, const vq_t *q,
                          double *restrict x) {
    int f32 = r->kind == K_F32;
    if (base + 64 <= n && (q == NULL || q->kind == K_NONE)) {
        if (f32) p64_f32((const float *)r->p + base, total, x);
        else p64_f64((const double *)r->p + base, total, x);
        return;
    }
    if (base + 64 <= n && q->ids == NULL) {
        const float *vf = (const float *)r->p + base;
        const double *vd = (const double *)r->p + base;
        switch (q->kind) {
        case K_F32: {
            const float *qs = (const float *)q->q + base;
            if (f32) r64_f32_f32(vf, qs, total, x); else r64_f64_f32(vd, qs, total, x);
            return;
        }
        case K_I32: {
            const int32_t *qs = (const int32_t *)q->q + base;
            if (f32) r64_f32_i32(vf, qs, total, x); else r64_f64_i32(vd, qs, total, x);
            return;
        }
        default: {
            const int64_t *qs = (const int64_t *)q->q + base;
            if (f32) r64_f32_i64(vf, qs, total, x); else r64_f64_i64(vd, qs, total, x);
            return;
        }
        }
    }
    size_t m = load_block(r, n, base, x);
    divide_block(x, m, total);
    if (q == NULL || q->kind == K_NONE || m == 0) return;
    if (q->ids == NULL) {
        for (size_t i = 0; i < m; i++) x[i] = clamp0(x[i] - q_at(q, base + i));
        return;
    }
    /* Sparse: q is zero outside its ids, and max(p - 0, 0) is p. */
    size_t lo = 0, hi = q->nids;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((size_t)q->ids[mid] < base) lo = mid + 1; else hi = mid;
    }
    for (size_t j = lo; j < q->nids && (size_t)q->ids[j] < base + m; j++) {
        size_t i = (size_t)q->ids[j] - base;
        x[i] = clamp0(x[i] - q_at(q, j));
    }
}

static inline int go_right(double a, double b, double *t) {
    if (b > 0.0 && (a == 0.0 || *t >= a)) {
        *t = *t - a;
        return 1;
    }
    return 0;
}

/* Levels of a block of 64 (or fewer) leaves: level l at lv + offset[l]. */
static void block_levels(double *lv, size_t size) {
    double *below = lv;
    for (size_t width = size; width > 1; width >>= 1) {
        double *above = below + width;
        for (size_t i = 0; i < width / 2; i++) above[i] = below[2 * i] + below[2 * i + 1];
        below = above;
    }
}

/* Descend levels laid out as block_levels builds them (width leaves first, then each level above)
 * from the root, carrying *t down; the leaf index, with *t left where it falls inside that leaf. */
static size_t descend(const double *lv, size_t width, double *t) {
    const double *level[64];
    size_t off = 0;
    int depth = 0;
    while (1) {
        level[depth] = lv + off;
        if (width == 1) break;
        off += width;
        width >>= 1;
        depth++;
    }
    size_t index = 0;
    for (int l = depth; l > 0; l--) {
        const double *below = level[l - 1];
        index = 2 * index + (size_t)go_right(below[2 * index], below[2 * index + 1], t);
    }
    return index;
}

/* Descend the levels block_levels built from its root; the leaf index. */
static size_t block_descend(const double *lv, size_t size, double t) { return descend(lv, size, &t); }

static double block_root(const double *x) {
#ifdef HAVE_X86_PATH
    if (have_avx2()) {
        uint64_t sign = 0;
        return root64_f64_x86(x, &sign);
    }
#endif
    return root64(x);
}

/* The block roots of the draw's weights for blocks [first, first + count) into up. */
static void weights_roots(const vrow_t *r, size_t n, double total, const vq_t *q, double *up,
                          size_t first, size_t count) {
    double lv[64];
#ifdef HAVE_X86_PATH
    int qkind = q == NULL ? K_NONE : q->kind;
    int fused = have_avx2() && (q == NULL || (q->ids == NULL && qkind != K_I64));
#endif
    for (size_t blk = first; blk < first + count; blk++) {
        size_t base = blk << 6;
        if (base >= n) {
            up[blk] = 0.0;
            continue;
        }
#ifdef HAVE_X86_PATH
        if (fused && base + 64 <= n) {
            up[blk] = weights_root_x86(r->p, r->kind == K_F32, base, total,
                                       q == NULL ? NULL : q->q, qkind);
            continue;
        }
#endif
        weights_block(r, n, base, total, q, lv);
        up[blk] = block_root(lv);
    }
}

/* The canonical total of the draw's weights (what the draw descends); -1.0 if
 * out of memory (a total is never negative). */
static double weights_total(const vrow_t *r, size_t n, double total, const vq_t *q) {
    int depth;
    size_t size = tree_size(n, &depth);
    if (depth < 6) {
        double lv[128];
        weights_block(r, n, 0, total, q, lv);
        block_levels(lv, size);
        return lv[2 * size - 2];
    }
    size_t blocks = size >> 6;
    double *up = (double *)malloc(2 * blocks * sizeof(double));
    if (up == NULL) return -1.0;
    weights_roots(r, n, total, q, up, 0, blocks);
    block_levels(up, blocks);
    double root = up[2 * blocks - 2];
    free(up);
    return root;
}

/* sample_weights / residual_sample of a row of fewer than 64 leaves: the drawn
 * index, -1 if the weights have no mass. */
static int64_t draw_small(const vrow_t *r, size_t n, double total, const vq_t *q, uint64_t u53) {
    int depth;
    size_t size = tree_size(n, &depth);
    double lv[128];
    weights_block(r, n, 0, total, q, lv);
    block_levels(lv, size);
    double root = lv[2 * size - 2];
    if (!(root > 0.0)) return -1;
    return (int64_t)block_descend(lv, size, ((double)u53 / 9007199254740992.0) * root);
}

/* The same for a row of blocks of 64 leaves once up holds every block's root:
 * down the blocks' tree to one block, then inside it. */
static int64_t draw_blocks(const vrow_t *r, size_t n, double total, const vq_t *q, uint64_t u53,
                           double *up, size_t blocks) {
    block_levels(up, blocks);
    double root = up[2 * blocks - 2];
    if (!(root > 0.0)) return -1;
    double t = ((double)u53 / 9007199254740992.0) * root;
    size_t index = descend(up, blocks, &t);
    double lv[128];
    weights_block(r, n, index << 6, total, q, lv);
    block_levels(lv, 64);
    return (int64_t)((index << 6) + block_descend(lv, 64, t));
}

/* The buffer's element kind, from its format and item size. */
static int buffer_kind(const Py_buffer *b) {
    const char *f = b->format == NULL ? "B" : b->format;
    while (*f == '@' || *f == '=' || *f == '<') f++;
    if (f[0] == '\0' || f[1] != '\0') return K_NONE;
    switch (f[0]) {
    case 'd': return b->itemsize == 8 ? K_F64 : K_NONE;
    case 'f': return b->itemsize == 4 ? K_F32 : K_NONE;
    case 'i': case 'l': case 'q':
        return b->itemsize == 4 ? K_I32 : b->itemsize == 8 ? K_I64 : K_NONE;
    default: return K_NONE;
    }
}

/* A contiguous buffer of obj into views[*used]; its kind, or -1 with an exception set. */
static int take_buffer(PyObject *obj, Py_buffer *views, int *used, const void **ptr,
                       Py_ssize_t *count) {
    Py_buffer *b = &views[*used];
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    (*used)++;
    int kind = buffer_kind(b);
    if (kind == K_NONE || b->ndim != 1) {
        PyErr_SetString(PyExc_TypeError, "unsupported buffer");
        return -1;
    }
    *ptr = b->buf;
    *count = b->shape[0];
    return kind;
}

/* One row's buffer into views[*used]: float32 or float64, not empty. */
static int one_row(PyObject *obj, Py_buffer *views, int *used, vrow_t *row, size_t *n) {
    Py_ssize_t len;
    int kind = take_buffer(obj, views, used, &row->p, &len);
    if (kind < 0) return -1;
    if ((kind != K_F32 && kind != K_F64) || len < 1) {
        PyErr_SetString(PyExc_TypeError, "a row is float32 or float64, not empty");
        return -1;
    }
    row->kind = kind;
    *n = (size_t)len;
    return 0;
}

/* Items handed out one at a time from a shared counter, so threads that get short
 * ones take more of them. Each item writes only its own outputs. */
typedef struct {
    void (*run)(void *items, Py_ssize_t j);
    void *items;
    Py_ssize_t count;
    Py_ssize_t next; /* atomic */
} vwork_t;

static void *run_items(void *arg) {
    vwork_t *work = (vwork_t *)arg;
    for (;;) {
        Py_ssize_t j = __atomic_fetch_add(&work->next, 1, __ATOMIC_RELAXED);
        if (j >= work->count) break;
        work->run(work->items, j);
    }
    return NULL;
}

#define V_MAX_THREADS 16

#if !defined(_WIN32)
/* Helper threads, started once and kept: a call publishes its items and works on them itself, and
 * waits only for the helpers that joined it (each busy with an item), never for one that was not
 * yet scheduled. On a shared machine a call that waited for every helper to start and end would pay
 * a scheduler slice per call, and the walk makes several calls a step. */
static pthread_mutex_t pool_use = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* guards what follows */
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_idle = PTHREAD_COND_INITIALIZER;
static vwork_t *pool_job;  /* the open call's items, or NULL */
static unsigned long pool_gen;
static int pool_size, pool_active, pool_wanted;

static void *pool_main(void *arg) {
    (void)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&pool_lock);
    for (;;) {
        while (pool_job == NULL || pool_gen == seen || pool_active >= pool_wanted)
            pthread_cond_wait(&pool_wake, &pool_lock);
        seen = pool_gen;
        vwork_t *work = pool_job;
        pool_active++;
        pthread_mutex_unlock(&pool_lock);
        run_items(work);
        pthread_mutex_lock(&pool_lock);
        if (--pool_active == 0) pthread_cond_signal(&pool_idle);
    }
    return NULL;
}

/* A forked child has none of the helpers, and may have copied a lock held. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool_use, NULL);
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pthread_cond_init(&pool_idle, NULL);
    pool_job = NULL;
    pool_size = pool_active = pool_wanted = 0;
}
#endif

static void run_all(void (*run)(void *, Py_ssize_t), void *items, Py_ssize_t k, int threads) {
    vwork_t work = {run, items, k, 0};
    if (threads > V_MAX_THREADS) threads = V_MAX_THREADS;
    if (threads > k) threads = (int)k;
#if defined(_WIN32)
    (void)threads;
    run_items(&work);
#else
    /* Another thread's call holds the helpers: this one runs alone. */
    if (threads <= 1 || pthread_mutex_trylock(&pool_use) != 0) {
        run_items(&work);
        return;
    }
    static int registered = 0;
    pthread_mutex_lock(&pool_lock);
    if (!registered) registered = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (registered && pool_size < threads - 1) {
        pthread_t helper;
        if (pthread_create(&helper, NULL, pool_main, NULL) != 0) break;
        pthread_detach(helper);
        pool_size++; /* a helper that could not start leaves its items to the others */
    }
    pool_job = &work;
    pool_gen++;
    pool_wanted = threads - 1;
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    run_items(&work);
    pthread_mutex_lock(&pool_lock);
    pool_job = NULL; /* a helper not in by now stays out */
    while (pool_active > 0) pthread_cond_wait(&pool_idle, &pool_lock);
    pthread_mutex_unlock(&pool_lock);
    pthread_mutex_unlock(&pool_use);
#endif
}

/* Each call shares its rows out as pieces: with threads > 1 a row of at least two
 * 64-leaf blocks splits into up to `pieces` aligned subtrees of its canonical
 * tree, whose roots are nodes of that tree (a row's total is then their sums, in
 * the tree's order): the threads stay busy however few rows a call has. */
static size_t pieces_for(int threads) {
    size_t p = 1;
    while (threads > 1 && p < (size_t)threads) p <<= 1;
    return p;
}

static size_t blocks_of(size_t n) {
    int depth;
    size_t size = tree_size(n, &depth);
    return depth < 6 ? 0 : size >> 6;
}

typedef struct {
    vrow_t row;
    size_t n, blocks, pieces, first; /* blocks == 0: a row under 64 leaves, one piece */
} vcheck_t;

typedef struct {
    const vcheck_t *row;
    size_t first, count; /* blocks of this piece */
    double root;
    int bad;
} vpiece_t;

static void check_piece(void *items, Py_ssize_t j) {
    vpiece_t *p = (vpiece_t *)items + j;
    p->bad = 0;
    if (p->row->blocks == 0) p->root = row_total(&p->row->row, p->row->n, &p->bad);
    else p->root = blocks_total(&p->row->row, p->row->n, p->first, p->count, &p->bad);
}

/* Lay out each row's pieces; returns how many there are in all. */
static size_t split_rows(vcheck_t *rows, Py_ssize_t k, size_t pieces) {
    size_t total = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        vcheck_t *c = &rows[j];
        c->blocks = c->row.kind == K_NONE ? 0 : blocks_of(c->n);
        c->pieces = c->row.kind == K_NONE ? 0 : 1;
        while (c->blocks && c->pieces < pieces && c->pieces < c->blocks) c->pieces <<= 1;
        c->first = total;
        total += c->pieces;
    }
    return total;
}

static void fill_pieces(const vcheck_t *rows, Py_ssize_t k, vpiece_t *out) {
    for (Py_ssize_t j = 0; j < k; j++) {
        const vcheck_t *c = &rows[j];
        size_t each = c->blocks && c->pieces ? c->blocks / c->pieces : 0;
        for (size_t i = 0; i < c->pieces; i++) {
            vpiece_t *p = &out[c->first + i];
            p->row = c;
            p->first = i * each;
            p->count = each;
        }
    }
}

/* A list of k entries from totals: each a float where ok, else None. */
static PyObject *totals_list(const double *totals, const int *ok, Py_ssize_t k) {
    PyObject *out = PyList_New(k);
    for (Py_ssize_t j = 0; out != NULL && j < k; j++) {
        PyObject *v = ok[j] ? PyFloat_FromDouble(totals[j]) : Py_NewRef(Py_None);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, j, v);
    }
    return out;
}

/* Each row (float32 or float64, contiguous; None: unreadable) in one pass: its canonical
 * total if it is a distribution (nothing below zero, a finite positive total), else None. */
static PyObject *row_checks(PyObject *self, PyObject *args) {
    PyObject *rows;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O!|i", &PyList_Type, &rows, &threads)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(rows);
    size_t slots = k ? (size_t)k : 1;
    vcheck_t *items = (vcheck_t *)calloc(slots, sizeof(vcheck_t));
    Py_buffer *views = (Py_buffer *)calloc(slots, sizeof(Py_buffer));
    double *totals = (double *)calloc(slots, sizeof(double));
    int *ok = (int *)calloc(slots, sizeof(int));
    vpiece_t *pieces = NULL;
    int used = 0, failed = items == NULL || views == NULL || totals == NULL || ok == NULL;
    for (Py_ssize_t j = 0; j < k && !failed; j++) {
        PyObject *r = PyList_GET_ITEM(rows, j);
        if (r == Py_None) continue; /* kind stays K_NONE */
        failed = one_row(r, views, &used, &items[j].row, &items[j].n) < 0;
    }
    size_t count = failed ? 0 : split_rows(items, k, pieces_for(threads));
    if (!failed) {
        pieces = (vpiece_t *)calloc(count ? count : 1, sizeof(vpiece_t));
        failed = pieces == NULL;
    }
    if (failed && !PyErr_Occurred()) PyErr_NoMemory();
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        fill_pieces(items, k, pieces);
        run_all(check_piece, pieces, (Py_ssize_t)count, threads);
        for (Py_ssize_t j = 0; j < k; j++) {
            vcheck_t *c = &items[j];
            if (c->pieces == 0) continue; /* an unreadable row: not ok */
            vpiece_t *p = &pieces[c->first];
            int bad = 0;
            for (size_t i = 0; i < c->pieces; i++) bad |= p[i].bad;
            for (size_t w = c->pieces; w > 1; w >>= 1) /* the tree above the pieces */
                for (size_t i = 0; i < w / 2; i++) p[i].root = p[2 * i].root + p[2 * i + 1].root;
            totals[j] = p[0].root;
            ok[j] = !bad && isfinite(p[0].root) && p[0].root > 0.0;
        }
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < used; i++) PyBuffer_Release(&views[i]);
    PyObject *out = failed ? NULL : totals_list(totals, ok, k);
    free(pieces);
    free(views);
    free(items);
    free(totals);
    free(ok);
    return out;
}

typedef struct {
    vcheck_t shape; /* the row, and its pieces */
    double total;
    vq_t q;
    int has_q, bad_q;
    uint64_t u53;
    double *up; /* the block roots, then the levels above them */
    int64_t *out;
} vdraw_t;

typedef struct {
    vdraw_t *draw;
    size_t first, count;
} vdpiece_t;

static void draw_piece(void *items, Py_ssize_t j) {
    vdpiece_t *p = (vdpiece_t *)items + j;
    vdraw_t *d = p->draw;
    const vq_t *q = d->has_q ? &d->q : NULL;
    if (d->shape.blocks == 0) *d->out = draw_small(&d->shape.row, d->shape.n, d->total, q, d->u53);
    else weights_roots(&d->shape.row, d->shape.n, d->total, q, d->up, p->first, p->count);
}

/* One draw's q: its buffers into views, and whether its ids are ascending inside the row. */
static int parse_q(PyObject *qobj, PyObject *idobj, vdraw_t *d, Py_buffer *views, int *used) {
    Py_ssize_t nq;
    vq_t *q = &d->q;
    q->kind = take_buffer(qobj, views, used, &q->q, &nq);
    if (q->kind < 0) return -1;
    if (q->kind == K_F64) {
        PyErr_SetString(PyExc_TypeError, "draw_rows: q is float32 values or int counts");
        return -1;
    }
    d->has_q = 1;
    if (idobj == Py_None) {
        if ((size_t)nq < d->shape.n) {
            PyErr_SetString(PyExc_ValueError, "draw_rows: dense q shorter than its row");
            return -1;
        }
        return 0;
    }
    Py_ssize_t nid;
    const void *idp;
    if (take_buffer(idobj, views, used, &idp, &nid) != K_I32 || nid != nq) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "draw_rows: ids are int32, one per q");
        return -1;
    }
    q->ids = (const int32_t *)idp;
    q->nids = (size_t)nid;
    for (Py_ssize_t j = 0; j < nid; j++) {
        int32_t id = q->ids[j];
        if (id < 0 || (size_t)id >= d->shape.n || (j && id <= q->ids[j - 1])) d->bad_q = 1;
    }
    return 0;
}

/* Each draw (row, total, q or None, ids or None, u53) of a checked row, from
 * max(row / total - q, 0) with q (float32 values or int counts, dense or sparse), from
 * row / total without: the index, -1 without mass, -2 out of memory, -3 sparse ids that
 * do not ascend inside the row (the caller draws those its own way). */
static PyObject *draw_rows(PyObject *self, PyObject *args) {
    PyObject *draws;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O!|i", &PyList_Type, &draws, &threads)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(draws);
    vdraw_t *items = (vdraw_t *)calloc(k ? (size_t)k : 1, sizeof(vdraw_t));
    Py_buffer *views = (Py_buffer *)calloc(k ? (size_t)k * 3 : 1, sizeof(Py_buffer));
    int64_t *drawn = (int64_t *)calloc(k ? (size_t)k : 1, sizeof(int64_t));
    vdpiece_t *pieces = NULL;
    int used = 0, failed = items == NULL || views == NULL || drawn == NULL;
    if (failed) PyErr_NoMemory();
    for (Py_ssize_t j = 0; j < k && !failed; j++) {
        vdraw_t *d = &items[j];
        d->out = drawn + j;
        PyObject *row, *qobj, *idobj;
        unsigned long long u53;
        failed = !PyArg_ParseTuple(PyList_GET_ITEM(draws, j), "OdOOK", &row, &d->total, &qobj,
                                   &idobj, &u53);
        if (failed) break;
        d->u53 = (uint64_t)u53;
        failed = one_row(row, views, &used, &d->shape.row, &d->shape.n) < 0 ||
                 (qobj != Py_None && parse_q(qobj, idobj, d, views, &used) < 0);
    }
    size_t count = 0;
    if (!failed) {
        size_t split = pieces_for(threads);
        for (Py_ssize_t j = 0; j < k; j++) {
            vdraw_t *d = &items[j];
            vcheck_t *c = &d->shape;
            c->blocks = blocks_of(c->n);
            c->pieces = 1;
            if (d->bad_q) {
                *d->out = -3;
                c->pieces = 0;
            } else if (c->blocks) {
                d->up = (double *)malloc(2 * c->blocks * sizeof(double));
                if (d->up == NULL) {
                    *d->out = -2;
                    c->pieces = 0;
                }
                while (d->up && c->pieces < split && c->pieces < c->blocks) c->pieces <<= 1;
            }
            c->first = count;
            count += c->pieces;
        }
        pieces = (vdpiece_t *)calloc(count ? count : 1, sizeof(vdpiece_t));
        failed = pieces == NULL;
        if (failed) PyErr_NoMemory();
    }
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < k; j++) {
            vcheck_t *c = &items[j].shape;
            size_t each = c->blocks && c->pieces ? c->blocks / c->pieces : 0;
            for (size_t i = 0; i < c->pieces; i++)
                pieces[c->first + i] = (vdpiece_t){&items[j], i * each, each};
        }
        run_all(draw_piece, pieces, (Py_ssize_t)count, threads);
        for (Py_ssize_t j = 0; j < k; j++) {
            vdraw_t *d = &items[j];
            if (d->up != NULL)
                *d->out = draw_blocks(&d->shape.row, d->shape.n, d->total,
                                      d->has_q ? &d->q : NULL, d->u53, d->up, d->shape.blocks);
        }
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t j = 0; items != NULL && j < k; j++) free(items[j].up);
    for (int i = 0; i < used; i++) PyBuffer_Release(&views[i]);
    PyObject *out = failed ? NULL : PyList_New(k);
    for (Py_ssize_t j = 0; out != NULL && j < k; j++) {
        PyObject *v = PyLong_FromLongLong(drawn[j]);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, j, v);
    }
    free(drawn);
    free(pieces);
    free(views);
    free(items);
    return out;
}

/* ---------------------------------------------------------------------------
 * q construction: weights (float32 or float64) to dyadic24 counts in q, n 32-bit words
 * (int32 counts, or for a row that travels their FP32 wire values, q being the outgoing
 * buffer), and the proposal draw. allocate_row is dyadic.allocate_with for one row, its
 * pieces fused into the passes the row needs anyway:
 *
 *   floors     floors_pass: each share's floor into q and its remainder's 12-bit key
 *              floor(r * 2**12) (keys order like the remainders), the keys' histogram
 *              and the floors' sum. The share is one multiplication by (W / M)'s
 *              reciprocal, within 2**-15.4 key units of the quotient for shares up to
 *              M; a chunk of 64 with a product within 2**-14 of a key boundary is done
 *              again by division, so every floor and key is the quotient's.
 *   threshold  the key bucket holding the left-th largest remainder, from the
 *              histogram (bucket_threshold; with AVX-512 from a sampled histogram and
 *              one vector pass, bracket_threshold, the same bucket either way), then
 *              the exact remainder among that bucket's (kth_remainder).
 *   above      every key above the bucket, and the bucket's remainders above it.
 *   assign     the bucket's tickets at once (bucket_tickets), the keys above it in the
 *              last pass (assign_and_draw), which also sums the counts.
 *
 * The draw (dyadic.sample) rides on that last pass in time that does not depend on the
 * index drawn (docs/adaptive.md §7): each chunk of CHUNK counts is copied aside under a
 * mask made from the running total (draw_mask), never by a branch or an address that
 * depends on u, so the copy left is the chunk that holds u (draw_index). Only draw_start,
 * draw_mask and draw_index read u; the mask is used only in and-masks.
 * ------------------------------------------------------------------------- */

#define TOP_BITS 12
#define TOP_SCALE 4096.0 /* 2**TOP_BITS */
#define TOP_MASK 4095u
#define NEAR_KEY 0x1p-14
/* The sampled key histogram of bracket_threshold: one 64-weight chunk in this many. */
#define SAMPLE_EVERY 8
/* Up to this many candidates of the threshold's bucket are ordered by insertion. */
#define FEW 64
#define CHUNK 128
/* Rows at least this long count their keys into two histograms (histogram64). */
#define TWIN_MIN 4096

static inline uint64_t bits_of(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* The share of a weight (dyadic.floors_and_remainders): w / scale, or
 * (w / total) * M when total / M is subnormal. */
static inline double share_of(double w, double total, double scale, int small) {
    return small ? (w / total) * M24 : w / scale;
}

/* A weight of a row of float64 or float32 values, as binary64 (exact). */
static inline double weight_at(const void *w, int f32, size_t i) {
    return f32 ? (double)((const float *)w)[i] : ((const double *)w)[i];
}

/* The floor of a share v into *out and its remainder's key into *key. */
static inline int32_t floor_key(double v, int32_t *restrict out, uint16_t *restrict key) {
    /* v >= 0: truncation is the floor. A share beyond int32 (only from a total that does not match
     * the weights) converts as numpy's cast does, and the ticket count then refuses the row. */
    int32_t f = (int32_t)v;
    double r = v - (double)f;
    *out = f;
    /* exact: r in [0, 1), a power-of-two scale; the mask guards memory
     * against such an inconsistent total */
    *key = (uint16_t)((uint32_t)(int32_t)(r * TOP_SCALE) & TOP_MASK);
    return f;
}

static void histogram(const uint16_t *restrict key, size_t n, uint32_t *restrict hist) {
    for (size_t i = 0; i < n; i++) hist[key[i]]++;
}

/* The keys of a chunk of 64 counted into two histograms, even and odd entries: runs of
 * equal keys (remainders cluster) then wait on half as many increments of one count. */
static inline void histogram64(const uint16_t *restrict key, uint32_t *restrict even,
                               uint32_t *restrict odd) {
    for (int i = 0; i < 64; i += 2) {
        even[key[i]]++;
        odd[key[i + 1]]++;
    }
}

/* The floors pass over 64 weights by multiplication: the floors into q,
 * the keys, the floors' sum into *sum; nonzero if some product lies within NEAR_KEY of
 * a key boundary (other than the boundary at 0, which no share crosses). */
#define FAST64(NAME, WT)                                                                   \
    MULTIVERSION512                                                                        \
    static int NAME(const WT *restrict w, double inv, int32_t *restrict q,                 \
                    uint16_t *restrict key, int64_t *restrict sum) {                       \
        int64_t acc = 0;                                                                   \
        int near = 0;                                                                      \
        for (int i = 0; i < 64; i++) {                                                     \
            double s = (double)w[i] * inv;                                                 \
            int32_t c = (int32_t)s;                                                        \
            double t = (s - (double)c) * TOP_SCALE;                                        \
            int32_t k = (int32_t)t;                                                        \
            double f = t - (double)k;                                                      \
            near |= (f > 1.0 - NEAR_KEY) | ((f < NEAR_KEY) & ((c | k) != 0));             \
            q[i] = c;                                                                      \
            key[i] = (uint16_t)((uint32_t)k & TOP_MASK);                                   \
            acc += c;                                                                      \
        }                                                                                  \
        *sum = acc;                                                                        \
        return near;                                                                       \
    }
FAST64(fast64_f64, double)
FAST64(fast64_f32, float)
#undef FAST64

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
/* The same values where the CPU converts binary64 to and from int64 in vectors
 * (AVX-512 DQ): floor(T) for T = s * 2**12 in one conversion (T < 2**37), its
 * floor and key by shift and mask, the distance f = T - floor(T) exactly as
 * above (T - floor(T) is exact, Sterbenz). Chosen at run time. */
#define FAST64_Q(NAME, WT)                                                                 \
    __attribute__((target("arch=x86-64-v4"))) static int NAME(                             \
        const WT *restrict w, double inv, int32_t *restrict q, uint16_t *restrict key,     \
        int64_t *restrict sum) {                                                           \
        int64_t acc = 0, near = 0;                                                         \
        for (int i = 0; i < 64; i++) {                                                     \
            double t = ((double)w[i] * inv) * TOP_SCALE;                                   \
            int64_t whole = (int64_t)t;                                                    \
            double f = t - (double)whole;                                                  \
            int64_t c = whole >> TOP_BITS;                                                 \
            near |= (int64_t)((f > 1.0 - NEAR_KEY) | ((f < NEAR_KEY) & (whole != 0)));     \
            q[i] = (int32_t)c;                                                             \
            key[i] = (uint16_t)(whole & TOP_MASK);                                         \
            acc += c;                                                                      \
        }                                                                                  \
        *sum = acc;                                                                        \
        return near != 0;                                                                  \
    }
FAST64_Q(fast64q_f64, double)
FAST64_Q(fast64q_f32, float)
#undef FAST64_Q
#define HAVE_FAST64_Q 1

static int have_dq = -1;

static int use_fast64_q(void) {
    if (have_dq < 0) {
        __builtin_cpu_init();
        /* what target("arch=x86-64-v4") compiles for */
        have_dq = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                  && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq")
                  && __builtin_cpu_supports("avx512vl");
    }
    return have_dq;
}
#else
static int have_dq = 0; /* no AVX-512 path in this build */
static int use_fast64_q(void) { return 0; }
#endif

/* The floors pass by division (floor_key) over [lo, lo + len). */
static int64_t floors_exact(const void *w, int f32, size_t lo, size_t len, double total,
                            double scale, int small, int32_t *restrict q,
                            uint16_t *restrict key) {
    int64_t sum = 0;
    for (size_t i = lo; i < lo + len; i++)
        sum += floor_key(share_of(weight_at(w, f32, i), total, scale, small), &q[i], &key[i]);
    return sum;
}

/* The floors pass over the 64 weights from i by multiplication (FAST64, FAST64_Q
 * where the CPU has AVX-512): nonzero if they must be done again by division. */
static inline int multiply64(const void *w, int f32, size_t i, double inv, int32_t *q,
                             uint16_t *key, int64_t *part) {
#ifdef HAVE_FAST64_Q
    if (use_fast64_q())
        return f32 ? fast64q_f32((const float *)w + i, inv, q + i, key + i, part)
                   : fast64q_f64((const double *)w + i, inv, q + i, key + i, part);
#endif
    return f32 ? fast64_f32((const float *)w + i, inv, q + i, key + i, part)
               : fast64_f64((const double *)w + i, inv, q + i, key + i, part);
}

/* The floors pass over 64 float64 weights by division (as floor_key), vectorized:
 * where division is fast, it beats the multiplication and its check. */
MULTIVERSION
static int64_t divide64(const double *restrict w, double scale, int32_t *restrict q,
                        uint16_t *restrict key) {
    int64_t sum = 0;
    for (int i = 0; i < 64; i++) {
        double v = w[i] / scale;
        int32_t c = (int32_t)v;
        q[i] = c;
        key[i] = (uint16_t)((uint32_t)(int32_t)((v - (double)c) * TOP_SCALE) & TOP_MASK);
        sum += c;
    }
    return sum;
}

/* floors: the pass over the row (see above), by division for float64 weights with divide; the
 * floors' sum. With sampled, the histogram counts one chunk in SAMPLE_EVERY (bracket_threshold). */
static int64_t floors_pass(const void *w, int f32, size_t n, double total, double scale,
                           int small, int divide, int32_t *q, uint16_t *key, uint32_t *hist,
                           int sampled) {
    double inv = 1.0 / scale;
    int64_t sum = 0;
    /* The second histogram pays for its zeroing and merging from rows of TWIN_MIN. */
    int twin = n >= TWIN_MIN;
    uint32_t odd[1 << TOP_BITS];
    if (twin) memset(odd, 0, sizeof odd);
    size_t i = 0;
    for (; !small && i + 64 <= n; i += 64) {
        int64_t part;
        if (divide && !f32) {
            part = divide64((const double *)w + i, scale, q + i, key + i);
        } else if (multiply64(w, f32, i, inv, q, key, &part)) {
            part = floors_exact(w, f32, i, 64, total, scale, small, q, key);
        }
        sum += part;
        /* Counted chunk by chunk: the scalar counting overlaps the next chunk's vector work. */
        if (sampled && (i / 64) % SAMPLE_EVERY != 0) continue;
        if (twin) histogram64(key + i, hist, odd);
        else histogram(key + i, 64, hist);
    }
    if (twin)
        for (size_t k = 0; k <= TOP_MASK; k++) hist[k] += odd[k];
    if (i < n) {
        sum += floors_exact(w, f32, i, n - i, total, scale, small, q, key);
        if (!sampled) histogram(key + i, n - i, hist);
    }
    return sum;
}

/* Scratch of one row: the threshold bucket's remainders, the keys, the bucket's indices. */
typedef struct {
    double *rem;
    uint16_t *key;
    uint32_t *idx;
} scratch_t;

/* Lay out a row's key and idx scratch in `work` (at least 6 n + 4 bytes, n + 16
 * indices); rem (8 bytes per entry) holds the bucket's remainders. */
static void scratch_in(scratch_t *s, double *rem, void *work, size_t n) {
    s->rem = rem;
    s->key = (uint16_t *)work;
    s->idx = (uint32_t *)((char *)work + ((2 * n + 3) & ~(size_t)3));
}

/* The threshold's bucket: `top`, every key above it (`above_keys` of them), the
 * bucket's `count` entries in s->idx (ascending), and `need`, the rank of the
 * threshold among them (1-based, from the largest). */
typedef struct {
    uint32_t top;
    size_t above_keys, count, need;
} bucket_t;

/* Whether any of 64 keys equals top (vectorized: the scan below skips most chunks). */
MULTIVERSION
static int any_equal(const uint16_t *restrict key, uint32_t top) {
    int any = 0;
    for (int j = 0; j < 64; j++) any |= key[j] == top;
    return any;
}

/* The indices of the keys equal to top, ascending, into idx; returns how many. */
static size_t gather_equal(const uint16_t *restrict key, size_t n, uint32_t top,
                           uint32_t *restrict idx) {
    size_t count = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        if (!any_equal(key + i, top)) continue;
        for (size_t j = i; j < i + 64; j++) {
            idx[count] = (uint32_t)j;
            count += key[j] == top;
        }
    }
    for (; i < n; i++) {
        idx[count] = (uint32_t)i;
        count += key[i] == top;
    }
    return count;
}

/* threshold, its bucket from the full histogram of the n keys. */
static void bucket_threshold(const scratch_t *s, size_t n, size_t left, const uint32_t *hist,
                             bucket_t *b) {
    size_t acc = 0;
    uint32_t top = TOP_MASK;
    for (;; top--) {
        if (acc + hist[top] >= left) break;
        acc += hist[top];
    }
    b->top = top;
    b->above_keys = acc;
    b->need = left - acc;
    b->count = gather_equal(s->key, n, top, s->idx);
}

/* Non-negative doubles order as their bit patterns: six digits of those patterns
 * find a rank exactly. */
static const int SHIFTS[6] = {52, 40, 28, 16, 4, 0};
static const int WIDTHS[6] = {12, 12, 12, 12, 12, 4};

/* threshold, exactly: the need-th largest (1-based) of rem[0 .. count), by insertion
 * for a few, else by a radix select over their bit patterns (rem is left as it is). */
__attribute__((noinline)) static double kth_remainder(const double *rem, size_t count,
                                                     size_t need) {
    uint64_t prefix = 0;
    if (count <= FEW) {
        uint64_t sorted[FEW];
        for (size_t c = 0; c < count; c++) {
            uint64_t b = bits_of(rem[c]);
            size_t j = c;
            for (; j > 0 && sorted[j - 1] < b; j--) sorted[j] = sorted[j - 1];
            sorted[j] = b;
        }
        prefix = sorted[need - 1];
    } else {
        uint64_t decided = 0; /* the bits of prefix fixed so far */
        uint32_t hist[4096];
        for (int pass = 0; pass < 6; pass++) {
            int shift = SHIFTS[pass];
            uint64_t mask = ((uint64_t)1 << WIDTHS[pass]) - 1;
            memset(hist, 0, (size_t)(mask + 1) * sizeof(uint32_t));
            for (size_t c = 0; c < count; c++) {
                uint64_t b = bits_of(rem[c]);
                if ((b & decided) == prefix) hist[(b >> shift) & mask]++;
            }
            size_t above = 0;
            uint64_t d = mask;
            for (;; d--) {
                if (above + hist[d] >= need) break;
                above += hist[d];
            }
            need -= above;
            prefix |= d << shift;
            decided |= mask << shift;
        }
    }
    double v;
    memcpy(&v, &prefix, sizeof v);
    return v;
}

/* The bucket's remainders into s->rem, as the floors pass had them; + 0.0 makes the remainder of a
 * -0.0 weight +0.0, which orders below every positive one (its bits would not). */
static void bucket_remainders(const void *w, int f32, double total, double scale, int small,
                              const scratch_t *s, size_t count) {
    for (size_t c = 0; c < count; c++) {
        double v = share_of(weight_at(w, f32, s->idx[c]), total, scale, small);
        s->rem[c] = (v - (double)(int32_t)v) + 0.0;
    }
}

/* assign, in the threshold's bucket: a ticket for each remainder above the threshold,
 * and for the first `ties` equal to it (the indices ascend). */
static void bucket_tickets(const scratch_t *s, size_t count, double threshold, size_t ties,
                           int32_t *q) {
    for (size_t c = 0; c < count; c++) {
        double r = s->rem[c];
        if (r > threshold) {
            q[s->idx[c]]++;
        } else if (r == threshold && ties > 0) {
            q[s->idx[c]]++;
            ties--;
        }
    }
}

#ifdef HAVE_FAST64_Q
#include <immintrin.h>

/* Rows at least this long take the sampled bracket (bracket_threshold). */
#define BRACKET_MIN 4096

/* A factor on the sampled rank the bracket is centred on: 1, but tests move it so
 * that the bracket misses, and qualify the way back. */
static double bracket_factor = 1.0;

/* Over every key: how many are above hi (into *given), and the indices of those in
 * [lo, hi] appended to idx in ascending order (idx holds n + 16); returns how many. */
__attribute__((target("arch=x86-64-v4"))) static size_t bracket_pass(
    const uint16_t *key, size_t n, uint32_t lo, uint32_t hi, uint32_t *idx, size_t *given) {
    const __m512i vlo = _mm512_set1_epi32((int)lo), vhi = _mm512_set1_epi32((int)hi);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    size_t count = 0, above = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i k = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(key + i)));
        __mmask16 gt = _mm512_cmpgt_epu32_mask(k, vhi);
        __mmask16 in = _mm512_mask_cmpge_epu32_mask((__mmask16)~gt, k, vlo);
        above += (size_t)__builtin_popcount(gt);
        __m512i ids = _mm512_add_epi32(_mm512_set1_epi32((int)i), iota);
        _mm512_storeu_si512((void *)(idx + count), _mm512_maskz_compress_epi32(in, ids));
        count += (size_t)__builtin_popcount(in);
    }
    for (; i < n; i++) {
        uint32_t k = key[i];
        if (k > hi) above++;
        else if (k >= lo) idx[count++] = (uint32_t)i;
    }
    *given = above;
    return count;
}

/* threshold, its bucket from a sampled histogram (one chunk in SAMPLE_EVERY): the
 * sample brackets the bucket of the left-th largest remainder, [lo, hi], six
 * standard deviations of its rank and some either side; one vector pass counts the
 * keys above the bracket and gathers those inside it, which are counted exactly.
 * Returns 0 with *b as bucket_threshold gives it, or -1 if the bracket missed. */
static int bracket_threshold(const scratch_t *s, size_t n, size_t left, const uint32_t *sample,
                             bucket_t *b) {
    size_t sampled = 0;
    for (size_t k = 0; k <= TOP_MASK; k++) sampled += sample[k];
    if (sampled == 0) return -1;
    /* left's rank in the sample (times bracket_factor: 1 but in tests) */
    double rank = bracket_factor * (double)left * (double)sampled / (double)n;
    double margin = 6.0 * sqrt(rank) + 16.0;
    double want_hi = rank - margin, want_lo = rank + margin;
    uint32_t hi = TOP_MASK, lo = 0;
    double acc = 0.0;
    int found_hi = 0;
    for (int k = (int)TOP_MASK; k >= 0; k--) {
        acc += sample[k];
        if (!found_hi && acc > want_hi) {
            hi = (uint32_t)k;
            found_hi = 1;
        }
        if (acc >= want_lo) {
            lo = (uint32_t)k;
            break;
        }
    }
    size_t given = 0;
    size_t count = bracket_pass(s->key, n, lo, hi, s->idx, &given);
    if (!(given < left && left <= given + count)) return -1;
    uint32_t hist[1 << TOP_BITS];
    memset(hist + lo, 0, (hi - lo + 1) * sizeof(uint32_t));
    for (size_t c = 0; c < count; c++) hist[s->key[s->idx[c]]]++;
    size_t above = given;
    uint32_t top = hi;
    for (;; top--) {
        if (above + hist[top] >= left) break;
        above += hist[top];
    }
    size_t kept = 0;
    for (size_t c = 0; c < count; c++) { /* the bucket's own, in index order */
        uint32_t i = s->idx[c];
        s->idx[kept] = i;
        kept += s->key[i] == top;
    }
    b->top = top;
    b->above_keys = above;
    b->need = left - above;
    b->count = kept;
    return 0;
}
#endif

/* The proposal draw's state over the chunks of a row (see the section's head). */
typedef struct {
    int64_t u, acc, base, starts;
    int32_t sel[CHUNK];
} draw_t;

static inline void draw_start(draw_t *d, int64_t u) {
    d->u = u;
    d->acc = d->base = d->starts = 0;
    memset(d->sel, 0, sizeof d->sel);
}

/* The next chunk's mask: all ones when the running total before it is at most u, and then that
 * total kept in base. The last chunk that starts at or below u holds the draw (the next starts
 * above it), so sel, overwritten under the mask, ends holding that chunk's counts. */
static inline int32_t draw_mask(draw_t *d) {
    int64_t in = (int64_t)(d->acc <= d->u);
    d->base ^= (d->base ^ d->acc) & -in;
    d->starts += in;
    return -(int32_t)in;
}

/* The drawn index: the number of cumulative counts at most u (every chunk before the
 * one kept, and those of the kept one). */
static inline int64_t draw_index(const draw_t *d) {
    int64_t c = d->base, within = 0;
    for (int j = 0; j < CHUNK; j++) {
        c += d->sel[j];
        within += (int64_t)(c <= d->u);
    }
    return (d->starts - 1) * CHUNK + within;
}

/* The running total after a chunk of counts summing to sum (wrapping, as numpy's
 * cumulative sum does, for counts no valid row has). */
static inline void draw_add(draw_t *d, int64_t sum) {
    d->acc = (int64_t)((uint64_t)d->acc + (uint64_t)sum);
}

/* The FP32 wire value c / 2**24 of a count c (exact for c <= 2**24), as its bits. */
static inline uint32_t wire_bits(int32_t c) {
    float v = (float)c * 0x1p-24f;
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

/* assign over one chunk of len <= CHUNK counts q (int32 bits): a ticket for each key above top, and
 * with fp32 the counts' wire values left over them; with sel, each count kept there under the mask
 * m (zeros past len). Their sum, in 32 bits (they vectorize so), exact: the counts of a row whose
 * floors fit (no share beyond int32) sum to M. */
static inline uint32_t assign_chunk(const uint16_t *restrict key, uint32_t top,
                                    uint32_t *restrict q, int fp32, int32_t *restrict sel,
                                    int32_t m, size_t len) {
    uint32_t sum = 0;
    for (size_t j = 0; j < len; j++) {
        int32_t c = (int32_t)q[j] + (int32_t)(key[j] > top);
        q[j] = fp32 ? wire_bits(c) : (uint32_t)c;
        if (sel != NULL) sel[j] = (sel[j] & ~m) | (c & m);
        sum += (uint32_t)c;
    }
    if (sel != NULL)
        for (size_t j = len; j < CHUNK; j++) sel[j] &= ~m;
    return sum;
}

/* assign, the keys above the threshold's bucket (top; TOP_MASK: none), over the whole
 * row of counts q: their tickets, and the counts' sum (returned); with fp32 the counts
 * are left as their wire values; with draw, the draw with u into *token. Each form of
 * the chunk loop is written out so that it vectorizes. */
MULTIVERSION512
static int64_t assign_and_draw(const uint16_t *restrict key, size_t n, uint32_t top,
                               uint32_t *restrict q, int fp32, int draw, int64_t u,
                               int64_t *token) {
    draw_t d;
    draw_start(&d, u);
    for (size_t lo = 0; lo < n; lo += CHUNK) {
        size_t len = n - lo < CHUNK ? n - lo : CHUNK;
        const uint16_t *k = key + lo;
        uint32_t *c = q + lo;
        int64_t sum;
        if (draw) {
            int32_t m = draw_mask(&d);
            if (len < CHUNK) sum = assign_chunk(k, top, c, fp32, d.sel, m, len);
            else if (fp32) sum = assign_chunk(k, top, c, 1, d.sel, m, CHUNK);
            else sum = assign_chunk(k, top, c, 0, d.sel, m, CHUNK);
        } else {
            if (len < CHUNK) sum = assign_chunk(k, top, c, fp32, NULL, 0, len);
            else if (fp32) sum = assign_chunk(k, top, c, 1, NULL, 0, CHUNK);
            else sum = assign_chunk(k, top, c, 0, NULL, 0, CHUNK);
        }
        draw_add(&d, sum);
    }
    if (draw) *token = draw_index(&d);
    return d.acc;
}

/* dyadic.allocate_with for one row of n weights (float32 if f32) normalized by total: the counts
 * into q (n 32-bit words: int32 counts, or with fp32 their FP32 wire values), drawn from with u (<
 * 0: no draw) into *token; divide takes the floors by division, else by multiplication. Returns
 * allocate_with's status: 0 done; 1 tickets left over outside 0..n-1; 2 the left-th largest
 * remainder is 0; 3 the counts do not sum to M. The pieces are named as in allocate_with. */
static int allocate_row(const void *w, int f32, size_t n, double total, int divide,
                        uint32_t *q, int fp32, const scratch_t *s, int64_t u, int64_t *token) {
    int32_t *counts = (int32_t *)q;
    double scale = total / M24;
    int small = !(scale >= MIN_NORMAL);
    uint32_t hist[1 << TOP_BITS] __attribute__((aligned(64)));
    memset(hist, 0, sizeof hist);
    int sampled = 0;
#ifdef HAVE_FAST64_Q
    sampled = !small && !divide && n >= BRACKET_MIN && use_fast64_q();
#endif
    /* floors, then left */
    int64_t left = (int64_t)M24 - floors_pass(w, f32, n, total, scale, small, divide,
                                              counts, s->key, hist, sampled);
    *token = -1;
    if (left < 0 || left >= (int64_t)n) return 1;
    uint32_t top = TOP_MASK; /* no ticket left: no key is above it */
    if (left > 0) {
        /* threshold: its bucket, then its value among the bucket's remainders */
        bucket_t b;
        int found = -1;
#ifdef HAVE_FAST64_Q
        if (sampled) {
            found = bracket_threshold(s, n, (size_t)left, hist, &b);
            if (found < 0) { /* the bracket missed: count every key after all */
                memset(hist, 0, sizeof hist);
                histogram(s->key, n, hist);
            }
        }
#endif
        if (found < 0) bucket_threshold(s, n, (size_t)left, hist, &b);
        bucket_remainders(w, f32, total, scale, small, s, b.count);
        double threshold = kth_remainder(s->rem, b.count, b.need);
        if (!(threshold > 0.0)) return 2;
        /* above */
        size_t above = b.above_keys;
        for (size_t c = 0; c < b.count; c++) above += s->rem[c] > threshold;
        /* assign: the bucket's tickets now, the keys above it in the last pass */
        bucket_tickets(s, b.count, threshold, (size_t)left - above, counts);
        top = b.top;
    }
    int64_t sum = assign_and_draw(s->key, n, top, q, fp32, u >= 0, u, token);
    return sum == (int64_t)M24 ? 0 : 3;
}

/* The draw over integer counts (int32 or int64, dyadic.sample): the number of cumulative counts at
 * most u, chunk by chunk as assign_and_draw draws; the counts' sum, and whether one is negative. */
#define DRAW_COUNTS(NAME, CT)                                                              \
    MULTIVERSION                                                                           \
    static int64_t NAME(const CT *restrict c, size_t n, int64_t u, int *negative,         \
                        int64_t *token) {                                                  \
        draw_t d;                                                                          \
        draw_start(&d, u);                                                                 \
        int64_t neg = 0;                                                                   \
        for (size_t lo = 0; lo < n; lo += CHUNK) {                                         \
            size_t len = n - lo < CHUNK ? n - lo : CHUNK;                                  \
            int32_t m = draw_mask(&d);                                                     \
            uint64_t sum = 0;                                                              \
            for (size_t j = 0; j < len; j++) {                                             \
                CT v = c[lo + j];                                                          \
                neg |= (int64_t)(v < 0);                                                   \
                sum += (uint64_t)v;                                                        \
                /* exact wherever the result is used */                                    \
                d.sel[j] = (d.sel[j] & ~m) | ((int32_t)v & m);                             \
            }                                                                              \
            for (size_t j = len; j < CHUNK; j++) d.sel[j] &= ~m;                           \
            draw_add(&d, (int64_t)sum);                                                    \
        }                                                                                  \
        *token = draw_index(&d);                                                           \
        *negative = neg != 0;                                                              \
        return d.acc;                                                                      \
    }
DRAW_COUNTS(draw_counts32, int32_t)
DRAW_COUNTS(draw_counts64, int64_t)
#undef DRAW_COUNTS

/* dyadic.sample over int32 or int64 counts. */
static PyObject *sample_counts(PyObject *self, PyObject *args) {
    PyObject *obj;
    long long u;
    if (!PyArg_ParseTuple(args, "OL", &obj, &u)) return NULL;
    Py_buffer cb;
    if (PyObject_GetBuffer(obj, &cb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    int kind = buffer_kind(&cb);
    if ((kind != K_I32 && kind != K_I64) || cb.ndim != 1) {
        PyBuffer_Release(&cb);
        PyErr_SetString(PyExc_ValueError, "sample_counts: not a 1-D int32 or int64 buffer");
        return NULL;
    }
    size_t n = (size_t)cb.shape[0];
    int64_t sum, found;
    int negative;
    Py_BEGIN_ALLOW_THREADS
    sum = kind == K_I32 ? draw_counts32((const int32_t *)cb.buf, n, u, &negative, &found)
                        : draw_counts64((const int64_t *)cb.buf, n, u, &negative, &found);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&cb);
    if (negative) return Py_BuildValue("(Li)", -1LL, 1);
    if (sum != (int64_t)M24) return Py_BuildValue("(Li)", -1LL, 2);
    return Py_BuildValue("(Li)", (long long)found, 0);
}

/* QBuilder.allocate: checked float64 weights w over their canonical total, the counts
 * into out (int32), share and work (float64, len(w) each) scratch; allocate_row's status. */
static PyObject *allocate(PyObject *self, PyObject *args) {
    Py_buffer wb, ob, sb, kb;
    double total;
    if (!PyArg_ParseTuple(args, "y*dw*w*w*", &wb, &total, &ob, &sb, &kb)) return NULL;
    size_t n = (size_t)wb.len / 8;
    int status = -1;
    if (wb.len % 8 || (size_t)ob.len != 4 * n || (size_t)sb.len != 8 * n
        || (size_t)kb.len != 8 * n || n == 0 || n > 0xFFFFFFFFu) {
        PyErr_SetString(PyExc_ValueError, "allocate: buffer sizes do not match");
    } else {
        scratch_t s;
        scratch_in(&s, (double *)sb.buf, kb.buf, n);
        int64_t token;
        Py_BEGIN_ALLOW_THREADS
        status = allocate_row(wb.buf, 0, n, total, 1, (uint32_t *)ob.buf, 0, &s, -1, &token);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&wb, &ob, &sb, &kb);
    if (status < 0) return NULL;
    return PyLong_FromLong(status);
}

/* A built row's status once drawn from with u: its allocation's, else 4 for a draw
 * outside [0, M) (dyadic.sample refuses it after the row's own checks). */
static inline int drawn_status(int st, int64_t u) {
    return st == 0 && (u < 0 || u >= (int64_t)M24) ? 4 : st;
}

/* Construction statuses beyond allocate_row's 0..3 and 4, a draw outside [0, M)
 * (protocol §6.1's refusals). */
enum { C_NON_FINITE = 5, C_NEGATIVE = 6, C_ZERO_MASS = 7 };

/* Whether some weight is NaN or infinite (the diagnosis of a non-finite total). */
static int any_non_finite(const void *w, int f32, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(weight_at(w, f32, i))) return 1;
    return 0;
}

/* The checks of a row of n weights and its canonical total (row_total: the tree of
 * §6.6): 0, or a C_* status in dyadic._check_weights' order (a non-finite weight, a
 * negative one, zero mass, a total beyond binary64). */
static int check_row(const void *w, int f32, size_t n, double *total) {
    int negative = 0;
    const vrow_t row = {w, f32 ? K_F32 : K_F64};
    *total = row_total(&row, n, &negative);
    if (!isfinite(*total)) {
        if (any_non_finite(w, f32, n)) return C_NON_FINITE;
        return negative ? C_NEGATIVE : C_NON_FINITE;
    }
    if (negative) return C_NEGATIVE;
    if (!(*total > 0.0)) return C_ZERO_MASS;
    return 0;
}

/* Each row (n float32 or float64 weights, one type for all) checked, totalled, allocated and
 * drawn from with draws[r], its FP32 wire values then +0.0 (wire false: its int32 counts)
 * written into payloads[r] (m >= n 32-bit words); status[r] 0, 1 to 3 as allocate_row, 4 a
 * draw outside [0, M), 5 to 7 as check_row; a refused row's token -1 and its payload
 * unspecified. scratch: at least 16 n bytes. */
static PyObject *construct_rows(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *payloads;
    Py_ssize_t nn;
    Py_buffer db, tb, stb, sb;
    int wire = 1;
    if (!PyArg_ParseTuple(args, "Onw*w*w*Ow*|p", &rows_obj, &nn, &db, &tb, &stb, &payloads, &sb,
                          &wire))
        return NULL;
    size_t n = (size_t)(nn > 0 ? nn : 0);
    size_t count = (size_t)db.len / 8;
    PyObject *rseq = PySequence_Fast(rows_obj, "construct_rows: rows must be a sequence");
    PyObject *pseq = rseq == NULL ? NULL
                                  : PySequence_Fast(payloads, "construct_rows: payloads must be a sequence");
    int ok = pseq != NULL;
    if (ok && !(nn > 0 && n <= 0xFFFFFFFFu && db.len % 8 == 0 && (size_t)tb.len == 8 * count
                && (size_t)stb.len == 4 * count && (size_t)sb.len >= 16 * n
                && (size_t)PySequence_Fast_GET_SIZE(rseq) == count
                && (size_t)PySequence_Fast_GET_SIZE(pseq) == count)) {
        PyErr_SetString(PyExc_ValueError, "construct_rows: sizes do not match");
        ok = 0;
    }
    Py_buffer *views = NULL;
    size_t held = 0;
    int f32 = -1;
    if (ok) {
        views = (Py_buffer *)PyMem_Calloc(count ? 2 * count : 1, sizeof(Py_buffer));
        ok = views != NULL;
        if (!ok) PyErr_NoMemory();
    }
    for (size_t r = 0; ok && r < count; r++) {
        Py_buffer *wv = &views[held];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(rseq, (Py_ssize_t)r), wv,
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            ok = 0;
            break;
        }
        held++;
        int kind = buffer_kind(wv);
        int is32 = kind == K_F32;
        if ((kind != K_F32 && kind != K_F64) || (f32 >= 0 && is32 != f32)
            || (size_t)wv->len != n * (is32 ? 4 : 8)) {
            PyErr_SetString(PyExc_ValueError,
                            "construct_rows: each row is n float32 or n float64, one type for all");
            ok = 0;
            break;
        }
        f32 = is32;
        Py_buffer *qv = &views[held];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(pseq, (Py_ssize_t)r), qv,
                               PyBUF_WRITABLE) < 0) {
            ok = 0;
            break;
        }
        held++;
        if (qv->len % 4 || (size_t)qv->len < 4 * n) {
            PyErr_SetString(PyExc_ValueError, "construct_rows: a payload holds fewer than n FP32");
            ok = 0;
        }
    }
    if (ok) {
        scratch_t s;
        /* rem: 8 n bytes; then the keys (2 n, rounded) and the indices (4 n). */
        scratch_in(&s, (double *)sb.buf, (char *)sb.buf + 8 * n, n);
        const int64_t *draws = (const int64_t *)db.buf;
        int64_t *tokens = (int64_t *)tb.buf;
        int32_t *status = (int32_t *)stb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (size_t r = 0; r < count; r++) {
            const void *w = views[2 * r].buf;
            uint32_t *q = (uint32_t *)views[2 * r + 1].buf; /* counts, then any wire values */
            double total;
            int st = check_row(w, f32, n, &total);
            tokens[r] = -1;
            if (st == 0) st = allocate_row(w, f32, n, total, 0, q, wire, &s, draws[r], &tokens[r]);
            st = drawn_status(st, draws[r]);
            if (st == 0) memset(q + n, 0, (size_t)views[2 * r + 1].len - 4 * n); /* +0.0 */
            else tokens[r] = -1;
            status[r] = st;
        }
        Py_END_ALLOW_THREADS
    }
    for (size_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_XDECREF(rseq);
    Py_XDECREF(pseq);
    RELEASE(&db, &tb, &stb, &sb);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------
 * Sparse top-k support from FP32 weights (the k largest positive, ties to the lowest ID),
 * on their bit patterns, which order as the values: the maxima of 64-weight chunks bound
 * the k-th largest from below, and a radix select orders the few candidates at or above.
 * ------------------------------------------------------------------------- */

/* A weight's order key: its bits, 0 for -0.0 (a zero weight). */
static inline uint32_t order_bits(uint32_t b) { return b == 0x80000000u ? 0u : b; }

/* The largest order key of 64 weights (vectorized), OR-ing into *flags bit 0 for a NaN or infinity
 * and bit 1 for a negative weight (-0.0 is a zero weight). The keys of a row with a negative weight
 * are never used (it is refused), so the sign bit is dropped rather than tested. */
MULTIVERSION
static uint32_t chunk_max_bits(const uint32_t *restrict bits, uint32_t *restrict flags) {
    uint32_t mx = 0;
    int32_t nonfinite = 0, negative = 0;
    for (int i = 0; i < 64; i++) {
        uint32_t b = bits[i];
        nonfinite |= (int32_t)((b & 0x7F800000u) == 0x7F800000u);
        int32_t v = (int32_t)b; /* a negative weight: sign bit set, and not -0.0 */
        negative |= (int32_t)(v < 0) & (int32_t)(v != INT32_MIN);
        uint32_t o = b & 0x7FFFFFFFu;
        mx = o > mx ? o : mx;
    }
    *flags |= (uint32_t)nonfinite | ((uint32_t)(negative != 0) << 1);
    return mx;
}

/* The k-th largest (1-based) of m values (k <= m), by 11-bit digits; tmp holds m. */
static uint32_t kth_largest_u32(const uint32_t *vals, size_t m, size_t k, uint32_t *tmp) {
    static const int shift[3] = {21, 10, 0};
    static const uint32_t width[3] = {2048, 2048, 1024};
    uint32_t hist[2048];
    uint32_t prefix = 0, mask = 0;
    const uint32_t *cur = vals;
    size_t count = m;
    for (int d = 0; d < 3; d++) {
        memset(hist, 0, sizeof hist);
        for (size_t i = 0; i < count; i++) hist[(cur[i] >> shift[d]) & (width[d] - 1)]++;
        uint32_t digit = width[d] - 1;
        for (;; digit--) {
            if (hist[digit] >= k) break;
            k -= hist[digit];
        }
        prefix |= digit << shift[d];
        mask |= (width[d] - 1) << shift[d];
        size_t kept = 0;
        for (size_t i = 0; i < count; i++)
            if ((cur[i] & mask) == prefix) tmp[kept++] = cur[i];
        cur = tmp;
        count = kept;
    }
    return prefix;
}

/* The checks (status 5 to 7 as check_row) and the support's IDs, ascending, into ids
 * (int64, capacity cap >= k; scratch: 4 (ceil(n / 64) + 2 cap) bytes); count -1: more than
 * cap candidates (equal weights over many chunks), for the caller to select another way. */
static PyObject *topk_f32(PyObject *self, PyObject *args) {
    Py_buffer rb, ib, sb;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*nw*w*", &rb, &k, &ib, &sb)) return NULL;
    size_t n = (size_t)rb.len / 4, cap = (size_t)ib.len / 8, chunks = (n + 63) / 64;
    if (rb.len % 4 || ib.len % 8 || k < 1 || (size_t)k > cap || n == 0
        || (size_t)sb.len < 4 * (chunks + 2 * cap)) {
        RELEASE(&rb, &ib, &sb);
        PyErr_SetString(PyExc_ValueError, "topk_f32: bad arguments");
        return NULL;
    }
    const uint32_t *bits = (const uint32_t *)rb.buf;
    int64_t *ids = (int64_t *)ib.buf;
    uint32_t *cmax = (uint32_t *)sb.buf, *cand = cmax + chunks, *tmp = cand + cap;
    Py_ssize_t count = 0;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    uint32_t flags = 0;
    size_t positive_chunks = 0;
    for (size_t c = 0; c < chunks; c++) {
        size_t lo = 64 * c, hi = lo + 64 < n ? lo + 64 : n;
        uint32_t mx = 0;
        if (hi - lo == 64) {
            mx = chunk_max_bits(bits + lo, &flags);
        } else {
            for (size_t i = lo; i < hi; i++) {
                uint32_t b = bits[i];
                flags |= (uint32_t)((b & 0x7F800000u) == 0x7F800000u) | ((uint32_t)(b > 0x80000000u) << 1);
                uint32_t o = order_bits(b);
                mx = o > mx ? o : mx;
            }
        }
        cmax[c] = mx;
        positive_chunks += mx != 0;
    }
    if (flags & 1) status = C_NON_FINITE;
    else if (flags & 2) status = C_NEGATIVE;
    else if (positive_chunks == 0) status = C_ZERO_MASS;
    if (status == 0) {
        /* At least k chunks (or every chunk with a positive weight) reach floor. */
        uint32_t floor = positive_chunks >= (size_t)k
                             ? kth_largest_u32(cmax, chunks, (size_t)k, tmp)
                             : 1u;
        size_t m = 0;
        for (size_t c = 0; c < chunks && m <= cap; c++) {
            if (cmax[c] < floor) continue;
            size_t lo = 64 * c, hi = lo + 64 < n ? lo + 64 : n;
            for (size_t i = lo; i < hi; i++) {
                if (order_bits(bits[i]) < floor) continue;
                if (m == cap) {
                    m = cap + 1;
                    break;
                }
                ids[m] = (int64_t)i;
                cand[m++] = order_bits(bits[i]);
            }
        }
        if (m > cap) {
            count = -1;
        } else if (m <= (size_t)k) {
            count = (Py_ssize_t)m; /* every positive weight: fewer than k of them */
        } else {
            uint32_t theta = kth_largest_u32(cand, m, (size_t)k, tmp);
            size_t above = 0;
            for (size_t j = 0; j < m; j++) above += cand[j] > theta;
            size_t ties = (size_t)k - above, kept = 0;
            for (size_t j = 0; j < m; j++) {
                int take = cand[j] > theta || (cand[j] == theta && ties > 0);
                if (cand[j] == theta && take) ties--;
                if (take) ids[kept++] = ids[j];
            }
            count = (Py_ssize_t)kept;
        }
    }
    Py_END_ALLOW_THREADS
    RELEASE(&rb, &ib, &sb);
    return Py_BuildValue("(ni)", count, status);
}

/* ---------------------------------------------------------------------------
 * DenseRowValidator.check in one pass over a valid row (protocol §6.2, in its order): 0,
 * or the ErrorCode of the first failing check; only a refused row is read again.
 * ------------------------------------------------------------------------- */

enum { E_DENSE_PADDING_NONZERO = 72 };

/* OR of the raw bits (padding must be +0.0 bit for bit). */
MULTIVERSION
static uint32_t or_bits(const uint32_t *restrict bits, size_t n) {
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++) acc |= bits[i];
    return acc;
}

static int dense_code(const uint32_t *bits, size_t entries, size_t vocab, int64_t proposed) {
    if (entries < vocab) return E_ROW_LENGTH;
    if (proposed < 0 || proposed >= (int64_t)vocab) return E_PROPOSED_OUT_OF_RANGE;
    uint64_t sum = 0;
    uint32_t bad = 0;
    uint32_t mx = scan_loop(bits, vocab, &sum, &bad);
    if (mx > 0x3F800000u) return above_one_code(bits, vocab);
    if (or_bits(bits + vocab, entries - vocab)) return E_DENSE_PADDING_NONZERO;
    if (bad) return E_NON_DYADIC;
    if (sum != 16777216u) return E_MASS_MISMATCH;
    if (bits[proposed] == 0) return E_ZERO_Q_AT_PROPOSED;
    return 0;
}

static PyObject *check_dense(PyObject *self, PyObject *args) {
    Py_buffer rb;
    Py_ssize_t vocab;
    long long proposed;
    if (!PyArg_ParseTuple(args, "y*nL", &rb, &vocab, &proposed)) return NULL;
    int code;
    if (rb.len % 4 || vocab < 1) {
        code = E_ROW_LENGTH;
    } else {
        Py_BEGIN_ALLOW_THREADS
        code = dense_code((const uint32_t *)rb.buf, (size_t)rb.len / 4, (size_t)vocab,
                          (int64_t)proposed);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&rb);
    return PyLong_FromLong(code);
}

/* The canonical total of the weights one draw_rows draw (row, total, q, ids) descends. */
static PyObject *draw_total(PyObject *self, PyObject *args) {
    PyObject *obj, *qobj, *idobj;
    vdraw_t d = {0};
    if (!PyArg_ParseTuple(args, "OdOO", &obj, &d.total, &qobj, &idobj)) return NULL;
    Py_buffer views[3];
    int used = 0;
    int ok = one_row(obj, views, &used, &d.shape.row, &d.shape.n) == 0 &&
             (qobj == Py_None || parse_q(qobj, idobj, &d, views, &used) == 0);
    if (ok && d.bad_q) {
        PyErr_SetString(PyExc_ValueError, "draw_total: ids do not ascend inside the row");
        ok = 0;
    }
    double root = 0.0;
    if (ok) root = weights_total(&d.shape.row, d.shape.n, d.total, d.has_q ? &d.q : NULL);
    for (int i = 0; i < used; i++) PyBuffer_Release(&views[i]);
    if (!ok) return NULL;
    if (root < 0.0) return PyErr_NoMemory();
    return PyFloat_FromDouble(root);
}

/* A CPU path's switch, for the tests that qualify both sides: off runs the other path on
 * any CPU, on takes this one where probe finds the CPU has it; whether it was on. */
static PyObject *simd_switch(PyObject *args, int *state, int (*probe)(void)) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    int was = probe();
    *state = -1;
    if (!on || !probe()) *state = 0;
    return PyBool_FromLong(was);
}

/* The AVX2 path of row_checks and draw_rows. */
static PyObject *step_simd(PyObject *self, PyObject *args) {
    return simd_switch(args, &avx2_state, have_avx2);
}

static PyObject *philox_u53(PyObject *self, PyObject *args) {
    unsigned long long seed;
    unsigned long gen, round, pos;
    int domain;
    if (!PyArg_ParseTuple(args, "Kkkki", &seed, &gen, &round, &pos, &domain)) return NULL;
    if (gen > 0xFFFFFFFFul || round > 0xFFFFFFFFul || pos > 0xFFFFFFFFul || domain < 0 ||
        domain > 255) {
        PyErr_SetString(PyExc_ValueError, "philox_u53: field out of range");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(
        draw_u53(seed, (uint32_t)gen, (uint32_t)round, (uint32_t)pos, domain));
}

/* The AVX-512 path of construct_rows (the floors pass's other form, the full key count). */
static PyObject *construct_simd(PyObject *self, PyObject *args) {
    return simd_switch(args, &have_dq, use_fast64_q);
}

/* Set bracket_factor (far from 1 the bracket misses, for qualification); the previous. */
static PyObject *bracket_bias(PyObject *self, PyObject *args) {
    double x;
    if (!PyArg_ParseTuple(args, "d", &x)) return NULL;
#ifdef HAVE_FAST64_Q
    double was = bracket_factor;
    bracket_factor = x;
    return PyFloat_FromDouble(was);
#else
    (void)x;
    return PyFloat_FromDouble(1.0);
#endif
}

static PyObject *philox_block(PyObject *self, PyObject *args) {
    unsigned long c0, c1, c2, c3, k0, k1;
    if (!PyArg_ParseTuple(args, "kkkkkk", &c0, &c1, &c2, &c3, &k0, &k1)) return NULL;
    if ((c0 | c1 | c2 | c3 | k0 | k1) > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "philox_block: a word outside uint32");
        return NULL;
    }
    uint32_t c[4] = {(uint32_t)c0, (uint32_t)c1, (uint32_t)c2, (uint32_t)c3};
    philox10(c, (uint32_t)k0, (uint32_t)k1);
    return Py_BuildValue("(kkkk)", (unsigned long)c[0], (unsigned long)c[1], (unsigned long)c[2],
                         (unsigned long)c[3]);
}

/* One entry: the function under its own name, documented as that name followed by sig. */
#define METHOD(name, sig) {#name, name, METH_VARARGS, #name sig}

static PyMethodDef methods[] = {
    METHOD(row_checks, "(rows[, threads]) -> each row's total, or None if not a distribution"),
    METHOD(draw_rows, "(draws[, threads]) -> each drawn index, or -1 / -2 / -3"),
    METHOD(draw_total,
           "(row, total, q or None, ids or None) -> the canonical total of the draw's weights"),
    METHOD(step_simd, "(on) -> whether the AVX2 path was on"),
    METHOD(philox_u53, "(seed, generation, round, position, domain) -> the 53-bit draw"),
    METHOD(philox_block, "(c0, c1, c2, c3, k0, k1) -> the Philox4x32-10 block"),
    METHOD(construct_simd, "(on) -> whether the AVX-512 path of construct_rows was on"),
    METHOD(bracket_bias, "(x) -> the previous factor on the sampled bracket's centre rank"),
    METHOD(sample_counts,
           "(int32 or int64 counts, u) -> (index, 0), or (-1, 1) negative, (-1, 2) wrong total"),
    METHOD(tree_total, "(values) -> the canonical total"),
    METHOD(allocate, "(w, total, out, share, work) -> 0, or 1 to 3 for an inconsistent allocation"),
    METHOD(sparse_candidates, "(x, top, scale, k, margin, idx) -> (count, x_out_max)"),
    METHOD(construct_rows,
           "(rows, n, draws, tokens, status, payloads, scratch[, wire]) -> None"),
    METHOD(topk_f32, "(row, k, ids, scratch) -> (count, status)"),
    METHOD(check_dense, "(row, vocab, proposed) -> 0 or the first failing error code"),
    METHOD(check_sparse, "(ids, q, vocab, max_k, proposed) -> 0 or the first failing error code"),
    {NULL, NULL, 0, NULL},
};
#undef METHOD

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastq", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastq(void) { return PyModule_Create(&module); }
