//! Leasing's bound, on random sequences: three replicas (three `Admission`s, each its own replica
//! id) lease one tenant's scopes from one embedded store on a manual clock. Reserves of random
//! sizes on random replicas and users; commits (up to half again beyond the hold: debt) and
//! releases at the owner or at another replica (forwarded); renewals; lease windows; clock jumps
//! past refills and leases; reloads that cut the tenant's burst and restore it (and give one user
//! a limit leasing does not decide from slices, so that its requests go to the store beside the
//! leased ones, and take it away again: an hour's budget of output tokens, a bucket of input
//! tokens or a week's budget, one of them a case); replicas that
//! stall (no decision, window or call for up to 9 s, past their lease) and replicas that die
//! without giving their slices back; half the cases start 20 s before midnight and cross it; in
//! half, store calls that fail at random (a tenth run and lose their reply, a tenth never arrive),
//! which a caller retries, settlements forwarded all the same (one whose application fails is
//! applied by the owner's retry queue, drained before the next step); and in half, a tenant whose
//! expired holds give their tokens back (`expired_usage: refund`).
//!
//! Beside them runs a reference: one bucket per scope as a single store would keep it, driven by
//! what the replicas actually admitted and settled. After every step:
//!
//! - **concurrency is exact**: the holds alive (admitted, not settled, lease not passed) in each
//!   scope never exceed its `max_concurrency`;
//! - **tokens and requests overshoot by at most one slice per replica**: the reference bucket never
//!   falls below minus `replicas × max_share × capacity`, plus the refunds that had not yet reached
//!   the store the last time the reference bucket was full (a refund beyond a slice's share goes
//!   back with its replica's next window, and may find room there that the full bucket did not
//!   have; what a slice holds beyond a share a reload cut goes back so too), plus, after a reload
//!   cut the capacity, the old bound until the bucket is full again;
//! - **each day's budget is exact**: what the replicas admitted that day and did not refund never
//!   exceeds it.
//!
//! (Debt is the caller's usage beyond its hold: a single store charges it too, so the reference
//! bucket leaves it out of the bound, and the day's usage counts it.)
//!
//! At the end every live replica gives its slices back and every live hold of theirs is released,
//! and a dead replica's lease record is settled by the others' sweepers; then no slot is held, and
//! the store's usage of the month (of the day, when the case stayed in one) equals the
//! reference's to the token: the books balance. With a replica dead, it differs by no more than
//! what the dead took with them (their free slices, refunds and debt not yet sent).

// Small test numbers: the casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss, clippy::cast_sign_loss)]

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use support::Harness;
use support::faults::Chaos;
use tollgate::admission::{Attributes, Decision};
use tollgate::config::Policy;
use tollgate::hold::{CommitOutcome, ReleaseOutcome, RenewOutcome, Settled};
use tollgate::store::clock::ManualClock;
use tollgate::store::embedded::EmbeddedStore;
use tollgate::store::keys;

const REPLICAS: usize = 3;
const LEASE_MS: u64 = 5_000;

/// (tokens per minute, burst, requests per minute, max concurrency) of the tenant, then of user u0.
const TENANT: (u64, u64, u64, u64) = (6_000, 2_000, 600, 6);
const USER: (u64, u64, u64, u64) = (3_000, 1_000, 300, 3);
const BUDGET: u64 = 40_000;
/// The largest hold a reserve of the generator asks for (prompt and output).
const LARGEST_HOLD: u64 = 300 + 500;

#[derive(Debug, Clone)]
enum Op {
    Reserve {
        replica: usize,
        user: bool,
        prompt: u64,
        max_tokens: u64,
    },
    /// Commits the `hold`-th admitted hold (modulo) at `replica`, with `per_mille` of its hold used.
    Commit {
        hold: usize,
        replica: usize,
        per_mille: u64,
    },
    Release {
        hold: usize,
        replica: usize,
    },
    Renew {
        hold: usize,
    },
    Tick {
        replica: usize,
    },
    Advance {
        ms: u64,
    },
    /// The tenant's burst falls to 1,200 tokens (`tight`) or comes back to 2,000, on every
    /// replica at once.
    Reload {
        tight: bool,
    },
    /// The replica stops running for `ms` (a pause, a partition): no decision, no window, no
    /// call; what others forward for it waits. Past the lease, the store takes it for stopped.
    Stall {
        replica: usize,
        ms: u64,
    },
    /// The replica stops for good, without giving its slices back (at most all but one).
    Die {
        replica: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..REPLICAS, any::<bool>(), 0..300u64, 1..500u64)
            .prop_map(|(replica, user, prompt, max_tokens)| Op::Reserve { replica, user, prompt, max_tokens }),
        3 => (any::<usize>(), 0..REPLICAS, prop_oneof![4 => 0..=1000u64, 1 => 1001..=1500u64])
            .prop_map(|(hold, replica, per_mille)| Op::Commit { hold, replica, per_mille }),
        1 => (any::<usize>(), 0..REPLICAS).prop_map(|(hold, replica)| Op::Release { hold, replica }),
        1 => any::<usize>().prop_map(|hold| Op::Renew { hold }),
        2 => (0..REPLICAS).prop_map(|replica| Op::Tick { replica }),
        2 => prop_oneof![1..300u64, 300..3_000u64, 3_000..8_000u64].prop_map(|ms| Op::Advance { ms }),
        1 => prop_oneof![
            3 => any::<bool>().prop_map(|tight| Op::Reload { tight }),
            3 => (0..REPLICAS, prop_oneof![500..3_000u64, 5_000..9_000u64]).prop_map(|(replica, ms)| Op::Stall { replica, ms }),
            1 => (0..REPLICAS).prop_map(|replica| Op::Die { replica }),
        ],
    ]
}

/// Where a case's clock starts: mid-day, or 20 s before the day's turn.
const STARTS: [u64; 2] = [support::CLOCK_START_MS, support::CLOCK_START_MS + 12 * 3_600_000 - 20_000];

/// What `tight` gives user u0 beside its slices' limits, by a case's `aside`: a limit leasing does
/// not decide from slices (an hour's output budget, a bucket of input tokens, a week's budget),
/// so that while it holds u0's requests are decided at the store, beside the leased ones.
const ASIDES: [&str; 3] = ["output_tokens_per_hour: 20000", "input_tokens_per_minute: 1500", "tokens_per_week: 30000"];

/// The policy: `tight` also gives user u0 the limit `ASIDES[aside]`.
fn policy(tenant: &str, share: f64, refund: bool, tight: bool, aside: usize) -> String {
    let expired = if refund { "    expired_usage: refund\n" } else { "" };
    let limits = |(tpm, burst, rpm, c): (u64, u64, u64, u64), budget: Option<&str>| {
        let budget = budget.map_or(String::new(), |b| format!(", {b}"));
        format!(
            "{{ tokens_per_minute: {tpm}, burst_tokens: {burst}, requests_per_minute: {rpm}, max_concurrency: {c}{budget} }}"
        )
    };
    format!(
        "leasing: {{ window_ms: 250, max_share: {share} }}\n\
         models:\n  m: {{ max_output_tokens: 1000, bytes_per_token: 4 }}\n\
         tenants:\n  {tenant}:\n    lease_ttl_ms: {LEASE_MS}\n{expired}    limits: {}\n    users:\n      u0: {}\n",
        limits(tenant_limits(tight), Some(&format!("tokens_per_day: {BUDGET}"))),
        limits(USER, tight.then_some(ASIDES[aside])),
    )
}

