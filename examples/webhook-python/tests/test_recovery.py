"""What the README and docs/recipes.md promise when things fail around the
effect, against the real binary and the receiver under uvicorn:

- Complete fails (the service crashes after the effect committed): the
  delivery gets 503, the lease stays until it runs out, and the provider's
  retries then take the effect's row over under the next fencing token: the
  effect is not applied twice and the original response is stored.
- The service cannot be reached at all: 503, nothing applied.
- The README's manual walk-through: sign.py's header is accepted.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx

from conftest import EXAMPLE, PROVIDER, SECRET, server_binary, sign
from idempotency_client import IdempotencyClient, State, derive_key
from idempotency_client.testing import free_port, wait_until_serving


class RestartableServer:
    """The binary on a fixed free port and data directory, so it can be
    stopped and started again at the same address (ServerProcess picks a new
    port each time)."""

    def __init__(self, data_dir):
        self.data_dir = data_dir
        self.target = f"127.0.0.1:{free_port()}"
        self.process = None

    def start(self):
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env.update({"IDEMPOTENCY_LISTEN_ADDR": self.target, "IDEMPOTENCY_DATA_DIR": str(self.data_dir),
                    "IDEMPOTENCY_METRICS_ADDR": ""})
        log = open(self.data_dir / "server.log", "ab")
        self.process = subprocess.Popen([str(server_binary())], env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_until_serving(self.target, 30, self.process)

    def kill(self):
        """The service crashes: SIGKILL, so nothing it still had in flight lands."""
        self.process.kill()
        self.process.wait()

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def post(url, body: bytes, timeout=30):
    return httpx.post(f"{url}/webhooks", content=body, timeout=timeout,
                      headers={"Content-Type": "application/json", "Webhook-Signature": sign(body)})


def effect_log(receiver):
    with sqlite3.connect(receiver.database) as db:
        return db.execute("SELECT event_id, fencing_token FROM effect_log ORDER BY seq").fetchall()


def test_complete_fails_then_the_retry_takes_the_effect_over(tmp_path, receiver_factory):
    server = RestartableServer(tmp_path)
    server.start()
    try:
        receiver = receiver_factory(
            {
                "WEBHOOK_LEASE_SECONDS": "2",
                "WEBHOOK_TEST_SLOW_TYPES": "invoice.paid",
                "WEBHOOK_TEST_SLOW_SECONDS": "1.5",
            },
            target=server.target,
        )
        body = json.dumps(
            {"id": "evt_2001", "object": "event", "type": "invoice.paid", "created": 1764621000,
             "data": {"customer": "cus_Z", "amount": 4100, "currency": "eur"}},
            separators=(",", ":"),
        ).encode()

        # The first delivery claims and sleeps in the handler; the service
        # goes away meanwhile, so its Complete cannot land.
        answer = {}
        first = threading.Thread(target=lambda: answer.update(response=post(receiver.url, body)))
        first.start()
        deadline = time.monotonic() + 10
        with IdempotencyClient(server.target) as client:
            key = derive_key(PROVIDER, "evt_2001")
            while client.get(receiver.namespace, key).state is not State.IN_PROGRESS:
                assert time.monotonic() < deadline, "the first delivery never claimed"
                time.sleep(0.02)
        server.kill()
        first.join(30)
        response = answer["response"]
        assert response.status_code == 503, response.text
        assert response.json() == {"error": "unavailable", "detail": "deduplication is unavailable; retry",
                                   "event_id": "evt_2001"}
        assert response.headers["Retry-After"] == "5"
        # The effect itself committed, under the first lease.
        assert effect_log(receiver) == [("evt_2001", 1)]

        # The service comes back; the provider retries until it gets a 2xx.
        server.start()
        statuses = []
        deadline = time.monotonic() + 30
        while True:
            response = post(receiver.url, body)
            statuses.append(response.status_code)
            if response.status_code == 200:
                break
            assert response.status_code == 503, response.text
            assert response.json()["error"] in ("in_progress", "unavailable"), response.text
            assert time.monotonic() < deadline, statuses
            time.sleep(0.2)
        # Until the first lease ran out (2 s) the retries were told to wait;
        # then one took the key over and found the effect's row.
        assert "Idempotent-Replayed" not in response.headers
        stored = {"result": "applied", "event_id": "evt_2001", "type": "invoice.paid", "customer": "cus_Z",
                  "amount": 4100, "fencing_token": 1}
        assert response.json() == stored
        assert effect_log(receiver) == [("evt_2001", 1)]
        with sqlite3.connect(receiver.database) as db:
            assert db.execute("SELECT balance FROM balances WHERE customer = 'cus_Z'").fetchone() == (4100,)
            assert db.execute("SELECT fencing_token FROM payments").fetchall() == [(2,)]

        replay = post(receiver.url, body)
        assert replay.status_code == 200
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.content == response.content
        with IdempotencyClient(server.target) as client:
            record = client.get(receiver.namespace, derive_key(PROVIDER, "evt_2001"))
            assert record.state is State.COMPLETED and record.fencing_token == 2
    finally:
        server.stop()


def test_without_the_service_nothing_is_applied(tmp_path, receiver_factory):
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    receiver = receiver_factory(target=nobody)
    body = b'{"id":"evt_3001","type":"payment.succeeded","data":{"customer":"cus_Y","amount":5}}'
    response = post(receiver.url, body)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert response.json()["error"] == "unavailable"
    assert effect_log(receiver) == []


def test_sign_py_as_the_readme_uses_it(tmp_path, receiver_factory):
    receiver = receiver_factory()
    event = tmp_path / "event.json"
    event.write_bytes(b'{"id":"evt_4001","type":"payment.succeeded","data":{"customer":"cus_X","amount":42}}\n')
    header = subprocess.run(
        [sys.executable, "sign.py", "--secret", SECRET, str(event)],
        cwd=EXAMPLE, check=True, capture_output=True, text=True,
    ).stdout.strip()
    response = httpx.post(f"{receiver.url}/webhooks", content=event.read_bytes(), timeout=30,
                          headers={"Content-Type": "application/json", "Webhook-Signature": header})
    assert response.status_code == 200, response.text
    assert response.json() == {"result": "applied", "event_id": "evt_4001", "type": "payment.succeeded",
                               "customer": "cus_X", "amount": 42, "fencing_token": 1}
