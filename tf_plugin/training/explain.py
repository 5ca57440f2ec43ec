"""The plan of a demo model's training job, explained:

    python -m tf_plugin.training.explain --model mlp --mode ps --workers 2 --ps 1
"""
from __future__ import annotations

import argparse
import sys

from ..graph.analyzer import analyze
from ..graph.step import Step
from . import models


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the plan of a demo model's training job.")
    parser.add_argument("--model", choices=("mlp", "cnn", "embed"), default="mlp")
    parser.add_argument("--mode", choices=("ps", "allreduce"), default="allreduce")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=None, help="parameter servers (ps mode; default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fusion", action="store_true", help="allreduce: one ring per gradient")
    args = parser.parse_args(argv)
    model = models.build(args.model, args.seed)
    ps = (args.ps or 1) if args.mode == "ps" else 0
    step = Step.for_model(model, models.loss_fn, models.input_specs(args.model),
                          sparse="dense" if args.mode == "allreduce" else "dedupe")
    opt = models.optimizer()
    opt.build(model.trainable_variables)
    analyze(step, args.mode, args.workers, ps, optimizer=opt,
            fusion=not args.no_fusion).explain(file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
