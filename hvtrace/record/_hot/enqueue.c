/* hvtrace/record/_hot/enqueue.c: Horovod's poll called directly (HorovodPoll) and the
 * per-allreduce wrapper (Enqueue). Part of hvtrace/record/_hot.c (included there after reader.c);
 * not compiled alone.
 * Python twins: hvtrace.record.hot.TracerHooks._enqueue_wrapper's closure (Enqueue) and
 * TracerHooks._poll_done (poll_done); HorovodPoll stands in for Horovod's pybind11 poll
 * (hvtrace.record.opening.horovod_poll picks it).
 *
 * HorovodPoll: Horovod's own ``horovod::torch::PollHandle(int)``, looked up in the library Horovod
 * already loaded, so that a look at a handle costs a mutex and a map lookup, not a Python call
 * through pybind11 (the Enqueue calls it directly). Where the symbol is missing (another Horovod
 * build) the pybind11 poll is used.
 *
 * Enqueue: a callable that wraps Horovod's ``_allreduce_grad_async`` (or its grouped form)
 * exactly as the Python twin's closure does, and polls the allreduces in flight as
 * ``_poll_done`` does, on the tracer's Phases fields (``enqueued``, ``done``, ``poll_idx``,
 * ``in_sync``) and its recorder's attributes (``enabled``, ``between_steps``). Only the time of
 * the next look is the wrapper's own (``next_poll``, as in the closure). Per gradient it reads one
 * attribute (``rec.enabled``) and writes none. Any error after Horovod's call is handed to
 * ``tracer.fail(exc)`` (tracing is disabled, training goes on), as in the closure.
 */

/* _hvdpoll.cpp: calls Horovod's PollHandle, catching what it throws (err = 1). */
extern int hvtrace_poll_handle(void *fn, int handle, int *err);

/* Horovod's PyTorch PollHandle(int) (C++ name mangled as g++ and clang do). */
#define HOROVOD_POLL_SYMBOL "_ZN7horovod5torch10PollHandleEi"

typedef struct {
    PyObject_HEAD
    void *fn;
} HorovodPoll;

static PyTypeObject HorovodPollType;

/* 1 when the handle's op is done, 0 when not, -1 with ValueError (Horovod does not know it). */
static int horovod_poll_one(HorovodPoll *p, PyObject *handle) {
    long h = PyLong_AsLong(handle);
    if (h == -1 && PyErr_Occurred()) return -1;
    if (h < INT_MIN || h > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "Horovod handle %ld out of range", h);
        return -1;
    }
    int err = 0;
    int done = hvtrace_poll_handle(p->fn, (int)h, &err);
    if (err) {
        PyErr_Format(PyExc_ValueError, "Handle %ld was not created or has been cleared.", h);
        return -1;
    }
    return done != 0;
}

static PyObject *HorovodPoll_call(HorovodPoll *self, PyObject *args, PyObject *kwds) {
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O:HorovodPoll", &handle)) return NULL;
    int r = horovod_poll_one(self, handle);
    return r < 0 ? NULL : PyLong_FromLong(r);
}

static PyTypeObject HorovodPollType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hvtrace.record._hot.HorovodPoll",
    .tp_doc = PyDoc_STR("Horovod's PollHandle(handle) -> 1 when done, else 0 (ValueError for a "
                        "handle Horovod does not know); made by horovod_poll(path)."),
    .tp_basicsize = sizeof(HorovodPoll),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_call = (ternaryfunc)HorovodPoll_call,
};

