"""Simulation environments for robot-policy RL (imported as ``omni_rl.sim``)."""
