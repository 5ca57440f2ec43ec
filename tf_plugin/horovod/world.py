"""horovod.tensorflow's basics: the framework-free core's (core/world.py), with
an init() that can also plan ahead for a built Keras model."""
from __future__ import annotations

from ..core import world as _core
from ..core.world import (Adasum, Average, Max, Min, ProcessSet, Product, ReduceOp, Sum,  # noqa: F401
                          add_process_set, allgather_object, broadcast_object, broadcast_object_fn, ccl_built,
                          cross_rank, cross_size, cuda_built, ddl_built, global_process_set, gloo_built,
                          gloo_enabled, is_homogeneous, is_initialized, local_of, local_rank, local_size, mpi_built,
                          mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built,
                          shutdown, size, start_timeline, stats, stop_timeline, world)


def init(model=None, provider: str | None = None, cluster=None, token: str | None = None,
         timeout: float | None = None, fusion_threshold: int | None = None,
         check_finite: bool | None = None, process_sets=None) -> None:
    """Join the job (core/world.py's init). No model is needed; with one (a built
    Keras model), the tensor sets of its first step (gradient all-reduce of its
    trainable variables, broadcast of all its variables from rank 0) are planned
    now, in one exchange. Calling init() again only plans ahead for the model given."""
    _core.init(provider, cluster, token, timeout, fusion_threshold, check_finite, process_sets)
    if _core.size() > 1:
        from ..graph import native_allreduce     # TensorFlow: the Horovod API's users have it
        native_allreduce.preload()
    if model is not None:
        from .tensors import plan_ahead          # TensorFlow: only when a model asks for it
        plan_ahead(model)
