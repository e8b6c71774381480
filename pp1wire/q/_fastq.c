/*
 * Optional compiled fast paths for pp1wire.q.dyadic and pp1wire.q.rows.
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
 *   build_rows(w, n, out, draws, tokens, status, share, work[, payloads]) -> None
 *       A batch of rows (rows x n float64 weights) in one call with the GIL
 *       released: each row's canonical total, allocate, and the proposal draw
 *       (dyadic.sample) with its 24-bit draw, found from per-block count sums
 *       by scanning one block; optionally each row's FP32 wire values written
 *       straight into its outgoing buffer. See the function for the details.
 *
 *   sparse_candidates(x, top, scale, k, margin, idx) -> (count, x_out_max)
 *       A small superset of a sparse top-k support, from the logits without
 *       the exponential; the caller proves it holds the top k or falls back.
 *
 *   tree_total(values) -> float
 *       The canonical total of pp1wire.q.tree (protocol §6.6): the root of the
 *       pairwise tree over the values padded with +0.0 to a power of two, each
 *       node one binary64 addition of its children, bit for bit.
 *
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
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

/* The canonical tree's root. Leaves arrive in order; a binary counter keeps
 * the pending left children (stack[l] is a complete left subtree of level l),
 * so every addition is exactly one node of the tree: left child + right child.
 * Blocks of 64 leaves are summed first, level by level, so the additions of a
 * level are independent (and vectorize); a block of padding only is +0.0. */
static double tree_root(const double *restrict v, size_t n) {
    size_t size = 1;
    int depth = 0;
    while (size < n) {
        size <<= 1;
        depth++;
    }
    if (depth < 6) { /* fewer than 64 leaves: pad and add level by level */
        double level[64] = {0};
        memcpy(level, v, n * sizeof(double));
        for (size_t width = size; width > 1; width >>= 1)
            for (size_t i = 0; i < width / 2; i++) level[i] = level[2 * i] + level[2 * i + 1];
        return level[0];
    }
    double stack[64];
    size_t blocks = size >> 6;
    for (size_t blk = 0; blk < blocks; blk++) {
        size_t base = blk << 6;
        double carry;
        if (base + 64 <= n) {
            carry = root64(v + base);
        } else if (base < n) {
            double x[64] = {0};
            memcpy(x, v + base, (n - base) * sizeof(double));
            carry = root64(x);
        } else {
            carry = 0.0;
        }
        int level = 0;
        for (size_t b = blk; b & 1; b >>= 1) carry = stack[level++] + carry;
        stack[level] = carry;
    }
    return stack[depth - 6];
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

#define M24 16777216.0
#define MIN_NORMAL 2.2250738585072014e-308 /* 2**-1022 */

#define TOP_BITS 12
#define TOP_SCALE 4096.0 /* 2**TOP_BITS */
#define TOP_MASK 4095u
/* Counts are summed per block of this many entries: the draw then scans one block. */
#define BLOCK 4096
#define STACK_BLOCKS 1024

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

/* Floors into out and key: the remainders' first 12 binary digits,
 * floor(r * 2**12), a coarse key that orders like the remainders (r < s
 * implies key(r) <= key(s)) and spreads them evenly, unlike their exponent
 * bits. The remainders themselves are not stored: the few the ticket choice
 * needs are computed again, by the same operations. Returns the sum of the
 * floors. No histogram here, so the loop vectorizes (the division dominates). */
MULTIVERSION
static int64_t floors_scaled(const double *restrict w, size_t n, double scale,
                             int32_t *restrict out, uint16_t *restrict key) {
    int64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        double v = w[i] / scale;
        /* v >= 0: truncation is the floor. A share beyond int32 (only from a
         * total that does not match the weights) converts as numpy's cast
         * does, and the ticket count then refuses the row. */
        int32_t f = (int32_t)v;
        double r = v - (double)f;
        out[i] = f;
        /* exact: r in [0, 1), a power-of-two scale; the mask guards memory
         * against such an inconsistent total */
        key[i] = (uint16_t)((uint32_t)(int32_t)(r * TOP_SCALE) & TOP_MASK);
        sum += f;
    }
    return sum;
}

