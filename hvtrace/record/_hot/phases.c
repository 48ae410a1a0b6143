/* hvtrace/record/_hot/phases.c: Phases, the Tracer's base class: its per-step state as C fields
 * (common.h) and the compiled forms of its per-step hooks. Part of hvtrace/record/_hot.c
 * (included there after enqueue.c); not compiled alone.
 * Python twins: hvtrace.record.hot.TracerHooks (the Tracer's base class in Python): ``c_fwd_pre``,
 * ``c_fwd_post``, ``c_synchronize`` and ``c_step`` are its ``_fwd_pre``, ``_fwd_post``,
 * ``_synchronize`` and ``_step``; ph_span, ph_grad_end, ph_close_backward, ph_close_compute,
 * ph_end_step and ph_count_step its ``_span``, ``_grad_end``, ``_close_backward``,
 * ``_close_compute``, ``_end_step`` and ``_count_step``. Line for line on the same fields:
 * hvtrace/record/hot.py has the Python forms and the comments. The Python code around the hooks
 * reads and writes the fields as attributes, as it would on any object, so it is the same
 * whichever form runs; tests/unit/test_phases.py runs both forms through the same steps.
 *
 * What is rare or Python's own stays in Python and is called from here: the consistency checks'
 * on_step (but for its common case: ph_lr_rows, lr_rows.c), the live monitor's on_step, the clock
 * collective (resync_clock), the recorder's extend. */

static inline PyObject *ph_now(Phases *s) {
    if (IS_NONE(s->now) || s->now == monotonic_ns_func) return PyLong_FromLongLong(mono_ns());
    return PyObject_CallNoArgs(s->now);
}

static inline PyObject *ph_read_now(Phases *s) {
    if (s->read != NULL && Py_IS_TYPE(s->read, &ThreadReaderType))
        return reader_read((ThreadReader *)s->read);
    if (s->read == NULL) {
        PyErr_SetString(PyExc_AttributeError, "tracer.read is not set");
        return NULL;
    }
    return PyObject_CallNoArgs(s->read);
}

/* _read: a counter reading, or None on a step that reads none (counters_off). */
static inline PyObject *ph_read(Phases *s) {
    if (s->counters_off) return Py_NewRef(Py_None);
    return ph_read_now(s);
}

/* Steps between two reviews of counter_every (a power of two), and its largest value. */
#define COUNTER_REVIEW_STEPS 64
#define COUNTER_MAX_EVERY 64

/* _next_counters_off: whether the next step (number steps_done + 1) reads no CPU counters. Every
 * COUNTER_REVIEW_STEPS steps, counter_every becomes the largest power of two (at most
 * COUNTER_MAX_EVERY) whose steps, at the mean step of the last review period, last no longer than
 * counter_gap_ns; a step reads them when its number is a multiple of it: the same steps on every
 * rank (a rank that chose a smaller power reads them on those steps and more). */
static char ph_next_counters_off(Phases *s) {
    long long n = s->steps_done + 1;
    if (s->counter_gap_ns <= 0) {
        s->counter_every = 1;
        return 0;
    }
    if (n % COUNTER_REVIEW_STEPS == 0) {
        long long now = mono_ns();
        if (s->counter_mark_ns > 0) {
            long long period = (now - s->counter_mark_ns) / COUNTER_REVIEW_STEPS, k = 1;
            while (period > 0 && k < COUNTER_MAX_EVERY && 2 * k * period <= s->counter_gap_ns)
                k *= 2;
            s->counter_every = k;
        }
        s->counter_mark_ns = now;
    }
    return s->counter_every > 1 && n % s->counter_every != 0;
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

/* The tracer inside its own synchronize() (borrowed: that call holds it), else NULL: what
 * hvdpatch.observer says, read by HandleWait (wait.c) without a module attribute lookup per handle.
 * The module attribute is still set, for the Python twin's wrapper (hvtrace.record.hot). */
static PyObject *sync_observer = NULL;

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
    sync_observer = (PyObject *)s;
    PyObject *out = PyObject_CallNoArgs(OR_NONE(s->orig_sync));
    sync_observer = NULL;
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
    if ((te = ph_now(s)) == NULL) goto out;
    /* the reading that ends this step and begins the next: taken if either reads counters */
    char next_off = ph_next_counters_off(s);
    if ((c = s->counters_off && next_off ? Py_NewRef(Py_None) : ph_read_now(s)) == NULL) goto out;
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
    s->counters_off = next_off;
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

/* The consistency checks' common step (lr_rows.c, included after this part). */
static int ph_lr_rows(Phases *s, PyObject *checks, PyObject *step);

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
    {"counter_every", T_LONGLONG, offsetof(Phases, counter_every), 0, NULL},
    {"counter_gap_ns", T_LONGLONG, offsetof(Phases, counter_gap_ns), 0, NULL},
    {"counter_mark_ns", T_LONGLONG, offsetof(Phases, counter_mark_ns), 0, NULL},
    {"compute_closed", T_BOOL, offsetof(Phases, compute_closed), 0, NULL},
    {"in_sync", T_BOOL, offsetof(Phases, in_sync), 0, NULL},
    {"is_cuda", T_BOOL, offsetof(Phases, is_cuda), 0, NULL},
    {"has_model", T_BOOL, offsetof(Phases, has_model), 0, NULL},
    {"counters_off", T_BOOL, offsetof(Phases, counters_off), 0, NULL},
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
