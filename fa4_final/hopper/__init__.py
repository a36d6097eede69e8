"""Hopper (sm_90a) kernels: the forward, the backward and the decode forward, their configs, and
host.py (recipes and launches)."""