/* The same when total / M is subnormal: (w / total) * M, two roundings. */
MULTIVERSION
static int64_t floors_small(const double *restrict w, size_t n, double total,
                            int32_t *restrict out, uint16_t *restrict key) {
    int64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        double v = (w[i] / total) * M24;
        int32_t f = (int32_t)v;
        double r = v - (double)f;
        out[i] = f;
        key[i] = (uint16_t)((uint32_t)(int32_t)(r * TOP_SCALE) & TOP_MASK);
        sum += f;
    }
    return sum;
}

static void histogram(const uint16_t *restrict key, size_t n, uint32_t *restrict hist) {
    for (size_t i = 0; i < n; i++) hist[key[i]]++;
}

/* One ticket more for every key above top; returns how many. */
MULTIVERSION
static int64_t add_above(const uint16_t *restrict key, size_t n, uint32_t top,
                         int32_t *restrict out) {
    int64_t added = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t a = key[i] > top;
        out[i] += a;
        added += a;
    }
    return added;
}

/* add_above, also writing each count's FP32 wire value c / 2**24 (exact). */
MULTIVERSION
static int64_t add_above_fp32(const uint16_t *restrict key, size_t n, uint32_t top,
                              int32_t *restrict out, float *restrict q) {
    int64_t added = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t a = key[i] > top;
        int32_t c = out[i] + a;
        out[i] = c;
        q[i] = (float)c * 0x1p-24f;
        added += a;
    }
    return added;
}

/* The FP32 wire values of counts: c / 2**24, exact (c <= 2**24). */
MULTIVERSION
static void counts_to_fp32(const int32_t *restrict c, size_t n, float *restrict q) {
    for (size_t i = 0; i < n; i++) q[i] = (float)c[i] * 0x1p-24f;
}

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

/* Scratch of one row: candidate remainders, keys, candidate indices, block sums. */
typedef struct {
    double *rem;
    uint16_t *key;
    uint32_t *idx;
    int64_t *blocks;
} scratch_t;

/* Non-negative doubles order as their bit patterns: within one coarse bucket,
 * six digits of those patterns find the threshold exactly. */
static const int SHIFTS[6] = {52, 40, 28, 16, 4, 0};
static const int WIDTHS[6] = {12, 12, 12, 12, 12, 4};
/* Up to this many candidates are ordered by insertion instead. */
#define FEW 64

/* One ticket more for entry i (after the bulk pass), keeping blocks and q. */
static inline void ticket(int32_t *out, int64_t *blocks, float *q, uint32_t i) {
    out[i] += 1;
    blocks[i / BLOCK] += 1;
    if (q != NULL) q[i] = (float)out[i] * 0x1p-24f;
}

/* One ticket more for the k largest remainders, ties to the lowest index,
 * keeping the block sums (and the FP32 values, when q is given). Returns 0, or
 * 2 if a ticket lands on a zero. */
