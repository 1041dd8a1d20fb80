"""Top-k sparsified updates: selection, quantisation, error feedback, the wire codec, and the
uplink and downlink that carry them (client mods and their server-side decoders)."""
