"""Flower ClientApp entry point (component `client.app:app`): the site agent's per-message
relay (fedind.site.relay), which hands deployed messages to the site's long-lived worker and
calls the site agent in-process in simulation."""

from fedind.site.relay import app

__all__ = ["app"]
