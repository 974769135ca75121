"""Demos: ``tierflow demo`` (``local``), the three tiers on this machine.

The demo sits above every tier: it plans with the partitioner, starts the edge and the
cloud as processes and runs the device in its own process, so it lives here rather than
in the core (``tierflow/``) that the tiers import.
"""
