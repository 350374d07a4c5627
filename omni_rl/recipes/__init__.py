"""Training methods, one file each, read top to bottom."""