/// The tenant's limits: its burst 1,200 when `tight`.
fn tenant_limits(tight: bool) -> (u64, u64, u64, u64) {
    if tight { (TENANT.0, 1_200, TENANT.2, TENANT.3) } else { TENANT }
}

/// A scope as a single store would keep it.
#[derive(Debug, Clone)]
struct Bucket {
    capacity: f64,
    per_ms: f64,
    tokens: f64,
    requests: f64,
    request_capacity: f64,
    requests_per_ms: f64,
    max_concurrency: usize,
    /// Refunds not yet back at the store the last time this bucket was full.
    in_flight_when_full: f64,
    /// After a reload cut the capacity, what the replicas could overshoot under the old one, until
    /// the bucket is full again (a deficit run up under the old slices lasts until then).
    before_reload: f64,
}

impl Bucket {
    fn new((tpm, burst, rpm, c): (u64, u64, u64, u64)) -> Self {
        Bucket {
            capacity: burst as f64,
            per_ms: tpm as f64 / 60_000.0,
            tokens: burst as f64,
            requests: rpm as f64,
            request_capacity: rpm as f64,
            requests_per_ms: rpm as f64 / 60_000.0,
            max_concurrency: c as usize,
            in_flight_when_full: 0.0,
            before_reload: 0.0,
        }
    }

    /// The level a single store reads now: what it holds and has refilled since, never above the
    /// capacity it reads with. (A reload that cuts the capacity and restores it before the store
    /// reads the bucket cuts nothing.)
    fn level(&self) -> f64 {
        self.tokens.min(self.capacity)
    }

    /// A reload sets a new capacity, the one the store reads the level with next.
    fn reload(&mut self, capacity: u64, slack: f64) {
        if (capacity as f64) < self.capacity {
            self.before_reload = self.before_reload.max(slack);
        }
        self.capacity = capacity as f64;
    }

    fn refill(&mut self, ms: u64, in_flight: u64) {
        self.tokens += self.per_ms * ms as f64;
        self.requests = (self.requests + self.requests_per_ms * ms as f64).min(self.request_capacity);
        self.note_full(in_flight);
    }

    /// A reservation takes `tokens` from the level the store reads.
    fn take(&mut self, tokens: u64) {
        self.tokens = self.level() - tokens as f64;
        self.requests -= 1.0;
    }

    fn refund(&mut self, tokens: u64, in_flight: u64) {
        self.tokens = (self.level() + tokens as f64).min(self.capacity);
        self.note_full(in_flight);
    }

    fn note_full(&mut self, in_flight: u64) {
        if self.level() >= self.capacity {
            self.before_reload = 0.0;
            self.in_flight_when_full = in_flight as f64;
        }
    }
}

/// What a commit or a release answered.
enum Settling {
    Commit(CommitOutcome),
    Release(ReleaseOutcome),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Admitted; expired once the clock passes its lease.
    Live,
    /// Its lease passed and a release found it so: charged as held, a late commit may still come.
    Expired,
    /// Committed, late-committed or released.
    Done,
}

#[derive(Debug, Clone)]
struct Hold {
    id: String,
    owner: usize,
    user: bool,
    held: u64,
    lease_until: u64,
    state: State,
    /// The store's day it was admitted on: a refund goes back to it.
    day: u64,
}

/// An operation left for the owner replica, applied at its next window.
#[derive(Debug, Clone)]
enum Pending {
    Commit { hold: usize, used: u64 },
    Release { hold: usize },
}

/// How the owner's answer shows a hold was settled before: committed with these tokens charged,
/// committed (counts unknown), or released.
#[derive(Debug, Clone, Copy)]
enum Shown {
    Committed(u64),
    AnyCommit,
    Released,
}

impl Pending {
    fn hold(&self) -> usize {
        match *self {
            Pending::Commit { hold, .. } | Pending::Release { hold } => hold,
        }
    }
}

struct World {
    replicas: Vec<Harness<Chaos<EmbeddedStore>>>,
    chaos: Chaos<EmbeddedStore>,
    /// Each replica's retry worker (settlements whose store call failed), stopped at the end.
    stop: tokio_util::sync::CancellationToken,
    retries: Vec<tokio::task::JoinHandle<()>>,
    clock: ManualClock,
    share: f64,
    tenant: Bucket,
    user: Bucket,
    /// Per store day, tokens admitted and not refunded, debt included, and of which debt (usage
    /// beyond holds, charged to the day it was reported on).
    usage: BTreeMap<u64, (u64, u64)>,
    /// The policy's text, for reloads: the share, `expired_usage: refund`, and which of `ASIDES`.
    terms: (f64, bool, usize),
    /// The last reload was tight: user u0 has its limit aside, which sends its requests to the
    /// store.
    tight: bool,
    /// Until when (the case's clock) each replica is stalled; `u64::MAX`: dead.
    stalled_until: [u64; REPLICAS],
    /// What a dead replica took to its grave: refunds settled there since its last window, the
    /// tokens its live holds held (a refund at expiry nobody sends), and debt it never sent.
    lost_refunds: u64,
    lost_debt: u64,
    /// Debt settled at each replica since its last window.
    unsent_debt: [u64; REPLICAS],
    /// The tenant's expired holds give their tokens back (`expired_usage: refund`).
    refund: bool,
    holds: Vec<Hold>,
    pending: BTreeMap<usize, Vec<Pending>>,
    now: u64,
    /// Time since each replica last took a window.
    since_windows: [u64; REPLICAS],
    /// Refunds settled at each replica since its last window, and whether of a user hold: a refund
    /// beyond its slice's share reaches the store with the replica's next window.
    in_flight: [Vec<(u64, bool)>; REPLICAS],
}

impl World {
    async fn new(share: f64, faults: Option<u64>, refund: bool, start: u64, aside: usize) -> World {
        let tenant = support::unique_tenant("l");
        let clock = ManualClock::new(start);
        let store = EmbeddedStore::with_clock(Arc::new(clock.clone())).expect("embedded store");
        let policy = Policy::parse("lease-model.yaml", &policy(&tenant, share, refund, false, aside)).expect("policy");
        let chaos = Chaos::new(store, if faults.is_some() { 100 } else { 0 }, faults.unwrap_or(1));
        let first = Harness::from_parts(chaos.clone(), policy, tenant, String::new(), Some(clock.clone())).await;
        let mut replicas = vec![];
        for _ in 1..REPLICAS {
            replicas.push(first.wrapped(|s| s).await);
        }
        replicas.insert(0, first);
        let stop = tokio_util::sync::CancellationToken::new();
        let retries = replicas.iter().filter_map(|r| r.admission.run_retries(stop.clone())).collect();
        World {
            replicas,
            chaos,
            stop,
            retries,
            clock,
            share,
            tenant: Bucket::new(TENANT),
            user: Bucket::new(USER),
            usage: BTreeMap::new(),
            terms: (share, refund, aside),
            tight: false,
            stalled_until: [0; REPLICAS],
            lost_refunds: 0,
            lost_debt: 0,
            unsent_debt: [0; REPLICAS],
            refund,
            holds: Vec::new(),
            pending: BTreeMap::new(),
            now: 0,
            since_windows: [0; REPLICAS],
            in_flight: Default::default(),
        }
    }

