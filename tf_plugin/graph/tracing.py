"""What autograph leaves alone: the plugin's graph-building code.

Inside a user's tf.function, autograph rewrites every Python function it
reaches, recursively, unless told not to. The plugin's collectives and tapes
only build ops (their Python branches never depend on a tensor's value), so
rewriting them buys nothing and cost most of a trace: a 3-layer MLP's
DistributedGradientTape step on 2 ranks traced in 10.4-11.0 s with them
rewritten, 0.47-0.50 s without (docs/changelog.md), and in emulated VMs a
trace took over 15 minutes.
"""
import tensorflow as tf

graph_code = tf.autograph.experimental.do_not_convert      # a public entry point that builds ops
