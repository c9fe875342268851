//! Sorted sets, the lease indexes: the set itself, and ZRANGE (WITHSCORES) and ZRANGEBYSCORE
//! (LIMIT).

use std::collections::{BTreeSet, HashMap};

use super::{CmdResult, Keyspace, Resp, Score, bound_arg, format_number, int_arg};

#[derive(Debug, Default)]
pub(super) struct ZSet {
    pub(super) by_score: BTreeSet<(Score, Vec<u8>)>,
    pub(super) scores: HashMap<Vec<u8>, Score>,
}

impl ZSet {
    pub(super) fn add(&mut self, score: f64, member: Vec<u8>) -> i64 {
        let added = match self.scores.insert(member.clone(), Score(score)) {
            Some(old) => {
                self.by_score.remove(&(old, member.clone()));
                0
            }
            None => 1,
        };
        self.by_score.insert((Score(score), member));
        added
    }

    pub(super) fn remove(&mut self, member: &[u8]) -> bool {
        match self.scores.remove(member) {
            Some(score) => self.by_score.remove(&(score, member.to_vec())),
            None => false,
        }
    }
}

impl Keyspace {
    pub(super) fn zrange(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        let with_scores = match a.len() {
            3 => false,
            4 if a[3].eq_ignore_ascii_case(b"WITHSCORES") => true,
            _ => return Err("ERR syntax error (embedded ZRANGE takes only WITHSCORES)".into()),
        };
        let (start, stop) = (int_arg(&a[1])?, int_arg(&a[2])?);
        let Some(z) = self.zset(now, &a[0])? else { return Ok(Resp::Array(vec![])) };
        let len = z.by_score.len() as i64;
        let norm = |i: i64| if i < 0 { (len + i).max(0) } else { i };
        let (start, stop) = (norm(start), norm(stop).min(len - 1));
        let mut out = Vec::new();
        if start <= stop {
            let skip = usize::try_from(start).unwrap_or(usize::MAX);
            let take = usize::try_from(stop - start + 1).unwrap_or(0);
            for (score, member) in z.by_score.iter().skip(skip).take(take) {
                push_member(&mut out, score, member, with_scores);
            }
        }
        Ok(Resp::Array(out))
    }

    pub(super) fn zrangebyscore(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        let (offset, count) = match a.len() {
            3 => (0, usize::MAX),
            6 if a[3].eq_ignore_ascii_case(b"LIMIT") => {
                let count = int_arg(&a[5])?;
                let offset = usize::try_from(int_arg(&a[4])?.max(0)).unwrap_or(usize::MAX);
                (offset, usize::try_from(count).unwrap_or(usize::MAX))
            }
            _ => return Err("ERR syntax error (embedded ZRANGEBYSCORE takes only LIMIT)".into()),
        };
        let (min, max) = (bound_arg(&a[1])?, bound_arg(&a[2])?);
        let Some(z) = self.zset(now, &a[0])? else { return Ok(Resp::Array(vec![])) };
        let mut out = Vec::new();
        for (score, member) in z.by_score.iter().filter(|(s, _)| s.0 >= min && s.0 <= max).skip(offset).take(count) {
            push_member(&mut out, score, member, false);
        }
        Ok(Resp::Array(out))
    }
}

fn push_member(out: &mut Vec<Resp>, score: &Score, member: &[u8], with_scores: bool) {
    out.push(Resp::Bulk(member.to_vec()));
    if with_scores {
        out.push(Resp::Bulk(format_number(score.0).into_bytes()));
    }
}
