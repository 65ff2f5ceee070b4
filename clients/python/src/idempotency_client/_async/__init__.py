"""The clients' calls and their once(): _async/ is the source, written for
asyncio; _sync/ is generated from it by clients/python/gen_sync.py (unasync)
and committed. Users import them from idempotency_client (or its client, aio
and once modules), never from here."""
