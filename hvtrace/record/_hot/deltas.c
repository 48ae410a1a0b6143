/* hvtrace/record/_hot/deltas.c: deltas_into, the counters' deltas of a batch of readings;
 * rows_into and syncs_into, the writer's columns of a batch's rows and allreduce calls, and
 * entries_len and entries_into, the writer's columns of a whole batch in one pass; and
 * window_into, the live thread's matrix of a window's steps (those deltas among them). Part
 * of hvtrace/record/_hot.c (included there before module.c); not compiled alone.
 * Python twins: hvtrace.record.cpustat._deltas_py (chosen between them by
 * hvtrace.record.cpustat.deltas_columns), hvtrace.record.writer.BatchEncoder._row_columns_py
 * (by BatchEncoder._row_columns), writer._call_times_py (by writer._call_times), the Python
 * path of BatchEncoder.encode (entries_into's, chosen by BatchEncoder._compiled_columns) and
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

/* A C-contiguous column of ``n`` items of ``itemsize`` bytes (``flags``: PyBUF_WRITABLE, or 0
 * for one only read), else ValueError. */
static int column(PyObject *obj, Py_buffer *view, int flags, Py_ssize_t itemsize, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS) < 0) return -1;
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

/* Columns ``k`` of them, ``n`` items of ``itemsize[i]`` bytes each, C-contiguous (see column;
 * ``flags``: PyBUF_WRITABLE, or 0); on a failure none is held. */
