//! The hash the store groups a batch's keys by on Citus (shards.rs) is
//! PostgreSQL's `hashtext`, which Citus places text keys with
//! (`worker_hash(key) = hashtext(key)`): compared here, without Citus, with
//! the hashtext of the PostgreSQL the suites use, over keys of every length
//! from 0 to 80 bytes (every tail length of the hash's 12-byte blocks), in
//! ASCII and in UTF-8 of several widths. A wrong hash would not make an
//! answer wrong (each group is routed by Citus), but every batch would pay
//! a hop per key.

use idempotency_service::store::postgres::hashtext;
use sqlx::Connection;

#[tokio::test]
async fn the_rust_hash_is_postgresqls_hashtext() {
    let url = std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let mut connection = sqlx::PgConnection::connect(&url)
        .await
        .expect("TEST_POSTGRES_URL: a PostgreSQL to compare with");
    let alphabets = [
        "abcdefghijklmnopqrstuvwxyz0123456789-_:",
        "éüß€漢字🦀 ",
        "\u{7f}~!@#$%^&*()",
    ];
    let mut keys = Vec::new();
    for (a, alphabet) in alphabets.iter().enumerate() {
        let chars: Vec<char> = alphabet.chars().collect();
        for length in 0..=80usize {
            let key: String = (0..length)
                .map(|i| chars[(i * 7 + length * 3 + a) % chars.len()])
                .collect();
            keys.push(key);
        }
    }
    keys.extend((0..500).map(|i| format!("evt-{i:06}")));
    let theirs: Vec<i32> = sqlx::query_scalar(
        "SELECT hashtext(k) FROM unnest($1::text[]) WITH ORDINALITY AS u(k, o) ORDER BY o",
    )
    .bind(&keys)
    .fetch_all(&mut connection)
    .await
    .expect("hashtext");
    assert_eq!(theirs.len(), keys.len());
    let mut lengths = std::collections::BTreeSet::new();
    for (key, theirs) in keys.iter().zip(theirs) {
        assert_eq!(
            hashtext(key.as_bytes()),
            theirs,
            "key {key:?} ({} bytes)",
            key.len()
        );
        lengths.insert(key.len() % 12);
    }
    assert_eq!(lengths.len(), 12, "every tail length was compared");
}
