"""The comm engine on its own (no process group): FIFO order per queue, the feeder rule, failures
delivered through the future, and the blocking fast path (DESIGN 2-3)."""

import threading

import pytest

from commopt.comm.engine import Engine, Phase


class _Key:
    """A stand-in for a process group: the engine only uses groups as queue keys."""


def test_blocking_call_runs_on_the_caller_when_idle_and_queues_otherwise():
    engine = Engine()
    group = _Key()
    where = []
    try:
        fut = engine.submit([Phase("a", lambda: where.append(threading.current_thread()), group)], op="t",
                            result=1, blocking=True)
        assert fut.done() and fut.wait() == 1
        assert where == [threading.current_thread()] and engine.threads() == []

        gate = threading.Event()
        first = engine.submit([Phase("hold", gate.wait, group)], op="t", result="first")
        second = engine.submit([Phase("b", lambda: where.append(threading.current_thread()), group)], op="t",
                               result="second", blocking=True)
        # An op is in flight: the blocking one must queue behind it (running it here would issue its
        # collective before the earlier op's on this rank only).
        assert not second.done()
        gate.set()
        assert first.wait() == "first" and second.wait() == "second"
        assert where[1] is not threading.current_thread() and where[1] in engine.threads()
    finally:
        engine.shutdown()


def test_phases_run_in_submission_order_and_failures_reach_the_future():
    engine = Engine()
    a, b = _Key(), _Key()
    log = []
    try:
        futs = [engine.submit([Phase("x", lambda i=i: log.append(("a", i)), a),
                               Phase("y", lambda i=i: log.append(("b", i)), b)], op="t", result=i)
                for i in range(20)]
        assert [f.wait() for f in futs] == list(range(20))
        assert [i for q, i in log if q == "a"] == list(range(20))
        assert [i for q, i in log if q == "b"] == list(range(20))

        def boom():
            raise ValueError("bad shard")

        with pytest.raises(ValueError, match="bad shard"):
            engine.submit([Phase("x", boom, a)], op="t", blocking=True).wait()
        with pytest.raises(ValueError, match="bad shard"):
            engine.submit([Phase("x", boom, a)], op="t").wait()
        # The in-flight count returns to zero after failures too: the next blocking op is inline.
        engine.submit([Phase("x", lambda: log.append(threading.current_thread()), a)], op="t", blocking=True)
        assert log[-1] is threading.current_thread()
    finally:
        engine.shutdown()


def test_a_queue_fed_by_two_queues_is_refused():
    engine = Engine()
    a, b, c = _Key(), _Key(), _Key()
    try:
        engine.submit([Phase("x", lambda: None, a), Phase("z", lambda: None, c)], op="t").wait()
        with pytest.raises(Exception, match="fed by both"):
            engine.submit([Phase("y", lambda: None, b), Phase("z", lambda: None, c)], op="t").wait()
    finally:
        engine.shutdown()
