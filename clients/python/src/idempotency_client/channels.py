"""Addresses and channels: one gRPC channel per address given, calls spread
over them in turn, and a retry sent to the next one.

A client's `target` is one address ("host:port"), several (a list, or one
string with commas: "10.0.0.1:50051,10.0.0.2:50051"), or a gRPC target URI
("dns:///idempotency.internal:50051", "ipv4:10.0.0.1:50051,10.0.0.2:50051").
Every channel balances round-robin over the addresses its name resolves to
(so a `dns:///` name with several A records, or an `ipv4:` list, spreads over
all of them, and skips one that does not answer). With several addresses the
client keeps one channel per address (each kept connected), starts each call
on the next one in turn that is connected (else the next that is not
failing), and sends each retry to the next one: a retry after UNAVAILABLE
lands on another replica, and a replica that is down gets no call while
another is up.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from ._proto import idempotency_pb2_grpc as pb_grpc

Target = Union[str, Sequence[str]]
ChannelOptions = Optional[Sequence[Tuple[str, Any]]]

#: The channel a client may be given instead of a target: grpc.aio's for the
#: asyncio client, grpc's for the synchronous one (the name _sync/ uses).
AsyncChannel = grpc.aio.Channel
Channel = grpc.Channel

#: Target schemes whose whole string is one gRPC target, commas included.
WHOLE_TARGET_SCHEMES = ("ipv4", "ipv6")

#: Channel options the client sets unless `options` sets them: round-robin over
#: the addresses a name resolves to, and a reconnection to a replica that went
#: away tried at least every second (gRPC's default backs off to 2 minutes).
DEFAULT_CHANNEL_OPTIONS: Tuple[Tuple[str, Any], ...] = (
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

#: A channel in one of these states is passed over while another is not.
_FAILING = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def parse_targets(target: Target) -> List[str]:
    """The addresses of a client's `target`: a list, a comma-separated string,
    or one gRPC target (`dns:///...`, or an `ipv4:`/`ipv6:` list kept whole)."""
    if isinstance(target, str):
        scheme = target.split(":", 1)[0].strip().lower()
        parts = [target] if scheme in WHOLE_TARGET_SCHEMES else target.split(",")
    elif isinstance(target, (bytes, bytearray)) or not isinstance(target, Sequence):
        raise TypeError(f"target must be a str or a list of str, got {type(target).__name__}")
    else:
        parts = list(target)
        for part in parts:
            if not isinstance(part, str):
                raise TypeError(f"target: every address must be a str, got {type(part).__name__}")
    addresses = [part.strip() for part in parts if part.strip()]
    if not addresses:
        raise ValueError("target: no address given")
    return addresses


def channel_options(options: ChannelOptions, target: str = "") -> List[Tuple[str, Any]]:
    """The caller's options, plus the client's defaults for those it does not
    set. An `ipv4:`/`ipv6:` list gets its first address as the authority
    (gRPC would send the whole list, which servers refuse)."""
    given = list(options or ())
    names = {name for name, _ in given}
    defaults = list(DEFAULT_CHANNEL_OPTIONS)
    scheme, _, addresses = target.partition(":")
    if scheme.lower() in WHOLE_TARGET_SCHEMES and "," in addresses:
        defaults.append(("grpc.default_authority", addresses.split(",")[0].strip()))
    return [item for item in defaults if item[0] not in names] + given


class _Endpoint:
    def __init__(self, target: str, channel: Any, stub: Any):
        self.target = target
        self.channel = channel
        self.stub = stub
        self.state: Optional[grpc.ChannelConnectivity] = None

    def on_state(self, state: grpc.ChannelConnectivity) -> None:
        self.state = state


class Endpoints:
    """The channels of a client and the choice of one per attempt.

    `state_of` tells a channel's connectivity (None: unknown), so that a call
    starts on a channel that is not failing when there is one."""

    def __init__(self, endpoints: List[_Endpoint], state_of: Callable[[_Endpoint], Any]):
        self._endpoints = endpoints
        self._state_of = state_of
        self._turn = itertools.count()
        self._lock = threading.Lock()

    @property
    def targets(self) -> List[str]:
        return [endpoint.target for endpoint in self._endpoints]

    @property
    def channels(self) -> List[Any]:
        return [endpoint.channel for endpoint in self._endpoints]

    def first(self) -> int:
        """Where a call starts: the next channel in turn."""
        with self._lock:
            return next(self._turn)

    def pick(self, first: int, attempt: int) -> _Endpoint:
        """The channel for attempt number `attempt` (0 for the first) of a
        call that started at `first`: in turn from there, the first that is
        connected (READY), else the first that is not failing (connecting, or
        idle), else the one in turn. So a replica whose connections fail or
        hang gets no call while another is connected."""
        endpoints = self._endpoints
        count = len(endpoints)
        if count == 1:
            return endpoints[0]
        start = first + attempt
        ordered = [endpoints[(start + offset) % count] for offset in range(count)]
        states = [self._state_of(endpoint) for endpoint in ordered]
        for endpoint, state in zip(ordered, states):
            if state is grpc.ChannelConnectivity.READY:
                return endpoint
        for endpoint, state in zip(ordered, states):
            if state not in _FAILING:
                return endpoint
        return ordered[0]


def sync_endpoints(
    targets: List[str],
    credentials: Optional[grpc.ChannelCredentials],
    options: ChannelOptions,
    interceptors: Sequence[Any],
) -> Endpoints:
    """One grpc.Channel per address; with several, each channel's state is
    followed (grpc's subscribe) and kept connecting."""
    endpoints = []
    for target in targets:
        if credentials is None:
            channel = grpc.insecure_channel(target, options=channel_options(options, target))
        else:
            channel = grpc.secure_channel(target, credentials, options=channel_options(options, target))
        endpoints.append(_Endpoint(target, channel, _stub(channel, interceptors)))
    if len(endpoints) > 1:
        for endpoint in endpoints:
            endpoint.channel.subscribe(endpoint.on_state, try_to_connect=True)
    return Endpoints(endpoints, lambda endpoint: endpoint.state)


def sync_channel_endpoints(channel: grpc.Channel, interceptors: Sequence[Any]) -> Endpoints:
    """The caller's own channel, as it is."""
    return Endpoints([_Endpoint("<channel>", channel, _stub(channel, interceptors))], lambda _: None)


def close_sync(endpoints: Endpoints) -> None:
    for endpoint in endpoints._endpoints:
        if len(endpoints._endpoints) > 1:
            try:
                endpoint.channel.unsubscribe(endpoint.on_state)
            except Exception:  # already gone: nothing to stop
                pass
        endpoint.channel.close()


def _stub(channel: grpc.Channel, interceptors: Sequence[Any]) -> Any:
    if interceptors:
        channel = grpc.intercept_channel(channel, *interceptors)
    return pb_grpc.IdempotencyServiceStub(channel)


def aio_endpoints(
    targets: List[str],
    credentials: Optional[grpc.ChannelCredentials],
    options: ChannelOptions,
    interceptors: Sequence[Any],
) -> Endpoints:
    """One grpc.aio.Channel per address; the state is read from the channel."""
    endpoints = []
    for target in targets:
        if credentials is None:
            channel = grpc.aio.insecure_channel(
                target, options=channel_options(options, target), interceptors=list(interceptors) or None
            )
        else:
            channel = grpc.aio.secure_channel(
                target,
                credentials,
                options=channel_options(options, target),
                interceptors=list(interceptors) or None,
            )
        endpoints.append(_Endpoint(target, channel, pb_grpc.IdempotencyServiceStub(channel)))
    if len(endpoints) > 1:
        for endpoint in endpoints:
            endpoint.channel.get_state(try_to_connect=True)
    return Endpoints(endpoints, lambda endpoint: endpoint.channel.get_state(try_to_connect=True))


def aio_channel_endpoints(channel: Any, interceptors: Sequence[Any] = ()) -> Endpoints:
    """The caller's own grpc.aio channel, as it is: grpc.aio takes interceptors
    when a channel is made, so they cannot be added to this one."""
    if interceptors:
        raise TypeError("interceptors go with a target; add them to your own channel yourself")
    return Endpoints(
        [_Endpoint("<channel>", channel, pb_grpc.IdempotencyServiceStub(channel))], lambda _: None
    )


async def close_aio(endpoints: Endpoints) -> None:
    for channel in endpoints.channels:
        await channel.close()
