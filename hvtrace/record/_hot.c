/* hvtrace.record._hot: the recorder's hot path (per allreduce, per phase boundary, per counter
 * reading), compiled.
 *
 * Phases: the base class of ``Tracer`` (hvtrace/record/optimizer.py). It holds the tracer's
 * per-step state as C fields (the boundaries' timer tokens and readings, the step's spans so far,
 * the allreduces of the current synchronize, the counters and flags), which the Python code reads
 * and writes as attributes, as it would on any object, so the Python code around it is the same
 * whichever form runs. Its methods ``c_fwd_pre``, ``c_fwd_post``, ``c_synchronize`` and ``c_step``
 * are the compiled forms of the tracer's per-step hooks, step for step on those fields; what is
 * Python's own (the consistency checks, live detection, the clock collective, the recorder's
 * buffer) they call, but for the consistency checks' common step (float learning rates, nothing
 * else due), whose rows ``c_step`` writes itself. tests/unit/test_phases.py runs both forms
 * through the same steps.
 *
 * Enqueue: a callable that wraps Horovod's ``_allreduce_grad_async`` (or its grouped
 * form) exactly as ``Tracer._enqueue_wrapper``'s pure-Python closure does, and polls the
 * allreduces in flight as ``Tracer._poll_done`` does, on the tracer's Phases fields
 * (``enqueued``, ``done``, ``poll_idx``, ``in_sync``) and its recorder's attributes (``enabled``,
 * ``between_steps``). Only the time of the next look is the wrapper's own (``next_poll``, as in
 * the closure). Per gradient it reads one attribute (``rec.enabled``) and writes none. Any error
 * after Horovod's call is handed to ``tracer.fail(exc)`` (tracing is disabled, training goes
 * on), as in the closure.
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
 * mid-step. With the switch check (a perf event's user page on the thread, where Linux allows
 * one), a reading made by the thread itself with no context switch of it since the last clock
 * read, at most ``max_derived_ns`` ago, adds the wall time since instead of reading the clock:
 * no system call (hvtrace/record/cpustat.py has why that is the same figure). It closes itself
 * where it costs more than it saves (reader_review).
 *
 * Built as an optional extension (pyproject.toml); where it is missing the Python forms run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/perf_event.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#else
struct perf_event_mmap_page { uint32_t lock; }; /* never mapped: no switch check there */
#endif

/* _hvdpoll.cpp: calls Horovod's PollHandle, catching what it throws (err = 1). */
extern int hvtrace_poll_handle(void *fn, int handle, int *err);

static PyObject *s_enabled, *s_meta, *s_learn, *s_between_steps, *s_step, *s_micro, *s_extend,
    *s_on_step, *s_resync_clock, *s_observer, *s_fail, *s_every, *s_pending, *s_groups,
    *s_n_groups, *s_lr_names, *s_lr;
static PyObject *monotonic_ns_func; /* time.monotonic_ns: when it is the clock, read it here */

static inline long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The Tracer's per-step state (hvtrace/record/optimizer.py's Tracer is a subclass): C fields that
 * Python reads and writes as attributes (member descriptors) and the compiled hooks below use
 * directly. Objects are never NULL after tp_new (None); ``del`` makes one NULL, read as None. */
typedef struct {
    PyObject_HEAD
    PyObject *rec, *now, *read, *grad_enabled, *orig_sync, *orig_step, *checks, *live;
    PyObject *flags, *ar_flags;
    PyObject *step_start, *step_cpu, *fwd_start, *fwd_cpu, *bwd_start, *bwd_cpu;
    PyObject *sync_exit, *sync_cpu, *last_grad;
    PyObject *rows, *done_rows, *enqueued, *done, *meta;
    Py_ssize_t fwd_count, poll_idx, grad_mark;
    long long steps_done;
    char compute_closed, in_sync, is_cuda, has_model;
} Phases;

static PyTypeObject PhasesType;

#define PHASES_OBJECTS(X)                                                                      \
    X(rec) X(now) X(read) X(grad_enabled) X(orig_sync) X(orig_step) X(checks) X(live) X(flags) \
    X(ar_flags) X(step_start) X(step_cpu) X(fwd_start) X(fwd_cpu) X(bwd_start) X(bwd_cpu)      \
    X(sync_exit) X(sync_cpu) X(last_grad) X(rows) X(done_rows) X(enqueued) X(done) X(meta)

/* A list field, or -1 with TypeError naming it. */
static inline int list_field(PyObject *o, const char *name) {
    if (o != NULL && PyList_CheckExact(o)) return 0;
    PyErr_Format(PyExc_TypeError, "tracer.%s is not a list", name);
    return -1;
}

/* An error inside hvtrace after the wrapped call: an Exception goes to ``tracer.fail(exc)``
 * (tracing is disabled, training goes on) and 0 is returned; anything else (KeyboardInterrupt,
 * SystemExit) stays raised and -1 is returned, as ``except Exception`` does. */
static int hand_to_fail(PyObject *tracer) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc == NULL) exc = Py_NewRef(Py_None);
    PyObject *r = PyObject_CallMethodOneArg(tracer, s_fail, exc);
    Py_XDECREF(r);
    Py_XDECREF(type);
    Py_DECREF(exc);
    Py_XDECREF(tb);
    if (r == NULL) PyErr_Clear(); /* never into training */
    return 0;
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

