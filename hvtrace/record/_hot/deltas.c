/* hvtrace/record/_hot/deltas.c: deltas_into, the counters' deltas of a batch of readings;
 * rows_into and syncs_into, the writer's columns of a batch's rows and allreduce calls; and
 * window_into, the live thread's matrix of a window's steps (those deltas among them). Part
 * of hvtrace/record/_hot.c (included there before module.c); not compiled alone.
 * Python twins: hvtrace.record.cpustat._deltas_py (chosen between them by
 * hvtrace.record.cpustat.deltas_columns), hvtrace.record.writer.BatchEncoder._row_columns_py
 * (by BatchEncoder._row_columns), writer._call_times_py (by writer._call_times) and
 * hvtrace.record.live._step_matrix_py (by live.step_matrix).
 *
 * Off the hot path, but on a thread of the training process holding the GIL: the writer thread
 * (each flush's rows) and the live thread (each chunk of steps) both turn every phase row's two
 * readings into a CPU time and a run-queue wait. In Python that is a loop over the rows that
 * parses each schedstat line once (about 40 % of the live thread's reduction, 20 % of the
 * writer's encoding); here it is one pass of C. A reading is None (not read), an int (the CPU
 * clock only) or a tuple (the CPU clock, the schedstat line as bytes); the deltas are as the twin
 * defines them (cpustat.deltas_columns). Anything else, or a line that is not three fields of
 * digits, and it returns False having filled nothing reliable: the caller runs the twin, which
 * decides what such a reading means (or raises), so both forms give the same columns or error.
 */

static inline int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* The run-queue wait (the second field) of a schedstat line, or -1 where it is not
 * ``digits digits digits`` with ASCII white space around (what the kernel writes). */
static long long schedstat_runq(PyObject *raw) {
    if (!PyBytes_CheckExact(raw)) return -1;
    const char *p = PyBytes_AS_STRING(raw), *end = p + PyBytes_GET_SIZE(raw);
    long long field[3];
    int k = 0;
    while (1) {
        while (p < end && is_space(*p)) p++;
        if (p == end) break;
        if (k == 3 || *p < '0' || *p > '9') return -1;
        long long v = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            if (v > (LLONG_MAX - 9) / 10) return -1;
            v = v * 10 + (*p++ - '0');
        }
        if (p < end && !is_space(*p)) return -1;
        field[k++] = v;
    }
    return k == 3 ? field[1] : -1;
}

