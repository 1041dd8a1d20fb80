"""Flower ServerApp entry point (component `server.app:app`)."""

from fedind.server.app import app

__all__ = ["app"]
