"""The collective engine and the job's basics, with no framework (as Horovod's
horovod/common): every face of tf_plugin stands on it, and it never imports
TensorFlow (tests/test_layout.py checks what a fresh process loads).

    world               init, rank, size, objects between ranks; the registry of process sets
    process_sets        a registered process set's own collectives, and the exchange that registers it
    elastic             State, ObjectState, run: a job that survives a lost rank
    checked_collectives the engine's front door: every call checked, errors naming the tensor and rank
    collectives         the engine: the plan grown from the tensor sets the job calls; numbered, tagged calls
    tensor_sets         what a call is as the ranks compare it: its key, its entries, a message's words for it
    generations         the plan's successive sessions: what a reset decides, counters carried over
    reductions          an all-reduce set's op (how it combines, its threshold, hierarchy, scaling) and buckets
    algorithms          each kind of set on the wire: its slots, and what one call writes and reads of them
    bootstrap           small objects between the workers, before any tensor plan
    layout              names, fusion buckets, ring chunks: how tensors become a Plan (Analysis)
    adasum              Horovod's Adasum reduction
    failure             a lost rank fails every collective of this rank, naming the rank lost first

Below the executor (tf_plugin.executor: the ring all-reduce and the
communication thread that run the plans made here), and below everything
else of the plugin, because the executor stands on them too:

    buffers             64-byte aligned memory TensorFlow takes with no copy, reused once it lets go
    scaling             Horovod's pre/postscale
    meter, timeline     time in communication and copies; RDMATENSOR_TIMELINE (Chrome trace)
    settings            the job's settings from the environment, under this project's names and Horovod's
"""
