"""Exceptions users see. Each names the problem in words a user can act on."""


class OvernightError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(OvernightError):
    """The model could not be found, read or understood (path, format, architecture, weights)."""


class ConfigError(OvernightError, ValueError):
    """The engine's options cannot work together on this machine (memory, lengths, limits)."""


class InvalidRequestError(OvernightError, ValueError):
    """One request is invalid (empty prompt, too long, bad sampling values); the engine keeps serving."""


class EngineDeadError(OvernightError):
    """The engine hit an internal failure and cannot serve any more requests."""
