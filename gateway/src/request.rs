//! What the gateway reads from a guarded request: the `Idempotency-Key`
//! (an RFC 8941 sf-string), the namespace it is scoped to (the route's and
//! the caller's hashed identity), and the request's fingerprint.

use http::HeaderMap;
use http::header::GetAll;
use sha2::{Digest, Sha256};

use crate::config::{Fingerprint, Identity};
use crate::error::GatewayError;

/// The longest key accepted, in characters (Stripe's limit, and the draft's
/// examples fit well within it).
pub const MAX_KEY_CHARS: usize = 255;

/// The key of the `Idempotency-Key` field: `Ok(None)` when absent, an error
/// when it is not one sf-string of 1 to 255 characters. Parameters are
/// ignored, as RFC 8941 asks of unknown ones.
pub fn parse_key(values: GetAll<'_, http::HeaderValue>) -> Result<Option<String>, GatewayError> {
    let mut lines = values.iter().peekable();
    if lines.peek().is_none() {
        return Ok(None);
    }
    // Several field lines are one field, joined with ", " (RFC 9110 5.3);
    // for an Item that never parses, so a repeated key is refused.
    let mut joined = Vec::new();
    for (i, line) in lines.enumerate() {
        if i > 0 {
            joined.extend_from_slice(b", ");
        }
        joined.extend_from_slice(line.as_bytes());
    }
    let item = sfv::Parser::new(&joined)
        .with_version(sfv::Version::Rfc8941)
        .parse::<sfv::Item>()
        .map_err(|e| GatewayError::KeyInvalid(format!("not a structured field string ({e})")))?;
    let Some(key) = item.bare_item.as_string() else {
        return Err(GatewayError::KeyInvalid(
            "it must be a string in double quotes, as in Idempotency-Key: \"8e03978e\"".to_owned(),
        ));
    };
    let key = key.as_str();
    if key.is_empty() {
        return Err(GatewayError::KeyInvalid("it is empty".to_owned()));
    }
    if key.chars().count() > MAX_KEY_CHARS {
        return Err(GatewayError::KeyInvalid(format!(
            "it is longer than {MAX_KEY_CHARS} characters"
        )));
    }
    Ok(Some(key.to_owned()))
}

/// The caller's share of the namespace: `/` and the first 128 bits of
/// SHA-256 over the salt and the identity header's value, in hex. The
/// value itself is never stored or logged.
pub fn identity_suffix(identity: &Identity, headers: &HeaderMap) -> Option<String> {
    let value = headers.get(&identity.header)?;
    if value.is_empty() {
        return None;
    }
    let digest = tagged_digest(
        "idempotency-gateway/identity/v1",
        &[identity.salt.as_bytes(), value.as_bytes()],
    );
    Some(format!("/{}", hex::encode(&digest[..16])))
}

/// The fingerprint of a request, as the route asks: SHA-256 over a tagged,
/// length-prefixed encoding of the parts, so no two sets of parts encode
/// alike.
pub fn fingerprint(kind: &Fingerprint, method: &str, target: &str, body: &[u8]) -> Vec<u8> {
    match kind {
        Fingerprint::Request => tagged_digest(
            "idempotency-gateway/request/v1",
            &[method.as_bytes(), target.as_bytes(), &Sha256::digest(body)],
        ),
        Fingerprint::Body => tagged_digest("idempotency-gateway/body/v1", &[body]),
        Fingerprint::JsonFields(fields) => {
            match serde_json::from_slice::<serde_json::Value>(body) {
                Ok(json) => {
                    // serde_json's maps are sorted, so equal values serialize alike
                    // whatever the order or spacing of the body.
                    let values: Vec<Vec<u8>> = fields
                        .iter()
                        .map(|field| {
                            let value = if field.starts_with('/') {
                                json.pointer(field)
                            } else {
                                json.get(field)
                            };
                            serde_json::to_vec(value.unwrap_or(&serde_json::Value::Null))
                                .unwrap_or_default()
                        })
                        .collect();
                    let mut parts: Vec<&[u8]> = Vec::with_capacity(fields.len() * 2);
                    for (field, value) in fields.iter().zip(&values) {
                        parts.push(field.as_bytes());
                        parts.push(value);
                    }
                    tagged_digest("idempotency-gateway/json-fields/v1", &parts)
                }
                Err(_) => tagged_digest("idempotency-gateway/json-fields-not-json/v1", &[body]),
            }
        }
    }
}