/* -- ThreadReader ------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    clockid_t clock;    /* the thread's CPU clock (pthread_getcpuclockid) */
    int fd;             /* its schedstat file, kept open by the caller */
    long long slack_ns; /* re-read the line when off a CPU longer than this since the last read */
    long long off_cpu;  /* at the last read: wall time minus CPU time */
    PyObject *raw;      /* the line of the last read (bytes) */
    /* The switch check (see derive_ok): a perf event's user page on the thread, whose ``lock``
     * the kernel changes at each of its context switches; none: every reading reads the clock. */
    int perf_fd;                                /* -1: no switch check */
    volatile struct perf_event_mmap_page *page; /* its user page (NULL: none) */
    size_t page_len;
    pthread_t owner;            /* the thread counted: only its own readings may be derived */
    uint32_t lock;              /* page->lock just before the last clock read */
    long long max_derived_ns;   /* read the clock at least this often */
    long long base_t, base_cpu; /* the last clock read: when (host ns), and the CPU time read */
    long long last_cpu;         /* the last cpu_ns handed out (readings never go back) */
    unsigned long long n_exact, n_derived;
    /* The review (see reader_review): readings per review, and at the last one the page's lock
     * and the derived readings so far. */
    long long review_reads, since_review;
    uint32_t review_lock;
    unsigned long long review_derived;
    /* Optimizer steps since the last reading (see reader_idle_step). */
    long long idle_steps;
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

static inline uint32_t page_lock(ThreadReader *self) {
    return __atomic_load_n(&self->page->lock, __ATOMIC_ACQUIRE);
}

/* Open the switch check on thread ``tid`` (0, or -1 with nothing set where perf events are not
 * allowed or not there: the caller then reads the clock every time; no error is raised). */
static int reader_open_switch_check(ThreadReader *self, long long tid) {
#ifdef __linux__
    struct perf_event_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.size = sizeof attr;
    attr.type = PERF_TYPE_SOFTWARE;
    attr.config = PERF_COUNT_SW_DUMMY; /* counts nothing: only its user page is used */
    attr.exclude_kernel = 1;           /* what perf_event_paranoid 2 allows */
    attr.exclude_hv = 1;
    long fd = syscall(SYS_perf_event_open, &attr, (pid_t)tid, -1, -1, PERF_FLAG_FD_CLOEXEC);
    if (fd < 0) return -1;
    long page_len = sysconf(_SC_PAGESIZE);
    void *page = page_len > 0 ? mmap(NULL, (size_t)page_len, PROT_READ, MAP_SHARED, (int)fd, 0)
                              : MAP_FAILED;
    if (page == MAP_FAILED) {
        close((int)fd);
        return -1;
    }
    self->perf_fd = (int)fd;
    self->page = page;
    self->page_len = (size_t)page_len;
    return 0;
#else
    return -1;
#endif
}

static void reader_close_switch_check(ThreadReader *self) {
    if (self->page != NULL) munmap((void *)self->page, self->page_len);
    if (self->perf_fd >= 0) close(self->perf_fd);
    self->page = NULL;
    self->perf_fd = -1;
}

/* The first review comes after review_reads / FIRST_REVIEW_DIV readings (256 of the default 4096:
 * a few dozen steps), the later ones every review_reads: a thread that pays for the check at every
 * switch (a pinned rank sharing its CPU with Horovod's threads: 25-30 switches a step on the
 * demo's model) stops paying within seconds of the start, not after the first 4096 readings
 * (about 600 steps, most of a short job or of a benchmark's run). */
#define FIRST_REVIEW_DIV 16

/* Every review_reads readings: keep the switch check only while what it saved since the last
 * review (a clock read per derived reading, about 0.7 µs on the development VM) outweighs what it
 * cost (the kernel updates the page at each context switch of the thread, the lock going up by
 * 2: about 1.3 µs more per switch there; bench/switch_cost.py). A thread that switches more often
 * than that (oversubscribed CPUs, a wait that spins on sched_yield) has it closed for good, and
 * every reading reads the clock from then on. */
static void reader_review(ThreadReader *self) {
    uint32_t lock = page_lock(self);
    unsigned long long switches = (uint32_t)(lock - self->review_lock) / 2;
    unsigned long long derived = self->n_derived - self->review_derived;
    self->since_review = 0;
    if (2 * switches > derived) { /* 1.3 µs a switch against 0.7 µs a derived reading */
        reader_close_switch_check(self);
        return;
    }
    self->review_lock = lock;
    self->review_derived = self->n_derived;
}

/* Steps without a reading after which the switch check is closed (reader_idle_step). */
#define IDLE_CLOSE_STEPS 64

/* One optimizer step passed on the counted thread without a reading: recording is off (a failure
 * disabled it, or the job switched it off). Nothing is derived then, so the perf event only makes
 * each context switch dearer (about 1.3 µs on the development VM, bench/switch_cost.py), and no
 * review comes, for reviews count readings: after IDLE_CLOSE_STEPS such steps in a row it is
 * closed for good. Only the counted thread closes it: another may not unmap the page under a
 * reading in progress. */
static void reader_idle_step(ThreadReader *self) {
    if (self->page != NULL && pthread_equal(pthread_self(), self->owner) &&
        ++self->idle_steps >= IDLE_CLOSE_STEPS)
        reader_close_switch_check(self);
}

