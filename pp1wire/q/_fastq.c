/*
 * Optional compiled fast paths for pp1wire.q.dyadic.
 *
 * Each function computes exactly what the numpy path in dyadic.py computes
 * (in one pass instead of six, or without numpy's per-call overhead for a
 * 32-entry sparse row), and is qualified against it
 * (and against the rational oracle) by tests/test_fastq.py. When this module
 * is absent, dyadic.py uses numpy and nothing changes but speed.
 *
 *   scan_dense(row) -> (max_bits, count_sum, non_integral)
 *       row: a buffer of little-endian FP32 values (read-only is fine).
 *       max_bits: the largest raw uint32 bit pattern (> 0x3F800000 means some
 *       value is negative, non-finite or above 1: the caller then diagnoses
 *       and ignores the other two results). count_sum: exact sum of
 *       trunc(v * 2**24). non_integral: 1 if some v * 2**24 is not an integer.
 *
 *   check_sparse(ids, q, vocab, max_k, proposed) -> code
 *       ids: int32 buffer, q: FP32 buffer. 0 if the row is valid, else the
 *       ErrorCode value of the first failing check, in validate_sparse's order.
 *
 *   allocate(w, total, out, share, work) -> status
 *       QBuilder.allocate in one compiled pass: w float64 weights (checked by
 *       the caller), total their canonical total; writes the dyadic24 counts
 *       into out (int32) using share and work (float64, len(w) each) as
 *       scratch. The leftover tickets go to the largest remainders, ties to
 *       the lowest index, chosen by a radix select over the remainders' bit
 *       patterns: linear, and independent of the data's order and of the CPU.
 *       status 0: done; 1: leftover tickets outside 0..n-1; 2: a ticket
 *       would land on a zero remainder (both ALLOCATION_INCONSISTENT).
 *
 *   tree_total(values) -> float
 *       The canonical total of pp1wire.q.tree (protocol §6.6): the root of the
 *       pairwise tree over the values padded with +0.0 to a power of two, each
 *       node one binary64 addition of its children, bit for bit.
 *
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
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

static PyObject *scan_dense(PyObject *self, PyObject *args) {
    Py_buffer row;
    if (!PyArg_ParseTuple(args, "y*", &row)) return NULL;
    if (row.len % 4 != 0) {
        PyBuffer_Release(&row);
        PyErr_SetString(PyExc_ValueError, "row length is not a multiple of 4 bytes");
        return NULL;
    }
    uint64_t sum = 0;
    uint32_t bad = 0, mx;
    Py_BEGIN_ALLOW_THREADS
    mx = scan_loop((const uint32_t *)row.buf, (size_t)row.len / 4, &sum, &bad);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&row);
    return Py_BuildValue("(kKi)", (unsigned long)mx, (unsigned long long)sum, (int)(bad != 0));
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

/* The sparse-row checks of dyadic.validate_sparse, in the same order. */
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
    if (mx > 0x3F800000u) {
        for (size_t i = 0; i < k; i++)
            if ((bits[i] & 0x7F800000u) == 0x7F800000u) return E_NON_FINITE;
        for (size_t i = 0; i < k; i++)
            if (bits[i] & 0x80000000u) return E_NEGATIVE;
        return E_NON_DYADIC;
    }
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
    PyBuffer_Release(&idb);
    PyBuffer_Release(&qb);
    if (code < 0) return PyErr_NoMemory();
    return PyLong_FromLong(code);
}

#define M24 16777216.0
#define MIN_NORMAL 2.2250738585072014e-308 /* 2**-1022 */

#define TOP_BITS 12
#define TOP_SCALE 4096.0 /* 2**TOP_BITS */

