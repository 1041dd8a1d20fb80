"""One pass per reply (fedind.server.pipeline): every train reply is decoded exactly once.

The decode is :func:`fedind.server.pipeline.decode_reply` (and, under it, the top-k payload
decode of :mod:`fedind.topk.uplink`); these tests count both across short loopback runs of
the recipe (top-k both ways, DWA, two phases) and of a dense Flower built-in, and fail if a
second decode of a reply creeps in anywhere (screen, strategy, phase controller)."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace

import pytest

import fedind.server.pipeline as pipeline
import fedind.topk.uplink as uplink
from fedind.config import RunConfig, recipe
from fedind.simulation import simulate

SMALL = dict(num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, model_width=16, device="cpu", seed=0)


def counting(monkeypatch) -> tuple[Counter, Counter]:
    """Count decode_reply (wherever a fedind module imported it) and the top-k payload
    decode, per train reply as it arrived."""
    decodes, payloads = Counter(), Counter()
    decode_reply, sent_change = pipeline.decode_reply, uplink._sent_change
    seen = []  # every reply decoded, kept alive so that its id stays its own

    def key(reply) -> int:
        seen.append(reply)
        return id(reply)

    def counted_decode(instruction, reply, sent, **kwargs):
        decodes[key(reply)] += 1
        return decode_reply(instruction, reply, sent, **kwargs)

    def counted_payload(instruction, reply, schedule):
        payloads[key(reply)] += 1
        return sent_change(instruction, reply, schedule)

    for name, module in list(sys.modules.items()):
        if name.startswith("fedind") and getattr(module, "decode_reply", None) is decode_reply:
            monkeypatch.setattr(module, "decode_reply", counted_decode)
    monkeypatch.setattr(uplink, "_sent_change", counted_payload)
    return decodes, payloads


@pytest.mark.parametrize(
    "name, config",
    [
        ("recipe", recipe(**SMALL, num_server_rounds=3, phase_rounds=2)),
        ("fedavgm", RunConfig(strategy="fedavgm", num_server_rounds=2, **SMALL)),
    ],
)
def test_every_train_reply_is_decoded_exactly_once(name, config, tmp_path, monkeypatch):
    decodes, payloads = counting(monkeypatch)
    summary = simulate(replace(config, run_dir=str(tmp_path), run_name=name), runtime="loopback")
    replies = config.num_server_rounds * config.num_sites
    assert len(summary["model_sha256"]) == 64
    assert len(decodes) == replies and set(decodes.values()) == {1}, decodes
    if config.compression == "topk":
        assert len(payloads) == replies and set(payloads.values()) == {1}, payloads
    else:
        assert not payloads
