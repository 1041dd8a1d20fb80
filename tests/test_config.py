"""Run config: pyproject defaults, parsing and validation."""

import tomllib
from pathlib import Path

import pytest

from fedind.config import RECIPE, ConfigError, RunConfig, recipe

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pyproject_config() -> dict:
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"]["config"]


def test_pyproject_declares_every_key_with_the_recipe_value():
    assert pyproject_config() == recipe().to_flower()


def test_the_recipe_only_changes_keys_that_exist():
    plain = RunConfig().to_flower()
    assert {k.replace("_", "-") for k in RECIPE} <= set(plain)
    assert all(recipe().to_flower()[k.replace("_", "-")] != plain[k.replace("_", "-")] for k in RECIPE)


def test_round_trip_through_flower_keys():
    config = RunConfig(strategy="dwa", num_sites=4, dirichlet_alpha=0.1)
    assert RunConfig.from_flower(config.to_flower()) == config


@pytest.mark.parametrize(
    "key, value",
    [
        ("num-server-rounds", 0),
        ("learning-rate", -0.1),
        ("strategy", "fedsgd"),
        ("fraction-train", 1.5),
        ("dirichlet-alpha", 0.0),
        ("dirichlet-alpha", float("inf")),
        ("model-width", 10),
        ("server-momentum", 1.0),
        ("dwa-momentum", 1.0),
        ("dwa-momentum", -0.1),
        ("device", "tpu"),
        ("conflict-threshold", 2.0),
        ("topk-gain", 0.0),
        ("topk-gain", float("nan")),
        ("norm-clip", 0.5),
        ("norm-clip", float("inf")),
    ],
)
def test_invalid_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        RunConfig.from_flower({key: value})


def test_norm_clip_reaches_the_screen_and_zero_turns_it_off():
    assert RunConfig(norm_clip=1.5).screen_rules["clip_ratio"] == 1.5
    assert RunConfig(norm_clip=0.0).screen_rules["clip_ratio"] is None


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigError, match="num-rounds"):
        RunConfig.from_flower({"num-rounds": 3})


def test_types_are_checked_not_cast():
    assert RunConfig.from_flower({"learning-rate": 1}).learning_rate == 1.0
    for key, value in [("num-sites", True), ("num-sites", "10"), ("dwa-weighting", 1), ("data-root", 3)]:
        with pytest.raises(ConfigError, match=key):
            RunConfig.from_flower({key: value})
