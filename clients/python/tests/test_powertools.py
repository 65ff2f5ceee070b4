"""idempotency_client.powertools against the real aws-lambda-powertools package
(the pinned `powertools` extra) and a real server: Powertools' documented
behaviours (in progress, completed, expired, payload mismatch, a handler
that raises), a concurrent duplicate that waits for the result, a lost lease
refused, and a Lambda-style handler run twice concurrently with one effect."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from aws_lambda_powertools.utilities.idempotency import (
    IdempotencyConfig,
    idempotent,
    idempotent_function,
)
from aws_lambda_powertools.utilities.idempotency.exceptions import (
    IdempotencyAlreadyInProgressError,
    IdempotencyPersistenceLayerError,
    IdempotencyValidationError,
)

from idempotency_client import IdempotencyClient, LeaseNotCurrent, State
from idempotency_client.powertools import IdempotencyServicePersistenceLayer
from interceptors import Counting
from poll import until

pytestmark = pytest.mark.filterwarnings(
    # idempotent_function without a Lambda context: Powertools warns that it
    # cannot tell the remaining time (the layer then uses its lease_ttl).
    "ignore:Couldn't determine the remaining time left:UserWarning"
)


class LambdaContext:
    """What the Lambda runtime hands a handler, as far as Powertools reads it."""

    function_name = "orders"
    memory_limit_in_mb = 128
    invoked_function_arn = "arn:aws:lambda:eu-west-1:123456789012:function:orders"
    aws_request_id = "req"

    def __init__(self, timeout_ms=30_000):
        self._deadline = time.monotonic() + timeout_ms / 1000

    def get_remaining_time_in_millis(self):
        return int((self._deadline - time.monotonic()) * 1000)


class Effect:
    """A function's effect, counted (thread-safe), with the fencing token of
    the lease it ran under."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runs = []

    def apply(self, what, fencing_token=None):
        with self.lock:
            self.runs.append((what, fencing_token))
            return len(self.runs)


@pytest.fixture
def layer(client, namespace):
    return IdempotencyServicePersistenceLayer(client, namespace=namespace, wait=0)


def test_completed_result_is_replayed(layer, client, namespace):
    effect = Effect()
    config = IdempotencyConfig(event_key_jmespath="order_id")

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=config)
    def place(order):
        lease = layer.held_lease()
        effect.apply(order["order_id"], lease.fencing_token)
        return {"order": order["order_id"], "fencing_token": lease.fencing_token}

    first = place(order={"order_id": "o-1", "amount": 10})
    again = place(order={"order_id": "o-1", "amount": 10})
    assert first == {"order": "o-1", "fencing_token": 1}
    assert again == first
    assert effect.runs == [("o-1", 1)]
    assert layer.held_lease() is None
    key = layer._get_hashed_idempotency_key({"order_id": "o-1", "amount": 10})
    record = client.get(namespace, key)
    assert record.state is State.COMPLETED
    assert record.response == b'{"fencing_token": 1, "order": "o-1"}'
    assert record.fingerprint == b""  # no payload_validation_jmespath


def test_in_progress_duplicate_without_wait_raises(layer, client, namespace):
    effect = Effect()
    entered, finish = threading.Event(), threading.Event()

    @idempotent(persistence_store=layer, config=IdempotencyConfig(event_key_jmespath="id"))
    def handler(event, context):
        effect.apply(event["id"])
        entered.set()
        assert finish.wait(10)
        return {"done": event["id"]}

    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(handler, {"id": "e-1"}, LambdaContext())
        assert entered.wait(10)
        with pytest.raises(IdempotencyAlreadyInProgressError):
            handler({"id": "e-1"}, LambdaContext())
        finish.set()
        assert holder.result(10) == {"done": "e-1"}
    assert handler({"id": "e-1"}, LambdaContext()) == {"done": "e-1"}
    assert effect.runs == [("e-1", None)]


@pytest.mark.postgres
def test_concurrent_duplicate_waits_for_the_result(server, namespace):
    counting = Counting()
    with IdempotencyClient(server.target, interceptors=[counting]) as client:
        layer = IdempotencyServicePersistenceLayer(client, namespace=namespace, wait=10)
        effect = Effect()
        entered, finish = threading.Event(), threading.Event()

        @idempotent(persistence_store=layer, config=IdempotencyConfig(event_key_jmespath="id"))
        def handler(event, context):
            effect.apply(event["id"])
            entered.set()
            assert finish.wait(10)
            return {"done": event["id"]}

        with ThreadPoolExecutor(2) as pool:
            holder = pool.submit(handler, {"id": "e-2"}, LambdaContext())
            assert entered.wait(10)
            duplicate = pool.submit(handler, {"id": "e-2"}, LambdaContext())
            until(lambda: counting.sent("Claim") == 2, what="the duplicate's Claim")
            time.sleep(0.3)  # the Claim reaches the server and waits there
            assert not duplicate.done()
            finish.set()
            assert holder.result(10) == {"done": "e-2"}
            assert duplicate.result(10) == {"done": "e-2"}
        assert effect.runs == [("e-2", None)]
        waiting = counting.requests[1][1]
        assert counting.requests[1][0] == "Claim" and waiting.HasField("wait")
        assert client.server_waits is True
        # Two Claims and one Complete: the duplicate neither polled nor ran.
        assert [method for method, _ in counting.requests] == ["Claim", "Claim", "Complete"]