/* An int field of a row into ``*v`` within [lo, hi]: 0, or -1 where it is not an int there. */
static int int_field(PyObject *o, long long lo, long long hi, long long *v) {
    if (!PyLong_CheckExact(o)) return -1;
    int overflow = 0;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (*v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return (*v < lo || *v > hi) ? -1 : 0;
}

/* An int into ``*v`` as a double (as numpy converts one: a value, a step number or count of a
 * window row): 0, or -1 where it is not an int (or too large for a double). */
static int as_double(PyObject *o, double *v) {
    if (!PyLong_CheckExact(o)) return -1;
    *v = PyLong_AsDouble(o);
    if (*v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* One reading's CPU clock (1) and its line (NULL: none), 0 where it is None, -1 otherwise. */
static int reading_parts(PyObject *r, long long *cpu, PyObject **line) {
    *line = NULL;
    if (r == Py_None) return 0;
    PyObject *c = r;
    if (PyTuple_CheckExact(r)) {
        if (PyTuple_GET_SIZE(r) != 2) return -1;
        c = PyTuple_GET_ITEM(r, 0);
        *line = PyTuple_GET_ITEM(r, 1);
    }
    return int_field(c, LLONG_MIN, LLONG_MAX, cpu) < 0 ? -1 : 1;
}

static int writable(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != itemsize || view->len != itemsize * n) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a column has the wrong size");
        return -1;
    }
    return 0;
}

/* The last two schedstat lines parsed: readings that found the line unchanged share it. */
typedef struct {
    PyObject *seen[2]; /* borrowed: the caller's list holds them for the call */
    long long value[2];
    int slot;
} LineMemo;

static long long memo_runq(LineMemo *m, PyObject *line) {
    if (line == m->seen[0]) return m->value[0];
    if (line == m->seen[1]) return m->value[1];
    long long v = schedstat_runq(line);
    if (v >= 0) {
        m->seen[m->slot] = line;
        m->value[m->slot] = v;
        m->slot ^= 1;
    }
    return v;
}

/* The deltas between readings ``a`` and ``b`` into ``cpu``/``runq`` and their flags (left as
 * they are where not measured): 0, or -1 where a reading is not one this reads. */
static int pair_delta(PyObject *a, PyObject *b, LineMemo *m, long long *cpu, char *cpu_ok,
                      long long *runq, char *runq_ok) {
    long long c0, c1, c;
    PyObject *l0, *l1;
    int x = reading_parts(a, &c0, &l0), y = reading_parts(b, &c1, &l1);
    if (x < 0 || y < 0) return -1;
    if (!x || !y) return 0;
    if (__builtin_sub_overflow(c1, c0, &c)) return -1;
    if (c >= 0) {
        *cpu = c;
        *cpu_ok = 1;
    }
    if (l0 == NULL || l1 == NULL) return 0;
    long long r0 = memo_runq(m, l0);
    if (r0 < 0) return -1;
    long long r1 = memo_runq(m, l1);
    if (r1 < 0) return -1;
    if (r1 >= r0) {
        *runq = r1 - r0;
        *runq_ok = 1;
    }
    return 0;
}

/* Writable columns: ``n`` items of ``itemsize`` bytes each, C-contiguous. */
static int get_columns(PyObject **cols, Py_buffer *view, const Py_ssize_t *itemsize, int k,
                       Py_ssize_t n) {
    for (int i = 0; i < k; i++) {
        if (writable(cols[i], &view[i], itemsize[i], n) < 0) {
            while (i--) PyBuffer_Release(&view[i]);
            return -1;
        }
    }
    return 0;
}

/* deltas_into(pairs, cpu, runq, cpu_ok, runq_ok) -> bool: see the top of this file. ``pairs``:
 * a list of (start, end) readings; the four columns: writable, len(pairs) long, int64, int64,
 * bool, bool, zeroed by the caller. */
static PyObject *deltas_into(PyObject *module, PyObject *args) {
    PyObject *pairs, *cols[4];
    if (!PyArg_ParseTuple(args, "O!OOOO:deltas_into", &PyList_Type, &pairs, &cols[0], &cols[1],
                          &cols[2], &cols[3]))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    Py_buffer view[4];
    const Py_ssize_t size[4] = {8, 8, 1, 1};
    if (get_columns(cols, view, size, 4, n) < 0) return NULL;
    long long *cpu = view[0].buf, *runq = view[1].buf;
    char *cpu_ok = view[2].buf, *runq_ok = view[3].buf;
    LineMemo memo = {{NULL, NULL}, {0, 0}, 0};
    int ok = 1;
    for (Py_ssize_t j = 0; j < n && ok; j++) {
        PyObject *pair = PyList_GET_ITEM(pairs, j);
        ok = PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2 &&
             pair_delta(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), &memo, &cpu[j],
                        &cpu_ok[j], &runq[j], &runq_ok[j]) == 0;
    }
    for (int i = 0; i < 4; i++) PyBuffer_Release(&view[i]);
    return PyBool_FromLong(ok);
}

/* rows_into(rows, name_ids, names, step, micro, kind, name, start, end, nbytes, dtype, value,
 * flags, cpu, runq, cpu_ok, runq_ok) -> bool: the writer's columns of a batch's rows (tuples,
 * hvtrace.record.rows: ten fields, or twelve with the readings), as its Python form
 * (writer.BatchEncoder._row_columns) makes them: names interned into ``name_ids`` (a dict, str
 * -> id) and ``names`` (a list, in order of first appearance), the readings' deltas as
 * deltas_into's. False where a row is not one this reads (another length, a field of another
 * type or out of its column's range): the caller then runs the Python form on the whole batch
 * (the names this interned are the ones it would have, in the same order). */
