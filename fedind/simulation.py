"""Run a whole federation in this process (tests, benchmarks).

Two runtimes: ``"ray"``, Flower's Simulation Runtime (``run_simulation``: Ray, one worker
process per site, ~10-15 s to start on 2 cores), and ``"loopback"``, the sites called one
after another in this process through :class:`fedind.loopback.LoopbackGrid` (no start-up;
for the server's round logic). For the same seed on CPU both give the same model, bit for
bit (tests/test_simulation.py), when the server's and each site's torch thread counts are
the same in both (a Ray actor with ``num_cpus=1`` trains on one thread; ``"loopback"``
runs each site on ``num_cpus`` threads for that reason) and every site trains every round
(Ray draws new node ids at every start; :mod:`fedind.loopback`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from .site.app import app as site_app
from .config import RunConfig
from .loopback import LoopbackGrid, task_identity
from .paillier.keys import generate_keypair, save_keypair
from .server.app import federation_shape, run_server

REPLY_POLL_SECONDS = 0.01
RUNTIMES = ("ray", "loopback")


def simulate(
    config: RunConfig,
    num_supernodes: int | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    client_app: ClientApp | None = None,
    runtime: str = "ray",
) -> dict:
    """Run ``config`` with one virtual SuperNode per site; return its summary.json.

    ``client_app``: the site agent to simulate (default: :data:`fedind.site.app.app`), e.g.
    one with an extra mod that misbehaves at some sites (``simulations/poisoning.py``).
    ``runtime``: ``"ray"`` (Flower's Simulation Runtime) or ``"loopback"`` (in this process,
    sequential: :mod:`fedind.loopback`; ``num_cpus`` is then each site's torch threads)."""
    if not config.run_name and not config.resume:  # resume without a name: the newest run (serverapp)
        config = replace(config, run_name=f"{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    return simulate_many([config], num_supernodes, num_cpus, num_gpus, client_app, runtime)[0]


def simulate_many(
    configs: list[RunConfig],
    num_supernodes: int | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    client_app: ClientApp | None = None,
    runtime: str = "ray",
) -> list[dict]:
    """Run ``configs`` one after another in one Flower simulation; return their summaries.

    The same results as a :func:`simulate` per config, bit for bit on CPU (each run seeds
    itself, and each site's ``context.state`` starts empty for each run:
    :func:`fedind.site.state.run_scope_mod`), without starting Ray and the site workers
    (imports, data) again for every run: about 15 s a run on 2 cores. For benchmarks that
    make many runs of the same federation size. The runs need distinct run folders and the
    same number of sites. With ``runtime="loopback"`` the runs share one
    :class:`~fedind.loopback.LoopbackGrid` (its node contexts), as they share the Flower run."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    if not configs:
        return []
    folders = [(c.run_dir, c.run_name) for c in configs]
    if len(configs) > 1 and (any(not c.run_name for c in configs) or len(set(folders)) < len(folders)):
        raise ValueError(f"simulate_many needs a distinct run-dir/run-name per run, got {folders}")
    num_sites = {federation_shape(c)[0] for c in configs}
    if len(num_sites) > 1:
        raise ValueError(f"simulate_many needs the same number of sites in every run, got {sorted(num_sites)}")
    configs = [_with_keys(config) for config in configs]
    if runtime == "loopback":
        return _loopback(configs, num_supernodes or num_sites.pop(), num_cpus, client_app or site_app)
    server_app = ServerApp()
    summaries: list[dict] = []

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        # Flower's in-memory grid checks for replies every 0.1 s: a round waited up to that
        # long after its last site replied (a default round is about 1.2 s). A check is cheap.
        grid.pull_interval = REPLY_POLL_SECONDS
        for config in configs:
            summaries.append(run_server(grid, config))

    run_simulation(
        server_app=server_app,
        client_app=client_app or site_app,
        num_supernodes=num_supernodes or num_sites.pop(),
        backend_config={"client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus}},
    )
    if len(summaries) < len(configs):
        failed = configs[len(summaries)]
        raise RuntimeError(
            f"the simulation of {failed.run_name or 'the resumed run'} ended without a summary; see the log above"
        )
    return summaries


def _loopback(configs: list[RunConfig], num_nodes: int, num_cpus: float, client_app: ClientApp) -> list[dict]:
    """The runs on one :class:`LoopbackGrid`; each site with ``num_cpus`` torch threads (at
    least 1), as a Ray actor with that many CPUs has."""
    grid = LoopbackGrid(client_app, num_nodes, client_threads=max(1, int(num_cpus)))
    with task_identity(grid.run.run_id):  # what Message() stamps; run_simulation sets it too
        return [run_server(grid, config) for config in configs]


def _with_keys(config: RunConfig) -> RunConfig:
    if config.encryption == "paillier" and not config.paillier_public_key:
        # A throwaway key pair in the run folder: the server gets the .pub, the sites the .key.
        config = provision_simulation_keys(config, Path(config.run_dir) / config.run_name)
    return config


def provision_simulation_keys(config: RunConfig, folder: Path) -> RunConfig:
    """In-process simulation without key files: a throwaway pair of ``paillier-key-bits`` in
    ``folder/keys`` (private 0600). The server gets the public file, the sites the private
    one; nothing else ever sees or keeps the pair."""
    keys = Path(folder) / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    private, public = keys / "paillier.key", keys / "paillier.pub"
    for path in (private, public):
        if path.exists():
            path.unlink()
    save_keypair(generate_keypair(config.paillier_key_bits), private, public)
    return replace(config, paillier_public_key=str(public), paillier_private_key=str(private))