def test_waiting_duplicate_takes_the_key_when_the_holder_raises(server, namespace):
    with IdempotencyClient(server.target) as client:
        layer = IdempotencyServicePersistenceLayer(client, namespace=namespace, wait=10)
        effect = Effect()
        entered, finish = threading.Event(), threading.Event()

        @idempotent(persistence_store=layer, config=IdempotencyConfig(event_key_jmespath="id"))
        def handler(event, context):
            run = effect.apply(event["id"], layer.held_lease().fencing_token)
            if run == 1:
                entered.set()
                assert finish.wait(10)
                raise RuntimeError("first attempt fails")
            return {"run": run}

        with ThreadPoolExecutor(2) as pool:
            holder = pool.submit(handler, {"id": "e-3"}, LambdaContext())
            assert entered.wait(10)
            duplicate = pool.submit(handler, {"id": "e-3"}, LambdaContext())
            time.sleep(0.3)
            finish.set()
            with pytest.raises(RuntimeError, match="first attempt fails"):
                holder.result(10)
            assert duplicate.result(10) == {"run": 2}
        assert effect.runs == [("e-3", 1), ("e-3", 2)]


def test_handler_that_raises_releases_the_key(layer, client, namespace):
    effect = Effect()
    config = IdempotencyConfig(event_key_jmespath="id")

    @idempotent(persistence_store=layer, config=config)
    def handler(event, context):
        run = effect.apply(event["id"], layer.held_lease().fencing_token)
        if run == 1:
            raise ValueError("downstream refused")
        return {"run": run}

    with pytest.raises(ValueError, match="downstream refused"):
        handler({"id": "e-4"}, LambdaContext())
    key = layer._get_hashed_idempotency_key({"id": "e-4"})
    assert client.get(namespace, key).state is State.RELEASED
    assert layer.held_lease() is None
    assert handler({"id": "e-4"}, LambdaContext()) == {"run": 2}
    assert handler({"id": "e-4"}, LambdaContext()) == {"run": 2}
    assert effect.runs == [("e-4", 1), ("e-4", 2)]


def test_payload_mismatch_is_a_validation_error(layer, client, namespace):
    effect = Effect()
    config = IdempotencyConfig(event_key_jmespath="order_id", payload_validation_jmespath="amount")

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=config)
    def place(order):
        effect.apply(order["amount"])
        return {"charged": order["amount"]}

    assert place(order={"order_id": "o-5", "amount": 10}) == {"charged": 10}
    assert place(order={"order_id": "o-5", "amount": 10}) == {"charged": 10}
    with pytest.raises(IdempotencyValidationError):
        place(order={"order_id": "o-5", "amount": 11})
    assert effect.runs == [(10, None)]
    # The fingerprint is Powertools' payload hash (md5 of the amount), as bytes.
    key = layer._get_hashed_idempotency_key({"order_id": "o-5"})
    record = client.get(namespace, key)
    assert record.fingerprint.hex() == layer._get_hashed_payload({"amount": 10})
    assert len(record.fingerprint) == 16


def test_expired_result_runs_again(layer, client, namespace):
    effect = Effect()
    config = IdempotencyConfig(event_key_jmespath="id", expires_after_seconds=1)

    @idempotent(persistence_store=layer, config=config)
    def handler(event, context):
        lease = layer.held_lease()
        return {"run": effect.apply(event["id"], lease.fencing_token), "fencing_token": lease.fencing_token}

    assert handler({"id": "e-6"}, LambdaContext()) == {"run": 1, "fencing_token": 1}
    assert handler({"id": "e-6"}, LambdaContext()) == {"run": 1, "fencing_token": 1}
    key = layer._get_hashed_idempotency_key({"id": "e-6"})
    until(lambda: client.get(namespace, key).state is State.ABSENT, timeout=5, what="the result to expire")
    assert handler({"id": "e-6"}, LambdaContext()) == {"run": 2, "fencing_token": 2}
    assert effect.runs == [("e-6", 1), ("e-6", 2)]


