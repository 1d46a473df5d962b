//! The accept loop under every listener, with the protections `axum::serve` lacks: a cap on
//! open connections, a keep-alive idle timeout, a header-read timeout and a body-read
//! timeout. Without them, clients that open connections and send nothing (or a byte now and
//! then) hold a file descriptor each for ever; about 20,000 of them exhausted the process's
//! descriptors and `/health` stopped answering.
//!
//! Each connection is served by hyper's HTTP/1 server with its header-read timer, wrapped so
//! that bytes read and written mark it active, and watched: a connection with no request in
//! flight (a streamed response counts until its last byte) and no traffic for the keep-alive
//! timeout is closed. A request body must arrive whole within the body-read timeout, or the
//! request gets 408.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::serve::Listener;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// Limits on connections. Defaults follow uvicorn (5 s keep-alive) and hyper (30 s to
/// read a request's headers).
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    /// An idle keep-alive connection (no request in flight, no bytes either way) is closed
    /// after this long. Default: 5 s.
    pub keep_alive_timeout: Duration,
    /// A request's headers must arrive within this; otherwise the connection is closed.
    /// Default: 30 s.
    pub header_read_timeout: Duration,
    /// A request's body must arrive whole within this after its headers; otherwise 408.
    /// Default: 60 s.
    pub body_read_timeout: Duration,
    /// Most connections open at once; more are answered 503 (with `Retry-After`) and
    /// closed at once. Default: 1024.
    pub max_connections: usize,
    /// After shutdown begins, how long open connections may take to finish their responses
    /// before they are dropped. Default: 10 s.
    pub drain_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            keep_alive_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            max_connections: 1024,
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// The body-read timeout fired: the handlers turn it into a 408.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?} (--body-read-timeout)")]
pub(crate) struct BodyReadTimeout(pub Duration);

/// Serves `app` on `listener` under `limits` until `shutdown` resolves; then stops
/// accepting, lets open connections finish (idle ones close at once) for up to
/// `limits.drain_timeout`, and returns.
pub async fn serve_with_limits<L: Listener>(
    mut listener: L,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    let mut full_logged: Option<Instant> = None;
    loop {
        let (io, _addr) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        match slots.clone().try_acquire_owned() {
            Ok(permit) => {
                let app = app.clone();
                let limits = limits.clone();
                let stop = stop_rx.clone();
                tokio::spawn(async move {
                    connection(io, app, &limits, stop).await;
                    drop(permit);
                });
            }
            Err(_) => {
                if full_logged.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(
                        max = limits.max_connections,
                        "connection limit reached: new connections get 503 (--max-connections)"
                    );
                    full_logged = Some(Instant::now());
                }
                tokio::spawn(refuse(io));
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let all = limits.max_connections.max(1) as u32;
    if tokio::time::timeout(limits.drain_timeout, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!(
            open = all as usize - slots.available_permits(),
            "connections still open after the drain timeout are dropped"
        );
    }
    Ok(())
}

/// Answers a connection over the limit with a 503 and closes it.
async fn refuse<S: AsyncWrite + Unpin>(mut io: S) {
    let body = r#"{"error":{"message":"too many open connections; retry shortly","type":"server_error","param":null,"code":"too_many_connections"}}"#;
    let resp = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: \
         1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = io.write_all(resp.as_bytes()).await;
        let _ = io.shutdown().await;
    })
    .await;
}

/// What the watchdog of one connection knows.
struct ConnState {
    start: Instant,
    /// Milliseconds after `start` of the last byte read or written.
    last_io_ms: AtomicU64,
    /// Requests whose response has not been sent whole.
    in_flight: AtomicUsize,
}

impl ConnState {
    fn touch(&self) {
        self.last_io_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        self.start.elapsed() - Duration::from_millis(self.last_io_ms.load(Ordering::Relaxed))
    }
}

async fn connection<S>(
    io: S,
    app: Router,
    limits: &ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let state = Arc::new(ConnState {
        start: Instant::now(),
        last_io_ms: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
    });
    let io = TokioIo::new(Watched {
        inner: io,
        state: state.clone(),
    });
    let body_timeout = limits.body_read_timeout;
    let svc_state = state.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let app = app.clone();
        let guard = InFlight::new(svc_state.clone());
        async move {
            let req = req.map(|b| Body::new(DeadlineBody::new(b, body_timeout)));
            let resp = match app.oneshot(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(resp.map(|b| {
                Body::new(Tracked {
                    inner: b,
                    _guard: guard,
                })
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let idle_limit = limits.keep_alive_timeout;
    let mut tick = tokio::time::interval(
        (idle_limit / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)),
    );
    let mut closing = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => break,
            changed = stop.wait_for(|s| *s), if !closing => {
                let _ = changed;
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tick.tick(), if !closing => {
                if state.in_flight.load(Ordering::Relaxed) == 0 && state.idle_for() >= idle_limit {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

/// The connection's stream, marking the connection active on every byte.
struct Watched<S> {
    inner: S,
    state: Arc<ConnState>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.state.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.state.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Counts a request as in flight until its response body is dropped (sent or abandoned).
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn new(state: Arc<ConnState>) -> InFlight {
        state.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its request in flight while it lives.
struct Tracked {
    inner: Body,
    _guard: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that fails with [`BodyReadTimeout`] unless it arrives whole in time.
struct DeadlineBody {
    inner: Incoming,
    limit: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl DeadlineBody {
    fn new(inner: Incoming, limit: Duration) -> DeadlineBody {
        DeadlineBody {
            inner,
            limit,
            deadline: Box::pin(tokio::time::sleep(limit)),
        }
    }
}

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyReadTimeout(self.limit))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
