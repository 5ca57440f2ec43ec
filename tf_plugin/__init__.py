"""TensorFlow distributed-training plugin built on rdmatensor.

`import tf_plugin as hvd` gives horovod.tensorflow's API (init, rank, size,
DistributedGradientTape, broadcast_variables, allreduce, ...); `import
tf_plugin.keras as hvd` gives horovod.tensorflow.keras'. The names are
loaded on first use: importing this package does not import TensorFlow.

One concept per module:

    cluster     TF_CONFIG -> Cluster (ranks: workers, then parameter servers)
    world       this process in the job: init, rank, size, local rank, objects, stats (no TensorFlow)
    bootstrap   small objects between the workers, before any tensor plan
    collectives the plan grown from the tensor sets the job calls; numbered, tagged calls and resets;
                allreduce/broadcast/allgather/alltoall
    checks      what broken scripts get: divergence, NaN/Inf, errors naming the tensor and rank
    failure     a lost rank fails every collective of this rank, naming the rank lost first
    horovod     horovod.tensorflow's tensor API: DistributedGradientTape, broadcast_variables, ...
    tf_errors   rdmatensor's errors as the TensorFlow types Horovod raises (eagerly and in graphs)
    sync_batch_norm  SyncBatchNormalization for Keras 3
    util        horovod.tensorflow.util's helpers scripts call
    keras       horovod.tensorflow.keras: DistributedOptimizer, callbacks, load_model
    models      demo models (mlp, cnn, embed), synthetic data, single-process reference
    step        the traced loss-and-gradients function the analyzer and trainers share
    analyzer    analyze(model | tf.function, mode, workers, ps) -> Analysis(plan, explain())
    ingest      received slot -> tf.Tensor with no copy (DLPack); when the slot is released;
                output buffers reused once TensorFlow frees them
    background  the communication thread: every bucket's ring, in plan order, while backprop runs
    overlap     the all-reduce in a graph: one launch op and one wait op per bucket
    timeline    RDMATENSOR_TIMELINE: when buckets were ready, rings ran, TensorFlow waited (Chrome trace)
    ops         send(tensor, name, dst) / recv(name, src, dtype, shape) inside tf.function
    ps          parameter-server training (PSWorker, ParameterServer)
    ring        the ring all-reduce over an analyzed plan (RingAllReduce, RingGradientTape)
    meter       time in communication, its overlap with backprop, copies made by the plugin
    runner      one rank (run_rank), or all ranks as threads (run_threads); summaries
    tf_baseline TensorFlow's MultiWorkerMirroredStrategy on the same model, for comparison
    launch      the rdmatensor-train command (python -m tf_plugin.launch)
    run         the rdmatensor-run launcher (python -m tf_plugin.run)
    cores       a rank's share of its host's cores for TensorFlow's intra-op pool (at import)
"""
import importlib

from .cores import share_cores

share_cores()     # before TensorFlow's runtime starts: ranks sharing a host split its cores

_WORLD = ("init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "broadcast_object",
          "allgather_object", "stats", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
          "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
          "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous", "ProcessSet", "global_process_set",
          "add_process_set", "remove_process_set")
_HOROVOD = ("DistributedGradientTape", "PartialDistributedGradientTape", "broadcast_variables", "allreduce",
            "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
            "broadcast_global_variables", "alltoall", "reducescatter", "grouped_reducescatter", "join", "rank_op",
            "local_rank_op", "size_op", "local_size_op", "Compression")
_API = {**dict.fromkeys(_WORLD, "world"), **dict.fromkeys(_HOROVOD, "horovod"), "_executing_eagerly": "util",
        "SyncBatchNormalization": "sync_batch_norm"}
__all__ = list(_API)


def __getattr__(name: str):
    if name == "util":
        return importlib.import_module(".util", __name__)
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_API))