static PyObject *rows_into(PyObject *module, PyObject *args) {
    PyObject *rows, *ids, *names, *cols[14];
    if (!PyArg_ParseTuple(args, "O!O!O!OOOOOOOOOOOOOO:rows_into", &PyList_Type, &rows,
                          &PyDict_Type, &ids, &PyList_Type, &names, &cols[0], &cols[1],
                          &cols[2], &cols[3], &cols[4], &cols[5], &cols[6], &cols[7], &cols[8],
                          &cols[9], &cols[10], &cols[11], &cols[12], &cols[13]))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows);
    Py_buffer view[14];
    const Py_ssize_t size[14] = {4, 2, 1, 4, 8, 8, 8, 1, 8, 1, 8, 8, 1, 1};
    if (get_columns(cols, view, size, 14, n) < 0) return NULL;
    int32_t *step = view[0].buf, *name = view[3].buf;
    int16_t *micro = view[1].buf;
    int8_t *kind = view[2].buf, *dtype = view[7].buf;
    int64_t *start = view[4].buf, *end = view[5].buf, *nbytes = view[6].buf;
    double *value = view[8].buf;
    uint8_t *flags = view[9].buf;
    long long *cpu = view[10].buf, *runq = view[11].buf;
    char *cpu_ok = view[12].buf, *runq_ok = view[13].buf;
    LineMemo memo = {{NULL, NULL}, {0, 0}, 0};
    int ok = 1;
    PyObject *result = NULL;
    for (Py_ssize_t j = 0; j < n && ok; j++) {
        PyObject *r = PyList_GET_ITEM(rows, j);
        ok = 0;
        if (!PyTuple_CheckExact(r)) break;
        Py_ssize_t len = PyTuple_GET_SIZE(r);
        if (len != 10 && len != 12) break;
        long long v[10];
        /* step, micro, kind, (name), start, end, bytes, dtype, (value), flags */
        if (int_field(PyTuple_GET_ITEM(r, 0), INT32_MIN, INT32_MAX, &v[0]) < 0 ||
            int_field(PyTuple_GET_ITEM(r, 1), INT16_MIN, INT16_MAX, &v[1]) < 0 ||
            int_field(PyTuple_GET_ITEM(r, 2), INT8_MIN, INT8_MAX, &v[2]) < 0 ||
            int_field(PyTuple_GET_ITEM(r, 4), LLONG_MIN, LLONG_MAX, &v[4]) < 0 ||
            int_field(PyTuple_GET_ITEM(r, 5), LLONG_MIN, LLONG_MAX, &v[5]) < 0 ||
            int_field(PyTuple_GET_ITEM(r, 6), LLONG_MIN, LLONG_MAX, &v[6]) < 0 ||
            int_field(PyTuple_GET_ITEM(r, 7), INT8_MIN, INT8_MAX, &v[7]) < 0 ||
            int_field(PyTuple_GET_ITEM(r, 9), 0, UINT8_MAX, &v[9]) < 0)
            break;
        PyObject *val = PyTuple_GET_ITEM(r, 8);
        double d;
        if (PyFloat_CheckExact(val))
            d = PyFloat_AS_DOUBLE(val);
        else if (as_double(val, &d) < 0)
            break;
        PyObject *nm = PyTuple_GET_ITEM(r, 3);
        if (!PyUnicode_CheckExact(nm)) break;
        PyObject *id = PyDict_GetItemWithError(ids, nm);
        long long name_id;
        if (id == NULL) {
            if (PyErr_Occurred()) goto done;
            Py_ssize_t k = PyList_GET_SIZE(names);
            PyObject *kid = PyLong_FromSsize_t(k);
            if (kid == NULL) goto done;
            int bad = PyDict_SetItem(ids, nm, kid) < 0 || PyList_Append(names, nm) < 0;
            Py_DECREF(kid);
            if (bad) goto done;
            name_id = k;
        } else if (int_field(id, INT32_MIN, INT32_MAX, &name_id) < 0) {
            break;
        }
        if (len == 12 && pair_delta(PyTuple_GET_ITEM(r, 10), PyTuple_GET_ITEM(r, 11), &memo,
                                    &cpu[j], &cpu_ok[j], &runq[j], &runq_ok[j]) < 0)
            break;
        step[j] = (int32_t)v[0];
        micro[j] = (int16_t)v[1];
        kind[j] = (int8_t)v[2];
        name[j] = (int32_t)name_id;
        start[j] = v[4];
        end[j] = v[5];
        nbytes[j] = v[6];
        dtype[j] = (int8_t)v[7];
        value[j] = d;
        flags[j] = (uint8_t)v[9];
        ok = 1;
    }
    result = PyBool_FromLong(ok);
