"""The traced computations of one training step: loss and gradients.

The analyzer traces these to learn what crosses processes, and the trainers
run the very same functions, so the plan always matches what is sent.

Sparse gradients (tf.IndexedSlices, e.g. of an embedding) are either
`dedupe`d (duplicate rows summed: values [rows, ...] and indices [rows],
`rows` unknown until run time: a dynamic tensor) or made `dense` (the
variable's static shape), which is what a ring all-reduce needs.
"""
from __future__ import annotations

import tensorflow as tf


def dedupe(g: tf.IndexedSlices) -> tf.IndexedSlices:
    """Sum duplicate rows: at most one row per distinct index crosses the wire."""
    indices, pos = tf.unique(tf.cast(g.indices, tf.int64))
    values = tf.math.unsorted_segment_sum(g.values, pos, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, g.dense_shape)


def _shape(grads, sparse: str):
    if sparse == "dense":
        return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return [dedupe(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


class Step:
    """`grads(*inputs)` -> (loss, [gradient per trainable variable]), traced once.

    `forward(*inputs)` computes the loss from the variables' current values;
    `stateless(weights, *inputs)`, when given, from weight tensors passed in
    (a parameter-server worker feeds the received values straight in, with no
    copy into variables). `signature` lists the inputs' tf.TensorSpec."""

    def __init__(self, variables, forward, signature, stateless=None, sparse: str = "dedupe"):
        if sparse not in ("dedupe", "dense"):
            raise ValueError(f"sparse must be dedupe or dense, not {sparse!r}")
        self.variables = list(variables)
        self.signature = list(signature)
        self.sparse = sparse
        self._forward, self._stateless = forward, stateless
        self.grads = tf.function(self._grads, input_signature=self.signature)
        self.weight_specs = [tf.TensorSpec(v.shape, v.dtype) for v in self.variables]
        self.stateless_grads = (tf.function(self._stateless_grads,
                                            input_signature=[self.weight_specs, *self.signature])
                                if stateless else None)

    @classmethod
    def for_model(cls, model, loss, signature, sparse: str = "dedupe") -> "Step":
        """A Keras model and loss(y, outputs); signature = (x spec, y spec)."""
        def forward(x, y):
            return loss(y, model(x))

        def stateless(weights, x, y):
            outputs, _ = model.stateless_call(weights, [v.value for v in model.non_trainable_variables], x)
            return loss(y, outputs)

        return cls(model.trainable_variables, forward, signature, stateless, sparse)

    @classmethod
    def for_function(cls, fn, signature, sparse: str = "dedupe") -> "Step":
        """A tf.function of `signature`; its outputs, summed, stand in for the loss
        (gradient shapes do not depend on which loss)."""
        concrete = fn.get_concrete_function(*signature)
        return cls(concrete.trainable_variables, lambda *a: tf.reduce_sum(fn(*a)), signature,
                   sparse=sparse)

    def _grads(self, *inputs):
        with tf.GradientTape() as tape:
            loss = self._forward(*inputs)
        return loss, _shape(tape.gradient(loss, self.variables), self.sparse)

    def _stateless_grads(self, weights, *inputs):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            loss = self._stateless(weights, *inputs)
        return loss, _shape(tape.gradient(loss, weights), self.sparse)

    def traced_gradients(self):
        """The symbolic gradients (static shapes where known, None where not)."""
        return self.grads.get_concrete_function().structured_outputs[1]
