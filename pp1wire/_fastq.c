/*
 * Optional compiled fast paths for pp1wire.dyadic.
 *
 * The function computes exactly what the numpy path in dyadic.py computes,
 * in one pass instead of six, and is qualified against it
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
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

static PyMethodDef methods[] = {
    {"scan_dense", scan_dense, METH_VARARGS, "scan_dense(row) -> (max_bits, count_sum, non_integral)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastq", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastq(void) { return PyModule_Create(&module); }
