"""Torch code shared by the training backends, the rollout engines and the reward model (LoRA, ...).

Not a plugin kind: a library the plugins import, so that no backend imports another backend and no engine
imports a backend."""
