from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_AUTOREGRESSIVE: _ClassVar[Mode]
    MODE_CHAIN: _ClassVar[Mode]
    MODE_TREE: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
MODE_AUTOREGRESSIVE: Mode
MODE_CHAIN: Mode
MODE_TREE: Mode

class ItemError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...
