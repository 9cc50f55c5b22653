//! A delaying TCP proxy in front of PostgreSQL, for `bench/throughput.sh RTT=…`: every round
//! trip through it takes `--rtt` longer (see `idem_bench::delay`).
//!
//! `delay-proxy --listen 127.0.0.1:6433 --upstream 127.0.0.1:5432 --rtt 0.5ms
//! [--probe postgres://postgres@127.0.0.1:5432/postgres]`: with `--probe`, first prints what a
//! `SELECT 1` round trip costs straight and through the proxy, so the proxy's own cost is known.
//! Runs until it is stopped.

use std::net::SocketAddr;

use idem_bench::delay;
use idem_bench::micros;

fn main() {
    if let Err(error) = run() {
        eprintln!("delay-proxy: {error}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let mut listen: SocketAddr = "127.0.0.1:6433".parse().expect("address");
    let mut upstream: SocketAddr = "127.0.0.1:5432".parse().expect("address");
    let mut rtt = std::time::Duration::ZERO;
    let mut probe_url = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => {
                listen = value
                    .parse()
                    .map_err(|_| format!("--listen {value:?} is not host:port"))?
            }
            "--upstream" => {
                upstream = value
                    .parse()
                    .map_err(|_| format!("--upstream {value:?} is not host:port"))?
            }
            "--rtt" => rtt = delay::parse_rtt(&value)?,
            "--probe" => probe_url = Some(value),
            other => {
                return Err(format!(
                    "unknown flag {other} (--listen, --upstream, --rtt, --probe)"
                ));
            }
        }
    }
    let address = delay::spawn(listen, upstream, rtt)
        .map_err(|error| format!("cannot listen on {listen}: {error}"))?;
    println!(
        "delay-proxy: {address} -> {upstream}, {} added to every round trip",
        micros(rtt)
    );
    if let Some(url) = probe_url {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| error.to_string())?;
        let probe = runtime.block_on(delay::probe(&url, address))?;
        println!(
            "delay-proxy: probe, SELECT 1 round trip p50 / p99: direct {} / {}, through the proxy {} / {}; the proxy adds {} beyond the RTT at p50",
            micros(probe.direct.p50),
            micros(probe.direct.p99),
            micros(probe.proxied.p50),
            micros(probe.proxied.p99),
            micros(probe.overhead(rtt))
        );
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}
