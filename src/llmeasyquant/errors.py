"""Errors a user can act on: each message names the problem and the fix. The CLI prints them on one line."""


class LLMEasyQuantError(Exception):
    """Base class of every error the library raises on purpose."""


class ConfigError(LLMEasyQuantError, ValueError):
    """A method, scheme, bit width, group size or option that cannot be used."""


class DataError(LLMEasyQuantError, ValueError):
    """Text or weights that cannot be used: empty or too short text, NaN weights."""


class CheckpointError(LLMEasyQuantError):
    """A checkpoint that is missing, corrupt, or does not match its configuration."""


class ModelLoadError(LLMEasyQuantError):
    """A model that cannot be found or loaded."""


class OutputExistsError(LLMEasyQuantError, FileExistsError):
    """An output path that exists already and would be overwritten without --force."""
