"""Hopper (sm_90a) kernels: the forward and the backward, their configs, and host.py (recipes
and launches)."""
