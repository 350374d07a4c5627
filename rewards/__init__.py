"""Task-routed verifiable rewards (imported as ``omni_rl.rewards``)."""
