"""One process of duplicates for bench/wait.sh (run.py starts several).

    python duplicates.py --target 127.0.0.1:PORT --namespace NS --count N [--connections C]

Opens C HTTP/2 connections to the server, says {"ready": ...} on stdout, then
reads one JSON command a line on stdin:
    {"round": i, "mode": "wait" | "poll", "key": K, "expected": HEX}
starts N duplicates of key K at once (duplicate j on connection j % C), and
when all have their final answer writes one line:
    {"round": i, "cpu_start": s, "cpu_end": s, "answers": [calls.Answer.report()...]}
cpu_* are this process's CPU seconds (user + system, every thread: grpcio's
own included), read when the command arrived and after the last answer.
{"quit": true} or the end of stdin stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import grpc
from idempotency.v1 import idempotency_pb2_grpc as pb_grpc

import calls


def say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--connections", type=int, default=1)
    args = parser.parse_args()

    # A local subchannel pool per channel: otherwise grpcio shares one
    # connection between channels to the same address.
    channels = [
        grpc.aio.insecure_channel(args.target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(max(1, args.connections))
    ]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
    stubs = [pb_grpc.IdempotencyServiceStub(channel) for channel in channels]
    say({"ready": True, "pid": os.getpid()})

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        command = json.loads(line)
        if command.get("quit"):
            break
        cpu_start = time.process_time()
        answers = await asyncio.gather(
            *(
                calls.duplicate(stubs[j % len(stubs)], command["mode"], args.namespace, command["key"])
                for j in range(args.count)
            )
        )
        cpu_end = time.process_time()
        expected = bytes.fromhex(command["expected"])
        say(
            {
                "round": command["round"],
                "cpu_start": cpu_start,
                "cpu_end": cpu_end,
                "answers": [answer.report(expected) for answer in answers],
            }
        )
    for channel in channels:
        await channel.close()


if __name__ == "__main__":
    asyncio.run(main())
