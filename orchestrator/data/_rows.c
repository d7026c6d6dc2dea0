/* Columns to rows: the streamed reader's decode (orchestrator/data/stream_reader.py).
 *
 * rows_from_columns(columns, out, mean, std) writes float32 columns (each a buffer of n
 * values) into `out`, a buffer of n * len(columns) float32 in row-major order, each value
 * (v - mean[c]) / std[c] when mean and std are given (buffers of len(columns) float32, or
 * None). The same float32 operations, in the same order, as numpy's `x -= mean; x /= std`:
 * the two paths give the same bits (tests/test_streaming.py).
 *
 * Why compiled: numpy writes a column into rows one value at a time with a stride of the
 * row's width; here a tile of TILE rows stays in the L1 cache while every column lands in
 * it (about 3x faster), and the GIL is released, so the read threads go on meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#define TILE 16

static int float32_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "%s: a float32 buffer is needed", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static inline void scale_row(float *row, Py_ssize_t from, Py_ssize_t to, const float *mean,
                             const float *std) {
    for (Py_ssize_t c = from; c < to; c++) {
        float v = row[c] - mean[c];
        row[c] = v / std[c];
    }
}

/* Rows r0..r1 (r1 - r0 <= TILE), columns c0..c1, one value at a time (the tails). */
static void transpose_scalar(const float **cols, Py_ssize_t ncols, Py_ssize_t r0, Py_ssize_t r1,
                             Py_ssize_t c0, Py_ssize_t c1, float *out, const float *mean,
                             const float *std) {
    for (Py_ssize_t c = c0; c < c1; c++) {
        const float *src = cols[c] + r0;
        float *dst = out + r0 * ncols + c;
        for (Py_ssize_t r = r0; r < r1; r++, src++, dst += ncols)
            *dst = *src;
    }
    if (mean != NULL)
        for (Py_ssize_t r = r0; r < r1; r++)
            scale_row(out + r * ncols, c0, c1, mean, std);
}

static void transpose(const float **cols, Py_ssize_t ncols, Py_ssize_t n, float *out,
                      const float *mean, const float *std) {
    Py_ssize_t whole_rows = n - n % 4, whole_cols = 0;
#if defined(__SSE2__)
    /* 4 rows of 4 columns at a time: four loads, a transpose in registers, the scaling on
       4 values at once, four stores; the same IEEE float32 operations as the scalar path */
    whole_cols = ncols - ncols % 4;
    for (Py_ssize_t r = 0; r < whole_rows; r += 4) {
        float *row = out + r * ncols;
        for (Py_ssize_t c = 0; c < whole_cols; c += 4) {
            __m128 a = _mm_loadu_ps(cols[c] + r), b = _mm_loadu_ps(cols[c + 1] + r);
            __m128 d = _mm_loadu_ps(cols[c + 2] + r), e = _mm_loadu_ps(cols[c + 3] + r);
            _MM_TRANSPOSE4_PS(a, b, d, e);
            if (mean != NULL) {
                __m128 m = _mm_loadu_ps(mean + c), s = _mm_loadu_ps(std + c);
                a = _mm_div_ps(_mm_sub_ps(a, m), s);
                b = _mm_div_ps(_mm_sub_ps(b, m), s);
                d = _mm_div_ps(_mm_sub_ps(d, m), s);
                e = _mm_div_ps(_mm_sub_ps(e, m), s);
            }
            _mm_storeu_ps(row + c, a);
            _mm_storeu_ps(row + ncols + c, b);
            _mm_storeu_ps(row + 2 * ncols + c, d);
            _mm_storeu_ps(row + 3 * ncols + c, e);
        }
    }
#endif
    for (Py_ssize_t r0 = 0; r0 < whole_rows; r0 += TILE) {  /* the columns left over */
        Py_ssize_t r1 = r0 + TILE < whole_rows ? r0 + TILE : whole_rows;
        transpose_scalar(cols, ncols, r0, r1, whole_cols, ncols, out, mean, std);
    }
    transpose_scalar(cols, ncols, whole_rows, n, 0, ncols, out, mean, std);  /* the rows left */
}

static PyObject *rows_from_columns(PyObject *self, PyObject *args) {
    PyObject *columns, *out_obj, *mean_obj, *std_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &columns, &out_obj, &mean_obj, &std_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(columns, "columns: a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t ncols = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(ncols ? ncols : 1, sizeof(Py_buffer));
    const float **cols = PyMem_Calloc(ncols ? ncols : 1, sizeof(float *));
    Py_buffer out = {0}, mean = {0}, std = {0};
    int have_out = 0, have_mean = 0, have_std = 0;
    Py_ssize_t got = 0, n = -1;
    PyObject *result = NULL;
    if (views == NULL || cols == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < ncols; got++) {
        if (float32_buffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], 0, "columns") < 0)
            goto done;
        Py_ssize_t len = views[got].len / 4;
        if (n >= 0 && len != n) {
            got++;
            PyErr_SetString(PyExc_ValueError, "columns: of different lengths");
            goto done;
        }
        n = len;
        cols[got] = (const float *)views[got].buf;
    }
    if (n < 0)
        n = 0;
    if (float32_buffer(out_obj, &out, 1, "out") < 0)
        goto done;
    have_out = 1;
    if (out.len / 4 != n * ncols) {
        PyErr_SetString(PyExc_ValueError, "out: rows * columns values are needed");
        goto done;
    }
    if ((mean_obj == Py_None) != (std_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "mean and std: both or neither");
        goto done;
    }
    if (mean_obj != Py_None) {
        if (float32_buffer(mean_obj, &mean, 0, "mean") < 0)
            goto done;
        have_mean = 1;
        if (float32_buffer(std_obj, &std, 0, "std") < 0)
            goto done;
        have_std = 1;
        if (mean.len / 4 != ncols || std.len / 4 != ncols) {
            PyErr_SetString(PyExc_ValueError, "mean and std: one value per column");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    transpose(cols, ncols, n, (float *)out.buf, have_mean ? (const float *)mean.buf : NULL,
              have_std ? (const float *)std.buf : NULL);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got && views != NULL; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
    if (have_out)
        PyBuffer_Release(&out);
    if (have_mean)
        PyBuffer_Release(&mean);
    if (have_std)
        PyBuffer_Release(&std);
    PyMem_Free(views);
    PyMem_Free(cols);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"rows_from_columns", rows_from_columns, METH_VARARGS,
     "rows_from_columns(columns, out, mean, std): float32 columns into row-major `out`, "
     "each value (v - mean[c]) / std[c] when mean and std are given."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
