"""The device code both architectures share: numbers, tiles and masks, the online softmax,
the schedule, roles and pipelines, the backward pieces (pre, post, tiles, dQ order) and the
split-KV combine."""