static PyObject *ThreadReader_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"clock_id", "fd",           "slack_ns",     "tid",
                             "ident",    "max_derived_ns", "review_reads", NULL};
    long long clock_id, slack_ns, tid = 0, max_derived_ns = 0, review_reads = 4096;
    unsigned long ident = 0;
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LiL|LkLL", kwlist, &clock_id, &fd, &slack_ns,
                                     &tid, &ident, &max_derived_ns, &review_reads))
        return NULL;
    if (review_reads < 1) {
        PyErr_SetString(PyExc_ValueError, "ThreadReader: review_reads must be positive");
        return NULL;
    }
    ThreadReader *self = (ThreadReader *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->clock = (clockid_t)clock_id;
    self->fd = fd;
    self->slack_ns = slack_ns;
    self->raw = NULL;
    self->perf_fd = -1;
    self->page = NULL;
    self->owner = (pthread_t)ident;
    self->max_derived_ns = max_derived_ns;
    self->review_reads = review_reads;
    /* the first review early (see FIRST_REVIEW_DIV) */
    self->since_review = review_reads - (review_reads / FIRST_REVIEW_DIV > 0
                                             ? review_reads / FIRST_REVIEW_DIV
                                             : 1);
    if (tid > 0 && ident != 0 && max_derived_ns > 0) reader_open_switch_check(self, tid);
    long long c;
    if (self->page != NULL) self->lock = self->review_lock = page_lock(self);
    if (reader_cpu(self, &c) < 0 || reader_pread(self) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->off_cpu = mono_ns() - c;
    self->base_t = mono_ns();
    self->base_cpu = self->last_cpu = c;
    return (PyObject *)self;
}

/* Whether this reading may be derived: made on the counted thread, no context switch of it since
 * the last clock read (the page's lock unchanged: a switch changes it, and an update in progress
 * leaves it odd, changed as well), and that read recent enough. Then the thread ran all along:
 * its CPU time grew by the wall time, its run-queue wait did not grow (it only does while the
 * thread is off a CPU, which takes a switch). */
static inline int derive_ok(ThreadReader *self, long long t) {
    return self->page != NULL && t - self->base_t <= self->max_derived_ns &&
           pthread_equal(pthread_self(), self->owner) && page_lock(self) == self->lock;
}

/* One reading: (cpu_ns, schedstat line), a new tuple. */
static PyObject *reader_read(ThreadReader *self) {
    long long t = mono_ns(), c;
    self->idle_steps = 0;
    if (derive_ok(self, t)) {
        c = self->base_cpu + (t - self->base_t);
        self->n_derived++;
    } else {
        if (self->page != NULL) self->lock = page_lock(self); /* before the clock is read */
        if (reader_cpu(self, &c) < 0) return NULL;
        if (t - c - self->off_cpu > self->slack_ns) {
            if (reader_pread(self) < 0) return NULL;
            self->off_cpu = t - c;
        }
        /* when: just after the clock was read (a derived reading is low by the system call's
         * return at most, never high: a switch after the lock was read makes the next exact) */
        self->base_t = mono_ns();
        self->base_cpu = c;
        self->n_exact++;
    }
    if (c < self->last_cpu) c = self->last_cpu; /* a derived reading ran ahead (interrupts) */
    self->last_cpu = c;
    if (self->page != NULL && ++self->since_review >= self->review_reads) reader_review(self);
    PyObject *cpu = PyLong_FromLongLong(c);
    if (cpu == NULL) return NULL;
    PyObject *out = PyTuple_Pack(2, cpu, self->raw);
    Py_DECREF(cpu);
    return out;
}

static PyObject *ThreadReader_call(ThreadReader *self, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "ThreadReader() takes no arguments");
        return NULL;
    }
    return reader_read(self);
}

