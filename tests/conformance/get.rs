//! Get: an unknown key is absent; namespaces and keys are compared byte for
//! byte.

use crate::support::*;

pub async fn get_reports_absent_for_an_unknown_key(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let record = get(&mut client, "nobody").await;
    assert_eq!(state(&record), State::Absent);
    assert_eq!(record.fencing_token, 0);
    assert_eq!(record.expires_at, None);
    assert_eq!(record.created_at, None);
}

pub async fn namespaces_and_keys_are_compared_byte_for_byte(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    // Case, trailing space, Unicode normal forms, and separators that would
    // collide if namespace and key were joined into one string.
    let pairs = [
        ("ns", "Key"),
        ("ns", "key"),
        ("ns", "key "),
        ("ns", "caf\u{e9}"),
        ("ns", "cafe\u{301}"),
        ("ns/a", "b"),
        ("ns", "a/b"),
        ("NS", "key"),
    ];
    for (namespace, key) in pairs {
        let c = client
            .claim(claim_request(namespace, key))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(outcome(&c), Outcome::Claimed, "{namespace:?}/{key:?}");
        assert_eq!(c.fencing_token, 1);
    }
}
