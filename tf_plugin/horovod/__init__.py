"""horovod.tensorflow's API over the engine (`import tf_plugin as hvd` loads it name by name):

    world            this process in the job: init, rank, size, local rank, objects, process sets
    tensors          allreduce, allgather, broadcast, alltoall, reducescatter, grouped_*, join,
                     broadcast_variables, their gradients
    gradient_tape    DistributedGradientTape, PartialDistributedGradientTape, and which gradients
                     stay local (shared with the optimizers)
    compression      hvd.Compression: none, fp16
    elastic          hvd.elastic: run, State, ObjectState, TensorFlowState, TensorFlowKerasState
    sync_batch_norm  SyncBatchNormalization for Keras 3
    util             horovod.tensorflow.util's helpers scripts call
    tf1_optimizer    a TF1 optimizer whose gradients are combined over the ranks (hvd.DistributedOptimizer)
"""
