"""Run a whole federation in this process with Flower's Simulation Runtime (tests, benchmarks)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from .clientapp import app as site_app
from .config import RunConfig
from .secure import provision_simulation_keys
from .serverapp import federation_shape, run_server

REPLY_POLL_SECONDS = 0.01


def simulate(
    config: RunConfig,
    num_supernodes: int | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    client_app: ClientApp | None = None,
) -> dict:
    """Run ``config`` with one virtual SuperNode per site; return its summary.json.

    ``client_app``: the site agent to simulate (default: :data:`fedind.clientapp.app`), e.g.
    one with an extra mod that misbehaves at some sites (``simulations/poisoning.py``)."""
    if not config.run_name and not config.resume:  # resume without a name: the newest run (serverapp)
        config = replace(config, run_name=f"{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    if config.encryption == "paillier" and not config.paillier_public_key:
        # A throwaway key pair in the run folder: the server gets the .pub, the sites the .key.
        config = provision_simulation_keys(config, Path(config.run_dir) / config.run_name)
    server_app = ServerApp()
    finished: dict = {}

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        # Flower's in-memory grid checks for replies every 0.1 s: a round waited up to that
        # long after its last site replied (a default round is about 1.2 s). A check is cheap.
        grid.pull_interval = REPLY_POLL_SECONDS
        finished["summary"] = run_server(grid, config)

    num_sites = federation_shape(config)[0]
    run_simulation(
        server_app=server_app,
        client_app=client_app or site_app,
        num_supernodes=num_supernodes or num_sites,
        backend_config={"client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus}},
    )
    if "summary" not in finished:
        raise RuntimeError(f"the simulation of {config.run_name or 'the resumed run'} ended without a summary; see the log above")
    return finished["summary"]
