//! One codec per script: each file owns a script's `KEYS`/`ARGV` encoding and its reply decoding,
//! beside the typed call it serves, so the layout each `lua/*.lua` header documents is written in
//! Rust once. Every codec names its arguments in a `const` list, in `ARGV` order; a push under the
//! wrong name fails in debug builds, and a test here holds each list against its script's
//! `-- ARGV[n]` header lines, so a shifted position fails by name, not by behaviour.
//!
//! - [`reserve`]: `reserve.lua`, the admission phase.
//! - [`settle`]: `commit.lua`, `renew.lua`, `release.lua`.
//! - [`lease`]: `lease.lua` and `lease_forward.lua`, a replica's slices; `heartbeat.lua`.
//! - [`pool`]: the backend pool's scripts.
//! - [`estimate`]: `estimate.lua`, a tenant's learned output length.
//! - [`ledger`]: `ledger_read.lua` and `ledger_ack.lua`, the ledger read through a consumer group.
//! - [`sweep`]: the background sweeper: `sweep.lua` on a tenant, the index of tenants in shards.
//! - [`budget`]: `budget_get.lua` and `budget_adjust.lua`, the Budgets API.

pub mod budget;
pub mod estimate;
pub mod lease;
pub mod ledger;
pub mod pool;
pub mod reserve;
pub mod settle;
pub mod sweep;

use super::{Reply, Script, StoreError};
use crate::hold::{BudgetKey, Measure, Period, Refusal, Settled, Window};

/// Two argument lists, one after the other, as one (`N` their lengths' sum).
// Evaluated at compile time over lists of a few dozen: indices stay below `N`.
#[allow(clippy::arithmetic_side_effects)]
pub(crate) const fn joined<const A: usize, const B: usize, const N: usize>(
    first: [&'static str; A],
    then: [&'static str; B],
) -> [&'static str; N] {
    assert!(A + B == N, "joined: N is not the lists' lengths together");
    let mut all = [""; N];
    let mut i = 0;
    while i < A {
        all[i] = first[i];
        i += 1;
    }
    while i < N {
        all[i] = then[i - A];
        i += 1;
    }
    all
}

/// A script's `ARGV` as a codec builds it: each value pushed under the name the script's header
/// gives its position. `names` is the fixed part; `group` repeats after it (per scope, per entry).
pub(crate) struct Argv {
    script: &'static str,
    names: &'static [&'static str],
    group: &'static [&'static str],
    values: Vec<String>,
}

impl Argv {
    pub(crate) fn new(script: &'static str, names: &'static [&'static str], groups: usize) -> Self {
        Argv::grouped(script, names, &[], groups)
    }

    pub(crate) fn grouped(
        script: &'static str,
        names: &'static [&'static str],
        group: &'static [&'static str],
        groups: usize,
    ) -> Self {
        let capacity = names.len().saturating_add(group.len().saturating_mul(groups));
        Argv { script, names, group, values: Vec::with_capacity(capacity) }
    }

    /// The name the next position has in the script's header.
    fn expected(&self) -> Option<&'static str> {
        let at = self.values.len();
        match self.names.get(at) {
            Some(name) => Some(name),
            None => {
                let into_group = at.saturating_sub(self.names.len());
                self.group.get(into_group.checked_rem(self.group.len())?).copied()
            }
        }
    }

    pub(crate) fn push(&mut self, name: &'static str, value: String) {
        debug_assert_eq!(
            self.expected(),
            Some(name),
            "{}: ARGV[{}] is not {name:?}",
            self.script,
            self.values.len().saturating_add(1)
        );
        self.values.push(value);
    }

    pub(crate) fn finish(self) -> Vec<String> {
        debug_assert!(self.values.len() >= self.names.len(), "{}: ARGV stops short", self.script);
        debug_assert!(
            self.group.is_empty()
                || self.values.len().saturating_sub(self.names.len()).is_multiple_of(self.group.len()),
            "{}: ARGV ends inside a group",
            self.script
        );
        self.values
    }
}

