//! The books balance under faults: two leasing replicas of one tenant, random reserves on random
//! replicas, commits (some beyond their hold: debt) and releases at the owner or forwarded through
//! another replica, renewals and lease windows, while calls fail at random: through a TCP proxy in
//! front of a real Redis that cuts connections right after forwarding a script call (the script
//! ran, its reply is lost) and holds replies past the command timeout, the same in front of every
//! node of a Redis Cluster (each announcing its proxy as itself), and through a store wrapper that
//! loses replies or calls on the embedded store and the shared Cluster. A caller retries what failed,
//! as a client of the Admission service would.
//!
//! At the end (faults off, every replica's windows taken, every hold settled, the slices given back,
//! the retry queue drained) the store's day usage equals the usage truly committed, to the token;
//! no slot is held; and no commit or release of an admitted hold was ever answered `NOT_FOUND`.

// Small test numbers: the casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

mod support;

use std::time::Duration;

use support::faults::Chaos;
use support::proxy::FaultProxy;
use support::{Harness, TOP_SEPARATOR};
use tollgate::admission::Decision;
use tollgate::hold::{CommitOutcome, ReleaseOutcome, RenewOutcome};
use tollgate::store::Store;
use tollgate::store::redis::{RedisOptions, RedisStore, RedisTarget};

/// Operations in one run (bounded, as every loop in a soak test is).
const OPS: usize = 400;
/// Attempts at a commit or release (or a lease window once the faults are off) before the test
/// gives up on the store, `RETRY_EVERY` apart, for at most `RETRY_FOR`: five seconds, past several
/// of the client's reconnects (at most 500 ms apart after connections cut in a row), while which
/// every call fails at once.
const ATTEMPTS: usize = 1_000;
const RETRY_EVERY: Duration = Duration::from_millis(5);
const RETRY_FOR: Duration = Duration::from_secs(5);

/// The attempts of one retry loop: at most [`ATTEMPTS`], for at most [`RETRY_FOR`].
fn attempts() -> impl Iterator<Item = usize> {
    let until = std::time::Instant::now() + RETRY_FOR;
    (0..ATTEMPTS).take_while(move |_| std::time::Instant::now() <= until)
}

fn policy() -> String {
    format!(
        "leasing:\n  window_ms: 250\n  max_share: 0.5\n{TOP_SEPARATOR}lease_ttl_ms: 60000\non_store_error: fail_closed\n\
         limits:\n  tokens_per_minute: 6000000\n  burst_tokens: 200000\n  tokens_per_day: 100000000\n  max_concurrency: 40\n"
    )
}

#[derive(Debug)]
struct Hold {
    id: String,
    owner: usize,
    held: u64,
    settled: bool,
}

/// What one run saw.
#[derive(Debug, Default)]
struct Run {
    admitted: usize,
    refused: usize,
    committed_usage: u64,
    failed_calls: usize,
}

/// Commits (`Some(usage)`) or releases a hold at `at`, retrying what failed. Never `NOT_FOUND`.
async fn settle<S: Store>(r: &Harness<S>, h: &Hold, usage: Option<u64>, run: &mut Run) {
    let mut last = None;
    for _ in attempts() {
        let outcome = match usage {
            Some(used) => r.admission.commit(&h.id, used / 2, used - used / 2).await.map(|o| {
                assert_ne!(o, CommitOutcome::NotFound, "the commit of an admitted hold: {h:?}");
                o.state()
            }),
            None => r.admission.release(&h.id).await.map(|o| {
                assert_ne!(o, ReleaseOutcome::NotFound, "the release of an admitted hold: {h:?}");
                o.state()
            }),
        };
        match outcome {
            Ok(_) => return,
            Err(e) => {
                run.failed_calls += 1;
                last = Some(e);
                tokio::time::sleep(RETRY_EVERY).await;
            }
        }
    }
    panic!("{h:?} could not be settled in {RETRY_FOR:?} ({ATTEMPTS} attempts at most), the last failing with {last:?}");
}

