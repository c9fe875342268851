//! A reference model of the protocol in plain Rust: no Lua, no store. It keeps the same state the
//! scripts keep (scopes, holds, lease indexes, idempotency keys, the pool) and applies each phase
//! as `lua/` documents it, with the same float arithmetic in the same order, so on the embedded
//! store's manual clock every reply and every counter must agree exactly.
//!
//! Where the model needs a rule, it states the rule as the documentation does (docs/books.md), not as the script is
//! written: "a denial changes nothing", "a hold leaves its scopes and its pool exactly as it came".
//! The counters it compares (`c` of a scope, `n` and `w` of a pool) are derived from the live holds,
//! never counted, so comparing them with the store's counters checks the invariant itself.

use std::collections::{BTreeMap, BTreeSet};

use tollgate::admission::{Admitted, Decision, Denial, Forecast, Reason};
use tollgate::config::{ExpiredUsage, PoolPolicy, Priority};
pub use tollgate::hold::BudgetKey;
use tollgate::hold::{
    CommitOutcome, Ending, KeyRepeat, Measure, Period, ReleaseOutcome, RenewOutcome, Settled, Usage, Window,
};

pub const DAY_MS: u64 = 86_400_000;
pub const HOUR_MS: u64 = 3_600_000;

/// One scope's limits, as the reserve script takes them (0: no such limit), read from the policy
/// the way `config::Limits` defines them: the model keeps the scripts' own convention.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits {
    pub token_capacity: u64,
    pub tokens_per_ms: f64,
    pub request_capacity: u64,
    pub requests_per_ms: f64,
    pub max_concurrency: u64,
    /// The buckets of prompt tokens and of output tokens: capacity one minute's refill.
    pub input_capacity: u64,
    pub input_per_ms: f64,
    pub output_capacity: u64,
    pub output_per_ms: f64,
    /// Period budgets by [`BudgetKey::index`] (money in nanos).
    pub budgets: [u64; 16],
    /// Soft budgets, the same way (a tenant's scope alone has them): past one a request is
    /// admitted all the same, and marked.
    pub soft: [u64; 16],
}

impl Limits {
    pub fn budget(&self, key: BudgetKey) -> u64 {
        self.budgets[key.index()]
    }
}

impl From<&tollgate::config::Limits> for Limits {
    fn from(l: &tollgate::config::Limits) -> Self {
        Limits {
            token_capacity: l.token_capacity().unwrap_or(0),
            tokens_per_ms: l.tokens_per_ms(),
            request_capacity: l.requests_per_minute.unwrap_or(0),
            requests_per_ms: l.requests_per_ms(),
            max_concurrency: l.max_concurrency.unwrap_or(0),
            input_capacity: l.input_tokens_per_minute.unwrap_or(0),
            input_per_ms: l.input_tokens_per_minute.unwrap_or(0) as f64 / 60_000.0,
            output_capacity: l.output_tokens_per_minute.unwrap_or(0),
            output_per_ms: l.output_tokens_per_minute.unwrap_or(0) as f64 / 60_000.0,
            budgets: std::array::from_fn(|i| BudgetKey::all().nth(i).and_then(|k| l.budget(k)).unwrap_or(0)),
            soft: [0; 16],
        }
    }
}

/// What the model knows of a tenant's policy.
#[derive(Debug, Clone)]
pub struct TenantRules {
    pub lease_ms: u64,
    pub expired_usage: ExpiredUsage,
    /// The tenant's time zone, a fixed offset (minutes east of UTC).
    pub zone_offset_min: i64,
    pub tenant: Limits,
    /// Limits of every user (the policy's `default_user`), if any.
    pub user: Option<Limits>,
    /// Limits of model `n` within the tenant, if any.
    pub model_n: Option<Limits>,
}

/// A scope hash.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scope {
    pub t: Option<f64>,
    pub tt: u64,
    pub tc: u64,
    pub tr: f64,
    pub r: Option<f64>,
    pub rt: u64,
    pub input: Option<Level>,
    pub output: Option<Level>,
    /// Each period's marker: the number of the period its counters count.
    pub markers: BTreeMap<Period, u64>,
    /// What each period budget's counter has counted (in its marker's period).
    pub counts: BTreeMap<BudgetKey, u64>,
}

/// A bucket of one side: its level, last refill, capacity and refill per ms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub level: f64,
    pub at: u64,
    pub cap: u64,
    pub rate: f64,
}

/// The counters every scope keeps, whatever budgets it has: tokens and money per day and month.
pub const ALWAYS: [BudgetKey; 4] = [
    BudgetKey::new(Measure::Tokens, Period::Day),
    BudgetKey::new(Measure::Cost, Period::Day),
    BudgetKey::new(Measure::Tokens, Period::Month),
    BudgetKey::new(Measure::Cost, Period::Month),
];

/// The hour (when known), day, week and month numbers a moment falls in, in a zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Periods {
    pub hour: Option<u64>,
    pub day: u64,
}

impl Periods {
    pub fn of(day: u64, hour: Option<u64>) -> Periods {
        Periods { hour, day }
    }

    /// The periods of `now` in the zone `offset` minutes east of UTC.
    pub fn at(now: u64, offset: i64) -> Periods {
        let local = (now as i64 + offset * 60_000) as u64;
        Periods { hour: Some(local / HOUR_MS), day: local / DAY_MS }
    }

    pub fn get(&self, p: Period) -> Option<u64> {
        match p {
            Period::Hour => self.hour,
            Period::Day => Some(self.day),
            Period::Week => Some((self.day + 3) / 7),
            Period::Month => Some(month_of(self.day)),
        }
    }

    /// Ms from `now` until period `p` of these turns, in the zone `offset` minutes east.
    pub fn ends(&self, p: Period, now: u64, offset: i64) -> f64 {
        let ends = match p {
            Period::Hour => (self.hour.unwrap() + 1) * HOUR_MS,
            Period::Day => (self.day + 1) * DAY_MS,
            Period::Week => (((self.day + 3) / 7 + 1) * 7 - 3) * DAY_MS,
            Period::Month => month_start(month_of(self.day) + 1) * DAY_MS,
        };
        (ends as i64 - offset * 60_000 - now as i64) as f64
    }
}

/// Amounts by measure (debt when positive, a refund when negative).
#[derive(Debug, Clone, Copy, Default)]
pub struct Amounts {
    pub tokens: i64,
    pub cost: i64,
    pub input: i64,
    pub output: i64,
}

