//! Input written to hurt the server, against the real binary: oversized
//! fields and messages, bytes that are not protobuf (invalid UTF-8, nesting
//! past prost's limit, truncated fields, truncated and mis-flagged gRPC
//! frames), a million small calls on one connection, stalled clients, spent
//! deadlines, more calls than the server admits. After each the server still
//! serves; at the end it has not panicked, its memory has not grown without
//! bound, and every stored record is exactly as it was.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use common::process::{self, ServerProcess};
use common::{Client, claim_request, complete, complete_request, eventually, get_request};
use idempotency_service::grpc::proto::{self, Outcome};
use tempfile::TempDir;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

const CLAIM: &str = "/idempotency.v1.IdempotencyService/Claim";
/// The server's call timeout in this test: how long a stalled call may live.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// The server's limit of calls in flight in this test.
const MAX_CALLS: usize = 48;
/// Stalled calls opened: more than the server admits.
const STALLS: usize = MAX_CALLS + 4;
/// Small calls sent down one connection.
const SMALL_CALLS: usize = 1_000_000;
/// How many of them are in flight at once.
const SMALL_CALLS_IN_FLIGHT: usize = 32;

/// Sends bytes as they are and returns the bytes of the answer: a client
/// that can say anything.
#[derive(Clone, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

async fn raw_call(channel: Channel, path: &'static str, body: Bytes) -> Status {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let result = grpc
        .unary(
            Request::new(body),
            http::uri::PathAndQuery::from_static(path),
            RawCodec,
        )
        .await;
    result.expect_err("hostile bytes were accepted")
}

/// A protobuf length-delimited field.
fn field(number: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![(number << 3 | 2) as u8, bytes.len() as u8];
    out.extend_from_slice(bytes);
    out
}

/// One raw HTTP/2 stream to `path`: the gRPC headers, then `data` (ending
/// the stream or not). Returns the gRPC status code the server sent, from
/// the headers (trailers-only) or the trailers.
async fn h2_call(
    addr: SocketAddr,
    data: Bytes,
    end_stream: bool,
    grpc_timeout: Option<&str>,
) -> Option<i32> {
    let (mut h2, _conn) = h2_connect(addr).await;
    let mut request = grpc_request(addr, CLAIM);
    if let Some(timeout) = grpc_timeout {
        request
            .headers_mut()
            .insert("grpc-timeout", timeout.parse().unwrap());
    }
    h2 = h2.ready().await.unwrap();
    let (response, mut send) = h2.send_request(request, false).unwrap();
    send.send_data(data, end_stream).unwrap();
    let response = response.await.ok()?;
    let mut status = response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.ok()?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    if let Ok(Some(trailers)) = body.trailers().await {
        status = trailers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok()?.parse().ok());
    }
    status
}

async fn h2_connect(
    addr: SocketAddr,
) -> (h2::client::SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    (h2, task)
}

