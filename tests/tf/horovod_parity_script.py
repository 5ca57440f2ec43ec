"""Horovod's TensorFlow API as Horovod defines it, on 2+ ranks (rdmatensor-run):
each case computes what this rank got and what Horovod's semantics say it must
get, from every rank's inputs (known to every rank). Writes OUT_DIR/rank{R}.json:
per case, True or what differed.

    python horovod_parity_script.py OUT_DIR
"""
import json
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd
import tf_plugin.keras as hvd_keras

out_dir = sys.argv[1]
hvd.init()
r, n = hvd.rank(), hvd.size()
report = {}


def case(name, fn):
    try:
        got = fn()
        report[name] = True if got is True else f"got {got!r}"
    except Exception as exc:  # noqa: BLE001 - reported, then asserted by the test
        report[name] = f"{type(exc).__name__}: {exc}"


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for the check
        return exc
    return None


def x_of(rank):           # every rank's input, known to all
    return np.array([1.0, 5.0, -2.0, 0.5], np.float32) * (rank + 1)


everyone = [x_of(k) for k in range(n)]

# Reductions.
case("min", lambda: same(hvd.allreduce(x_of(r), op=hvd.Min), np.min(everyone, 0)))
case("max", lambda: same(hvd.allreduce(x_of(r), op=hvd.Max), np.max(everyone, 0)))
case("product", lambda: same(hvd.allreduce(x_of(r), op=hvd.Product), np.prod(everyone, 0)))
case("grouped_min", lambda: all(same(o, np.min(everyone, 0)) for o in
                                hvd.grouped_allreduce([x_of(r), x_of(r)], op=hvd.Min)))


# Adasum: Horovod's test reference (test_adasum_tensorflow.py's tree), in float64; power-of-two ranks only.
def adasum_pair(a, b):
    dot, a_sq, b_sq = np.dot(a, b), np.dot(a, a), np.dot(b, b)
    return (1.0 - dot / a_sq * 0.5 if a_sq else 1.0) * a + (1.0 - dot / b_sq * 0.5 if b_sq else 1.0) * b


def adasum_of(rows):
    while len(rows) > 1:
        rows = [adasum_pair(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
    return rows[0]


def g_of(rank):           # not collinear from rank to rank, as gradients are not
    return np.random.default_rng(100 + rank).standard_normal(6)


def adasum_case():
    if n & (n - 1):
        err = _raises(lambda: hvd.allreduce(g_of(r), op=hvd.Adasum))
        return isinstance(err, NotImplementedError) and "power of 2" in str(err) or err
    want = adasum_of([g_of(k) for k in range(n)])
    for dtype, rtol in ((np.float16, 1e-2), (np.float32, 1e-5), (np.float64, 1e-12)):
        got = hvd.allreduce(g_of(r).astype(dtype), op=hvd.Adasum)
        if got.dtype != dtype or not np.allclose(got, want, rtol=rtol, atol=rtol):
            return f"{np.dtype(dtype).name}: {np.asarray(got)} against {want}"
    pair = hvd.grouped_allreduce([g_of(r), 2 * g_of(r)], op=hvd.Adasum)
    v = tf.Variable(np.zeros(6))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * g_of(r))
    grad = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, v)
    return (np.allclose(pair[0], want) and np.allclose(pair[1], 2 * want) and np.allclose(grad, want)
            and all(v is not None for v in pair))


def adasum_refusals_case():
    errors = [_raises(lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r])), op=hvd.Adasum)),
              _raises(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)),
              _raises(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum,
                                                       average_aggregated_gradients=True))]
    kinds = [NotImplementedError, ValueError, ValueError]
    if not n & (n - 1):
        errors.append(_raises(lambda: hvd.allreduce(np.arange(4, dtype=np.int32), op=hvd.Adasum)))
        kinds.append(tf.errors.InvalidArgumentError)
    return all(isinstance(e, k) for e, k in zip(errors, kinds, strict=True)) or errors


case("adasum", adasum_case)
case("adasum_refusals", adasum_refusals_case)
case("sparse_min_refused", lambda: isinstance(_raises(lambda: hvd.allreduce(
    tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r])), op=hvd.Min)), NotImplementedError))


# alltoall: rank r sends k+1 rows... of value 10 * r + d to each rank d.
def alltoall_case():
    splits = [d + 1 for d in range(n)]
    rows = np.concatenate([np.full((d + 1, 2), 10 * r + d, np.int32) for d in range(n)])
    out, received = hvd.alltoall(rows, splits=splits)
    want = np.concatenate([np.full((r + 1, 2), 10 * s + r, np.int32) for s in range(n)])
    return same(out, want) and received.numpy().tolist() == [r + 1] * n


