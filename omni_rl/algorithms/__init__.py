"""Pure RL math over tensors: advantages, policy losses, KL, entropy, sampling filters.

Every function documents its tensor shapes; recipes only coordinate them.
"""
