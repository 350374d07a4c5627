"""The one training engine under every recipe (see ``omni_rl.engine.engine``)."""
