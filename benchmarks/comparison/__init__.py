"""The comparison benchmark: tierflow against device-only, cloud-only and single-split.

``python -m benchmarks.comparison`` runs :func:`benchmarks.comparison.run.main`; the
other modules are its parts (strategies, measurement, fidelity, the report's sections).
"""
