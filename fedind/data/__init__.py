"""Site data: the on-disk format, and a synthetic Non-IID federation of production lines."""

from .format import (
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

__all__ = [
    "DataFormatError",
    "SiteArrays",
    "infer_num_classes",
    "list_sites",
    "load_global_test",
    "load_meta",
    "load_site",
    "load_split",
    "validate_data_root",
    "write_meta",
    "write_split",
]
