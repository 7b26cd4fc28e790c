from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

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
