"""Benchmarks that ship with the package, so `aieng bench` runs them from any install."""