static PyObject *horovod_poll(PyObject *module, PyObject *arg) {
    PyObject *path_bytes;
    if (!PyUnicode_FSConverter(arg, &path_bytes)) return NULL;
    /* only a library this process already loaded (Horovod's, imported by the caller) */
    void *lib = dlopen(PyBytes_AS_STRING(path_bytes), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(path_bytes);
    void *fn = lib ? dlsym(lib, HOROVOD_POLL_SYMBOL) : NULL;
    if (fn == NULL) Py_RETURN_NONE; /* the library handle stays open: Horovod is loaded anyway */
    HorovodPoll *p = PyObject_New(HorovodPoll, &HorovodPollType);
    if (p == NULL) return NULL;
    p->fn = fn;
    return (PyObject *)p;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *tracer;  /* the Tracer: state attributes, _learn, fail */
    PyObject *rec;     /* its Recorder: enabled, between_steps */
    PyObject *orig;    /* Horovod's enqueue */
    PyObject *key_of;  /* NULL: id(arg) */
    PyObject *now;     /* NULL: the host monotonic clock */
    PyObject *poll;    /* Horovod's poll(handle) -> nonzero when done; NULL: never poll */
    PyObject *meta;    /* tracer.meta (a dict, never replaced): allreduce key -> tensors */
    long long interval_ns;
    long long next_poll; /* host clock: a gradient enqueued from then on looks (0: the first) */
} Enqueue;

/* Note the allreduces that completed since the last look, oldest first, as seen now. */
static int poll_done(Enqueue *self) {
    Phases *ph = (Phases *)self->tracer;
    if (list_field(ph->enqueued, "enqueued") < 0) return -1;
    PyObject *enq = Py_NewRef(ph->enqueued);
    Py_ssize_t i = ph->poll_idx < 0 ? 0 : ph->poll_idx, first = i;
    /* (a poll that is a Python callable may change the list: its size is read every time, and
     * the entry is held while it runs) */
    for (; i < PyList_GET_SIZE(enq); i++) {
        PyObject *item = PyList_GET_ITEM(enq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 3) break;
        PyObject *h = PyTuple_GET_ITEM(item, 2);
        if (PyTuple_CheckExact(h)) {
            if (PyTuple_GET_SIZE(h) == 0) break;
            h = PyTuple_GET_ITEM(h, 0);
        }
        if (!PyLong_CheckExact(h)) break;
        int ok;
        if (Py_IS_TYPE(self->poll, &HorovodPollType)) {
            ok = horovod_poll_one((HorovodPoll *)self->poll, h);
        } else {
            Py_INCREF(item);
            PyObject *r = PyObject_CallOneArg(self->poll, h);
            Py_DECREF(item);
            if (r == NULL) {
                Py_DECREF(enq);
                return -1;
            }
            ok = PyObject_IsTrue(r);
            Py_DECREF(r);
        }
        if (ok < 0) {
            Py_DECREF(enq);
            return -1;
        }
        if (!ok) break;
    }
    int rc = 0;
    if (i > first) {
        PyObject *done = ph->done;
        PyObject *t = NULL;
        if (list_field(done, "done") < 0 || (t = PyLong_FromLongLong(mono_ns())) == NULL) rc = -1;
        Py_XINCREF(done);
        for (Py_ssize_t j = first; rc == 0 && j < i && j < PyList_GET_SIZE(enq); j++) {
            PyObject *item = PyList_GET_ITEM(enq, j), *h;
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 3) break;
            h = PyTuple_GET_ITEM(item, 2);
            if (PyTuple_CheckExact(h) && PyTuple_GET_SIZE(h) > 0) h = PyTuple_GET_ITEM(h, 0);
            PyObject *pair = PyTuple_Pack(2, h, t);
            if (pair == NULL || PyList_Append(done, pair) < 0) rc = -1;
            Py_XDECREF(pair);
        }
        Py_XDECREF(t);
        Py_XDECREF(done);
        if (rc == 0) ph->poll_idx = i;
    }
    Py_DECREF(enq);
    return rc;
}

/* After Horovod's call: the bookkeeping of one enqueued allreduce (0, or -1 with an error). */
static int note(Enqueue *self, PyObject *arg, PyObject *t, PyObject *out) {
    PyObject *key = self->key_of ? PyObject_CallOneArg(self->key_of, arg) : PyLong_FromVoidPtr(arg);
    if (key == NULL) return -1;
    int rc = -1;
    int known = PyDict_Contains(self->meta, key);
    if (known < 0) goto out;
    if (!known) {
        PyObject *r = PyObject_CallMethodObjArgs(self->tracer, s_learn, key, arg, out, NULL);
        if (r == NULL) goto out;
        Py_DECREF(r);
    }
    Phases *ph = (Phases *)self->tracer;
    if (list_field(ph->enqueued, "enqueued") < 0) goto out;
    PyObject *enq = Py_NewRef(ph->enqueued);
    PyObject *entry = PyTuple_Pack(3, t, key, out);
    int app = entry == NULL ? -1 : PyList_Append(enq, entry);
    Py_XDECREF(entry);
    Py_ssize_t n = app < 0 ? 0 : PyList_GET_SIZE(enq);
    Py_DECREF(enq);
    if (app < 0) goto out;
    /* the step's first allreduce: its work has begun */
    if (n == 1 && PyObject_SetAttr(self->rec, s_between_steps, Py_False) < 0) goto out;
    if (self->poll != NULL) { /* host tokens (ints); CUDA tokens are events: no polling */
        long long tv = PyLong_AsLongLong(t);
        if (tv == -1 && PyErr_Occurred()) goto out;
        if (tv >= self->next_poll) {
            /* a gradient became ready (not an allreduce Horovod sends late, in synchronize) */
            if (!ph->in_sync) {
                self->next_poll = tv + self->interval_ns;
                if (poll_done(self) < 0) goto out;
            }
        }
    }
    rc = 0;
out:
    Py_DECREF(key);
    return rc;
}

