//! The keyspace against Redis's semantics, command by command.

use super::*;

fn cmd(ks: &mut Keyspace, now: u64, parts: &[&str]) -> CmdResult {
    let args: Vec<Vec<u8>> = parts.iter().map(|p| p.as_bytes().to_vec()).collect();
    ks.command(now, &args)
}

fn bulk(s: &str) -> Resp {
    Resp::Bulk(s.as_bytes().to_vec())
}

#[test]
fn keys_expire_lazily_and_by_purge() {
    let mut ks = Keyspace::default();
    cmd(&mut ks, 0, &["SET", "a", "1", "PX", "100"]).unwrap();
    cmd(&mut ks, 0, &["HSET", "h", "f", "v"]).unwrap();
    cmd(&mut ks, 0, &["PEXPIRE", "h", "50"]).unwrap();
    assert_eq!(cmd(&mut ks, 99, &["GET", "a"]), Ok(bulk("1")));
    assert_eq!(cmd(&mut ks, 100, &["GET", "a"]), Ok(Resp::Nil));
    assert_eq!(ks.len(), 1);
    ks.purge_expired(60, 10);
    assert!(ks.is_empty());
}

#[test]
fn the_expiry_index_is_bounded_by_the_live_keys() {
    let mut ks = Keyspace::default();
    for i in 0..10_000u64 {
        let key = format!("k{}", i % 7);
        cmd(&mut ks, i, &["HSET", &key, "f", "v"]).unwrap();
        cmd(&mut ks, i, &["PEXPIRE", &key, "60000"]).unwrap();
        cmd(&mut ks, i, &["SET", "s", "1", "PX", "60000"]).unwrap();
        if i % 3 == 0 {
            cmd(&mut ks, i, &["DEL", &key]).unwrap();
        }
        assert!(ks.expiry_index_len() <= ks.len(), "cycle {i}: {} > {}", ks.expiry_index_len(), ks.len());
    }
    assert!(ks.len() <= 8);
}

#[test]
fn sorted_set_ranges_follow_redis() {
    let mut ks = Keyspace::default();
    for (s, m) in [("30", "c"), ("10", "a"), ("20", "b")] {
        cmd(&mut ks, 0, &["ZADD", "z", s, m]).unwrap();
    }
    assert_eq!(
        cmd(&mut ks, 0, &["ZRANGEBYSCORE", "z", "-inf", "20", "LIMIT", "0", "1"]),
        Ok(Resp::Array(vec![bulk("a")]))
    );
    assert_eq!(cmd(&mut ks, 0, &["ZRANGE", "z", "0", "0", "WITHSCORES"]), Ok(Resp::Array(vec![bulk("a"), bulk("10")])));
    assert_eq!(cmd(&mut ks, 0, &["ZREM", "z", "a", "b", "c"]), Ok(Resp::Int(3)));
    assert!(ks.is_empty(), "an emptied sorted set is deleted, as in Redis");
}

#[test]
fn wrong_type_and_unknown_commands_are_errors() {
    let mut ks = Keyspace::default();
    cmd(&mut ks, 0, &["SET", "s", "1"]).unwrap();
    assert!(cmd(&mut ks, 0, &["HGET", "s", "f"]).unwrap_err().starts_with("WRONGTYPE"));
    assert!(cmd(&mut ks, 0, &["FLUSHALL"]).is_err());
}

#[test]
fn zscore_reads_a_members_score_or_nil() {
    let mut ks = Keyspace::default();
    cmd(&mut ks, 0, &["ZADD", "z", "1.5", "a"]).unwrap();
    assert_eq!(cmd(&mut ks, 0, &["ZSCORE", "z", "a"]), Ok(bulk("1.5")));
    assert_eq!(cmd(&mut ks, 0, &["ZSCORE", "z", "b"]), Ok(Resp::Nil));
    assert_eq!(cmd(&mut ks, 0, &["ZSCORE", "none", "a"]), Ok(Resp::Nil));
}

