//! A pool that queues in tollgate (`pool_reserve.lua` with `queue: tollgate`, `pool_release.lua`)
//! against a reference model in plain Rust: random asks (a new request, or a waiting one asking
//! again; with a deadline, and KV-cache tokens against its tier's share), releases (of a request
//! that ran, or of one that never reached the backend) and time, on the embedded store with a manual clock (so arrivals are ordered
//! exactly as the model orders them). After every step the reply is the model's (admitted, waiting
//! with its predicted start, or refused), and the pool's keys hold exactly the model's holds,
//! waiting places, finish tags and virtual times: a waiting request holds no work, a refusal
//! leaves no place, tags are written only on admission, and an idle pool keeps none.
//!
//! The pool has provider limits too (`provider_limits`: a token bucket, a request bucket and a
//! day's token budget, each tier its share counted from the top): a request that would start is
//! refused when they cannot take it, a waiting one takes none of them, and a release settles what
//! a hold took by how its request ended (unused: everything back; released: its tokens; used: the
//! counts it reports, a refund or debt; expired: nothing). After every step the provider scope's
//! buckets and day counter are the model's, to the bit.
//! `tests/conformance.rs` runs the same scripts on a single Redis and a Cluster.

// The model computes the script's float prediction as the script does, and reads its scores.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss, clippy::cast_sign_loss)]

mod support;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use proptest::prelude::*;
use support::Harness;
use tollgate::config::{Limits, PoolQueue, Priority};
use tollgate::hold::ScopeLimits;
use tollgate::store::embedded::EmbeddedStore;
use tollgate::store::{PoolCall, PoolEnd, PoolOutcome, ProviderCall, keys};

const SLOTS: u64 = 3;
const TIERS: [(Priority, u64); 3] = [(Priority::Critical, 3), (Priority::Standard, 2), (Priority::Sheddable, 1)];
const WEIGHTS: [u64; 3] = [1_000, 2_000, 500];
const WAITER_TTL_MS: u64 = 1_000;
/// Longer than any case: holds never expire here (expiry is the conformance suite's).
const LEASE_MS: u64 = 3_600_000;
const IDS: usize = 8;
/// KV-cache tokens each tier may fill.
const TIER_KV: [u64; 3] = [1_000, 800, 500];
/// The provider's limits: a bucket of 1,500 tokens refilled one a ms, 12 requests a minute, and
/// 12,000 tokens a day; and each tier's share of them (thousandths).
const PROVIDER: (u64, u64, u64, u64) = (60_000, 1_500, 12, 12_000);
const PROVIDER_SHARE: [u64; 3] = [1_000, 750, 500];

fn provider_limits() -> ScopeLimits {
    let (tokens_per_minute, burst_tokens, requests_per_minute, tokens_per_day) = PROVIDER;
    ScopeLimits::from(&Limits {
        tokens_per_minute: Some(tokens_per_minute),
        burst_tokens: Some(burst_tokens),
        requests_per_minute: Some(requests_per_minute),
        tokens_per_day: Some(tokens_per_day),
        ..Limits::default()
    })
}

#[derive(Debug, Clone)]
enum Op {
    /// Request `id` asks (its tenant, tier, work, KV tokens and deadline are fixed by its first ask).
    Ask {
        id: usize,
        tenant: usize,
        tier: usize,
        work: u64,
        kv: u64,
        deadline: u64,
        wait: u64,
    },
    /// And how its request ended.
    Release {
        id: usize,
        end: PoolEnd,
    },
    Advance {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (
            (0..IDS, 0..3usize, 0..3usize, 100..3_000u64),
            (1..600u64, prop_oneof![3 => Just(0u64), 1 => 500..6_000u64], prop_oneof![1 => Just(0u64), 4 => 1..6_000u64]),
        )
            .prop_map(|((id, tenant, tier, work), (kv, deadline, wait))| Op::Ask { id, tenant, tier, work, kv, deadline, wait }),
        3 => (0..IDS, ending()).prop_map(|(id, end)| Op::Release { id, end }),
        1 => prop_oneof![3 => 1..300u64, 1 => 900..1_500u64].prop_map(|ms| Op::Advance { ms }),
    ]
}