    fn tenant_name(&self) -> &str {
        &self.replicas[0].tenant
    }

    fn alive(&self, h: &Hold) -> bool {
        h.state == State::Live && self.now < h.lease_until
    }

    fn live(&self, user_only: bool) -> usize {
        self.holds.iter().filter(|h| self.alive(h) && (!user_only || h.user)).count()
    }

    fn refund(&mut self, hold: usize, tokens: u64) {
        let (owner, user, day) = (self.holds[hold].owner, self.holds[hold].user, self.holds[hold].day);
        self.in_flight[owner].push((tokens, user));
        let (all, users) = self.in_flight_tokens();
        self.tenant.refund(tokens, all);
        if user {
            self.user.refund(tokens, users);
        }
        self.usage.entry(day).or_default().0 -= tokens;
    }

    /// Usage beyond a hold of replica `owner`, charged to the day it is reported on.
    fn owe(&mut self, owner: usize, tokens: u64) {
        let today = self.today();
        let day = self.usage.entry(today).or_default();
        day.0 += tokens;
        day.1 += tokens;
        self.unsent_debt[owner] += tokens;
    }

    /// The store's day.
    fn today(&self) -> u64 {
        tollgate::store::clock::Clock::now_ms(&self.clock) / tollgate::hold::DAY_MS
    }

    fn running(&self, replica: usize) -> bool {
        self.now >= self.stalled_until[replica]
    }

    fn dead(&self, replica: usize) -> bool {
        self.stalled_until[replica] == u64::MAX
    }

    /// What replicas holding slices of `capacity` may spend beyond a single store: one slice each.
    fn slack(&self, capacity: f64) -> f64 {
        REPLICAS as f64 * (capacity * self.share).floor().max(1.0)
    }

    /// Refunds not yet back at the store: of every hold, of user holds.
    fn in_flight_tokens(&self) -> (u64, u64) {
        let refunds = self.in_flight.iter().flatten();
        refunds.fold((0, 0), |(all, users), &(n, user)| (all + n, users + if user { n } else { 0 }))
    }

    /// A commit (`Some(used)`) or release (`None`) reaching the owner, as a single store settles
    /// it. Returns whether it changed anything (a first commit or release; a late commit).
    fn apply(&mut self, i: usize, used: Option<u64>) -> bool {
        // (Under `refund`, a hold past its lease was refunded when it expired.)
        self.expire_refunded();
        let h = self.holds[i].clone();
        let alive = self.alive(&h);
        match (h.state, used) {
            (State::Done, _) => false,
            // A late commit of a hold whose expiry refunded it: its usage charged, as debt.
            (State::Expired, Some(used)) if self.refund => {
                self.owe(h.owner, used);
                self.holds[i].state = State::Done;
                true
            }
            // A live hold, or a late commit of an expired one (charged as held): the rest back,
            // or the usage beyond the hold charged (debt, for the day's usage only: see above).
            (_, Some(used)) => {
                if used <= h.held {
                    self.refund(i, h.held - used);
                } else {
                    self.owe(h.owner, used - h.held);
                }
                self.holds[i].state = State::Done;
                true
            }
            (State::Live, None) if alive => {
                self.refund(i, h.held);
                self.holds[i].state = State::Done;
                true
            }
            (_, None) => {
                self.holds[i].state = State::Expired;
                false
            }
        }
    }

    /// Under `refund`, a hold whose lease has passed gives its tokens back (its replica does at
    /// its next window, or when something touches the hold).
    fn expire_refunded(&mut self) {
        if !self.refund {
            return;
        }
        for i in 0..self.holds.len() {
            if self.holds[i].state == State::Live && !self.alive(&self.holds[i]) {
                self.holds[i].state = State::Expired;
                self.refund(i, self.holds[i].held);
            }
        }
    }