/// A window of `r` once the faults are off: a connection still being made again may fail the
/// first tries.
async fn window<S: Store>(r: &Harness<S>, ending: bool) {
    for _ in attempts() {
        if r.admission.lease_tick(ending).await.is_ok() {
            return;
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
    panic!("no window went through once the faults were off");
}

/// The run, on `replicas` of one tenant whose store fails as the test set it up to; `at_op` is
/// told each operation's number before it runs (to change the faults at one), `calm` turns the
/// faults off.
async fn books_balance<S: Store + Clone>(
    replicas: &[Harness<S>],
    seed: u64,
    at_op: impl Fn(usize),
    calm: impl Fn(),
) -> Run {
    if !replicas[0].exact_time() {
        // The run and its final count of the day's usage fall inside one day.
        support::clear_of_a_turn(Duration::from_secs(60)).await;
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let workers: Vec<_> = replicas.iter().filter_map(|r| r.admission.run_retries(stop.clone())).collect();
    let n = replicas.len() as u64;
    let rng = support::rng::Seeded::new(seed);
    let mut holds: Vec<Hold> = Vec::new();
    let mut run = Run::default();
    for op in 0..OPS {
        at_op(op);
        let live: Vec<usize> = (0..holds.len()).filter(|&i| !holds[i].settled).collect();
        let pick = |rng: &support::rng::Seeded| live.get(rng.below(live.len() as u64) as usize).copied();
        match rng.below(10) {
            0..=3 => {
                let owner = rng.below(n) as usize;
                let (prompt, max_tokens) = (1 + rng.below(200), 1 + rng.below(300));
                match replicas[owner].reserve(prompt, max_tokens).await {
                    Decision::Admitted(a) => {
                        run.admitted += 1;
                        holds.push(Hold { id: a.reservation_id, owner, held: a.reserved_tokens, settled: false });
                    }
                    _ => run.refused += 1,
                }
            }
            4..=6 => {
                let Some(i) = pick(&rng) else { continue };
                let at = if rng.below(2) == 0 { holds[i].owner } else { rng.below(n) as usize };
                // Up to half again the hold: an overrun is debt, charged in full.
                let usage = rng.below(holds[i].held * 3 / 2 + 1);
                settle(&replicas[at], &holds[i], Some(usage), &mut run).await;
                run.committed_usage += usage;
                holds[i].settled = true;
            }
            7 => {
                let Some(i) = pick(&rng) else { continue };
                let at = rng.below(n) as usize;
                settle(&replicas[at], &holds[i], None, &mut run).await;
                holds[i].settled = true;
            }
            8 => {
                let Some(i) = pick(&rng) else { continue };
                let at = rng.below(n) as usize;
                if let Ok(o) = replicas[at].admission.renew(&holds[i].id, 0).await {
                    assert_ne!(o, RenewOutcome::NotFound, "the renewal of a live hold: {:?}", holds[i]);
                }
            }
            _ => {
                let at = rng.below(n) as usize;
                if replicas[at].admission.lease_tick(false).await.is_err() {
                    run.failed_calls += 1;
                }
            }
        }
    }
    calm();
    // Each replica's windows: calls whose answers were lost go again, forwarded operations are
    // applied by their owners.
    for _ in 0..3 {
        for r in replicas {
            window(r, false).await;
        }
    }
    for h in holds.iter().filter(|h| !h.settled) {
        settle(&replicas[h.owner], h, None, &mut run).await;
    }
    for r in replicas {
        window(r, true).await;
    }
    stop.cancel();
    for w in workers {
        w.await.unwrap();
    }
    let scope = replicas[0].tenant_scope().await;
    assert_eq!(scope.num("c"), 0.0, "slots still held: {scope:?}\n{run:?}");
    assert_eq!(
        scope.num("du"),
        run.committed_usage as f64,
        "the store's day usage against the usage committed: {scope:?}\n{run:?}"
    );
    assert!(run.admitted > OPS / 10, "the run admitted too little to mean anything: {run:?}");
    run
}

/// Through the TCP fault proxy on a single Redis: 20% of the script calls have their connection cut
/// right after they are forwarded, and for a stretch of the run every reply is held past the
/// command timeout. Each replica has a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_balance_through_a_proxy_that_cuts_connections() {
    let upstream = support::redis_url().trim_start_matches("redis://").trim_end_matches('/').parse().unwrap();
    let proxy = FaultProxy::start(upstream, 0x5eed).await;
    let timeout = Duration::from_millis(300);
    let first = support::redis_at(&proxy.url(), &policy(), timeout).await;
    let options = RedisOptions { command_timeout: timeout, ..RedisOptions::default() };
    let own = RedisStore::connect(&RedisTarget::Single(proxy.url()), options).await.unwrap();
    let second = first.wrapped(|_| own).await;
    proxy.cut_after_scripts(200);
    // A stretch of held replies, well inside the run: the next six (each past its timeout), so a
    // call retried into it gets through after them.
    let stretch = |op: usize| {
        if op == 100 {
            proxy.hold_replies(400, 6);
        }
    };
    let run = books_balance(&[first, second], 0x5eed, stretch, || proxy.calm()).await;
    assert!(proxy.cuts() >= 5, "the proxy cut {} connections: not a fault test", proxy.cuts());
    eprintln!("{run:?}; {} connections cut", proxy.cuts());
}

/// The same on a Redis Cluster of the test's own, each node behind a fault proxy that it announces
/// as itself: a script call's connection cut (and the client's re-send after it), on whichever
/// node holds the tenant's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_balance_through_proxies_on_a_cluster() {
    use support::proxy::ProxiedCluster;
    let cluster = ProxiedCluster::start(0xc105).await;
    let timeout = Duration::from_millis(300);
    let options = RedisOptions { command_timeout: timeout, ..RedisOptions::default() };
    let target = RedisTarget::Cluster(cluster.nodes());
    let connect = || RedisStore::connect(&target, options);
    let nodes = cluster.nodes().iter().map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(", ");
    let (tenant, pool) = (support::unique_tenant("t"), support::unique_tenant("p"));
    let (top, body) = policy().split_once(TOP_SEPARATOR).map(|(t, b)| (t.to_string(), b.to_string())).unwrap();
    let yaml = support::policy_yaml(&tenant, &pool, &body, &format!("{top}\nstore:\n  redis_cluster: [{nodes}]"));
    let policy = tollgate::config::Policy::parse("test.yaml", &yaml).expect("test policy");
    let first =
        Harness::from_parts(connect().await.expect("the cluster, through its proxies"), policy, tenant, pool, None)
            .await;
    let own = connect().await.expect("a second connection");
    let second = first.wrapped(|_| own).await;
    for proxy in &cluster.proxies {
        proxy.cut_after_scripts(200);
    }
    let run =
        books_balance(&[first, second], 0xc105, |_| {}, || cluster.proxies.iter().for_each(FaultProxy::calm)).await;
    let cuts: u32 = cluster.proxies.iter().map(FaultProxy::cuts).sum();
    assert!(cuts >= 5, "the proxies cut {cuts} connections: not a fault test");
    eprintln!("{run:?}; {cuts} connections cut");
}

/// The same with calls failing in the store wrapper (15% lose their reply, 15% never arrive), on
/// the embedded store and on the Cluster, over several seeds (a fresh tenant each).
async fn under_lost_calls<S, F, Fut>(make: F)
where
    S: Store + Clone,
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Harness<S>>,
{
    for seed in [1_u64, 0xfeed, 0xbeef] {
        let h = make(policy()).await;
        let first = h.wrapped(|s| Chaos::new(s, 150, seed)).await;
        let chaos = first.admission.protocol().store().clone();
        let second = first.wrapped(|s| s).await;
        let run = books_balance(&[first, second], seed, |_| {}, || chaos.calm()).await;
        assert!(chaos.failed() > 10, "{} calls failed: not a fault test ({run:?})", chaos.failed());
        eprintln!("seed {seed:#x}: {run:?}; {} calls failed", chaos.failed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_balance_under_lost_calls_embedded() {
    under_lost_calls(|body| async move { support::embedded(&body).await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_balance_under_lost_calls_cluster() {
    under_lost_calls(|body| async move { support::cluster(&body).await }).await;
}