/// A script's array reply, read field by field; any field of the wrong shape is a
/// [`StoreError::BadReply`] naming the script and the whole reply.
pub(crate) struct Fields<'a> {
    script: &'static str,
    reply: &'a Reply,
    items: &'a [Reply],
}

impl<'a> Fields<'a> {
    pub(crate) fn of(script: &Script, reply: &'a Reply) -> Result<Self, StoreError> {
        match reply {
            Reply::Array(items) => Ok(Fields { script: script.name, reply, items }),
            _ => Err(StoreError::BadReply { script: script.name, reply: reply.clone() }),
        }
    }

    pub(crate) fn bad(&self) -> StoreError {
        StoreError::BadReply { script: self.script, reply: self.reply.clone() }
    }

    /// How many fields the reply has.
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn get(&self, i: usize) -> Option<&'a Reply> {
        self.items.get(i)
    }

    /// The reply as runs of `n` fields, each read as a reply of its own (the last may be shorter).
    pub(crate) fn chunks(&self, n: usize) -> impl Iterator<Item = Fields<'a>> + '_ {
        self.items.chunks(n).map(|items| Fields { script: self.script, reply: self.reply, items })
    }

    pub(crate) fn int(&self, i: usize) -> Result<i64, StoreError> {
        self.items.get(i).and_then(Reply::as_int).ok_or_else(|| self.bad())
    }

    /// A count: never negative.
    pub(crate) fn uint(&self, i: usize) -> Result<u64, StoreError> {
        u64::try_from(self.int(i)?).map_err(|_| self.bad())
    }

    /// A count, or `None` for `-1`, "no such limit".
    pub(crate) fn optional_uint(&self, i: usize) -> Result<Option<u64>, StoreError> {
        match self.int(i)? {
            -1 => Ok(None),
            n => u64::try_from(n).map(Some).map_err(|_| self.bad()),
        }
    }

    pub(crate) fn count(&self, i: usize) -> Result<u32, StoreError> {
        u32::try_from(self.int(i)?).map_err(|_| self.bad())
    }

    /// A 0 / 1 field.
    pub(crate) fn flag(&self, i: usize) -> Result<bool, StoreError> {
        match self.int(i)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.bad()),
        }
    }

    pub(crate) fn text(&self, i: usize) -> Result<&'a str, StoreError> {
        self.items.get(i).and_then(Reply::as_text).ok_or_else(|| self.bad())
    }

    /// A list of texts. An empty Lua table arrives as an empty array (or, from the embedded
    /// store, as nothing at all past the last field).
    pub(crate) fn texts(&self, i: usize) -> Result<Vec<String>, StoreError> {
        match self.items.get(i) {
            None => Ok(Vec::new()),
            Some(Reply::Array(items)) => {
                items.iter().map(|t| t.as_text().map(str::to_string).ok_or_else(|| self.bad())).collect()
            }
            Some(_) => Err(self.bad()),
        }
    }

    /// The two lists a reply ends with, flat from `i`: a count, that many counts (`None` for
    /// each `-1`, "no such limit"), then texts to the end.
    pub(crate) fn lists(&self, i: usize) -> Result<(Vec<Option<u64>>, Vec<String>), StoreError> {
        let n = usize::try_from(self.uint(i)?).map_err(|_| self.bad())?;
        let first = i.saturating_add(1);
        let texts_from = first.checked_add(n).filter(|&end| end <= self.items.len()).ok_or_else(|| self.bad())?;
        let counts = (first..texts_from).map(|at| self.optional_uint(at)).collect::<Result<_, _>>()?;
        let texts =
            (texts_from..self.items.len()).map(|at| self.text(at).map(str::to_string)).collect::<Result<_, _>>()?;
        Ok((counts, texts))
    }

    /// A refusal's reason at `i`, as the scripts name it.
    pub(crate) fn refusal(&self, i: usize) -> Result<Refusal, StoreError> {
        refusal(self.text(i)?).ok_or_else(|| self.bad())
    }

    /// A scope index at `i`: 1-based in Lua, 0-based here.
    pub(crate) fn scope(&self, i: usize) -> Result<usize, StoreError> {
        usize::try_from(self.uint(i)?.saturating_sub(1)).map_err(|_| self.bad())
    }

    /// A settled hold's state, as the reply named it.
    pub(crate) fn settled(&self, text: &str) -> Result<Settled, StoreError> {
        settled(text).ok_or_else(|| self.bad())
    }

    /// Remaining / limit / reset at these fields: the scripts send a limit of -1 for "no scope
    /// limits this".
    pub(crate) fn window(&self, [remaining, limit, reset]: [usize; 3]) -> Result<Option<Window>, StoreError> {
        let limit = self.int(limit)?;
        if limit < 0 {
            return Ok(None);
        }
        Ok(Some(Window {
            remaining: self.int(remaining)?,
            limit: limit.unsigned_abs(),
            reset_ms: self.int(reset)?.max(0).unsigned_abs(),
        }))
    }
}