impl Amounts {
    pub fn of(&self, m: Measure) -> i64 {
        match m {
            Measure::Tokens => self.tokens,
            Measure::Cost => self.cost,
            Measure::Input => self.input,
            Measure::Output => self.output,
        }
    }

    fn negated(self) -> Amounts {
        Amounts { tokens: -self.tokens, cost: -self.cost, input: -self.input, output: -self.output }
    }

    fn is_zero(&self) -> bool {
        self.tokens == 0 && self.cost == 0 && self.input == 0 && self.output == 0
    }
}

/// The UTC calendar month of a day number: tollgate's own, which the counters this model holds
/// against the store's (day and month turns included) check against `common.lua`'s.
pub use tollgate::hold::month_of;

/// The day number a month (as [`month_of`] numbers it) starts on.
pub fn month_start(month: u64) -> u64 {
    let (y, m) = ((month / 12) as i64, (month % 12 + 1) as i64);
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe - 719_468) as u64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Reserved,
    Settled(Settled),
}

/// A reservation record.
#[derive(Debug, Clone)]
pub struct Hold {
    pub tenant: String,
    pub state: State,
    pub held: u64,
    pub charged: u64,
    pub slot: bool,
    pub lease_end: u64,
    pub attempts: u32,
    /// The day (and hour, when a scope counts hours) it was charged to, in its zone.
    pub day: u64,
    pub hour: Option<u64>,
    pub zone_offset_min: i64,
    pub scopes: Vec<String>,
    /// Per scope, the counters its reserve charged: where a refund may go.
    pub counted_in: Vec<BTreeSet<BudgetKey>>,
    pub policy: ExpiredUsage,
    pub key: Option<String>,
    pub usage: Option<Usage>,
    pub refunded_on_release: u64,
    /// The record is gone at this time (retention after settling).
    pub gone_at: Option<u64>,
    pub pool: Option<String>,
    /// The model the request named, and the output part of its hold (what commit reports).
    pub model: String,
    pub output_held: u64,
    /// The model's price per input and output token, the cost held and the cost charged (nanos).
    pub price: (u64, u64),
    pub cost_held: u64,
    pub cost_charged: u64,
}

/// An idempotency key.
#[derive(Debug, Clone)]
pub struct Key {
    pub fingerprint: String,
    pub made: u32,
    pub latest: Option<String>,
    pub last_call: Option<u64>,
    pub expires_at: u64,
}

/// A pool's holds: id → (work, kv, lease end).
/// A pool's holds: (work, KV tokens, lease end, predicted end) by reservation id.
type PoolHolds = BTreeMap<String, (u64, u64, u64, u64)>;

#[derive(Debug, Clone, Default)]
pub struct Pool {
    /// (work, KV tokens, lease end, predicted end: admission + predicted start + work) by
    /// reservation id.
    pub holds: BTreeMap<String, (u64, u64, u64, u64)>,
    /// Whose each hold is: (tier, tenant), for fair shares within a tier.
    pub owners: BTreeMap<String, (Priority, String)>,
}

impl Pool {
    pub fn load(&self) -> (u64, u64) {
        (self.holds.len() as u64, self.holds.values().map(|h| h.0).sum())
    }
}

/// One reserve, as the generator makes it.
#[derive(Debug, Clone)]
pub struct Ask {
    pub tenant: String,
    pub user: Option<String>,
    pub model: String,
    pub prompt: u64,
    pub max_tokens: u64,
    pub priority: Priority,
    pub deadline_ms: Option<u64>,
    pub key: Option<(String, KeyRepeat)>,
}

/// The model's world.
#[derive(Debug, Clone)]
pub struct Model {
    pub rules: BTreeMap<String, TenantRules>,
    pub pool_name: String,
    pub pool_policy: PoolPolicy,
    pub sweep_batch: usize,
    pub max_attempts: u32,
    pub retention_ms: u64,
    pub concurrency_cap_ms: u64,
    pub scopes: BTreeMap<String, Scope>,
    pub holds: BTreeMap<String, Hold>,
    /// Per tenant: (lease end, id).
    pub leases: BTreeMap<String, BTreeSet<(u64, String)>>,
    pub keys: BTreeMap<(String, String), Key>,
    pub pool: Pool,
    /// Each priced model's price per input and output token (nanos).
    pub prices: BTreeMap<String, (u64, u64)>,
    /// Calls made, for a replay's "last call" identity.
    calls: u64,
    /// The last admission's soft budget passed: ms until its period ends (what a replica
    /// remembers to demote the tenant's next requests by); `None` when it passed none.
    pub last_soft_ends_ms: Option<u64>,
}

/// The model's answer to a reserve: the decision, and for an admission that made a new hold, a
/// placeholder the driver replaces with the id the store chose.
pub const NEW_ID: &str = "<new>";

/// The tightest of one kind of bucket after taking `take`, from each scope's (level, capacity,
/// refill per ms): common.lua's `tightest`.
fn tightest(buckets: impl Iterator<Item = (f64, u64, f64)>, take: f64) -> Option<Window> {
    let (mut rem, mut lim, mut reset) = (-1.0f64, -1i64, -1i64);
    for (level, cap, rate) in buckets {
        if cap > 0 && (rem == -1.0 || level - take < rem) {
            rem = (level - take).max(0.0);
            lim = cap as i64;
            reset = ((cap as f64 - rem) / rate).ceil() as i64;
        }
    }
    (lim >= 0).then(|| Window { remaining: rem.floor() as i64, limit: lim as u64, reset_ms: reset.max(0) as u64 })
}

/// A bucket of one side refilled to `now` (0 when the scope has none; full when never written).
fn side_level(bucket: Option<Level>, cap: u64, rate: f64, now: u64) -> f64 {
    if cap == 0 {
        return 0.0;
    }
    refilled(bucket.map(|b| b.level), bucket.map_or(0, |b| b.at), cap, rate, now)
}

/// A bucket's level at `now` (common.lua's `refilled`): full when never written (`level` None).
pub fn refilled(level: Option<f64>, at: u64, cap: u64, rate: f64, now: u64) -> f64 {
    match level {
        None => cap as f64,
        Some(level) => (cap as f64).min(level + rate * (now.saturating_sub(at)) as f64),
    }
}

