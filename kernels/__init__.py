"""Triton kernels and their launchers (installed as kvbackend.kernels)."""