    async fn step(&mut self, op: &Op) {
        self.expire_refunded();
        match *op {
            Op::Reserve { replica, .. } | Op::Tick { replica } if !self.running(replica) => {}
            Op::Reserve { replica, user, prompt, max_tokens } => {
                let today = self.today();
                let r = &self.replicas[replica];
                let a = Attributes { user: user.then(|| "u0".to_string()), ..r.attributes(prompt, max_tokens) };
                if let Decision::Admitted(ad) = r.admission.reserve(&a).await {
                    let held = prompt + max_tokens;
                    assert_eq!(ad.reserved_tokens, held);
                    self.tenant.take(held);
                    if user {
                        self.user.take(held);
                    }
                    self.usage.entry(today).or_default().0 += held;
                    // The hold's lease ends with its replica's lease record, if that is sooner: a
                    // renewal at once, changing nothing, says when.
                    // (A store hold under a leased id renews at the store: retried past faults.)
                    let mut renewed = r.admission.renew(&ad.reservation_id, LEASE_MS).await;
                    for _ in 0..100 {
                        if renewed.is_ok() {
                            break;
                        }
                        renewed = r.admission.renew(&ad.reservation_id, LEASE_MS).await;
                    }
                    let lease = match renewed.unwrap() {
                        RenewOutcome::Renewed { lease_remaining_ms } => lease_remaining_ms,
                        other => panic!("a hold just admitted renews: {other:?}"),
                    };
                    assert!(lease <= LEASE_MS);
                    let id = ad.reservation_id;
                    // (Under its aside, every u0 request is decided at the store: no replica in its id.)
                    assert!(!(user && self.tight && id.contains('@')), "u0's hold {id} was leased under its aside");
                    self.holds.push(Hold {
                        id,
                        owner: replica,
                        user,
                        held,
                        lease_until: self.now + lease,
                        state: State::Live,
                        day: today,
                    });
                }
            }
            Op::Commit { hold, replica, per_mille } => {
                let Some(i) = self.pick(hold) else { return };
                if !self.running(replica) {
                    return;
                }
                let used = self.holds[i].held * per_mille / 1000;
                let prompt = used / 2;
                let waiting = self.waiting(i).await;
                let (o, retried) =
                    self.settled(replica, &self.holds[i].id.clone(), Some((prompt, used - prompt))).await;
                let o = match o {
                    Settling::Commit(o) => o,
                    Settling::Release(_) => unreachable!(),
                };
                if self.settles_at(i, replica) {
                    let fresh = o.usage().is_some_and(|u| !u.duplicate);
                    // Settled before this commit, by what (not this very commit, re-sent after
                    // its reply was lost: that one answers with its own counts).
                    let shown = match &o {
                        CommitOutcome::Committed(u) if u.duplicate && !(retried && u.used == used) => {
                            Some(Shown::Committed(u.used))
                        }
                        CommitOutcome::Released => Some(Shown::Released),
                        _ => None,
                    };
                    if let Some(shown) = shown {
                        self.applied_by_owner(i, shown);
                    }
                    let expected = self.apply(i, Some(used));
                    // An attempt whose reply was lost may have been the one that applied it: the
                    // retry is then answered as a duplicate of it, with its counts.
                    let applied_by_lost_reply =
                        retried && expected && o.usage().is_some_and(|u| u.duplicate && u.used == used);
                    assert_eq!(fresh || applied_by_lost_reply, expected, "commit of {:?}: {o:?}", self.holds[i]);
                } else if o == CommitOutcome::NotFound {
                    // The owner's lease record lapsed (its calls failed for a whole lease): the
                    // store takes it for stopped. Only a hold already over is answered so.
                    assert!(
                        !self.alive(&self.holds[i]),
                        "a live hold's commit answered not_found: {:?}",
                        self.holds[i]
                    );
                } else {
                    assert_eq!(o, CommitOutcome::Forwarded, "commit of {:?} at {replica}", self.holds[i]);
                    self.forward(self.holds[i].owner, Pending::Commit { hold: i, used }, waiting);
                }
            }
            Op::Release { hold, replica } => {
                let Some(i) = self.pick(hold) else { return };
                if !self.running(replica) {
                    return;
                }
                let waiting = self.waiting(i).await;
                let (o, retried) = self.settled(replica, &self.holds[i].id.clone(), None).await;
                let o = match o {
                    Settling::Release(o) => o,
                    Settling::Commit(_) => unreachable!(),
                };
                if self.settles_at(i, replica) {
                    let fresh = matches!(o, ReleaseOutcome::Released { repeated: false, .. });
                    let shown = match o {
                        ReleaseOutcome::Released { repeated: true, .. } if !retried => Some(Shown::Released),
                        ReleaseOutcome::Settled(Settled::Committed | Settled::LateCommitted) => Some(Shown::AnyCommit),
                        _ => None,
                    };
                    if let Some(shown) = shown {
                        self.applied_by_owner(i, shown);
                    }
                    let expected = self.apply(i, None);
                    let applied_by_lost_reply =
                        retried && expected && matches!(o, ReleaseOutcome::Released { repeated: true, .. });
                    assert_eq!(fresh || applied_by_lost_reply, expected, "release of {:?}: {o:?}", self.holds[i]);
                } else if o == ReleaseOutcome::NotFound {
                    assert!(
                        !self.alive(&self.holds[i]),
                        "a live hold's release answered not_found: {:?}",
                        self.holds[i]
                    );
                } else {
                    assert_eq!(o, ReleaseOutcome::Forwarded, "release of {:?} at {replica}", self.holds[i]);
                    self.forward(self.holds[i].owner, Pending::Release { hold: i }, waiting);
                }
            }
            Op::Renew { hold } => {
                let Some(i) = self.pick(hold) else { return };
                let owner = self.holds[i].owner;
                if !self.running(owner) {
                    return;
                }
                // A hold decided at the store (or a store hold under a leased id: a leased
                // decision its slices could not cover after all) renews at the store, whose call
                // may fail after it ran (its reply lost): tried again, as a caller would, until
                // answered, so the lease is the store's.
                let a = &self.replicas[owner].admission;
                let mut renewed = a.renew(&self.holds[i].id, 0).await;
                for _ in 0..100 {
                    if renewed.is_ok() {
                        break;
                    }
                    renewed = a.renew(&self.holds[i].id, 0).await;
                }
                let alive = self.alive(&self.holds[i]);
                match renewed {
                    Ok(RenewOutcome::Renewed { lease_remaining_ms }) => {
                        assert!(alive, "renewed a hold that is not alive: {:?}", self.holds[i]);
                        self.holds[i].lease_until = self.now + lease_remaining_ms;
                    }
                    Ok(other) => {
                        // Settled already: by a forwarded operation the owner applied (see
                        // `applied_by_owner`), if the reference still held one pending.
                        let shown = match other {
                            RenewOutcome::Settled(Settled::Committed | Settled::LateCommitted) => {
                                Some(Shown::AnyCommit)
                            }
                            RenewOutcome::Settled(Settled::Released) => Some(Shown::Released),
                            _ => None,
                        };
                        if let (true, Some(shown)) = (alive, shown) {
                            self.applied_by_owner(i, shown);
                        }
                        assert!(!self.alive(&self.holds[i]), "an alive hold did not renew: {other:?}");
                    }
                    Err(e) => assert!(self.chaos.failed() > 0, "a renewal failed with no fault: {e}"),
                }
            }
            Op::Tick { replica } => self.tick(replica).await,
            Op::Advance { ms } => self.advance(ms).await,
            Op::Reload { tight } => {
                self.tight = tight;
                let (share, refund, aside) = self.terms;
                let text = policy(self.tenant_name(), share, refund, tight, aside);
                let new = Policy::parse("lease-model.yaml", &text).expect("reloaded policy");
                for r in &self.replicas {
                    r.admission.reload(new.clone());
                }
                let slack = self.slack(self.tenant.capacity);
                let capacity = tenant_limits(tight).1;
                if (capacity as f64) < self.tenant.capacity {
                    // What a slice holds free beyond the new share goes back with its replica's
                    // next call, as a refund beyond the share does: in flight until then.
                    let slice = |c: f64| (c * self.share).floor().max(1.0) as u64;
                    let excess = slice(self.tenant.capacity) - slice(capacity as f64);
                    for r in 0..REPLICAS {
                        if !self.dead(r) {
                            self.in_flight[r].push((excess, false));
                        }
                    }
                }
                self.tenant.reload(capacity, slack);
            }
            Op::Stall { replica, ms } => {
                if !self.dead(replica) {
                    self.stalled_until[replica] = self.stalled_until[replica].max(self.now + ms);
                }
            }
            Op::Die { replica } => {
                let dead = (0..REPLICAS).filter(|&r| self.dead(r)).count();
                if !self.dead(replica) && dead + 1 < REPLICAS {
                    self.die(replica).await;
                }
            }
        }
        self.collect_forwarded().await;
        self.check();
    }

    /// Moves the clock. Running replicas keep their lease records: each takes a window at least
    /// every 2 s; a stalled one takes none until its stall ends.
    async fn advance(&mut self, ms: u64) {
        let mut left = ms;
        loop {
            let due: Vec<usize> =
                (0..REPLICAS).filter(|&r| self.running(r) && self.since_windows[r] >= 2_000).collect();
            for &r in &due {
                self.tick(r).await;
            }
            if !due.is_empty() {
                self.collect_forwarded().await;
                self.check();
            }
            if left == 0 {
                return;
            }
            let longest = (0..REPLICAS).filter(|&r| self.running(r)).map(|r| self.since_windows[r]).max().unwrap_or(0);
            // (Every running replica took a window within 2 s: a step moves the clock.)
            let mut step = left.min(2_000 - longest);
            // A stall ends on time: the replica's next window is then due.
            for &until in &self.stalled_until {
                if until > self.now && until != u64::MAX {
                    step = step.min(until - self.now);
                }
            }
            assert!(step > 0, "the clock must move");
            left -= step;
            self.clock.advance_ms(step);
            self.now += step;
            for since in &mut self.since_windows {
                *since += step;
            }
            let (all, users) = self.in_flight_tokens();
            self.tenant.refill(step, all);
            self.user.refill(step, users);
        }
    }

