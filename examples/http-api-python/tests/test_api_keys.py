"""API keys are compared in constant time (issue 33, defect 11): the
presented key's SHA-256 against every configured key's with
hmac.compare_digest, never a dict lookup or == on the secret, which stop at
the first differing byte. No server needed: the comparison itself."""

from __future__ import annotations

import hmac

import pytest

import app


@pytest.fixture
def config(monkeypatch):
    monkeypatch.setenv("API_KEYS", "sk_test_a=acct_a,sk_test_b=acct_b,sk_live_c=acct_c")
    return app.Config.from_env()


@pytest.mark.parametrize("presented, principal", [
    ("sk_test_a", "acct_a"), ("sk_live_c", "acct_c"),
    ("sk_test_", None), ("sk_test_a ", None), ("sk_test_ab", None), ("", None), ("sk_test_\u00e9", None),
])
def test_every_key_is_compared_with_compare_digest_whatever_matches(config, monkeypatch, presented, principal):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert app.principal_for(config.api_keys, presented) == principal
    # Every configured key, each time, digests of one length: no early exit,
    # and the time does not depend on the presented key's length either.
    assert calls == [(32, 32)] * 3


def test_the_configuration_keeps_digests_not_keys(config):
    assert "sk_test_a" not in repr(config) and "sk_live_c" not in repr(config)
    assert sorted(principal for _, principal in config.api_keys) == ["acct_a", "acct_b", "acct_c"]
