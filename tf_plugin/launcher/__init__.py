"""The launcher is rdmatensor.runner now (it imports no framework); these
modules keep the commands job files written before the move use working:

    run.py      `python -m tf_plugin.launcher.run`: rdmatensor-run
    cluster.py  `python -m tf_plugin.launcher.cluster`: rdmatensor.runner.cluster
"""
