"""Aggregation maths: DWA weights, conflict detection, momentum buffer, centered clipping,
and the running average of the served model (which the sites keep too).

Pure numpy, no Flower or torch: the strategy (:mod:`fedind.server.dwa`) composes these
functions and only moves records around. Every rule is stated as a formula in its
docstring and tested against a numeric oracle in ``tests/test_aggregation.py``.

Round, server side::

    hist.update(site, label_histogram)            # for every replying site   (weighting)
    w = dwa_weights(n, histograms, hist.distribution(), temperature, floor)
    delta = conflict_aware_aggregate(deltas, w, buffer, threshold)          # (conflicts)
    global_arrays = {k: global_arrays[k] + delta[k] for k in delta}
"""
