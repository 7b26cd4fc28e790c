"""Engine errors (defined in ``protocol.types``); ``protocol.wire`` maps them to gRPC status codes."""
from protocol.types import FailedPrecondition, InvalidRequest, ResourceExhausted, UnknownRequest  # noqa: F401
