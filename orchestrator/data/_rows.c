/* Columns to rows: the streamed reader's decode (orchestrator/data/stream_reader.py).
 *
 * rows_from_columns(columns, out, mean, std, dest=None) writes float32 columns (each a buffer
 * of n values) as rows of `out` (row-major float32, len(columns) values a row), each value
 * (v - mean[c]) / std[c] when mean and std are given (buffers of len(columns) float32, or
 * None). Row r goes to row r of `out`, or with `dest` (n int64) to row dest[r], nowhere when
 * dest[r] < 0: the window's shuffle and its held-out rows in the same pass, not a gather of a
 * copy after it. The same float32 operations, in the same order, as numpy's
 * `x -= mean; x /= std`: the two paths give the same bits (tests/test_streaming.py).
 *
 * Why compiled: numpy writes a column into rows one value at a time with a stride of the
 * row's width; here 4 rows of 4 columns are transposed in registers, and each row is whole
 * while it is in the cache. The GIL is released, so the read threads go on meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <xmmintrin.h>
#endif


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

typedef struct {
    float *out;
    Py_ssize_t ncols;
    const long long *dest; /* NULL: row r to row r */
    float *scratch;        /* where a row that goes nowhere is written */
} Target;

static inline float *row_of(const Target *t, Py_ssize_t r) {
    if (t->dest == NULL)
        return t->out + r * t->ncols;
    return t->dest[r] < 0 ? t->scratch : t->out + t->dest[r] * t->ncols;
}

static inline void scale_row(float *row, Py_ssize_t from, Py_ssize_t to, const float *mean,
                             const float *std) {
    for (Py_ssize_t c = from; c < to; c++) {
        float v = row[c] - mean[c];
        row[c] = v / std[c];
    }
}

/* Rows r0..r1, columns c0..c1, one value at a time (the tails). */
static void transpose_scalar(const float **cols, const Target *t, Py_ssize_t r0, Py_ssize_t r1,
                             Py_ssize_t c0, Py_ssize_t c1, const float *mean, const float *std) {
    for (Py_ssize_t r = r0; r < r1; r++) {
        float *row = row_of(t, r);
        for (Py_ssize_t c = c0; c < c1; c++)
            row[c] = cols[c][r];
        if (mean != NULL)
            scale_row(row, c0, c1, mean, std);
    }
}

static void transpose(const float **cols, const Target *t, Py_ssize_t n, const float *mean,
                      const float *std) {
    Py_ssize_t ncols = t->ncols, whole_rows = n - n % 4, whole_cols = 0;
#if defined(__SSE2__)
    /* 4 rows of 4 columns at a time: four loads, a transpose in registers, the scaling on
       4 values at once, four stores; the same IEEE float32 operations as the scalar path */
    whole_cols = ncols - ncols % 4;
    /* Rows shuffled into place (dest) go around the cache where every row starts 16-byte
       aligned: they land all over `out` and are read steps later, so fetching their lines
       first only adds traffic (0.82 of the time on this machine; in order, it was slower). */
    int stream = t->dest != NULL && ncols % 4 == 0 && (uintptr_t)t->out % 16 == 0 &&
                 (uintptr_t)t->scratch % 16 == 0;
    for (Py_ssize_t r = 0; r < whole_rows; r += 4) {
        float *a_row = row_of(t, r), *b_row = row_of(t, r + 1);
        float *d_row = row_of(t, r + 2), *e_row = row_of(t, r + 3);
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
            if (stream) {
                _mm_stream_ps(a_row + c, a);
                _mm_stream_ps(b_row + c, b);
                _mm_stream_ps(d_row + c, d);
                _mm_stream_ps(e_row + c, e);
            } else {
                _mm_storeu_ps(a_row + c, a);
                _mm_storeu_ps(b_row + c, b);
                _mm_storeu_ps(d_row + c, d);
                _mm_storeu_ps(e_row + c, e);
            }
        }
    }
    _mm_sfence(); /* the streamed stores land before the tails' and the caller's reads */
#endif
    transpose_scalar(cols, t, 0, whole_rows, whole_cols, ncols, mean, std); /* columns left */
    transpose_scalar(cols, t, whole_rows, n, 0, ncols, mean, std);          /* rows left */
}