static PyObject *enqueue_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames) {
    Enqueue *self = (Enqueue *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        /* not how Horovod calls it: pass it through untouched */
        return PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
    }
    PyObject *arg = args[0];
    PyObject *en = PyObject_GetAttr(self->rec, s_enabled);
    if (en == NULL) return NULL;
    int enabled = PyObject_IsTrue(en);
    Py_DECREF(en);
    if (enabled < 0) return NULL;
    if (!enabled) return PyObject_CallOneArg(self->orig, arg);
    PyObject *t = self->now ? PyObject_CallNoArgs(self->now) : PyLong_FromLongLong(mono_ns());
    if (t == NULL) return NULL;
    PyObject *out = PyObject_CallOneArg(self->orig, arg);
    if (out == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    if (note(self, arg, t, out) < 0 && hand_to_fail(self->tracer) < 0) Py_CLEAR(out);
    Py_DECREF(t);
    return out;
}

static PyObject *Enqueue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tracer", "rec", "orig", "key_of", "now", "poll", "interval_ns", NULL};
    PyObject *tracer, *rec, *orig, *key_of, *now, *poll;
    long long interval_ns;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOL", kwlist, &tracer, &rec, &orig,
                                     &key_of, &now, &poll, &interval_ns))
        return NULL;
    if (!PyObject_TypeCheck(tracer, &PhasesType)) {
        PyErr_SetString(PyExc_TypeError, "Enqueue: tracer is not a hvtrace.record._hot.Phases");
        return NULL;
    }
    Enqueue *self = (Enqueue *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = enqueue_vectorcall;
    self->tracer = Py_NewRef(tracer);
    self->rec = Py_NewRef(rec);
    self->orig = Py_NewRef(orig);
    self->key_of = key_of == Py_None ? NULL : Py_NewRef(key_of);
    self->now = (now == Py_None || now == monotonic_ns_func) ? NULL : Py_NewRef(now);
    self->poll = poll == Py_None ? NULL : Py_NewRef(poll);
    self->interval_ns = interval_ns;
    self->next_poll = 0;
    self->meta = PyObject_GetAttr(tracer, s_meta);
    if (self->meta != NULL && !PyDict_Check(self->meta))
        PyErr_SetString(PyExc_TypeError, "tracer.meta is not a dict");
    if (self->meta == NULL || !PyDict_Check(self->meta)) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int Enqueue_traverse(Enqueue *self, visitproc visit, void *arg) {
    Py_VISIT(self->tracer);
    Py_VISIT(self->rec);
    Py_VISIT(self->orig);
    Py_VISIT(self->key_of);
    Py_VISIT(self->now);
    Py_VISIT(self->poll);
    Py_VISIT(self->meta);
    return 0;
}

static int Enqueue_clear(Enqueue *self) {
    Py_CLEAR(self->tracer);
    Py_CLEAR(self->rec);
    Py_CLEAR(self->orig);
    Py_CLEAR(self->key_of);
    Py_CLEAR(self->now);
    Py_CLEAR(self->poll);
    Py_CLEAR(self->meta);
    return 0;
}

static void Enqueue_dealloc(Enqueue *self) {
    PyObject_GC_UnTrack(self);
    Enqueue_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Enqueue_get_wrapped(Enqueue *self, void *closure) {
    return Py_NewRef(self->orig);
}

static PyObject *Enqueue_poll_now(Enqueue *self, PyObject *noargs) {
    if (self->poll == NULL) Py_RETURN_NONE;
    if (poll_done(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyGetSetDef Enqueue_getset[] = {
    {"__wrapped__", (getter)Enqueue_get_wrapped, NULL, "Horovod's function, wrapped", NULL},
    {NULL},
};

static PyMethodDef Enqueue_methods[] = {
    {"poll_now", (PyCFunction)Enqueue_poll_now, METH_NOARGS,
     "Look at the allreduces in flight now (as the wrapper does when a poll is due)."},
    {NULL},
};

static PyTypeObject EnqueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hvtrace.record._hot.Enqueue",
    .tp_doc = PyDoc_STR("Enqueue(tracer, rec, orig, key_of, now, poll, interval_ns): Horovod's "
                        "enqueue, recorded (the compiled form of Tracer._enqueue_wrapper)."),
    .tp_basicsize = sizeof(Enqueue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = Enqueue_new,
    .tp_dealloc = (destructor)Enqueue_dealloc,
    .tp_traverse = (traverseproc)Enqueue_traverse,
    .tp_clear = (inquiry)Enqueue_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Enqueue, vectorcall),
    .tp_getset = Enqueue_getset,
    .tp_methods = Enqueue_methods,
};
