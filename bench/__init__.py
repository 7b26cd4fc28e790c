"""Benchmarks: scripts that print a table and write results under bench/results/."""