/// How a request ends: it never reached the backend, it was released with no usage, it ran and
/// reported its counts, or it settles as held.
fn ending() -> impl Strategy<Value = PoolEnd> {
    prop_oneof![
        Just(PoolEnd::Unused),
        Just(PoolEnd::Released),
        (0..800u64, 0..800u64).prop_map(|(p, g)| PoolEnd::Used {
            prompt: Some(p),
            output: Some(g),
            cost_nanos: Some(0)
        }),
        Just(PoolEnd::AsHeld),
    ]
}

/// A waiting place: tier rank, tenant, work, arrival, expiry, weight.
#[derive(Debug, Clone, PartialEq)]
struct Place {
    rank: usize,
    tenant: String,
    work: u64,
    arrival: u64,
    expires: u64,
    weight: u64,
}

/// A token bucket as the scripts keep it: its level at its last write, and when.
type Bucket = Option<(f64, u64)>;

/// The provider scope: its token and request buckets and the day's tokens.
#[derive(Debug, Default)]
struct Provider {
    tokens: Bucket,
    requests: Bucket,
    day: u64,
}

/// A bucket's level at `now`: full when never written.
fn refilled(b: Bucket, cap: f64, rate: f64, now: u64) -> f64 {
    support::model::refilled(b.map(|b| b.0), b.map_or(0, |b| b.1), cap as u64, rate, now)
}

#[derive(Debug, Default)]
struct Model {
    /// id → (work, tier, tenant, KV tokens, what its admission added to its tenant's finish tag,
    /// its predicted end: admitted at once, then its work, and a tenth more)
    holds: BTreeMap<String, (u64, usize, String, u64, u64, u64)>,
    /// id → the prompt and output tokens its hold took from the provider's limits.
    charged: BTreeMap<String, (u64, u64)>,
    provider: Provider,
    waiting: BTreeMap<String, Place>,
    /// Per tier: tenant → finish tag; and the tier's virtual time.
    tags: [BTreeMap<String, u64>; 3],
    virtual_time: [u64; 3],
    /// What each id asked with first: tenant, tier, work, KV tokens, deadline.
    asked: BTreeMap<String, (usize, usize, u64, u64, u64)>,
}

#[derive(Debug, PartialEq)]
enum Reply {
    Admitted,
    Waiting(u64),
    Refused(u64),
}

/// When a hold that takes `span` ms from `now` is predicted to end: a tenth more, at least 50 ms.
fn pool_ends(now: u64, span: u64) -> u64 {
    now + span + span.div_ceil(10).max(50)
}

fn cost(work: u64, weight: u64) -> u64 {
    (work * 1_000).div_ceil(weight)
}

/// A request's KV tokens as its provider's: a third prompt, the rest its output ceiling.
fn split(kv: u64) -> (u64, u64) {
    (kv / 3, kv - kv / 3)
}

impl Model {
    fn load(&self) -> (u64, u64) {
        (self.holds.len() as u64, self.holds.values().map(|h| h.0).sum())
    }

    fn used_kv(&self) -> u64 {
        self.holds.values().map(|h| h.3).sum()
    }

    /// A refusal: its place, if it had one, is given up; a pool left with nothing (that place
    /// gone, or expired places read away) forgets.
    fn give_up_place(&mut self, id: &str) {
        self.waiting.remove(id);
        if self.holds.is_empty() && self.waiting.is_empty() {
            self.forget();
        }
    }

    fn forget(&mut self) {
        self.tags = Default::default();
        self.virtual_time = [0; 3];
    }