static int get_columns(PyObject **cols, Py_buffer *view, const Py_ssize_t *itemsize, int k,
                       Py_ssize_t n, int flags) {
    for (int i = 0; i < k; i++) {
        if (column(cols[i], &view[i], flags, itemsize[i], n) < 0) {
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
    if (get_columns(cols, view, size, 4, n, PyBUF_WRITABLE) < 0) return NULL;
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

/* A batch's fourteen writer columns (writer._ROW_DTYPES), as C arrays. */
typedef struct {
    int32_t *step, *name;
    int16_t *micro;
    int8_t *kind, *dtype;
    int64_t *start, *end, *nbytes;
    double *value;
    uint8_t *flags;
    long long *cpu, *runq;
    char *cpu_ok, *runq_ok;
} RowCols;

/* The item sizes of the fourteen columns, in order. */
static const Py_ssize_t ROW_COL_SIZES[14] = {4, 2, 1, 4, 8, 8, 8, 1, 8, 1, 8, 8, 1, 1};

static RowCols row_cols(Py_buffer *view) {
    RowCols c = {view[0].buf, view[3].buf, view[1].buf, view[2].buf, view[7].buf,
                 view[4].buf, view[5].buf, view[6].buf, view[8].buf, view[9].buf,
                 view[10].buf, view[11].buf, view[12].buf, view[13].buf};
    return c;
}

/* A name's id in ``ids`` (a dict, str -> id), interned there and appended to ``names`` when new:
 * 0, 1 where it is not one this reads (an id out of range), -1 with an error set. */
static int name_id_of(PyObject *nm, PyObject *ids, PyObject *names, long long *name_id) {
    PyObject *id = PyDict_GetItemWithError(ids, nm);
    if (id == NULL) {
        if (PyErr_Occurred()) return -1;
        Py_ssize_t k = PyList_GET_SIZE(names);
        PyObject *kid = PyLong_FromSsize_t(k);
        if (kid == NULL) return -1;
        int bad = PyDict_SetItem(ids, nm, kid) < 0 || PyList_Append(names, nm) < 0;
        Py_DECREF(kid);
        if (bad) return -1;
        *name_id = k;
        return 0;
    }
    return int_field(id, INT32_MIN, INT32_MAX, name_id) < 0 ? 1 : 0;
}

/* Row ``r`` (a tuple, hvtrace.record.rows: ten fields, or twelve with the readings) into row
 * ``j`` of the columns, as writer.BatchEncoder._row_columns_py makes it (no reading: its four
 * counter cells zero and unmeasured): 1, 0 where it is not a row this reads (another length, a
 * field of another type or out of its column's range), -1 with an error set. */
static int row_into(PyObject *r, PyObject *ids, PyObject *names, LineMemo *memo, RowCols *c,
                    Py_ssize_t j) {
    if (!PyTuple_CheckExact(r)) return 0;
    Py_ssize_t len = PyTuple_GET_SIZE(r);
    if (len != 10 && len != 12) return 0;
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
        return 0;
    PyObject *val = PyTuple_GET_ITEM(r, 8);
    double d;
    if (PyFloat_CheckExact(val))
        d = PyFloat_AS_DOUBLE(val);
    else if (as_double(val, &d) < 0)
        return 0;
    PyObject *nm = PyTuple_GET_ITEM(r, 3);
    if (!PyUnicode_CheckExact(nm)) return 0;
    long long name_id;
    int got = name_id_of(nm, ids, names, &name_id);
    if (got != 0) return got < 0 ? -1 : 0;
    c->cpu[j] = c->runq[j] = 0;
    c->cpu_ok[j] = c->runq_ok[j] = 0;
    if (len == 12 && pair_delta(PyTuple_GET_ITEM(r, 10), PyTuple_GET_ITEM(r, 11), memo,
                                &c->cpu[j], &c->cpu_ok[j], &c->runq[j], &c->runq_ok[j]) < 0)
        return 0;
    c->step[j] = (int32_t)v[0];
    c->micro[j] = (int16_t)v[1];
    c->kind[j] = (int8_t)v[2];
    c->name[j] = (int32_t)name_id;
    c->start[j] = v[4];
    c->end[j] = v[5];
    c->nbytes[j] = v[6];
    c->dtype[j] = (int8_t)v[7];
    c->value[j] = d;
    c->flags[j] = (uint8_t)v[9];
    return 1;
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
    if (get_columns(cols, view, ROW_COL_SIZES, 14, n, PyBUF_WRITABLE) < 0) return NULL;
    RowCols c = row_cols(view);
    LineMemo memo = {{NULL, NULL}, {0, 0}, 0};
    int ok = 1;
    for (Py_ssize_t j = 0; j < n && ok == 1; j++)
        ok = row_into(PyList_GET_ITEM(rows, j), ids, names, &memo, &c, j);
    for (int i = 0; i < 14; i++) PyBuffer_Release(&view[i]);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

/* An entry of a batch that is an hvtrace.record.rows.Allreduces (a named tuple: step, micro,
 * flags, enqueued, done, end, meta) whose ``enqueued`` and ``done`` are lists, ``meta`` a dict. */
static int is_sync(PyObject *e) {
    return !PyTuple_CheckExact(e) && PyTuple_Check(e) && PyTuple_GET_SIZE(e) == 7 &&
           PyList_CheckExact(PyTuple_GET_ITEM(e, 3)) &&
           PyList_CheckExact(PyTuple_GET_ITEM(e, 4)) && PyDict_CheckExact(PyTuple_GET_ITEM(e, 6));
}

/* entries_len(entries, infos, tensors) -> int: the rows of a batch's ``entries`` (rows: tuples;
 * synchronizes: hvtrace.record.rows.Allreduces) where every synchronize's enqueued calls find,
 * in its ``meta``, the very ``infos`` (a list, by identity) whose tensor columns the writer holds
 * (``tensors`` of them: writer.BatchEncoder._tensor_columns, its last synchronize's); -1 where
 * one does not (the caller's Python form makes that batch, and holds its new columns) or an
 * entry is neither. */
static PyObject *entries_len(PyObject *module, PyObject *args) {
    PyObject *entries, *infos;
    Py_ssize_t tensors;
    if (!PyArg_ParseTuple(args, "O!O!n:entries_len", &PyList_Type, &entries, &PyList_Type,
                          &infos, &tensors))
        return NULL;
    Py_ssize_t n = 0, calls = PyList_GET_SIZE(infos);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++) {
        PyObject *e = PyList_GET_ITEM(entries, i);
        if (PyTuple_CheckExact(e)) {
            n++;
            continue;
        }
        if (!is_sync(e)) return PyLong_FromLong(-1);
        PyObject *enq = PyTuple_GET_ITEM(e, 3), *meta = PyTuple_GET_ITEM(e, 6);
        if (PyList_GET_SIZE(enq) != calls) return PyLong_FromLong(-1);
        for (Py_ssize_t j = 0; j < calls; j++) {
            PyObject *c = PyList_GET_ITEM(enq, j);
            if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 3) return PyLong_FromLong(-1);
            PyObject *info = PyDict_GetItemWithError(meta, PyTuple_GET_ITEM(c, 1));
            if (info != PyList_GET_ITEM(infos, j)) {
                PyErr_Clear(); /* an unhashable key: the Python form raises it */
                return PyLong_FromLong(-1);
            }
        }
        n += tensors;
    }
    return PyLong_FromSsize_t(n);
}

/* The tensor columns of a model's synchronize (writer.BatchEncoder._tensor_columns): per call,
 * its tensors; per tensor, its name id, bytes and dtype code. */
typedef struct {
    const int64_t *counts, *nbytes;
    const int32_t *names;
    const int8_t *dtypes;
    Py_ssize_t calls, tensors;
} TensorCols;

/* Synchronize ``e`` (checked by is_sync) into rows ``*j`` on, one per tensor, as
 * writer.BatchEncoder._allreduce_block makes them (each call's tensors from its enqueue to its
 * handle's first observed completion, else the synchronize's end; no counters), ``ends`` a
 * scratch dict: 1, 0 where it is not one this reads, -1 with an error set. */
static int sync_into(PyObject *e, const TensorCols *t, int8_t k_allreduce, PyObject *ends,
                     RowCols *c, Py_ssize_t *j, Py_ssize_t n) {
    long long step, micro, flags;
    if (int_field(PyTuple_GET_ITEM(e, 0), INT32_MIN, INT32_MAX, &step) < 0 ||
        int_field(PyTuple_GET_ITEM(e, 1), INT16_MIN, INT16_MAX, &micro) < 0 ||
        int_field(PyTuple_GET_ITEM(e, 2), 0, UINT8_MAX, &flags) < 0)
        return 0;
    PyObject *enq = PyTuple_GET_ITEM(e, 3), *done = PyTuple_GET_ITEM(e, 4);
    PyObject *end = PyTuple_GET_ITEM(e, 5);
    if (PyList_GET_SIZE(enq) != t->calls) return 0;
    PyDict_Clear(ends);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(done); i++) {
        PyObject *d = PyList_GET_ITEM(done, i);
        if (!PyTuple_CheckExact(d) || PyTuple_GET_SIZE(d) != 2) return 0;
        if (PyDict_SetDefault(ends, PyTuple_GET_ITEM(d, 0), PyTuple_GET_ITEM(d, 1)) == NULL) {
            PyErr_Clear(); /* an unhashable handle: the Python form raises it */
            return 0;
        }
    }
    Py_ssize_t k = 0; /* the tensor */
    for (Py_ssize_t i = 0; i < t->calls; i++) {
        PyObject *call = PyList_GET_ITEM(enq, i);
        if (!PyTuple_CheckExact(call) || PyTuple_GET_SIZE(call) != 3) return 0;
        PyObject *h = PyTuple_GET_ITEM(call, 2);
        if (PyTuple_CheckExact(h)) {
            if (PyTuple_GET_SIZE(h) < 1) return 0;
            h = PyTuple_GET_ITEM(h, 0);
        }
        PyObject *tok = PyDict_GetItemWithError(ends, h);
        if (tok == NULL && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        long long t0, t1;
        if (int_field(PyTuple_GET_ITEM(call, 0), LLONG_MIN, LLONG_MAX, &t0) < 0 ||
            int_field(tok != NULL ? tok : end, LLONG_MIN, LLONG_MAX, &t1) < 0)
            return 0;
        if (t->counts[i] < 0 || t->counts[i] > t->tensors - k || *j + t->counts[i] > n) return 0;
        for (int64_t m = 0; m < t->counts[i]; m++, k++) {
            Py_ssize_t r = (*j)++;
            c->step[r] = (int32_t)step;
            c->micro[r] = (int16_t)micro;
            c->kind[r] = k_allreduce;
            c->name[r] = t->names[k];
            c->start[r] = t0;
            c->end[r] = t1;
            c->nbytes[r] = t->nbytes[k];
            c->dtype[r] = t->dtypes[k];
            c->value[r] = Py_NAN;
            c->flags[r] = (uint8_t)flags;
            c->cpu[r] = c->runq[r] = 0;
            c->cpu_ok[r] = c->runq_ok[r] = 0;
        }
    }
    return k == t->tensors;
}

/* entries_into(entries, name_ids, names, counts, tensor_names, tensor_bytes, tensor_dtypes,
 * k_allreduce, *columns) -> bool: the writer's fourteen columns of a whole batch, rows and
 * synchronizes in their order, in one pass (what writer.BatchEncoder.encode's Python form makes
 * in several: rows_into's rows, a synchronize's rows from the tensor columns it holds, its
 * calls' times as syncs_into's, interleaved), the columns entries_len(...) rows long. False where
 * an entry is not one this reads (the caller runs the Python form on the batch). */
static PyObject *entries_into(PyObject *module, PyObject *args) {
    PyObject *entries, *ids, *names, *tcols[4], *cols[14];
    int k_allreduce;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOOiOOOOOOOOOOOOOO:entries_into", &PyList_Type,
                          &entries, &PyDict_Type, &ids, &PyList_Type, &names, &tcols[0],
                          &tcols[1], &tcols[2], &tcols[3], &k_allreduce, &cols[0], &cols[1],
                          &cols[2], &cols[3], &cols[4], &cols[5], &cols[6], &cols[7], &cols[8],
                          &cols[9], &cols[10], &cols[11], &cols[12], &cols[13]))
        return NULL;
    if (k_allreduce < INT8_MIN || k_allreduce > INT8_MAX) {
        PyErr_SetString(PyExc_ValueError, "entries_into: k_allreduce out of range");
        return NULL;
    }
    /* per call its tensors (int64); per tensor its name id (int32), bytes (int64), dtype (int8) */
    static const Py_ssize_t tensor_sizes[4] = {8, 4, 8, 1};
    Py_ssize_t calls = PyObject_Length(tcols[0]), tensors = PyObject_Length(tcols[1]);
    if (calls < 0 || tensors < 0) return NULL;
    Py_buffer tview[4];
    if (get_columns(tcols, tview, tensor_sizes, 1, calls, 0) < 0) return NULL;
    if (get_columns(tcols + 1, tview + 1, tensor_sizes + 1, 3, tensors, 0) < 0) {
        PyBuffer_Release(&tview[0]);
        return NULL;
    }
    TensorCols t = {tview[0].buf, tview[2].buf, tview[1].buf, tview[3].buf, calls, tensors};
    Py_ssize_t n = PyObject_Length(cols[0]);
    Py_buffer view[14];
    PyObject *ends = NULL, *result = NULL;
    if (n < 0 || get_columns(cols, view, ROW_COL_SIZES, 14, n, PyBUF_WRITABLE) < 0)
        goto release_t;
    if ((ends = PyDict_New()) == NULL) goto release;
    RowCols c = row_cols(view);
    LineMemo memo = {{NULL, NULL}, {0, 0}, 0};
    int ok = 1;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries) && ok == 1; i++) {
        PyObject *e = PyList_GET_ITEM(entries, i);
        if (PyTuple_CheckExact(e))
            ok = j < n ? row_into(e, ids, names, &memo, &c, j++) : 0;
        else
            ok = is_sync(e) ? sync_into(e, &t, (int8_t)k_allreduce, ends, &c, &j, n) : 0;
    }
    if (ok >= 0) result = PyBool_FromLong(ok == 1 && j == n);
release:
    Py_XDECREF(ends);
    for (int i = 0; i < 14; i++) PyBuffer_Release(&view[i]);
release_t:
    for (int i = 0; i < 4; i++) PyBuffer_Release(&tview[i]);
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
    if (get_columns(cols, view, size, 2, calls, PyBUF_WRITABLE) < 0) return NULL;
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