impl Model {
    pub fn new(
        rules: BTreeMap<String, TenantRules>,
        pool_name: String,
        pool_policy: PoolPolicy,
        sweep_batch: usize,
        max_attempts: u32,
        retention_ms: u64,
        concurrency_cap_ms: u64,
    ) -> Self {
        Model {
            rules,
            pool_name,
            pool_policy,
            sweep_batch,
            max_attempts,
            retention_ms,
            concurrency_cap_ms,
            scopes: BTreeMap::new(),
            holds: BTreeMap::new(),
            leases: BTreeMap::new(),
            keys: BTreeMap::new(),
            pool: Pool::default(),
            prices: BTreeMap::new(),
            calls: 0,
            last_soft_ends_ms: None,
        }
    }

    /// A record as a script would load it: `None` once its TTL has passed.
    fn record(&self, id: &str, now: u64) -> Option<&Hold> {
        self.holds.get(id).filter(|h| h.gone_at.is_none_or(|at| now < at))
    }

    /// Holds in flight in a scope: the live holds that took a slot in it.
    pub fn in_flight(&self, scope: &str) -> u64 {
        self.holds.values().filter(|h| h.slot && h.scopes.iter().any(|s| s == scope)).count() as u64
    }

    fn scope_keys(&self, ask: &Ask) -> Vec<(String, Limits)> {
        let r = &self.rules[&ask.tenant];
        let t = &ask.tenant;
        let mut out = vec![(format!("tg:{{{t}}}:s:t"), r.tenant)];
        if let (Some(user), Some(limits)) = (&ask.user, r.user) {
            out.push((format!("tg:{{{t}}}:s:u:{user}"), limits));
        }
        if ask.model == "n"
            && let Some(limits) = r.model_n
        {
            out.push((format!("tg:{{{t}}}:s:m:n"), limits));
        }
        out
    }

    // ---- tenant helpers, as common.lua ----

    fn move_tokens(&mut self, key: &str, delta: f64, now: u64) {
        if let Some(s) = self.scopes.get_mut(key)
            && let Some(t) = s.t
        {
            let cap = s.tc as f64;
            let level = refilled(Some(t), s.tt, s.tc, s.tr, now) + delta;
            s.t = Some((-cap).max(cap.min(level)));
            s.tt = now;
        }
    }

    /// Moves each scope by `n` (as common.lua's adjust): its buckets from their level now; each
    /// period's counters it has when their marker is the period `hold_at` (a refund) or `now_at`
    /// (debt) names; debt in a new period starts all of that period's counters afresh.
    fn adjust(&mut self, keys: &[String], n: Amounts, hold_at: Periods, now_at: Periods, now: u64, h: &Hold) {
        for (i, k) in keys.iter().enumerate() {
            if n.tokens != 0 {
                self.move_tokens(k, -(n.tokens as f64), now);
            }
            let Some(s) = self.scopes.get_mut(k) else { continue };
            for (bucket, amount) in [(&mut s.input, n.input), (&mut s.output, n.output)] {
                if amount != 0
                    && let Some(b) = bucket
                {
                    let cap = b.cap as f64;
                    let level = refilled(Some(b.level), b.at, b.cap, b.rate, now) - amount as f64;
                    (b.level, b.at) = ((-cap).max(cap.min(level)), now);
                }
            }
            for p in Period::ALL {
                if !s.markers.contains_key(&p) {
                    continue;
                }
                for m in Measure::ALL {
                    let key = BudgetKey::new(m, p);
                    let amount = n.of(m);
                    // A refund goes only to what the hold charged.
                    let charged = h.counted_in.get(i).is_some_and(|c| c.contains(&key));
                    let at = if amount < 0 { hold_at.get(p).filter(|_| charged) } else { now_at.get(p) };
                    let Some(at) = at.filter(|_| amount != 0 && s.counts.contains_key(&key)) else { continue };
                    // (Debt for a period before the one counted counts in it: a marker never
                    // goes back.)
                    if s.markers[&p] == at || (amount > 0 && at < s.markers[&p]) {
                        let v = (s.counts[&key] as i64 + amount).max(0) as u64;
                        s.counts.insert(key, v);
                    } else if amount > 0 {
                        for (k, v) in s.counts.iter_mut() {
                            if k.period == p {
                                *v = 0;
                            }
                        }
                        s.markers.insert(p, at);
                        s.counts.insert(key, amount as u64);
                    }
                }
            }
        }
    }

    fn refund(&mut self, keys: &[String], n: Amounts, hold_at: Periods, now: u64, h: &Hold) {
        if n.tokens > 0 || n.cost > 0 || n.input > 0 || n.output > 0 {
            self.adjust(keys, n.negated(), hold_at, hold_at, now, h);
        }
    }

    /// A settled hold moves from what it charged to what it should: refunds to its periods,
    /// charges to the current ones.
    fn settle(&mut self, keys: &[String], n: Amounts, hold_at: Periods, now_at: Periods, now: u64, h: &Hold) {
        if !n.is_zero() {
            self.adjust(keys, n, hold_at, now_at, now, h);
        }
    }

    /// What a hold has charged, by measure: all it held, or nothing once an expiry refunded it.
    fn charged_of(h: &Hold) -> Amounts {
        let output = if h.charged > 0 { h.charged.min(h.output_held) } else { 0 };
        Amounts {
            tokens: h.charged as i64,
            cost: h.cost_charged as i64,
            input: (h.charged - output) as i64,
            output: output as i64,
        }
    }

    /// Ends a hold's life in the index and its key. An expired record waits for a late commit
    /// for the retention (or the lease, if longer: here never); a committed or released hold is
    /// filed in the settled bucket of its period, gone at the end of the next.
    fn close(&mut self, id: &str, now: u64) {
        let retention = self.retention_ms;
        let h = self.holds.get_mut(id).expect("closing a known hold");
        h.gone_at = Some(match h.state {
            State::Settled(Settled::Expired) => now + retention,
            _ => (now / retention + 2) * retention,
        });
        let (tenant, key) = (h.tenant.clone(), h.key.clone());
        if let Some(set) = self.leases.get_mut(&tenant) {
            set.retain(|(_, i)| i != id);
        }
        if let Some(k) = key
            && let Some(entry) = self.keys.get_mut(&(tenant, k))
            && entry.latest.as_deref() == Some(id)
        {
            entry.latest = None;
        }
    }

