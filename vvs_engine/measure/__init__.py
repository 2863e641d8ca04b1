"""Measurement of the decode rounds: launches, op counts, profiler ranges (nothing here decodes)."""