    #[allow(clippy::too_many_arguments)]
    fn ask(
        &mut self,
        id: &str,
        tenant: &str,
        rank: usize,
        work: u64,
        kv: u64,
        deadline: u64,
        wait: u64,
        now: u64,
    ) -> Reply {
        if self.holds.contains_key(id) {
            self.waiting.remove(id);
            return Reply::Admitted;
        }
        self.waiting.retain(|_, p| p.expires > now);
        let weight = WEIGHTS[tenant.as_bytes()[tenant.len() - 1] as usize - b'0' as usize];
        let arrival = self.waiting.get(id).map_or(now, |p| p.arrival);
        // Start tags of the tier's places (this request's among them), by arrival then id.
        let mut same: Vec<(String, Place)> = self
            .waiting
            .iter()
            .filter(|(other, p)| p.rank == rank && other.as_str() != id)
            .map(|(i, p)| (i.clone(), p.clone()))
            .collect();
        same.push((id.to_string(), Place { rank, tenant: tenant.to_string(), work, arrival, expires: 0, weight }));
        same.sort_by(|a, b| (a.1.arrival, &a.0).cmp(&(b.1.arrival, &b.0)));
        let virtual_time = self.virtual_time[rank];
        let mut next: BTreeMap<String, u64> = BTreeMap::new();
        let mut starts = BTreeMap::new();
        for (i, p) in &same {
            let s = *next
                .entry(p.tenant.clone())
                .or_insert_with(|| self.tags[rank].get(&p.tenant).copied().unwrap_or(virtual_time).max(virtual_time));
            starts.insert(i.clone(), s);
            next.insert(p.tenant.clone(), s + cost(p.work, p.weight));
        }
        let mine = starts[id];
        // Those before it, in the order they start: tier, then (its own tier) start tag, then arrival
        // and id.
        let mut before: Vec<(usize, u64, u64, &str, &Place)> = self
            .waiting
            .iter()
            .filter(|(other, p)| {
                other.as_str() != id
                    && (p.rank < rank
                        || (p.rank == rank && (starts[*other], p.arrival, other.as_str()) < (mine, arrival, id)))
            })
            .map(|(other, p)| (p.rank, if p.rank == rank { starts[other] } else { 0 }, p.arrival, other.as_str(), p))
            .collect();
        before.sort_by(|a, b| (a.0, a.1, a.2, a.3).cmp(&(b.0, b.1, b.2, b.3)));
        let before: Vec<&Place> = before.into_iter().map(|b| b.4).collect();
        let (n, _) = self.load();
        let tier_slots = TIERS[rank].1;
        if kv > TIER_KV[rank] {
            self.give_up_place(id);
            return Reply::Refused(0);
        }
        let kv_room = self.used_kv() + kv <= TIER_KV[rank];
        let starts = n + (before.len() as u64) < tier_slots && kv_room;
        let delay = if starts {
            0
        } else {
            // Slots free as holds end when predicted (one past its end, now), and each request
            // before it, once started, holds one for its work.
            let mut ends: BinaryHeap<Reverse<u64>> = self.holds.values().map(|h| Reverse(h.5.max(now))).collect();
            let first_end = ends.peek().map_or(now, |e| e.0);
            let (mut free, mut at) = (tier_slots as i64 - n as i64, now);
            let mut slot = |ends: &mut BinaryHeap<Reverse<u64>>| {
                while free <= 0 {
                    let Reverse(e) = ends.pop().expect("every hold has an end");
                    at = at.max(e);
                    free += 1;
                }
                free -= 1;
                at
            };
            for p in &before {
                let start = slot(&mut ends);
                ends.push(Reverse(pool_ends(start, p.work)));
            }
            let start = slot(&mut ends) - now;
            if kv_room { start } else { start.max(first_end - now) }
        };
        // A request's finish is its work here.
        if deadline > 0 && delay + work > deadline {
            self.give_up_place(id);
            return Reply::Refused(delay);
        }
        if starts && !self.provider_takes(rank, kv, now) {
            self.give_up_place(id);
            return Reply::Refused(0);
        }
        if starts {
            self.waiting.remove(id);
            self.charged.insert(id.to_string(), split(kv));
            let added = cost(work, weight);
            self.holds.insert(id.to_string(), (work, rank, tenant.to_string(), kv, added, pool_ends(now, work)));
            let finish = mine + added;
            let had = self.tags[rank].get(tenant).copied().unwrap_or(0);
            self.tags[rank].insert(tenant.to_string(), had.max(finish));
            if mine > virtual_time {
                self.virtual_time[rank] = mine;
                self.tags[rank].retain(|_, t| *t > mine);
            }
            return Reply::Admitted;
        }
        if self.provider_never(rank, kv) {
            self.give_up_place(id);
            return Reply::Refused(delay);
        }
        if delay > wait || wait == 0 {
            self.give_up_place(id);
            return Reply::Refused(delay);
        }
        self.waiting.insert(
            id.to_string(),
            Place { rank, tenant: tenant.to_string(), work, arrival, expires: now + WAITER_TTL_MS, weight },
        );
        Reply::Waiting(delay)
    }

