"""The exception tree of fairlimit; imports nothing.

::

    FairlimitError
    ├── ConfigError            a descriptor file or rule is unusable (FILE: PATH: message)
    │   ├── ConfigUnreadable   a path is missing, unreadable or not YAML at all
    │   ├── ConfigWarningError a warning promoted to an error by --strict
    │   └── ScenarioError      a simulate scenario is unusable or fits none of its configs
    ├── RequestError           a ShouldRateLimit request is malformed (INVALID_ARGUMENT)
    ├── ReservationOpen        a reservation's request id holds an open one (OVER_LIMIT)
    ├── StoreUnavailable       the backend cannot answer now (failure mode decides)
    │   ├── DeadlineExceeded   the caller's deadline leaves the backend no time (shed)
    │   └── GivenUp            a call's wait on the backend was given up (call budget full)
    ├── UnsupportedBackend     a backend URL the store cannot use (scheme, host, options)
    └── SettingsError          a flag or environment variable is unusable
"""


class FairlimitError(Exception):
    """Base of every error fairlimit raises on purpose."""


class ConfigError(FairlimitError):
    """A descriptor configuration is unusable; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ConfigUnreadable(ConfigError):
    """A config path cannot be read or parsed at all (``check`` exits 2)."""


class ConfigWarningError(ConfigError):
    """A classification warning that ``--strict`` turns into a load error."""


class ScenarioError(ConfigError):
    """A traffic scenario cannot be run (``simulate`` exits 2); lines as ``FILE: PATH: message``.

    Under ConfigError because it is reported the same way, one line per problem, and a run
    can fail on either the scenario or one of its configs.
    """


class RequestError(FairlimitError):
    """The request cannot be answered as asked (maps to INVALID_ARGUMENT)."""


class ReservationOpen(FairlimitError):
    """A request reserves by a request id whose earlier reservation is still open: the store
    charged and kept nothing (the limiter answers OVER_LIMIT; core/reserve.py)."""


class StoreUnavailable(FairlimitError):
    """The backend did not answer; the failure mode decides what the caller sees."""


class DeadlineExceeded(StoreUnavailable):
    """The caller's deadline leaves too little time to ask the backend: the call is shed
    (answered by the failure mode, counted apart from backend errors)."""


class GivenUp(StoreUnavailable):
    """A call's wait on the backend was given up before its answer (store/waits.py): the
    failure mode answers it, as if the backend had failed."""


class UnsupportedBackend(FairlimitError):
    """A backend URL names no store, or one the store cannot open as written."""


class SettingsError(FairlimitError):
    """A command-line flag or FAIRLIMIT_* variable has an unusable value."""
