"""The launcher is rdmatensor.runner now (it imports no framework); these
modules keep `python -m tf_plugin.launcher.run` and `...cluster`, as job files
written before the move say, working."""
