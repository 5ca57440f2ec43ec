"""The collective engine, what moves tensors for every face of tf_plugin:

    analyzer     analyze(model | tf.function, mode, workers, ps) -> Analysis(plan, explain())
    step         the traced loss-and-gradients function the analyzer and trainers share
    bootstrap    small objects between the workers, before any tensor plan
    collectives  the plan grown from the tensor sets the job calls; numbered, tagged calls and resets
    checks       what broken scripts get: divergence, NaN/Inf, errors naming the tensor and rank
    failure      a lost rank fails every collective of this rank, naming the rank lost first
    ring         the ring all-reduce over an analyzed plan (RingAllReduce, RingGradientTape)
    background   the communication thread: every bucket's ring, in plan order, while backprop runs
    overlap      the all-reduce in a graph: one launch op and one wait op per bucket
    ingest       received slot -> tf.Tensor with no copy (DLPack); when the slot is released
    ps           parameter-server training (PSWorker, ParameterServer)
    ops          send(tensor, name, dst) / recv(name, src, dtype, shape) inside tf.function
    tf_errors    rdmatensor's errors as the TensorFlow types Horovod raises (eagerly and in graphs)
    meter        time in communication, its overlap with backprop, copies made by the plugin
    timeline     RDMATENSOR_TIMELINE: buckets ready, rings run, TensorFlow waiting (Chrome trace)

Imports nothing else of tf_plugin.
"""
