"""Flower ServerApp entry point (component `server.app:app`)."""

from fedind.serverapp import app

__all__ = ["app"]