    fn expire(&mut self, id: &str, now: u64) {
        let h = self.holds[id].clone();
        let (mut charged, mut cost) = (h.charged, h.cost_charged);
        if h.slot && h.policy == ExpiredUsage::Refund {
            self.refund(&h.scopes, Self::charged_of(&h), Periods::of(h.day, h.hour), now, &h);
            (charged, cost) = (0, 0);
        }
        let h = self.holds.get_mut(id).unwrap();
        h.charged = charged;
        h.cost_charged = cost;
        h.state = State::Settled(Settled::Expired);
        h.slot = false;
        self.close(id, now);
    }

    /// The tenant's sweep. Admission takes each settled hold's pool leg off its pool when the
    /// reply reaches it; `delivered` is false when the reply was lost.
    fn sweep(&mut self, tenant: &str, now: u64, delivered: bool) {
        let due: Vec<String> = self
            .leases
            .get(tenant)
            .map(|set| {
                set.iter().filter(|(le, _)| *le <= now).take(self.sweep_batch).map(|(_, id)| id.clone()).collect()
            })
            .unwrap_or_default();
        for id in due {
            if self.record(&id, now).is_some_and(|h| h.state == State::Reserved) {
                self.expire(&id, now);
                if delivered && self.holds[&id].pool.is_some() {
                    self.pool_drop(&id);
                }
            } else if let Some(set) = self.leases.get_mut(tenant) {
                set.retain(|(_, i)| *i != id);
            }
        }
    }

    /// A live hold, or the reply to send (settling it now when its lease has passed).
    fn live(&mut self, id: &str, now: u64) -> Result<(), Option<Settled>> {
        let Some(h) = self.record(id, now) else { return Err(None) };
        match h.state {
            State::Settled(s) => Err(Some(s)),
            State::Reserved if now >= h.lease_end => {
                self.expire(id, now);
                Err(Some(Settled::Expired))
            }
            State::Reserved => Ok(()),
        }
    }

    // ---- the pool, as pool_reserve.lua and pool_release.lua ----

    fn pool_drop(&mut self, id: &str) {
        self.pool.holds.remove(id);
        self.pool.owners.remove(id);
    }

    /// Fair shares within a contended tier (every tenant's weight is 1 here): a tenant holding
    /// work at the tier may hold at most its share of the tier's work, this request's included.
    fn fair_share(&self, holds: &PoolHolds, ask: &Ask, work: u64) -> bool {
        let at_tier = |id: &String| self.pool.owners.get(id).is_some_and(|(t, _)| *t == ask.priority);
        let held = holds.iter().filter(|(id, _)| at_tier(id));
        let mine: Vec<u64> =
            held.clone().filter(|(id, _)| self.pool.owners[*id].1 == ask.tenant).map(|(_, h)| h.0).collect();
        if mine.is_empty() {
            return true;
        }
        let tier_work: u64 = held.clone().map(|(_, h)| h.0).sum();
        let tenants: std::collections::BTreeSet<&String> = held.map(|(id, _)| &self.pool.owners[id].1).collect();
        let (weight, weights) = (1000.0, 1000.0 * tenants.len() as f64);
        let fair = weight / f64::max(weights, weight) * (tier_work + work) as f64;
        (mine.iter().sum::<u64>() + work) as f64 <= fair
    }

    /// The pool's checks on `holds`: `None` when they admit the request, else the refusal's reason.
    fn pool_refusal(&self, holds: &PoolHolds, ask: &Ask, work: u64) -> Option<Reason> {
        let (n, w) = (holds.len() as u64, holds.values().map(|h| h.0).sum::<u64>());
        let p = &self.pool_policy;
        let start_delay = |over: u64| if n < over { 0 } else { w.div_ceil(over) };
        if ask.deadline_ms.is_some_and(|deadline| start_delay(p.max_sequences) + work > deadline) {
            return Some(Reason::Deadline);
        }
        let tier_slots = p.slots_for(ask.priority);
        if start_delay(tier_slots) > p.queue_delay_for(ask.priority) {
            return Some(Reason::QueueFull);
        }
        if n >= tier_slots && !self.fair_share(holds, ask, work) {
            return Some(Reason::QueueFull);
        }
        None
    }

    /// When the request, sent again with nothing else arriving, would be admitted: the holds
    /// leaving at their predicted ends (one past its end, never, as far as anyone can say), the
    /// first end after which the checks pass. Without one, the back-off; a deadline shorter than
    /// the request's own work, never.
    fn pool_retry(&self, ask: &Ask, work: u64, now: u64) -> Option<u64> {
        if ask.deadline_ms.is_some_and(|deadline| work > deadline) {
            return None;
        }
        let mut holds = self.pool.holds.clone();
        let mut ends: Vec<u64> = holds.values().map(|h| h.3).filter(|end| *end > now).collect();
        ends.sort_unstable();
        ends.dedup();
        for end in ends {
            holds.retain(|_, h| h.3 > end || h.3 <= now);
            if self.pool_refusal(&holds, ask, work).is_none() {
                return Some(end - now);
            }
        }
        Some(self.concurrency_cap_ms)
    }

    /// The pool leg's script: the predicted start delay, or a refusal. A re-sent one that finds
    /// its hold answers a delay of 0, as the script does.
    fn pool_reserve(&mut self, id: &str, work: u64, kv: u64, lease: u64, ask: &Ask, now: u64) -> Result<u64, Denial> {
        if self.pool.holds.contains_key(id) {
            return Ok(0);
        }
        let due: Vec<String> = {
            let mut v: Vec<(u64, String)> =
                self.pool.holds.iter().filter(|(_, h)| h.2 <= now).map(|(id, h)| (h.2, id.clone())).collect();
            v.sort();
            v.into_iter().take(self.sweep_batch).map(|(_, id)| id).collect()
        };
        for d in due {
            self.pool_drop(&d);
        }
        let (n, w) = self.pool.load();
        let slots = self.pool_policy.max_sequences;
        let delay = if n < slots { 0 } else { w.div_ceil(slots) };
        if let Some(reason) = self.pool_refusal(&self.pool.holds, ask, work) {
            let retry_after_ms = self.pool_retry(ask, work, now);
            return Err(Denial { retry_after_ms, ..Denial::now(reason, "") });
        }
        // Predicted to end after its start and its work, a tenth more (at least 50 ms).
        let span = delay + work;
        self.pool.holds.insert(id.to_string(), (work, kv, now + lease, now + span + span.div_ceil(10).max(50)));
        self.pool.owners.insert(id.to_string(), (ask.priority, ask.tenant.clone()));
        Ok(delay)
    }

