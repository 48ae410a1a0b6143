/* hvtrace/record/_hot/module.c: configure() and the module's init. Part of
 * hvtrace/record/_hot.c (included there last); not compiled alone.
 * Python twin: hvtrace.record.hot.configure (which calls this configure() where it is built).
 */

/* configure(kinds, allreduces, hvdpatch, resync_first, resync_every): what the hooks need from
 * hvtrace's Python modules (schema.KIND_CODE, rows.Allreduces, record.hvdpatch, the steps of the
 * clock collective), once, through hvtrace.record.hot.configure (from hvtrace.record.optimizer).
 */
static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *kinds, *ar, *hvdp;
    long long first, every;
    if (!PyArg_ParseTuple(args, "O!OOLL:configure", &PyDict_Type, &kinds, &ar, &hvdp, &first,
                          &every))
        return NULL;
    if (!PyType_Check(ar) || !PyType_IsSubtype((PyTypeObject *)ar, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "configure: allreduces must be a tuple subclass");
        return NULL;
    }
    if (every <= 0) {
        PyErr_SetString(PyExc_ValueError, "configure: resync_every must be positive");
        return NULL;
    }
    struct { PyObject **k; PyObject **n; const char *kind; const char *name; } spec[] = {
        {&k_step, &n_step, "step", "step"},
        {&k_input, &n_input, "input", "input"},
        {&k_forward, &n_forward, "forward", "forward"},
        {&k_backward, &n_backward, "backward", "backward"},
        {&k_compute, &n_compute, "compute", "compute"},
        {&k_wait, &n_sync, "wait", "synchronize"},
        {&k_update, &n_update, "update", "update"},
    };
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
        PyObject *k = PyDict_GetItemString(kinds, spec[i].kind);
        if (k == NULL || !PyLong_Check(k)) {
            PyErr_Format(PyExc_KeyError, "configure: no kind code for %s", spec[i].kind);
            return NULL;
        }
        PyObject *n = PyUnicode_InternFromString(spec[i].name);
        if (n == NULL) return NULL;
        Py_XSETREF(*spec[i].k, Py_NewRef(k));
        Py_XSETREF(*spec[i].n, n);
    }
    PyObject *ks = PyDict_GetItemString(kinds, "scalar");
    if (ks == NULL || !PyLong_Check(ks)) {
        PyErr_SetString(PyExc_KeyError, "configure: no kind code for scalar");
        return NULL;
    }
    Py_XSETREF(k_scalar, Py_NewRef(ks));
    Py_XSETREF(allreduces_cls, Py_NewRef(ar));
    Py_XSETREF(hvdpatch_mod, Py_NewRef(hvdp));
    resync_first = first;
    resync_every = every;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(kinds, allreduces, hvdpatch, resync_first, resync_every): what the compiled "
     "per-step hooks need from hvtrace's modules (once, through hvtrace.record.hot.configure)."},
    {"horovod_poll", horovod_poll, METH_O,
     "horovod_poll(path) -> HorovodPoll or None: Horovod's PollHandle in the already loaded "
     "library at path (its PyTorch extension), None where it is not there."},
    {"deltas_into", deltas_into, METH_VARARGS,
     "deltas_into(pairs, cpu, runq, cpu_ok, runq_ok) -> bool: the CPU time and run-queue wait "
     "between each pair of readings, into the four columns (hvtrace.record.cpustat."
     "deltas_columns); False where a reading is not one it reads (the Python twin decides)."},
    {"rows_into", rows_into, METH_VARARGS,
     "rows_into(rows, name_ids, names, *columns) -> bool: the writer's fourteen columns of a "
     "batch's rows (hvtrace.record.writer.BatchEncoder._row_columns); False where a row is not "
     "one it reads (the Python form decides)."},
    {"entries_len", entries_len, METH_VARARGS,
     "entries_len(entries, infos, tensors) -> int: the rows of a batch whose synchronizes all "
     "enqueue the tensors whose columns the writer holds (hvtrace.record.writer.BatchEncoder."
     "encode); -1 where one does not or an entry is neither a row nor a synchronize."},
    {"entries_into", entries_into, METH_VARARGS,
     "entries_into(entries, name_ids, names, counts, tensor_names, tensor_bytes, tensor_dtypes, "
     "k_allreduce, *columns) -> bool: the writer's fourteen columns of a whole batch in one pass "
     "(hvtrace.record.writer.BatchEncoder.encode); False where an entry is not one it reads "
     "(the Python form decides)."},
    {"syncs_into", syncs_into, METH_VARARGS,
     "syncs_into(syncs, start, stop) -> bool: the start and end tokens of every allreduce call "
     "of a batch's synchronizes (hvtrace.record.writer.BatchEncoder._call_times); False where "
     "one is not what it reads (the Python form decides)."},
    {"window_into", window_into, METH_VARARGS,
     "window_into(window, out, codes, k_forward, k_backward, allreduces, offset_ns, arrival_col, "
     "count_col) -> bool: a live window's per-step matrix (hvtrace.record.live.step_matrix); "
     "False where an entry is not one it reads (the Python form decides)."},
    {NULL},
};

static struct PyModuleDef hotmodule = {
    PyModuleDef_HEAD_INIT, "_hot",
    "hvtrace's compiled hot path (per allreduce, per counter reading).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__hot(void) {
#define INTERN(var, str) \
    if ((var = PyUnicode_InternFromString(str)) == NULL) return NULL;
    INTERN(s_enabled, "enabled");
    INTERN(s_meta, "meta");
    INTERN(s_learn, "_learn");
    INTERN(s_between_steps, "between_steps");
    INTERN(s_step, "step");
    INTERN(s_micro, "micro");
    INTERN(s_extend, "extend");
    INTERN(s_on_step, "on_step");
    INTERN(s_resync_clock, "resync_clock");
    INTERN(s_observer, "observer");
    INTERN(s_fail, "fail");
    INTERN(s_every, "every");
    INTERN(s_pending, "pending");
    INTERN(s_groups, "groups");
    INTERN(s_n_groups, "_n_groups");
    INTERN(s_lr_names, "_lr_names");
    INTERN(s_lr, "lr");
#undef INTERN
    PyObject *time_mod = PyImport_ImportModule("time");
    if (time_mod == NULL) return NULL;
    monotonic_ns_func = PyObject_GetAttrString(time_mod, "monotonic_ns");
    Py_DECREF(time_mod);
    if (monotonic_ns_func == NULL) return NULL;
    if (PyType_Ready(&EnqueueType) < 0 || PyType_Ready(&HorovodPollType) < 0 ||
        PyType_Ready(&ThreadReaderType) < 0 || PyType_Ready(&PhasesType) < 0 ||
        PyType_Ready(&HandleWaitType) < 0)
        return NULL;
    if ((zero_obj = PyLong_FromLong(0)) == NULL || (one_obj = PyLong_FromLong(1)) == NULL ||
        (nan_obj = PyFloat_FromDouble(Py_NAN)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&hotmodule);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Enqueue", (PyObject *)&EnqueueType) < 0 ||
        PyModule_AddObjectRef(m, "HorovodPoll", (PyObject *)&HorovodPollType) < 0 ||
        PyModule_AddObjectRef(m, "ThreadReader", (PyObject *)&ThreadReaderType) < 0 ||
        PyModule_AddObjectRef(m, "Phases", (PyObject *)&PhasesType) < 0 ||
        PyModule_AddObjectRef(m, "HandleWait", (PyObject *)&HandleWaitType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