/// A refusal as the reserve and lease scripts name it.
fn refusal(s: &str) -> Option<Refusal> {
    Some(match s {
        "token_rate" => Refusal::TokenRate,
        "request_rate" => Refusal::RequestRate,
        "concurrency" => Refusal::Concurrency,
        "input_rate" => Refusal::InputRate,
        "output_rate" => Refusal::OutputRate,
        // (The names of the four budgets before hours and weeks, as a lease call's kept answer
        // from an earlier version may give them.)
        "budget" => Refusal::Budget(BudgetKey::new(Measure::Tokens, Period::Day)),
        "cost_budget" => Refusal::Budget(BudgetKey::new(Measure::Cost, Period::Day)),
        "monthly_budget" => Refusal::Budget(BudgetKey::new(Measure::Tokens, Period::Month)),
        "monthly_cost_budget" => Refusal::Budget(BudgetKey::new(Measure::Cost, Period::Month)),
        "attempts" => Refusal::Attempts,
        "conflict" => Refusal::Conflict,
        "unsatisfiable" => Refusal::Unsatisfiable,
        other => Refusal::Budget(BudgetKey::from_counter(other.strip_prefix("budget:")?)?),
    })
}

/// A settled record's state, as the scripts write it.
fn settled(s: &str) -> Option<Settled> {
    Some(match s {
        "committed" => Settled::Committed,
        "late_committed" => Settled::LateCommitted,
        "released" => Settled::Released,
        "expired" => Settled::Expired,
        _ => return None,
    })
}