case("alltoall_splits", alltoall_case)
case("alltoall_equal", lambda: same(hvd.alltoall(np.arange(2 * n, dtype=np.int64) + 100 * r),
                                    np.array([100 * s + 2 * r + j for s in range(n) for j in range(2)])))
case("alltoall_bad_splits", lambda: isinstance(_raises(lambda: hvd.alltoall(np.ones(n + 1), splits=[1] * n)),
                                               tf.errors.InvalidArgumentError))


# reducescatter: sum over ranks, then rank r's rows (the first rows % n ranks get one more).
def reducescatter_case():
    rows = 2 * n + 1
    t = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * (r + 1)
    total = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * sum(k + 1 for k in range(n))
    counts = [rows // n + (k < rows % n) for k in range(n)]
    lo = sum(counts[:r])
    got = hvd.reducescatter(t, op=hvd.Sum)
    grouped = hvd.grouped_reducescatter([t, t], op=hvd.Sum)
    return same(got, total[lo:lo + counts[r]]) and all(same(g, total[lo:lo + counts[r]]) for g in grouped)


case("reducescatter_uneven", reducescatter_case)
case("grouped_allgather", lambda: all(same(o, np.concatenate([np.full(k + 1, k, np.float32) for k in range(n)]))
                                      for o in hvd.grouped_allgather([np.full(r + 1, r, np.float32)] * 2)))


# Gradients, as Horovod registers them.
def gradient(fn, value):
    v = tf.Variable(value)
    with tf.GradientTape() as tape:
        loss = fn(v)
    return tape.gradient(loss, v).numpy()


w = np.arange(3 * n, dtype=np.float32)
case("grad_allreduce_sum", lambda: same(gradient(lambda v: tf.reduce_sum(hvd.allreduce(v * 2, op=hvd.Sum) ** 2),
                                                 np.full(3, float(r), np.float32)),
                                        np.full(3, 2 * 2 * 2 * n * sum(range(n)), np.float32)))
case("grad_allgather", lambda: same(gradient(lambda v: tf.reduce_sum(hvd.allgather(v) * w),
                                             np.zeros(3, np.float32)), w[3 * r:3 * r + 3]))
case("grad_broadcast", lambda: same(gradient(lambda v: tf.reduce_sum(hvd.broadcast(v, 0)),
                                             np.zeros(3, np.float32)), np.full(3, float(r == 0), np.float32)))
case("grad_reducescatter_sum", lambda: same(
    gradient(lambda v: tf.reduce_sum(hvd.reducescatter(v, op=hvd.Sum)), np.zeros(2 * n, np.float32)),
    np.full(2 * n, float(n), np.float32)))
case("grad_alltoall", lambda: same(
    gradient(lambda v: tf.reduce_sum(hvd.alltoall(v) * tf.range(n, dtype=tf.float32)), np.zeros(n, np.float32)),
    np.full(n, float(r), np.float32)))

# Helpers and build queries.
case("ops", lambda: [int(hvd.rank_op()), int(hvd.size_op()), int(hvd.local_rank_op()),
                     int(hvd.local_size_op())] == [r, n, hvd.local_rank(), hvd.local_size()])
case("join", lambda: hvd.join() in range(n))
case("built", lambda: (hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built(), hvd.ccl_built(),
                       hvd.cuda_built()) == (False, False, 0, False, False))
case("executing_eagerly", lambda: hvd._executing_eagerly() is True and hvd.util._executing_eagerly() is True)
case("global_variables_eager", lambda: isinstance(_raises(lambda: hvd.broadcast_global_variables(0)), RuntimeError))
# Every rank is the global set already: a duplicate (ValueError), and it is never removed (False), as Horovod.
case("process_set", lambda: isinstance(_raises(lambda: hvd.add_process_set(list(range(n)))), ValueError)
     and hvd.remove_process_set(hvd.global_process_set) is False and hvd.global_process_set.size() == n
     and hvd.global_process_set.included() is True and hvd.global_process_set.ranks == list(range(n)))


case("cross", lambda: (hvd.cross_rank(), hvd.cross_size(), hvd_keras.cross_size()) == (0, 1, 1))   # one host
case("broadcast_object_fn", lambda: hvd.broadcast_object_fn(root_rank=n - 1)({"r": r}) == {"r": n - 1})


def timeline_case():
    path = f"{out_dir}/timeline-{{rank}}.json"
    hvd.start_timeline(path)
    hvd.allreduce(x_of(r), name="timed")
    hvd.stop_timeline()
    events = json.loads(open(path.replace("{rank}", str(r))).read())
    return events[-1]["name"] == "trace_end" and any(e["name"].startswith("ready") for e in events)


case("timeline", timeline_case)


def inplace_case():
    v = tf.Variable(np.full(2, float(r), np.float32))
    values = hvd.broadcast_([v], n - 1)
    return same(v.numpy(), np.full(2, float(n - 1), np.float32)) and same(values[0], v.numpy())


case("broadcast_inplace", inplace_case)


# Error types: a mismatch is FailedPreconditionError on every rank, eagerly and in a tf.function,
# and the next collective works.
def mismatch_case():
    eager = _raises(lambda: hvd.allreduce(tf.ones(3 + r), name="mismatched"))
    graph = _raises(lambda: tf.function(lambda: hvd.allgather(tf.ones([2, 3 + r]), name="mismatched_graph"))())
    after = same(hvd.allreduce(tf.ones(2), op=hvd.Sum, name="after"), np.full(2, float(n), np.float32))
    return (isinstance(eager, tf.errors.FailedPreconditionError), isinstance(graph, tf.errors.FailedPreconditionError),
            after) == (True, True, True) or (type(eager).__name__, type(graph).__name__, after)


case("mismatch_types", mismatch_case)


# Several collectives with no data dependency in one tf.function: the same order on every rank.
@tf.function
def independent(a, b, c):
    return hvd.allgather(a, name="i_gather"), hvd.allreduce(b, op=hvd.Sum, name="i_reduce"), hvd.broadcast(c, 0)


def order_case():
    results = [independent(tf.fill([r + 1], float(r)), tf.ones(3) * r, tf.ones(2) * r) for _ in range(3)]
    gathered = np.concatenate([np.full(k + 1, float(k), np.float32) for k in range(n)])
    return all(same(a, gathered) and same(b, np.full(3, float(sum(range(n))), np.float32))
               and same(c, np.zeros(2, np.float32)) for a, b, c in results)


case("graph_order", order_case)


# SyncBatchNormalization: the statistics of every rank's batch, as one BatchNormalization over all of them.
def syncbn_case():
    batches = [np.array([[k, k + 1.0], [2.0 * k, 3.0 * k + 1]], np.float32) for k in range(n)]
    whole = keras.layers.BatchNormalization(axis=1)(np.concatenate(batches), training=True).numpy()
    mine = hvd.SyncBatchNormalization(axis=1)(batches[r], training=True).numpy()
    return bool(np.allclose(mine, whole[2 * r:2 * r + 2], atol=1e-5)) or (mine.tolist(), whole.tolist())


case("sync_batch_norm", syncbn_case)


# PartialDistributedGradientTape: local layers keep their own gradient (divided by size), others averaged.
def partial_tape_case():
    keras.utils.set_random_seed(0)
    local, shared = keras.layers.Dense(2, name="local"), keras.layers.Dense(1, name="shared")
    model = keras.Sequential([keras.Input((3,)), local, shared])
    x = np.full((2, 3), r + 1.0, np.float32)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x))
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    combined = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    every = hvd.allgather_object(plain)
    ok_local = all(np.allclose(c, p / n) for c, p in zip(combined[:2], plain[:2], strict=True))
    ok_shared = all(np.allclose(c, np.mean([e[j] for e in every], 0)) for j, c in zip((2, 3), combined[2:],
                                                                                       strict=True))
    return ok_local and ok_shared