    // ---- the phases, as admission runs them ----

    /// A reserve. An admission of a new hold comes back with [`NEW_ID`] as its id: the driver
    /// calls [`Model::adopt`] with the id the store chose. `twice`: every script of the call runs
    /// twice and only the second reply arrives, as when a client re-sends after a lost reply.
    pub fn reserve(&mut self, ask: &Ask, now: u64, twice: bool) -> Decision {
        self.reserve_as(ask, now, twice, !twice)
    }

    /// A reserve that ran once and whose reply was lost: the holds its sweep settled are not
    /// taken off their pools by the caller (the pool's own sweep reclaims their work).
    pub fn reserve_reply_lost(&mut self, ask: &Ask, now: u64) -> Decision {
        self.reserve_as(ask, now, false, false)
    }

    fn reserve_as(&mut self, ask: &Ask, now: u64, twice: bool, delivered: bool) -> Decision {
        self.calls += 1;
        self.last_soft_ends_ms = None;
        let call = self.calls;
        let scopes = self.scope_keys(ask);
        if let Some(refused) = self.never_fits(ask, &scopes) {
            return refused;
        }
        let id = NEW_ID.to_string();
        let pooled = ask.model == "m";
        let forecast = match pooled.then(|| self.pool_leg(ask, now, twice)) {
            Some(Err(d)) => return Decision::Denied(d),
            Some(Ok(start_delay_ms)) => Some(Forecast { start_delay_ms, output_tokens: ask.max_tokens }),
            None => None,
        };
        let mut decision = self.tenant_reserve(ask, &scopes, call, now, delivered);
        // A re-sent reserve whose first run held (or replayed) answers as that run did, changing
        // nothing; one whose first run refused runs again in full.
        if twice && matches!(decision, Decision::Denied(_)) {
            decision = self.tenant_reserve(ask, &scopes, call, now, true);
        }
        let holds_new = matches!(&decision, Decision::Admitted(a) if a.reservation_id == NEW_ID);
        if pooled && !holds_new {
            self.pool_drop(&id);
        }
        if let Decision::Admitted(a) = &mut decision
            && holds_new
        {
            a.forecast = forecast;
        }
        decision
    }

    /// A reserve whose tenant call never reached the store: what can never fit is refused as
    /// ever, and a pool leg is taken and given back (tollgate tidies it up). `Some`: the answer the
    /// caller hears instead of `store_unavailable`.
    pub fn reserve_unreached(&mut self, ask: &Ask, now: u64) -> Option<Decision> {
        let scopes = self.scope_keys(ask);
        if let Some(refused) = self.never_fits(ask, &scopes) {
            return Some(refused);
        }
        if ask.model == "m" {
            if let Err(d) = self.pool_leg(ask, now, false) {
                return Some(Decision::Denied(d));
            }
            self.pool_drop(NEW_ID);
        }
        None
    }

    /// Plan: what can never fit is refused before any store call.
    fn never_fits(&self, ask: &Ask, scopes: &[(String, Limits)]) -> Option<Decision> {
        let hold = ask.prompt + ask.max_tokens;
        let cost = self.cost(&ask.model, ask.prompt, ask.max_tokens);
        for (_, l) in scopes {
            let tokens = Period::ALL.map(|p| l.budget(BudgetKey::new(Measure::Tokens, p)));
            let largest = std::iter::once(l.token_capacity).chain(tokens).filter(|&n| n > 0).min();
            let dearest =
                Period::ALL.map(|p| l.budget(BudgetKey::new(Measure::Cost, p))).into_iter().filter(|&n| n > 0).min();
            if largest.is_some_and(|largest| hold > largest) || dearest.is_some_and(|d| cost > d) {
                return Some(Decision::Denied(Denial::now(Reason::Unsatisfiable, "")));
            }
        }
        None
    }

    /// The pool leg of a reserve of model `m`. A re-sent pool reserve finds its hold and changes
    /// nothing; a refused one decides again.
    /// (The policy's pool does not calibrate: its work is the request's ceiling at the policy's
    /// speeds.)
    fn pool_leg(&mut self, ask: &Ask, now: u64, twice: bool) -> Result<u64, Denial> {
        let id = NEW_ID.to_string();
        let lease = self.rules[&ask.tenant].lease_ms;
        let hold = ask.prompt + ask.max_tokens;
        let work = self.pool_policy.service_ms(ask.prompt, ask.max_tokens);
        let pool = self.pool_reserve(&id, work, hold, lease, ask, now);
        if twice {
            return self.pool_reserve(&id, work, hold, lease, ask, now);
        }
        pool
    }

    /// Every key of the store has run out of its TTL (no hold is live): scopes, lease indexes,
    /// idempotency keys and the pool start afresh; settled records are gone by their retention.
    pub fn forget_idle(&mut self) {
        assert!(self.live_ids().is_empty(), "idle with live holds: {:?}", self.live_ids());
        self.scopes.clear();
        self.leases.clear();
        self.keys.clear();
        self.pool = Pool::default();
    }

    /// What tokens of a model cost at its price (nanos; 0 unpriced).
    fn cost(&self, model: &str, prompt: u64, output: u64) -> u64 {
        self.prices.get(model).map_or(0, |(i, o)| prompt * i + output * o)
    }