static void ThreadReader_dealloc(ThreadReader *self) {
    reader_close_switch_check(self);
    Py_XDECREF(self->raw);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *ThreadReader_close_switch_check(ThreadReader *self, PyObject *unused) {
    reader_close_switch_check(self);
    Py_RETURN_NONE;
}

static PyObject *ThreadReader_idle_step(ThreadReader *self, PyObject *unused) {
    reader_idle_step(self);
    Py_RETURN_NONE;
}

static PyMethodDef ThreadReader_methods[] = {
    {"idle_step", (PyCFunction)ThreadReader_idle_step, METH_NOARGS,
     "An optimizer step passed without a reading (recording off): after 64 in a row on the "
     "counted thread, the switch check is closed (it would only make switches dearer)."},
    {"close_switch_check", (PyCFunction)ThreadReader_close_switch_check, METH_NOARGS,
     "Close the perf event (the counters' close: a finished or forked-off reader keeps no event "
     "on the thread); readings read the clock from then on."},
    {NULL},
};

static PyObject *ThreadReader_switch_check(ThreadReader *self, void *closure) {
    return PyBool_FromLong(self->page != NULL);
}

static PyMemberDef ThreadReader_members[] = {
    {"exact_reads", T_ULONGLONG, offsetof(ThreadReader, n_exact), READONLY,
     "readings that read the CPU clock"},
    {"derived_reads", T_ULONGLONG, offsetof(ThreadReader, n_derived), READONLY,
     "readings derived from the wall time (no context switch since the last clock read)"},
    {"max_derived_ns", T_LONGLONG, offsetof(ThreadReader, max_derived_ns), READONLY,
     "the clock is read at least this often (ns)"},
    {"review_reads", T_LONGLONG, offsetof(ThreadReader, review_reads), READONLY,
     "readings between two reviews of the switch check (closed where it costs more than it "
     "saves)"},
    {NULL},
};

static PyGetSetDef ThreadReader_getset[] = {
    {"switch_check", (getter)ThreadReader_switch_check, NULL,
     "whether readings without a context switch since the last clock read are derived", NULL},
    {NULL},
};

static PyTypeObject ThreadReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hvtrace.record._hot.ThreadReader",
    .tp_doc = PyDoc_STR("ThreadReader(clock_id, fd, slack_ns, tid=0, ident=0, max_derived_ns=0, "
                        "review_reads=4096)() -> (cpu_ns, schedstat line): the compiled form of "
                        "hvtrace.record.cpustat._schedstat_reader (the file stays the caller's "
                        "to close); with tid, ident and max_derived_ns, the switch check."),
    .tp_members = ThreadReader_members,
    .tp_getset = ThreadReader_getset,
    .tp_methods = ThreadReader_methods,
    .tp_basicsize = sizeof(ThreadReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ThreadReader_new,
    .tp_dealloc = (destructor)ThreadReader_dealloc,
    .tp_call = (ternaryfunc)ThreadReader_call,
};


/* -- Phases: the per-step hot path ------------------------------------------------------------
 * The compiled forms of Tracer._fwd_pre, _fwd_post, _synchronize and _step (with _end_step,
 * _close_compute, _close_backward, _grad_end, _span and _count_step), line for line on the same
 * fields: hvtrace/record/optimizer.py has the Python forms and the comments. What is rare or
 * Python's own stays in Python and is called from here: the consistency checks' on_step (but
 * for its common case: ph_lr_rows), the live monitor's on_step, the clock collective
 * (resync_clock), the recorder's extend. */

/* What configure() hands over once: span kinds and names, Allreduces, hvdpatch, the clock's
 * resynchronisation steps. */
static PyObject *k_step, *k_input, *k_forward, *k_backward, *k_compute, *k_wait, *k_update,
    *k_scalar;
static PyObject *n_step, *n_input, *n_forward, *n_backward, *n_compute, *n_sync, *n_update;
static PyObject *allreduces_cls, *hvdpatch_mod, *zero_obj, *one_obj, *nan_obj;
static long long resync_first = -1, resync_every = 1;

#define OR_NONE(o) ((o) != NULL ? (o) : Py_None)
#define IS_NONE(o) ((o) == NULL || (o) == Py_None)
#define SET_NONE(field) Py_XSETREF(field, Py_NewRef(Py_None))

static inline PyObject *ph_now(Phases *s) {
    if (IS_NONE(s->now) || s->now == monotonic_ns_func) return PyLong_FromLongLong(mono_ns());
    return PyObject_CallNoArgs(s->now);
}

static inline PyObject *ph_read(Phases *s) {
    if (s->read != NULL && Py_IS_TYPE(s->read, &ThreadReaderType))
        return reader_read((ThreadReader *)s->read);
    if (s->read == NULL) {
        PyErr_SetString(PyExc_AttributeError, "tracer.read is not set");
        return NULL;
    }
    return PyObject_CallNoArgs(s->read);
}

static inline int rec_enabled(Phases *s) {
    if (s->rec == NULL) {
        PyErr_SetString(PyExc_AttributeError, "tracer.rec is not set");
        return -1;
    }
    PyObject *en = PyObject_GetAttr(s->rec, s_enabled);
    if (en == NULL) return -1;
    int r = PyObject_IsTrue(en);
    Py_DECREF(en);
    return r;
}

/* _span: append (rec.step, rec.micro, kind, name, start, end, 0, 0, nan, flags, c0, c1). */
static int ph_span(Phases *s, PyObject *kind, PyObject *name, PyObject *start, PyObject *end,
                   PyObject *c0, PyObject *c1, PyObject *flags) {
    if (list_field(s->rows, "rows") < 0) return -1;
    PyObject *row = PyTuple_New(12);
    if (row == NULL) return -1;
    PyObject *items[10] = {kind, name, start, end, zero_obj, zero_obj, nan_obj, flags, c0, c1};
    for (int i = 0; i < 10; i++) PyTuple_SET_ITEM(row, i + 2, Py_NewRef(OR_NONE(items[i])));
    /* (the items are the row's before the recorder's attributes are read) */
    PyObject *step = PyObject_GetAttr(OR_NONE(s->rec), s_step);
    PyObject *micro = step ? PyObject_GetAttr(OR_NONE(s->rec), s_micro) : NULL;
    if (micro == NULL) {
        Py_XDECREF(step);
        Py_DECREF(row);
        return -1;
    }
    PyTuple_SET_ITEM(row, 0, step);
    PyTuple_SET_ITEM(row, 1, micro);
    PyObject *rows = Py_NewRef(s->rows);
    int rc = PyList_Append(rows, row);
    Py_DECREF(rows);
    Py_DECREF(row);
    return rc;
}

/* _grad_end: when the backward pass that ends now (t) had its last gradient ready (new ref). */
static PyObject *ph_grad_end(Phases *s, PyObject *t) {
    if (list_field(s->enqueued, "enqueued") < 0) return NULL;
    Py_ssize_t mark = s->grad_mark, n = PyList_GET_SIZE(s->enqueued);
    s->grad_mark = n;
    if (!IS_NONE(s->last_grad)) return Py_NewRef(s->last_grad);
    if (n > mark) {
        PyObject *last = PyList_GET_ITEM(s->enqueued, n - 1);
        if (!PyTuple_Check(last) || PyTuple_GET_SIZE(last) < 1) {
            PyErr_SetString(PyExc_TypeError, "tracer.enqueued holds a malformed entry");
            return NULL;
        }
        return Py_NewRef(PyTuple_GET_ITEM(last, 0));
    }
    return Py_NewRef(t);
}

static int ph_close_backward(Phases *s, PyObject *t, PyObject *c) {
    PyObject *end = ph_grad_end(s, t);
    if (end == NULL) return -1;
    int rc = 0;
    if (!IS_NONE(s->bwd_start)) {
        PyObject *start = Py_NewRef(s->bwd_start), *c0 = Py_NewRef(OR_NONE(s->bwd_cpu));
        rc = ph_span(s, k_backward, n_backward, start, end, c0, c, s->flags);
        Py_DECREF(start);
        Py_DECREF(c0);
    }
    Py_DECREF(end);
    if (rc < 0) return -1;
    SET_NONE(s->bwd_start);
    SET_NONE(s->last_grad);
    return 0;
}

static int ph_close_compute(Phases *s, PyObject *t, PyObject *c) {
    if (s->compute_closed) return 0;
    s->compute_closed = 1;
    if (s->fwd_count) return ph_close_backward(s, t, c);
    PyObject *end = ph_grad_end(s, t);
    if (end == NULL) return -1;
    PyObject *start = Py_NewRef(OR_NONE(s->step_start)), *c0 = Py_NewRef(OR_NONE(s->step_cpu));
    int rc = ph_span(s, k_compute, n_compute, start, end, c0, c, s->flags);
    Py_DECREF(start);
    Py_DECREF(c0);
    Py_DECREF(end);
    return rc;
}

static int check_configured(void) {
    if (allreduces_cls != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "hvtrace.record._hot.configure() was not called");
    return -1;
}

/* _fwd_pre(module, args) */
static PyObject *Phases_fwd_pre(Phases *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "c_fwd_pre(module, args)");
        return NULL;
    }
    int en = rec_enabled(s);
    if (en <= 0) return en < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *t = NULL, *c = NULL;
    if (check_configured() < 0) goto error;
    PyObject *ge = PyObject_CallNoArgs(OR_NONE(s->grad_enabled));
    int grad = ge == NULL ? -1 : PyObject_IsTrue(ge);
    Py_XDECREF(ge);
    if (grad < 0) goto error;
    if (!grad) { /* evaluation: no step phase */
        SET_NONE(s->fwd_start);
        Py_RETURN_NONE;
    }
    if ((t = ph_now(s)) == NULL || (c = ph_read(s)) == NULL) goto error;
    if (s->fwd_count == 0) {
        PyObject *start = Py_NewRef(OR_NONE(s->step_start)), *c0 = Py_NewRef(OR_NONE(s->step_cpu));
        int rc = ph_span(s, k_input, n_input, start, t, c0, c, s->flags);
        Py_DECREF(start);
        Py_DECREF(c0);
        if (rc < 0) goto error;
    } else { /* another micro-step (backward_passes_per_step, or several forwards) */
        if (ph_close_backward(s, t, c) < 0) goto error;
        PyObject *micro = PyLong_FromSsize_t(s->fwd_count);
        int rc = micro == NULL ? -1 : PyObject_SetAttr(OR_NONE(s->rec), s_micro, micro);
        Py_XDECREF(micro);
        if (rc < 0) goto error;
    }
    if (PyObject_SetAttr(OR_NONE(s->rec), s_between_steps, Py_False) < 0) goto error;
    Py_XSETREF(s->fwd_start, t);
    Py_XSETREF(s->fwd_cpu, c);
    Py_RETURN_NONE;
