"""The comm engine on its own (no process group): FIFO order per queue, the feeder rule, failures
delivered through the future, and the blocking fast path (docs/architecture.md sections 3 and 5.1)."""

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


def test_a_phase_finishing_after_shutdown_starts_no_thread():
    """docs/faults.md row 5 (a peer died mid 2-D all-to-all): the survivors' intra-node phase completes after
    destroy(); its successor must fail instead of starting a worker that nothing would stop."""
    engine = Engine()
    a, b = _Key(), _Key()
    gate, started = threading.Event(), threading.Event()

    def intra():
        started.set()
        gate.wait()

    fut = engine.submit([Phase("intra", intra, a), Phase("inter", lambda: None, b)], op="t")
    assert started.wait(5)
    workers = engine.threads()
    with pytest.warns(RuntimeWarning, match="abandoned"):
        engine.shutdown(timeout=0.2)  # phase "intra" is still running
    gate.set()
    with pytest.raises(Exception, match="shut down"):
        fut.wait()
    for t in workers + [t for t in threading.enumerate() if t.name.startswith("commopt-engine-pg")]:
        t.join(5)
        assert not t.is_alive(), t.name


def test_shutdown_abandons_a_worker_stuck_in_a_wait_and_says_so():
    """docs/faults.md rows 5 and 30 (destroy() after a peer stalled or died): a worker still inside a
    blocking wait when shutdown's time is up (here an event; in a rank, a backend wait bounded only by
    the group's own timeout) is abandoned, never joined forever: shutdown returns its name and warns
    naming it, and leaves it a daemon thread, which exits once its wait ends; an idle worker exits at
    once. Before, shutdown returned nothing and said nothing."""
    engine = Engine()
    stuck, idle = _Key(), _Key()
    gate, started = threading.Event(), threading.Event()

    def blocked() -> None:
        started.set()
        gate.wait()

    held = engine.submit([Phase("blocked", blocked, stuck)], op="t", result="late")
    engine.submit([Phase("quick", lambda: None, idle)], op="t").wait()
    assert started.wait(5)
    workers = {t.name: t for t in engine.threads()}
    assert len(workers) == 2
    try:
        with pytest.warns(RuntimeWarning, match="abandoned") as caught:
            abandoned = engine.shutdown(timeout=0.3)
        stuck_name = next(n for n in workers if workers[n].is_alive() and n in abandoned)
        assert abandoned == [stuck_name], abandoned
        assert stuck_name in str(caught[0].message)
        thread = workers[stuck_name]
        assert thread.is_alive() and thread.daemon, thread.name
        assert not [t for n, t in workers.items() if n != stuck_name and t.is_alive()]  # the idle one exited
    finally:
        gate.set()
    assert held.wait() == "late"  # the abandoned phase still finishes its own op
    thread.join(5)
    assert not thread.is_alive()


def test_release_stops_a_queue_after_its_work_and_a_later_submission_restarts_it():
    """A wrapper that owns a private group releases its queue on close(): the queued work still
    completes, and no idle worker thread outlives the group (docs/faults.md row 30)."""
    engine = Engine()
    group, other = _Key(), _Key()
    try:
        gate = threading.Event()
        held = engine.submit([Phase("hold", gate.wait, group)], op="t", result="held")
        engine.submit([Phase("x", lambda: None, other)], op="t").wait()
        workers = engine.threads()
        assert len(workers) == 2
        threading.Timer(0.2, gate.set).start()
        engine.release(group)  # waits for the queued phase, then stops the thread
        assert held.wait() == "held"
        left = engine.threads()
        assert len(left) == 1 and left[0].is_alive()
        assert [t.is_alive() for t in workers if t is not left[0]] == [False]
        assert engine.submit([Phase("again", lambda: None, group)], op="t", result=3).wait() == 3
        engine.release(_Key())  # a group without a queue: nothing to do
    finally:
        engine.shutdown()


def test_phase_times_say_how_long_each_phase_ran_and_waited_for_its_queue():
    """``time_phases``: per "<op>/<phase>", the calls, the seconds running and the seconds between
    becoming ready and starting; the oracle is what the test makes the phases do (sleep, and hold
    the queue busy), with the clock's slack only upwards."""
    import time

    engine = Engine()
    group = _Key()
    try:
        assert engine.phase_times() == {}  # off by default
        engine.time_phases()
        gate = threading.Event()
        holder = engine.submit([Phase("hold", gate.wait, group)], op="busy")
        waiting = engine.submit([Phase("nap", lambda: time.sleep(0.05), group),
                                 Phase("local", lambda: time.sleep(0.02))], op="t")
        time.sleep(0.1)  # "nap" is ready but queued behind "hold" all this time
        gate.set()
        holder.wait()
        waiting.wait()
        times = engine.phase_times()
        calls, run, wait = times["t/nap"]
        assert calls == 1 and 0.05 <= run < 1.0 and 0.1 <= wait < 1.0
        calls, run, wait = times["t/local"]  # inline after "nap" on its worker: no hand-off
        assert calls == 1 and 0.02 <= run < 1.0 and wait < 0.05
        # "hold" ends 0.1 s after it was submitted at the earliest: its run plus its wait to start
        # (the worker's hand-off, a few ms on a busy machine) add up to at least that.
        calls, run, wait = times["busy/hold"]
        assert calls == 1 and run + wait >= 0.1 and run < 1.0
        engine.time_phases(False)
        engine.submit([Phase("x", lambda: None, group)], op="t").wait()
        assert engine.phase_times() == {}
    finally:
        engine.shutdown()
