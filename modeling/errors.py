"""Engine errors; servicers map them to gRPC status codes."""


class InvalidRequest(ValueError):
    """Bad input (→ INVALID_ARGUMENT). The message names the field and the limit."""


class ResourceExhausted(RuntimeError):
    """Does not fit the configured capacity (→ RESOURCE_EXHAUSTED)."""


class UnknownRequest(KeyError):
    """No state for this request id (→ NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class FailedPrecondition(RuntimeError):
    """The request's state does not allow this call (→ FAILED_PRECONDITION)."""
