"""What handing a step's gradients out of and back into a tf.function costs.

    python -m bench.graph_boundary --models densenet121,resnet50,mobilenetv2

Inside tf.function the all-reduce is two numpy_function ops per bucket
(tf_plugin.graph.overlap): a launch that takes the bucket's gradients and a
wait that returns its result. This times, on one process with no ring (the
"result" is a reused flat buffer), one call of a tf.function that makes a
model's gradients (bench/model_grads.json, fused into buckets as training
fuses them) and returns them, three ways, in turn, so all see the same machine:

- `none`: the gradients returned as they are, no boundary at all;
- `flat`: overlap.bucketed, what training runs: one flat output per bucket,
  sliced into its members in the graph (views);
- `per-tensor`: the same launch, but a wait op with one output per gradient
  (views of the same buffer), as before the flat output.

Prints the median milliseconds per call of each way and what `flat` and
`per-tensor` add over `none`; checks first that `flat` returns the buffer's
values, member by member.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _buckets(model: str):
    import numpy as np

    from . import model_grads
    from tf_plugin.core.layout import VarInfo, buckets_of
    infos = [VarInfo(str(j), tuple(t["shape"]), np.dtype(t["dtype"]), False, {})
             for j, t in enumerate(model_grads.gradient_set(model))]
    return infos, buckets_of(infos, fusion=True)


def measure(model: str, calls: int, rounds: int) -> dict:
    import numpy as np
    import tensorflow as tf

    from tf_plugin.core.buffers import aligned_empty
    from tf_plugin.graph import overlap
    infos, buckets = _buckets(model)
    shapes = [v.shape for v in infos]
    outputs = [aligned_empty((b.size,), b.dtype) for b in buckets]
    for o in outputs:
        o[...] = np.arange(o.size) % 251
    layouts = [[(int(key), offset, shapes[int(key)]) for key, offset, _ in b.members] for b in buckets]
    seeds = [tf.Variable(tf.ones(s)) for s in shapes]

    def grads():
        return [v * 2.0 for v in seeds]

    def launch(j, arrays):
        return 0            # the round's number

    @tf.function
    def none():
        return grads()

    @tf.function
    def flat():
        return overlap.bucketed(grads(), layouts, launch, lambda j, number: outputs[j], "bench")

    @tf.function
    def per_tensor():
        gs, out = grads(), [None] * len(shapes)
        for j, layout in enumerate(layouts):
            token = tf.numpy_function(lambda *a: np.int64(0), [gs[p] for p, _, _ in layout], tf.int64,
                                      stateful=True)
            with tf.control_dependencies([token]):
                results = tf.numpy_function(
                    lambda j=j, layout=layout: [outputs[j][o:o + int(np.prod(s))] for _, o, s in layout], [],
                    [gs[p].dtype for p, _, _ in layout], stateful=True)
            for (p, _, _), r in zip(layout, results, strict=True):
                out[p] = tf.reshape(r, shapes[p])
        return out

    got = flat()
    for j, layout in enumerate(layouts):
        for p, offset, shape in layout:
            if not np.array_equal(got[p].numpy(), outputs[j][offset:offset + int(np.prod(shape))].reshape(shape)):
                raise AssertionError(f"{model}: gradient {p} came back wrong")
    ways = {"none": none, "flat": flat, "per-tensor": per_tensor}
    times = {w: [] for w in ways}
    for _ in range(rounds):
        for w, fn in ways.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[w].append((time.perf_counter() - t0) / calls * 1e3)
    ms = {w: statistics.median(t) for w, t in times.items()}
    return {"model": model, "tensors": len(shapes), "buckets": len(buckets), "ms": ms}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="densenet121,resnet50,mobilenetv2")
    parser.add_argument("--calls", type=int, default=20, help="calls per way per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    from . import model_grads
    unknown = [m for m in args.models.split(",") if m not in model_grads.names()]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: choose from {', '.join(model_grads.names())}")
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    print(f"{'model':<14}{'tensors':>8}{'buckets':>8}{'none ms':>9}{'flat ms':>9}{'per-tensor ms':>14}"
          f"{'flat adds':>10}{'per-tensor adds':>16}")
    for model in args.models.split(","):
        r = measure(model, args.calls, args.rounds)
        ms = r["ms"]
        print(f"{model:<14}{r['tensors']:>8}{r['buckets']:>8}{ms['none']:>9.2f}{ms['flat']:>9.2f}"
              f"{ms['per-tensor']:>14.2f}{ms['flat'] - ms['none']:>10.2f}{ms['per-tensor'] - ms['none']:>16.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