error:
    Py_XDECREF(t);
    Py_XDECREF(c);
    return hand_to_fail((PyObject *)s) < 0 ? NULL : Py_NewRef(Py_None);
}

/* _fwd_post(module, args, output) */
static PyObject *Phases_fwd_post(Phases *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "c_fwd_post(module, args, output)");
        return NULL;
    }
    int en = rec_enabled(s);
    if (en <= 0 || IS_NONE(s->fwd_start)) return en < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *t = NULL, *c = NULL;
    if (check_configured() < 0 || (t = ph_now(s)) == NULL || (c = ph_read(s)) == NULL) goto error;
    PyObject *start = Py_NewRef(s->fwd_start), *c0 = Py_NewRef(OR_NONE(s->fwd_cpu));
    int rc = ph_span(s, k_forward, n_forward, start, t, c0, c, s->flags);
    Py_DECREF(start);
    Py_DECREF(c0);
    if (rc < 0) goto error;
    Py_XSETREF(s->bwd_cpu, c); /* backward's counters start here */
    SET_NONE(s->fwd_start);
    s->fwd_count += 1;
    Py_DECREF(t);
    Py_RETURN_NONE;
error:
    Py_XDECREF(t);
    Py_XDECREF(c);
    return hand_to_fail((PyObject *)s) < 0 ? NULL : Py_NewRef(Py_None);
}

/* The Allreduces of this synchronize (a named tuple, made as its __new__ makes it). */
static PyObject *make_allreduces(Phases *s, PyObject *end) {
    PyObject *step = PyObject_GetAttr(OR_NONE(s->rec), s_step);
    PyObject *micro = step ? PyObject_GetAttr(OR_NONE(s->rec), s_micro) : NULL;
    PyObject *out = NULL;
    if (micro != NULL) {
        PyObject *vals = PyTuple_Pack(7, step, micro, OR_NONE(s->ar_flags), s->enqueued, s->done,
                                      end, OR_NONE(s->meta));
        PyObject *args = vals ? PyTuple_Pack(1, vals) : NULL;
        if (args != NULL)
            out = PyTuple_Type.tp_new((PyTypeObject *)allreduces_cls, args, NULL);
        Py_XDECREF(args);
        Py_XDECREF(vals);
    }
    Py_XDECREF(step);
    Py_XDECREF(micro);
    return out;
}

