/* hvtrace/record/_hot/reader.c: ThreadReader, the training thread's counter reading. Part of
 * hvtrace/record/_hot.c (included there after common.h); not compiled alone.
 * Python twin: hvtrace.record.hot.schedstat_reader (chosen between them by
 * hvtrace.record.cpustat._schedstat_reader).
 *
 * The reading of the training thread's counters at a phase boundary, as the Python twin's closure
 * does it (its CPU clock; its schedstat line only when it was off a CPU long enough since the last
 * read, else that line again), in one call instead of three Python calls around the system call.
 * The ``pread`` holds the GIL: a read of a procfs line does not block, and releasing the GIL there
 * would let another thread in mid-step. With the switch check (a perf event's user page on the
 * thread, where Linux allows one), a reading made by the thread itself with no context switch of
 * it since the last clock read, at most ``max_derived_ns`` ago, adds the wall time since instead
 * of reading the clock: no system call (hvtrace/record/cpustat.py has why that is the same
 * figure). It closes itself where it costs more than it saves (reader_review).
 */
#ifdef __linux__
#include <linux/perf_event.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#else
struct perf_event_mmap_page { uint32_t lock; }; /* never mapped: no switch check there */
#endif

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
                        "hvtrace.record.hot.schedstat_reader (the file stays the caller's "
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
