"""Who is who and how ranks start: the cluster from TF_CONFIG or Slurm (cluster), a rank's share of
the cores (cores), the rdmatensor-run launcher (run), its elastic mode (elastic) and the rounds
an elastic job's workers join (rendezvous). Imports nothing else of tf_plugin.
"""
