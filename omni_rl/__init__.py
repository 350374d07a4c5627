"""omni_rl: reinforcement learning for multimodal models."""

__version__ = "0.1.0"
