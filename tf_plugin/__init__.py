"""TensorFlow distributed-training plugin built on rdmatensor.

`import tf_plugin as hvd` gives horovod.tensorflow's API (init, rank, size,
DistributedGradientTape, broadcast_variables, allreduce, ...); `import
tf_plugin.keras as hvd` gives horovod.tensorflow.keras'. The names are
loaded on first use: importing this package does not import TensorFlow.

Its parts are layers, lowest first, above rdmatensor (whose runner/ says who
is who, and whose cores.py this import calls to bind a rank to its cores); an
import only ever runs down them (tests/test_layout.py):

    errors.py   every error of the plugin's own (NonFiniteValue, HorovodInternalError, ...);
                the two that are TensorFlow's types too are built on first use
    executor/   what runs a plan, with no framework, behind one contract a compiled
                executor is to keep: the ring all-reduce, the communication thread
                (it stands on core's settings, buffers, scaling, meter and timeline,
                which import nothing above them)
    native/     the compiled all-reduce for ranks on one host (C executor over shared
                memory, TensorFlow ops), with its Python twin behind one contract
    core/       the job's basics and the collective engine, with no framework: world,
                process sets, elastic state, plans grown from what the job calls
    graph/      where the core meets TensorFlow: the graph analyzer, graph ops, ingest
                of received slots, overlap with backprop, TensorFlow's error types
    horovod/    horovod.tensorflow's API over the engine: world (init, rank, size),
                tensors (allreduce, broadcast, ...), gradient_tape (DistributedGradientTape),
                compression, sync_batch_norm, util
    keras/      horovod.tensorflow.keras: DistributedOptimizer, callbacks, load_model
    parameter_server.py   parameter-server training of your own Keras model
    training/   rdmatensor-train, the training benchmark: models, one rank, the job,
                TensorFlow's own strategy as the baseline, the plan explained
    launcher/   `python -m tf_plugin.launcher.run` and `...cluster`, deprecated: forwarded to
                rdmatensor-run and rdmatensor.runner.cluster, with a DeprecationWarning
    README.md   the plugin in depth
"""
import importlib

from rdmatensor.runner.cores import bind_cores, share_cores

share_cores()     # before TensorFlow's runtime starts: ranks sharing a host split its cores
bind_cores()      # and, started with --bind-to core, each runs on its own

_WORLD = ("init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "broadcast_object",
          "allgather_object", "stats", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
          "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
          "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous", "ProcessSet", "global_process_set",
          "add_process_set", "remove_process_set", "cross_rank", "cross_size", "start_timeline", "stop_timeline",
          "broadcast_object_fn")
_TENSORS = ("broadcast_variables", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
            "broadcast_", "broadcast_global_variables", "alltoall", "reducescatter", "grouped_reducescatter", "join",
            "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op")
_TAPES = ("DistributedGradientTape", "PartialDistributedGradientTape")
_API = {**dict.fromkeys(_WORLD, "horovod.world"), **dict.fromkeys(_TENSORS, "horovod.tensors"),
        **dict.fromkeys(_TAPES, "horovod.gradient_tape"), "Compression": "horovod.compression",
        "_executing_eagerly": "horovod.util", "SyncBatchNormalization": "horovod.sync_batch_norm",
        "DistributedOptimizer": "keras.any_optimizer"}
__all__ = list(_API) + ["elastic", "util"]


def __getattr__(name: str):
    if name in ("util", "elastic"):
        return importlib.import_module(f".horovod.{name}", __name__)
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_API))
