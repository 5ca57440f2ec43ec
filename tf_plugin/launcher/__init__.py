"""Who is who and how ranks start: the cluster from TF_CONFIG or Slurm (cluster), a rank's share of
the cores (cores), and the rdmatensor-run launcher (run). Imports nothing else of tf_plugin.
"""
