"""Centralized upper bound: the same model trained on the union of all sites' data.

Same data, model, seed, batch size and learning-rate schedule as the federated run, and
the same budget: ``num-server-rounds x local-epochs`` passes over the pooled data.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import RunConfig
from .data.format import SiteArrays, list_sites, load_site
from .data.federation import make_site
from .data.sources import global_test_set, resolve_root
from .models import FaultCNN
from .training import cosine_lr, evaluate, pick_device, train_local


def pooled_training_data(config: RunConfig) -> SiteArrays:
    if config.data_root:
        root = resolve_root(config.data_root)
        parts = [load_site(root, site)[0] for site in list_sites(root)]
    else:
        spec = config.federation_spec()
        parts = [make_site(spec, i)[0] for i in range(spec.num_sites)]
    return SiteArrays(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]))


def train_centralized(config: RunConfig, log_every: int = 0) -> dict:
    """Train on pooled data; return the accuracy curve on the global test set (one point
    per ``local-epochs`` passes, i.e. per federated-round equivalent)."""
    data = pooled_training_data(config)
    test_set = global_test_set(config.federation_spec(), config.data_root)
    if test_set is None:
        raise ValueError("the centralized bound needs a global test set (data-root/test.npz)")
    device = pick_device(config.device)
    torch.manual_seed(config.seed)
    num_classes = int(max(data.y.max(), test_set.y.max())) + 1
    model = FaultCNN(in_channels=data.x.shape[1], num_classes=max(num_classes, 2), width=config.model_width)
    curve = []
    for step in range(config.num_server_rounds):
        train_local(
            model,
            data,
            epochs=config.local_epochs,
            batch_size=config.batch_size,
            lr=cosine_lr(config.learning_rate, step / config.num_server_rounds),
            seed=config.seed + step,
            device=device,
            momentum=config.local_momentum,
            grad_clip=config.local_grad_clip,
        )
        curve.append(evaluate(model, test_set, device).accuracy)
        if log_every and (step + 1) % log_every == 0:
            print(f"  epoch-block {step + 1}/{config.num_server_rounds}  accuracy {curve[-1]:.4f}", flush=True)
    return {
        "final_accuracy": curve[-1],
        "best_accuracy": max(curve),
        "curve": curve,
        "train_examples": data.num_examples,
        "epochs": config.num_server_rounds * config.local_epochs,
    }