done:
    for (int i = 0; i < 14; i++) PyBuffer_Release(&view[i]);
    return result;
}

/* syncs_into(syncs, start, stop) -> bool: the start and end token (host ns) of every enqueued
 * allreduce call of ``syncs`` (hvtrace.record.rows.Allreduces, one after another), as the
 * writer's Python form makes them (writer.BatchEncoder._call_times_py): a call ends at its
 * handle's first observed completion (rows.call_ends), else at its synchronize's end. The two
 * columns: int64, as long as the calls. False where a token or entry is not one this reads. */
static PyObject *syncs_into(PyObject *module, PyObject *args) {
    PyObject *syncs, *cols[2];
    if (!PyArg_ParseTuple(args, "O!OO:syncs_into", &PyList_Type, &syncs, &cols[0], &cols[1]))
        return NULL;
    Py_ssize_t calls = 0, n = PyList_GET_SIZE(syncs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(syncs, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 7 ||
            !PyList_CheckExact(PyTuple_GET_ITEM(e, 3)) ||
            !PyList_CheckExact(PyTuple_GET_ITEM(e, 4)))
            Py_RETURN_FALSE;
        calls += PyList_GET_SIZE(PyTuple_GET_ITEM(e, 3));
    }
    Py_buffer view[2];
    const Py_ssize_t size[2] = {8, 8};
    if (get_columns(cols, view, size, 2, calls) < 0) return NULL;
    int64_t *start = view[0].buf, *stop = view[1].buf;
    PyObject *ends = PyDict_New();
    int ok = ends != NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *e = PyList_GET_ITEM(syncs, i);
        PyObject *enq = PyTuple_GET_ITEM(e, 3), *done = PyTuple_GET_ITEM(e, 4);
        PyObject *end = PyTuple_GET_ITEM(e, 5);
        PyDict_Clear(ends);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(done) && ok; j++) {
            PyObject *d = PyList_GET_ITEM(done, j);
            ok = PyTuple_CheckExact(d) && PyTuple_GET_SIZE(d) == 2 &&
                 PyDict_SetDefault(ends, PyTuple_GET_ITEM(d, 0), PyTuple_GET_ITEM(d, 1)) != NULL;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(enq) && ok; j++, k++) {
            PyObject *c = PyList_GET_ITEM(enq, j);
            long long t0, t1;
            ok = 0;
            if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 3) break;
            PyObject *h = PyTuple_GET_ITEM(c, 2);
            if (PyTuple_CheckExact(h)) {
                if (PyTuple_GET_SIZE(h) < 1) break;
                h = PyTuple_GET_ITEM(h, 0);
            }
            PyObject *t = PyDict_GetItemWithError(ends, h);
            if (t == NULL && PyErr_Occurred()) break;
            if (int_field(PyTuple_GET_ITEM(c, 0), LLONG_MIN, LLONG_MAX, &t0) < 0 ||
                int_field(t != NULL ? t : end, LLONG_MIN, LLONG_MAX, &t1) < 0)
                break;
            start[k] = t0;
            stop[k] = t1;
            ok = 1;
        }
    }
    if (PyErr_Occurred()) PyErr_Clear(); /* an unhashable handle: the Python form raises it */
    Py_XDECREF(ends);
    for (int i = 0; i < 2; i++) PyBuffer_Release(&view[i]);
    return PyBool_FromLong(ok);
}