static int leftover_pass(const double *w, double total, double scale, int small,
                         const scratch_t *s, size_t n, size_t k, int32_t *restrict out,
                         float *q, const uint32_t *restrict top_hist) {
    uint32_t *idx = s->idx;
    double *rem = s->rem;
    int64_t *blocks = s->blocks;
    /* The top digit: its bucket holds the k-th largest remainder. */
    size_t acc = 0, need = k;
    uint32_t top = TOP_MASK;
    for (;; top--) {
        if (acc + top_hist[top] >= need) break;
        acc += top_hist[top];
    }
    need -= acc;
    /* A ticket for every remainder in a higher bucket (vectorized), then the
     * target bucket's indices, in index order: about n / 4096 of them. */
    for (size_t lo = 0, b = 0; lo < n; lo += BLOCK, b++) {
        size_t len = n - lo < BLOCK ? n - lo : BLOCK;
        blocks[b] += q != NULL ? add_above_fp32(s->key + lo, len, top, out + lo, q + lo)
                               : add_above(s->key + lo, len, top, out + lo);
    }
    size_t count = gather_equal(s->key, n, top, idx);
    for (size_t c = 0; c < count; c++) {
        double v = share_of(w[idx[c]], total, scale, small);
        rem[c] = v - (double)(int32_t)v; /* as the floors pass had it */
    }
    uint64_t threshold = 0;
    if (count <= FEW) {
        /* Order by remainder, descending, ties by index (insertion is stable). */
        for (size_t c = 1; c < count; c++) {
            uint32_t i = idx[c];
            double r = rem[c];
            uint64_t rb = bits_of(r);
            size_t j = c;
            for (; j > 0 && bits_of(rem[j - 1]) < rb; j--) {
                idx[j] = idx[j - 1];
                rem[j] = rem[j - 1];
            }
            idx[j] = i;
            rem[j] = r;
        }
        threshold = bits_of(rem[need - 1]);
        if (threshold == 0) return 2; /* the k-th largest remainder is +0.0 */
        for (size_t c = 0; c < need; c++) ticket(out, blocks, q, idx[c]);
        return 0;
    }
    /* Within the bucket, narrow to the threshold digit by digit. */
    uint32_t hist[4096];
    for (int pass = 0; pass < 6; pass++) {
        int shift = SHIFTS[pass];
        uint64_t mask = ((uint64_t)1 << WIDTHS[pass]) - 1;
        memset(hist, 0, sizeof hist);
        for (size_t c = 0; c < count; c++) hist[(bits_of(rem[c]) >> shift) & mask]++;
        size_t above = 0;
        uint64_t b = mask;
        for (;; b--) {
            if (above + hist[b] >= need) break;
            above += hist[b];
        }
        need -= above;
        threshold |= b << shift;
        size_t kept = 0;
        for (size_t c = 0; c < count; c++) {
            uint64_t d = (bits_of(rem[c]) >> shift) & mask;
            if (d > b) ticket(out, blocks, q, idx[c]); /* above the threshold */
            idx[kept] = idx[c];
            rem[kept] = rem[c];
            kept += d == b;
        }
        count = kept;
    }
    if (threshold == 0) return 2; /* the k-th largest remainder is +0.0 */
    /* idx[0 ..) holds every remainder equal to the threshold, in index order. */
    for (size_t c = 0; c < need; c++) ticket(out, blocks, q, idx[c]);
    return 0;
}

/* QBuilder.allocate for checked weights w and their canonical total: counts
 * into out, and blocks[b] = the sum of block b's counts; with q, the FP32
 * wire values too. Status 0: done; 1: tickets left over outside 0..n-1;
 * 2: a ticket would land on a zero remainder (both ALLOCATION_INCONSISTENT). */
static int build_counts(const double *w, size_t n, double total, int32_t *out, float *q,
                        const scratch_t *s) {
    double scale = total / M24;
    int small = !(scale >= MIN_NORMAL);
    uint32_t top_hist[1 << TOP_BITS];
    memset(top_hist, 0, sizeof top_hist);
    int64_t sum = 0;
    for (size_t lo = 0, b = 0; lo < n; lo += BLOCK, b++) {
        size_t len = n - lo < BLOCK ? n - lo : BLOCK;
        int64_t part = small ? floors_small(w + lo, len, total, out + lo, s->key + lo)
                             : floors_scaled(w + lo, len, scale, out + lo, s->key + lo);
        histogram(s->key + lo, len, top_hist); /* while the block's keys are in L1 */
        s->blocks[b] = part;
        sum += part;
    }
    int64_t remaining = (int64_t)M24 - sum;
    if (remaining < 0 || remaining >= (int64_t)n) return 1;
    if (remaining == 0) {
        if (q != NULL) counts_to_fp32(out, n, q);
        return 0;
    }
    return leftover_pass(w, total, scale, small, s, n, (size_t)remaining, out, q, top_hist);
}

/* The proposal draw from counts whose block sums are known: the first index
 * whose cumulative count exceeds u (dyadic.sample), scanning one block.
 * -1 if the counts do not sum to M. */
static int64_t draw_from_blocks(const int32_t *out, size_t n, const int64_t *blocks, int64_t u) {
    size_t nblocks = (n + BLOCK - 1) / BLOCK;
    int64_t total = 0;
    for (size_t b = 0; b < nblocks; b++) total += blocks[b];
    if (total != (int64_t)M24) return -1;
    int64_t acc = 0;
    size_t b = 0;
    while (acc + blocks[b] <= u) acc += blocks[b++];
    size_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
    for (size_t i = b * BLOCK; i < end; i++) {
        acc += out[i];
        if (acc > u) return (int64_t)i;
    }
    return -1; /* unreachable for counts that sum to M */
}

