"""Errors a user can cause and fix: the CLI prints them on one line and exits 2."""


class OmniRLError(Exception):
    """A problem with the user's input (config, data, paths), not a bug in omni_rl."""


class ConfigError(OmniRLError):
    """A config file or override that does not match the schema."""
