"""Continual learning across data phases: new classes, replay buffer, EWC and head growth
(pure maths; the server's phase controller is :mod:`fedind.server.continual`)."""