    /// The provider's limits as tier `rank` sees them (its share, counted from the top): whether
    /// they take a request of `kv` tokens now; if so, taken.
    fn provider_takes(&mut self, rank: usize, kv: u64, now: u64) -> bool {
        let (tpm, burst, rpm, _) = PROVIDER;
        let share = PROVIDER_SHARE[rank] as f64 / 1000.0;
        let (cap, rate) = (burst as f64, tpm as f64 / 60_000.0);
        let (rcap, rrate) = (rpm as f64, rpm as f64 / 60_000.0);
        let tokens = refilled(self.provider.tokens, cap, rate, now);
        let requests = refilled(self.provider.requests, rcap, rrate, now);
        let (p, g) = split(kv);
        let n = (p + g) as f64;
        if self.provider_never(rank, kv) {
            return false;
        }
        if tokens - cap * (1.0 - share) < n || requests - rcap * (1.0 - share) < 1.0 {
            return false;
        }
        self.provider.tokens = Some(((tokens - n).max(-cap), now));
        self.provider.requests = Some(((requests - 1.0).max(-rcap), now));
        self.provider.day += p + g;
        true
    }

    /// Whether the provider's limits, as tier `rank` sees them, refuse a request of `kv` tokens
    /// whatever it waits for a slot: larger than the tier's share of one, or its day spent.
    fn provider_never(&self, rank: usize, kv: u64) -> bool {
        let (_, burst, rpm, per_day) = PROVIDER;
        let share = PROVIDER_SHARE[rank] as f64 / 1000.0;
        let budget = ((per_day as f64 * share).floor() as u64).max(1);
        kv as f64 > burst as f64 * share || (rpm as f64) * share < 1.0 || self.provider.day + kv > budget
    }

    /// Moves the provider's token bucket and day by `amount` (debt when positive, a refund when
    /// negative), as common.lua's `adjust`.
    fn provider_moves(&mut self, amount: i64, now: u64) {
        let (tpm, burst, ..) = PROVIDER;
        let (cap, rate) = (burst as f64, tpm as f64 / 60_000.0);
        if amount == 0 {
            return;
        }
        if self.provider.tokens.is_some() {
            let level = refilled(self.provider.tokens, cap, rate, now) - amount as f64;
            self.provider.tokens = Some((level.min(cap).max(-cap), now));
        }
        self.provider.day = self.provider.day.saturating_add_signed(amount);
    }

    /// A hold's provider charge settled by how its request ended.
    fn provider_settles(&mut self, id: &str, end: PoolEnd, now: u64) {
        let Some((p, g)) = self.charged.remove(id) else { return };
        let held = (p + g) as i64;
        match end {
            PoolEnd::Unused => {
                self.provider_moves(-held, now);
                let (.., rpm, _) = PROVIDER;
                let (rcap, rrate) = (rpm as f64, rpm as f64 / 60_000.0);
                if self.provider.requests.is_some() {
                    let level = refilled(self.provider.requests, rcap, rrate, now) + 1.0;
                    self.provider.requests = Some((level.min(rcap), now));
                }
            }
            PoolEnd::Released => self.provider_moves(-held, now),
            PoolEnd::Used { prompt, output, .. } => {
                self.provider_moves((prompt.unwrap_or(p) + output.unwrap_or(g)) as i64 - held, now)
            }
            PoolEnd::AsHeld => {}
        }
    }

