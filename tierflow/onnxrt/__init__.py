"""ONNX Runtime, opened in one place: inference sessions with the tiers' settings
(``inference``) and the execution providers they run on (``providers``).

Below the plan and the runtime, so that checking a plan's segment files and planning open
their models the way a tier does. "Session" elsewhere in tierflow means a caller's
session (its state on a tier, ``tierflow.state.store``), never an ONNX Runtime one.
"""
