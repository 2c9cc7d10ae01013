"""Errors a user can act on.

Every error raised because of user input (a flag, a config file, a dataset row, a media file)
is an `MMGRPOError`: the CLI prints its message on one line and exits with status 2, with no
stack trace. The message names the file, row, field or flag and says what to do.
"""


class MMGRPOError(Exception):
    """Base class of user-facing errors."""


class ConfigError(MMGRPOError):
    """A flag, config file or registry entry is wrong."""


class DataError(MMGRPOError):
    """A dataset row, column or media file is wrong."""


class RewardError(MMGRPOError):
    """A reward function raised or returned something unusable."""


class CheckpointError(MMGRPOError):
    """A checkpoint or model folder is incomplete, truncated or corrupt, or cannot be written."""
