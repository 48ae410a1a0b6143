/* hvtrace/record/_hot/lr_rows.c: the learning-rate rows of the consistency checks' common step,
 * written by the compiled step() itself (Phases_step, phases.c). Part of hvtrace/record/_hot.c
 * (included there after phases.c); not compiled alone.
 * Python twin: hvtrace.record.hot.LrRows.on_step (ConsistencyChecks.on_step), whose common case
 * this is; in any other case c_step calls it.
 */

/* An attribute of o as a C long long (-1 with an error). */
static int attr_ll(PyObject *o, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* ConsistencyChecks.on_step(step) (hvtrace/record/consistency.py) in its common case, without
 * calling Python: no parameter fingerprints due this step (``every`` 0 or ``step`` not a multiple
 * of it), none pending, the param groups as many as when their row names were made, every
 * learning rate a float. Appends the rows on_step would (one per group) to the step's rows.
 * 1: done; 0: not the common case, nothing appended (call on_step); -1: an error. */
static int ph_lr_rows(Phases *s, PyObject *checks, PyObject *step) {
    long long every, n_groups, step_ll = PyLong_AsLongLong(step);
    if (step_ll == -1 && PyErr_Occurred()) return -1;
    if (attr_ll(checks, s_every, &every) < 0 || attr_ll(checks, s_n_groups, &n_groups) < 0)
        return -1;
    if (every && step_ll % every == 0) return 0;
    PyObject *pending = PyObject_GetAttr(checks, s_pending);
    if (pending == NULL) return -1;
    Py_ssize_t n_pending = PyObject_Size(pending);
    Py_DECREF(pending);
    if (n_pending != 0) return n_pending < 0 ? -1 : 0;
    PyObject *groups = PyObject_GetAttr(checks, s_groups), *names = NULL, *micro = NULL,
             *t = NULL, *rows = NULL;
    int rc = 0;
    if (groups == NULL || (names = PyObject_GetAttr(checks, s_lr_names)) == NULL) {
        rc = -1;
        goto out;
    }
    if (!PyList_CheckExact(groups) || !PyList_CheckExact(names) || !PyList_CheckExact(s->rows) ||
        PyList_GET_SIZE(groups) != n_groups || PyList_GET_SIZE(names) != n_groups)
        goto out;
    rows = Py_NewRef(s->rows);
    if ((micro = PyObject_GetAttr(OR_NONE(s->rec), s_micro)) == NULL ||
        (t = PyLong_FromLongLong(mono_ns())) == NULL) {
        rc = -1;
        goto out;
    }
    for (Py_ssize_t i = 0; i < n_groups; i++) { /* every learning rate a float, or on_step */
        PyObject *g = PyList_GET_ITEM(groups, i);
        if (!PyDict_CheckExact(g)) goto out;
        PyObject *lr = PyDict_GetItemWithError(g, s_lr);
        if (lr == NULL && PyErr_Occurred()) {
            rc = -1;
            goto out;
        }
        if (lr == NULL || !PyFloat_CheckExact(lr)) goto out;
    }
    for (Py_ssize_t i = 0; i < n_groups; i++) {
        /* (nothing since the check above ran Python code: a finalizer run by the collector
         * in PyTuple_Pack at most, which may change the groups: then an error) */
        PyObject *lr = NULL, *row = NULL;
        if (i < PyList_GET_SIZE(groups) && i < PyList_GET_SIZE(names) &&
            PyDict_Check(PyList_GET_ITEM(groups, i)))
            lr = PyDict_GetItemWithError(PyList_GET_ITEM(groups, i), s_lr);
        row = lr == NULL ? NULL
                                   : PyTuple_Pack(10, step, micro, k_scalar,
                                                  PyList_GET_ITEM(names, i), t, t, zero_obj,
                                                  zero_obj, lr, zero_obj);
        if (row == NULL || PyList_Append(rows, row) < 0) {
            if (lr == NULL && !PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "a param group changed under on_step");
            Py_XDECREF(row);
            rc = -1;
            goto out;
        }
        Py_DECREF(row);
    }
    rc = 1;
out:
    Py_XDECREF(groups);
    Py_XDECREF(names);
    Py_XDECREF(micro);
    Py_XDECREF(t);
    Py_XDECREF(rows);
    return rc;
}