    fn tenant_reserve(
        &mut self,
        ask: &Ask,
        scope_keys: &[(String, Limits)],
        call: u64,
        now: u64,
        delivered: bool,
    ) -> Decision {
        let rules = self.rules[&ask.tenant].clone();
        let hold = ask.prompt + ask.max_tokens;
        let price = self.prices.get(&ask.model).copied().unwrap_or((0, 0));
        let cost = ask.prompt * price.0 + ask.max_tokens * price.1;
        let n =
            Amounts { tokens: hold as i64, cost: cost as i64, input: ask.prompt as i64, output: ask.max_tokens as i64 };
        let offset = rules.zone_offset_min;
        let at = Periods::at(now, offset);
        self.sweep(&ask.tenant, now, delivered);

        // Read and refill every scope.
        struct Read {
            key: String,
            l: Limits,
            t: f64,
            r: f64,
            c: u64,
            input: f64,
            output: f64,
            /// Every counter the scope counts (its budgets, ALWAYS, what it has counted), in the
            /// current period.
            used: BTreeMap<BudgetKey, u64>,
            /// As stored: its buckets' levels then, which the wait for each is counted from.
            stored: Scope,
        }
        let reads: Vec<Read> = scope_keys
            .iter()
            .map(|(key, l)| {
                let s = self.scopes.get(key).cloned().unwrap_or_default();
                Read {
                    stored: s.clone(),
                    key: key.clone(),
                    l: *l,
                    t: if l.token_capacity > 0 {
                        refilled(s.t, s.tt, l.token_capacity, l.tokens_per_ms, now)
                    } else {
                        0.0
                    },
                    r: if l.request_capacity > 0 {
                        refilled(s.r, s.rt, l.request_capacity, l.requests_per_ms, now)
                    } else {
                        0.0
                    },
                    c: self.in_flight(key),
                    input: side_level(s.input, l.input_capacity, l.input_per_ms, now),
                    output: side_level(s.output, l.output_capacity, l.output_per_ms, now),
                    used: BudgetKey::all()
                        .filter(|k| {
                            l.budget(*k) > 0 || l.soft[k.index()] > 0 || s.counts.contains_key(k) || ALWAYS.contains(k)
                        })
                        .map(|k| {
                            let current = at.get(k.period).is_some_and(|p| s.markers.get(&k.period) == Some(&p));
                            (k, if current { s.counts.get(&k).copied().unwrap_or(0) } else { 0 })
                        })
                        .collect(),
                }
            })
            .collect();
        let headroom = |take_t: f64, take_r: f64| {
            let tokens = tightest(reads.iter().map(|s| (s.t, s.l.token_capacity, s.l.tokens_per_ms)), take_t);
            let requests = tightest(reads.iter().map(|s| (s.r, s.l.request_capacity, s.l.requests_per_ms)), take_r);
            (tokens, requests)
        };
        // The buckets of one side after taking `prompt` and `output` (an admission's headroom).
        let sides = |prompt: f64, output: f64| {
            let input = tightest(reads.iter().map(|s| (s.input, s.l.input_capacity, s.l.input_per_ms)), prompt);
            let output = tightest(reads.iter().map(|s| (s.output, s.l.output_capacity, s.l.output_per_ms)), output);
            (input, output)
        };
        // The first soft budget (scopes in order, counters in common.lua's order) that taking
        // `taken` more leaves passed, and ms until its period ends.
        let soft_passed = |taken: &Amounts| {
            reads.iter().find_map(|s| {
                BudgetKey::all().find_map(|k| {
                    let limit = s.l.soft[k.index()];
                    let used = s.used.get(&k).copied().unwrap_or(0) as i64;
                    (limit > 0 && used + taken.of(k.measure) > limit as i64)
                        .then(|| (k, at.ends(k.period, now, offset).ceil() as u64))
                })
            })
        };
        self.last_soft_ends_ms = None;
        let refuse = |reason: Reason| {
            Decision::Denied(Denial {
                retry_after_ms: None,
                headroom: tollgate::hold::Headroom { tokens: headroom(0.0, 0.0).0, ..Default::default() },
                ..Denial::now(reason, "")
            })
        };

        // Idempotency.
        let mut attempts = 1;
        let mut fingerprint = String::new();
        if let Some((key, repeat)) = &ask.key {
            fingerprint =
                format!("{} {} {} {}", ask.user.as_deref().unwrap_or(""), ask.model, ask.prompt, ask.max_tokens);
            let k = self.keys.get(&(ask.tenant.clone(), key.clone())).filter(|k| now < k.expires_at).cloned();
            if let Some(k) = k {
                if k.fingerprint != fingerprint {
                    return refuse(Reason::InvalidRequest);
                }
                if *repeat == KeyRepeat::ReturnHold
                    && let Some(latest) = &k.latest
                    && let Some(h) =
                        self.record(latest, now).filter(|h| h.state == State::Reserved && h.lease_end > now)
                {
                    if k.made >= self.max_attempts {
                        return refuse(Reason::InvalidRequest);
                    }
                    let (held, latest) = (h.held, latest.clone());
                    let entry = self.keys.get_mut(&(ask.tenant.clone(), key.clone())).unwrap();
                    entry.made += 1;
                    entry.last_call = Some(call);
                    let (tokens, requests) = headroom(0.0, 0.0);
                    let (input, output) = sides(0.0, 0.0);
                    let soft = soft_passed(&Amounts::default());
                    self.last_soft_ends_ms = soft.map(|(_, ms)| ms);
                    return Decision::Admitted(Admitted {
                        reservation_id: latest,
                        model: ask.model.clone(),
                        reserved_tokens: held,
                        attempts: k.made + 1,
                        replayed: true,
                        headroom: tollgate::hold::Headroom { tokens, requests, sides: None }
                            .with_sides(tollgate::hold::Sides { input, output }),
                        shadow: None,
                        soft_limit: soft.map(|(k, _)| k),
                        tier: ask.priority,
                        forecast: None,
                        output_ceiling: Some(ask.max_tokens),
                    });
                }
                if k.made >= self.max_attempts {
                    return refuse(Reason::InvalidRequest);
                }
                attempts = k.made + 1;
            }
        }

        // What no wait can help: a side larger than its bucket or budget ever holds.
        let beyond = |s: &Read| {
            (s.l.input_capacity > 0 && ask.prompt > s.l.input_capacity)
                || (s.l.output_capacity > 0 && ask.max_tokens > s.l.output_capacity)
                || BudgetKey::all().any(|k| s.l.budget(k) > 0 && n.of(k.measure) > s.l.budget(k) as i64)
        };
        if reads.iter().any(beyond) {
            return Decision::Denied(Denial::now(Reason::Unsatisfiable, ""));
        }

        // Decide: the limit that frees last is the reason.
        let mut verdict: Option<(Reason, u64)> = None;
        let mut deny = |why: Reason, ms: f64| {
            let ms = ms.ceil().max(1.0) as u64;
            if verdict.is_none_or(|(_, w)| ms > w) {
                verdict = Some((why, ms));
            }
        };
        // The least whole ms after which a bucket, refilled from its stored level (`then`), holds
        // `need`: the division's rounding is not the refill's.
        let wait = |level: f64, need: f64, rate: f64, then: &dyn Fn(u64) -> f64| {
            let mut ms = ((need - level) / rate).ceil().max(1.0) as u64;
            while then(now + ms) < need {
                ms += 1;
            }
            while ms > 1 && then(now + ms - 1) >= need {
                ms -= 1;
            }
            ms as f64
        };
        for s in &reads {
            let st = &s.stored;
            let l = &s.l;
            if l.token_capacity > 0 && s.t < hold as f64 {
                let then = |t| refilled(st.t, st.tt, l.token_capacity, l.tokens_per_ms, t);
                deny(Reason::TokenRate, wait(s.t, hold as f64, l.tokens_per_ms, &then));
            }
            if l.input_capacity > 0 && ask.prompt > 0 && s.input < ask.prompt as f64 {
                let then = |t| side_level(st.input, l.input_capacity, l.input_per_ms, t);
                deny(Reason::TokenRate, wait(s.input, ask.prompt as f64, l.input_per_ms, &then));
            }
            if l.output_capacity > 0 && ask.max_tokens > 0 && s.output < ask.max_tokens as f64 {
                let then = |t| side_level(st.output, l.output_capacity, l.output_per_ms, t);
                deny(Reason::TokenRate, wait(s.output, ask.max_tokens as f64, l.output_per_ms, &then));
            }
            if l.request_capacity > 0 && s.r < 1.0 {
                let then = |t| refilled(st.r, st.rt, l.request_capacity, l.requests_per_ms, t);
                deny(Reason::RequestRate, wait(s.r, 1.0, l.requests_per_ms, &then));
            }
            if s.l.max_concurrency > 0 && s.c >= s.l.max_concurrency {
                // The lease end of the hold whose end frees the slot needed, among this scope's
                // holds (oldest lease first), or the back-off when that is later.
                let mut ends: Vec<u64> = self
                    .holds
                    .values()
                    .filter(|h| h.state == State::Reserved && h.slot && h.scopes.contains(&s.key))
                    .map(|h| h.lease_end)
                    .collect();
                ends.sort_unstable();
                let need = (s.c + 1 - s.l.max_concurrency) as usize;
                let cap = self.concurrency_cap_ms;
                let ms = ends.get(need - 1).map_or(cap, |le| cap.min(le.saturating_sub(now).max(1)));
                deny(Reason::Concurrency, ms as f64);
            }
            for (key, used) in &s.used {
                let (limit, amount) = (s.l.budget(*key), n.of(key.measure));
                if limit > 0 && amount > 0 && used + amount as u64 > limit {
                    deny(Reason::Budget, at.ends(key.period, now, offset));
                }
            }
        }
        if let Some((reason, wait)) = verdict {
            return Decision::Denied(Denial {
                retry_after_ms: Some(wait),
                headroom: tollgate::hold::Headroom { tokens: headroom(0.0, 0.0).0, ..Default::default() },
                ..Denial::now(reason, "")
            });
        }

        // Hold.
        let soft = soft_passed(&n);
        self.last_soft_ends_ms = soft.map(|(_, ms)| ms);
        let mut hourly = false;
        for s in &reads {
            let scope = self.scopes.entry(s.key.clone()).or_default();
            for (key, used) in &s.used {
                scope.counts.insert(*key, used + n.of(key.measure) as u64);
                scope.markers.insert(key.period, at.get(key.period).unwrap());
                hourly |= key.period == Period::Hour;
            }
            let level = |level: f64, amount: u64, cap: u64, rate: f64| Level {
                level: level - amount as f64,
                at: now,
                cap,
                rate,
            };
            if s.l.input_capacity > 0 {
                scope.input = Some(level(s.input, ask.prompt, s.l.input_capacity, s.l.input_per_ms));
            }
            if s.l.output_capacity > 0 {
                scope.output = Some(level(s.output, ask.max_tokens, s.l.output_capacity, s.l.output_per_ms));
            }
            if s.l.token_capacity > 0 {
                scope.t = Some(s.t - hold as f64);
                scope.tt = now;
                scope.tc = s.l.token_capacity;
                scope.tr = s.l.tokens_per_ms;
            }
            if s.l.request_capacity > 0 {
                scope.r = Some(s.r - 1.0);
                scope.rt = now;
            }
        }
        let id = NEW_ID.to_string();
        if let Some((key, _)) = &ask.key {
            self.keys.insert(
                (ask.tenant.clone(), key.clone()),
                Key {
                    fingerprint,
                    made: attempts,
                    latest: Some(id.clone()),
                    last_call: Some(call),
                    expires_at: now + rules.lease_ms,
                },
            );
        }
        self.holds.insert(
            id.clone(),
            Hold {
                tenant: ask.tenant.clone(),
                state: State::Reserved,
                held: hold,
                charged: hold,
                slot: true,
                lease_end: now + rules.lease_ms,
                attempts,
                day: at.day,
                hour: if hourly { at.hour } else { None },
                zone_offset_min: offset,
                scopes: reads.iter().map(|s| s.key.clone()).collect(),
                counted_in: reads.iter().map(|s| s.used.keys().copied().collect()).collect(),
                policy: rules.expired_usage,
                key: ask.key.as_ref().map(|(k, _)| k.clone()),
                usage: None,
                refunded_on_release: 0,
                gone_at: None,
                pool: (ask.model == "m").then(|| self.pool_name.clone()),
                model: ask.model.clone(),
                output_held: hold - ask.prompt,
                price,
                cost_held: cost,
                cost_charged: cost,
            },
        );
        self.leases.entry(ask.tenant.clone()).or_default().insert((now + rules.lease_ms, id.clone()));
        let (tokens, requests) = headroom(hold as f64, 1.0);
        let (input, output) = sides(ask.prompt as f64, ask.max_tokens as f64);
        Decision::Admitted(Admitted {
            reservation_id: id,
            model: ask.model.clone(),
            reserved_tokens: hold,
            attempts,
            replayed: false,
            headroom: tollgate::hold::Headroom { tokens, requests, sides: None }
                .with_sides(tollgate::hold::Sides { input, output }),
            shadow: None,
            soft_limit: soft.map(|(k, _)| k),
            tier: ask.priority,
            forecast: None,
            output_ceiling: Some(ask.max_tokens),
        })
    }

