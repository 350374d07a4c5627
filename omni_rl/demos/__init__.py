"""Demos and quickstarts: short end-to-end runs that show the library working, apart
from the training methods in ``omni_rl.recipes`` (each with its config beside it)."""
