import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import field_mask_pb2 as _field_mask_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_FORMAT_UNSPECIFIED: _ClassVar[PushFormat]
    PUSH_FORMAT_CLOUDEVENTS_BINARY: _ClassVar[PushFormat]
    PUSH_FORMAT_CLOUDEVENTS_STRUCTURED: _ClassVar[PushFormat]

class Boundary(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BOUNDARY_UNSPECIFIED: _ClassVar[Boundary]
    BOUNDARY_LATEST: _ClassVar[Boundary]
    BOUNDARY_EARLIEST: _ClassVar[Boundary]

class DeliveryState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELIVERY_STATE_UNSPECIFIED: _ClassVar[DeliveryState]
    DELIVERY_STATE_NOT_MATCHED: _ClassVar[DeliveryState]
    DELIVERY_STATE_PENDING: _ClassVar[DeliveryState]
    DELIVERY_STATE_SKIPPED: _ClassVar[DeliveryState]
    DELIVERY_STATE_ACKED: _ClassVar[DeliveryState]
    DELIVERY_STATE_IN_FLIGHT: _ClassVar[DeliveryState]
    DELIVERY_STATE_AWAITING_RETRY: _ClassVar[DeliveryState]
    DELIVERY_STATE_WAITING: _ClassVar[DeliveryState]
    DELIVERY_STATE_DEAD: _ClassVar[DeliveryState]

class SubscriptionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUBSCRIPTION_STATUS_UNSPECIFIED: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_PUSH_STOPPED: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_PAUSED: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_DEAD_LETTERS: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_BEHIND: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_NO_CONSUMER: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_DELIVERING: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_SCHEDULED_ONLY: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_CAUGHT_UP: _ClassVar[SubscriptionStatus]
    SUBSCRIPTION_STATUS_SINK_UNREACHABLE: _ClassVar[SubscriptionStatus]

class SourceStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_STATUS_UNSPECIFIED: _ClassVar[SourceStatus]
    SOURCE_STATUS_CONNECTED: _ClassVar[SourceStatus]
    SOURCE_STATUS_UNAVAILABLE: _ClassVar[SourceStatus]
PUSH_FORMAT_UNSPECIFIED: PushFormat
PUSH_FORMAT_CLOUDEVENTS_BINARY: PushFormat
PUSH_FORMAT_CLOUDEVENTS_STRUCTURED: PushFormat
BOUNDARY_UNSPECIFIED: Boundary
BOUNDARY_LATEST: Boundary
BOUNDARY_EARLIEST: Boundary
DELIVERY_STATE_UNSPECIFIED: DeliveryState
DELIVERY_STATE_NOT_MATCHED: DeliveryState
DELIVERY_STATE_PENDING: DeliveryState
DELIVERY_STATE_SKIPPED: DeliveryState
DELIVERY_STATE_ACKED: DeliveryState
DELIVERY_STATE_IN_FLIGHT: DeliveryState
DELIVERY_STATE_AWAITING_RETRY: DeliveryState
DELIVERY_STATE_WAITING: DeliveryState
DELIVERY_STATE_DEAD: DeliveryState
SUBSCRIPTION_STATUS_UNSPECIFIED: SubscriptionStatus
SUBSCRIPTION_STATUS_PUSH_STOPPED: SubscriptionStatus
SUBSCRIPTION_STATUS_PAUSED: SubscriptionStatus
SUBSCRIPTION_STATUS_DEAD_LETTERS: SubscriptionStatus
SUBSCRIPTION_STATUS_BEHIND: SubscriptionStatus
SUBSCRIPTION_STATUS_NO_CONSUMER: SubscriptionStatus
SUBSCRIPTION_STATUS_DELIVERING: SubscriptionStatus
SUBSCRIPTION_STATUS_SCHEDULED_ONLY: SubscriptionStatus
SUBSCRIPTION_STATUS_CAUGHT_UP: SubscriptionStatus
SUBSCRIPTION_STATUS_SINK_UNREACHABLE: SubscriptionStatus
SOURCE_STATUS_UNSPECIFIED: SourceStatus
SOURCE_STATUS_CONNECTED: SourceStatus
SOURCE_STATUS_UNAVAILABLE: SourceStatus

class PublishRequest(_message.Message):
    __slots__ = ("events", "source")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[EventInput]
    source: str
    def __init__(self, events: _Optional[_Iterable[_Union[EventInput, _Mapping]]] = ..., source: _Optional[str] = ...) -> None: ...

class EventInput(_message.Message):
    __slots__ = ("id", "aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload", "content_type", "metadata", "occurred_at", "deliver_at", "expires_at")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_TYPE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    OCCURRED_AT_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    aggregate_type: str
    aggregate_id: str
    aggregate_version: int
    event_type: str
    payload: bytes
    content_type: str
    metadata: _containers.ScalarMap[str, str]
    occurred_at: _timestamp_pb2.Timestamp
    deliver_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., aggregate_type: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., aggregate_version: _Optional[int] = ..., event_type: _Optional[str] = ..., payload: _Optional[bytes] = ..., content_type: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., occurred_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., deliver_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PublishResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PublishResult, _Mapping]]] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("id", "duplicate")
    ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    duplicate: bool
    def __init__(self, id: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload", "content_type", "metadata", "occurred_at", "created_at", "source", "deliver_at", "expires_at", "transaction_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_TYPE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    OCCURRED_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    aggregate_type: str
    aggregate_id: str
    aggregate_version: int
    event_type: str
    payload: bytes
    content_type: str
    metadata: _containers.ScalarMap[str, str]
    occurred_at: _timestamp_pb2.Timestamp
    created_at: _timestamp_pb2.Timestamp
    source: str
    deliver_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    transaction_id: int
    def __init__(self, id: _Optional[str] = ..., aggregate_type: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., aggregate_version: _Optional[int] = ..., event_type: _Optional[str] = ..., payload: _Optional[bytes] = ..., content_type: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., occurred_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., source: _Optional[str] = ..., deliver_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., transaction_id: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscription", "max_in_flight", "max_in_flight_bytes", "max_deliveries")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    max_in_flight: int
    max_in_flight_bytes: int
    max_deliveries: int
    def __init__(self, subscription: _Optional[str] = ..., max_in_flight: _Optional[int] = ..., max_in_flight_bytes: _Optional[int] = ..., max_deliveries: _Optional[int] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("ack_id", "attempt", "event", "ack_deadline")
    ACK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ACK_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    ack_id: str
    attempt: int
    event: Event
    ack_deadline: _timestamp_pb2.Timestamp
    def __init__(self, ack_id: _Optional[str] = ..., attempt: _Optional[int] = ..., event: _Optional[_Union[Event, _Mapping]] = ..., ack_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("subscription", "ack_ids")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ACK_IDS_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    ack_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, subscription: _Optional[str] = ..., ack_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("stale_ack_ids", "unavailable_ack_ids")
    STALE_ACK_IDS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_ACK_IDS_FIELD_NUMBER: _ClassVar[int]
    stale_ack_ids: _containers.RepeatedScalarFieldContainer[str]
    unavailable_ack_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stale_ack_ids: _Optional[_Iterable[str]] = ..., unavailable_ack_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("subscription", "ack_id", "reason", "retry_after", "dead_letter")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ACK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    ack_id: str
    reason: str
    retry_after: _duration_pb2.Duration
    dead_letter: bool
    def __init__(self, subscription: _Optional[str] = ..., ack_id: _Optional[str] = ..., reason: _Optional[str] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., dead_letter: _Optional[bool] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("dead_lettered", "retry_at")
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AT_FIELD_NUMBER: _ClassVar[int]
    dead_lettered: bool
    retry_at: _timestamp_pb2.Timestamp
    def __init__(self, dead_lettered: _Optional[bool] = ..., retry_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ExtendAckDeadlineRequest(_message.Message):
    __slots__ = ("subscription", "ack_ids", "extension")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ACK_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTENSION_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    ack_ids: _containers.RepeatedScalarFieldContainer[str]
    extension: _duration_pb2.Duration
    def __init__(self, subscription: _Optional[str] = ..., ack_ids: _Optional[_Iterable[str]] = ..., extension: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ExtendAckDeadlineResponse(_message.Message):
    __slots__ = ("stale_ack_ids",)
    STALE_ACK_IDS_FIELD_NUMBER: _ClassVar[int]
    stale_ack_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stale_ack_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListSinksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSinksResponse(_message.Message):
    __slots__ = ("sinks",)
    SINKS_FIELD_NUMBER: _ClassVar[int]
    sinks: _containers.RepeatedCompositeFieldContainer[Sink]
    def __init__(self, sinks: _Optional[_Iterable[_Union[Sink, _Mapping]]] = ...) -> None: ...

class Sink(_message.Message):
    __slots__ = ("name", "kind", "reachable", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    reachable: bool
    error: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class RotatePushSecretRequest(_message.Message):
    __slots__ = ("name", "keep_previous_for")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREVIOUS_FOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    keep_previous_for: _duration_pb2.Duration
    def __init__(self, name: _Optional[str] = ..., keep_previous_for: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RotatePushSecretResponse(_message.Message):
    __slots__ = ("signing_secret", "previous_expires_at")
    SIGNING_SECRET_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    signing_secret: str
    previous_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, signing_secret: _Optional[str] = ..., previous_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Subscription(_message.Message):
    __slots__ = ("name", "event_types", "aggregate_types", "metadata_match", "start", "ack_deadline", "max_attempts", "retry_backoff_min", "retry_backoff_max", "ordered", "persistent_event_types", "created_at", "filter", "transform", "sources", "paused", "pause_reason", "paused_until", "max_event_age", "dead_letter_expired", "paused_at", "expire_after_idle", "push", "push_stopped", "sink")
    class MetadataMatchEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_TYPES_FIELD_NUMBER: _ClassVar[int]
    METADATA_MATCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ACK_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RETRY_BACKOFF_MIN_FIELD_NUMBER: _ClassVar[int]
    RETRY_BACKOFF_MAX_FIELD_NUMBER: _ClassVar[int]
    ORDERED_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_EVENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    TRANSFORM_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSE_REASON_FIELD_NUMBER: _ClassVar[int]
    PAUSED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENT_AGE_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_AFTER_IDLE_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PUSH_STOPPED_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    name: str
    event_types: _containers.RepeatedScalarFieldContainer[str]
    aggregate_types: _containers.RepeatedScalarFieldContainer[str]
    metadata_match: _containers.ScalarMap[str, str]
    start: StartPosition
    ack_deadline: _duration_pb2.Duration
    max_attempts: int
    retry_backoff_min: _duration_pb2.Duration
    retry_backoff_max: _duration_pb2.Duration
    ordered: bool
    persistent_event_types: _containers.RepeatedScalarFieldContainer[str]
    created_at: _timestamp_pb2.Timestamp
    filter: str
    transform: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    paused: bool
    pause_reason: str
    paused_until: _timestamp_pb2.Timestamp
    max_event_age: _duration_pb2.Duration
    dead_letter_expired: bool
    paused_at: _timestamp_pb2.Timestamp
    expire_after_idle: _duration_pb2.Duration
    push: PushConfig
    push_stopped: PushStopped
    sink: SinkConfig
    def __init__(self, name: _Optional[str] = ..., event_types: _Optional[_Iterable[str]] = ..., aggregate_types: _Optional[_Iterable[str]] = ..., metadata_match: _Optional[_Mapping[str, str]] = ..., start: _Optional[_Union[StartPosition, _Mapping]] = ..., ack_deadline: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_attempts: _Optional[int] = ..., retry_backoff_min: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., retry_backoff_max: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., ordered: _Optional[bool] = ..., persistent_event_types: _Optional[_Iterable[str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., filter: _Optional[str] = ..., transform: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., paused: _Optional[bool] = ..., pause_reason: _Optional[str] = ..., paused_until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., max_event_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., dead_letter_expired: _Optional[bool] = ..., paused_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expire_after_idle: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., push: _Optional[_Union[PushConfig, _Mapping]] = ..., push_stopped: _Optional[_Union[PushStopped, _Mapping]] = ..., sink: _Optional[_Union[SinkConfig, _Mapping]] = ...) -> None: ...

class SinkConfig(_message.Message):
    __slots__ = ("name", "subject", "topic", "key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    subject: str
    topic: str
    key: str
    def __init__(self, name: _Optional[str] = ..., subject: _Optional[str] = ..., topic: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class PushConfig(_message.Message):
    __slots__ = ("endpoint", "headers", "format", "timeout", "max_concurrency", "rate_limit", "signing_secret", "max_batch_events", "max_batch_bytes", "max_batch_wait")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SIGNING_SECRET_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_EVENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_WAIT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    headers: _containers.ScalarMap[str, str]
    format: PushFormat
    timeout: _duration_pb2.Duration
    max_concurrency: int
    rate_limit: float
    signing_secret: str
    max_batch_events: int
    max_batch_bytes: int
    max_batch_wait: _duration_pb2.Duration
    def __init__(self, endpoint: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., format: _Optional[_Union[PushFormat, str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_concurrency: _Optional[int] = ..., rate_limit: _Optional[float] = ..., signing_secret: _Optional[str] = ..., max_batch_events: _Optional[int] = ..., max_batch_bytes: _Optional[int] = ..., max_batch_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PushStopped(_message.Message):
    __slots__ = ("at", "reason")
    AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    reason: str
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class StartPosition(_message.Message):
    __slots__ = ("boundary", "time")
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    boundary: Boundary
    time: _timestamp_pb2.Timestamp
    def __init__(self, boundary: _Optional[_Union[Boundary, str]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CreateSubscriptionRequest(_message.Message):
    __slots__ = ("subscription", "validate_only")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    subscription: Subscription
    validate_only: bool
    def __init__(self, subscription: _Optional[_Union[Subscription, _Mapping]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class GetSubscriptionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListSubscriptionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSubscriptionsResponse(_message.Message):
    __slots__ = ("subscriptions",)
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[Subscription]
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[Subscription, _Mapping]]] = ...) -> None: ...

class DeleteSubscriptionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteSubscriptionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateSubscriptionRequest(_message.Message):
    __slots__ = ("subscription", "update_mask", "validate_only")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MASK_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    subscription: Subscription
    update_mask: _field_mask_pb2.FieldMask
    validate_only: bool
    def __init__(self, subscription: _Optional[_Union[Subscription, _Mapping]] = ..., update_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class PauseSubscriptionRequest(_message.Message):
    __slots__ = ("name", "reason", "until")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    until: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ..., until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ResumeSubscriptionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SeekSubscriptionRequest(_message.Message):
    __slots__ = ("subscription", "to")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    to: StartPosition
    def __init__(self, subscription: _Optional[str] = ..., to: _Optional[_Union[StartPosition, _Mapping]] = ...) -> None: ...

class SeekSubscriptionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequeueEventRequest(_message.Message):
    __slots__ = ("id", "subscription", "source", "forget_consumption")
    ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FORGET_CONSUMPTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    subscription: str
    source: str
    forget_consumption: bool
    def __init__(self, id: _Optional[str] = ..., subscription: _Optional[str] = ..., source: _Optional[str] = ..., forget_consumption: _Optional[bool] = ...) -> None: ...

class RequeueLatestRequest(_message.Message):
    __slots__ = ("aggregate_type", "aggregate_id", "event_type", "subscription", "source", "forget_consumption")
    AGGREGATE_TYPE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FORGET_CONSUMPTION_FIELD_NUMBER: _ClassVar[int]
    aggregate_type: str
    aggregate_id: str
    event_type: str
    subscription: str
    source: str
    forget_consumption: bool
    def __init__(self, aggregate_type: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., event_type: _Optional[str] = ..., subscription: _Optional[str] = ..., source: _Optional[str] = ..., forget_consumption: _Optional[bool] = ...) -> None: ...

class RequeueResponse(_message.Message):
    __slots__ = ("requeued_count",)
    REQUEUED_COUNT_FIELD_NUMBER: _ClassVar[int]
    requeued_count: int
    def __init__(self, requeued_count: _Optional[int] = ...) -> None: ...

class ListDeadLettersRequest(_message.Message):
    __slots__ = ("subscription", "event_types", "include_resolved", "page_size", "page_token", "source", "aggregate_type", "aggregate_id", "last_error", "dead_lettered_after", "dead_lettered_before")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_RESOLVED_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_TYPE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_AFTER_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    event_types: _containers.RepeatedScalarFieldContainer[str]
    include_resolved: bool
    page_size: int
    page_token: str
    source: str
    aggregate_type: str
    aggregate_id: str
    last_error: str
    dead_lettered_after: _timestamp_pb2.Timestamp
    dead_lettered_before: _timestamp_pb2.Timestamp
    def __init__(self, subscription: _Optional[str] = ..., event_types: _Optional[_Iterable[str]] = ..., include_resolved: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., source: _Optional[str] = ..., aggregate_type: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., last_error: _Optional[str] = ..., dead_lettered_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., dead_lettered_before: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListDeadLettersResponse(_message.Message):
    __slots__ = ("dead_letters", "next_page_token")
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    dead_letters: _containers.RepeatedCompositeFieldContainer[DeadLetter]
    next_page_token: str
    def __init__(self, dead_letters: _Optional[_Iterable[_Union[DeadLetter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("subscription", "event", "attempts", "last_error", "dead_lettered_at", "resolved", "resolved_at", "resolved_by", "notes", "source")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_AT_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_AT_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_BY_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    event: Event
    attempts: int
    last_error: str
    dead_lettered_at: _timestamp_pb2.Timestamp
    resolved: bool
    resolved_at: _timestamp_pb2.Timestamp
    resolved_by: str
    notes: str
    source: str
    def __init__(self, subscription: _Optional[str] = ..., event: _Optional[_Union[Event, _Mapping]] = ..., attempts: _Optional[int] = ..., last_error: _Optional[str] = ..., dead_lettered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., resolved: _Optional[bool] = ..., resolved_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., resolved_by: _Optional[str] = ..., notes: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class RequeueDeadLettersRequest(_message.Message):
    __slots__ = ("subscription", "ids", "event_types", "dead_lettered_before", "all", "source", "aggregate_type", "aggregate_id", "last_error", "dead_lettered_after", "validate_only")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_TYPE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_AFTER_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    event_types: _containers.RepeatedScalarFieldContainer[str]
    dead_lettered_before: _timestamp_pb2.Timestamp
    all: bool
    source: str
    aggregate_type: str
    aggregate_id: str
    last_error: str
    dead_lettered_after: _timestamp_pb2.Timestamp
    validate_only: bool
    def __init__(self, subscription: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ..., event_types: _Optional[_Iterable[str]] = ..., dead_lettered_before: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., all: _Optional[bool] = ..., source: _Optional[str] = ..., aggregate_type: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., last_error: _Optional[str] = ..., dead_lettered_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class ResolveDeadLettersRequest(_message.Message):
    __slots__ = ("subscription", "ids", "event_types", "aggregate_type", "aggregate_id", "last_error", "dead_lettered_after", "dead_lettered_before", "all", "resolved_by", "notes", "validate_only", "source")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_TYPE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_AFTER_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_BY_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    event_types: _containers.RepeatedScalarFieldContainer[str]
    aggregate_type: str
    aggregate_id: str
    last_error: str
    dead_lettered_after: _timestamp_pb2.Timestamp
    dead_lettered_before: _timestamp_pb2.Timestamp
    all: bool
    resolved_by: str
    notes: str
    validate_only: bool
    source: str
    def __init__(self, subscription: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ..., event_types: _Optional[_Iterable[str]] = ..., aggregate_type: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., last_error: _Optional[str] = ..., dead_lettered_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., dead_lettered_before: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., all: _Optional[bool] = ..., resolved_by: _Optional[str] = ..., notes: _Optional[str] = ..., validate_only: _Optional[bool] = ..., source: _Optional[str] = ...) -> None: ...

class ResolveDeadLettersResponse(_message.Message):
    __slots__ = ("resolved_count",)
    RESOLVED_COUNT_FIELD_NUMBER: _ClassVar[int]
    resolved_count: int
    def __init__(self, resolved_count: _Optional[int] = ...) -> None: ...

class SummarizeDeadLettersRequest(_message.Message):
    __slots__ = ("subscription", "source")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    source: str
    def __init__(self, subscription: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class DeadLetterSummary(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[DeadLetterGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[DeadLetterGroup, _Mapping]]] = ...) -> None: ...

class DeadLetterGroup(_message.Message):
    __slots__ = ("last_error", "count", "first_dead_lettered_at", "last_dead_lettered_at", "example_event_id")
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_DEAD_LETTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_DEAD_LETTERED_AT_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    last_error: str
    count: int
    first_dead_lettered_at: _timestamp_pb2.Timestamp
    last_dead_lettered_at: _timestamp_pb2.Timestamp
    example_event_id: str
    def __init__(self, last_error: _Optional[str] = ..., count: _Optional[int] = ..., first_dead_lettered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_dead_lettered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., example_event_id: _Optional[str] = ...) -> None: ...

class GetEventRequest(_message.Message):
    __slots__ = ("id", "source")
    ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    source: str
    def __init__(self, id: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class EventDeliveries(_message.Message):
    __slots__ = ("event", "subscriptions")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    event: Event
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionDelivery]
    def __init__(self, event: _Optional[_Union[Event, _Mapping]] = ..., subscriptions: _Optional[_Iterable[_Union[SubscriptionDelivery, _Mapping]]] = ...) -> None: ...

class SubscriptionDelivery(_message.Message):
    __slots__ = ("subscription", "state", "attempt", "due_at", "last_error", "dead_lettered_at", "resolved_at", "resolved_by", "notes")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DUE_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_AT_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_AT_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_BY_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    state: DeliveryState
    attempt: int
    due_at: _timestamp_pb2.Timestamp
    last_error: str
    dead_lettered_at: _timestamp_pb2.Timestamp
    resolved_at: _timestamp_pb2.Timestamp
    resolved_by: str
    notes: str
    def __init__(self, subscription: _Optional[str] = ..., state: _Optional[_Union[DeliveryState, str]] = ..., attempt: _Optional[int] = ..., due_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_error: _Optional[str] = ..., dead_lettered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., resolved_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., resolved_by: _Optional[str] = ..., notes: _Optional[str] = ...) -> None: ...

class ResolveDeadLetterRequest(_message.Message):
    __slots__ = ("subscription", "id", "resolved_by", "notes", "source")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_BY_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    id: str
    resolved_by: str
    notes: str
    source: str
    def __init__(self, subscription: _Optional[str] = ..., id: _Optional[str] = ..., resolved_by: _Optional[str] = ..., notes: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("subscription",)
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    def __init__(self, subscription: _Optional[str] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("subscriptions", "outbox")
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    OUTBOX_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionStats]
    outbox: OutboxStats
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[SubscriptionStats, _Mapping]]] = ..., outbox: _Optional[_Union[OutboxStats, _Mapping]] = ...) -> None: ...

class SubscriptionStats(_message.Message):
    __slots__ = ("name", "pending", "in_flight", "awaiting_retry", "dead_lettered", "oldest_unacked_age", "lag_events", "lag", "delivered_total", "acked_total", "late_transactions", "source", "sources", "expired_total", "scheduled", "next_scheduled_at", "push_in_flight", "push_last_status", "push_last_error", "push_last_error_at", "push_requests_total", "push_rate", "push_stopped_reason", "sink_in_flight", "sink_last_error", "sink_last_error_at", "sink_sent_total", "sink_confirmed_total", "sink_rate", "consumption_records", "filtered_total", "filter_errors_total", "last_filter_error", "last_filter_error_at", "error", "status", "status_detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    AWAITING_RETRY_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_UNACKED_AGE_FIELD_NUMBER: _ClassVar[int]
    LAG_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACKED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LATE_TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    NEXT_SCHEDULED_AT_FIELD_NUMBER: _ClassVar[int]
    PUSH_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PUSH_LAST_STATUS_FIELD_NUMBER: _ClassVar[int]
    PUSH_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PUSH_LAST_ERROR_AT_FIELD_NUMBER: _ClassVar[int]
    PUSH_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUSH_RATE_FIELD_NUMBER: _ClassVar[int]
    PUSH_STOPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    SINK_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SINK_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SINK_LAST_ERROR_AT_FIELD_NUMBER: _ClassVar[int]
    SINK_SENT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SINK_CONFIRMED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SINK_RATE_FIELD_NUMBER: _ClassVar[int]
    CONSUMPTION_RECORDS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FILTER_ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_FILTER_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_FILTER_ERROR_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    pending: int
    in_flight: int
    awaiting_retry: int
    dead_lettered: int
    oldest_unacked_age: _duration_pb2.Duration
    lag_events: int
    lag: _duration_pb2.Duration
    delivered_total: int
    acked_total: int
    late_transactions: int
    source: str
    sources: _containers.RepeatedCompositeFieldContainer[SubscriptionStats]
    expired_total: int
    scheduled: int
    next_scheduled_at: _timestamp_pb2.Timestamp
    push_in_flight: int
    push_last_status: int
    push_last_error: str
    push_last_error_at: _timestamp_pb2.Timestamp
    push_requests_total: int
    push_rate: float
    push_stopped_reason: str
    sink_in_flight: int
    sink_last_error: str
    sink_last_error_at: _timestamp_pb2.Timestamp
    sink_sent_total: int
    sink_confirmed_total: int
    sink_rate: float
    consumption_records: int
    filtered_total: int
    filter_errors_total: int
    last_filter_error: str
    last_filter_error_at: _timestamp_pb2.Timestamp
    error: str
    status: SubscriptionStatus
    status_detail: str
    def __init__(self, name: _Optional[str] = ..., pending: _Optional[int] = ..., in_flight: _Optional[int] = ..., awaiting_retry: _Optional[int] = ..., dead_lettered: _Optional[int] = ..., oldest_unacked_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lag_events: _Optional[int] = ..., lag: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., delivered_total: _Optional[int] = ..., acked_total: _Optional[int] = ..., late_transactions: _Optional[int] = ..., source: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[SubscriptionStats, _Mapping]]] = ..., expired_total: _Optional[int] = ..., scheduled: _Optional[int] = ..., next_scheduled_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., push_in_flight: _Optional[int] = ..., push_last_status: _Optional[int] = ..., push_last_error: _Optional[str] = ..., push_last_error_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., push_requests_total: _Optional[int] = ..., push_rate: _Optional[float] = ..., push_stopped_reason: _Optional[str] = ..., sink_in_flight: _Optional[int] = ..., sink_last_error: _Optional[str] = ..., sink_last_error_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., sink_sent_total: _Optional[int] = ..., sink_confirmed_total: _Optional[int] = ..., sink_rate: _Optional[float] = ..., consumption_records: _Optional[int] = ..., filtered_total: _Optional[int] = ..., filter_errors_total: _Optional[int] = ..., last_filter_error: _Optional[str] = ..., last_filter_error_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., status: _Optional[_Union[SubscriptionStatus, str]] = ..., status_detail: _Optional[str] = ...) -> None: ...

class OutboxStats(_message.Message):
    __slots__ = ("events_stored", "oldest_event_at", "newest_event_at", "oldest_open_transaction_age", "events_force_expired")
    EVENTS_STORED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_EVENT_AT_FIELD_NUMBER: _ClassVar[int]
    NEWEST_EVENT_AT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_OPEN_TRANSACTION_AGE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FORCE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    events_stored: int
    oldest_event_at: _timestamp_pb2.Timestamp
    newest_event_at: _timestamp_pb2.Timestamp
    oldest_open_transaction_age: _duration_pb2.Duration
    events_force_expired: int
    def __init__(self, events_stored: _Optional[int] = ..., oldest_event_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., newest_event_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., oldest_open_transaction_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., events_force_expired: _Optional[int] = ...) -> None: ...

class ListSourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSourcesResponse(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    def __init__(self, sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("name", "status", "last_error", "since", "events_stored", "oldest_event_at", "oldest_open_transaction_age", "schema_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_STORED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_EVENT_AT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_OPEN_TRANSACTION_AGE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: SourceStatus
    last_error: str
    since: _timestamp_pb2.Timestamp
    events_stored: int
    oldest_event_at: _timestamp_pb2.Timestamp
    oldest_open_transaction_age: _duration_pb2.Duration
    schema_version: int
    def __init__(self, name: _Optional[str] = ..., status: _Optional[_Union[SourceStatus, str]] = ..., last_error: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., events_stored: _Optional[int] = ..., oldest_event_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., oldest_open_transaction_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., schema_version: _Optional[int] = ...) -> None: ...