/// Every write, overwrite, delete and expiry keeps the count of bytes equal to a recount, and it
/// returns to zero with the last key.
#[test]
fn the_byte_count_follows_every_change_and_returns_to_zero() {
    let mut ks = Keyspace::default();
    ks.evict_only(|k| k.starts_with(b"s:"));
    for i in 0..400u64 {
        let (key, f, v) = (format!("h{}", i % 5), format!("f{}", i % 7), "x".repeat((i % 13) as usize + 1));
        cmd(&mut ks, i, &["HSET", &key, &f, &v, "n", "1"]).unwrap();
        cmd(&mut ks, i, &["HINCRBY", &key, "n", "12345"]).unwrap();
        cmd(&mut ks, i, &["ZADD", &format!("z{}", i % 3), &i.to_string(), &f]).unwrap();
        cmd(&mut ks, i, &["SET", &format!("s:{}", i % 4), &v, "PX", "50"]).unwrap();
        cmd(&mut ks, i, &["XADD", "x", "MAXLEN", "~", "20", "*", "id", &v]).unwrap();
        if i % 3 == 0 {
            cmd(&mut ks, i, &["HDEL", &key, &f, "n"]).unwrap();
            cmd(&mut ks, i, &["ZREM", &format!("z{}", i % 3), &f]).unwrap();
            cmd(&mut ks, i, &["PEXPIRE", &key, "30"]).unwrap();
        }
        if i % 50 == 0 {
            cmd(&mut ks, i, &["XTRIM", "x", "MINID", "~", &i.saturating_sub(5).to_string()]).unwrap();
        }
        ks.purge_expired(i, 2);
        assert_eq!(ks.used(), ks.recount(), "step {i}");
    }
    for key in ["h0", "h1", "h2", "h3", "h4", "z0", "z1", "z2", "x"] {
        cmd(&mut ks, 400, &["DEL", key]).unwrap();
    }
    ks.purge_expired(1_000, 100);
    assert!(ks.is_empty());
    assert_eq!(ks.used(), 0);
}

/// Eviction takes only the keys the test picks, soonest to expire first, and only as many as
/// bring the count under the cap; what it may not take stays, over the cap if need be.
#[test]
fn room_is_made_from_evictable_keys_soonest_to_expire_first() {
    let mut ks = Keyspace::default();
    ks.evict_only(|k| k.starts_with(b"s:"));
    cmd(&mut ks, 0, &["HSET", "live", "f", &"v".repeat(1_000)]).unwrap();
    cmd(&mut ks, 0, &["HSET", "live-with-ttl", "f", "v"]).unwrap();
    cmd(&mut ks, 0, &["PEXPIRE", "live-with-ttl", "10"]).unwrap();
    for (key, ttl) in [("s:3", "300"), ("s:1", "100"), ("s:2", "200")] {
        cmd(&mut ks, 0, &["HSET", key, "f", &"v".repeat(500)]).unwrap();
        cmd(&mut ks, 0, &["PEXPIRE", key, ttl]).unwrap();
    }
    let before = ks.used();
    assert!(ks.make_room(before - 1), "one eviction is room enough");
    assert_eq!(cmd(&mut ks, 0, &["TYPE", "s:1"]), Ok(Resp::Status("none")), "the soonest to expire went first");
    assert_eq!(cmd(&mut ks, 0, &["TYPE", "s:2"]), Ok(Resp::Status("hash")));
    let per_key = before - ks.used();
    assert!(ks.make_room(ks.used() - per_key), "one more");
    assert_eq!(cmd(&mut ks, 0, &["TYPE", "s:2"]), Ok(Resp::Status("none")));
    assert_eq!(cmd(&mut ks, 0, &["TYPE", "s:3"]), Ok(Resp::Status("hash")));
    assert!(!ks.make_room(0), "what may not be evicted is over any cap");
    assert_eq!(ks.len(), 2, "only the unevictable keys are left");
    assert_eq!(ks.used(), ks.recount());
}

#[test]
fn pexpire_conditions_follow_redis() {
    let mut ks = Keyspace::default();
    let ttl = |ks: &mut Keyspace| cmd(ks, 0, &["PTTL", "h"]);
    cmd(&mut ks, 0, &["HSET", "h", "f", "v"]).unwrap();
    // No TTL counts as never expiring: GT and XX leave it so, NX and LT give it one.
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "100", "GT"]), Ok(Resp::Int(0)));
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "100", "XX"]), Ok(Resp::Int(0)));
    assert_eq!(ttl(&mut ks), Ok(Resp::Int(-1)));
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "100", "nx"]), Ok(Resp::Int(1)));
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "500", "NX"]), Ok(Resp::Int(0)));
    // GT only lengthens, LT only shortens.
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "50", "GT"]), Ok(Resp::Int(0)));
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "200", "GT"]), Ok(Resp::Int(1)));
    assert_eq!(ttl(&mut ks), Ok(Resp::Int(200)));
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "300", "LT"]), Ok(Resp::Int(0)));
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "h", "150", "LT"]), Ok(Resp::Int(1)));
    assert_eq!(ttl(&mut ks), Ok(Resp::Int(150)));
    assert_eq!(cmd(&mut ks, 0, &["PEXPIRE", "missing", "100", "NX"]), Ok(Resp::Int(0)));
    assert!(cmd(&mut ks, 0, &["PEXPIRE", "h", "100", "SOON"]).is_err());
}