case("partial_tape", partial_tape_case)


# Keras: a model built lazily inside fit, Horovod's full DistributedOptimizer signature, the schedule
# callback, local variables kept out of the broadcast, a partial optimizer.
def lazy_fit_case():
    keras.utils.set_random_seed(r)           # different initial weights per rank
    # Dropout holds a variable (its seed state) before the model is built: Horovod's Keras MNIST example
    model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dropout(0.25),
                              keras.layers.Dense(2)])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=1,
                                         average_aggregated_gradients=True, gradient_predivide_factor=1.0,
                                         num_groups=0, groups=None, scale_local_gradients=True)
    model.compile(loss="mse", optimizer=opt)
    x = np.random.default_rng(r).standard_normal((16, 3)).astype(np.float32)
    y = np.random.default_rng(r + 10).standard_normal((16, 2)).astype(np.float32)
    lrs = []
    # multiplier ** (epoch - start_epoch) from start_epoch on: 0.01 at epochs 0 and 1, 0.005 at epoch 2
    schedule = hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=0.01, multiplier=0.5, start_epoch=1)
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: lrs.append(float(opt.learning_rate)))
    model.fit(x, y, batch_size=4, epochs=3, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), schedule, record])
    weights = [w.tolist() for w in model.get_weights()]
    return (hvd.allgather_object(weights) == [weights] * n and np.allclose(lrs, [0.01, 0.01, 0.005])) or lrs


case("lazy_fit", lazy_fit_case)


