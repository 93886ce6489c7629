"""Benchmark task generation and scoring."""
