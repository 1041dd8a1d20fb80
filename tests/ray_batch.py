"""The test suite's one run of Flower's Simulation Runtime (Ray): ``python tests/ray_batch.py OUT``.

tests/conftest.py starts this script in a process of its own as soon as collection ends
(if a selected test uses the ``ray_runs`` fixture), so that Ray's start-up (~15 s on 2
cores) overlaps the rest of the suite. Three runs share the one Ray start
(``simulate_many``); each is asserted on by the test named next to its config. This
process is the ServerApp's: it may not load or build a Paillier private key while Ray runs
(the sites, in Ray's worker processes, do). Writes ``OUT/ray_runs.json``: the three
summaries, the run configs, the run folder and the private-key attempts (must be [])."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

RAY_TOPK = dict(  # tests/test_simulation.py::test_same_seed_gives_a_bit_identical_model_on_cpu_alone_or_batched
    num_server_rounds=2, num_sites=3, dirichlet_alpha=0.3, samples_per_site=60, local_epochs=5, batch_size=8,
    learning_rate=0.01, model_width=16, device="cpu", seed=0, compression="topk", topk_ratio=0.05,
)
RAY_ENCRYPTED = dict(  # tests/test_secure.py::test_simulation_end_to_end_without_the_server_loading_the_private_key
    num_server_rounds=2, num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, learning_rate=0.01,
    model_width=8, device="cpu", strategy="dwa", encryption="paillier",
)


def main(out: Path) -> None:
    from fedind.paillier import keys as paillier_keys
    from fedind.config import RunConfig
    from fedind.simulation import simulate_many

    run_dir, keys = out / "runs", out / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    key = paillier_keys.generate_keypair(512)
    paillier_keys.save_keypair(key, keys / "paillier.key", keys / "paillier.pub")
    topk = RunConfig(**RAY_TOPK, run_dir=str(run_dir))
    configs = {
        "first": replace(topk, run_name="first"),
        "second": replace(topk, run_name="second"),
        "encrypted": RunConfig(
            **RAY_ENCRYPTED, paillier_public_key=str(keys / "paillier.pub"),
            paillier_private_key=str(keys / "paillier.key"), run_dir=str(run_dir), run_name="encrypted",
        ),
    }
    loads: list[str] = []

    def forbidden(*args, **kwargs):
        loads.append(repr(args))
        raise AssertionError("the server process touched a Paillier private key")

    paillier_keys.load_private_key = forbidden
    paillier_keys.PrivateKey.__init__ = forbidden
    summaries = simulate_many(list(configs.values()), runtime="ray")
    result = {
        **dict(zip(configs, summaries)),
        "configs": {name: config.to_flower() for name, config in configs.items()},
        "run_dir": str(run_dir),
        "private_key_loads": loads,
    }
    (out / "ray_runs.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
