from specdec_proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_AUTOREGRESSIVE: _ClassVar[Mode]
    MODE_CHAIN: _ClassVar[Mode]
    MODE_TREE: _ClassVar[Mode]

class BudgetPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUDGET_POLICY_UNSPECIFIED: _ClassVar[BudgetPolicy]
    BUDGET_POLICY_FIXED: _ClassVar[BudgetPolicy]
    BUDGET_POLICY_ADAPTIVE: _ClassVar[BudgetPolicy]
MODE_UNSPECIFIED: Mode
MODE_AUTOREGRESSIVE: Mode
MODE_CHAIN: Mode
MODE_TREE: Mode
BUDGET_POLICY_UNSPECIFIED: BudgetPolicy
BUDGET_POLICY_FIXED: BudgetPolicy
BUDGET_POLICY_ADAPTIVE: BudgetPolicy

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "token_ids", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "mode", "tree_budget", "sampling", "request_id", "budget_policy")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_POLICY_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    mode: Mode
    tree_budget: int
    sampling: _common_pb2.SamplingParams
    request_id: str
    budget_policy: BudgetPolicy
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., mode: _Optional[_Union[Mode, str]] = ..., tree_budget: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., budget_policy: _Optional[_Union[BudgetPolicy, str]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("rounds", "mean_accept_length", "accept_length_histogram", "expected_accept_length", "draft_seconds", "verify_seconds", "fallback_rounds")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    mean_accept_length: float
    accept_length_histogram: _containers.RepeatedScalarFieldContainer[int]
    expected_accept_length: float
    draft_seconds: float
    verify_seconds: float
    fallback_rounds: int
    def __init__(self, rounds: _Optional[int] = ..., mean_accept_length: _Optional[float] = ..., accept_length_histogram: _Optional[_Iterable[int]] = ..., expected_accept_length: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., fallback_rounds: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "stats", "request_id")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    stats: SpecStats
    request_id: str
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpecStats, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    final: Final
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...
