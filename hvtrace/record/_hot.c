/* hvtrace.record._hot: the recorder's hot path (per allreduce, per phase boundary, per counter
 * reading), compiled.
 *
 * One extension, one translation unit: this file includes its parts, in this order (each uses
 * what the ones before it define), and is the only C source the build names (pyproject.toml,
 * with the C++ shim _hvdpoll.cpp that catches Horovod's exceptions). Each part's Python twin is in
 * hvtrace/record/hot.py, in the same order, recording the same where this is not built or
 * ``$HVTRACE_NATIVE`` is off:
 *
 *   part              compiled                          Python twin (hvtrace.record.hot)
 *   _hot/common.h     struct Phases (its fields),       PHASES_FIELDS, Phases (the fields'
 *                     the error helpers                 fallback base)
 *   _hot/reader.c     ThreadReader                      schedstat_reader
 *   _hot/enqueue.c    HorovodPoll, Enqueue, poll_done   TracerHooks._enqueue_wrapper, _poll_done
 *   _hot/phases.c     Phases.c_fwd_pre, c_fwd_post,     TracerHooks._fwd_pre, _fwd_post,
 *                     c_synchronize, c_step             _synchronize, _step (and their helpers)
 *   _hot/lr_rows.c    ph_lr_rows                        LrRows.on_step (the consistency checks)
 *   _hot/wait.c       HandleWait                        handle_wait
 *   _hot/deltas.c     deltas_into                       cpustat._deltas_py (off the hot
 *                                                       path: the writer's and live thread's)
 *   _hot/module.c     configure, the module's init      configure
 *
 * Phases: the base class of ``Tracer`` (hvtrace/record/optimizer.py). It holds the tracer's
 * per-step state as C fields (the boundaries' timer tokens and readings, the step's spans so far,
 * the allreduces of the current synchronize, the counters and flags), which the Python code reads
 * and writes as attributes, as it would on any object, so the Python code around it is the same
 * whichever form runs. Their Python names are declared once, hvtrace.record.hot.PHASES_FIELDS;
 * tests/unit/test_hot_fields.py checks that Phases exposes exactly those. What is Python's own
 * (the consistency checks, live detection, the clock collective, the recorder's buffer) the hooks
 * call, but for the consistency checks' common step (float learning rates, nothing else due),
 * whose rows ``c_step`` writes itself. tests/unit/test_phases.py, test_hot_path.py and
 * test_cpustat.py run both forms through the same steps.
 *
 * Built as an optional extension (pyproject.toml); where it is missing the Python forms run.
 * ``make setup`` rebuilds it when any part changes (the Makefile's stamp), and so does
 * ``setup.py build_ext --inplace`` (setup.py names the parts as the extension's depends).
 */
#include "_hot/common.h"
#include "_hot/reader.c"
#include "_hot/enqueue.c"
#include "_hot/phases.c"
#include "_hot/lr_rows.c"
#include "_hot/wait.c"
#include "_hot/deltas.c"
#include "_hot/module.c"
