from specdec_proto.v1 import common_pb2 as _common_pb2
from specdec_proto.v2 import common_pb2 as _common_pb2_1
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftOpen(_message.Message):
    __slots__ = ("mode", "tree_budget")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2_1.Mode
    tree_budget: int
    def __init__(self, mode: _Optional[_Union[_common_pb2_1.Mode, str]] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class DraftMessage(_message.Message):
    __slots__ = ("open", "context_features", "context_start", "bonus_token", "round_budget")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_START_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_BUDGET_FIELD_NUMBER: _ClassVar[int]
    open: DraftOpen
    context_features: _common_pb2.Tensor
    context_start: int
    bonus_token: int
    round_budget: int
    def __init__(self, open: _Optional[_Union[DraftOpen, _Mapping]] = ..., context_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., context_start: _Optional[int] = ..., bonus_token: _Optional[int] = ..., round_budget: _Optional[int] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("tree",)
    TREE_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.TokenTree
    def __init__(self, tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class DraftStepItem(_message.Message):
    __slots__ = ("worker_id", "draft")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    draft: DraftMessage
    def __init__(self, worker_id: _Optional[str] = ..., draft: _Optional[_Union[DraftMessage, _Mapping]] = ...) -> None: ...

class DraftStep(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftStepItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DraftStepItem, _Mapping]]] = ...) -> None: ...

class DraftStepResult(_message.Message):
    __slots__ = ("tree", "error")
    TREE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tree: DraftReply
    error: _common_pb2_1.ItemError
    def __init__(self, tree: _Optional[_Union[DraftReply, _Mapping]] = ..., error: _Optional[_Union[_common_pb2_1.ItemError, _Mapping]] = ...) -> None: ...

class DraftStepReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftStepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DraftStepResult, _Mapping]]] = ...) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model_name", "block_size", "taps", "hidden_size", "vocab_size", "mask_token_id", "max_tree_budget", "max_context", "device", "live_requests", "data_socket", "data_nonce")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TAPS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_NONCE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    block_size: int
    taps: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    vocab_size: int
    mask_token_id: int
    max_tree_budget: int
    max_context: int
    device: str
    live_requests: int
    data_socket: str
    data_nonce: str
    def __init__(self, model_name: _Optional[str] = ..., block_size: _Optional[int] = ..., taps: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., max_tree_budget: _Optional[int] = ..., max_context: _Optional[int] = ..., device: _Optional[str] = ..., live_requests: _Optional[int] = ..., data_socket: _Optional[str] = ..., data_nonce: _Optional[str] = ...) -> None: ...
