"""The site agent: a Flower ClientApp that trains the global model on one line's data.

Hyperparameters come from the run config the server sends with each message, so the
agent behaves the same under ``flwr run``, ``run_simulation`` and a deployed SuperNode.
Where the data is comes from the node config: ``data-dir`` (deployment, one site's folder)
or ``partition-id`` / ``num-partitions`` (simulation).
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from . import wire
from .config import RunConfig
from .data.format import DataFormatError
from .data.sources import SiteData, site_from_dir, site_from_partition
from .models import FaultCNN
from .training import cosine_lr, evaluate, pick_device, prior_logit_adjustment, train_local
from .site_state import state_mod
from .secure import decrypt_query, paillier_mod
from .transport import topk_mod

# state_mod first (outermost): it saves context.state after the inner mods wrote to it.
app = ClientApp(mods=[state_mod, topk_mod, paillier_mod])
app.query()(decrypt_query)  # encryption = "paillier": decrypt the round's summed ciphertexts


def run_config_of(msg: Message) -> RunConfig:
    return RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))


def load_site_data(context: Context, config: RunConfig) -> SiteData:
    node = context.node_config
    if "data-dir" in node:
        return site_from_dir(str(node["data-dir"]), str(node.get("site-id", "")))
    spec = None if config.data_root else config.federation_spec()
    return site_from_partition(spec, config.data_root, int(node["partition-id"]), int(node["num-partitions"]))


def receive_model(msg: Message, site: SiteData) -> FaultCNN:
    model = FaultCNN.from_state_dict(msg.content[wire.ARRAYS].to_torch_state_dict())
    num_classes = model.head.out_features
    for split in (site.train, site.test):
        if split is not None and split.y.max() >= num_classes:
            raise DataFormatError(
                f"site {site.site_id}: label {int(split.y.max())} but the global model has "
                f"{num_classes} classes"
            )
    return model


def _state(model: torch.nn.Module) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})


def _site_seed(config: RunConfig, site_id: str, server_round: int) -> int:
    return (config.seed * 1_000_003 + zlib.crc32(site_id.encode()) * 101 + server_round) % 2**31


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = run_config_of(msg)
    server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
    site = load_site_data(context, config)
    device = pick_device(config.device)
    model = receive_model(msg, site)
    # Score the global model on local data first: the site's view of the federation.
    before = evaluate(model, site.test if site.test is not None else site.train, device)
    seed = _site_seed(config, site.site_id, server_round)
    torch.manual_seed(seed)
    histogram = np.bincount(site.train.y, minlength=model.head.out_features)
    adjustment = prior_logit_adjustment(histogram, config.logit_adjustment) if config.logit_adjustment else None
    started = time.process_time()
    result = train_local(
        model,
        site.train,
        epochs=config.local_epochs,
        batch_size=config.batch_size,
        lr=cosine_lr(config.learning_rate, (server_round - 1) / config.num_server_rounds),
        seed=seed,
        device=device,
        proximal_mu=float(msg.content[wire.CONFIG].get("proximal-mu", 0.0)),
        momentum=config.local_momentum,
        logit_adjustment=adjustment,
    )
    metrics = MetricRecord(
        {
            wire.NUM_EXAMPLES: site.train.num_examples,
            wire.TRAIN_LOSS: result.loss,
            wire.LABEL_HISTOGRAM: [int(c) for c in histogram],
            wire.LOCAL_ACCURACY: before.accuracy,
            wire.LOCAL_LOSS: before.loss,
            wire.TRAIN_SECONDS: time.process_time() - started,
        }
    )
    content = RecordDict(
        {wire.ARRAYS: _state(model), wire.METRICS: metrics, wire.SITE: ConfigRecord({wire.SITE_ID: site.site_id})}
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_global(msg: Message, context: Context) -> Message:
    config = run_config_of(msg)
    site = load_site_data(context, config)
    model = receive_model(msg, site)
    result = evaluate(model, site.test if site.test is not None else site.train, pick_device(config.device))
    metrics = MetricRecord(
        {wire.NUM_EXAMPLES: result.num_examples, "accuracy": result.accuracy, "loss": result.loss}
    )
    content = RecordDict({wire.METRICS: metrics, wire.SITE: ConfigRecord({wire.SITE_ID: site.site_id})})
    return Message(content=content, reply_to=msg)
