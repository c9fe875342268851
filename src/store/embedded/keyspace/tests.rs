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
