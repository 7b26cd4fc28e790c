from specdec_proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TreeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TREE_MODE_UNSPECIFIED: _ClassVar[TreeMode]
    TREE_MODE_CHAIN: _ClassVar[TreeMode]
    TREE_MODE_TREE: _ClassVar[TreeMode]
TREE_MODE_UNSPECIFIED: TreeMode
TREE_MODE_CHAIN: TreeMode
TREE_MODE_TREE: TreeMode

class DraftItem(_message.Message):
    __slots__ = ("request_id", "context_features", "context_start", "bonus_token", "mode", "budget")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_START_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_features: _common_pb2.Tensor
    context_start: int
    bonus_token: int
    mode: TreeMode
    budget: int
    def __init__(self, request_id: _Optional[str] = ..., context_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., context_start: _Optional[int] = ..., bonus_token: _Optional[int] = ..., mode: _Optional[_Union[TreeMode, str]] = ..., budget: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("request_id", "tree")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tree: _common_pb2.TokenTree
    def __init__(self, request_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ...) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model_name", "block_size", "target_layer_ids", "hidden_size", "vocab_size", "mask_token_id", "max_budget", "device", "live_requests")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    block_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    vocab_size: int
    mask_token_id: int
    max_budget: int
    device: str
    live_requests: int
    def __init__(self, model_name: _Optional[str] = ..., block_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., max_budget: _Optional[int] = ..., device: _Optional[str] = ..., live_requests: _Optional[int] = ...) -> None: ...
