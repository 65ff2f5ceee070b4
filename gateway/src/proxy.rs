//! The reverse proxy's part: the upstream client (HTTP/1.1, or h2c), the
//! request and response header rules (hop-by-hop headers dropped,
//! `X-Forwarded-For`, `-Host`, `-Proto` added), and pass-through, where
//! bodies stream both ways untouched.

use std::net::SocketAddr;

use http::header::{self, HeaderName};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::{Body, BoxError};

/// The API behind the gateway.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Body>,
    base: Uri,
}

/// The headers that belong to one connection, never forwarded (RFC 9110
/// 7.6.1), besides those the `Connection` header names.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Drops the hop-by-hop headers.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    for name in named {
        headers.remove(name);
    }
}

impl Upstream {
    pub fn new(base: Uri, http2: bool) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .http2_only(http2)
            .build(connector);
        Self { client, base }
    }

    /// The request as the upstream gets it: the same method, target, headers
    /// (less hop-by-hop ones, plus `X-Forwarded-*`) and body.
    pub fn request(
        &self,
        mut parts: http::request::Parts,
        body: Body,
        peer: SocketAddr,
    ) -> Request<Body> {
        let target = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let mut uri = self.base.clone().into_parts();
        uri.path_and_query = Some(target);
        parts.uri = Uri::from_parts(uri).expect("scheme and authority from a valid base");
        strip_hop_by_hop(&mut parts.headers);
        let host = parts.headers.remove(header::HOST).or_else(|| {
            // HTTP/2 clients send :authority instead of Host.
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        if let Some(host) = host {
            parts.headers.insert("x-forwarded-host", host);
        }
        let forwarded_for = match parts.headers.get("x-forwarded-for") {
            Some(earlier) => format!("{}, {}", earlier.to_str().unwrap_or(""), peer.ip()),
            None => peer.ip().to_string(),
        };
        if let Ok(value) = HeaderValue::from_str(&forwarded_for) {
            parts.headers.insert("x-forwarded-for", value);
        }
        parts
            .headers
            .insert("x-forwarded-proto", HeaderValue::from_static("http"));
        // The upstream connection decides its own version.
        parts.version = http::Version::HTTP_11;
        Request::from_parts(parts, body)
    }

    /// Sends a request; the response's body streams from the upstream.
    pub async fn send(&self, request: Request<Body>) -> Result<Response<Body>, BoxError> {
        let response = self.client.request(request).await?;
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(
            parts,
            body.map_err(|e| Box::new(e) as BoxError).boxed(),
        ))
    }
}

/// The client's request body, as the upstream client takes it.
pub fn boxed_incoming(body: hyper::body::Incoming) -> Body {
    body.map_err(|e| Box::new(e) as BoxError).boxed()
}
