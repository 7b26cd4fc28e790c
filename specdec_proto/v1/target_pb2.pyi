from specdec_proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillItem(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "max_new_tokens", "sampling", "return_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    return_features: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_features: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("request_id", "first_token", "context_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    context_features: _common_pb2.Tensor
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., context_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrefillResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PrefillResult, _Mapping]]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("request_id", "tree", "sampling", "return_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tree: _common_pb2.TokenTree
    sampling: _common_pb2.SamplingParams
    return_features: bool
    def __init__(self, request_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_features: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "accepted_nodes", "bonus_token", "node_samples", "expected_accepted", "context_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    node_samples: _containers.RepeatedScalarFieldContainer[int]
    expected_accepted: float
    context_features: _common_pb2.Tensor
    def __init__(self, request_id: _Optional[str] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., node_samples: _Optional[_Iterable[int]] = ..., expected_accepted: _Optional[float] = ..., context_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "hidden_size", "num_layers", "tapped_layers", "max_context", "max_tree_nodes", "eos_token_ids", "dtype", "device", "kv_pool_tokens", "live_requests", "kv_reserved_tokens")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TAPPED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tapped_layers: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    max_tree_nodes: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    kv_pool_tokens: int
    live_requests: int
    kv_reserved_tokens: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., tapped_layers: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_pool_tokens: _Optional[int] = ..., live_requests: _Optional[int] = ..., kv_reserved_tokens: _Optional[int] = ...) -> None: ...