    /// The replica stops for good. What it never sends is what the store's books and the
    /// reference's may differ by at the end: its refunds since its last window, its live holds'
    /// refunds at expiry (under `refund`), its free slices (charged when drawn), and its debt.
    async fn die(&mut self, replica: usize) {
        // Its sweeper's last period wrote its notes: the others' sweepers know the tenant. (One
        // that dies before its first period leaves the tenant to its next call: see sweeper.rs.)
        // (Under faults, a period that failed is followed by another.)
        let mut swept = false;
        for _ in 0..100 {
            swept = self.replicas[replica].admission.sweep_tick().await.is_ok();
            if swept {
                break;
            }
        }
        assert!(swept, "no sweeper period of the dying replica went through");
        self.lost_refunds += self.in_flight[replica].iter().map(|&(n, _)| n).sum::<u64>();
        if self.refund {
            let live: u64 = self
                .holds
                .iter()
                .filter(|h| h.owner == replica && h.id.contains('@') && h.state == State::Live)
                .map(|h| h.held)
                .sum();
            self.lost_refunds += live;
        }
        self.lost_debt += self.unsent_debt[replica];
        // What others forwarded for it is never applied: its holds expire as they are.
        self.pending.remove(&replica);
        self.stalled_until[replica] = u64::MAX;
    }

    /// A commit (`Some(counts)`) or release at `replica`, retried while the store call fails, as
    /// a caller of the Admission service would.
    /// Commits (with `counts`) or releases the hold at `replica`, trying again while the store
    /// call fails; also whether it was tried again (an attempt whose reply was lost may have
    /// settled it).
    async fn settled(&self, replica: usize, id: &str, counts: Option<(u64, u64)>) -> (Settling, bool) {
        let a = &self.replicas[replica].admission;
        for attempt in 0..100 {
            let got = match counts {
                Some((prompt, output)) => a.commit(id, prompt, output).await.map(Settling::Commit),
                None => a.release(id).await.map(Settling::Release),
            };
            if let Ok(got) = got {
                return (got, attempt > 0);
            }
        }
        panic!("{id} could not be settled at replica {replica}");
    }

    async fn tick(&mut self, replica: usize) {
        // A window whose call fails stays pending, and goes again first at the next: until a
        // window goes through, its refunds and debt are still the replica's (lost if it dies).
        let sent = self.replicas[replica].admission.lease_tick(false).await.is_ok();
        self.since_windows[replica] = 0;
        if sent {
            self.in_flight[replica].clear();
            self.unsent_debt[replica] = 0;
        }
    }

    /// Operations forwarded to a replica are taken by its next lease call (a window, or a miss):
    /// those no longer waiting in the store were applied by this step, in the order they came.
    /// The owner found hold `i` settled already, as `shown`: the forwarded operation on it that
    /// the reference still holds as pending (handed over by a lease call it counts as
    /// unanswered) and that settles it so was applied by the owner, once. Applied here.
    fn applied_by_owner(&mut self, i: usize, shown: Shown) {
        let owner = self.holds[i].owner;
        let Some(pending) = self.pending.get_mut(&owner) else { return };
        let settles = |p: &Pending| match (p, shown) {
            (Pending::Commit { hold, used }, Shown::Committed(charged)) => *hold == i && *used == charged,
            (Pending::Commit { hold, .. }, Shown::AnyCommit) => *hold == i,
            (Pending::Release { hold }, Shown::Released) => *hold == i,
            _ => false,
        };
        let Some(k) = pending.iter().position(settles) else { return };
        let p = pending.remove(k);
        match p {
            Pending::Commit { hold, used } => self.apply(hold, Some(used)),
            Pending::Release { hold } => self.apply(hold, None),
        };
    }

    async fn collect_forwarded(&mut self) {
        self.drain_retries().await;
        let tenant = self.tenant_name().to_string();
        for r in 0..REPLICAS {
            let Some(pending) = self.pending.remove(&r) else { continue };
            let replica = self.replicas[r].admission.replica().unwrap().to_string();
            let waiting = self.replicas[0].scope(&keys::forwarded(&tenant, &replica)).await;
            let waiting = waiting.map(|v| v.fields).unwrap_or_default();
            // Handed over by a call whose answer was lost: kept with that answer, applied once
            // the call, sent again, is answered.
            let last = self.replicas[0].scope(&keys::last_lease_call(&tenant, &replica)).await;
            let last = last.map(|v| v.fields).unwrap_or_default();
            let unanswered = self.replicas[r].admission.unanswered_lease_call(&tenant);
            // (The call's operations are lines, an id then what it is: a release handed over
            // before, and applied, is not the commit of the same hold this call handed over.)
            let handed_unapplied = |id: &str, p: &Pending| {
                let kind = match p {
                    Pending::Commit { .. } => "commit",
                    Pending::Release { .. } => "release",
                };
                unanswered.is_some_and(|seq| last.get("sq") == Some(&seq.to_string()))
                    && last.get("op").is_some_and(|ops| {
                        let lines: Vec<&str> = ops.lines().collect();
                        lines.chunks(2).any(|pair| matches!(pair, [i, op] if *i == id && op.starts_with(kind)))
                    })
            };
            let mut still: Vec<Pending> = Vec::new();
            for (k, p) in pending.iter().enumerate() {
                let hold = p.hold();
                let id = &self.holds[hold].id;
                // Only the last operation queued for a hold can still wait in the store; one
                // before it was handed over already. Operations on a hold apply in order.
                let last_for_hold = !pending[k + 1..].iter().any(|q| q.hold() == hold);
                let earlier_kept = still.iter().any(|q| q.hold() == hold);
                // The unanswered call handed over at most one operation of the hold: the latest
                // one no longer waiting in the store (those before it went with calls answered,
                // and were applied), whatever its kind and counts.
                let later = pending[k + 1..].iter().filter(|q| q.hold() == hold).count();
                let latest_handed = match later {
                    0 => !waiting.contains_key(id),
                    1 => waiting.contains_key(id),
                    _ => false,
                };
                if earlier_kept
                    || (last_for_hold && waiting.contains_key(id))
                    || (latest_handed && handed_unapplied(id, p))
                {
                    still.push(p.clone());
                    continue;
                }
                let p = p.clone();
                match p {
                    Pending::Commit { hold, used } => self.apply(hold, Some(used)),
                    Pending::Release { hold } => self.apply(hold, None),
                };
            }
            if !still.is_empty() {
                self.pending.insert(r, still);
            }
        }
    }

    /// Waits (real time, bounded) until every replica's reserves have tidied up (a give-back of a
    /// hold nobody received runs on the reserve's task, after its answer) and its retry queue is
    /// empty: a forwarded operation whose application failed is applied by it, within the step
    /// the reference sees it in.
    async fn drain_retries(&self) {
        for r in &self.replicas {
            let idle = || async { r.admission.reserves_running() == 0 && r.admission.retries_waiting() == 0 };
            let drained = r.eventually(std::time::Duration::from_secs(20), idle);
            assert!(drained.await, "settlements left in the retry queue");
        }
    }

