"""Links between tiers: their names and figures, their emulation, and recorded traces.

``spec`` names the tiers and links and holds :class:`~tierflow.link.spec.LinkSpec` (rate,
RTT); ``emulation`` shapes a link in process (``--link-emulation``); ``trace`` reads and
writes rate traces (``SECONDS,RATE,RTT`` lines).
"""
