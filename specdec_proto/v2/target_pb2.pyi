from specdec_proto.v1 import common_pb2 as _common_pb2
from specdec_proto.v2 import common_pb2 as _common_pb2_1
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetOpen(_message.Message):
    __slots__ = ("prompt_tokens", "max_new_tokens", "sampling", "mode", "tree_budget", "hold_features")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    HOLD_FEATURES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    mode: _common_pb2_1.Mode
    tree_budget: int
    hold_features: bool
    def __init__(self, prompt_tokens: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2_1.Mode, str]] = ..., tree_budget: _Optional[int] = ..., hold_features: _Optional[bool] = ...) -> None: ...

class TargetVerify(_message.Message):
    __slots__ = ("commit", "tree", "hold_features")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FEATURES_FIELD_NUMBER: _ClassVar[int]
    commit: _containers.RepeatedScalarFieldContainer[int]
    tree: _common_pb2.TokenTree
    hold_features: bool
    def __init__(self, commit: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., hold_features: _Optional[bool] = ...) -> None: ...

class TargetMessage(_message.Message):
    __slots__ = ("open", "verify")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    open: TargetOpen
    verify: TargetVerify
    def __init__(self, open: _Optional[_Union[TargetOpen, _Mapping]] = ..., verify: _Optional[_Union[TargetVerify, _Mapping]] = ...) -> None: ...

class TargetOpened(_message.Message):
    __slots__ = ("first_token", "context_features")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    context_features: _common_pb2.Tensor
    def __init__(self, first_token: _Optional[int] = ..., context_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TargetVerified(_message.Message):
    __slots__ = ("samples", "edge_probs", "feature_nodes", "context_features", "held_rows")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EDGE_PROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NODES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    HELD_ROWS_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedScalarFieldContainer[int]
    edge_probs: _containers.RepeatedScalarFieldContainer[float]
    feature_nodes: _containers.RepeatedScalarFieldContainer[int]
    context_features: _common_pb2.Tensor
    held_rows: int
    def __init__(self, samples: _Optional[_Iterable[int]] = ..., edge_probs: _Optional[_Iterable[float]] = ..., feature_nodes: _Optional[_Iterable[int]] = ..., context_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., held_rows: _Optional[int] = ...) -> None: ...

class TargetReply(_message.Message):
    __slots__ = ("opened", "verified")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    opened: TargetOpened
    verified: TargetVerified
    def __init__(self, opened: _Optional[_Union[TargetOpened, _Mapping]] = ..., verified: _Optional[_Union[TargetVerified, _Mapping]] = ...) -> None: ...

class TargetStepItem(_message.Message):
    __slots__ = ("worker_id", "verify")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    verify: TargetVerify
    def __init__(self, worker_id: _Optional[str] = ..., verify: _Optional[_Union[TargetVerify, _Mapping]] = ...) -> None: ...

class TargetStep(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TargetStepItem]
    def __init__(self, items: _Optional[_Iterable[_Union[TargetStepItem, _Mapping]]] = ...) -> None: ...

class TargetStepResult(_message.Message):
    __slots__ = ("verified", "error")
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    verified: TargetVerified
    error: _common_pb2_1.ItemError
    def __init__(self, verified: _Optional[_Union[TargetVerified, _Mapping]] = ..., error: _Optional[_Union[_common_pb2_1.ItemError, _Mapping]] = ...) -> None: ...

class TargetStepReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TargetStepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TargetStepResult, _Mapping]]] = ...) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "hidden_size", "num_layers", "taps", "max_context", "max_tree_budget", "eos_token_ids", "dtype", "device", "kv_pool_tokens", "live_requests", "kv_reserved_tokens", "data_socket", "data_nonce")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TAPS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_NONCE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    taps: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    max_tree_budget: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    kv_pool_tokens: int
    live_requests: int
    kv_reserved_tokens: int
    data_socket: str
    data_nonce: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., taps: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., max_tree_budget: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_pool_tokens: _Optional[int] = ..., live_requests: _Optional[int] = ..., kv_reserved_tokens: _Optional[int] = ..., data_socket: _Optional[str] = ..., data_nonce: _Optional[str] = ...) -> None: ...
