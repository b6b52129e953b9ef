"""Benchmarks: kernel speed, ring balance, ring communication model."""
