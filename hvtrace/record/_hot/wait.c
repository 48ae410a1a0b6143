/* hvtrace/record/_hot/wait.c: HandleWait, Horovod's module-level synchronize(handle), wrapped.
 * Part of hvtrace/record/_hot.c (included there after lr_rows.c); not compiled alone.
 * Python twin: hvtrace.record.hot.handle_wait (hvtrace.record.hvdpatch.wrap picks one).
 *
 * It calls Horovod's function unchanged, then, while a traced optimizer is inside its own
 * synchronize() (hvdpatch.observer is its tracer; a compiled tracer's is also phases.c's
 * sync_observer, read here without the module attribute lookup: 8 lookups a step fewer for a
 * model of 8 tensors), appends (handle, monotonic ns) to that tracer's done list. An error of
 * hvtrace's goes to the tracer's fail(); Horovod's pass through unchanged. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig;
} HandleWait;

/* obs.done.append((handle, monotonic_ns())): 0, or -1 with an error. The observer is a tracer (a
 * Phases: hvdpatch.observer is only ever set by a tracer's synchronize). */
static int note_done(PyObject *obs, PyObject *handle) {
    if (!PyObject_TypeCheck(obs, &PhasesType)) {
        PyErr_SetString(PyExc_TypeError, "hvdpatch.observer is not a tracer");
        return -1;
    }
    Phases *ph = (Phases *)obs;
    if (list_field(ph->done, "done") < 0) return -1;
    PyObject *t = PyLong_FromLongLong(mono_ns()); /* the host saw it return (hvdpatch's docs) */
    PyObject *pair = t ? PyTuple_Pack(2, handle, t) : NULL;
    PyObject *done = Py_NewRef(ph->done);
    int rc = pair == NULL ? -1 : PyList_Append(done, pair);
    Py_XDECREF(pair);
    Py_XDECREF(t);
    Py_DECREF(done);
    return rc;
}

static PyObject *handle_wait_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    HandleWait *self = (HandleWait *)callable;
    PyObject *out = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
    if (out == NULL || PyVectorcall_NARGS(nargsf) != 1 || (kwnames && PyTuple_GET_SIZE(kwnames)) ||
        hvdpatch_mod == NULL)
        return out;
    /* a compiled tracer's synchronize sets sync_observer (phases.c): no lookup */
    PyObject *obs = sync_observer != NULL ? Py_NewRef(sync_observer)
                                          : PyObject_GetAttr(hvdpatch_mod, s_observer);
    if (obs == NULL) { /* (hvdpatch always has it) */
        Py_DECREF(out);
        return NULL;
    }
    if (obs != Py_None && note_done(obs, args[0]) < 0 && hand_to_fail(obs) < 0) Py_CLEAR(out);
    Py_DECREF(obs);
    return out;
}

static PyObject *HandleWait_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"orig", NULL};
    PyObject *orig;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:HandleWait", kwlist, &orig)) return NULL;
    if (check_configured() < 0) return NULL;
    HandleWait *self = (HandleWait *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = handle_wait_vectorcall;
    self->orig = Py_NewRef(orig);
    return (PyObject *)self;
}

static int HandleWait_traverse(HandleWait *self, visitproc visit, void *arg) {
    Py_VISIT(self->orig);
    return 0;
}

static int HandleWait_clear(HandleWait *self) {
    Py_CLEAR(self->orig);
    return 0;
}

static void HandleWait_dealloc(HandleWait *self) {
    PyObject_GC_UnTrack(self);
    HandleWait_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *HandleWait_get_wrapped(HandleWait *self, void *closure) {
    return Py_NewRef(self->orig);
}

static PyGetSetDef HandleWait_getset[] = {
    {"__wrapped__", (getter)HandleWait_get_wrapped, NULL, "Horovod's function, wrapped", NULL},
    {NULL},
};

static PyTypeObject HandleWaitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hvtrace.record._hot.HandleWait",
    .tp_doc = PyDoc_STR("HandleWait(orig): Horovod's synchronize(handle), noting when each wait "
                        "returns (the compiled form of hvtrace.record.hot.handle_wait)."),
    .tp_basicsize = sizeof(HandleWait),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = HandleWait_new,
    .tp_dealloc = (destructor)HandleWait_dealloc,
    .tp_traverse = (traverseproc)HandleWait_traverse,
    .tp_clear = (inquiry)HandleWait_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HandleWait, vectorcall),
    .tp_getset = HandleWait_getset,
};
