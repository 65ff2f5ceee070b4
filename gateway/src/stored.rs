//! The stored response: what Complete saves for a key (the status, the
//! route's allowed headers, the body) and the replay built from it.
//!
//! The encoding, version 1: the magic `IGW1`, the status (u16), the number
//! of headers (u16), each header as its name's length (u16), name, value's
//! length (u32), value; then the body, to the end. Integers are big-endian.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::Body;

const MAGIC: &[u8; 4] = b"IGW1";

/// The header every replay carries.
pub const REPLAYED: &str = "idempotent-replayed";

/// A response as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: StatusCode,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

impl StoredResponse {
    /// The response's status, the allowed headers it has, and its body.
    pub fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        allowed: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let mut kept = Vec::new();
        for name in allowed {
            for value in headers.get_all(name) {
                kept.push((name.clone(), value.clone()));
            }
        }
        Self {
            status,
            headers: kept,
            body,
        }
    }

    /// The encoded size, without encoding.
    pub fn encoded_len(&self) -> usize {
        8 + self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum::<usize>()
            + self.body.len()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        out.put_slice(MAGIC);
        out.put_u16(self.status.as_u16());
        out.put_u16(self.headers.len() as u16);
        for (name, value) in &self.headers {
            out.put_u16(name.as_str().len() as u16);
            out.put_slice(name.as_str().as_bytes());
            out.put_u32(value.len() as u32);
            out.put_slice(value.as_bytes());
        }
        out.put_slice(&self.body);
        out.to_vec()
    }

    /// `None` when the bytes are not a version-1 encoding (another client
    /// wrote this key, or it was corrupted).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut buf = bytes;
        if buf.len() < 8 || &buf[..4] != MAGIC {
            return None;
        }
        buf.advance(4);
        let status = StatusCode::from_u16(buf.get_u16()).ok()?;
        let count = buf.get_u16();
        let mut headers = Vec::with_capacity(count as usize);
        for _ in 0..count {
            if buf.remaining() < 2 {
                return None;
            }
            let len = buf.get_u16() as usize;
            if buf.remaining() < len + 4 {
                return None;
            }
            let name = HeaderName::from_bytes(&buf[..len]).ok()?;
            buf.advance(len);
            let len = buf.get_u32() as usize;
            if buf.remaining() < len {
                return None;
            }
            let value = HeaderValue::from_bytes(&buf[..len]).ok()?;
            buf.advance(len);
            headers.push((name, value));
        }
        Some(Self {
            status,
            headers,
            body: Bytes::copy_from_slice(buf),
        })
    }

    /// The replay: the stored status, headers and body, and
    /// `Idempotent-Replayed: true`.
    pub fn replay(self) -> Response<Body> {
        let mut response = self.into_response();
        response
            .headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
        response
    }

    /// The response as the first client gets it when its headers were not
    /// kept apart (the stored form, without the replay marker).
    pub fn into_response(self) -> Response<Body> {
        let mut response = Response::new(Full::new(self.body).map_err(|n| match n {}).boxed());
        *response.status_mut() = self.status;
        for (name, value) in self.headers {
            response.headers_mut().append(name, value);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_only_allowed_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("link", HeaderValue::from_static("</a>"));
        headers.append("link", HeaderValue::from_static("</b>"));
        headers.insert("set-cookie", HeaderValue::from_static("s=1"));
        let allowed = [
            HeaderName::from_static("content-type"),
            HeaderName::from_static("link"),
        ];
        let stored = StoredResponse::capture(
            StatusCode::CREATED,
            &headers,
            &allowed,
            Bytes::from_static(b"{\"id\":1}"),
        );
        let bytes = stored.encode();
        assert_eq!(bytes.len(), stored.encoded_len());
        let back = StoredResponse::decode(&bytes).unwrap();
        assert_eq!(back, stored);
        assert_eq!(back.headers.len(), 3);
        assert!(back.headers.iter().all(|(n, _)| n != "set-cookie"));
        assert_eq!(StoredResponse::decode(b"{\"ok\":true}"), None);
        assert_eq!(StoredResponse::decode(&bytes[..bytes.len() - 20]), None);
    }
}
