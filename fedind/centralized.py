"""Centralized upper bound: the same model trained on the union of all sites' data.

Same data, model, seed, batch size and learning-rate schedule as the federated run, the
same budget (``num-server-rounds x local-epochs`` passes over the pooled data) and the same
loss: with ``logit-adjustment`` > 0 each window's logits are adjusted by ITS site's label
prior, as that site's training does (:func:`site_prior_adjustment`).

The curve depends, in its last bits and so over 160 epochs in its value, on torch's thread
count. :func:`train_centralized_many` trains each bound in a worker process of one thread,
as a simulation worker trains a site: the same numbers whatever the machine's core count,
several bounds at a time.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from .config import RunConfig
from .data.format import SiteArrays, list_sites, load_site
from .data.federation import make_site
from .data.sources import global_test_set, resolve_root
from .models import FaultCNN
from .training import cosine_lr, evaluate, pick_device, prior_logit_adjustment, train_local


def site_training_data(config: RunConfig) -> list[SiteArrays]:
    """Every site's training windows, in site order."""
    if config.data_root:
        root = resolve_root(config.data_root)
        return [load_site(root, site)[0] for site in list_sites(root)]
    spec = config.federation_spec()
    return [make_site(spec, i)[0] for i in range(spec.num_sites)]


def site_prior_adjustment(parts: list[SiteArrays], num_classes: int, tau: float) -> torch.Tensor:
    """``[N, num_classes]``: each pooled window gets its own site's logit adjustment
    (:func:`prior_logit_adjustment` of that site's label histogram), the loss the sites
    train with. Without it, pooled label-skewed sites let the model learn "this line's
    signal, so this line's classes": a shortcut the class-balanced global test set punishes."""
    rows = [
        prior_logit_adjustment(np.bincount(p.y, minlength=num_classes), tau).expand(p.num_examples, num_classes)
        for p in parts
    ]
    return torch.cat(rows)


def train_centralized(config: RunConfig, log_every: int = 0) -> dict:
    """Train on pooled data; return the accuracy curve on the global test set (one point
    per ``local-epochs`` passes, i.e. per federated-round equivalent)."""
    parts = site_training_data(config)
    data = SiteArrays(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]))
    test_set = global_test_set(config.federation_spec(), config.data_root)
    if test_set is None:
        raise ValueError("the centralized bound needs a global test set (data-root/test.npz)")
    device = pick_device(config.device)
    torch.manual_seed(config.seed)
    num_classes = int(max(data.y.max(), test_set.y.max())) + 1
    model = FaultCNN(in_channels=data.x.shape[1], num_classes=max(num_classes, 2), width=config.model_width)
    tau = config.logit_adjustment
    adjustment = site_prior_adjustment(parts, model.head.out_features, tau) if tau > 0 else None
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
            stretch=config.local_stretch_at(step + 1),
            logit_adjustment=adjustment,
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


def train_centralized_many(
    configs: list[RunConfig], processes: int | None = None, log_every: int = 0
) -> Iterator[dict]:
    """:func:`train_centralized` of every config in ``processes`` worker processes (default:
    one per CPU core) of one torch thread each; yields the results in the order of
    ``configs``, each as soon as it and those before it are done (a caller can save them
    one by one, so an interrupted batch keeps what it finished).

    One bound barely uses a second thread (121 s at one thread against 112 s at two on
    2 cores, 2026-12-03), so two bounds side by side at one thread each take about half the
    time of two in turn at two threads."""
    if not configs:
        return
    processes = max(1, min(len(configs), processes or os.cpu_count() or 1))
    # spawn, not fork: a forked child of a process whose torch thread pool already ran can hang.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        yield from pool.map(functools.partial(train_centralized, log_every=log_every), configs)
