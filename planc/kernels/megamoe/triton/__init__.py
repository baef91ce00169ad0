"""Triton and Gluon Mega MoE kernels for Hopper (and any GPU Triton runs on)."""
