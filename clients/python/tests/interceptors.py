"""Client interceptors for the retry tests: they count attempts, and lose an
answer on purpose (the call reached the server, which did the work; the
caller sees UNAVAILABLE instead of the answer), as a dropped connection or a
replica that dies after committing would."""

import threading

import grpc
import grpc.aio

DROPPED = "the answer was dropped on purpose by the test"


def method_name(details) -> str:
    method = details.method
    if isinstance(method, bytes):
        method = method.decode()
    return method.rsplit("/", 1)[-1]


class _DroppedAnswer(grpc.RpcError, grpc.Call, grpc.Future):
    """What the sync stub gets instead of the answer: UNAVAILABLE."""

    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, details=DROPPED):
        super().__init__()
        self._code = code
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def cancelled(self):
        return False

    def running(self):
        return False

    def done(self):
        return True

    def result(self, timeout=None):
        raise self

    def exception(self, timeout=None):
        return self

    def traceback(self, timeout=None):
        return None

    def add_callback(self, callback):
        return False

    def add_done_callback(self, fn):
        fn(self)


class Recorder:
    """What the interceptors saw: (method, status code) per attempt, the
    requests as they were sent (method, request), and the answers they
    dropped."""

    def __init__(self):
        self._lock = threading.Lock()
        self.attempts = []
        self.requests = []
        self.dropped = []

    def record(self, method, code):
        with self._lock:
            self.attempts.append((method, code))

    def record_request(self, method, request):
        with self._lock:
            self.requests.append((method, request))

    def sent(self, method=None):
        """Attempts sent so far (answered or not), of `method` or of all."""
        with self._lock:
            return sum(1 for seen, _ in self.requests if method is None or seen == method)

    def count(self, method=None, code=None):
        with self._lock:
            return sum(
                1
                for seen_method, seen_code in self.attempts
                if (method is None or seen_method == method) and (code is None or seen_code == code)
            )


class Counting(grpc.UnaryUnaryClientInterceptor, Recorder):
    """Counts every attempt with its outcome, and keeps every request as it
    is sent (sync channels)."""

    def __init__(self):
        Recorder.__init__(self)

    def intercept_unary_unary(self, continuation, details, request):
        self.record_request(method_name(details), request)
        outcome = continuation(details, request)
        self.record(method_name(details), outcome.code())
        return outcome


class DropAnswers(grpc.UnaryUnaryClientInterceptor, Recorder):
    """Lets the first `times` calls of `method` reach the server and answer,
    keeps their answers in `dropped`, and raises UNAVAILABLE to the caller
    instead (sync channels). Every attempt is counted."""

    def __init__(self, method, times=1):
        Recorder.__init__(self)
        self.method = method
        self.times = times

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        name = method_name(details)
        with self._lock:
            drop = name == self.method and len(self.dropped) < self.times and outcome.code() == grpc.StatusCode.OK
            if drop:
                self.dropped.append(outcome.result())
        if drop:
            self.record(name, grpc.StatusCode.UNAVAILABLE)
            return _DroppedAnswer()
        self.record(name, outcome.code())
        return outcome


class FailCalls(grpc.UnaryUnaryClientInterceptor, Recorder):
    """Fails every call of `method` with `code` without sending it (sync)."""

    def __init__(self, method, code=grpc.StatusCode.UNAVAILABLE):
        Recorder.__init__(self)
        self.method = method
        self.code = code

    def intercept_unary_unary(self, continuation, details, request):
        name = method_name(details)
        if name == self.method:
            self.record(name, self.code)
            return _DroppedAnswer(self.code, "failed on purpose by the test")
        outcome = continuation(details, request)
        self.record(name, outcome.code())
        return outcome


class AsyncCounting(grpc.aio.UnaryUnaryClientInterceptor, Recorder):
    def __init__(self):
        Recorder.__init__(self)

    async def intercept_unary_unary(self, continuation, details, request):
        self.record_request(method_name(details), request)
        call = await continuation(details, request)
        self.record(method_name(details), await call.code())
        return call


class AsyncDropAnswers(grpc.aio.UnaryUnaryClientInterceptor, Recorder):
    """DropAnswers for grpc.aio channels."""

    def __init__(self, method, times=1):
        Recorder.__init__(self)
        self.method = method
        self.times = times

    async def intercept_unary_unary(self, continuation, details, request):
        call = await continuation(details, request)
        name = method_name(details)
        code = await call.code()
        if name == self.method and len(self.dropped) < self.times and code == grpc.StatusCode.OK:
            self.dropped.append(await call)
            self.record(name, grpc.StatusCode.UNAVAILABLE)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=DROPPED
            )
        self.record(name, code)
        return call


class BeforeFirst(grpc.UnaryUnaryClientInterceptor, Recorder):
    """Runs `action` once, right before the first call of `method` is sent
    (after the client chose the channel for it); counts every attempt."""

    def __init__(self, method, action):
        Recorder.__init__(self)
        self.method = method
        self.action = action
        self.done = False

    def intercept_unary_unary(self, continuation, details, request):
        name = method_name(details)
        if name == self.method and not self.done:
            self.done = True
            self.action()
        outcome = continuation(details, request)
        self.record(name, outcome.code())
        return outcome
