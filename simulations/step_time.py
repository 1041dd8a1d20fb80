"""Local training speed: the front end once per dataset against once per batch, side by side.

``train_local`` conditions a FaultCNN's windows once (``FaultCNN.condition``) and trains
``classify`` on them. This script trains the same site from the same weights both ways, one
torch thread (as a simulation worker has), the two arms alternating ``--reps`` times, and
prints the median time per SGD step of each and whether the trained weights are identical.

    python simulations/step_time.py                           # about 15 s
    python simulations/step_time.py --site 2 dirichlet-alpha=0.1   # the largest site there, about 25 s

Extra ``key=value`` arguments override the run config (pyproject defaults).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides  # noqa: E402

from fedind.data.federation import make_site  # noqa: E402
from fedind.data.synthetic import NUM_CLASSES  # noqa: E402
from fedind.models import FaultCNN  # noqa: E402
from fedind.training import prior_logit_adjustment, train_local  # noqa: E402


class WholeModel(torch.nn.Module):
    """The model seen only through ``forward``: training runs the front end every batch."""

    def __init__(self, model: FaultCNN) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def one_round(start: dict, data, config, whole: bool) -> tuple[float, int, dict]:
    """Seconds (process time) and steps of one round of local training, and the weights."""
    model = FaultCNN(data.x.shape[1], NUM_CLASSES, config.model_width)
    model.load_state_dict(start)
    adjustment = prior_logit_adjustment(np.bincount(data.y, minlength=NUM_CLASSES), config.logit_adjustment)
    began = time.process_time()
    result = train_local(
        WholeModel(model) if whole else model, data, epochs=config.local_epochs, batch_size=config.batch_size,
        lr=config.learning_rate, seed=0, device=torch.device("cpu"), momentum=config.local_momentum,
        logit_adjustment=adjustment, grad_clip=config.local_grad_clip,
    )
    return time.process_time() - began, result.steps, model.state_dict()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=int, default=0, help="which site of the federation trains")
    parser.add_argument("--reps", type=int, default=15)
    args, overrides = parser.parse_known_args(argv)
    config = parse_overrides(overrides)
    torch.set_num_threads(1)
    data = make_site(config.federation_spec(), args.site)[0]
    torch.manual_seed(config.seed)
    start = FaultCNN(data.x.shape[1], NUM_CLASSES, config.model_width).state_dict()
    one_round(start, data, config, whole=False)  # warm-up: oneDNN builds its kernels
    one_round(start, data, config, whole=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    weights = {}
    for _ in range(args.reps):
        for whole in (True, False):
            seconds, steps, weights[whole] = one_round(start, data, config, whole)
            times[whole].append(1000 * seconds / steps)
    identical = all(torch.equal(weights[True][k], weights[False][k]) for k in weights[True])
    once, every = statistics.median(times[False]), statistics.median(times[True])
    print(f"site {args.site}: {data.num_examples} windows of {data.x.shape[1:]}, {steps} steps a round, {args.reps} rounds each way")
    print(f"front end every batch: {every:.2f} ms/step (median)")
    print(f"front end once:        {once:.2f} ms/step (median), {1 - once / every:.0%} less")
    print(f"trained weights identical: {identical}")


if __name__ == "__main__":
    main(sys.argv[1:])
