"""A gRPC relay that makes a server look as if it predated ClaimRequest.wait:
it forwards every call to the real server unchanged (bytes in, bytes out,
with the caller's metadata and deadline), except that it clears the `wait`
field of each Claim, so the field never takes effect, and the server, which
was not asked to wait, leaves ClaimResponse.waited unset. That is exactly
what a server built before the field does with it. CI has no old server
binary; this relay stands in for one in the tests of the helpers' fallback to
polling."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from idempotency_client._proto import idempotency_pb2 as pb

CLAIM = "/idempotency.v1.IdempotencyService/Claim"


class WaitClearingRelay(grpc.GenericRpcHandler):
    """`with WaitClearingRelay(server.target) as relay:` then call
    `relay.target`. `claims` counts the Claims relayed and
    `claims_asking_to_wait` those that carried a wait (cleared on the way)."""

    def __init__(self, upstream: str):
        self._upstream = grpc.insecure_channel(upstream)
        self._lock = threading.Lock()
        self.claims = 0
        self.claims_asking_to_wait = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        self._server.add_generic_rpc_handlers([self])
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{port}"
        self._server.start()

    def __enter__(self) -> "WaitClearingRelay":
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.stop(grace=None)
        self._upstream.close()

    def service(self, handler_call_details):
        method = handler_call_details.method

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            if method == CLAIM:
                request = self._cleared(request)
            metadata = [(k, v) for k, v in context.invocation_metadata() if not k.startswith("grpc-")]
            try:
                return self._upstream.unary_unary(method)(
                    request, timeout=context.time_remaining(), metadata=metadata
                )
            except grpc.RpcError as error:
                context.abort(error.code(), error.details())

        return grpc.unary_unary_rpc_method_handler(forward)

    def _cleared(self, request: bytes) -> bytes:
        claim = pb.ClaimRequest.FromString(request)
        with self._lock:
            self.claims += 1
            if claim.HasField("wait"):
                self.claims_asking_to_wait += 1
        claim.ClearField("wait")
        return claim.SerializeToString()