fn grpc_request(addr: SocketAddr, path: &str) -> http::Request<()> {
    http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// A gRPC frame: flag, big-endian length, message.
fn frame(compressed: bool, declared_len: u32, message: &[u8]) -> Bytes {
    let mut out = BytesMut::new();
    out.put_u8(compressed as u8);
    out.put_u32(declared_len);
    out.put_slice(message);
    out.freeze()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Records made before the attack, as Get shows them.
async fn snapshot(client: &mut Client) -> Vec<proto::GetResponse> {
    let mut out = Vec::new();
    for key in ["done-1", "done-2", "held"] {
        out.push(
            client
                .get(get_request("victim", key))
                .await
                .unwrap()
                .into_inner(),
        );
    }
    out
}

async fn seed(client: &mut Client) {
    for key in ["done-1", "done-2"] {
        let lease = client
            .claim(proto::ClaimRequest {
                fingerprint: b"fp".to_vec(),
                ..claim_request("victim", key)
            })
            .await
            .unwrap()
            .into_inner();
        complete(
            client,
            "victim",
            key,
            &lease.lease_token,
            format!("result of {key}").as_bytes(),
        )
        .await;
    }
    let held = client
        .claim(proto::ClaimRequest {
            lease_ttl: Some(prost_types::Duration {
                seconds: 3600,
                nanos: 0,
            }),
            ..claim_request("victim", "held")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(held.outcome(), Outcome::Claimed);
}

/// The server answers a normal call.
async fn still_serves(client: &mut Client, what: &str) {
    let record = client
        .get(get_request("victim", "done-1"))
        .await
        .unwrap_or_else(|s| panic!("after {what} the server no longer serves: {s:?}"))
        .into_inner();
    assert_eq!(record.response, b"result of done-1", "after {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_neither_crashes_the_server_nor_grows_it_nor_changes_a_record() {
    let dir = TempDir::new().unwrap();
    let mut command = process::command(dir.path());
    command
        .env(
            "IDEMPOTENCY_CALL_TIMEOUT",
            format!("{}ms", CALL_TIMEOUT.as_millis()),
        )
        .env("IDEMPOTENCY_MAX_CONCURRENT_CALLS", MAX_CALLS.to_string())
        .env("RUST_LOG", "warn");
    let mut server = ServerProcess::start(command).await;
    let pid = server.child.id();
    let addr: SocketAddr = format!("127.0.0.1:{}", server.port).parse().unwrap();
    let mut client = server
        .client()
        .max_encoding_message_size(64 * 1024 * 1024)
        .max_decoding_message_size(64 * 1024 * 1024);
    seed(&mut client).await;
    let before = snapshot(&mut client).await;

    // Oversized fields: INVALID_ARGUMENT naming each.
    let big = |n: usize| "x".repeat(n);
    let cases = [
        (claim_request(&big(129), "k"), "namespace"),
        (claim_request(&big(1 << 20), "k"), "namespace"),
        (claim_request("victim", &big(513)), "key"),
        (claim_request("victim", &big(4 << 20)), "key"),
        (
            proto::ClaimRequest {
                fingerprint: vec![7; 1 << 20],
                ..claim_request("victim", "fresh")
            },
            "fingerprint",
        ),
    ];
    for (request, field_name) in cases {
        let status = client.claim(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{field_name}");
        assert!(
            status.message().starts_with(&format!("{field_name}: ")),
            "{field_name}: {}",
            status.message()
        );
    }
    let status = client
        .complete(complete_request(
            "victim",
            "held",
            &"0".repeat(32),
            &vec![0; (1 << 20) + 1],
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().starts_with("response: "), "{status:?}");
    // Larger than any valid request: refused from the length prefix.
    let status = client
        .claim(claim_request("victim", &big(20 << 20)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    still_serves(&mut client, "oversized fields").await;

    // Bytes that are not a valid request: INVALID_ARGUMENT, with prost's
    // message naming the field where it can.
    let channel = server.channel();
    let mut nested = Vec::new();
    for _ in 0..200 {
        nested.push((15 << 3 | 3) as u8); // start group, field 15
    }
    let not_protobuf: [(&str, Vec<u8>, &str); 4] = [
        (
            "invalid UTF-8",
            field(1, &[0xff, 0xfe, 0xfd]),
            "ClaimRequest.namespace",
        ),
        ("nesting past the limit", nested, "recursion limit"),
        (
            "a truncated field",
            vec![(2 << 3 | 2) as u8, 100, b'a', b'b'],
            "",
        ),
        ("a bad wire type", vec![(1 << 3 | 7) as u8, 1], ""),
    ];
    for (what, bytes, mentions) in not_protobuf {
        let status = raw_call(channel.clone(), CLAIM, Bytes::from(bytes)).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert!(status.message().contains(mentions), "{what}: {status:?}");
    }
    still_serves(&mut client, "bytes that are not protobuf").await;

    // Broken gRPC framing, through a raw HTTP/2 client.
    let valid = field(1, b"victim");
    let truncated = h2_call(addr, frame(false, 100, &valid), true, None).await;
    assert_eq!(truncated, Some(Code::Internal as i32), "a truncated frame");
    let compressed = h2_call(addr, frame(true, valid.len() as u32, &valid), true, None).await;
    assert_eq!(
        compressed,
        Some(Code::Internal as i32),
        "a compressed frame without grpc-encoding"
    );
    let huge_prefix = h2_call(addr, frame(false, u32::MAX, b""), true, None).await;
    assert_eq!(
        huge_prefix,
        Some(Code::OutOfRange as i32),
        "a 4 GiB length prefix"
    );
    still_serves(&mut client, "broken framing").await;

    // A spent deadline (1 ns, sent raw: tonic's client would give up on its
    // own first): refused, and nothing is done.
    let too_late = field(1, b"victim")
        .into_iter()
        .chain(field(2, b"too-late"))
        .collect::<Vec<u8>>();
    let spent = h2_call(
        addr,
        frame(false, too_late.len() as u32, &too_late),
        true,
        Some("1n"),
    )
    .await;
    assert_eq!(
        spent,
        Some(Code::DeadlineExceeded as i32),
        "a spent deadline"
    );
    let record = client
        .get(get_request("victim", "too-late"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(record.state(), proto::State::Absent);

    // Stalled clients: half a request each, never finished, a few more than
    // the server admits. They hold every slot (calls beyond the limit are
    // refused at once) until the call timeout ends them; meanwhile other
    // calls are refused, and afterwards service resumes.
    let (mut h2, _conn) = h2_connect(addr).await;
    // One finished call first, so the server's SETTINGS have arrived.
    h2 = h2.ready().await.unwrap();
    let (response, mut send) = h2.send_request(grpc_request(addr, CLAIM), false).unwrap();
    send.send_data(frame(false, 0, b""), true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(
        response.headers().get("grpc-status").unwrap(),
        &(Code::InvalidArgument as i32).to_string(),
        "an empty Claim"
    );
    assert_eq!(h2.current_max_send_streams(), 128, "streams per connection");
    let mut stalled = Vec::new();
    let mut held = Vec::new();
    for _ in 0..STALLS {
        h2 = h2.ready().await.unwrap();
        let (response, mut send) = h2.send_request(grpc_request(addr, CLAIM), false).unwrap();
        send.send_data(frame(false, 64, &valid), false).unwrap();
        stalled.push(response);
        held.push(send);
    }
    let stalled_at = Instant::now();
    let attempts = std::sync::Mutex::new(Vec::new());
    let refused = eventually(CALL_TIMEOUT / 2, || {
        let mut client = client.clone();
        let attempts = &attempts;
        async move {
            let result = client.claim(claim_request("victim", "during-stall")).await;
            let code = result.as_ref().map_or_else(|s| s.code(), |_| Code::Ok);
            attempts.lock().unwrap().push((stalled_at.elapsed(), code));
            (code == Code::ResourceExhausted).then_some(())
        }
    })
    .await;
    let (mut timed_out, mut refused_at_once) = (0, 0);
    for response in stalled {
        let response = tokio::time::timeout(CALL_TIMEOUT * 5, response)
            .await
            .expect("a stalled call outlived the call timeout")
            .unwrap();
        let status = response
            .headers()
            .get("grpc-status")
            .unwrap()
            .to_str()
            .unwrap();
        match status.parse::<i32>().unwrap() {
            code if code == Code::DeadlineExceeded as i32 => timed_out += 1,
            code if code == Code::ResourceExhausted as i32 => refused_at_once += 1,
            code => panic!("a stalled call ended with code {code}"),
        }
    }
    // Never more than the limit in flight: stalls beyond it were refused at
    // once, and a call made while every slot was held was refused too. (The
    // first attempt may race the stalls' arrival and take a slot, so that one
    // more stall is refused and the attempts find a slot free: then fewer
    // than the limit were admitted.)
    assert_eq!(timed_out + refused_at_once, STALLS);
    assert!(timed_out <= MAX_CALLS, "{timed_out} stalled calls admitted");
    assert!(
        refused.is_some() || timed_out < MAX_CALLS,
        "{timed_out} stalled calls held every slot, yet no call was refused: {:?}",
        attempts.lock().unwrap()
    );
    drop(held);
    still_serves(&mut client, "stalled clients").await;

    // A million small calls down one connection, each refused by validation.
    let warm_rss = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..SMALL_CALLS_IN_FLIGHT)
        .map(|w| {
            let mut client = client.clone();
            let done = done.clone();
            let warm_rss = warm_rss.clone();
            tokio::spawn(async move {
                let mut i = w;
                while i < SMALL_CALLS {
                    let status = client.claim(claim_request("", "k")).await.unwrap_err();
                    assert_eq!(status.code(), Code::InvalidArgument);
                    if done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == SMALL_CALLS / 10 {
                        warm_rss.store(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
                    }
                    i += SMALL_CALLS_IN_FLIGHT;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let elapsed = started.elapsed();
    let warm = warm_rss.load(std::sync::atomic::Ordering::Relaxed);
    let end = rss_kib(pid);
    eprintln!(
        "{SMALL_CALLS} calls in {elapsed:?}; RSS {warm} KiB after a tenth, {end} KiB at the end"
    );
    assert_eq!(done.load(std::sync::atomic::Ordering::Relaxed), SMALL_CALLS);
    assert!(
        end < warm + 16 * 1024,
        "RSS grew from {warm} KiB to {end} KiB over {SMALL_CALLS} calls"
    );
    still_serves(&mut client, "a million calls").await;

    // The end: alive, unchanged.
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server exited"
    );
    assert_eq!(snapshot(&mut client).await, before);
    assert!(rss_kib(pid) < 64 * 1024, "RSS above 64 MiB");
    assert!(server.terminate().await.success());
}
