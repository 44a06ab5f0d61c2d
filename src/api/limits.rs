//! Answers requests tonic could not read with the codes the API documents: an oversized
//! request with RESOURCE_EXHAUSTED naming the limit (tonic says OUT_OF_RANGE, a code
//! clients do not associate with a size limit), a malformed one with INVALID_ARGUMENT
//! (tonic says INTERNAL). Both appear in the headers or, for calls that already
//! answered, in the trailers.
//!
//! Oversized request metadata is refused here too, before authentication: HTTP/2 itself
//! can only answer a header list over its limit with HTTP 431, which gRPC clients report
//! as UNKNOWN. So the transport reads up to [`MAX_HEADER_LIST_BYTES`] and
//! [`HeaderLimitLayer`] answers anything over [`MAX_REQUEST_METADATA_BYTES`] with
//! RESOURCE_EXHAUSTED naming the limit.

use std::{
    pin::Pin,
    task::{Context, Poll, ready},
};

use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use tonic::Status;

/// The request metadata a call may carry, counted as HTTP/2 counts a header list: each
/// entry's name and value plus 32 bytes. gRPC's usual limit, and what the transport
/// allowed before it answered more with HTTP 431.
pub const MAX_REQUEST_METADATA_BYTES: usize = 16 * 1024;

/// The header list the HTTP/2 transport reads (pseudo-headers included), above which it
/// answers HTTP 431 itself. Four times the metadata limit, so that a caller a little or
/// a lot over it learns the limit from a gRPC status; bounded, because the transport
/// holds a stream's headers in memory before any layer sees them.
pub const MAX_HEADER_LIST_BYTES: u32 = 4 * MAX_REQUEST_METADATA_BYTES as u32;

/// Refuses calls whose metadata exceeds [`MAX_REQUEST_METADATA_BYTES`].
#[derive(Debug, Clone, Copy)]
pub struct HeaderLimitLayer;

impl<S> tower::Layer<S> for HeaderLimitLayer {
    type Service = HeaderLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HeaderLimit { inner }
    }
}

#[derive(Debug, Clone)]
pub struct HeaderLimit<S> {
    inner: S,
}

impl<S, RequestBody, ResponseBody> tower::Service<http::Request<RequestBody>> for HeaderLimit<S>
where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
    ResponseBody: Default + Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let size = metadata_size(request.headers());
        if size <= MAX_REQUEST_METADATA_BYTES {
            return Box::pin(self.inner.call(request));
        }
        tracing::info!(
            path = request.uri().path(),
            size,
            "refused a call with oversized metadata"
        );
        let response = Status::resource_exhausted(format!(
            "request metadata is {size} bytes; the limit is 16 KiB ({MAX_REQUEST_METADATA_BYTES} bytes, each entry counted as its name and value plus 32); send less metadata"
        ))
        .into_http();
        Box::pin(async move { Ok(response) })
    }
}

/// The size of a header list as HTTP/2 counts it (RFC 9113, SETTINGS_MAX_HEADER_LIST_SIZE).
fn metadata_size(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 32)
        .sum()
}

#[derive(Debug, Clone, Copy)]
pub struct MessageLimitLayer {
    pub max_message_bytes: usize,
}

impl<S> tower::Layer<S> for MessageLimitLayer {
    type Service = MessageLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MessageLimit {
            inner,
            max_message_bytes: self.max_message_bytes,
        }
    }
}

#[derive(Debug, Clone)]
pub struct MessageLimit<S> {
    inner: S,
    max_message_bytes: usize,
}

impl<S, RequestBody, ResponseBody> tower::Service<http::Request<RequestBody>> for MessageLimit<S>
where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<LimitBody<ResponseBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let call = self.inner.call(request);
        let limit = self.max_message_bytes;
        Box::pin(async move {
            let mut response = call.await?;
            rewrite(response.headers_mut(), limit);
            Ok(response.map(|inner| LimitBody { inner, limit }))
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body whose trailers get the same rewrite.
    pub struct LimitBody<B> {
        #[pin]
        inner: B,
        limit: usize,
    }
}

impl<B: http_body::Body> http_body::Body for LimitBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        Poll::Ready(frame.map(|frame| {
            frame.map(|frame| match frame.into_trailers() {
                Ok(mut trailers) => {
                    rewrite(&mut trailers, *this.limit);
                    Frame::trailers(trailers)
                }
                Err(frame) => frame,
            })
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Turns tonic's answers to requests it could not read into the codes the API documents:
/// "decoded message length too large" (OUT_OF_RANGE) becomes RESOURCE_EXHAUSTED, and a
/// message that is not valid protobuf (INTERNAL, as if the gateway were at fault) becomes
/// INVALID_ARGUMENT. Messages arrive percent-encoded in the header.
fn rewrite(headers: &mut HeaderMap, limit: usize) {
    let status = headers
        .get("grpc-status")
        .and_then(|code| code.to_str().ok());
    let message = headers
        .get("grpc-message")
        .and_then(|message| message.to_str().ok())
        .unwrap_or_default();
    let (code, message) = match status {
        Some("11") if message.contains("message%20length%20too%20large") => (
            "8",
            format!(
                "the request is larger than the gateway's limit of {limit} bytes (max_message_bytes); send smaller batches"
            ),
        ),
        Some("13") if message.starts_with("failed%20to%20decode%20Protobuf%20message") => (
            "3",
            "the request is not a valid protobuf encoding of the method's request message"
                .to_owned(),
        ),
        _ => return,
    };
    headers.insert("grpc-status", HeaderValue::from_static(code));
    if let Ok(value) = HeaderValue::from_str(&percent_encode(&message)) {
        headers.insert("grpc-message", value);
    }
}

/// gRPC percent-encodes messages outside printable ASCII and `%`.
fn percent_encode(message: &str) -> String {
    message
        .bytes()
        .map(|b| {
            if (0x20..0x7f).contains(&b) && b != b'%' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
