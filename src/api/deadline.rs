//! The `--rpc-timeout` bound on a call: one that has not answered in time is answered
//! DEADLINE_EXCEEDED, as the configuration promises. tonic's own server timeout answers
//! CANCELLED ("Timeout expired"), which clients read as the caller having given up.
//! Like tonic's, it bounds the wait for the answer's headers, so a Subscribe stream,
//! which answers at once and then streams, is not cut.

use std::{
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use tonic::Status;

#[derive(Debug, Clone, Copy)]
pub struct RpcTimeoutLayer {
    pub rpc_timeout: Duration,
}

impl<S> tower::Layer<S> for RpcTimeoutLayer {
    type Service = RpcTimeout<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcTimeout {
            inner,
            rpc_timeout: self.rpc_timeout,
        }
    }
}

#[derive(Debug, Clone)]
pub struct RpcTimeout<S> {
    inner: S,
    rpc_timeout: Duration,
}

impl<S, RequestBody, ResponseBody> tower::Service<http::Request<RequestBody>> for RpcTimeout<S>
where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
    ResponseBody: Default + Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let rpc_timeout = self.rpc_timeout;
        let answer = self.inner.call(request);
        Box::pin(async move {
            match tokio::time::timeout(rpc_timeout, answer).await {
                Ok(answered) => answered,
                Err(_) => {
                    // Inside the call's span, which names the method.
                    tracing::info!(?rpc_timeout, "cut a call that outlasted the rpc timeout");
                    Ok(Status::deadline_exceeded(format!(
                        "the call took longer than the gateway's rpc timeout ({})",
                        humantime::format_duration(rpc_timeout)
                    ))
                    .into_http())
                }
            }
        })
    }
}
