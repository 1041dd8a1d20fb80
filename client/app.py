"""Flower ClientApp entry point (component `client.app:app`): the site agent."""

from fedind.clientapp import app

__all__ = ["app"]
