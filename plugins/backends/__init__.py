"""rlx built-in plugins."""
