//! Authentication of every call: a tower layer that turns the `authorization` metadata
//! into a [`Principal`] in the request extensions, or answers UNAUTHENTICATED. Health
//! and reflection stay open. Handlers authorize with [`principal`].

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use tonic::{Request, Status};

use crate::auth::{Authenticator, Principal};

/// Paths served without credentials: orchestrators probe health unauthenticated, and
/// tools such as grpcurl list and describe the API before a token is at hand. Reflection
/// describes only the public API, which is published anyway.
const OPEN_PREFIXES: [&str; 3] = [
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

#[derive(Debug, Clone)]
pub struct AuthLayer {
    /// `None`: authentication is off and every caller may do everything.
    authenticator: Option<Arc<Authenticator>>,
}

impl AuthLayer {
    pub fn new(authenticator: Option<Authenticator>) -> Self {
        AuthLayer {
            authenticator: authenticator.map(Arc::new),
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            authenticator: self.authenticator.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    authenticator: Option<Arc<Authenticator>>,
}

impl<S, RequestBody, ResponseBody> tower::Service<http::Request<RequestBody>> for AuthService<S>
where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
    ResponseBody: Default + Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<RequestBody>) -> Self::Future {
        let principal = match &self.authenticator {
            None => Ok(Principal::anonymous()),
            Some(_)
                if OPEN_PREFIXES
                    .iter()
                    .any(|prefix| request.uri().path().starts_with(prefix)) =>
            {
                Ok(Principal::anonymous())
            }
            Some(authenticator) => authenticator.authenticate(
                request
                    .headers()
                    .get("authorization")
                    .and_then(|value| value.to_str().ok()),
            ),
        };
        match principal {
            Ok(principal) => {
                request.extensions_mut().insert(principal);
                Box::pin(self.inner.call(request))
            }
            Err(error) => {
                tracing::info!(path = request.uri().path(), %error, "refused unauthenticated call");
                let response = super::status_from(error).into_http();
                Box::pin(async move { Ok(response) })
            }
        }
    }
}

/// The caller of a request that passed [`AuthLayer`].
pub(super) fn principal<T>(request: &Request<T>) -> Result<&Principal, Status> {
    request.extensions().get::<Principal>().ok_or_else(|| {
        tracing::error!("request without principal: the auth layer is missing");
        Status::internal("internal error")
    })
}