/* Lay out a row's key and idx scratch in `work` (at least 8 bytes per entry);
 * share (8 bytes per entry) holds the candidates' remainders. */
static void scratch_in(scratch_t *s, double *share, void *work, size_t n, int64_t *blocks) {
    s->rem = share;
    s->key = (uint16_t *)work;
    s->idx = (uint32_t *)((char *)work + ((2 * n + 3) & ~(size_t)3));
    s->blocks = blocks;
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
        size_t nblocks = (n + BLOCK - 1) / BLOCK;
        int64_t stack_blocks[STACK_BLOCKS];
        int64_t *blocks = nblocks <= STACK_BLOCKS ? stack_blocks
                                                  : (int64_t *)malloc(nblocks * sizeof(int64_t));
        if (blocks == NULL) {
            PyErr_NoMemory();
        } else {
            scratch_t s;
            scratch_in(&s, (double *)sb.buf, kb.buf, n, blocks);
            Py_BEGIN_ALLOW_THREADS
            status = build_counts((const double *)wb.buf, n, total, (int32_t *)ob.buf, NULL, &s);
            Py_END_ALLOW_THREADS
            if (blocks != stack_blocks) free(blocks);
        }
    }
    PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&kb);
    if (status < 0) return NULL;
    return PyLong_FromLong(status);
}

/* build_rows(w, n, out, draws, tokens, status, share, work[, payloads])
 *     Every row of w (rows x n float64 weights, checked) gets its canonical
 *     total, its counts (allocate) and its proposal draw with draws[r]
 *     (int64): tokens[r] (int64) and status[r] (int32: 0 done, 1 or 2 as
 *     allocate, 3 counts not summing to M, 4 a draw outside [0, M)). share and
 *     work: float64 scratch of n entries each. out (int32) holds the counts:
 *     rows x n, or n reused by every row when payloads is given: a sequence
 *     of one writable buffer per row, of m >= n FP32 values each, that gets
 *     the row's wire values c / 2**24 followed by +0.0 (written for a row of
 *     status 0). The GIL is released for the whole batch. */
