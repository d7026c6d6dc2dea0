"""The two ways a run ends badly, each with its exit code (see SPEC.md)."""


class ConfigError(ValueError):
    """Wrong input (config, path, credentials, dataset): exit 2, before any worker starts.

    The message is one line that names the key and what is allowed.
    """

    exit_code = 2


class TrainingFailed(RuntimeError):
    """Training failed after its restarts were used up: exit 1."""

    exit_code = 1
