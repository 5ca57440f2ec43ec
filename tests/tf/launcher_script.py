"""One rank of a job started by a launcher other than rdmatensor-run (mpirun,
srun, torchrun): no TF_CONFIG, only the launcher's variables and a rendezvous
address. Prints `rank R of N local L/LS sum S` after a real all-reduce."""
import tensorflow as tf

import tf_plugin as hvd

hvd.init()
total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum, name="sum")
print(f"rank {hvd.rank()} of {hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} sum {float(total[0]):g}",
      flush=True)