/* _synchronize() */
static PyObject *Phases_synchronize(Phases *s, PyObject *noargs) {
    int en = rec_enabled(s);
    if (en <= 0) return en < 0 ? NULL : PyObject_CallNoArgs(OR_NONE(s->orig_sync));
    PyObject *t0 = NULL, *c0 = NULL, *t1 = NULL, *c1 = NULL, *end = NULL;
    if (check_configured() < 0 || list_field(s->enqueued, "enqueued") < 0 ||
        list_field(s->done, "done") < 0)
        goto pre_error;
    if ((t0 = PyLong_FromLongLong(mono_ns())) == NULL || (c0 = ph_read(s)) == NULL) goto pre_error;
    PyObject *tc = s->is_cuda ? ph_now(s) : Py_NewRef(t0);
    int rc = tc == NULL ? -1 : ph_close_compute(s, tc, c0);
    Py_XDECREF(tc);
    if (rc < 0) goto pre_error;
    /* (no poll here: Horovod now waits for each handle in order, and hvdpatch notes when each
     * wait returns) */
    s->in_sync = 1;
    if (PyObject_SetAttr(OR_NONE(s->rec), s_between_steps, Py_False) < 0 ||
        PyObject_SetAttr(hvdpatch_mod, s_observer, (PyObject *)s) < 0)
        goto pre_error;
    PyObject *out = PyObject_CallNoArgs(OR_NONE(s->orig_sync));
    s->in_sync = 0;
    {
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        if (PyObject_SetAttr(hvdpatch_mod, s_observer, Py_None) < 0) PyErr_Clear();
        PyErr_Restore(type, exc, tb);
    }
    if (out == NULL) {
        Py_DECREF(t0);
        Py_DECREF(c0);
        return NULL;
    }
    if ((t1 = PyLong_FromLongLong(mono_ns())) == NULL || (c1 = ph_read(s)) == NULL) goto error;
    if ((end = s->is_cuda ? ph_now(s) : Py_NewRef(t1)) == NULL) goto error;
    if (ph_span(s, k_wait, n_sync, t0, t1, c0, c1, zero_obj) < 0) goto error;
    Py_XSETREF(s->sync_exit, Py_NewRef(end));
    Py_XSETREF(s->sync_cpu, Py_NewRef(c1));
    if (list_field(s->enqueued, "enqueued") < 0 || list_field(s->done, "done") < 0) goto error;
    PyObject *ar = make_allreduces(s, end);
    if (ar == NULL) goto error;
    PyObject *rows = Py_NewRef(s->rows);
    rc = PyList_Append(rows, ar);
    Py_DECREF(rows);
    Py_DECREF(ar);
    if (rc < 0) goto error;
    PyObject *enq = PyList_New(0), *done = PyList_New(0);
    if (enq == NULL || done == NULL) {
        Py_XDECREF(enq);
        Py_XDECREF(done);
        goto error;
    }
    Py_XSETREF(s->enqueued, enq);
    Py_XSETREF(s->done, done);
    s->poll_idx = s->grad_mark = 0;
    Py_DECREF(t0);
    Py_DECREF(c0);
    Py_DECREF(t1);
    Py_DECREF(c1);
    Py_DECREF(end);
    return out;
error:
    Py_DECREF(t0);
    Py_DECREF(c0);
    Py_XDECREF(t1);
    Py_XDECREF(c1);
    Py_XDECREF(end);
    if (hand_to_fail((PyObject *)s) < 0) Py_CLEAR(out);
    return out;
pre_error:
    s->in_sync = 0;
    Py_XDECREF(t0);
    Py_XDECREF(c0);
    if (hand_to_fail((PyObject *)s) < 0) return NULL;
    return PyObject_CallNoArgs(OR_NONE(s->orig_sync));
}

/* _end_step(ts, cs): close the update and the step (the optimizer's update ran from ts). */
static int ph_end_step(Phases *s, PyObject *ts, PyObject *cs) {
    PyObject *te = NULL, *c = NULL, *us = NULL, *uc = NULL, *rows = NULL, *fresh = NULL;
    int rc = -1;
    if ((te = ph_now(s)) == NULL || (c = ph_read(s)) == NULL) goto out;
    if (!s->compute_closed && ph_close_compute(s, ts, Py_None) < 0) goto out;
    if (!IS_NONE(s->sync_exit)) { /* the update ran from synchronize's exit */
        us = Py_NewRef(s->sync_exit);
        uc = Py_NewRef(OR_NONE(s->sync_cpu));
    } else {
        us = Py_NewRef(ts);
        uc = Py_NewRef(cs);
    }
    if (ph_span(s, k_update, n_update, us, te, uc, c, s->flags) < 0) goto out;
    {
        PyObject *start = Py_NewRef(OR_NONE(s->step_start)), *c0 = Py_NewRef(OR_NONE(s->step_cpu));
        int r = ph_span(s, k_step, n_step, start, te, c0, c, s->flags);
        Py_DECREF(start);
        Py_DECREF(c0);
        if (r < 0) goto out;
    }
    if ((fresh = PyList_New(0)) == NULL) goto out;
    rows = s->rows; /* the step's entries, handed to the recorder */
    s->rows = fresh;
    fresh = NULL;
    PyObject *r = PyObject_CallMethodOneArg(OR_NONE(s->rec), s_extend, rows);
    if (r == NULL) goto out;
    Py_DECREF(r);
    Py_XSETREF(s->done_rows, rows); /* the live window's, at _count_step */
    rows = NULL;
    PyObject *step = PyObject_GetAttr(OR_NONE(s->rec), s_step);
    PyObject *next = step ? PyNumber_Add(step, one_obj) : NULL;
    Py_XDECREF(step);
    int set = next == NULL ? -1 : PyObject_SetAttr(OR_NONE(s->rec), s_step, next);
    Py_XDECREF(next);
    if (set < 0) goto out;
    if (PyObject_SetAttr(OR_NONE(s->rec), s_micro, zero_obj) < 0) goto out;
    s->fwd_count = 0;
    if (PyObject_SetAttr(OR_NONE(s->rec), s_between_steps, Py_True) < 0) goto out;
    Py_XSETREF(s->step_start, Py_NewRef(te));
    Py_XSETREF(s->step_cpu, Py_NewRef(c));
    s->compute_closed = 0;
    SET_NONE(s->bwd_start);
    SET_NONE(s->last_grad);
    rc = 0;
out:
    Py_XDECREF(te);
    Py_XDECREF(c);
    Py_XDECREF(us);
    Py_XDECREF(uc);
    Py_XDECREF(rows);
    Py_XDECREF(fresh);
    return rc;
}

