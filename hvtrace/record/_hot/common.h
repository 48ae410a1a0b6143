/* hvtrace/record/_hot/common.h: what the parts of hvtrace.record._hot share. Included first by
 * hvtrace/record/_hot.c (one extension, one translation unit); not compiled alone.
 *
 * The interned attribute names and the host clock; the Tracer's per-step state (``Phases``, its
 * C fields); the helpers every wrapper uses on an error; what configure() hands over once.
 */
#ifndef HVTRACE_HOT_COMMON_H
#define HVTRACE_HOT_COMMON_H

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

static PyObject *s_enabled, *s_meta, *s_learn, *s_between_steps, *s_step, *s_micro, *s_extend,
    *s_on_step, *s_resync_clock, *s_observer, *s_fail, *s_every, *s_pending, *s_groups,
    *s_n_groups, *s_lr_names, *s_lr;
static PyObject *monotonic_ns_func; /* time.monotonic_ns: when it is the clock, read it here */

static inline long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The Tracer's per-step state (hvtrace.record.optimizer.Tracer is a subclass of Phases): C fields
 * that Python reads and writes as attributes (member descriptors: Phases_members, phases.c) and
 * the compiled hooks use directly (phases.c, lr_rows.c; enqueue.c and wait.c: the allreduces in
 * flight). Objects are never NULL after tp_new (None); ``del`` makes one NULL, read as None.
 * Their Python names are declared once, hvtrace.record.hot.PHASES_FIELDS: a field added here must
 * be added there and to Phases_members (tests/unit/test_hot_fields.py checks that they agree).
 * The CPU counters' sampling (phases.c, ph_next_counters_off): read on the steps whose number
 * counter_every divides (counters_off: not this one); counter_every is reviewed every
 * COUNTER_REVIEW_STEPS steps against counter_gap_ns (0: every step) from counter_mark_ns (host
 * ns at the last review). */
typedef struct {
    PyObject_HEAD
    PyObject *rec, *now, *read, *grad_enabled, *orig_sync, *orig_step, *checks, *live;
    PyObject *flags, *ar_flags;
    PyObject *step_start, *step_cpu, *fwd_start, *fwd_cpu, *bwd_start, *bwd_cpu;
    PyObject *sync_exit, *sync_cpu, *last_grad;
    PyObject *rows, *done_rows, *enqueued, *done, *meta;
    Py_ssize_t fwd_count, poll_idx, grad_mark;
    long long steps_done;
    long long counter_every, counter_gap_ns, counter_mark_ns;
    char compute_closed, in_sync, is_cuda, has_model, counters_off;
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

#define OR_NONE(o) ((o) != NULL ? (o) : Py_None)
#define IS_NONE(o) ((o) == NULL || (o) == Py_None)
#define SET_NONE(field) Py_XSETREF(field, Py_NewRef(Py_None))

/* What configure() (module.c) hands over once: span kinds and names, Allreduces, hvdpatch, the
 * clock's resynchronisation steps; and the constants the module's init makes. */
static PyObject *k_step, *k_input, *k_forward, *k_backward, *k_compute, *k_wait, *k_update,
    *k_scalar;
static PyObject *n_step, *n_input, *n_forward, *n_backward, *n_compute, *n_sync, *n_update;
static PyObject *allreduces_cls, *hvdpatch_mod, *zero_obj, *one_obj, *nan_obj;
static long long resync_first = -1, resync_every = 1;

static int check_configured(void) {
    if (allreduces_cls != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "hvtrace.record._hot.configure() was not called");
    return -1;
}

#endif /* HVTRACE_HOT_COMMON_H */
