"""The plant benchmark's own measures (simulations/plant.py)."""

import numpy as np

import pytest

from simulations.plant import parse_targets, precision_from, round_swing, target_for


def test_new_class_precision_counts_every_diagnosis_of_the_new_classes():
    """Rows: true class; columns: diagnosis. Class 2 is new: 3 windows of it called 2, and
    1 of class 0 plus 2 of class 1 called 2 too, so 3 of 6 diagnoses of it are right."""
    confusion = np.array([[5, 0, 1], [0, 4, 2], [1, 0, 3]])
    assert precision_from(confusion, 2) == 0.5
    assert precision_from(confusion, 1) == 9 / 10  # classes 1 and 2 together: a 1 called 2 is within them
    assert precision_from(np.array([[5, 0], [3, 0]]), 1) is None  # never diagnosed: no precision


def test_round_swing_is_the_mean_change_between_rounds_before_the_last():
    """0.2 -> 0.5 -> 0.3 -> 0.6, then a calibrated last round that is left out: changes
    0.3, 0.2, 0.3."""
    assert round_swing([0.2, 0.5, 0.3, 0.6, 0.9]) == pytest.approx(0.8 / 3)
    assert round_swing([0.4, 0.4, 0.4]) == 0.0
    assert round_swing([0.5, 0.9]) is None  # one trained round: no change to measure


def test_the_target_is_fedavgs_when_it_ran_else_the_one_given():
    """90 % of FedAvg's mean final accuracy where FedAvg is among the runs; a recipe-only
    rerun takes the target given for its alpha (--target), so its rounds compare."""
    runs = {("FedAvg", 0.3): [{"final_accuracy": 0.5}, {"final_accuracy": 0.52}]}
    assert target_for(runs, 0.3, 0.9) == pytest.approx(0.459)
    assert target_for(runs, 0.1, 0.4) == 0.4
    assert parse_targets(["0.3=0.459", "0.1=0.400"]) == {0.3: 0.459, 0.1: 0.4}
    for bad in ("0.3", "0.3=high", "0.3=46"):
        with pytest.raises(SystemExit, match="ALPHA=ACCURACY"):
            parse_targets([bad])