    /// Names the hold the last reserve made with the id the store chose.
    pub fn adopt(&mut self, id: &str) {
        let hold = self.holds.remove(NEW_ID).expect("a new hold to adopt");
        let tenant = hold.tenant.clone();
        if let Some(set) = self.leases.get_mut(&tenant) {
            let entries: Vec<_> = set.iter().filter(|(_, i)| i == NEW_ID).cloned().collect();
            for (le, _) in entries {
                set.remove(&(le, NEW_ID.to_string()));
                set.insert((le, id.to_string()));
            }
        }
        for k in self.keys.values_mut() {
            if k.latest.as_deref() == Some(NEW_ID) {
                k.latest = Some(id.to_string());
            }
        }
        if let Some(p) = self.pool.holds.remove(NEW_ID) {
            self.pool.holds.insert(id.to_string(), p);
        }
        if let Some(o) = self.pool.owners.remove(NEW_ID) {
            self.pool.owners.insert(id.to_string(), o);
        }
        self.holds.insert(id.to_string(), hold);
    }

    pub fn commit(&mut self, id: &str, prompt: u64, output: u64, now: u64) -> CommitOutcome {
        let outcome = self.tenant_commit(id, prompt, output, now);
        if outcome != CommitOutcome::NotFound
            && let Some(h) = self.holds.get(id)
            && h.pool.is_some()
        {
            self.pool_drop(id);
        }
        outcome
    }

