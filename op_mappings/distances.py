"""Pairwise distances: cdist and pdist, forward and backward."""

from runtime.registry import aten, register_mapping  # noqa: F401
