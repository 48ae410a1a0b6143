/* hvtrace.record._hot: the recorder's hot path (per allreduce, per counter reading), compiled.
 *
 * Enqueue: a callable that wraps Horovod's ``_allreduce_grad_async`` (or its grouped
 * form) exactly as ``Tracer._enqueue_wrapper``'s pure-Python closure does
 * (hvtrace/record/optimizer.py), and polls the allreduces in flight as ``Tracer._poll_done``
 * does. The state stays on the Python ``Tracer`` (``enqueued``, ``done``, ``poll_idx``,
 * ``in_sync``, ``meta``) and on its recorder (``enabled``, ``between_steps``): this module reads
 * and writes those attributes, so the Python code around it is the same whichever implementation
 * runs. Only the time of the next look is the wrapper's own (``next_poll``, as in the closure).
 * Per gradient it reads two attributes (``rec.enabled``, ``tracer.enqueued``) and writes none:
 * on a real backward each attribute access costs about 0.2 µs with the caches that autograd's
 * kernels leave (in a hot loop, 20 ns). Any error after Horovod's call is handed to
 * ``tracer.fail(exc)`` (tracing is disabled, training goes on), as in the closure.
 *
 * HorovodPoll: Horovod's own ``horovod::torch::PollHandle(int)``, looked up in the library Horovod
 * already loaded, so that a look at a handle costs a mutex and a map lookup, not a Python call
 * through pybind11 (the Enqueue calls it directly). Where the symbol is missing (another Horovod
 * build) the pybind11 poll is used.
 *
 * ThreadReader: the reading of the training thread's counters at a phase boundary, as
 * ``hvtrace.record.cpustat._schedstat_reader``'s closure does it (its CPU clock; its schedstat
 * line only when it was off a CPU long enough since the last read, else that line again), in one
 * call instead of three Python calls around the system call. The ``pread`` holds the GIL: a
 * read of a procfs line does not block, and releasing the GIL there would let another thread in
 * mid-step.
 *
 * Built as an optional extension (pyproject.toml); when it is missing the closure runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <time.h>
#include <unistd.h>

/* _hvdpoll.cpp: calls Horovod's PollHandle, catching what it throws (err = 1). */
extern int hvtrace_poll_handle(void *fn, int handle, int *err);

static PyObject *s_enabled, *s_meta, *s_learn, *s_enqueued, *s_in_sync, *s_between_steps,
    *s_poll_idx, *s_done, *s_fail;
static PyObject *monotonic_ns_func; /* time.monotonic_ns: when it is the clock, read it here */

static inline long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

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
    PyObject *enq = PyObject_GetAttr(self->tracer, s_enqueued);
    if (enq == NULL) return -1;
    if (!PyList_Check(enq)) {
        Py_DECREF(enq);
        PyErr_SetString(PyExc_TypeError, "tracer.enqueued is not a list");
        return -1;
    }
    PyObject *idx_obj = PyObject_GetAttr(self->tracer, s_poll_idx);
    if (idx_obj == NULL) {
        Py_DECREF(enq);
        return -1;
    }
    Py_ssize_t first = PyLong_AsSsize_t(idx_obj);
    Py_DECREF(idx_obj);
    if (first == -1 && PyErr_Occurred()) {
        Py_DECREF(enq);
        return -1;
    }
    Py_ssize_t i = first < 0 ? 0 : first;
    first = i;
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
        PyObject *done = PyObject_GetAttr(self->tracer, s_done);
        PyObject *t = done ? PyLong_FromLongLong(mono_ns()) : NULL;
        if (t == NULL || !PyList_Check(done)) {
            if (t != NULL) PyErr_SetString(PyExc_TypeError, "tracer.done is not a list");
            rc = -1;
        }
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
        if (rc == 0) {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (idx == NULL || PyObject_SetAttr(self->tracer, s_poll_idx, idx) < 0) rc = -1;
            Py_XDECREF(idx);
        }
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
    PyObject *enq = PyObject_GetAttr(self->tracer, s_enqueued);
    if (enq == NULL) goto out;
    PyObject *entry = PyTuple_Pack(3, t, key, out);
    int app = -1;
    if (entry != NULL && !PyList_Check(enq))
        PyErr_SetString(PyExc_TypeError, "tracer.enqueued is not a list");
    else if (entry != NULL)
        app = PyList_Append(enq, entry);
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
            PyObject *in_sync = PyObject_GetAttr(self->tracer, s_in_sync);
            if (in_sync == NULL) goto out;
            int syncing = PyObject_IsTrue(in_sync);
            Py_DECREF(in_sync);
            if (syncing < 0) goto out;
            if (!syncing) {
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
    if (note(self, arg, t, out) < 0) {
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (exc == NULL) exc = Py_NewRef(Py_None);
        PyObject *r = PyObject_CallMethodOneArg(self->tracer, s_fail, exc);
        Py_XDECREF(r);
        Py_XDECREF(type);
        Py_DECREF(exc);
        Py_XDECREF(tb);
        if (r == NULL) PyErr_Clear(); /* never into training */
    }
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

/* -- ThreadReader ------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    clockid_t clock;    /* the thread's CPU clock (pthread_getcpuclockid) */
    int fd;             /* its schedstat file, kept open by the caller */
    long long slack_ns; /* re-read the line when off a CPU longer than this since the last read */
    long long off_cpu;  /* at the last read: wall time minus CPU time */
    PyObject *raw;      /* the line of the last read (bytes) */
} ThreadReader;