    fn tenant_commit(&mut self, id: &str, prompt: u64, output: u64, now: u64) -> CommitOutcome {
        let Some(h) = self.record(id, now).cloned() else { return CommitOutcome::NotFound };
        match h.state {
            State::Settled(Settled::Committed | Settled::LateCommitted) => {
                // A repeat answers with the first commit's counts; the model went with the record.
                let u = h.usage.expect("a committed hold has its usage");
                return CommitOutcome::Committed(Usage { duplicate: true, model: None, ..u });
            }
            State::Settled(Settled::Released) => return CommitOutcome::Released,
            _ => {}
        }
        if h.state == State::Reserved && now >= h.lease_end {
            self.expire(id, now);
        }
        let h = self.holds[id].clone();
        let used = prompt + output;
        let cost = prompt * h.price.0 + output * h.price.1;
        let had = Self::charged_of(&h);
        let delta = Amounts {
            tokens: used as i64 - had.tokens,
            cost: cost as i64 - had.cost,
            input: prompt as i64 - had.input,
            output: output as i64 - had.output,
        };
        let now_at = Periods::at(now, h.zone_offset_min);
        self.settle(&h.scopes, delta, Periods::of(h.day, h.hour), now_at, now, &h);
        let late = h.state == State::Settled(Settled::Expired);
        let usage = Usage {
            late,
            duplicate: false,
            metered: false,
            used,
            held: h.held,
            refunded: h.held.saturating_sub(used),
            overrun: used.saturating_sub(h.held),
            model: Some(h.model.clone()),
            output_held: Some(h.output_held),
            cost_nanos: cost,
            // The model commits reported counts, as `Admission::commit` does.
            ending: Some(Ending::Completed),
        };
        let rec = self.holds.get_mut(id).unwrap();
        rec.state = State::Settled(if late { Settled::LateCommitted } else { Settled::Committed });
        rec.charged = used;
        rec.cost_charged = cost;
        rec.slot = false;
        rec.usage = Some(usage.clone());
        self.close(id, now);
        CommitOutcome::Committed(usage)
    }

    pub fn release(&mut self, id: &str, now: u64) -> ReleaseOutcome {
        let outcome = match self.live(id, now) {
            Err(None) => ReleaseOutcome::NotFound,
            Err(Some(Settled::Released)) => {
                ReleaseOutcome::Released { refunded: self.holds[id].refunded_on_release, repeated: true }
            }
            Err(Some(s)) => ReleaseOutcome::Settled(s),
            Ok(()) => {
                let h = self.holds[id].clone();
                self.refund(&h.scopes, Self::charged_of(&h), Periods::of(h.day, h.hour), now, &h);
                let rec = self.holds.get_mut(id).unwrap();
                rec.state = State::Settled(Settled::Released);
                rec.refunded_on_release = h.charged;
                rec.charged = 0;
                rec.cost_charged = 0;
                rec.slot = false;
                self.close(id, now);
                ReleaseOutcome::Released { refunded: h.charged, repeated: false }
            }
        };
        if outcome != ReleaseOutcome::NotFound && self.holds.get(id).is_some_and(|h| h.pool.is_some()) {
            self.pool_drop(id);
        }
        outcome
    }

    pub fn renew(&mut self, id: &str, now: u64) -> RenewOutcome {
        match self.live(id, now) {
            Err(None) => RenewOutcome::NotFound,
            Err(Some(s)) => {
                self.pool_drop(id);
                RenewOutcome::Settled(s)
            }
            Ok(()) => {
                let h = self.holds[id].clone();
                let lease = self.rules[&h.tenant].lease_ms;
                let end = now + lease;
                self.holds.get_mut(id).unwrap().lease_end = end;
                let set = self.leases.entry(h.tenant.clone()).or_default();
                set.retain(|(_, i)| i != id);
                set.insert((end, id.to_string()));
                if let Some(k) = &h.key
                    && let Some(entry) = self.keys.get_mut(&(h.tenant.clone(), k.clone()))
                    && now < entry.expires_at
                {
                    entry.expires_at = end;
                }
                if let Some(p) = self.pool.holds.get_mut(id) {
                    p.2 = end;
                }
                RenewOutcome::Renewed { lease_remaining_ms: lease }
            }
        }
    }

    /// Pool holds whose lease has not run out at `now`: the pool's own sweep reclaims the rest.
    pub fn pool_holds_in_lease(&self, now: u64) -> u64 {
        self.pool.holds.values().filter(|h| h.2 > now).count() as u64
    }

    /// The background sweeper, run until nothing is due: every hold whose lease has passed by
    /// `now`, of every tenant, settled as expired (its pool leg taken off with it).
    pub fn sweep_all(&mut self, now: u64) {
        let tenants: Vec<String> = self.leases.keys().cloned().collect();
        for tenant in tenants {
            while self.leases.get(&tenant).is_some_and(|set| set.iter().any(|(le, _)| *le <= now)) {
                self.sweep(&tenant, now, true);
            }
        }
    }

    /// Ids of every hold still reserved.
    pub fn live_ids(&self) -> Vec<String> {
        self.holds.iter().filter(|(_, h)| h.state == State::Reserved).map(|(id, _)| id.clone()).collect()
    }
}
