//! A TCP proxy that holds every byte for a fixed time in each direction, so a client behind it
//! pays a network's round-trip time (`rtt`, half on the way there, half on the way back), like
//! a database in another machine of the same zone. This kernel has no `netem` qdisc; a
//! delaying proxy (toxiproxy's kind of tool) gives the same delay to every client that talks
//! through it: pgbench, the guide's consumer and idem alike.
//!
//! Each direction of a connection is two threads: one reads whatever arrives and stamps it
//! with the time it may leave, the other writes it at that time, in order. Many requests may
//! be in flight at once (a pipelined flight is not serialised behind the delay), and nothing
//! is merged or split beyond what TCP does anyway. The writer sleeps with a 1 ns timer slack
//! (Linux's default 50 µs would overshoot a 250 µs delay by a fifth) and asks to be woken as
//! early as it has lately woken late; what the proxy adds on top of `rtt` is measured by
//! [`probe`] and reported beside every figure taken through it.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Reads `0`, `500us`, `0.5ms`, `1ms` (a round-trip time).
pub fn parse_rtt(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| c.is_ascii_alphabetic()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("RTT {text:?} is not a number with a unit (0, 500us, 0.5ms)"))?;
    let micros = match unit {
        "" if value == 0.0 => 0.0,
        "us" | "µs" => value,
        "ms" => value * 1e3,
        "s" => value * 1e6,
        _ => return Err(format!("RTT {text:?}: the unit must be us, ms or s")),
    };
    if !(0.0..=10e6).contains(&micros) {
        return Err(format!("RTT {text:?} must be between 0 and 10 s"));
    }
    Ok(Duration::from_nanos((micros * 1e3) as u64))
}

/// Listens on `listen` (port 0: any free port) and forwards every connection to `upstream`
/// with `rtt` added to each round trip, on background threads, until the process ends.
/// Returns the address it listens on.
pub fn spawn(listen: SocketAddr, upstream: SocketAddr, rtt: Duration) -> io::Result<SocketAddr> {
    let listener = TcpListener::bind(listen)?;
    let address = listener.local_addr()?;
    thread::Builder::new()
        .name("delay-accept".into())
        .spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if let Err(error) = connect(client, upstream, rtt / 2) {
                    eprintln!("delay-proxy: cannot reach {upstream}: {error}");
                }
            }
        })?;
    Ok(address)
}

fn connect(client: TcpStream, upstream: SocketAddr, one_way: Duration) -> io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    forward(client.try_clone()?, server.try_clone()?, one_way)?;
    forward(server, client, one_way)
}

/// Copies `from` to `to`, each chunk `delay` after it arrived; shuts `to`'s write half when
/// `from` ends.
fn forward(mut from: TcpStream, mut to: TcpStream, delay: Duration) -> io::Result<()> {
    let (chunks, arrived) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::Builder::new()
        .name("delay-read".into())
        .spawn(move || {
            let mut buffer = vec![0u8; 64 * 1024];
            while let Ok(read @ 1..) = from.read(&mut buffer) {
                let due = Instant::now() + delay;
                if chunks.send((due, buffer[..read].to_vec())).is_err() {
                    break;
                }
            }
        })?;
    thread::Builder::new()
        .name("delay-write".into())
        .spawn(move || {
            precise_sleeps();
            let mut wake_up = WakeUp::default();
            for (due, chunk) in arrived {
                wake_up.sleep_until(due);
                if to.write_all(&chunk).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        })?;
    Ok(())
}

/// Sleeps that end on time on average: a sleeping thread wakes some tens of microseconds late
/// (the scheduler's wake-up time, more on a busy machine), so each sleep ends that much early,
/// learned from the sleeps before it.
#[derive(Default)]
struct WakeUp {
    /// How much earlier than due to ask to be woken, in nanoseconds.
    early_nanos: f64,
}

impl WakeUp {
    fn sleep_until(&mut self, due: Instant) {
        let asked = due
            .checked_sub(Duration::from_nanos(self.early_nanos as u64))
            .unwrap_or(due);
        let now = Instant::now();
        if asked <= now {
            return;
        }
        thread::sleep(asked - now);
        let woke = Instant::now();
        let late = if woke >= due {
            (woke - due).as_nanos() as f64
        } else {
            -((due - woke).as_nanos() as f64)
        };
        self.early_nanos = (self.early_nanos + late / 8.0).clamp(0.0, 200_000.0);
    }
}

/// This thread's sleeps end within the scheduler's wake-up time instead of up to 50 µs late.
/// (The one call to libc in the workspace: Rust's standard library has no timer slack.)
#[allow(unsafe_code)]
fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer and changes only this thread's slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
}

/// `SELECT 1` round trips straight to PostgreSQL and through a proxy, measured in turn.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    pub direct: crate::Percentiles,
    pub proxied: crate::Percentiles,
}

impl Probe {
    /// What the proxy adds to a round trip beyond `rtt`, at the median.
    pub fn overhead(&self, rtt: Duration) -> Duration {
        self.proxied.p50.saturating_sub(self.direct.p50 + rtt)
    }
}

/// Round trips each probe times, each way.
const PROBE_ROUNDS: usize = 2_000;

/// Times [`PROBE_ROUNDS`] simple-query round trips on a connection to `direct` (a PostgreSQL
/// URL), then on one to the same server through the proxy at `proxy`.
pub async fn probe(direct: &str, proxy: SocketAddr) -> Result<Probe, String> {
    Ok(Probe {
        direct: round_trips(direct).await?,
        proxied: round_trips(&through(direct, proxy)?).await?,
    })
}

/// `url` with the proxy at `proxy` as its host and port.
fn through(url: &str, proxy: SocketAddr) -> Result<String, String> {
    let mut parsed = url::Url::parse(url).map_err(|error| format!("{url}: {error}"))?;
    parsed
        .set_host(Some(&proxy.ip().to_string()))
        .map_err(|error| format!("{url}: {error}"))?;
    parsed
        .set_port(Some(proxy.port()))
        .map_err(|()| format!("{url}: cannot take a port"))?;
    Ok(parsed.to_string())
}

async fn round_trips(url: &str) -> Result<crate::Percentiles, String> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|error| format!("cannot connect to {url} for the probe: {error}"))?;
    let running = tokio::spawn(connection);
    let mut samples = Vec::with_capacity(PROBE_ROUNDS);
    for _ in 0..PROBE_ROUNDS {
        let started = Instant::now();
        client
            .simple_query("SELECT 1")
            .await
            .map_err(|error| format!("probe query failed: {error}"))?;
        samples.push(started.elapsed());
    }
    drop(client);
    let _ = running.await;
    Ok(crate::Percentiles::of(&mut samples))
}

/// `url` (a PostgreSQL URL) behind a new proxy adding `rtt` to each round trip, with the
/// probe of that proxy; `url` itself when `rtt` is zero.
pub async fn behind_proxy(url: &str, rtt: Duration) -> Result<(String, Option<Probe>), String> {
    if rtt.is_zero() {
        return Ok((url.to_string(), None));
    }
    let parsed = url::Url::parse(url).map_err(|error| format!("{url}: {error}"))?;
    let upstream = parsed
        .socket_addrs(|| Some(5432))
        .map_err(|error| format!("{url}: {error}"))?
        .into_iter()
        .next()
        .ok_or_else(|| format!("{url} names no address"))?;
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let proxy = spawn(loopback, upstream, rtt)
        .map_err(|error| format!("cannot start the delaying proxy: {error}"))?;
    let probe = probe(url, proxy).await?;
    Ok((through(url, proxy)?, Some(probe)))
}
