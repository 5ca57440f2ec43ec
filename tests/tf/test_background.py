"""The communication thread's contract, without a model: buckets run in the plan's order
whatever order they are handed over in, results go to the round that launched them, and
a round that cannot finish fails with a typed error instead of hanging."""
import threading
import time

import numpy as np
import pytest

from rdmatensor import RecvTimeout, Timeout, UsageError
from tf_plugin.executor.comm_thread import CommThread


def describe(j):
    return {"tensors": 1}


def test_buckets_run_in_plan_order_whatever_order_they_arrive_in():
    ran = []

    def run(j, arrays):
        ran.append(j)
        return [a * 2 for a in arrays]

    comm = CommThread(0, timeout=10)
    try:
        for step in range(3):
            for j in (2, 0, 1):                          # backprop hands them over out of order
                comm.launch("grads", j, [np.full(3, step + j)], 3, run, describe)
            for j in range(3):
                (out,) = comm.collect("grads", j)
                assert np.array_equal(out, np.full(3, 2 * (step + j)))
        assert ran == [0, 1, 2] * 3
        assert comm.meter.rounds == 3 and comm.meter.ring_seconds > 0
    finally:
        comm.close()


def test_a_bucket_never_handed_over_fails_its_round_and_the_next_round_runs():
    comm = CommThread(1, timeout=0.5)
    try:
        comm.launch("grads", 0, [np.zeros(2)], 2, lambda j, a: a, describe)
        assert np.array_equal(comm.collect("grads", 0)[0], np.zeros(2))
        t0 = time.monotonic()
        with pytest.raises(Timeout, match="rank 1: bucket 1 of 'grads'.*not handed over"):
            comm.collect("grads", 1)
        assert time.monotonic() - t0 < 5
        for j in range(2):                                # a new round is not poisoned by the old one
            comm.launch("grads", j, [np.full(2, j)], 2, lambda j, a: a, describe)
        assert [comm.collect("grads", j)[0].tolist() for j in range(2)] == [[0, 0], [1, 1]]
    finally:
        comm.close()


def test_a_ring_error_reaches_the_waiter_and_fails_only_its_round():
    def run(j, arrays):
        if arrays[0][0] < 0:
            raise RecvTimeout("no chunk from rank 0", peer=0, tensor="ring/x")
        return arrays

    comm = CommThread(0, timeout=10)
    try:
        comm.launch("grads", 0, [-np.ones(1)], 1, run, describe)
        with pytest.raises(RecvTimeout, match="no chunk"):
            comm.collect("grads", 0)
        comm.launch("grads", 0, [np.ones(1)], 1, run, describe)
        assert comm.collect("grads", 0)[0].tolist() == [1.0]
        with pytest.raises(UsageError, match="never launched"):
            comm.collect("other", 0)
    finally:
        comm.close()


def test_shutdown_fails_a_round_still_waiting_for_buckets():
    comm = CommThread(0, timeout=30)
    comm.launch("grads", 0, [np.zeros(1)], 2, lambda j, a: a, describe)
    comm.collect("grads", 0)
    errors = []

    def waiter():
        try:
            comm.collect("grads", 1)
        except UsageError as exc:
            errors.append(exc)
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    comm.close()
    t.join(5)
    assert not t.is_alive() and errors and "shut" in str(errors[0])


def test_output_buffers_come_back_when_the_last_view_is_gone():
    import gc

    from tf_plugin.core.buffers import TF_ALIGN, Reused
    pool = Reused(100, np.float32)
    first = pool.lease()
    view = first[10:20].reshape(2, 5)             # what TensorFlow holds: a view of the lease
    address = first.ctypes.data
    del first
    gc.collect()
    assert pool.lease().ctypes.data != address    # still held through the view: a second buffer
    assert pool.allocated == 2 and address % TF_ALIGN == 0
    del view
    gc.collect()
    again = [pool.lease(), pool.lease()]
    assert address in {a.ctypes.data for a in again} and pool.allocated == 2


def test_the_python_twins_take_the_executors_contract_call_for_call():
    """What a compiled executor is to keep: each call of the contract, with the same
    parameters and defaults, as the Python twins callers use today take it."""
    import inspect

    from tf_plugin.executor.contract import Ring, Rounds
    from tf_plugin.executor.ring import RingAllReduce

    def parameters(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    for twin, contract in ((CommThread, Rounds), (RingAllReduce, Ring)):
        assert issubclass(twin, contract) and not getattr(twin, "__abstractmethods__", None)
        assert contract.__abstractmethods__ >= {"launch", "collect", "close"}
        for name in contract.__abstractmethods__:
            assert parameters(getattr(twin, name)) == parameters(getattr(contract, name)), name
