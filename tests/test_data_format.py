"""Site data format: round trips, and one clear DataFormatError per fault."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedind.data.format import (
    DataFormatError,
    SiteArrays,
    infer_num_classes,
    list_sites,
    load_global_test,
    load_meta,
    load_site,
    load_split,
    validate_data_root,
    write_meta,
    write_split,
)

K = 3  # classes in the helper data


def make_arrays(n: int = 6, channels: int = 2, length: int = 16, seed: int = 0) -> SiteArrays:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, channels, length)).astype(np.float32)
    y = (np.arange(n) % K).astype(np.int64)
    return SiteArrays(x=x, y=y)


def make_root(tmp_path: Path, shapes: dict[str, tuple[int, int]] | None = None) -> Path:
    """A valid DATA_ROOT with one train.npz per site (site id -> (C, L))."""
    root = tmp_path / "data"
    shapes = shapes or {"a": (2, 16), "b": (2, 16)}
    for i, (site, (channels, length)) in enumerate(shapes.items()):
        arrays = make_arrays(4 + i, channels, length, seed=i)
        write_split(root / "sites" / site / "train.npz", arrays)
    return root


def assert_fault(exc_info: pytest.ExceptionInfo, path: Path, *phrases: str) -> None:
    message = str(exc_info.value)
    assert str(path) in message
    for phrase in phrases:
        assert phrase in message


# --------------------------------------------------------------------------- load / write split


def test_round_trip_keeps_values_and_dtypes(tmp_path):
    path = tmp_path / "new" / "dir" / "train.npz"
    arrays = make_arrays()
    write_split(path, arrays)
    loaded = load_split(path, num_classes=K, sample_shape=(2, 16))
    assert loaded.x.dtype == np.float32 and loaded.y.dtype == np.int64
    np.testing.assert_array_equal(loaded.x, arrays.x)
    np.testing.assert_array_equal(loaded.y, arrays.y)
    assert loaded.num_examples == 6
    assert loaded.sample_shape == (2, 16)
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.npz"]  # no temp file left


def test_write_split_replaces_existing_file(tmp_path):
    path = tmp_path / "train.npz"
    write_split(path, make_arrays(n=4))
    write_split(path, make_arrays(n=9))
    assert load_split(path).num_examples == 9


def test_missing_file(tmp_path):
    path = tmp_path / "nope.npz"
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path)
    assert_fault(exc_info, path, "file not found")


def _good_x(n: int = 4) -> np.ndarray:
    return np.zeros((n, 2, 8), dtype=np.float32)


def _good_y(n: int = 4) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


def _labels(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _x_with_non_finite() -> np.ndarray:
    x = _good_x()
    x[0, 0, :2] = np.nan
    x[3, 1, 5] = -np.inf
    return x


BAD_CONTENT = {
    "x float64": (_good_x().astype(float), _good_y(), {}, "x has dtype float64, expected float32"),
    "x big-endian": (_good_x().astype(">f4"), _good_y(), {}, "x has dtype >f4, expected float32"),
    "y int32": (_good_x(), _good_y().astype(np.int32), {}, "y has dtype int32, expected int64"),
    "y float": (_good_x(), _good_y().astype(np.float32), {}, "y has dtype float32, expected int64"),
    "x 2-D": (np.zeros((4, 8), np.float32), _good_y(), {}, "(2-D), expected 3-D [N, C, L]"),
    "y 2-D": (_good_x(), np.zeros((4, 1), np.int64), {}, "(2-D), expected 1-D [N]"),
    "length mismatch": (_good_x(4), _good_y(5), {}, "x has 4 examples, y has 5 labels"),
    "empty": (_good_x(0), _good_y(0), {}, "x is empty"),
    "zero length": (np.zeros((4, 2, 0), np.float32), _good_y(), {}, "x is empty"),
    "nan/inf": (_x_with_non_finite(), _good_y(), {}, "x contains 3 NaN or Inf"),
    "negative label": (_good_x(), _labels(0, 1, -1, 0), {}, "y[2] = -1; expected labels >= 0"),
    "label >= K": (_good_x(), _labels(0, 5, 3, 1), {"num_classes": K}, "2 label(s) out of range"),
    "sample shape": (_good_x(), _good_y(), {"sample_shape": (3, 8)}, "[2, 8], expected [3, 8]"),
}


@pytest.mark.parametrize("x, y, kwargs, phrase", BAD_CONTENT.values(), ids=BAD_CONTENT.keys())
def test_load_split_refuses_bad_content(tmp_path, x, y, kwargs, phrase):
    path = tmp_path / "sites" / "line-03" / "train.npz"
    path.parent.mkdir(parents=True)
    np.savez(path, x=x, y=y)
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path, **kwargs)
    assert_fault(exc_info, path, phrase)


def test_label_range_message_names_valid_range(tmp_path):
    path = tmp_path / "train.npz"
    np.savez(path, x=_good_x(), y=_labels(0, 1, 2, 3))
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path, num_classes=K)
    assert_fault(exc_info, path, "y[3] = 3", "expected labels in [0, 3)")


@pytest.mark.parametrize(
    "x, y, phrase",
    [
        (_good_x().astype(np.float64), _good_y(), "x has dtype float64"),
        (_x_with_non_finite(), _good_y(), "NaN or Inf"),
        (_good_x(), _good_y(3), "length mismatch"),
        (_good_x().tolist(), _good_y(), "x is list, expected a numpy array"),
    ],
)
def test_write_split_refuses_bad_arrays_and_writes_nothing(tmp_path, x, y, phrase):
    path = tmp_path / "site" / "train.npz"
    with pytest.raises(DataFormatError) as exc_info:
        write_split(path, SiteArrays(x=x, y=y))
    assert_fault(exc_info, path, phrase)
    assert not path.exists()


@pytest.mark.parametrize(
    "arrays, phrase",
    [
        ({"x": _good_x()}, "missing key(s) y; found keys ['x']"),
        (
            {"feats": _good_x(), "labels": _good_y()},
            "missing key(s) x, y; found keys ['feats', 'labels']",
        ),
    ],
)
def test_missing_keys_are_named(tmp_path, arrays, phrase):
    path = tmp_path / "train.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path)
    assert_fault(exc_info, path, phrase)


TRIPPED: list[str] = []


def _trip() -> str:
    TRIPPED.append("unpickled")
    return "boom"


class Tripwire:
    """Unpickling this object records it, so the test can prove nothing was unpickled."""

    def __reduce__(self):
        return (_trip, ())


@pytest.mark.parametrize("key", ["x", "y"])
def test_pickled_object_array_is_refused_without_unpickling(tmp_path, key):
    path = tmp_path / "train.npz"
    arrays = {"x": _good_x(), "y": _good_y()}
    arrays[key] = np.array([Tripwire()] * 4, dtype=object)
    np.savez(path, **arrays)
    TRIPPED.clear()
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path)
    assert_fault(exc_info, path, f"{key} is a pickled object array", "allow_pickle=False")
    assert TRIPPED == []


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_middle_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 3  # inside x's raw data (savez stores members uncompressed)
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def _garbage(path: Path) -> None:
    path.write_bytes(b"this is not an npz archive at all")


def _empty_file(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize(
    "damage, phrase",
    [
        (_truncate, "not a valid .npz archive"),
        (_garbage, "not a valid .npz archive"),
        (_empty_file, "not a valid .npz archive"),
        (_flip_middle_bytes, "cannot read x, archive corrupt or truncated"),
    ],
)
def test_corrupt_archive(tmp_path, damage, phrase):
    path = tmp_path / "train.npz"
    write_split(path, make_arrays(n=64, length=64))
    damage(path)
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path)
    assert_fault(exc_info, path, phrase)


def test_npy_instead_of_npz(tmp_path):
    path = tmp_path / "train.npz"
    with open(path, "wb") as f:
        np.save(f, _good_x())
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path)
    assert_fault(exc_info, path, "single .npy array")


def test_directory_instead_of_file(tmp_path):
    path = tmp_path / "train.npz"
    path.mkdir()
    with pytest.raises(DataFormatError) as exc_info:
        load_split(path)
    assert_fault(exc_info, path, "is a directory")


# --------------------------------------------------------------------------- meta.json


def test_meta_absent_is_empty(tmp_path):
    assert load_meta(tmp_path) == {}


def test_meta_round_trip(tmp_path):
    meta = {"num_classes": 3, "class_names": ["ok", "bearing", "gear"], "sensor": "accel"}
    write_meta(tmp_path / "new", meta)
    assert load_meta(tmp_path / "new") == meta
    assert json.loads((tmp_path / "new" / "meta.json").read_text()) == meta


BAD_META = {
    "invalid json": ('{"num_classes": 3', "invalid JSON"),
    "not utf-8": (b"\xff\xfe{}", "invalid JSON"),
    "not an object": ("[3]", "expected a JSON object, got list"),
    "num_classes zero": ('{"num_classes": 0}', "num_classes must be a positive int, got 0"),
    "num_classes str": ('{"num_classes": "3"}', "num_classes must be a positive int, got '3'"),
    "num_classes float": ('{"num_classes": 3.0}', "num_classes must be a positive int, got 3.0"),
    "num_classes bool": ('{"num_classes": true}', "num_classes must be a positive int, got True"),
    "class_names str": ('{"class_names": "ok"}', "class_names must be a list of str"),
    "class_names ints": ('{"class_names": [0, 1]}', "class_names must be a list of str"),
    "class_names length": (
        '{"num_classes": 3, "class_names": ["a", "b"]}',
        "class_names has 2 names, expected num_classes = 3",
    ),
}


@pytest.mark.parametrize("content, phrase", BAD_META.values(), ids=BAD_META.keys())
def test_bad_meta(tmp_path, content, phrase):
    path = tmp_path / "meta.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataFormatError) as exc_info:
        load_meta(tmp_path)
    assert_fault(exc_info, path, phrase)


@pytest.mark.parametrize(
    "meta, phrase",
    [
        ({"num_classes": -1}, "num_classes must be a positive int"),
        ({"num_classes": 3, "extra": float("nan")}, "not JSON-serialisable"),
        ({"num_classes": 3, "extra": object()}, "not JSON-serialisable"),
    ],
)
def test_write_meta_refuses_bad_meta(tmp_path, meta, phrase):
    with pytest.raises(DataFormatError) as exc_info:
        write_meta(tmp_path, meta)
    assert_fault(exc_info, tmp_path / "meta.json", phrase)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- data root


def test_list_sites_sorted_ignoring_hidden_entries_and_files(tmp_path):
    root = make_root(tmp_path, {"line-10": (2, 16), "line-02": (2, 16), "line-01": (2, 16)})
    (root / "sites" / ".cache").mkdir()
    (root / "sites" / "README.txt").write_text("notes")
    assert list_sites(root) == ["line-01", "line-02", "line-10"]


def test_site_without_train_is_an_error(tmp_path):
    root = make_root(tmp_path)
    half_copied = root / "sites" / "c"
    half_copied.mkdir()
    write_split(half_copied / "test.npz", make_arrays())
    with pytest.raises(DataFormatError) as exc_info:
        list_sites(root)
    assert_fault(exc_info, half_copied, "has no train.npz")
    with pytest.raises(DataFormatError, match="has no train.npz"):
        validate_data_root(root)


@pytest.mark.parametrize(
    "prepare, where, phrase",
    [
        (lambda root: None, "", "data root directory not found"),
        (lambda root: root.mkdir(), "sites", "directory not found"),
        (lambda root: (root / "sites").mkdir(parents=True), "sites", "no site directories"),
    ],
    ids=["no root", "no sites dir", "no site"],
)
def test_list_sites_structure_errors(tmp_path, prepare, where, phrase):
    root = tmp_path / "data"
    prepare(root)
    with pytest.raises(DataFormatError) as exc_info:
        list_sites(root)
    assert_fault(exc_info, root / where if where else root, phrase)


def test_load_site_with_and_without_test(tmp_path):
    root = make_root(tmp_path)
    write_split(root / "sites" / "b" / "test.npz", make_arrays(n=3))
    train, test = load_site(root, "a", num_classes=K)
    assert train.num_examples == 4 and test is None
    train, test = load_site(root, "b", num_classes=K, sample_shape=(2, 16))
    assert train.num_examples == 5 and test.num_examples == 3


def test_load_site_test_must_match_train_shape(tmp_path):
    root = make_root(tmp_path)
    path = root / "sites" / "a" / "test.npz"
    write_split(path, make_arrays(length=32))
    with pytest.raises(DataFormatError) as exc_info:
        load_site(root, "a")
    assert_fault(exc_info, path, "[C, L] is [2, 32], expected [2, 16]")


@pytest.mark.parametrize("site_id", ["missing", "../data", "", ".."])
def test_load_site_unknown_or_invalid_id(tmp_path, site_id):
    root = make_root(tmp_path)
    with pytest.raises(DataFormatError, match="file not found|invalid site id"):
        load_site(root, site_id)


def test_load_global_test(tmp_path):
    root = make_root(tmp_path)
    assert load_global_test(root) is None
    write_split(root / "test.npz", make_arrays(n=7))
    assert load_global_test(root, num_classes=K, sample_shape=(2, 16)).num_examples == 7


def test_infer_num_classes_from_meta_or_labels(tmp_path):
    root = make_root(tmp_path)
    assert infer_num_classes(root) == K
    arrays = make_arrays(n=2)
    write_split(root / "test.npz", SiteArrays(x=arrays.x, y=_labels(0, 6)))
    assert infer_num_classes(root) == 7
    write_meta(root, {"num_classes": 10})
    assert infer_num_classes(root) == 10


def test_validate_data_root_summary(tmp_path):
    root = make_root(tmp_path)
    write_split(root / "sites" / "a" / "test.npz", make_arrays(n=2))
    write_split(root / "test.npz", make_arrays(n=3))
    write_meta(root, {"num_classes": 5})
    assert validate_data_root(root) == {
        "sites": ["a", "b"],
        "num_classes": 5,
        "sample_shape": [2, 16],
        "num_train": {"a": 4, "b": 5},
        "has_global_test": True,
        "num_classes_from": "meta.json",
        "absent_labels": [3, 4],  # K = 3 labels in the data, 5 declared
    }


def test_validate_data_root_inconsistent_sample_shapes(tmp_path):
    root = make_root(tmp_path, {"a": (2, 16), "b": (3, 16)})
    with pytest.raises(DataFormatError) as exc_info:
        validate_data_root(root)
    assert_fault(exc_info, root / "sites/b/train.npz", "[C, L] is [3, 16], expected [2, 16]")


def test_validate_data_root_global_test_shape(tmp_path):
    root = make_root(tmp_path)
    path = root / "test.npz"
    write_split(path, make_arrays(length=8))
    with pytest.raises(DataFormatError) as exc_info:
        validate_data_root(root)
    assert_fault(exc_info, path, "sample shape")


def test_validate_data_root_labels_beyond_meta_num_classes(tmp_path):
    root = make_root(tmp_path)
    write_meta(root, {"num_classes": 2})  # the helper data uses labels 0..2
    with pytest.raises(DataFormatError) as exc_info:
        validate_data_root(root)
    assert_fault(exc_info, root / "sites/a/train.npz", "y[2] = 2", "expected labels in [0, 2)")


def test_validate_data_root_bad_meta(tmp_path):
    root = make_root(tmp_path)
    (root / "meta.json").write_text("{nope")
    with pytest.raises(DataFormatError) as exc_info:
        validate_data_root(root)
    assert_fault(exc_info, root / "meta.json", "invalid JSON")
