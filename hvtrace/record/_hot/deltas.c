/* hvtrace/record/_hot/deltas.c: deltas_into, the counters' deltas of a batch of readings. Part
 * of hvtrace/record/_hot.c (included there before module.c); not compiled alone.
 * Python twin: hvtrace.record.cpustat._deltas_py (chosen between them by
 * hvtrace.record.cpustat.deltas_columns).
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

/* The run-queue wait (the second field) of a schedstat line, or -1 where it is not
 * ``digits digits digits`` with ASCII white space around (what the kernel writes). */
static long long schedstat_runq(PyObject *raw) {
    if (!PyBytes_CheckExact(raw)) return -1;
    const char *p = PyBytes_AS_STRING(raw), *end = p + PyBytes_GET_SIZE(raw);
    long long field[3];
    int k = 0;
    while (1) {
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == '\v' ||
                           *p == '\f'))
            p++;
        if (p == end) break;
        if (k == 3 || *p < '0' || *p > '9') return -1;
        long long v = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            if (v > (LLONG_MAX - 9) / 10) return -1;
            v = v * 10 + (*p++ - '0');
        }
        if (p < end && !(*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == '\v' ||
                         *p == '\f'))
            return -1;
        field[k++] = v;
    }
    return k == 3 ? field[1] : -1;
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
    if (!PyLong_CheckExact(c)) return -1;
    int overflow = 0;
    *cpu = PyLong_AsLongLongAndOverflow(c, &overflow);
    if (overflow || (*cpu == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return 1;
}

static int writable(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != itemsize || view->len != itemsize * n) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "deltas_into: a column has the wrong size");
        return -1;
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
    int got = 0;
    for (; got < 4; got++)
        if (writable(cols[got], &view[got], size[got], n) < 0) break;
    PyObject *result = NULL;
    if (got == 4) {
        long long *cpu = view[0].buf, *runq = view[1].buf;
        char *cpu_ok = view[2].buf, *runq_ok = view[3].buf;
        /* the last two lines parsed: readings that found the line unchanged share it */
        PyObject *seen[2] = {NULL, NULL};
        long long seen_v[2] = {0, 0};
        int slot = 0, ok = 1;
        for (Py_ssize_t j = 0; j < n && ok; j++) {
            PyObject *pair = PyList_GET_ITEM(pairs, j);
            if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
                ok = 0;
                break;
            }
            long long c0, c1;
            PyObject *l0, *l1;
            int a = reading_parts(PyTuple_GET_ITEM(pair, 0), &c0, &l0);
            int b = reading_parts(PyTuple_GET_ITEM(pair, 1), &c1, &l1);
            if (a < 0 || b < 0) {
                ok = 0;
                break;
            }
            if (!a || !b) continue;
            long long c;
            if (__builtin_sub_overflow(c1, c0, &c)) {
                ok = 0;
                break;
            }
            if (c >= 0) {
                cpu[j] = c;
                cpu_ok[j] = 1;
            }
            if (l0 == NULL || l1 == NULL) continue;
            long long r[2] = {-1, -1};
            PyObject *line[2] = {l0, l1};
            for (int i = 0; i < 2; i++) {
                if (line[i] == seen[0]) {
                    r[i] = seen_v[0];
                } else if (line[i] == seen[1]) {
                    r[i] = seen_v[1];
                } else {
                    r[i] = schedstat_runq(line[i]);
                    if (r[i] < 0) break;
                    seen[slot] = line[i]; /* borrowed: ``pairs`` holds it for this call */
                    seen_v[slot] = r[i];
                    slot ^= 1;
                }
            }
            if (r[0] < 0 || r[1] < 0) {
                ok = 0;
                break;
            }
            if (r[1] >= r[0]) {
                runq[j] = r[1] - r[0];
                runq_ok[j] = 1;
            }
        }
        result = PyBool_FromLong(ok);
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&view[i]);
    return result;
}
