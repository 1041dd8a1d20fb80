"""fedind: federated fault diagnosis for factory edge sites, on Flower."""

__version__ = "0.1.0"
