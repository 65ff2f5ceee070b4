"""The asyncio client and its once(), against a real server."""

import asyncio
import re
import time

import pytest

from idempotency_client import (
    AsyncIdempotencyClient,
    FingerprintMismatch,
    InProgress,
    InvalidArgument,
    KeyNotFound,
    LeaseLost,
    LeaseNotCurrent,
    Outcome,
    State,
    Unavailable,
    derive_key,
    fingerprint,
)
from idempotency_client.testing import free_port
from poll import until_async


@pytest.fixture
async def other(server):
    async with AsyncIdempotencyClient(server.target) as client:
        yield client


@pytest.mark.postgres
async def test_the_rpcs_return_typed_results_for_each_outcome(aclient, other, namespace):
    claim = await aclient.claim(namespace, "k", lease_ttl=30, fingerprint=b"fp")
    assert claim.outcome is Outcome.CLAIMED and re.fullmatch(r"[0-9a-f]{32}", claim.lease_token)

    busy = await other.claim(namespace, "k")
    assert busy.outcome is Outcome.IN_PROGRESS and busy.retry_after.total_seconds() > 0

    extended = await aclient.extend_lease(namespace, "k", claim.lease_token, lease_ttl=60)
    assert extended.lease_expires_at > claim.lease_expires_at

    await aclient.complete(namespace, "k", claim.lease_token, b"r")
    replay = await other.claim(namespace, "k", fingerprint=b"fp")
    assert replay.outcome is Outcome.COMPLETED and replay.response == b"r"

    mismatch = await other.claim(namespace, "k", fingerprint=b"other")
    assert mismatch.outcome is Outcome.FINGERPRINT_MISMATCH

    record = await aclient.get(namespace, "k")
    assert record.state is State.COMPLETED and record.fencing_token == 1


async def test_the_rpcs_raise_typed_errors(aclient, namespace):
    with pytest.raises(InvalidArgument, match="namespace"):
        await aclient.claim("", "k")
    with pytest.raises(KeyNotFound):
        await aclient.release(namespace, "nope", "0" * 32)
    claim = await aclient.claim(namespace, "k")
    await aclient.release(namespace, "k", claim.lease_token)
    await aclient.claim(namespace, "k")
    with pytest.raises(LeaseNotCurrent):
        await aclient.complete(namespace, "k", claim.lease_token, b"")


async def test_an_unreachable_server_raises_unavailable():
    async with AsyncIdempotencyClient(f"127.0.0.1:{free_port()}", timeout=2) as client:
        with pytest.raises(Unavailable):
            await client.get("ns", "k")


@pytest.mark.postgres
async def test_a_duplicate_delivery_replays_without_running_the_coroutine(aclient, namespace):
    calls = []

    async def charge(amount):
        calls.append(amount)
        await asyncio.sleep(0)
        return {"charged": amount}

    first = await aclient.once(namespace, "evt-1").run(charge, 100)
    async with aclient.once(namespace, "evt-1") as run:
        second = await run(charge, 999)

    assert first == second == {"charged": 100}
    assert run.replayed
    assert calls == [100]


@pytest.mark.postgres
async def test_an_exception_in_the_work_releases_the_key_and_the_next_attempt_succeeds(aclient, namespace):
    async def failing():
        raise ConnectionError("downstream down")

    with pytest.raises(ConnectionError):
        await aclient.once(namespace, "evt-1").run(failing)

    assert (await aclient.get(namespace, "evt-1")).state is State.RELEASED
    assert await aclient.once(namespace, "evt-1").run(lambda: "ok") == "ok"  # a plain function too
    assert (await aclient.get(namespace, "evt-1")).fencing_token == 2


async def test_a_fingerprint_mismatch_raises(aclient, namespace):
    await aclient.once(namespace, "evt-1", fingerprint=fingerprint(b"body-1")).run(lambda: 1)

    with pytest.raises(FingerprintMismatch):
        await aclient.once(namespace, "evt-1", fingerprint=fingerprint(b"body-2")).run(lambda: 2)


async def test_in_progress_raises_or_waits_for_the_other_claimant(aclient, other, namespace):
    claim = await other.claim(namespace, "evt-1", lease_ttl=30)

    with pytest.raises(InProgress) as raised:
        await aclient.once(namespace, "evt-1", on_in_progress="raise").run(lambda: "mine")
    assert raised.value.retry_after.total_seconds() > 0

    with pytest.raises(InProgress, match="still in progress"):
        await aclient.once(namespace, "evt-1", wait_timeout=0.3).run(lambda: "mine")

    async def complete_later():
        await asyncio.sleep(0.3)
        await other.complete(namespace, "evt-1", claim.lease_token, b'"theirs"')

    completer = asyncio.ensure_future(complete_later())
    started = time.monotonic()
    assert await aclient.once(namespace, "evt-1", wait_timeout=10).run(lambda: "mine") == "theirs"
    await completer
    assert time.monotonic() - started < 5


@pytest.mark.postgres
async def test_a_lease_lost_to_another_claimant_raises_lease_lost(aclient, other, namespace):
    async def taken_over():
        return (await other.claim(namespace, "evt-1", lease_ttl=30)).claimed

    with pytest.raises(LeaseLost) as raised:
        async with aclient.once(namespace, "evt-1", lease_ttl=1, heartbeat=False) as run:
            await until_async(taken_over, what="another claimant to take the expired lease")
            run.set_result("too late")

    assert isinstance(raised.value.__cause__, LeaseNotCurrent)
    assert (await aclient.get(namespace, "evt-1")).state is State.IN_PROGRESS


async def test_the_heartbeat_keeps_the_lease_alive_and_notices_when_it_is_lost(aclient, other, namespace):
    async def long_work():
        for _ in range(15):  # 3 s: one and a half leases of 2 s
            assert (await other.claim(namespace, "kept")).outcome is Outcome.IN_PROGRESS
            await asyncio.sleep(0.2)
        return "done"

    assert await aclient.once(namespace, "kept", lease_ttl=2).run(long_work) == "done"
    assert (await aclient.get(namespace, "kept")).fencing_token == 1

    async def lost():
        return run.lease_lost

    with pytest.raises(LeaseLost):
        async with aclient.once(namespace, "lost", lease_ttl=2, heartbeat_interval=0.1) as run:
            await other.release(namespace, "lost", run.claim.lease_token)
            assert (await other.claim(namespace, "lost")).claimed
            await until_async(lost, what="the heartbeat to notice")
            run.set_result("must not be stored")
    assert (await aclient.get(namespace, "lost")).state is State.IN_PROGRESS


async def test_the_decorator_wraps_a_coroutine_function_once_per_derived_key(aclient, namespace):
    calls = []

    @aclient.once(namespace, key=lambda order_id: derive_key("orders", order_id))
    async def ship(order_id):
        calls.append(order_id)
        return f"shipped {order_id}"

    assert await ship("o-1") == "shipped o-1"
    assert await ship("o-1") == "shipped o-1"
    assert await ship("o-2") == "shipped o-2"
    assert calls == ["o-1", "o-2"]
