"""The runtime: input checks, one prologue per call (checks, window, scale, backend), the
dispatch table, one compile path and its cache."""