    /// Leaves an operation for the owner, as the store does: the first commit or release forwarded
    /// for a hold stands while it waits for the owner to take it, and a later one is dropped; once
    /// taken, the next one forwarded waits in its turn.
    /// (`waiting`: an operation on the hold waited in the store when this one was forwarded.)
    fn forward(&mut self, owner: usize, p: Pending, waiting: bool) {
        // A dead replica never takes it: the hold expires as it is.
        if self.dead(owner) {
            return;
        }
        let queue = self.pending.entry(owner).or_default();
        let queued = queue.iter().any(|q| q.hold() == p.hold());
        if !(queued && waiting) {
            queue.push(p);
        }
    }

    /// Whether an operation on hold `i` waits in the store for its owner to take it.
    async fn waiting(&self, i: usize) -> bool {
        let tenant = self.tenant_name();
        let replica = self.replicas[self.holds[i].owner].admission.replica().unwrap().to_string();
        let waiting = self.replicas[0].scope(&keys::forwarded(tenant, &replica)).await;
        waiting.is_some_and(|v| v.fields.contains_key(&self.holds[i].id))
    }

    /// Whether a settlement of hold `i` at `replica` is applied there and then: at its owner, or
    /// at any replica for a hold decided at the store (its id names no replica).
    fn settles_at(&self, i: usize, replica: usize) -> bool {
        replica == self.holds[i].owner || !self.holds[i].id.contains('@')
    }

    fn pick(&self, hold: usize) -> Option<usize> {
        (!self.holds.is_empty()).then(|| hold % self.holds.len())
    }

    fn check(&self) {
        let slack = |capacity: f64| self.slack(capacity);
        for (name, b, live) in [("tenant", &self.tenant, self.live(false)), ("user u0", &self.user, self.live(true))] {
            assert!(live <= b.max_concurrency, "{name}: {live} holds alive, {} slots", b.max_concurrency);
            let bound = slack(b.capacity) + b.in_flight_when_full + b.before_reload;
            assert!(
                b.level() >= -bound - 1e-6,
                "{name}: a single store would be at {} tokens; leasing may overshoot by {bound} at most",
                b.level(),
            );
            assert!(
                b.requests >= -slack(b.request_capacity) - 1e-6,
                "{name}: {} requests; bound {}",
                b.requests,
                slack(b.request_capacity)
            );
        }
        for (day, (usage, debt)) in &self.usage {
            let admitted = usage - debt;
            assert!(admitted <= BUDGET, "day {day}: admitted and not refunded: {admitted}, over the budget {BUDGET}");
        }
    }

    /// Every replica alive gives back; every live hold is released at its owner. Then no slot is
    /// held and the store's day usage is the reference's, or (when a replica died) differs by no
    /// more than what the dead took with them.
    async fn finish(mut self) {
        self.chaos.calm();
        // Stalls end; the dead stay dead, and their lease records run out.
        for until in &mut self.stalled_until {
            if *until != u64::MAX {
                *until = 0;
            }
        }
        let dead: Vec<usize> = (0..REPLICAS).filter(|&r| self.dead(r)).collect();
        let alive: Vec<usize> = (0..REPLICAS).filter(|r| !dead.contains(r)).collect();
        // Past the dead replicas' leases, the others' sweepers (a period a second, each looking
        // at the shards in turn) settle their lease records, and their slots come back.
        let tenant = self.tenant_name().to_string();
        let members: Vec<String> =
            dead.iter().map(|&r| format!("@{}", self.replicas[r].admission.replica().unwrap())).collect();
        let mut settled = false;
        for _ in 0..60 {
            let index = self.replicas[0].scope(&keys::leases(&tenant)).await;
            settled = !index.is_some_and(|i| members.iter().any(|m| i.fields.contains_key(m)));
            if settled {
                break;
            }
            self.advance(1_000).await;
            for &r in &alive {
                let _ = self.replicas[r].admission.sweep_tick().await;
            }
        }
        assert!(settled, "a dead replica's lease record outlived a minute of sweeps");
        self.expire_refunded();
        // What failed on its way to the store is settled by the retry queue (within its backoff,
        // in real time, now that the store answers); then its workers go.
        self.drain_retries().await;
        self.stop.cancel();
        for w in std::mem::take(&mut self.retries) {
            w.abort();
        }
        // A window that gives everything back also takes every forwarded operation (after the
        // call whose answer was lost, if one was).
        for _ in 0..2 {
            for &r in &alive {
                self.replicas[r].admission.lease_tick(true).await.unwrap();
            }
        }
        self.collect_forwarded().await;
        assert!(self.pending.is_empty(), "forwarded operations left untaken: {:?}", self.pending);
        for i in 0..self.holds.len() {
            let h = self.holds[i].clone();
            // A dead replica's leased holds went with its lease record; a hold decided at the
            // store is any replica's to settle.
            let at = match (dead.contains(&h.owner), h.id.contains('@')) {
                (false, _) => h.owner,
                (true, false) => alive[0],
                (true, true) => continue,
            };
            let o = self.replicas[at].admission.release(&h.id).await.unwrap();
            let fresh = matches!(o, ReleaseOutcome::Released { repeated: false, .. });
            assert_eq!(fresh, self.apply(i, None), "final release of {h:?}: {o:?}");
        }
        for &r in &alive {
            self.replicas[r].admission.lease_tick(true).await.unwrap();
        }
        let scope = self.replicas[0].scope(&keys::tenant_scope(&tenant)).await;
        if let Some(scope) = &scope {
            assert_eq!(scope.num("c"), 0.0, "slots still held: {scope:?}");
        }
        // Usage within the month (every case stays in one): what reached the store, whichever
        // day it reached it on (debt of a leased hold settled before midnight may reach it with
        // the replica's first call after), against all the reference charged.
        let month = scope.as_ref().map_or(0, |s| s.num("mu") as u64);
        let expected: u64 = self.usage.values().map(|u| u.0).sum();
        if dead.is_empty() {
            assert_eq!(month, expected, "the store's month usage against the reference's {:?}", self.usage);
            // Within one day, that day's usage to the token.
            if let (Some(scope), [(day, _)]) = (&scope, &self.usage.iter().collect::<Vec<_>>()[..])
                && scope.num("d") as u64 == **day
            {
                assert_eq!(scope.num("du") as u64, expected, "the store's day usage against the reference");
            }
        } else {
            // A dead replica's free slices stay charged: at most one slice of the day's budget or
            // the largest burst, each, and what a call whose answer it never had drew (a slice,
            // or what the largest request asked beyond it).
            let slice = ((TENANT.1.min(BUDGET) as f64 * self.share).floor() as u64).max(1);
            let slices = dead.len() as u64 * (slice + slice.max(LARGEST_HOLD));
            let (low, high) = (expected.saturating_sub(self.lost_debt), expected + self.lost_refunds + slices);
            assert!(
                (low..=high).contains(&month),
                "the store's month usage {month}, the reference's {expected}: {low}..={high}"
            );
        }
        if let Some(user) = self.replicas[0].scope(&keys::user_scope(&tenant, "u0")).await {
            assert_eq!(user.num("c"), 0.0, "user slots still held: {user:?}");
        }
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap())
}

