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


class ServerUnreachableError(OvernightError):
    """A server a command talks to (check, bench sweep) is down, wants an API key, or is not one whose
    answers the command can read."""


# What a command reports as one line (exit status 2) instead of a traceback: the user can fix each of
# these (a model path, an option, a URL or key), and a traceback would only hide the sentence that says how.
USER_ERRORS: tuple[type[OvernightError], ...] = (
    ModelLoadError,
    ConfigError,
    InvalidRequestError,
    ServerUnreachableError,
)