def test_expired_result_refused_when_late_retries_are(client, namespace):
    layer = IdempotencyServicePersistenceLayer(client, namespace=namespace, wait=0, late_retry="refuse")
    config = IdempotencyConfig(event_key_jmespath="id", expires_after_seconds=1)
    effect = Effect()

    @idempotent(persistence_store=layer, config=config)
    def handler(event, context):
        return {"run": effect.apply(event["id"])}

    assert handler({"id": "e-7"}, LambdaContext()) == {"run": 1}
    key = layer._get_hashed_idempotency_key({"id": "e-7"})
    until(lambda: client.get(namespace, key).state is State.ABSENT, timeout=5, what="the result to expire")
    with pytest.raises(IdempotencyPersistenceLayerError) as raised:
        handler({"id": "e-7"}, LambdaContext())
    assert type(raised.value.__cause__).__name__ == "ResultExpired"
    assert effect.runs == [("e-7", None)]


def test_lost_lease_is_fenced(layer, client, namespace):
    """The lease ends with the invocation's remaining time; once it ran out
    and another invocation took the key, the first one's result is refused."""
    effect = Effect()
    entered, finish = threading.Event(), threading.Event()

    @idempotent(persistence_store=layer, config=IdempotencyConfig(event_key_jmespath="id"))
    def handler(event, context):
        lease = layer.held_lease()
        effect.apply(event["id"], lease.fencing_token)
        if lease.fencing_token == 1:
            entered.set()
            assert finish.wait(10)
        return {"fencing_token": lease.fencing_token}

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(handler, {"id": "e-8"}, LambdaContext(timeout_ms=1000))
        assert entered.wait(10)
        key = layer._get_hashed_idempotency_key({"id": "e-8"})
        lease_end = client.get(namespace, key).lease_expires_at.timestamp()
        time.sleep(max(0.0, lease_end - time.time()) + 0.1)
        assert handler({"id": "e-8"}, LambdaContext()) == {"fencing_token": 2}
        finish.set()
        with pytest.raises(IdempotencyPersistenceLayerError) as raised:
            slow.result(10)
    assert isinstance(raised.value.__cause__, LeaseNotCurrent)
    assert effect.runs == [("e-8", 1), ("e-8", 2)]
    assert client.get(namespace, key).response == b'{"fencing_token": 2}'


@pytest.mark.postgres
def test_lambda_handler_run_twice_concurrently_has_one_effect(server, namespace):
    """Two deliveries of one event at once, each on its own client as two
    Lambda instances would be: one runs, the other waits and replays."""
    ledger = {}
    ledger_lock = threading.Lock()
    effect = Effect()
    start = threading.Barrier(2)

    def instance():
        client = IdempotencyClient(server.target)
        layer = IdempotencyServicePersistenceLayer(client, namespace=namespace, wait=10)

        @idempotent(
            persistence_store=layer,
            config=IdempotencyConfig(event_key_jmespath="detail.payment_id", payload_validation_jmespath="detail"),
        )
        def handler(event, context):
            fencing_token = layer.held_lease().fencing_token
            time.sleep(0.3)  # the charge takes a while
            with ledger_lock:  # the downstream write refuses an older fencing token
                payment = event["detail"]["payment_id"]
                if ledger.get(payment, (0,))[0] < fencing_token:
                    ledger[payment] = (fencing_token, event["detail"]["amount"])
            effect.apply(payment, fencing_token)
            return {"statusCode": 200, "charged": event["detail"]["amount"], "fencing_token": fencing_token}

        def invoke(event):
            start.wait(10)
            try:
                return handler(event, LambdaContext(timeout_ms=15_000))
            finally:
                client.close()

        return invoke

    event = {"detail": {"payment_id": "pay-9", "amount": 1299}}
    with ThreadPoolExecutor(2) as pool:
        results = [future.result(20) for future in [pool.submit(instance(), event), pool.submit(instance(), event)]]
    assert results == [{"statusCode": 200, "charged": 1299, "fencing_token": 1}] * 2
    assert effect.runs == [("pay-9", 1)]
    assert ledger == {"pay-9": (1, 1299)}


def test_readme_example_runs(server, namespace):
    """The snippet of README.md's "Powertools for AWS Lambda", run as written
    (its address and namespace pointed at the test's server)."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Powertools for AWS Lambda\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```\n", section, re.M | re.S)
    assert code.count('"dns:///idempotency.internal:50051"') == 1 and code.count('"payments"') == 1
    code = code.replace('"dns:///idempotency.internal:50051"', repr(server.target))
    code = code.replace('"payments"', repr(namespace))
    charges = []
    scope = {"charge": lambda detail, fencing_token: charges.append((detail["payment_id"], fencing_token))}
    exec(compile(code, "README.md", "exec"), scope)
    event = {"detail": {"payment_id": "pay-1", "amount": 500}}
    assert scope["handler"](event, LambdaContext()) == {"statusCode": 200}
    assert scope["handler"](event, LambdaContext()) == {"statusCode": 200}
    assert charges == [("pay-1", 1)]
    scope["persistence"].client.close()
