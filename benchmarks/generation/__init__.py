"""The generation benchmark (``python -m benchmarks.generation``) and its pure parts."""
