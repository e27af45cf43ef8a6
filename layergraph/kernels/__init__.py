"""Triton kernels that speed options put in place of runs of small PyTorch kernels.

Each kernel lives in a module of its own that imports Triton; importing this package does
not, so layergraph imports where Triton is not installed.
"""
