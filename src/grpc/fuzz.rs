//! Property tests (proptest), run in CI with a bounded number of cases: the
//! decoding of every request type from arbitrary bytes, and the adapter's
//! validation of arbitrary field values, never panic; what validation lets
//! through keeps the domain's invariants, and what it refuses is
//! INVALID_ARGUMENT naming one of the request's fields.

use proptest::prelude::*;
use prost::Message;

use super::*;

/// Cases per property: enough to explore, few enough for CI (well under a
/// second each in a release build). `PROPTEST_CASES` overrides.
const CASES: u32 = 4096;

fn log() -> CallLog {
    CallLog {
        method: "Fuzz",
        started: Instant::now(),
        namespace: None,
        request_id: None,
        fencing_token: None,
        took_over: false,
        labels: NamespaceLabels::default(),
        caller: Caller(None),
    }
}

/// The field an INVALID_ARGUMENT names, with any `items[i].` prefix removed.
fn field_of(error: &Error) -> String {
    match error {
        Error::InvalidArgument { field, .. } => match field.split_once("].") {
            Some((_, rest)) => rest.to_owned(),
            None => field.to_string(),
        },
        other => panic!("validation gave {other:?}, not INVALID_ARGUMENT"),
    }
}

const FIELDS: &[&str] = &[
    "namespace",
    "key",
    "fingerprint",
    "lease_token",
    "lease_ttl",
    "retention",
    "reason",
];

fn check_refusal(error: Error) {
    let field = field_of(&error);
    assert!(FIELDS.contains(&field.as_str()), "unknown field {field:?}");
}

fn check_claim(request: lifecycle::ClaimRequest) {
    assert!((1..=128).contains(&request.namespace.as_str().len()));
    assert!((1..=512).contains(&request.key.as_str().len()));
    assert!(!request.namespace.as_str().contains('\0'));
    assert!(!request.key.as_str().contains('\0'));
}

/// Decodes `bytes` as a `T` and validates it; bytes that do not decode are
/// the codec's to refuse.
fn decoded<T: Message + Default>(
    bytes: &[u8],
    validate: impl FnOnce(T) -> Result<(), Error>,
) -> Result<(), Error> {
    T::decode(bytes).map_or(Ok(()), validate)
}

/// Runs the adapter's validation of each request type on decoded bytes.
fn validate_any(kind: u8, bytes: &[u8]) {
    let result = match kind % 8 {
        0 => decoded(bytes, |r: proto::ClaimRequest| {
            parse_claim(r).map(check_claim)
        }),
        1 => decoded(bytes, |r: proto::CompleteRequest| {
            parse_complete(r).map(drop)
        }),
        2 => decoded(bytes, |r: proto::ReleaseRequest| {
            namespaced_key(&mut log(), r.namespace, r.key)?;
            LeaseToken::parse(&r.lease_token).map(drop)
        }),
        3 => decoded(bytes, |r: proto::ExtendLeaseRequest| {
            namespaced_key(&mut log(), r.namespace, r.key)?;
            LeaseToken::parse(&r.lease_token)?;
            duration("lease_ttl", r.lease_ttl).map(drop)
        }),
        4 => decoded(bytes, |r: proto::GetRequest| {
            namespaced_key(&mut log(), r.namespace, r.key).map(drop)
        }),
        5 => decoded(bytes, |r: proto::PurgeRequest| {
            namespaced_key(&mut log(), r.namespace, r.key).map(drop)
        }),
        6 => decoded(bytes, |r: proto::ClaimBatchRequest| {
            parse_items(r.items, parse_claim).map(|items| items.into_iter().for_each(check_claim))
        }),
        _ => decoded(bytes, |r: proto::CompleteBatchRequest| {
            parse_items(r.items, parse_complete).map(drop)
        }),
    };
    if let Err(error) = result {
        check_refusal(error);
    }
}

/// Field values that reach the edges: empty, at and past the limits, NUL,
/// multi-byte characters.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z/._-]{1,16}",
        ".{0,40}",
        "\\PC{120,140}",
        "[a-z]{500,520}",
        "[a-z]{0,8}\u{0}[a-z]{0,8}",
    ]
}

