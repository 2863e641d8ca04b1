"""Evaluation (quality metrics, reports) and speed benchmarks. Never imported by the runtime."""
