"""Triton kernels, each with a torch reference and a test comparing them (later issues)."""
