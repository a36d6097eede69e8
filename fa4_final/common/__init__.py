"""The device code both architectures share: numbers, tiles and masks, the online softmax,
the schedule, roles and pipelines, the backward pieces (pre, post, tiles, dQ order), the
split-KV combine and the decode kernel's index arithmetic (decode_index)."""