static PyObject *rows_from_columns(PyObject *self, PyObject *args) {
    PyObject *columns, *out_obj, *mean_obj, *std_obj, *dest_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OOOO|O", &columns, &out_obj, &mean_obj, &std_obj, &dest_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(columns, "columns: a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t ncols = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(ncols ? ncols : 1, sizeof(Py_buffer));
    const float **cols = PyMem_Calloc(ncols ? ncols : 1, sizeof(float *));
    Py_buffer out = {0}, mean = {0}, std = {0}, dest = {0};
    int have_out = 0, have_mean = 0, have_std = 0, have_dest = 0;
    float *scratch = NULL;
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
    Py_ssize_t out_rows = ncols ? out.len / 4 / ncols : 0;
    if (dest_obj == Py_None ? out.len / 4 != n * ncols : out.len / 4 != out_rows * ncols) {
        PyErr_SetString(PyExc_ValueError, "out: whole rows of len(columns) values are needed");
        goto done;
    }
    if (dest_obj != Py_None) {
        if (PyObject_GetBuffer(dest_obj, &dest, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        have_dest = 1;
        if (dest.itemsize != 8 || dest.format == NULL ||
            (strcmp(dest.format, "l") != 0 && strcmp(dest.format, "q") != 0) ||
            dest.len / 8 != n) {
            PyErr_SetString(PyExc_TypeError, "dest: an int64 buffer of one value per row");
            goto done;
        }
        const long long *d = (const long long *)dest.buf;
        for (Py_ssize_t r = 0; r < n; r++)
            if (d[r] >= out_rows) {  /* a row past the end would write outside `out` */
                PyErr_SetString(PyExc_ValueError, "dest: a row past the end of out");
                goto done;
            }
        scratch = PyMem_Malloc((ncols ? ncols : 1) * sizeof(float));
        if (scratch == NULL) {
            PyErr_NoMemory();
            goto done;
        }
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
    Target target = {(float *)out.buf, ncols, have_dest ? (const long long *)dest.buf : NULL,
                     scratch};
    Py_BEGIN_ALLOW_THREADS
    transpose(cols, &target, n, have_mean ? (const float *)mean.buf : NULL,
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
    if (have_dest)
        PyBuffer_Release(&dest);
    PyMem_Free(scratch);
    PyMem_Free(views);
    PyMem_Free(cols);
    Py_DECREF(seq);
    return result;
}

/* held_out(row_ids, key, fraction, out): out[i] = 1 where row_ids[i] falls in the test split,
 * the same SplitMix64 hash and comparison as orchestrator/data/row_split.py's numpy path (one
 * pass, not eight over the group). key is the seed's own hash. */
static inline unsigned long long splitmix_finish(unsigned long long x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static PyObject *held_out(PyObject *self, PyObject *args) {
    PyObject *ids_obj, *out_obj;
    unsigned long long key;
    double fraction;
    if (!PyArg_ParseTuple(args, "OKdO", &ids_obj, &key, &fraction, &out_obj))
        return NULL;
    Py_buffer ids = {0}, out = {0};
    if (PyObject_GetBuffer(ids_obj, &ids, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = ids.len / 8;
    if (ids.itemsize != 8 || ids.format == NULL ||
        (strcmp(ids.format, "l") != 0 && strcmp(ids.format, "q") != 0)) {
        PyErr_SetString(PyExc_TypeError, "row_ids: an int64 buffer");
    } else if (out.itemsize != 1 || out.len != n || out.format == NULL || strcmp(out.format, "?") != 0) {
        PyErr_SetString(PyExc_TypeError, "out: a bool buffer of one value per row id");
    } else {
        const long long *id = (const long long *)ids.buf;
        unsigned char *mask = (unsigned char *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            unsigned long long h = splitmix_finish(((unsigned long long)id[i] + 0x9E3779B97F4A7C15ULL) ^ key);
            mask[i] = (double)(h >> 11) * (1.0 / 9007199254740992.0) < fraction;
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"held_out", held_out, METH_VARARGS,
     "held_out(row_ids, key, fraction, out): out[i] = whether row_ids[i] is held out."},
    {"rows_from_columns", rows_from_columns, METH_VARARGS,
     "rows_from_columns(columns, out, mean, std, dest=None): float32 columns into rows of "
     "`out` (row r to row dest[r], none when negative), each value (v - mean[c]) / std[c] "
     "when mean and std are given."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
