"""Shared pytest fixtures."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def flower_task_identity(monkeypatch):
    """Messages stamp run/node/task ids from TaskIdentity, which a Flower runtime sets."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
