"""A caller's session state: what a plan says about it (``spec``: state pairs and
decoders), finding the pairs in a model's graph (``pairs``), and what a tier keeps of it,
per (owner, session), in bounded memory (``store``).

Below the plan (which carries a :class:`~tierflow.state.spec.StateSpec` per segment) and
the runtime (whose pipeline keeps a tier's :class:`~tierflow.state.store.SessionStates`).
"""
