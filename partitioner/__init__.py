"""Offline planning: graph analysis, cut points, profiling, cost model, search, splitting.

Needs the ``plan`` extra (onnx). Graph analysis, cost model and search are pure; profiling
(which measures) and splitting (which writes files) sit around them.
"""