/* _count_step: count a step on every rank; the scheduled clock collective. 1 if it ran. */
static int ph_count_step(Phases *s) {
    s->steps_done += 1;
    long long n = s->steps_done;
    if (!IS_NONE(s->live)) {
        PyObject *rows = Py_NewRef(OR_NONE(s->done_rows)), *fresh = PyList_New(0);
        if (fresh == NULL) {
            Py_DECREF(rows);
            return -1;
        }
        Py_XSETREF(s->done_rows, fresh);
        PyObject *live = Py_NewRef(s->live);
        PyObject *r = PyObject_CallMethodOneArg(live, s_on_step, rows);
        Py_DECREF(live);
        Py_DECREF(rows);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    if (n == resync_first || (n > resync_first && n % resync_every == 0)) {
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)s, s_resync_clock);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 1;
    }
    return 0;
}

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

/* _step(closure=None) */
static PyObject *Phases_step(Phases *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"closure", NULL};
    PyObject *closure = Py_None, *out, *ts = NULL, *cs = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:step", kwlist, &closure)) return NULL;
    int en = rec_enabled(s);
    if (en < 0) return NULL;
    if (!en) {
        if (s->read != NULL && Py_IS_TYPE(s->read, &ThreadReaderType))
            reader_idle_step((ThreadReader *)s->read); /* no readings: the event only costs */
        if ((out = PyObject_CallOneArg(OR_NONE(s->orig_step), closure)) == NULL) return NULL;
        if (ph_count_step(s) < 0) Py_CLEAR(out);
        return out;
    }
    if (!IS_NONE(s->checks)) { /* learning rates; every N steps the weights (no raise) */
        PyObject *step = PyObject_GetAttr(OR_NONE(s->rec), s_step);
        PyObject *checks = Py_NewRef(s->checks);
        int done = step ? ph_lr_rows(s, checks, step) : -1;
        if (done == 0) { /* not the common case: on_step itself */
            PyObject *r = PyObject_CallMethodOneArg(checks, s_on_step, step);
            done = r == NULL ? -1 : 1;
            Py_XDECREF(r);
        }
        Py_DECREF(checks);
        Py_XDECREF(step);
        if (done < 0 && hand_to_fail((PyObject *)s) < 0) return NULL;
    }
    /* synchronize() already ran (the skip pattern): the update's counters start here */
    if (check_configured() < 0 || (ts = ph_now(s)) == NULL ||
        (cs = s->compute_closed ? ph_read(s) : Py_NewRef(Py_None)) == NULL) {
        Py_CLEAR(ts);
        if (hand_to_fail((PyObject *)s) < 0) return NULL;
    } else {
        SET_NONE(s->sync_exit); /* set again if Horovod's step() synchronizes */
    }
    out = PyObject_CallOneArg(OR_NONE(s->orig_step), closure);
    if (out == NULL) {
        Py_XDECREF(ts);
        Py_XDECREF(cs);
        return NULL;
    }
    if (ts != NULL) {
        en = rec_enabled(s);
        if (en < 0 || (en && ph_end_step(s, ts, cs) < 0)) {
            if (hand_to_fail((PyObject *)s) < 0) {
                Py_DECREF(ts);
                Py_XDECREF(cs);
                Py_DECREF(out);
                return NULL;
            }
        }
        Py_DECREF(ts);
        Py_XDECREF(cs);
    }
    int counted = ph_count_step(s);
    if (counted < 0) {
        Py_DECREF(out);
        return NULL;
    }
    if (counted) {
        PyObject *t = ph_now(s), *c = t ? ph_read(s) : NULL;
        if (c == NULL) {
            Py_XDECREF(t);
            if (hand_to_fail((PyObject *)s) < 0) Py_CLEAR(out);
        } else {
            Py_XSETREF(s->step_start, t);
            Py_XSETREF(s->step_cpu, c);
        }
    }
    return out;
}

static PyObject *Phases_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Phases *s = (Phases *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
#define INIT_NONE(f) s->f = Py_NewRef(Py_None);
    PHASES_OBJECTS(INIT_NONE)
#undef INIT_NONE
    return (PyObject *)s;
}