/* Add ``v`` to a matrix cell that is NaN until a value reaches it. */
static inline void cell_add(double *cell, double v) {
    if (isnan(*cell)) *cell = 0.0;
    *cell += v;
}

/* window_into(window, out, codes, k_forward, k_backward, allreduces, offset_ns,
 * arrival_col, count_col) -> bool: a live window's per-step matrix (hvtrace.record.live.
 * step_matrix) into ``out`` (float64, len(window) x columns, C-contiguous, all NaN), as its
 * Python form (live._step_matrix_py) makes it: per step, its phase rows' durations, CPU time and
 * run-queue wait summed per phase (``codes``: a dict, kind code -> phase index; a phase's three
 * columns from 1 + 3 x index), its step number, its last allreduce enqueue (on rank 0's clock:
 * less ``offset_ns``) and its counts (allreduced tensors, collectives outside the optimizer,
 * forward and backward passes). False where an entry is not one this reads (``out`` is then
 * left part-filled: the caller runs the Python form on a new one). */
static PyObject *window_into(PyObject *module, PyObject *args) {
    PyObject *window, *out, *codes, *ar_type;
    long long k_fwd, k_bwd, offset;
    Py_ssize_t arrival_col, count_col;
    if (!PyArg_ParseTuple(args, "O!OO!LLOLnn:window_into", &PyList_Type, &window, &out,
                          &PyDict_Type, &codes, &k_fwd, &k_bwd, &ar_type, &offset, &arrival_col,
                          &count_col))
        return NULL;
    if (!PyType_Check(ar_type)) {
        PyErr_SetString(PyExc_TypeError, "window_into: allreduces must be a type");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(window);
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    Py_ssize_t ncols = n ? view.len / (Py_ssize_t)sizeof(double) / n : 0;
    if (view.itemsize != sizeof(double) || (view.format && strcmp(view.format, "d") != 0) ||
        view.len != n * ncols * (Py_ssize_t)sizeof(double) || (n && (count_col + 4 > ncols ||
        arrival_col >= ncols))) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "window_into: the matrix has the wrong shape");
        return NULL;
    }
    double *m = view.buf;
    LineMemo memo = {{NULL, NULL}, {0, 0}, 0};
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        double *row = m + i * ncols;
        PyObject *rows = PyList_GET_ITEM(window, i), *n_coll_obj = NULL;
        if (PyTuple_CheckExact(rows)) {
            if (PyTuple_GET_SIZE(rows) != 2) {
                ok = 0;
                break;
            }
            n_coll_obj = PyTuple_GET_ITEM(rows, 1);
            rows = PyTuple_GET_ITEM(rows, 0);
        }
        if (!PyList_CheckExact(rows)) {
            ok = 0;
            break;
        }
        double n_coll = 0.0;
        if (n_coll_obj != NULL && as_double(n_coll_obj, &n_coll) < 0) {
            ok = 0;
            break;
        }
        long long arrival = -1, n_ar = 0, n_fwd = 0, n_bwd = 0;
        Py_ssize_t len = PyList_GET_SIZE(rows);
        for (Py_ssize_t k = 0; k < len && ok; k++) {
            PyObject *e = PyList_GET_ITEM(rows, k);
            if (PyTuple_CheckExact(e)) {
                Py_ssize_t el = PyTuple_GET_SIZE(e);
                ok = 0;
                if (el < 3) break;
                PyObject *j_obj = PyDict_GetItemWithError(codes, PyTuple_GET_ITEM(e, 2));
                if (j_obj == NULL) {
                    if (PyErr_Occurred()) break;
                    ok = 1;
                    continue;
                }
                long long kind, j, t0, t1, dur;
                double step;
                if (el != 10 && el < 12) break;
                if (int_field(PyTuple_GET_ITEM(e, 2), LLONG_MIN, LLONG_MAX, &kind) < 0 ||
                    int_field(j_obj, 0, (ncols - 4) / 3, &j) < 0 || 3 + 3 * j >= ncols ||
                    int_field(PyTuple_GET_ITEM(e, 4), LLONG_MIN, LLONG_MAX, &t0) < 0 ||
                    int_field(PyTuple_GET_ITEM(e, 5), LLONG_MIN, LLONG_MAX, &t1) < 0 ||
                    __builtin_sub_overflow(t1, t0, &dur) ||
                    as_double(PyTuple_GET_ITEM(e, 0), &step) < 0)
                    break;
                long long cpu = 0, runq = 0;
                char cpu_ok = 0, runq_ok = 0;
                if (el >= 12 && pair_delta(PyTuple_GET_ITEM(e, 10), PyTuple_GET_ITEM(e, 11),
                                           &memo, &cpu, &cpu_ok, &runq, &runq_ok) < 0)
                    break;
                if (kind == k_fwd) n_fwd++;
                else if (kind == k_bwd) n_bwd++;
                cell_add(&row[1 + 3 * j], (double)dur);
                if (cpu_ok) cell_add(&row[2 + 3 * j], (double)cpu);
                if (runq_ok) cell_add(&row[3 + 3 * j], (double)runq);
                row[0] = step;
                ok = 1;
            } else if (PyObject_TypeCheck(e, (PyTypeObject *)ar_type)) {
                ok = 0;
                if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 7) break;
                PyObject *enq = PyTuple_GET_ITEM(e, 3), *meta = PyTuple_GET_ITEM(e, 6);
                if (!PyList_CheckExact(enq) || !PyDict_CheckExact(meta)) break;
                Py_ssize_t c = 0, nc = PyList_GET_SIZE(enq);
                for (; c < nc; c++) {
                    PyObject *call = PyList_GET_ITEM(enq, c);
                    if (!PyTuple_CheckExact(call) || PyTuple_GET_SIZE(call) != 3) break;
                    PyObject *t = PyTuple_GET_ITEM(call, 0);
                    long long tv;
                    if (PyLong_CheckExact(t)) {
                        if (int_field(t, LLONG_MIN, LLONG_MAX, &tv) < 0) break;
                        if (tv > arrival) arrival = tv;
                    }
                    PyObject *info = PyDict_GetItemWithError(meta, PyTuple_GET_ITEM(call, 1));
                    if (info == NULL) {
                        if (PyErr_Occurred()) break;
                        n_ar += 1;
                        continue;
                    }
                    if (!PyTuple_CheckExact(info) || PyTuple_GET_SIZE(info) < 1) break;
                    Py_ssize_t names = PyObject_Length(PyTuple_GET_ITEM(info, 0));
                    if (names < 0) break;
                    n_ar += names;
                }
                if (c < nc) break;
                ok = 1;
            }
        }
        if (!ok) break;
        if (len) {
            row[count_col] = (double)n_ar;
            row[count_col + 1] = n_coll;
            row[count_col + 2] = (double)n_fwd;
            row[count_col + 3] = (double)n_bwd;
        }
        long long a;
        if (arrival >= 0) {
            if (__builtin_sub_overflow(arrival, offset, &a)) {
                ok = 0;
                break;
            }
            row[arrival_col] = (double)a;
        }
    }
    if (PyErr_Occurred()) PyErr_Clear(); /* the Python form raises what it raises */
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}
