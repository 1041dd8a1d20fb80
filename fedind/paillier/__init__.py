"""Paillier-encrypted aggregation: keys, fixed-point slot packing, encrypted weighted sums,
and the site's client mod and decrypt handler."""
