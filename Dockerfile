# syntax=docker/dockerfile:1
#
# The idempotency-service server image, with idempotency-gateway (the HTTP
# reverse proxy for Idempotency-Key, gateway/) beside it:
#
#   docker build -t idempotency-service:0.1.0 .
#
# The service is the entrypoint; run the gateway from the same image with
# `--entrypoint /usr/local/bin/idempotency-gateway` (Kubernetes: `command:`).
#
# A Rust build stage, then a slim Debian runtime holding only the binary and a
# non-root user. Debian rather than distroless because the Helm chart's preStop
# hook runs `sleep`. Not built by this repository's CI (no container engine
# there); keep it plain.

# Cargo.toml's rust-version; raise the two together.
ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
WORKDIR /build
# Queries are plain sqlx::query calls and migrations are embedded by
# sqlx::migrate!: nothing needs a database at build time.
ENV SQLX_OFFLINE=true

# Dependencies first, against stub sources: this layer, most of the build
# time, is reused until a Cargo.toml, Cargo.lock, build.rs or proto/ change.
# The service and the gateway are built (-p idempotency-service -p
# idempotency-gateway), with their dependencies; among them the workspace
# member idempotency-proto, which comes in whole (proto/: its Cargo.toml,
# build.rs and src/ beside the .proto it compiles) and is built for real
# here. The load generator (bench/loadgen) is never compiled here, but cargo
# reads every member's manifest, so its Cargo.toml comes in with a stub main.
# The gateway compiles clients/service-config.json in (its retry rules).
COPY Cargo.toml Cargo.lock build.rs ./
COPY bench/loadgen/Cargo.toml ./bench/loadgen/
COPY gateway/Cargo.toml ./gateway/
COPY clients/service-config.json ./clients/
COPY proto ./proto
RUN mkdir src bench/loadgen/src gateway/src \
 && echo 'fn main() {}' > src/main.rs \
 && echo 'fn main() {}' > bench/loadgen/src/main.rs \
 && echo 'fn main() {}' > gateway/src/main.rs \
 && touch src/lib.rs gateway/src/lib.rs \
 && cargo build --release --locked -p idempotency-service --bin idempotency-service \
      -p idempotency-gateway --bin idempotency-gateway \
 && rm -rf src gateway/src target/release/.fingerprint/idempotency-service-* \
      target/release/deps/idempotency_service-* target/release/deps/libidempotency_service-* \
      target/release/.fingerprint/idempotency-gateway-* \
      target/release/deps/idempotency_gateway-* target/release/deps/libidempotency_gateway-*

# Then the crates themselves. The touch makes sure cargo sees the real
# sources as newer than the stubs it just built, whatever times COPY gave them.
COPY src ./src
COPY migrations ./migrations
COPY gateway/src ./gateway/src
RUN touch src/main.rs src/lib.rs gateway/src/main.rs gateway/src/lib.rs \
 && cargo build --release --locked -p idempotency-service --bin idempotency-service \
      -p idempotency-gateway --bin idempotency-gateway \
 && install -D -m 0755 target/release/idempotency-service /out/idempotency-service \
 && install -D -m 0755 target/release/idempotency-gateway /out/idempotency-gateway

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
LABEL org.opencontainers.image.title="idempotency-service" \
      org.opencontainers.image.description="A shared deduplication store over gRPC" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric user: the Helm chart's runAsUser/runAsGroup (10001) match it,
# and runAsNonRoot can verify a number. TLS to PostgreSQL uses the root
# certificates compiled into the binary, so no ca-certificates package.
RUN groupadd --system --gid 10001 idempotency \
 && useradd --system --uid 10001 --gid idempotency --no-create-home \
      --home-dir /var/lib/idempotency --shell /usr/sbin/nologin idempotency \
 && install -d -o idempotency -g idempotency -m 0750 /var/lib/idempotency
COPY --from=build /out/idempotency-service /usr/local/bin/idempotency-service
COPY --from=build /out/idempotency-gateway /usr/local/bin/idempotency-gateway
# Without DATABASE_URL the server keeps a SQLite file in ./data, that is
# /var/lib/idempotency/data: mount a volume there to keep it.
WORKDIR /var/lib/idempotency
USER 10001:10001
# 50051: gRPC (health, reflection, the API). 8464: Prometheus metrics at
# /metrics (IDEMPOTENCY_METRICS_ADDR; empty turns them off). The gateway's
# ports are its config file's (`listen`, `admin_listen`).
EXPOSE 50051 8464
ENTRYPOINT ["/usr/local/bin/idempotency-service"]
CMD ["serve"]