async fn run(share: f64, ops: Vec<Op>) {
    run_with(share, ops, None).await;
}

/// `faults`: the seed of the store calls that fail, or none.
async fn run_with(share: f64, ops: Vec<Op>, faults: Option<u64>) {
    run_in(share, ops, faults, false).await;
}

/// `refund`: the tenant's expired holds give their tokens back.
async fn run_in(share: f64, ops: Vec<Op>, faults: Option<u64>, refund: bool) {
    run_world(World::new(share, faults, refund, STARTS[0], 0).await, ops).await;
}

/// A random case.
async fn run_random(share: f64, ops: Vec<Op>, faults: Option<u64>, refund: bool, start: u64, aside: usize) {
    run_world(World::new(share, faults, refund, start, aside).await, ops).await;
}

async fn run_world(mut w: World, ops: Vec<Op>) {
    for op in &ops {
        w.step(op).await;
    }
    w.finish().await;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, max_shrink_iters: 2048, ..ProptestConfig::default() })]
    #[test]
    fn replicas_with_leases_stay_within_the_bound(
        share in prop_oneof![Just(0.1), Just(0.5), Just(1.0)],
        ops in prop::collection::vec(op(), 1..60),
        faults in prop::option::of(any::<u64>()),
        refund in any::<bool>(),
        start in prop::sample::select(STARTS.to_vec()),
        aside in 0..ASIDES.len(),
    ) {
        runtime().block_on(run_random(share, ops, faults, refund, start, aside));
    }
}

/// A commit forwarded to a replica whose hold expired while it waited is a late commit there.
#[test]
fn a_forwarded_commit_of_an_expired_hold_is_late() {
    let ops = vec![
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 6_001 },
        Op::Commit { hold: 0, replica: 0, per_mille: 0 },
        Op::Tick { replica: 0 },
    ];
    runtime().block_on(run(0.1, ops));
}

#[test]
fn regression_forwarded_commit_across_a_lease() {
    let ops = vec![
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Commit { hold: 0, replica: 1, per_mille: 0 },
        Op::Advance { ms: 1_370 },
        Op::Advance { ms: 1_630 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 2_000 },
    ];
    runtime().block_on(run(0.5, ops));
}

