"""The ``fedind`` command line: data, deployment, key, run, predict, serve and export commands."""