static inline uint64_t bits_of(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* Floors into out, remainders into share (the exact operations of
 * dyadic.floors_and_remainders), and top_hist: a histogram of the remainders'
 * first 12 binary digits, floor(r * 2**12), a coarse key that orders like the
 * remainders (r < s implies key(r) <= key(s)) and spreads them evenly, unlike
 * their exponent bits. Returns the sum of the floors. */
static int64_t floors_pass(const double *restrict w, size_t n, double total,
                           int32_t *restrict out, double *restrict share,
                           uint32_t *restrict top_hist) {
    int64_t sum = 0;
    double scale = total / M24;
    int small = !(scale >= MIN_NORMAL);
    memset(top_hist, 0, sizeof(uint32_t) << TOP_BITS);
    for (size_t i = 0; i < n; i++) {
        double v = small ? (w[i] / total) * M24 : w[i] / scale;
        int32_t f = (int32_t)v; /* v >= 0: truncation is the floor */
        double r = v - (double)f;
        out[i] = f;
        share[i] = r;
        sum += f;
        top_hist[(uint32_t)(r * TOP_SCALE)]++; /* exact: r in [0, 1), a power-of-two scale */
    }
    return sum;
}

/* Non-negative doubles order as their bit patterns: within one coarse bucket,
 * six digits of those patterns find the threshold exactly. */
static const int SHIFTS[6] = {52, 40, 28, 16, 4, 0};
static const int WIDTHS[6] = {12, 12, 12, 12, 12, 4};

/* One ticket more for the k largest remainders, ties to the lowest index.
 * idx: scratch for n indices. Returns 0, or 2 if a ticket lands on a zero. */
static int leftover_pass(const double *restrict share, size_t n, size_t k,
                         int32_t *restrict out, uint32_t *restrict idx,
                         const uint32_t *restrict top_hist) {
    /* The top digit: its bucket holds the k-th largest remainder. */
    size_t acc = 0, need = k;
    uint64_t top = (1u << TOP_BITS) - 1;
    for (;; top--) {
        if (acc + top_hist[top] >= need) break;
        acc += top_hist[top];
    }
    need -= acc;
    /* One pass: a ticket for every remainder in a higher bucket; gather the
     * target bucket's indices, in index order (branch-free: random
     * remainders would mispredict every other test). */
    size_t count = 0; /* candidates idx[0 .. count) equal the threshold so far */
    for (size_t i = 0; i < n; i++) {
        uint64_t d = (uint32_t)(share[i] * TOP_SCALE);
        out[i] += d > top;
        idx[count] = (uint32_t)i;
        count += d == top;
    }
    /* Within the bucket, narrow to the threshold digit by digit. */
    uint32_t hist[4096];
    uint64_t threshold = 0;
    for (int pass = 0; pass < 6; pass++) {
        int shift = SHIFTS[pass];
        uint64_t mask = ((uint64_t)1 << WIDTHS[pass]) - 1;
        memset(hist, 0, sizeof hist);
        for (size_t q = 0; q < count; q++)
            hist[(bits_of(share[idx[q]]) >> shift) & mask]++;
        size_t above = 0;
        uint64_t b = mask;
        for (;; b--) {
            if (above + hist[b] >= need) break;
            above += hist[b];
        }
        need -= above;
        threshold |= b << shift;
        size_t kept = 0;
        for (size_t q = 0; q < count; q++) {
            uint32_t i = idx[q];
            uint64_t d = (bits_of(share[i]) >> shift) & mask;
            out[i] += d > b; /* above the threshold: a ticket */
            idx[kept] = i;
            kept += d == b;
        }
        count = kept;
    }
    if (threshold == 0) return 2; /* the k-th largest remainder is +0.0 */
    /* idx[0 ..) holds every remainder equal to the threshold, in index order. */
    for (size_t q = 0; q < need; q++) out[idx[q]] += 1;
    return 0;
}

/* The canonical tree's root. Leaves arrive in order; a binary counter keeps
 * the pending left children (stack[l] is a complete left subtree of level l),
 * so every addition is exactly one node of the tree: left child + right child.
 * Blocks of 8 leaves are summed first, with independent additions in flight. */
static double tree_root(const double *restrict v, size_t n) {
    size_t size = 1;
    int depth = 0;
    while (size < n) {
        size <<= 1;
        depth++;
    }
    if (depth < 3) { /* fewer than 8 leaves: pad and add level by level */
        double level[8] = {0};
        memcpy(level, v, n * sizeof(double));
        for (size_t width = size; width > 1; width >>= 1)
            for (size_t i = 0; i < width / 2; i++) level[i] = level[2 * i] + level[2 * i + 1];
        return level[0];
    }
    double stack[64];
    size_t blocks = size >> 3;
    for (size_t blk = 0; blk < blocks; blk++) {
        double x[8];
        size_t base = blk << 3;
        if (base + 8 <= n) {
            memcpy(x, v + base, sizeof x);
        } else {
            for (int j = 0; j < 8; j++) x[j] = base + j < n ? v[base + j] : 0.0;
        }
        double carry = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
        int level = 0;
        for (size_t b = blk; b & 1; b >>= 1) carry = stack[level++] + carry;
        stack[level] = carry;
    }
    return stack[depth - 3];
}

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
        Py_BEGIN_ALLOW_THREADS
        root = tree_root((const double *)vb.buf, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&vb);
    return PyFloat_FromDouble(root);
}

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
        Py_BEGIN_ALLOW_THREADS
        uint32_t top_hist[1 << TOP_BITS];
        int64_t sum = floors_pass((const double *)wb.buf, n, total, (int32_t *)ob.buf,
                                  (double *)sb.buf, top_hist);
        int64_t remaining = (int64_t)M24 - sum;
        if (remaining < 0 || remaining >= (int64_t)n) {
            status = 1;
        } else if (remaining == 0) {
            status = 0;
        } else {
            status = leftover_pass((const double *)sb.buf, n, (size_t)remaining,
                                   (int32_t *)ob.buf, (uint32_t *)kb.buf, top_hist);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&kb);
    if (status < 0) return NULL;
    return PyLong_FromLong(status);
}