static int Phases_traverse(Phases *s, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(s->f);
    PHASES_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int Phases_clear(Phases *s) {
#define CLEAR(f) Py_CLEAR(s->f);
    PHASES_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void Phases_dealloc(Phases *s) {
    PyObject_GC_UnTrack(s);
    Phases_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s); /* (a subclass's dealloc releases its type) */
}

#define OBJ_MEMBER(name, field, doc) \
    {name, T_OBJECT_EX, offsetof(Phases, field), 0, doc}
static PyMemberDef Phases_members[] = {
    OBJ_MEMBER("rec", rec, "the Recorder"),
    OBJ_MEMBER("now", now, "the timer's now() (time.monotonic_ns: read here)"),
    OBJ_MEMBER("read", read, "the counter reading (a ThreadReader: called here)"),
    OBJ_MEMBER("_grad_enabled", grad_enabled, "torch.is_grad_enabled"),
    OBJ_MEMBER("_orig_sync", orig_sync, "Horovod's synchronize"),
    OBJ_MEMBER("_orig_step", orig_step, "Horovod's step"),
    OBJ_MEMBER("checks", checks, "the consistency checks, or None"),
    OBJ_MEMBER("live", live, "live detection, or None"),
    OBJ_MEMBER("flags", flags, "span flags"),
    OBJ_MEMBER("ar_flags", ar_flags, "allreduce span flags"),
    OBJ_MEMBER("step_start", step_start, NULL),
    OBJ_MEMBER("step_cpu", step_cpu, NULL),
    OBJ_MEMBER("fwd_start", fwd_start, NULL),
    OBJ_MEMBER("fwd_cpu", fwd_cpu, NULL),
    OBJ_MEMBER("bwd_start", bwd_start, NULL),
    OBJ_MEMBER("bwd_cpu", bwd_cpu, NULL),
    OBJ_MEMBER("sync_exit", sync_exit, NULL),
    OBJ_MEMBER("sync_cpu", sync_cpu, NULL),
    OBJ_MEMBER("last_grad", last_grad, NULL),
    OBJ_MEMBER("rows", rows, NULL),
    OBJ_MEMBER("done_rows", done_rows, NULL),
    OBJ_MEMBER("enqueued", enqueued, NULL),
    OBJ_MEMBER("done", done, NULL),
    OBJ_MEMBER("meta", meta, NULL),
    {"fwd_count", T_PYSSIZET, offsetof(Phases, fwd_count), 0, NULL},
    {"poll_idx", T_PYSSIZET, offsetof(Phases, poll_idx), 0, NULL},
    {"grad_mark", T_PYSSIZET, offsetof(Phases, grad_mark), 0, NULL},
    {"steps_done", T_LONGLONG, offsetof(Phases, steps_done), 0, NULL},
    {"compute_closed", T_BOOL, offsetof(Phases, compute_closed), 0, NULL},
    {"in_sync", T_BOOL, offsetof(Phases, in_sync), 0, NULL},
    {"is_cuda", T_BOOL, offsetof(Phases, is_cuda), 0, NULL},
    {"has_model", T_BOOL, offsetof(Phases, has_model), 0, NULL},
    {NULL},
};
#undef OBJ_MEMBER

static PyMethodDef Phases_methods[] = {
    {"c_fwd_pre", (PyCFunction)(void (*)(void))Phases_fwd_pre, METH_FASTCALL,
     "The compiled Tracer._fwd_pre (a forward pre-hook)."},
    {"c_fwd_post", (PyCFunction)(void (*)(void))Phases_fwd_post, METH_FASTCALL,
     "The compiled Tracer._fwd_post (a forward hook)."},
    {"c_synchronize", (PyCFunction)Phases_synchronize, METH_NOARGS,
     "The compiled Tracer._synchronize."},
    {"c_step", (PyCFunction)(void (*)(void))Phases_step, METH_VARARGS | METH_KEYWORDS,
     "The compiled Tracer._step(closure=None)."},
    {NULL},
};

static PyTypeObject PhasesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hvtrace.record._hot.Phases",
    .tp_doc = PyDoc_STR("The Tracer's per-step state as C fields, and the compiled forms of its "
                        "per-step hooks (c_fwd_pre, c_fwd_post, c_synchronize, c_step)."),
    .tp_basicsize = sizeof(Phases),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = Phases_new,
    .tp_dealloc = (destructor)Phases_dealloc,
    .tp_traverse = (traverseproc)Phases_traverse,
    .tp_clear = (inquiry)Phases_clear,
    .tp_members = Phases_members,
    .tp_methods = Phases_methods,
};

/* configure(kinds, allreduces, hvdpatch, resync_first, resync_every): what the hooks need from
 * hvtrace's Python modules (schema.KIND_CODE, rows.Allreduces, record.hvdpatch, the steps of the
 * clock collective), once, from hvtrace.record.optimizer. */
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


/* -- HandleWait: Horovod's module-level synchronize(handle), wrapped ---------------------------
 * The compiled form of hvtrace.record.hvdpatch's wrapper: calls Horovod's function unchanged,
 * then, while a traced optimizer is inside its own synchronize() (hvdpatch.observer is its
 * tracer), appends (handle, monotonic ns) to that tracer's done list. An error of hvtrace's goes to the
 * tracer's fail(); Horovod's pass through unchanged. */
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
    PyObject *obs = PyObject_GetAttr(hvdpatch_mod, s_observer);
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
                        "returns (the compiled form of hvtrace.record.hvdpatch's wrapper)."),
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

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(kinds, allreduces, hvdpatch, resync_first, resync_every): what the compiled "
     "per-step hooks need from hvtrace's modules (once, from hvtrace.record.optimizer)."},
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
