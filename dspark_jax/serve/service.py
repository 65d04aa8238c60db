"""The thread life of a long-running service: warm up (in the caller's thread or in the
background), then run one loop thread; drain or abort on shutdown; a failure anywhere is
kept in ``failure`` and ends the service, loudly.

``Engine`` is the one service; this module holds the lifecycle so the engine module is
about slots and rounds. Subclasses implement ``_warm()``, ``_loop()`` and
``_fail_everything(reason, message)`` and wait on ``_wake`` (a condition over ``_lock``).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Service:
    """Warm-up, loop thread and shutdown; see the module docstring."""

    thread_name = "dspark-service"

    def __init__(self):
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._accepting = False
        self._stop = False
        self._abort_all = False
        self._thread: threading.Thread | None = None
        self._warm_thread: threading.Thread | None = None
        self.failure: str | None = None

    # -- implemented by the service ------------------------------------------------------
    def _warm(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        raise NotImplementedError

    def _fail_everything(self, reason: str, message: str | None = None) -> None:
        raise NotImplementedError

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, background: bool = False):
        """Warm up, then run the loop thread. ``background``: return at once and warm up
        in a thread (``starting`` is True meanwhile; a warm-up error sets ``failure``) so
        a server can answer /health while compiling."""
        if self._thread is not None or self._warm_thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        if not background:
            self._warm_then_run()
            return self
        self._warm_thread = threading.Thread(
            target=self._warm_in_background, name=f"{self.thread_name}-warmup", daemon=True
        )
        self._warm_thread.start()
        return self

    def _warm_then_run(self) -> None:
        self._warm()
        with self._lock:
            if self._stop:  # shut down while warming up: never start serving
                return
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def _warm_in_background(self) -> None:
        try:
            self._warm_then_run()
        except Exception as e:
            log.exception("%s warm-up failed", type(self).__name__)
            self.failure = f"warm-up failed: {type(e).__name__}: {e}"

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # a device/runtime failure: fail every request, loudly
            log.exception("%s loop failed", type(self).__name__)
            self.failure = f"engine failure: {type(e).__name__}: {e}"
            self._accepting = False
            self._fail_everything("error", self.failure)
        finally:
            self._loop_ended(failed=self.failure is not None)

    def _loop_ended(self, failed: bool) -> None:
        """Called once the loop thread ends (drained, aborted or failed)."""

    def fail(self, reason: str) -> None:
        """End the service from outside its loop (another process of a multi-host run
        was lost): every request fails with ``reason``, /health reports it, nothing new
        is accepted. The loop thread may be blocked on the device; it is not waited on."""
        with self._lock:
            if self.failure is None:
                self.failure = reason
            self._accepting = False
            self._wake.notify_all()
        try:  # "abort": the server answers 503 (the service is gone, not the request)
            self._fail_everything("abort", reason)
        except Exception:  # the loop thread may be mid-turn; the process is ending anyway
            log.exception("failing the remaining requests")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until a background warm-up has ended; True if the service is running."""
        if self._warm_thread is not None:
            self._warm_thread.join(timeout)
        return self.running

    @property
    def starting(self) -> bool:
        """Warming up in the background."""
        return (
            self._warm_thread is not None
            and self._warm_thread.is_alive()
            and self._thread is None
            and self.failure is None
        )

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.running

    def begin_drain(self) -> None:
        """Stop accepting new work; accepted work still completes."""
        with self._lock:
            self._accepting = False
            self._wake.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the service. ``drain``: finish all accepted work first; otherwise the loop
        ends at once and ``_fail_everything("abort", ...)`` ends what is left."""
        with self._lock:
            self._accepting = False
            if not drain:
                self._abort_all = True
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)


__all__ = ["Service"]