static PyTypeObject ThreadReaderType;

/* Read the schedstat line into self->raw (0), or -1 with OSError. */
static int reader_pread(ThreadReader *self) {
    char buf[64];
    ssize_t n = pread(self->fd, buf, sizeof buf, 0);
    if (n < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    PyObject *raw = PyBytes_FromStringAndSize(buf, n);
    if (raw == NULL) return -1;
    Py_XSETREF(self->raw, raw);
    return 0;
}

static inline int reader_cpu(ThreadReader *self, long long *out) {
    struct timespec ts;
    if (clock_gettime(self->clock, &ts) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    *out = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    return 0;
}

static PyObject *ThreadReader_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"clock_id", "fd", "slack_ns", NULL};
    long long clock_id, slack_ns;
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LiL", kwlist, &clock_id, &fd, &slack_ns))
        return NULL;
    ThreadReader *self = (ThreadReader *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->clock = (clockid_t)clock_id;
    self->fd = fd;
    self->slack_ns = slack_ns;
    self->raw = NULL;
    long long c;
    if (reader_cpu(self, &c) < 0 || reader_pread(self) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->off_cpu = mono_ns() - c;
    return (PyObject *)self;
}

static PyObject *ThreadReader_call(ThreadReader *self, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "ThreadReader() takes no arguments");
        return NULL;
    }
    long long t = mono_ns(), c;
    if (reader_cpu(self, &c) < 0) return NULL;
    if (t - c - self->off_cpu > self->slack_ns) {
        if (reader_pread(self) < 0) return NULL;
        self->off_cpu = t - c;
    }
    PyObject *cpu = PyLong_FromLongLong(c);
    if (cpu == NULL) return NULL;
    PyObject *out = PyTuple_Pack(2, cpu, self->raw);
    Py_DECREF(cpu);
    return out;
}

static void ThreadReader_dealloc(ThreadReader *self) {
    Py_XDECREF(self->raw);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ThreadReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hvtrace.record._hot.ThreadReader",
    .tp_doc = PyDoc_STR("ThreadReader(clock_id, fd, slack_ns)() -> (cpu_ns, schedstat line): "
                        "the compiled form of hvtrace.record.cpustat._schedstat_reader (the file "
                        "stays the caller's to close)."),
    .tp_basicsize = sizeof(ThreadReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ThreadReader_new,
    .tp_dealloc = (destructor)ThreadReader_dealloc,
    .tp_call = (ternaryfunc)ThreadReader_call,
};

static PyMethodDef module_methods[] = {
    {"horovod_poll", horovod_poll, METH_O,
     "horovod_poll(path) -> HorovodPoll or None: Horovod's PollHandle in the already loaded "
     "library at path (its PyTorch extension), None where it is not there."},
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
    INTERN(s_enqueued, "enqueued");
    INTERN(s_in_sync, "in_sync");
    INTERN(s_between_steps, "between_steps");
    INTERN(s_poll_idx, "poll_idx");
    INTERN(s_done, "done");
    INTERN(s_fail, "fail");
#undef INTERN
    PyObject *time_mod = PyImport_ImportModule("time");
    if (time_mod == NULL) return NULL;
    monotonic_ns_func = PyObject_GetAttrString(time_mod, "monotonic_ns");
    Py_DECREF(time_mod);
    if (monotonic_ns_func == NULL) return NULL;
    if (PyType_Ready(&EnqueueType) < 0 || PyType_Ready(&HorovodPollType) < 0 ||
        PyType_Ready(&ThreadReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&hotmodule);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Enqueue", (PyObject *)&EnqueueType) < 0 ||
        PyModule_AddObjectRef(m, "HorovodPoll", (PyObject *)&HorovodPollType) < 0 ||
        PyModule_AddObjectRef(m, "ThreadReader", (PyObject *)&ThreadReaderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