static PyObject *build_rows(PyObject *self, PyObject *args) {
    Py_buffer wb, ob, db, tb, stb, sb, kb;
    Py_ssize_t nn;
    PyObject *payloads = Py_None;
    if (!PyArg_ParseTuple(args, "y*nw*y*w*w*w*w*|O", &wb, &nn, &ob, &db, &tb, &stb, &sb, &kb,
                          &payloads))
        return NULL;
    size_t n = (size_t)(nn > 0 ? nn : 0);
    size_t rows = (size_t)db.len / 8;
    int shared_out = payloads != Py_None && (size_t)ob.len == 4 * n;
    int ok = nn > 0 && n <= 0xFFFFFFFFu && db.len % 8 == 0 && (size_t)wb.len == 8 * n * rows
             && (shared_out || (size_t)ob.len == 4 * n * rows) && (size_t)tb.len == 8 * rows
             && (size_t)stb.len == 4 * rows && (size_t)sb.len == 8 * n && (size_t)kb.len == 8 * n;
    int64_t stack_blocks[STACK_BLOCKS];
    int64_t *blocks = NULL;
    Py_buffer *qb = NULL;
    size_t held = 0; /* payload buffers acquired */
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "build_rows: buffer sizes do not match");
    } else if (payloads != Py_None) {
        PyObject *seq = PySequence_Fast(payloads, "build_rows: payloads must be a sequence");
        ok = seq != NULL && (size_t)PySequence_Fast_GET_SIZE(seq) == rows;
        if (seq != NULL && !ok)
            PyErr_SetString(PyExc_ValueError, "build_rows: one payload per row");
        if (ok) {
            qb = (Py_buffer *)PyMem_Calloc(rows ? rows : 1, sizeof(Py_buffer));
            ok = qb != NULL;
            if (!ok) PyErr_NoMemory();
        }
        for (; ok && held < rows; held++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)held);
            if (PyObject_GetBuffer(item, &qb[held], PyBUF_WRITABLE) < 0) {
                ok = 0;
                break;
            }
            if (qb[held].len % 4 || (size_t)qb[held].len < 4 * n) {
                PyErr_SetString(PyExc_ValueError, "build_rows: a payload holds fewer than n FP32");
                PyBuffer_Release(&qb[held]);
                ok = 0;
                break;
            }
        }
        Py_XDECREF(seq);
    }
    if (ok) {
        size_t nblocks = (n + BLOCK - 1) / BLOCK;
        blocks = nblocks <= STACK_BLOCKS ? stack_blocks
                                         : (int64_t *)malloc(nblocks * sizeof(int64_t));
        if (blocks == NULL) {
            ok = 0;
            PyErr_NoMemory();
        }
    }
    if (ok) {
        scratch_t s;
        scratch_in(&s, (double *)sb.buf, kb.buf, n, blocks);
        const double *w = (const double *)wb.buf;
        int32_t *out = (int32_t *)ob.buf;
        const int64_t *draws = (const int64_t *)db.buf;
        int64_t *tokens = (int64_t *)tb.buf;
        int32_t *status = (int32_t *)stb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (size_t r = 0; r < rows; r++) {
            const double *wr = w + r * n;
            int32_t *outr = shared_out ? out : out + r * n;
            float *q = qb != NULL ? (float *)qb[r].buf : NULL;
            int st = build_counts(wr, n, tree_root(wr, n), outr, q, &s);
            int64_t token = -1;
            if (st == 0) {
                if (draws[r] < 0 || draws[r] >= (int64_t)M24) {
                    st = 4;
                } else {
                    token = draw_from_blocks(outr, n, blocks, draws[r]);
                    if (token < 0) st = 3;
                }
            }
            if (st == 0 && q != NULL) memset(q + n, 0, (size_t)qb[r].len - 4 * n); /* +0.0 */
            status[r] = st;
            tokens[r] = token;
        }
        Py_END_ALLOW_THREADS
    }
    if (blocks != NULL && blocks != stack_blocks) free(blocks);
    for (size_t r = 0; r < held; r++) PyBuffer_Release(&qb[r]);
    PyMem_Free(qb);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&db);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&kb);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

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

/* sparse_candidates(x, top, scale, k, margin, idx) -> (count, x_out_max)
 *     Candidates for a sparse top-k support from one logits row x (finite or
 *     -inf; top its maximum): every index whose distance bucket is at most
 *     margin buckets past the bucket holding the k-th largest logit, ascending,
 *     into idx (int64); x_out_max is the largest logit not taken (-inf if
 *     none). The caller proves the top-k weights lie among the candidates
 *     (x_out_max's weight below the k-th candidate weight) or falls back.
 *     count -1: no useful cut (a scale that is not finite and positive, the
 *     k-th logit in the last bucket, fewer than k entries, or more candidates
 *     than idx holds). */
static PyObject *sparse_candidates(PyObject *self, PyObject *args) {
    Py_buffer xb, ib;
    double top, scale;
    Py_ssize_t k, margin;
    if (!PyArg_ParseTuple(args, "y*ddnnw*", &xb, &top, &scale, &k, &margin, &ib)) return NULL;
    if (xb.len % 8 || ib.len % 8 || k < 1 || margin < 0) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&ib);
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
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ib);
    return Py_BuildValue("(nd)", count, out_max);
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
    {"build_rows", build_rows, METH_VARARGS,
     "build_rows(w, n, out, draws, tokens, status, share, work[, payloads]) -> None"},
    {"sparse_candidates", sparse_candidates, METH_VARARGS,
     "sparse_candidates(x, top, scale, k, margin, idx) -> (count, x_out_max)"},
    {"scan_dense", scan_dense, METH_VARARGS, "scan_dense(row) -> (max_bits, count_sum, non_integral)"},
    {"check_sparse", check_sparse, METH_VARARGS,
     "check_sparse(ids, q, vocab, max_k, proposed) -> 0 or the first failing error code"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastq", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastq(void) { return PyModule_Create(&module); }
