//! A TCP proxy on 127.0.0.1 that cuts connections on purpose: all of them at once, or the one
//! that sends `COMMIT`, after forwarding it, so the client never learns the outcome; or
//! silences them: open connections stay open but carry nothing more, as when a failover
//! moves an address or a NAT forgets a flow (half-open), while new connections work; or slows
//! every answer down (a loaded or distant server).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; it stops when dropped.
pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
    _stop: watch::Sender<()>,
}

struct State {
    target: SocketAddr,
    /// Bumped to cut every open connection.
    generation: watch::Sender<u64>,
    /// Bumped to silence every open connection.
    silence: watch::Sender<u64>,
    drop_next_commit: AtomicBool,
    commits_dropped: AtomicU64,
    /// How long each chunk from the server waits before it is forwarded, in milliseconds.
    delay_ms: AtomicU64,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (generation, _) = watch::channel(0u64);
        let (silence, _) = watch::channel(0u64);
        let state = Arc::new(State {
            target,
            generation,
            silence,
            drop_next_commit: AtomicBool::new(false),
            commits_dropped: AtomicU64::new(0),
            delay_ms: AtomicU64::new(0),
        });
        let (stop, mut stopped) = watch::channel(());
        let accepting = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    _ = stopped.changed() => return,
                };
                let Ok((client, _)) = accepted else { continue };
                tokio::spawn(relay(client, Arc::clone(&accepting), stopped.clone()));
            }
        });
        Proxy {
            port,
            state,
            _stop: stop,
        }
    }

    /// Closes every connection open now; new ones are accepted as before.
    pub fn cut_all(&self) {
        self.state
            .generation
            .send_modify(|generation| *generation += 1);
    }

    /// Every connection open now stops forwarding in both directions but stays open (no FIN,
    /// no RST): each side waits for an answer that never comes. New connections work.
    pub fn silence_all(&self) {
        self.state.silence.send_modify(|silence| *silence += 1);
    }

    /// The next `COMMIT` a client sends is forwarded to the server, then the connection is
    /// closed before the server's answer can reach the client: the outcome is unknown to it.
    pub fn drop_next_commit(&self) {
        self.state.drop_next_commit.store(true, Ordering::SeqCst);
    }

    /// From now on every chunk the server sends waits `delay` before it reaches the client,
    /// one chunk after another: each answer takes at least that long.
    pub fn delay_answers(&self, delay: Duration) {
        self.state
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn commits_dropped(&self) -> u64 {
        self.state.commits_dropped.load(Ordering::SeqCst)
    }
}

async fn relay(client: TcpStream, state: Arc<State>, mut stopped: watch::Receiver<()>) {
    let Ok(server) = TcpStream::connect(state.target).await else {
        return;
    };
    let mut cut = state.generation.subscribe();
    let mut silenced = state.silence.subscribe();
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Set once this connection's COMMIT is to be lost: nothing more reaches the client.
    let blackhole = AtomicBool::new(false);
    let upstream = async {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let read = client_read.read(&mut buffer).await.unwrap_or(0);
            if read == 0 {
                return;
            }
            let chunk = &buffer[..read];
            let dropping = chunk.windows(6).any(|window| window == b"COMMIT")
                && state.drop_next_commit.swap(false, Ordering::SeqCst);
            if dropping {
                blackhole.store(true, Ordering::SeqCst);
                state.commits_dropped.fetch_add(1, Ordering::SeqCst);
            }
            if server_write.write_all(chunk).await.is_err() {
                return;
            }
            if dropping {
                // Let the server receive and run the COMMIT, then lose its answer.
                tokio::time::sleep(Duration::from_millis(200)).await;
                return;
            }
        }
    };
    let downstream = async {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let read = server_read.read(&mut buffer).await.unwrap_or(0);
            if read == 0 || blackhole.load(Ordering::SeqCst) {
                return;
            }
            let delay = state.delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            if client_write.write_all(&buffer[..read]).await.is_err() {
                return;
            }
        }
    };
    // Whichever ends first (or a cut) drops both halves: both sockets close.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
        _ = cut.changed() => {}
        _ = silenced.changed() => {
            // Half-open: forward nothing more, but keep both sockets (locals of this
            // function) open until a cut or until the proxy stops.
            tokio::select! {
                _ = cut.changed() => {}
                _ = stopped.changed() => {}
            }
        }
    }
}
