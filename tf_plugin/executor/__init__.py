"""The executor: what runs an analyzed plan step after step, once the planner
(tf_plugin.core) made it. Python plans, the executor executes: the ring's
writes, waits, sums and copies, and the communication thread that runs the
rounds of buckets while backprop goes on. It sits below the planner, imports
none of it but the framework-free basics it stands on (core's settings,
buffers, scaling, meter, timeline: tests/test_layout.py places them below),
and never imports TensorFlow.

Everything here is behind one contract, so that a compiled executor (a
schedule compiled once from the plan, run without the GIL) can replace the
Python twin without a caller telling them apart:

    contract       what the engine and TensorFlow's ops ask of the executor: Ring, Rounds, the plan it reads
    schedule       the ring's schedule: which chunk each rank writes at each step, its bounds and name
    ring           the ring all-reduce over a laid-out plan, on numpy arrays (the Python twin of Ring)
    comm_thread    the communication thread: every bucket's ring, in plan order, while backprop runs
                   (the Python twin of Rounds)
"""