    fn release(&mut self, id: &str, end: PoolEnd, now: u64) {
        let unused = end == PoolEnd::Unused;
        self.provider_settles(id, end, now);
        let was_waiting = self.waiting.remove(id).is_some();
        let held = self.holds.remove(id);
        if let (true, Some((_, rank, tenant, _, added, _))) = (unused, &held)
            && let Some(tag) = self.tags[*rank].get(tenant).copied()
        {
            let back = tag.saturating_sub(*added);
            if back > self.virtual_time[*rank] {
                self.tags[*rank].insert(tenant.clone(), back);
            } else {
                self.tags[*rank].remove(tenant);
            }
        }
        if (was_waiting || held.is_some()) && self.holds.is_empty() && self.waiting.is_empty() {
            self.forget();
        }
    }
}

struct Run {
    h: Harness<EmbeddedStore>,
    model: Model,
    now: u64,
}

impl Run {
    async fn step(&mut self, op: &Op, at: &str) {
        match op {
            Op::Ask { id, tenant, tier, work, kv, deadline, wait } => {
                let id = format!("r{id}");
                let (tenant, tier, work, kv, deadline) =
                    *self.model.asked.entry(id.clone()).or_insert((*tenant, *tier, *work, *kv, *deadline));
                let tenant = format!("t{tenant}");
                let (priority, tier_slots) = TIERS[tier];
                let call = PoolCall {
                    pool: &self.h.pool,
                    id: &id,
                    work_ms: work,
                    finish_ms: work,
                    kv_tokens: kv,
                    lease_ms: LEASE_MS,
                    idle_ttl_ms: 2 * LEASE_MS,
                    sweep_batch: 100,
                    slots: SLOTS,
                    tier_slots,
                    max_queue_delay_ms: 6_000,
                    tier_kv_tokens: Some(TIER_KV[tier]),
                    deadline_ms: (deadline > 0).then_some(deadline),
                    recover_per_ms: 0.0,
                    tier: priority,
                    tenant: &tenant,
                    weight_milli: WEIGHTS[tenant.as_bytes()[1] as usize - b'0' as usize],
                    queue: PoolQueue::Tollgate,
                    wait_ms: *wait,
                    waiter_ttl_ms: WAITER_TTL_MS,
                    provider: Some(ProviderCall {
                        limits: provider_limits(),
                        tier_part: PROVIDER_SHARE[tier] as f64 / 1000.0,
                        prompt_tokens: split(kv).0,
                        output_tokens: split(kv).1,
                        cost_nanos: 0,
                        idle_ttl_ms: 2 * LEASE_MS,
                    }),
                };
                let got = match self.h.admission.protocol().pool_reserve(&call).await.expect("pool_reserve") {
                    PoolOutcome::Admitted { .. } => Reply::Admitted,
                    PoolOutcome::Waiting { start_delay_ms } => Reply::Waiting(start_delay_ms),
                    PoolOutcome::Denied { start_delay_ms, .. } => Reply::Refused(start_delay_ms),
                };
                let want = self.model.ask(&id, &tenant, tier, work, kv, deadline, *wait, self.now);
                assert_eq!(got, want, "{at}: the reply");
            }
            Op::Release { id, end } => {
                let id = format!("r{id}");
                self.h.admission.protocol().pool_release(&self.h.pool, &id, *end).await.expect("pool_release");
                self.model.release(&id, *end, self.now);
            }
            Op::Advance { ms } => {
                self.h.advance(*ms).await;
                self.now += ms;
            }
        }
        // Every ask arrives in a millisecond of its own, as the model orders them.
        self.h.advance(1).await;
        self.now += 1;
        self.check(at).await;
    }

