"""engine/lockstep.py's channel and liveness on one process: the turns through a key-value
store, the watchdog's bounds, and its stop (which a clean multi-process exit relies on).
Two real processes: tests/engine/test_multihost_decoding.py."""

import threading
import time

import pytest

from dspark_jax.engine.lockstep import Exchange, Watchdog


class DictStore:
    """The coordination service client's key-value calls, over a dict. ``gate`` (an
    Event) holds every set until released; ``broken`` makes every call fail."""

    def __init__(self):
        self.data, self.calls = {}, []
        self.gate, self.entered = None, threading.Event()
        self.broken = False

    def _call(self, name):
        self.calls.append((name, time.monotonic()))
        if self.broken:
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")

    def key_value_set(self, key, value, allow_overwrite=False):
        self._call("set")
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        if key in self.data and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.data[key] = value

    def key_value_set_bytes(self, key, value):
        self._call("set_bytes")
        self.data[key] = bytes(value)

    def key_value_try_get(self, key):
        self._call("try_get")
        if key not in self.data:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.data[key]

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        self._call("get_bytes")
        if key not in self.data:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_ms} ms")
        return self.data[key]

    def key_value_delete(self, key):
        self._call("delete")
        self.data.pop(key, None)


def test_turns_travel_in_order_and_old_ones_are_deleted():
    store = DictStore()
    exchange = Exchange(store, keep=2)
    turns = [[["s"]], [["a", 0, [5, 6, 7], 8, 0.0, 0, 1.0, [0, 1], "uint32", False]], [["s"]]]
    for n, ops in enumerate(turns):
        exchange.publish(n, ops)
    assert exchange.receive(0, 0.01) is None  # deleted: more than `keep` turns old
    assert [exchange.receive(n, 0.01) for n in (1, 2)] == turns[1:]
    assert exchange.receive(3, 0.01) is None  # not published yet: no error, no value
    assert exchange.turns_sent == 3  # the admission is the largest turn
    assert exchange.largest_turn == len(store.data["dspark/serve/turn/1"])


def test_watchdog_reports_a_peer_that_stops_beating_within_the_timeout():
    store, silent = DictStore(), []
    exchange = Exchange(store)
    exchange.beat(1, 0)  # the peer beat once, then went quiet
    t0 = time.monotonic()
    watchdog = Watchdog(exchange, 0.4, lambda *a: silent.append((time.monotonic() - t0, *a)),
                        interval=0.05, processes=(0, 2))  # fmt: skip
    watchdog.start()._thread.join(timeout=5)
    ((after, process, seconds, why),) = silent
    assert process == 1 and why == "its heartbeat stopped"
    assert 0.4 < seconds and after < 0.4 + 0.2  # the timeout, plus at most a few intervals
    assert store.data["dspark/serve/alive/0"] != "0"  # this process kept beating meanwhile


def test_watchdog_keeps_quiet_while_the_peer_beats():
    store, silent = DictStore(), []
    exchange = Exchange(store)
    watchdog = Watchdog(exchange, 0.3, lambda *a: silent.append(a), interval=0.05,
                        processes=(0, 2)).start()  # fmt: skip
    for beat in range(20):  # 1 s, more than three timeouts
        exchange.beat(1, beat)
        time.sleep(0.05)
    watchdog.stop()
    assert silent == []


def test_watchdog_reports_a_store_that_keeps_failing_and_forgives_one_failure():
    store, silent = DictStore(), []
    exchange = Exchange(store)
    watchdog = Watchdog(exchange, 0.4, lambda *a: silent.append(a), interval=0.05,
                        processes=(1, 2)).start()  # fmt: skip
    store.broken = True  # one short outage: shorter than the timeout
    time.sleep(0.2)
    store.broken = False
    exchange.beat(0, 1)
    for beat in range(2, 8):
        time.sleep(0.05)
        exchange.beat(0, beat)
    assert silent == []
    store.broken = True  # the coordination service is gone for good
    watchdog._thread.join(timeout=5)
    ((process, seconds, why),) = silent
    assert process == 0 and seconds > 0.4 and why.startswith("the coordination service failed")
    assert "UNAVAILABLE" in why


def test_watchdog_stop_waits_for_the_store_call_in_flight():
    """serve.py stops the watchdog before leaving the distributed runtime: once stop()
    returns, no heartbeat call is in flight and none follows."""
    store = DictStore()
    store.gate = threading.Event()  # the first heartbeat blocks in the store
    watchdog = Watchdog(Exchange(store), 5.0, lambda *a: pytest.fail(f"silent {a}"),
                        interval=0.01, processes=(0, 2)).start()  # fmt: skip
    assert store.entered.wait(5)
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (watchdog.stop(), stopped.set()))
    stopper.start()
    assert not stopped.wait(0.3)  # still waiting on the call in flight
    store.gate.set()
    assert stopped.wait(5)
    calls, t_stop = len(store.calls), time.monotonic()
    time.sleep(0.1)  # ten intervals
    assert len(store.calls) == calls
    assert all(t <= t_stop for _, t in store.calls)
