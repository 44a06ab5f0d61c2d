# Multi-stage build: dependencies and the workspace's crates are compiled in their own
# layer, so a change under src/ only rebuilds the gateway package itself.
FROM rust:1.95-slim-bookworm AS build
# The base has gcc and libc6-dev. The C parts of the build need more: rdkafka-sys builds
# librdkafka from the source it carries with mklove's ./configure (bash, which the base
# has), which requires a C++ compiler, and `make`; openssl-sys, libz-sys and librdkafka
# find OpenSSL and zlib through pkg-config. No cmake, perl, python3 or curl: librdkafka
# is built without cmake, OpenSSL is the system's, and the linker script python3 would
# generate serves only its shared library. tests/it/image.rs runs this line in a Debian
# root and checks each tool is there.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make pkg-config libssl-dev zlib1g-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The workspace manifest names every member, so cargo needs them all; the gateway builds
# only its own dependencies from them, outbox-client (with the API's .proto) among them.
# The store embeds the migrations, so they come before its build.
COPY Cargo.toml Cargo.lock build.rs ./
COPY crates crates
COPY tools tools
COPY migrations migrations
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked --bin outbox-gateway -p outbox-gateway \
    && rm -rf src
COPY src src
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked --bin outbox-gateway -p outbox-gateway

FROM debian:bookworm-slim
# The binary links OpenSSL (libssl3; librdkafka's TLS and SASL SCRAM) besides what the
# base has (glibc, libgcc-s1, zlib1g); librdkafka verifies Kafka brokers against the
# system's CA bundle. tests/it/image.rs runs these lines in a Debian root and serves the
# gateway there.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libssl3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home outbox
COPY --from=build /src/target/release/outbox-gateway /usr/local/bin/outbox-gateway
USER 10001
# Inside a container the gateway must listen beyond loopback.
ENV OUTBOX_LISTEN=0.0.0.0:50051 \
    OUTBOX_METRICS_LISTEN=0.0.0.0:9464 \
    OUTBOX_CONSOLE_LISTEN=0.0.0.0:9465
EXPOSE 50051 9464 9465
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
    CMD ["outbox-gateway", "health", "--endpoint", "http://127.0.0.1:50051", "--timeout", "2s"]
ENTRYPOINT ["outbox-gateway"]
CMD ["serve"]
