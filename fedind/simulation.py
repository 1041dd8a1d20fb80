"""Run a whole federation in this process (tests, benchmarks).

Two runtimes: ``"ray"``, Flower's Simulation Runtime (``run_simulation``: Ray, one worker
process per site, ~10-15 s to start on 2 cores), and ``"loopback"``, the sites called one
after another in this process through :class:`fedind.loopback.LoopbackGrid` (no start-up;
for the server's round logic). For the same seed on CPU both give the same model, bit for
bit (tests/test_simulation.py), when the server's and each site's torch thread counts are
the same in both (a Ray actor with ``num_cpus=1`` trains on one thread; ``"loopback"``
runs each site on ``num_cpus`` threads for that reason) and every site trains every round
(Ray draws new node ids at every start; :mod:`fedind.loopback`).

``"ray"`` can also attach to a Ray cluster that is already running (``ray_address``, or
Ray's own ``RAY_ADDRESS``): the ServerApp stays in this process, the sites run on the
cluster's workers (docs/gpu.md, "Beyond one machine")."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
RAY_CONNECT_SECONDS = 5.0  # ray.init retries an unreachable address for minutes: probe first


def simulate(
    config: RunConfig,
    num_supernodes: int | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    client_app: ClientApp | None = None,
    runtime: str = "ray",
    ray_address: str | None = None,
) -> dict:
    """Run ``config`` with one virtual SuperNode per site; return its summary.json.

    ``client_app``: the site agent to simulate (default: :data:`fedind.site.app.app`), e.g.
    one with an extra mod that misbehaves at some sites (``simulations/poisoning.py``).
    ``runtime``: ``"ray"`` (Flower's Simulation Runtime) or ``"loopback"`` (in this process,
    sequential: :mod:`fedind.loopback`; ``num_cpus`` is then each site's torch threads).
    ``ray_address``: ``host:port`` of a running Ray cluster to run the sites on
    (:func:`ray_cluster`); default ``RAY_ADDRESS``, else a Ray started in this process."""
    if not config.run_name and not config.resume:  # resume without a name: the newest run (serverapp)
        config = replace(config, run_name=f"{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    return simulate_many([config], num_supernodes, num_cpus, num_gpus, client_app, runtime, ray_address)[0]


def simulate_many(
    configs: list[RunConfig],
    num_supernodes: int | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    client_app: ClientApp | None = None,
    runtime: str = "ray",
    ray_address: str | None = None,
) -> list[dict]:
    """Run ``configs`` one after another in one Flower simulation; return their summaries.

    The same results as a :func:`simulate` per config, bit for bit on CPU (each run seeds
    itself, and each site's ``context.state`` starts empty for each run:
    :func:`fedind.site.state.run_scope_mod`), without starting Ray and the site workers
    (imports, data) again for every run: about 15 s a run on 2 cores. For benchmarks that
    make many runs of the same federation size. The runs need distinct run folders and the
    same number of sites. With ``runtime="loopback"`` the runs share one
    :class:`~fedind.loopback.LoopbackGrid` (its node contexts), as they share the Flower run.
    ``ray_address``: as for :func:`simulate`."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    if runtime == "loopback" and ray_address:
        raise ValueError(f"ray_address={ray_address!r} needs runtime='ray'; 'loopback' runs the sites in this process")
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

    with ray_cluster(ray_address or os.environ.get("RAY_ADDRESS") or None) as init_args:
        run_simulation(
            server_app=server_app,
            client_app=client_app or site_app,
            num_supernodes=num_supernodes or num_sites.pop(),
            backend_config={"client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus}, "init_args": init_args},
        )
    if len(summaries) < len(configs):
        failed = configs[len(summaries)]
        raise RuntimeError(
            f"the simulation of {failed.run_name or 'the resumed run'} ended without a summary; see the log above"
        )
    return summaries


@contextmanager
def ray_cluster(address: str | None) -> Iterator[dict]:
    """Flower's Ray ``init_args`` (passed to ``ray.init``) for one simulation: ``{}`` when
    ``address`` is None (Ray starts in this process, as before), else ``{"address": ...}``
    for the running cluster at ``host:port`` (what ``ray start --head`` prints), which this
    process joins as a driver and leaves when the block ends; the cluster stays up.

    Two checks first, as Ray makes neither: the address must answer within
    :data:`RAY_CONNECT_SECONDS` (``ray.init`` retries for minutes), and Ray must not be
    running in this process already (Flower would reuse that Ray and ignore the address)."""
    if address is None:
        yield {}
        return
    host, port = ray_endpoint(address)
    import ray

    if ray.is_initialized():
        raise RuntimeError(
            f"cannot attach to the Ray cluster at {address}: this process is already connected to Ray "
            f"(at {ray.get_runtime_context().gcs_address}), which Flower would use instead"
        )
    try:
        socket.create_connection((host, port), timeout=RAY_CONNECT_SECONDS).close()
    except OSError as error:
        raise ConnectionError(
            f"no Ray cluster answers at {address} ({error}); is `ray start --head` running there?"
        ) from error
    try:
        yield {"address": address.strip()}
    finally:
        ray.shutdown()  # this process leaves the cluster; the cluster stays up


def ray_endpoint(address: str) -> tuple[str, int]:
    """``(host, port)`` of a Ray cluster address ``host:port``. Ray's other forms (``auto``,
    ``ray://`` for Ray Client) are refused: the first names no host to check, and Flower's
    Ray backend is not tested over the second."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or "://" in address or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a Ray cluster address is host:port (as `ray start --head` prints it), got {address!r}")
    return host.strip("[]"), int(port)


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