/// Found by the property test: a refund beyond a slice's share, back at the store with the next
/// window, found room the single store's full bucket did not have when the hold settled.
#[test]
fn regression_a_refund_given_back_late() {
    let ops = vec![
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: true, prompt: 216, max_tokens: 18 },
        Op::Advance { ms: 4679 },
        Op::Commit { hold: 1921387949610615095, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 2, user: true, prompt: 233, max_tokens: 287 },
        Op::Commit { hold: 300834008850470744, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 3758 },
        Op::Release { hold: 7470144490541701533, replica: 0 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Renew { hold: 4263741591628924471 },
        Op::Advance { ms: 1962 },
        Op::Reserve { replica: 0, user: true, prompt: 73, max_tokens: 290 },
        Op::Commit { hold: 11072375845271451366, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 0, user: true, prompt: 269, max_tokens: 20 },
        Op::Commit { hold: 16699545537921, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 3 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Commit { hold: 9373681570348156882, replica: 0, per_mille: 984 },
        Op::Reserve { replica: 2, user: true, prompt: 64, max_tokens: 146 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 3601 },
        Op::Reserve { replica: 0, user: true, prompt: 270, max_tokens: 355 },
    ];
    runtime().block_on(run(0.1, ops));
}

/// Found by the property test under faults: a release forwarded and handed over by a call whose
/// answer was lost, then a commit forwarded for the same hold, which waits in its turn (a later
/// operation is dropped only while an earlier one still waits in the store).
#[test]
fn regression_an_operation_forwarded_after_one_handed_over_waits_its_turn() {
    let ops = vec![
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 1780 },
        Op::Commit { hold: 0, replica: 1, per_mille: 0 },
        Op::Renew { hold: 0 },
        Op::Advance { ms: 4220 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Commit { hold: 0, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Renew { hold: 0 },
        Op::Advance { ms: 2237 },
        Op::Release { hold: 1, replica: 2 },
        Op::Advance { ms: 2763 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Commit { hold: 1, replica: 2, per_mille: 0 },
    ];
    runtime().block_on(run_with(0.1, ops, Some(18_433_581_248_241_304_994)));
}

/// Found by the property test under faults: a commit forwarded to a replica whose calls then
/// failed past its lease used to expire with the forwarded operations (kept a lease): the hold
/// stayed charged as held. They are kept for the idle TTL now, and the owner takes them when back.
#[test]
fn regression_a_forwarded_commit_outlives_its_owners_lapsed_lease() {
    let ops = vec![
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Tick { replica: 2 },
        Op::Reserve { replica: 2, user: true, prompt: 0, max_tokens: 13 },
        Op::Release { hold: 0, replica: 0 },
        Op::Reserve { replica: 2, user: true, prompt: 122, max_tokens: 453 },
        Op::Reserve { replica: 0, user: true, prompt: 0, max_tokens: 413 },
        Op::Reserve { replica: 0, user: true, prompt: 224, max_tokens: 189 },
        Op::Advance { ms: 300 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 1, user: true, prompt: 171, max_tokens: 257 },
        Op::Advance { ms: 1700 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 3 },
        Op::Commit { hold: 857541385487922396, replica: 0, per_mille: 0 },
        Op::Release { hold: 4822092014089088229, replica: 2 },
        Op::Reserve { replica: 0, user: true, prompt: 0, max_tokens: 63 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 2842 },
        Op::Advance { ms: 2158 },
    ];
    runtime().block_on(run_with(0.5, ops, Some(15852145395776184516)));
}

/// Found by the property test under faults: a forwarded commit of a store hold under a leased id
/// (settled at the store) whose store call failed when its owner applied it was lost; it goes to
/// the retry queue now.
#[test]
fn regression_a_forwarded_commit_that_fails_to_apply_is_retried() {
    let ops = vec![
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Commit { hold: 0, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 2602 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 2213 },
        Op::Advance { ms: 2839 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 5 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 6347 },
        Op::Reserve { replica: 0, user: true, prompt: 0, max_tokens: 262 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Commit { hold: 4_293_150_147_001_264_551, replica: 0, per_mille: 0 },
        Op::Tick { replica: 1 },
        Op::Commit { hold: 16_452_044_516_542_300_724, replica: 0, per_mille: 800 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 1, user: false, prompt: 138, max_tokens: 59 },
        Op::Commit { hold: 85_873_252_852_793_762, replica: 2, per_mille: 6 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 3000 },
    ];
    runtime().block_on(run_in(0.1, ops, Some(12_321_353_374_983_456_544), true));
}

/// Found by the property test in CI under faults: a release handed over by a call whose answer was
/// lost, applied when that call went again, and a commit of the same hold handed over by the next
/// call, whose answer was lost too: the reference took the release for unapplied (same hold id).
#[test]
fn regression_a_release_applied_before_a_commit_of_the_same_hold_handed_over_after_it() {
    let ops = vec![
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 6500 },
        Op::Advance { ms: 6114 },
        Op::Commit { hold: 0, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 7386 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Tick { replica: 1 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Commit { hold: 37_547_111_823_927_477, replica: 1, per_mille: 0 },
        Op::Reserve { replica: 0, user: false, prompt: 107, max_tokens: 345 },
        Op::Reserve { replica: 2, user: false, prompt: 180, max_tokens: 213 },
        Op::Tick { replica: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 52, max_tokens: 229 },
        Op::Commit { hold: 2_019_639_814_616_786_263, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 277, max_tokens: 398 },
        Op::Tick { replica: 0 },
        Op::Release { hold: 12_806_964_947_106_694_796, replica: 0 },
        Op::Tick { replica: 2 },
        Op::Commit { hold: 15_469_345_597_571_829_983, replica: 0, per_mille: 3 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 1 },
        Op::Advance { ms: 4999 },
    ];
    runtime().block_on(run_random(0.1, ops, Some(8_393_230_269_657_374_578), false, STARTS[0], 0));
}

/// The owner's commit of a store hold under a leased id: the first call ran but its reply was
/// lost, so the call sent again is answered as the duplicate of the first, which was the one that
/// applied it (the shrunk case CI found; tollgate was right, the reference took the duplicate for a
/// second commit).
#[test]
fn regression_a_commit_whose_reply_was_lost_is_answered_as_its_own_duplicate() {
    let ops = vec![
        Op::Reserve { replica: 1, user: true, prompt: 105, max_tokens: 63 },
        Op::Commit { hold: 0, replica: 2, per_mille: 1298 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 151 },
        Op::Reserve { replica: 1, user: true, prompt: 68, max_tokens: 290 },
        Op::Release { hold: 14_746_588_809_168_306_180, replica: 2 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: true, prompt: 266, max_tokens: 159 },
        Op::Commit { hold: 247_879_037_722_114_654, replica: 0, per_mille: 880 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 1, user: true, prompt: 137, max_tokens: 118 },
        Op::Reserve { replica: 0, user: true, prompt: 0, max_tokens: 213 },
        Op::Tick { replica: 1 },
        Op::Tick { replica: 2 },
        Op::Commit { hold: 11_411_451_045_052_122_087, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 2, user: true, prompt: 87, max_tokens: 26 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: true, prompt: 0, max_tokens: 163 },
        Op::Reserve { replica: 0, user: true, prompt: 0, max_tokens: 163 },
        Op::Commit { hold: 7_076_527_365_127_130_648, replica: 0, per_mille: 0 },
        Op::Tick { replica: 1 },
        Op::Tick { replica: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 4 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Tick { replica: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 1 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 1 },
        Op::Release { hold: 2_695_870_628_167_509_983, replica: 0 },
        Op::Tick { replica: 0 },
        Op::Advance { ms: 2000 },
        Op::Commit { hold: 1_212_274_177_729_416_001, replica: 1, per_mille: 0 },
    ];
    runtime().block_on(run_random(0.1, ops, Some(17_753_354_234_723_082_508), false, STARTS[0], 0));
}

/// Every replica draws a full slice (share 0.1 of 2,000) and commits it whole; two seconds later a
/// reload cuts the burst, so each slice holds 80 tokens beyond the new share.
fn full_slices_cut_by_a_reload() -> Vec<Op> {
    vec![
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 100 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 100 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 100 },
        Op::Commit { hold: 0, replica: 0, per_mille: 1000 },
        Op::Commit { hold: 1, replica: 1, per_mille: 1000 },
        Op::Commit { hold: 2, replica: 2, per_mille: 1000 },
        Op::Advance { ms: 2000 },
        Op::Reload { tight: true },
        Op::Advance { ms: 1 },
    ]
}

/// A reload that cuts the burst while every replica holds a full slice; the excess of
/// each slice beyond the new share goes back to a store bucket that store decisions (user u0's,
/// under the hour budget) drained first.
#[test]
fn a_reload_cut_slices_excess_returns_into_a_drained_bucket() {
    let mut ops = full_slices_cut_by_a_reload();
    ops.extend([
        Op::Reserve { replica: 0, user: true, prompt: 299, max_tokens: 499 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 0, user: false, prompt: 299, max_tokens: 343 },
    ]);
    runtime().block_on(run(0.1, ops));
}

/// The same without user u0: the first replica's call after the reload gives its excess back to a
/// full bucket, then draws it down; the other two give theirs back into the drained bucket.
#[test]
fn a_reload_cut_slices_excess_returns_without_store_decisions() {
    let mut ops = full_slices_cut_by_a_reload();
    ops.extend([
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 0, user: false, prompt: 299, max_tokens: 343 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 1, user: false, prompt: 299, max_tokens: 419 },
    ]);
    runtime().block_on(run(0.1, ops));
}

/// A reload that cuts the burst while the bucket is below the new capacity: the deficit built up
/// under the old share (every replica stalled on a full slice while both buckets refilled) outlives
/// the reference's "back above zero".
#[test]
fn a_reload_below_capacity_keeps_the_old_deficit() {
    let ops = vec![
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 200 },
        Op::Commit { hold: 0, replica: 0, per_mille: 0 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 200 },
        Op::Commit { hold: 1, replica: 1, per_mille: 0 },
        Op::Reserve { replica: 2, user: false, prompt: 0, max_tokens: 200 },
        Op::Commit { hold: 2, replica: 2, per_mille: 0 },
        Op::Stall { replica: 0, ms: 7000 },
        Op::Stall { replica: 1, ms: 7000 },
        Op::Stall { replica: 2, ms: 7000 },
        Op::Advance { ms: 7000 },
        Op::Advance { ms: 1 },
        Op::Reserve { replica: 2, user: false, prompt: 299, max_tokens: 499 },
        Op::Reserve { replica: 2, user: false, prompt: 299, max_tokens: 499 },
        Op::Reload { tight: true },
        Op::Advance { ms: 1 },
        Op::Reserve { replica: 0, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 1, user: false, prompt: 0, max_tokens: 120 },
        Op::Reserve { replica: 2, user: false, prompt: 299, max_tokens: 465 },
    ];
    runtime().block_on(run(0.1, ops));
}

/// A reserve whose reply is lost is admitted unmetered (`local`), and the hold its script made is
/// given back; the store stays out of reach until that hold's lease has run out, which charges
/// it as held. Nobody received it, so its give-back, retried once the store answers, reconciles
/// it to nothing, as a late commit would: the month counts nothing. (Found by this test's random
/// cases in CI.)
#[test]
fn a_hold_nobody_received_is_given_back_after_its_lease_too() {
    let ops = vec![
        Op::Reload { tight: true },
        Op::Reserve { replica: 0, user: true, prompt: 0, max_tokens: 1 },
        Op::Advance { ms: 5000 },
    ];
    runtime().block_on(run_random(0.1, ops, Some(3379603618996127404), false, 1795953600000, 0));
}
