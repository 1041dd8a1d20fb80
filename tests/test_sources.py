"""Where a site agent finds its data: simulated partitions and deployment folders."""

import numpy as np
import pytest

from fedind.data.federation import FederationSpec, make_site, write_federation
from fedind.data.format import DataFormatError
from fedind.data.sources import site_from_dir, site_from_partition

SPEC = FederationSpec(num_sites=3, alpha=0.5, samples_per_site=40, seed=3)


@pytest.fixture(scope="module")
def plant(tmp_path_factory):
    return write_federation(SPEC, tmp_path_factory.mktemp("plant"))


def test_data_dir_is_one_site_folder(plant):
    site = site_from_dir.__wrapped__(str(plant / "sites" / "line-01"))
    train, test = make_site(SPEC, 1)
    assert site.site_id == "line-01"
    np.testing.assert_array_equal(site.train.x, train.x)
    np.testing.assert_array_equal(site.test.y, test.y)


def test_data_dir_without_test_split_and_with_explicit_site_id(plant, tmp_path):
    folder = tmp_path / "press-2"
    folder.mkdir()
    (folder / "train.npz").write_bytes((plant / "sites" / "line-00" / "train.npz").read_bytes())
    site = site_from_dir.__wrapped__(str(folder), "press-2")
    assert site.site_id == "press-2" and site.test is None


def test_missing_data_dir_names_the_path(tmp_path):
    with pytest.raises(DataFormatError, match="nowhere"):
        site_from_dir.__wrapped__(str(tmp_path / "nowhere"))


def test_partition_i_is_the_ith_sorted_site_of_data_root(plant):
    site = site_from_partition.__wrapped__(None, str(plant), 2, 3)
    assert site.site_id == "line-02"
    np.testing.assert_array_equal(site.train.y, make_site(SPEC, 2)[0].y)


def test_supernode_count_mismatch_says_which_number_to_use(plant):
    with pytest.raises(DataFormatError, match="num-supernodes=3"):
        site_from_partition.__wrapped__(None, str(plant), 0, 10)
    with pytest.raises(DataFormatError, match="num-supernodes=3"):
        site_from_partition.__wrapped__(SPEC, "", 0, 2)