#[cfg(test)]
// Offsets into a script's own header text, which the test reads whole.
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    /// Every codec's argument list, with the script whose header it follows.
    const CODECS: [(&str, &str, &[&str], &[&str]); 23] = [
        ("reserve.lua", include_str!("../../../lua/reserve.lua"), &reserve::ARGV, &reserve::PACKED_SCOPE_ARGV),
        ("commit.lua", include_str!("../../../lua/commit.lua"), &settle::COMMIT_ARGV, &[]),
        (
            "commit_many.lua",
            include_str!("../../../lua/commit_many.lua"),
            &settle::COMMIT_MANY_ARGV,
            &settle::COMMIT_MANY_GROUP,
        ),
        ("renew.lua", include_str!("../../../lua/renew.lua"), &settle::RENEW_ARGV, &[]),
        ("release.lua", include_str!("../../../lua/release.lua"), &settle::RELEASE_ARGV, &[]),
        ("lease.lua", include_str!("../../../lua/lease.lua"), &lease::ARGV, &lease::SCOPE_ARGV),
        ("lease_forward.lua", include_str!("../../../lua/lease_forward.lua"), &lease::FORWARD_ARGV, &[]),
        ("heartbeat.lua", include_str!("../../../lua/heartbeat.lua"), &lease::HEARTBEAT_ARGV, &[]),
        ("pool_reserve.lua", include_str!("../../../lua/pool_reserve.lua"), &pool::RESERVE_ARGV, &pool::PROVIDER_ARGV),
        ("pool_release.lua", include_str!("../../../lua/pool_release.lua"), &pool::RELEASE_ARGV, &[]),
        ("pool_renew.lua", include_str!("../../../lua/pool_renew.lua"), &pool::RENEW_ARGV, &[]),
        ("pool_progress.lua", include_str!("../../../lua/pool_progress.lua"), &pool::PROGRESS_ARGV, &[]),
        ("pool_throttle.lua", include_str!("../../../lua/pool_throttle.lua"), &pool::THROTTLE_ARGV, &[]),
        ("pool_status.lua", include_str!("../../../lua/pool_status.lua"), &pool::STATUS_ARGV, &[]),
        ("estimate.lua", include_str!("../../../lua/estimate.lua"), &estimate::ARGV, &[]),
        ("ledger_read.lua", include_str!("../../../lua/ledger_read.lua"), &ledger::READ_ARGV, &[]),
        ("ledger_ack.lua", include_str!("../../../lua/ledger_ack.lua"), &ledger::ACK_ARGV, &ledger::ACK_GROUP),
        ("sweep.lua", include_str!("../../../lua/sweep.lua"), &sweep::SWEEP_ARGV, &[]),
        ("sweep_note.lua", include_str!("../../../lua/sweep_note.lua"), &sweep::NOTE_ARGV, &sweep::NOTE_GROUP),
        ("sweep_take.lua", include_str!("../../../lua/sweep_take.lua"), &sweep::TAKE_ARGV, &[]),
        ("sweep_done.lua", include_str!("../../../lua/sweep_done.lua"), &sweep::DONE_ARGV, &[]),
        ("budget_get.lua", include_str!("../../../lua/budget_get.lua"), &budget::GET_ARGV, &reserve::SCOPE_ARGV),
        ("budget_adjust.lua", include_str!("../../../lua/budget_adjust.lua"), &budget::ADJUST_ARGV, &[]),
    ];

    /// The header: the comment lines before the first line of code.
    fn header(source: &str) -> Vec<&str> {
        source.lines().take_while(|l| l.starts_with("--") || l.trim().is_empty()).collect()
    }

    /// Each `ARGV[n]` the header names with its description: the text after it, up to the next
    /// `ARGV[` on the line or the line's end. `ARGV[2..]` (a repeated tail) is not a position.
    fn positions(header: &[&str]) -> Vec<(usize, String)> {
        let mut found = Vec::new();
        for line in header {
            let mut rest = *line;
            let mut first = true;
            while let Some(at) = rest.find("ARGV[") {
                // A position is declared first on its line or after a column gap; elsewhere,
                // `ARGV[n]` is a mention inside another entry's description.
                let declared =
                    (first && rest[..at].trim_start_matches('-').trim().is_empty()) || rest[..at].ends_with("  ");
                first = false;
                let after = &rest[at + 5..];
                let Some(close) = after.find(']') else { break };
                let next = after[close + 1..].find("ARGV[").map_or(after.len(), |n| n + close + 1);
                if let (true, Ok(n)) = (declared, after[..close].parse::<usize>()) {
                    found.push((n, after[close + 1..next].trim().to_string()));
                }
                rest = &after[close + 1..];
            }
        }
        found
    }

    /// The fields of the first `{…}` after `Reply:` in a script's header, its parenthesised
    /// notes left out.
    fn reply_fields(source: &str) -> Vec<String> {
        let text = header(source).iter().map(|l| l.trim_start_matches('-')).collect::<Vec<_>>().join(" ");
        let reply = text.split_once("Reply: {").map(|(_, rest)| rest).unwrap_or_default();
        let (mut depth, mut field, mut fields) = (0_u32, String::new(), Vec::new());
        for c in reply.chars() {
            match c {
                '(' => depth = depth.saturating_add(1),
                ')' => depth = depth.saturating_sub(1),
                ',' | '}' if depth == 0 => {
                    fields.push(field.split_whitespace().collect::<Vec<_>>().join(" "));
                    field.clear();
                    if c == '}' {
                        break;
                    }
                }
                _ if depth == 0 => field.push(c),
                _ => {}
            }
        }
        fields
    }

    #[test]
    fn a_commit_reply_has_the_fields_commit_lua_names() {
        let fields = reply_fields(include_str!("../../../lua/commit.lua"));
        assert_eq!(fields.len(), settle::COMMIT_REPLY_FIELDS, "{fields:?}");
        assert_eq!(fields.first().map(String::as_str), Some("state"));
        assert_eq!(fields.last().map(String::as_str), Some("ending"));
    }

    #[test]
    fn a_pools_provider_limits_go_as_a_scopes() {
        assert_eq!(pool::PROVIDER_ARGV[5..], reserve::SCOPE_ARGV);
    }

    #[test]
    fn every_argument_name_is_the_one_its_script_header_gives_its_position() {
        for (file, source, names, group) in CODECS {
            let header = header(source);
            let positions = positions(&header);
            let numbers: Vec<usize> = positions.iter().map(|(n, _)| *n).collect();
            assert_eq!(numbers, (1..=names.len()).collect::<Vec<_>>(), "{file}: the header's ARGV positions");
            for ((n, description), name) in positions.iter().zip(names.iter()) {
                assert!(
                    description.starts_with(name),
                    "{file}: ARGV[{n}] is {description:?} in the header, but the codec pushes {name:?} there"
                );
            }
            // A repeated group is listed after the fixed part, its names in order.
            let text = header.join(" ").replace("--", " ");
            let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
            let mut from = text.rfind(&format!("ARGV[{}]", names.len())).unwrap_or(0);
            for name in group {
                match text[from..].find(name) {
                    Some(at) => from += at + name.len(),
                    None => panic!("{file}: the repeated argument {name:?} is not in the header, in order"),
                }
            }
        }
    }

    #[test]
    fn the_lists_a_reply_ends_with_are_read_by_their_count() {
        let script = Script::new("reserve", String::new());
        let text = |s: &str| Reply::Text(s.to_string());
        let reply = Reply::Array(vec![Reply::Int(0), Reply::Int(2), Reply::Int(-1), text("7"), text("a"), text("b")]);
        let r = Fields::of(&script, &reply).unwrap();
        assert_eq!(r.lists(1).unwrap(), (vec![None, Some(7)], vec!["a".to_string(), "b".to_string()]));
        // A count past the reply's end, or a negative one, is a bad reply, not a short list.
        let short = Reply::Array(vec![Reply::Int(0), Reply::Int(3), Reply::Int(1)]);
        assert!(matches!(Fields::of(&script, &short).unwrap().lists(1), Err(StoreError::BadReply { .. })));
        let negative = Reply::Array(vec![Reply::Int(0), Reply::Int(-1)]);
        assert!(matches!(Fields::of(&script, &negative).unwrap().lists(1), Err(StoreError::BadReply { .. })));
        // Nothing past the count: no budgets, nothing swept.
        let bare = Reply::Array(vec![Reply::Int(0), Reply::Int(0)]);
        assert_eq!(Fields::of(&script, &bare).unwrap().lists(1).unwrap(), (vec![], vec![]));
    }

    #[test]
    #[should_panic(expected = "ARGV[2] is not")]
    fn a_push_under_another_name_fails() {
        let mut argv = Argv::new("reserve", &reserve::ARGV, 0);
        argv.push("reservation id", String::new());
        argv.push("prompt tokens", String::new());
    }
}
