"""Hopper (sm_90a) kernels: the forward (chapter 08) and the backward (chapter 11)."""