/* The proposal draw over integer counts: the first index whose cumulative count
 * exceeds u, with the checks dyadic.sample makes (no negative count, total M).
 * Returns (index, 0), or (-1, 1) for a negative count, (-1, 2) for a wrong total. */
static PyObject *sample_counts(PyObject *self, PyObject *args) {
    Py_buffer cb;
    long long u;
    if (!PyArg_ParseTuple(args, "y*L", &cb, &u)) return NULL;
    if (cb.len % 4) {
        PyBuffer_Release(&cb);
        PyErr_SetString(PyExc_ValueError, "sample_counts: not an int32 buffer");
        return NULL;
    }
    size_t n = (size_t)cb.len / 4;
    const int32_t *c = (const int32_t *)cb.buf;
    int64_t sum = 0, found = -1;
    int negative = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) {
        int32_t v = c[i];
        if (v < 0) {
            negative = 1;
            break;
        }
        sum += v;
        if (found < 0 && sum > u) found = (int64_t)i;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&cb);
    if (negative) return Py_BuildValue("(Li)", -1LL, 1);
    if (sum != (int64_t)M24) return Py_BuildValue("(Li)", -1LL, 2);
    return Py_BuildValue("(Li)", (long long)found, 0);
}

static PyMethodDef methods[] = {
    {"sample_counts", sample_counts, METH_VARARGS,
     "sample_counts(counts_int32, u) -> (index, 0), or (-1, 1) negative, (-1, 2) wrong total"},
    {"tree_total", tree_total, METH_VARARGS, "tree_total(values) -> the canonical total"},
    {"allocate", allocate, METH_VARARGS,
     "allocate(w, total, out, share, work) -> 0, or 1/2 for an inconsistent allocation"},
    {"scan_dense", scan_dense, METH_VARARGS, "scan_dense(row) -> (max_bits, count_sum, non_integral)"},
    {"check_sparse", check_sparse, METH_VARARGS,
     "check_sparse(ids, q, vocab, max_k, proposed) -> 0 or the first failing error code"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastq", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastq(void) { return PyModule_Create(&module); }
