"""Where the framework-free core (tf_plugin/core) meets TensorFlow's graphs and tensors:

    analyzer     analyze(model | tf.function, mode, workers, ps) -> Analysis(plan, explain())
    step         the traced loss-and-gradients function the analyzer and trainers share
    ring_tape    the executor's ring with TensorFlow's tensors and variables (RingGradientTape)
    overlap      the all-reduce in a graph: one launch op and one wait op per bucket
    native_allreduce  the same on the native ops (tf_plugin.native), every rank on one host
    ingest       received slot -> tf.Tensor with no copy (DLPack); when the slot is released
    ps_step      parameter-server training's step (PSWorker, ParameterServer)
    ops          send(tensor, name, dst) / recv(name, src, dtype, shape) inside tf.function
    tracing      graph_code: the plugin's functions are traced as written, never rewritten by autograph
    tf_errors    rdmatensor's errors raised as the TensorFlow types Horovod raises (eagerly and in graphs)

Imports only tf_plugin.core, tf_plugin.executor, tf_plugin.native and tf_plugin.errors of tf_plugin.
"""
