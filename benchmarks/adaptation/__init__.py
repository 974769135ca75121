"""The live adaptation benchmark (``python -m benchmarks.adaptation``) and its pure parts."""
