"""The benchmarks: rdmatensor-bench and what the make targets measure (installed
as rdmatensor_bench; run each as `python -m bench.<module>` in the checkout).

    cli.py                the rdmatensor-bench command: latency and bandwidth of every provider
    points.py             one measurement point: a fresh two-rank session, one mode, one size
    references.py         the physical reference each provider is compared with, in the same run
    perftest.py           perftest (ib_write_bw, ib_write_lat) as verbs' reference, run and parsed
    report.py             the table, JSON and PNG plot
    setup_cost.py         what setup costs against the number of tensors
    registration_cost.py  registering a write's memory against copying it into staging (verbs)
    cpu_split.py          where a verbs bandwidth run spends its CPU, sender and receiver apart
    sender_time.py        where a verbs bandwidth run's sending thread spends its time
    ring_cpu.py           the ring all-reduce's CPU on real models' gradient sets
    ring_variants.py      the ring as it was before two of its savings, for ring_cpu.py to measure beside it
    model_grads.py        real models' gradient sets (kept in model_grads.json: no TensorFlow needed)
    graph_boundary.py     what handing gradients out of and into a tf.function costs
    hierarchical.py       the flat ring against the hierarchical all-reduce (make bench-hierarchical)
    soak.py               many steps of a training job, its ranks' resources sampled (make soak)
    models_table.py       the README's table of real models, from make bench-models' JSON
    step_model.py         the step-time model: a step's time on a cluster from fitted or given constants
    step_fit.py           rdmatensor-bench fit: the model's constants from the micro-benchmarks
    step_validate.py      rdmatensor-bench validate: the model against measurement, paired rounds
    step_cli.py           rdmatensor-bench predict, and the dispatch of fit and validate
    native_step.py        the native shm all-reduce ops' step cost against today's path (make bench-native)
    horovod_step.py       the same tape step under real Horovod (horovodrun), to read beside native_step
    shm_executor.py       the shm all-reduce executor alone: C, C with scalar loops, the twin, paired
    model_grads_224.py    ImageNet-sized gradient sets (model_grads_224.json) for published comparisons
"""
