"""User-facing errors: each names the problem and the fix, and the CLI prints them as one line."""


class AgentevoError(Exception):
    """An error caused by user input or the machine set-up, with a message that says how to fix it."""


class ConfigError(AgentevoError):
    """A configuration key or value that is not allowed."""


class MissingDependencyError(AgentevoError):
    """An optional package (environment extra, Java, a model file) is not installed."""


class EnvCrashedError(AgentevoError):
    """An environment process died mid-episode; the worker pool restarts it and retries the episode."""
