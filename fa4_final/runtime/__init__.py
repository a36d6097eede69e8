"""The runtime: input checks, one prologue per call (checks, window, scale, backend), the
dispatch table, one compile path and its cache; decoding's arguments (the split count, a paged
KV cache's checks) and the split combine's launch."""
