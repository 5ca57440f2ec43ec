"""rdmatensor-run and what any program's ranks need to find each other; no
framework is imported here (TensorFlow's face, tf_plugin, reads it).

    cli.py          rdmatensor-run's command line
    horovodrun_flags.py
                    horovodrun's flags and config file, with horovodrun's meanings
    placement.py    hosts and slots, where each rank runs, the environment it starts with
    processes.py    the job's processes: started, output prefixed, watched, stopped together
    ssh.py          a rank on another host, stopped when its connection ends
    addresses.py    this host's address as a remote peer reaches it
    elastic.py      elastic jobs: the discovery script, workers added and lost
    rendezvous_server.py, rendezvous_client.py
                    the rounds an elastic job's workers join (or, under another
                    launcher, rank 0 serves them)
    cluster.py      who is who: TF_CONFIG, Slurm's variables, free ports
    cores.py        a rank's share of its host's cores, and binding to them
"""
