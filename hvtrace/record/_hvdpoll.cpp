// Horovod's PyTorch PollHandle, called without the Python layer: a C++ shim so that the exception
// Horovod throws for a handle it does not know (std::invalid_argument) is caught here and turned
// into an error code, never unwinding through hvtrace's C (hvtrace/record/_hot.c).
#include <exception>

// Horovod 0.28.1 returns int (0/1, its bool widened); read as bool, only the low byte counts,
// which is right for either return type.
typedef bool (*poll_fn)(int);

extern "C" int hvtrace_poll_handle(void *fn, int handle, int *err) {
    try {
        *err = 0;
        return reinterpret_cast<poll_fn>(fn)(handle) ? 1 : 0;
    } catch (...) {
        *err = 1;
        return 0;
    }
}
