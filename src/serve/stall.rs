//! A connection whose writes must keep moving: a client that stops reading its answer (its
//! receive window and the server's send buffer full) fails the write after `write_timeout`
//! without progress, so the connection closes instead of holding its task, its answer's
//! memory and a draining server forever. Time counts only while a write waits, so an answer
//! taken slowly but steadily, however long, is not cut: the socket holds few unsent bytes
//! ([`limit_unsent`]), so it reports progress each time the reader takes a little.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// Unsent bytes a connection's socket holds at most before writes wait (Linux's
/// `TCP_NOTSENT_LOWAT`): the socket reports itself writable again as soon as it holds less,
/// so a slow reader's progress is seen every time it takes a little, not only once half the
/// send buffer (megabytes) has drained — the write timeout then cuts only readers that stop.
const NOTSENT_LOWAT: usize = 128 << 10;

/// Sets [`NOTSENT_LOWAT`] on `socket` (Linux; elsewhere nothing). Best effort: a kernel that
/// refuses it leaves the default, under which a reader must take about half the send buffer
/// within the write timeout.
pub(crate) fn limit_unsent(socket: &tokio::net::TcpStream) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let value = NOTSENT_LOWAT as libc::c_int;
        // SAFETY: a valid descriptor and a c_int option value of the size given.
        unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = socket;
}

/// `inner` with a limit on how long a write, flush or shutdown may wait without progress.
pub(crate) struct WriteStallLimit<S> {
    inner: S,
    limit: Duration,
    /// Armed when a write first waits, disarmed by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteStallLimit<S> {
    /// `inner`, whose writes may wait at most `limit` without progress.
    pub(crate) fn new(inner: S, limit: Duration) -> Self {
        WriteStallLimit {
            inner,
            limit,
            stalled: None,
        }
    }

    /// What a write that did (`Ready`) or did not progress returns: a wait past the limit
    /// fails with `TimedOut`.
    fn progress<T>(
        &mut self,
        polled: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let stalled = (self.stalled).get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took no byte of its answer for {limit:?} (write_timeout)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteStallLimit<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteStallLimit<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(polled, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progress(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(polled, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progress(polled, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::Instant;

    /// A runtime whose clock moves only when every task waits (to the next timer): the
    /// timings below are exact whatever the machine's load.
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// A write into a pipe nobody reads fails after the limit, naming it; the same answer
    /// read slowly (a chunk every 40 ms, 25 chunks: 1 s in all, five times the limit) is
    /// written whole.
    #[test]
    fn a_stalled_write_fails_after_the_limit_and_a_slow_reader_gets_everything() {
        runtime().block_on(async {
            let limit = Duration::from_millis(200);
            let answer = vec![7u8; 25 * 64];

            let (server, _client) = tokio::io::duplex(64);
            let mut server = WriteStallLimit::new(server, limit);
            let start = Instant::now();
            let err = server
                .write_all(&answer)
                .await
                .expect_err("the write stalled");
            let waited = start.elapsed();
            assert_eq!(err.kind(), io::ErrorKind::TimedOut);
            assert!(err.to_string().contains("write_timeout"), "{err}");
            assert_eq!(waited, limit, "failed after {waited:?}");

            let (server, mut client) = tokio::io::duplex(64);
            let mut server = WriteStallLimit::new(server, limit);
            let reader = tokio::spawn(async move {
                let mut got = Vec::new();
                let mut chunk = [0u8; 64];
                loop {
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    match client.read(&mut chunk).await.unwrap() {
                        0 => return got,
                        n => got.extend_from_slice(&chunk[..n]),
                    }
                }
            });
            let start = Instant::now();
            server
                .write_all(&answer)
                .await
                .expect("a slow reader progresses");
            server.shutdown().await.unwrap();
            drop(server);
            assert_eq!(reader.await.unwrap(), answer);
            assert!(
                start.elapsed() >= Duration::from_millis(960),
                "{:?}",
                start.elapsed()
            );
        });
    }
}
