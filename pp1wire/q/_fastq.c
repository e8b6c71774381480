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

static PyMethodDef methods[] = {
    {"scan_dense", scan_dense, METH_VARARGS, "scan_dense(row) -> (max_bits, count_sum, non_integral)"},
    {"check_sparse", check_sparse, METH_VARARGS,
     "check_sparse(ids, q, vocab, max_k, proposed) -> 0 or the first failing error code"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastq", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastq(void) { return PyModule_Create(&module); }
