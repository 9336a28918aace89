"""Measurement helpers behind tools/analysis/ (FLOPs/params, benchmarks)."""