fn wire_duration_strategy() -> impl Strategy<Value = Option<prost_types::Duration>> {
    prop_oneof![
        Just(None),
        (any::<i64>(), any::<i32>())
            .prop_map(|(seconds, nanos)| Some(prost_types::Duration { seconds, nanos })),
        (0i64..100_000, 0i32..1_000_000_000)
            .prop_map(|(seconds, nanos)| Some(prost_types::Duration { seconds, nanos })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn arbitrary_bytes_never_panic_decoding_or_validation(
        kind in any::<u8>(),
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        validate_any(kind, &bytes);
    }

    #[test]
    fn mutated_valid_requests_never_panic(
        kind in any::<u8>(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        cut in any::<usize>(),
    ) {
        // A valid request of each kind, then bytes changed and the tail cut:
        // the inputs a fuzzer finds nearest to real traffic.
        let claim = proto::ClaimRequest {
            namespace: "orders".into(),
            key: "evt_123".into(),
            fingerprint: vec![1; 32],
            lease_ttl: Some(prost_types::Duration { seconds: 30, nanos: 0 }),
            retention: Some(prost_types::Duration { seconds: 3600, nanos: 0 }),
            lease_token: "fedcba9876543210fedcba9876543210".into(),
            wait: Some(prost_types::Duration { seconds: 1, nanos: 0 }),
            late_retry: proto::LateRetry::Refuse as i32,
        };
        let complete = proto::CompleteRequest {
            namespace: "orders".into(),
            key: "evt_123".into(),
            lease_token: "0123456789abcdef0123456789abcdef".into(),
            response: b"{\"ok\":true}".to_vec(),
            retention: None,
        };
        let mut bytes = match kind % 8 {
            0 => claim.encode_to_vec(),
            1 => complete.encode_to_vec(),
            6 => proto::ClaimBatchRequest { items: vec![claim.clone(), claim], ..Default::default() }.encode_to_vec(),
            7 => proto::CompleteBatchRequest { items: vec![complete], ..Default::default() }.encode_to_vec(),
            _ => proto::ExtendLeaseRequest {
                namespace: "orders".into(),
                key: "evt_123".into(),
                lease_token: "0123456789abcdef0123456789abcdef".into(),
                lease_ttl: Some(prost_types::Duration { seconds: 30, nanos: 0 }),
                checkpoint: Some(b"step 2 of 3".to_vec()),
            }
            .encode_to_vec(),
        };
        for (at, value) in flips {
            let at = at % bytes.len();
            bytes[at] = value;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        validate_any(kind, &bytes);
    }

    #[test]
    fn claims_are_accepted_exactly_when_every_field_is_within_its_rules(
        namespace in text(),
        key in text(),
        fingerprint in proptest::collection::vec(any::<u8>(), 0..80),
        lease_ttl in wire_duration_strategy(),
        retention in wire_duration_strategy(),
        lease_token in "|[0-9a-f]{32}|[0-9a-fA-Z]{0,40}",
    ) {
        let request = proto::ClaimRequest {
            namespace: namespace.clone(),
            key: key.clone(),
            fingerprint: fingerprint.clone(),
            lease_ttl,
            retention,
            lease_token: lease_token.clone(),
            wait: None,
            late_retry: 0,
        };
        let identifier_ok = |s: &str, max: usize| !s.is_empty() && s.len() <= max && !s.contains('\0');
        let duration_ok = |d: &Option<prost_types::Duration>| {
            // Lenient as prost is: nanos of either sign, normalised.
            d.is_none_or(|d| {
                (-999_999_999..=999_999_999).contains(&d.nanos)
                    && i128::from(d.seconds) * 1_000_000_000 + i128::from(d.nanos) >= 0
            })
        };
        let valid = identifier_ok(&namespace, 128)
            && identifier_ok(&key, 512)
            && fingerprint.len() <= 64
            && duration_ok(&lease_ttl)
            && duration_ok(&retention)
            && (lease_token.is_empty()
                || (lease_token.len() == 32
                    && lease_token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))));
        match parse_claim(request) {
            Ok(parsed) => {
                prop_assert!(valid, "accepted an invalid claim");
                prop_assert_eq!(parsed.namespace.as_str(), namespace.as_str());
                prop_assert_eq!(parsed.key.as_str(), key.as_str());
                prop_assert_eq!(
                    parsed.fingerprint.map(Fingerprint::into_bytes).unwrap_or_default(),
                    fingerprint
                );
                prop_assert_eq!(
                    parsed.lease_token.map(|t| t.to_string()).unwrap_or_default(),
                    lease_token
                );
            }
            Err(error) => {
                prop_assert!(!valid, "refused a valid claim: {error}");
                check_refusal(error);
            }
        }
    }

    #[test]
    fn lease_tokens_are_32_lowercase_hex_characters(token in "[0-9a-fA-Z]{0,40}|.{0,40}") {
        let valid = token.len() == 32
            && token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        match LeaseToken::parse(&token) {
            Ok(parsed) => {
                prop_assert!(valid);
                prop_assert_eq!(parsed.to_string(), token);
            }
            Err(error) => {
                prop_assert!(!valid);
                prop_assert_eq!(field_of(&error), "lease_token");
            }
        }
    }
}
