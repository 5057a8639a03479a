"""Multi-turn agents: the agent loops that drive an episode (``loops.py``) and the built-in tools their models
may call (``tools.py``: ``calculator``, ``python``)."""
