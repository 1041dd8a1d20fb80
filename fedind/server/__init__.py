"""The server: the ServerApp, its round loop, screening, strategies, checkpoints, results and
monitoring, and the server halves of the features (phase controller, encrypted rounds)."""
