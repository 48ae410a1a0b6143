"""A run that is still being written: the page's data, refreshed in the background.

:class:`LiveFeed` looks at the run every ``poll_s`` seconds on a thread of its own
(:class:`hvtrace.follow.RunFollower`: only what the rank files gained since the last look is
read, and only the steps a rank may still add to are analyzed again), and when the files grew
replaces the page's :class:`~hvtrace_dashboard.app.DashboardData` and bumps ``version``. The page
asks for the version every few seconds (``dcc.Interval``) and redraws what changed. When no
stream is open any more (the job finished and compacted its files) the feed says so and stops
looking; when the open streams stopped growing for :data:`hvtrace.follow.STALE_S` (a job that
hangs, was killed, or checkpoints for long) it says so and looks less often.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from hvtrace.follow import Look, RunFollower

if TYPE_CHECKING:
    from hvtrace_dashboard.app import DashboardData

log = logging.getLogger("hvtrace.dashboard")

#: Seconds between two looks at a live run's files.
POLL_S: Final = 2.0
#: Seconds between two looks at a run whose open files stopped growing.
QUIET_POLL_S: Final = 10.0
#: Milliseconds between two questions of the page to the server (the page redraws only when the
#: version changed). A step written to the files is on the page within about POLL_S + this + the
#: analysis' time.
REFRESH_MS: Final = 2000


class LiveFeed:
    """The current :class:`DashboardData` of a followed run (see the module doc).

    ``make(look, analysis)`` turns a look and its analysis into the page's data.
    """

    def __init__(
        self,
        follower: RunFollower,
        data: DashboardData,
        look: Look,
        make: Callable[[Look, Any], DashboardData],
        poll_s: float = POLL_S,
    ) -> None:
        self.follower = follower
        self.make = make
        self.poll_s = float(poll_s)
        self._lock = threading.Lock()
        self._data = data
        self.version = 1
        self.live = look.live
        self.quiet_s = look.quiet_s
        self.open_streams = look.open_streams
        self.updated_wall = time.time()
        self.error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def data(self) -> DashboardData:
        """The page's data as of the last refresh."""
        with self._lock:
            return self._data

    def refresh(self) -> bool:
        """Look at the files once; when they grew (or the run stopped being live), analyze and
        publish new data. Returns whether the version changed."""
        look = self.follower.look()
        was_live = self.live
        if look.new_bytes == 0 and look.live == was_live and look.open_streams == self.open_streams:
            self.quiet_s, self.error = look.quiet_s, ""  # looked fine: no failure to report
            return False
        a = self.follower.analyze(look)
        new = self.make(look, a)
        with self._lock:
            self._data = new
            self.version += 1
            self.live = look.live
            self.quiet_s = look.quiet_s
            self.open_streams = look.open_streams
            self.updated_wall = time.time()
            self.error = ""
        return True

    def start(self) -> None:
        """Start looking on a daemon thread (until the run stops being live, or :meth:`stop`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hvtrace-live", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop looking."""
        self._stop.set()

    def _loop(self) -> None:
        # a run that went quiet (a long checkpoint, a hang) is still looked at, less often
        while self.open_streams and not self._stop.wait(self.poll_s if self.live else QUIET_POLL_S):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - a failed look is tried again
                msg = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                if msg != self.error:
                    log.warning("live refresh failed (tried again): %s", msg)
                self.error = msg
        self.follower.close()

    def snapshot(self) -> tuple[dict[str, Any], DashboardData]:
        """The live line (:meth:`status`) and the data it speaks of, taken together."""
        with self._lock:
            return self._status(self._data), self._data

    def status(self) -> dict[str, Any]:
        """What the page's live line says: ``live``, ``version``, ``last_step`` and ``text``."""
        return self.snapshot()[0]

    def _status(self, data: DashboardData) -> dict[str, Any]:
        when = time.strftime("%H:%M:%S", time.localtime(self.updated_wall))
        if self.live:
            text = (
                f"● live: step {data.last_step} · {self.open_streams} rank file(s) being "
                f"written · updated {when}"
            )
        elif self.open_streams:
            text = (
                f"not growing for {self.quiet_s:.0f} s (job stopped or hung?); "
                f"last step {data.last_step}"
            )
        else:
            text = f"finished: every rank closed its file; last step {data.last_step}"
        if self.error:
            text += f" · last refresh failed: {self.error}"
        return {
            "live": self.live,
            "following": bool(self.open_streams),
            "version": self.version,
            "last_step": data.last_step,
            "text": text,
        }
