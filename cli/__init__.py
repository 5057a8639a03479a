"""The rlx command-line interface."""
