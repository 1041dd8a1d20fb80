"""The centralized bound: pooled sites, each window trained with its own site's prior."""

from dataclasses import replace

import numpy as np
import torch

from fedind.centralized import site_prior_adjustment, site_training_data, train_centralized, train_centralized_many
from fedind.config import RunConfig
from fedind.data.format import SiteArrays
from fedind.training import prior_logit_adjustment

SMALL = RunConfig(num_server_rounds=2, local_epochs=1, num_sites=3, samples_per_site=40, dirichlet_alpha=0.1, model_width=8)


def _site(labels: list[int]) -> SiteArrays:
    y = np.array(labels, dtype=np.int64)
    return SiteArrays(np.zeros((len(y), 1, 64), dtype=np.float32), y)


def test_each_window_gets_its_own_sites_prior():
    parts = [_site([0, 0, 0, 1]), _site([2, 3, 3])]
    rows = site_prior_adjustment(parts, num_classes=4, tau=0.5)
    assert rows.shape == (7, 4)
    for i in range(4):
        torch.testing.assert_close(rows[i], prior_logit_adjustment([3, 1, 0, 0], 0.5))
    for i in range(4, 7):
        torch.testing.assert_close(rows[i], prior_logit_adjustment([0, 0, 1, 2], 0.5))


def test_bound_follows_the_sites_loss():
    """``logit-adjustment`` 0 trains plain cross-entropy on the pool; > 0 trains each window
    with its site's prior, and on label-skewed sites that is another model."""
    plain = train_centralized(replace(SMALL, logit_adjustment=0.0))
    adjusted = train_centralized(SMALL)
    assert len(plain["curve"]) == len(adjusted["curve"]) == SMALL.num_server_rounds
    assert plain["train_examples"] == sum(p.num_examples for p in site_training_data(SMALL))
    assert plain["curve"] != adjusted["curve"]


def test_bounds_in_parallel_are_the_one_thread_bound():
    """Two bounds side by side, one torch thread each: the same curves as training each
    here at one thread."""
    configs = [SMALL, replace(SMALL, seed=1)]
    parallel = list(train_centralized_many(configs, processes=2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = [train_centralized(c) for c in configs]
    finally:
        torch.set_num_threads(threads)
    assert [r["curve"] for r in parallel] == [r["curve"] for r in here]
    assert parallel[0]["curve"] != parallel[1]["curve"]
    assert list(train_centralized_many([])) == []
