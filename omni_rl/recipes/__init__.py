"""Training methods, one file each, read top to bottom, each with its root config
beside it (``grpo_config.py`` beside ``grpo.py``).

Every recipe is a row of the recipe table (``omni_rl.recipe_table``): its name, root
config and runner as import strings; ``omni_rl.recipe_loader`` resolves them for the
CLI. ``omni-rl train`` runs the trainable ones.
"""
