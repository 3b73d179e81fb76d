from proto.pdserve.v1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("id", "role", "model_id", "max_model_len", "eos_token_ids", "block_size", "kv_transport", "kv_metadata", "max_step_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_METADATA_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: str
    model_id: str
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    kv_transport: str
    kv_metadata: bytes
    max_step_tokens: int
    def __init__(self, id: _Optional[str] = ..., role: _Optional[str] = ..., model_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., kv_transport: _Optional[str] = ..., kv_metadata: _Optional[bytes] = ..., max_step_tokens: _Optional[int] = ...) -> None: ...

class ModelFilesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("kv_blocks_total", "kv_blocks_used", "kv_blocks_held", "running", "waiting", "prefix_cache_hit_tokens", "leases", "spec_draft_tokens", "spec_accepted_tokens", "engine_steps")
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_held: int
    running: int
    waiting: int
    prefix_cache_hit_tokens: int
    leases: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    engine_steps: int
    def __init__(self, kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_held: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., leases: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., engine_steps: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingOptions
    lease_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingOptions, _Mapping]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("worker_id", "kv_metadata", "block_ids", "num_cached_blocks", "reservation_epoch", "expires_unix")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_metadata: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_blocks: int
    reservation_epoch: int
    expires_unix: float
    def __init__(self, worker_id: _Optional[str] = ..., kv_metadata: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_blocks: _Optional[int] = ..., reservation_epoch: _Optional[int] = ..., expires_unix: _Optional[float] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("destination", "lease_expires_unix")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    destination: KVDestination
    lease_expires_unix: float
    def __init__(self, destination: _Optional[_Union[KVDestination, _Mapping]] = ..., lease_expires_unix: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "hold_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingOptions
    destination: KVDestination
    hold_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingOptions, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "usage", "kv_bytes", "transfer_seconds", "first_logprob", "kv_checksum")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: str
    usage: _api_pb2.Usage
    kv_bytes: int
    transfer_seconds: float
    first_logprob: _api_pb2.TokenLogprob
    kv_checksum: str
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_api_pb2.Usage, _Mapping]] = ..., kv_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., first_logprob: _Optional[_Union[_api_pb2.TokenLogprob, _Mapping]] = ..., kv_checksum: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "kv_checksum")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    kv_checksum: str
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., kv_checksum: _Optional[str] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingOptions
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingOptions, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: _api_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_api_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "senders_quiesced")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDERS_QUIESCED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    senders_quiesced: bool
    def __init__(self, request_id: _Optional[str] = ..., senders_quiesced: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ("epoch", "after_seq", "snapshot")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    after_seq: int
    snapshot: bool
    def __init__(self, epoch: _Optional[str] = ..., after_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class KvEventsResponse(_message.Message):
    __slots__ = ("epoch", "records", "is_snapshot", "seq", "block_hashes", "block_size")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    IS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    records: _containers.RepeatedScalarFieldContainer[str]
    is_snapshot: bool
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, epoch: _Optional[str] = ..., records: _Optional[_Iterable[str]] = ..., is_snapshot: _Optional[bool] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...
