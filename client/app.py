"""Flower ClientApp entry point (component `client.app:app`): the site agent."""

from fedind.site.app import app

__all__ = ["app"]
