"""rdmatensor-train, the training benchmark: the same model trained over every backend, side by side.

    models       demo and Keras application models, synthetic data, single-process reference
    job          what to run (JobConfig), what each rank measured, the summary, the backends
    runner       one rank (run_rank), or all ranks as threads (run_threads)
    tf_baseline  TensorFlow's MultiWorkerMirroredStrategy on the same model, for comparison
    horovod_baseline  real Horovod (horovodrun) on the same model and data
    hvd_runner   rdmatensor's Horovod API on the same model: native ops and Python path, paired
    cli          the rdmatensor-train command (python -m tf_plugin.training.cli)
    explain      a demo model's plan, printed (python -m tf_plugin.training.explain)
"""
