//! Client connections of the gRPC server: each is closed once it has sent nothing for
//! the idle timeout. HTTP/2 keepalive pings (set on the server) make every live client
//! send something at least once per keepalive interval, even with no call open, so the
//! timeout only closes connections whose peer is silent: one that never completes its
//! TLS or HTTP/2 handshake (hyper has no handshake timeout for HTTP/2), or one that
//! stops answering pings before the keepalive timeout notices.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};
use tonic::transport::server::Connected;

/// A connection that fails its reads once nothing has arrived for `timeout`; the HTTP/2
/// server then closes it.
pub struct IdleTimeout<IO> {
    io: IO,
    timeout: Duration,
    /// When bytes last arrived: reads only note the time, the timer is moved when it
    /// fires, so a busy connection does not touch the timer wheel per read.
    last_read: Instant,
    /// Boxed so the connection stays `Unpin`, as the server requires.
    deadline: Pin<Box<Sleep>>,
}

impl<IO> IdleTimeout<IO> {
    pub fn new(io: IO, timeout: Duration) -> Self {
        let now = Instant::now();
        IdleTimeout {
            io,
            timeout,
            last_read: now,
            deadline: Box::pin(tokio::time::sleep_until(now + timeout)),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for IdleTimeout<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.last_read = Instant::now();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => loop {
                if this.deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let due = this.last_read + this.timeout;
                if due <= Instant::now() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client sent nothing for {:?}", this.timeout),
                    )));
                }
                // Bytes arrived since the timer was set: wait from the last of them.
                this.deadline.as_mut().reset(due);
            },
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The connection's own information (its addresses), so calls see it as before.
impl<IO: Connected> Connected for IdleTimeout<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn reads_fail_once_nothing_arrived_for_the_timeout() {
        let timeout = Duration::from_millis(300);
        let (mut client, server) = tokio::io::duplex(64);
        let mut server = IdleTimeout::new(server, timeout);
        let mut buffer = [0; 8];

        // Bytes within the timeout keep the connection, past the first timeout: each
        // one restarts it.
        let opened = Instant::now();
        for _ in 0..4 {
            tokio::time::sleep(timeout / 2).await;
            client.write_all(b"x").await.unwrap();
            assert_eq!(server.read(&mut buffer).await.unwrap(), 1);
        }
        assert!(opened.elapsed() > timeout);
        let last_read = Instant::now();
        let error = server.read(&mut buffer).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(last_read.elapsed() >= timeout);
    }
}
