"""Shared pytest fixtures."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def flower_task_identity(monkeypatch):
    """Messages stamp run/node/task ids from TaskIdentity, which a Flower runtime sets."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


# --------------------------------------------------------------------------- the suite's one Ray start
#
# Most federation tests run on the loopback runtime (fedind.loopback: the sites called in
# this process, no start-up). Flower's Simulation Runtime (Ray, a worker process per site)
# starts once per session, here, for the tests that need it: every run below shares that
# start (simulate_many), and each is asserted on by the test named next to it.

RAY_TOPK = dict(  # tests/test_simulation.py::test_same_seed_gives_a_bit_identical_model_on_cpu_alone_or_batched
    num_server_rounds=2, num_sites=3, dirichlet_alpha=0.3, samples_per_site=60, local_epochs=5, batch_size=8,
    learning_rate=0.01, model_width=16, device="cpu", seed=0, compression="topk", topk_ratio=0.05,
)
RAY_ENCRYPTED = dict(  # tests/test_secure.py::test_simulation_end_to_end_without_the_server_loading_the_private_key
    num_server_rounds=2, num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, learning_rate=0.01,
    model_width=8, device="cpu", strategy="dwa", encryption="paillier",
)


@pytest.fixture(scope="session")
def ray_runs(tmp_path_factory) -> dict:
    """Summaries of three runs in one Ray simulation (``simulate_many``): ``first`` and
    ``second`` (RAY_TOPK, the same config twice), ``encrypted`` (RAY_ENCRYPTED with a
    Paillier key pair). While Ray runs, this process — the ServerApp's — may not load or
    build a Paillier private key: the sites (Ray workers, other processes) do.
    Also ``configs`` (the RunConfig of each), ``run_dir`` and ``private_key_loads``
    (attempts in this process: must stay [])."""
    from dataclasses import replace

    from fedind import crypto
    from fedind.config import RunConfig
    from fedind.simulation import simulate_many

    run_dir = tmp_path_factory.mktemp("ray")
    keys = tmp_path_factory.mktemp("ray-keys")
    crypto.save_keypair(crypto.generate_keypair(512), keys / "paillier.key", keys / "paillier.pub")
    topk = RunConfig(**RAY_TOPK, run_dir=str(run_dir))
    encrypted = RunConfig(
        **RAY_ENCRYPTED, paillier_public_key=str(keys / "paillier.pub"),
        paillier_private_key=str(keys / "paillier.key"), run_dir=str(run_dir), run_name="encrypted",
    )
    loads: list[str] = []

    def forbidden(*args, **kwargs):
        loads.append(repr(args))
        raise AssertionError("the server process touched a Paillier private key")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(crypto, "load_private_key", forbidden)
        patch.setattr(crypto.PrivateKey, "__init__", forbidden)
        first, second, enc = simulate_many(
            [replace(topk, run_name="first"), replace(topk, run_name="second"), encrypted], runtime="ray"
        )
    return {
        "first": first, "second": second, "encrypted": enc, "run_dir": run_dir, "private_key_loads": loads,
        "configs": {"first": replace(topk, run_name="first"), "second": replace(topk, run_name="second"),
                    "encrypted": encrypted},
    }
