"""One exception family for everything a user, a file or a request can trigger."""


class SdrtError(Exception):
    """Base class of every error sdrt raises on purpose."""


class OpError(SdrtError, ValueError):
    """An op was built or run with inputs it cannot take (shapes, dtypes, parameters)."""


class UnsupportedError(SdrtError):
    """A backend, dtype or feature that sdrt does not (yet) support was asked for."""


class ModelFileError(SdrtError):
    """A model file is missing, truncated, malformed or hostile."""


class UsageError(SdrtError):
    """A command-line flag or API argument is wrong."""


class DeviceOutOfMemoryError(SdrtError):
    """A device allocation did not fit (the message says how much was asked and what was free)."""