def local_variables_case():
    mine = keras.initializers.Constant(r)
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(2, kernel_initializer=mine, bias_initializer="zeros", trainable=False),
                              keras.layers.Dense(1, kernel_initializer=mine, trainable=False)])
    model.compile(loss="mse", optimizer="sgd")
    local = list(model.layers[0].variables)
    model.fit(np.ones((2, 3)), np.ones((2, 1)), verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(n - 1, local_variables=local)])
    kept = np.allclose(model.layers[0].kernel.numpy(), r)
    taken = np.allclose(model.layers[1].kernel.numpy(), n - 1)
    return kept and taken


case("broadcast_local_variables", local_variables_case)


def partial_optimizer_case():
    keras.utils.set_random_seed(0)
    local = keras.layers.Dense(2, name="p_local")
    model = keras.Sequential([keras.Input((3,)), local, keras.layers.Dense(1)])
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[local])
    x = np.full((2, 3), r + 1.0, np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    pairs = opt._compute_gradients(loss, model.trainable_variables, tape=tape)
    every = hvd.allgather_object(plain)
    ok_local = all(np.allclose(g, p / n) for (g, _), p in zip(pairs[:2], plain[:2], strict=True))
    ok_shared = all(np.allclose(g, np.mean([e[j] for e in every], 0)) for j, (g, _) in zip((2, 3), pairs[2:],
                                                                                          strict=True))
    opt.apply_gradients(pairs, experimental_aggregate_gradients=False)
    return ok_local and ok_shared


case("partial_optimizer", partial_optimizer_case)


def aggregation_case():
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                         average_aggregated_gradients=True)
    v = tf.Variable([0.0])
    for _ in range(3):
        opt.apply_gradients([(tf.constant([float(r + 1)]), v)])
    # one update after two passes: minus the average over passes and ranks; every pass an iteration
    want = -np.mean([k + 1.0 for k in range(n)])
    return (np.allclose(v.numpy(), want) and int(opt.iterations) == 3 and int(opt._agg_helper.counter) == 1) or \
        (v.numpy().tolist(), int(opt.iterations))


case("aggregation", aggregation_case)


def elastic_state_case(make):
    """sync() takes rank 0's values (variables, optimizer slots, keyword values), restore() goes
    back to the last save, commit() saves (and, with no launcher waiting to add workers, goes on)."""
    def check():
        v = 1.0 if r == 0 else 2.0
        state, variables, extra = make(v)
        state.sync()
        synced = [x.numpy().copy() for x in variables]
        ok = extra() and all(np.array_equal(x, np.ones_like(x)) for x in synced[:2])
        ok = ok and (state.batch, state.epoch) == (20, 10)
        for x in variables:
            x.assign(np.full(x.shape, 5.0, x.numpy().dtype))
        state.batch, state.epoch = 21, 11
        state.restore()
        ok = ok and all(np.array_equal(x.numpy(), s) for x, s in zip(variables, synced, strict=True))
        ok = ok and (state.batch, state.epoch) == (20, 10)
        for x in variables:
            x.assign(np.full(x.shape, 3.0, x.numpy().dtype))
        state.batch = 22
        state.commit()
        state.batch = 0
        for x in variables:
            x.assign(np.zeros(x.shape, x.numpy().dtype))
        state.restore()
        return ok and all((x.numpy() == 3.0).all() for x in variables) and state.batch == 22
    return check


def tensorflow_state(v):
    variables = [tf.Variable(np.full((2, 2), v)), tf.Variable(np.full(2, v))]
    return hvd.elastic.TensorFlowState(variables, batch=20 + r, epoch=10 + r), variables, lambda: True


def keras_state(v):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.set_weights([np.full((2, 2), v, np.float32), np.full(2, v, np.float32)])
    opt = keras.optimizers.Adam(0.001)
    if r == 0:            # rank 0 trained a step: its slots exist and are not zero; the other's are built by sync
        opt.apply_gradients(zip([tf.ones((2, 2)), tf.ones(2)], model.trainable_variables, strict=True))
        model.set_weights([np.ones((2, 2), np.float32), np.ones(2, np.float32)])
    state = hvd_keras.elastic.KerasState(model, opt, batch=20 + r, epoch=10 + r)
    variables = list(model.variables) + list(opt.variables)
    rank0 = hvd.broadcast_object([x.numpy() for x in opt.variables], 0)
    return state, variables, lambda: all(np.array_equal(a, b) for a, b in zip(rank0, state._saved_values[2:],
                                                                              strict=True))


case("elastic_tensorflow_state", elastic_state_case(tensorflow_state))
case("elastic_keras_state", elastic_state_case(keras_state))
def object_state_case():
    state = hvd.elastic.ObjectState(lr=0.5 * (r + 1))
    state.sync()
    return state.lr == 0.5 or state.lr


case("elastic_object_state", object_state_case)

with open(f"{out_dir}/rank{r}.json", "w") as f:
    json.dump(report, f)
hvd.shutdown()
