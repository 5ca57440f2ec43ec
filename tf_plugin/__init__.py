"""TensorFlow distributed-training plugin built on rdmatensor.

One concept per module (importing this package does not import TensorFlow):

    cluster     TF_CONFIG -> Cluster (ranks: workers, then parameter servers)
    models      demo models (mlp, cnn, embed), synthetic data, single-process reference
    step        the traced loss-and-gradients function the analyzer and trainers share
    analyzer    analyze(model | tf.function, mode, workers, ps) -> Analysis(plan, explain())
    ingest      received slot -> tf.Tensor with no copy (DLPack); when the slot is released
    ops         send(tensor, name, dst) / recv(name, src, dtype, shape) inside tf.function
    ps          parameter-server training (PSWorker, ParameterServer)
    allreduce   ring all-reduce; DistributedGradientTape, broadcast_variables (Horovod-like)
    meter       time in communication, copies made by the plugin
    runner      one rank (run_rank), or all ranks as threads (run_threads); summaries
    tf_baseline TensorFlow's MultiWorkerMirroredStrategy on the same model, for comparison
    launch      the rdmatensor-train command (python -m tf_plugin.launch)
"""
