"""What the worker scripts compare: a rank's training step through DistributedGradientTape,
and the single-process step on the global batch it must equal."""
import tensorflow as tf


def distributed_and_local(hvd, model, reference, opt, ref_opt, loss_fn):
    """(dist_step, local_step): dist_step is a plain function (wrap it in tf.function, or run
    it eagerly), local_step a tf.function training `reference` without communication."""
    def dist_step(x, y):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(y, model(x))
        grads = hvd.DistributedGradientTape(tape).gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss_value

    @tf.function
    def local_step(x, y):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(y, reference(x))
        ref_opt.apply_gradients(zip(tape.gradient(loss_value, reference.trainable_variables),
                                    reference.trainable_variables, strict=True))

    return dist_step, local_step