    async fn check(&self, at: &str) {
        let all = keys::pool_keys(&self.h.pool);
        let views = self.h.inspect(all.clone()).await;
        let fields = |k: usize| views[&all[k]].fields.clone();
        let (charges, holds): (BTreeMap<String, String>, BTreeMap<String, String>) =
            fields(1).into_iter().partition(|(id, _)| keys::is_pool_charge(id));
        let holds: BTreeMap<String, u64> =
            holds.into_iter().map(|(id, v)| (id, v.split(' ').next().unwrap().parse().unwrap())).collect();
        let charges: Vec<String> = charges.into_keys().collect();
        let want: Vec<String> = self.model.charged.keys().map(|id| keys::pool_charge(id)).collect();
        assert_eq!(charges, want, "{at}: each hold's provider charge beside it");
        let want: BTreeMap<String, u64> = self.model.holds.iter().map(|(id, h)| (id.clone(), h.0)).collect();
        assert_eq!(holds, want, "{at}: the pool's holds");
        let state = fields(0);
        let get = |f: &str| state.get(f).map_or(0, |v| v.parse::<u64>().unwrap());
        assert_eq!((get("n"), get("w")), self.model.load(), "{at}: n and w are the holds'");
        assert_eq!(get("kv"), self.model.used_kv(), "{at}: kv is the holds'");
        let waiting: BTreeMap<String, String> = fields(3);
        let want: BTreeMap<String, String> = self
            .model
            .waiting
            .iter()
            .map(|(id, p)| {
                (id.clone(), format!("{} {} {} {} {} {}", p.rank, p.tenant, p.work, p.arrival, p.expires, p.weight))
            })
            .collect();
        // The script removes expired places only when it next reads them; so does the model.
        assert_eq!(waiting, want, "{at}: the waiting places");
        for (rank, (tier, _)) in TIERS.iter().enumerate() {
            let tags: BTreeMap<String, u64> =
                fields(4 + rank).into_iter().map(|(t, v)| (t, v.parse::<f64>().unwrap() as u64)).collect();
            assert_eq!(tags, self.model.tags[rank], "{at}: finish tags at {}", tier.as_str());
            assert_eq!(get(&format!("v{}", tier.as_str())), self.model.virtual_time[rank], "{at}: virtual time");
        }
        if self.model.holds.is_empty() && self.model.waiting.is_empty() {
            assert!(state.keys().all(|f| !f.starts_with('f') && !f.starts_with('v')), "{at}: {state:?}");
        }
        let provider = fields(7);
        let bucket = |level: &str, at: &str| {
            provider.get(level).map(|l| (l.parse::<f64>().unwrap(), provider[at].parse::<f64>().unwrap() as u64))
        };
        let want = &self.model.provider;
        assert_eq!(bucket("t", "tt"), want.tokens, "{at}: the provider's tokens");
        assert_eq!(bucket("r", "rt"), want.requests, "{at}: the provider's requests");
        assert_eq!(provider.get("du").map_or(0, |v| v.parse::<u64>().unwrap()), want.day, "{at}: the provider's day");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_queue_keeps_the_models_books(ops in prop::collection::vec(op(), 1..60)) {
        runtime().block_on(async {
            let h = support::embedded("limits: {}\n---pool---\nmax_sequences: 3\nprefill_tokens_per_second: 1000\ndecode_tokens_per_second: 100\nmax_queue_delay_ms: 6000\nqueue: tollgate\n").await;
            let now = tollgate::store::clock::Clock::now_ms(h.clock.as_ref().unwrap());
            let mut run = Run { h, model: Model::default(), now };
            for (i, op) in ops.iter().enumerate() {
                run.step(op, &format!("step {i} {op:?}")).await;
            }
            // Everything released: the pool holds nothing and remembers no one.
            for id in 0..IDS {
                run.step(&Op::Release { id, end: PoolEnd::AsHeld }, "the end").await;
            }
            let views = run.h.inspect(keys::pool_keys(&run.h.pool)).await;
            let state_key = keys::pool_state(&run.h.pool);
            let provider_key = keys::pool_provider(&run.h.pool);
            let left: Vec<_> =
                views.iter().filter(|(k, v)| **k != state_key && **k != provider_key && !v.fields.is_empty()).collect();
            let state = &views[&state_key].fields;
            assert!(left.is_empty(), "{left:?}");
            assert!(state.keys().all(|f| !f.starts_with('v') && !f.starts_with('f')), "{state:?}");
        });
    }
}
