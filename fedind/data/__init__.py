"""Site data: the on-disk format, and a synthetic Non-IID federation of production lines."""

from .format import (
    DataFormatError,
    SiteArrays,
    batch_dir,
    infer_num_classes,
    list_sites,
    load_batch,
    load_global_test,
    load_meta,
    load_phase_test,
    load_site,
    load_split,
    phase_name,
    validate_data_root,
    validate_phases,
    write_meta,
    write_split,
)

__all__ = [
    "DataFormatError",
    "SiteArrays",
    "batch_dir",
    "infer_num_classes",
    "list_sites",
    "load_batch",
    "load_global_test",
    "load_meta",
    "load_phase_test",
    "load_site",
    "load_split",
    "phase_name",
    "validate_data_root",
    "validate_phases",
    "write_meta",
    "write_split",
]