fn tagged_digest(tag: &str, parts: &[&[u8]]) -> Vec<u8> {
    let mut hasher = Sha256::new();
    for part in std::iter::once(tag.as_bytes()).chain(parts.iter().copied()) {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hasher.finalize().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key(values: &[&str]) -> Result<Option<String>, GatewayError> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append("idempotency-key", HeaderValue::from_str(v).unwrap());
        }
        parse_key(headers.get_all("idempotency-key"))
    }

    #[test]
    fn keys_are_sf_strings() {
        assert_eq!(key(&[]).unwrap(), None);
        assert_eq!(key(&["\"abc-1\""]).unwrap().unwrap(), "abc-1");
        assert_eq!(key(&["\"a\\\"b\""]).unwrap().unwrap(), "a\"b");
        assert_eq!(key(&["\"k\";v=1"]).unwrap().unwrap(), "k");
        assert!(matches!(key(&["abc"]), Err(GatewayError::KeyInvalid(_))));
        assert!(matches!(key(&["\"\""]), Err(GatewayError::KeyInvalid(_))));
        // Field lines are joined with ", " before parsing (RFC 8941 4.2).
        assert_eq!(key(&["\"a", "b\""]).unwrap().unwrap(), "a, b");
        assert!(matches!(
            key(&["\"a\"", "\"a\""]),
            Err(GatewayError::KeyInvalid(_))
        ));
        assert!(matches!(key(&["42"]), Err(GatewayError::KeyInvalid(_))));
        let longest = format!("\"{}\"", "k".repeat(MAX_KEY_CHARS));
        assert!(key(&[&longest]).unwrap().is_some());
        let too_long = format!("\"{}\"", "k".repeat(MAX_KEY_CHARS + 1));
        assert!(matches!(
            key(&[&too_long]),
            Err(GatewayError::KeyInvalid(_))
        ));
    }

    #[test]
    fn fingerprints_tell_requests_apart() {
        let request = |m: &str, t: &str, b: &[u8]| fingerprint(&Fingerprint::Request, m, t, b);
        assert_eq!(request("POST", "/a", b"x"), request("POST", "/a", b"x"));
        assert_ne!(request("POST", "/a", b"x"), request("PUT", "/a", b"x"));
        assert_ne!(request("POST", "/a", b"x"), request("POST", "/a?b", b"x"));
        assert_ne!(request("POST", "/a", b"x"), request("POST", "/a", b"y"));
        let body = |b: &[u8]| fingerprint(&Fingerprint::Body, "POST", "/a", b);
        assert_eq!(
            body(b"x"),
            fingerprint(&Fingerprint::Body, "PUT", "/b", b"x")
        );
        let fields = Fingerprint::JsonFields(vec!["amount".into(), "/customer/id".into()]);
        let json = |b: &str| fingerprint(&fields, "POST", "/a", b.as_bytes());
        assert_eq!(
            json(r#"{"amount": 5, "customer": {"id": "c1"}, "note": "a"}"#),
            json(r#"{"customer":{"id":"c1"},"note":"b","amount":5}"#)
        );
        assert_ne!(
            json(r#"{"amount": 5, "customer": {"id": "c1"}}"#),
            json(r#"{"amount": 6, "customer": {"id": "c1"}}"#)
        );
        assert_ne!(json("not json"), json("not json either"));
        assert_eq!(request("POST", "/a", b"x").len(), 32);
    }

    #[test]
    fn identities_are_hashed_apart() {
        let identity = Identity {
            header: http::HeaderName::from_static("x-api-key"),
            salt: String::new(),
            missing: crate::config::MissingIdentity::Reject,
        };
        let of = |v: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-api-key", HeaderValue::from_str(v).unwrap());
            identity_suffix(&identity, &headers)
        };
        let a = of("key-a").unwrap();
        assert_eq!(a.len(), crate::config::IDENTITY_SUFFIX_BYTES);
        assert!(!a.contains("key-a"));
        assert_ne!(a, of("key-b").unwrap());
        assert_eq!(a, of("key-a").unwrap());
        assert_eq!(identity_suffix(&identity, &HeaderMap::new()), None);
    }
}
