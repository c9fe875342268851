//! The time zone a tenant's budgets turn in: UTC, a fixed offset, or an IANA zone (from the
//! time zone database built into the binary, so a container without `/usr/share/zoneinfo` has it).
//!
//! The scripts take the zone as its offset from UTC at the moment of the call, in minutes: a
//! day, week or month is the one the local clock is in, numbered from 1970-01-01 local. Across a
//! daylight-saving change the local date goes on where it was (only the hour is skipped or
//! repeated), so a day's count is never split or merged.

use jiff::Timestamp;
use jiff::tz::{Offset, TimeZone};

/// A tenant's time zone.
#[derive(Debug, Clone)]
pub struct Zone {
    /// As the policy wrote it (`UTC` when it did not).
    name: String,
    tz: TimeZone,
}

impl Zone {
    pub fn utc() -> Zone {
        Zone { name: "UTC".to_string(), tz: TimeZone::UTC }
    }

    /// From the policy's `time_zone`: an IANA name (`Europe/Berlin`), `UTC`, or a fixed offset
    /// `+HH:MM` / `-HH:MM` (at most 14 hours either way).
    pub fn parse(text: &str) -> Result<Zone, String> {
        let fixed = |sign: i32, rest: &str| -> Option<Offset> {
            let (h, m) = rest.split_once(':')?;
            let (h, m): (i32, i32) = (h.parse().ok()?, m.parse().ok()?);
            let ok = rest.len() == 5 && (0..=14).contains(&h) && (0..60).contains(&m) && h * 60 + m <= 14 * 60;
            ok.then(|| Offset::from_seconds(sign * (h * 3600 + m * 60)).ok()).flatten()
        };
        let tz = match text.as_bytes().first() {
            Some(b'+') => fixed(1, &text[1..]).map(TimeZone::fixed),
            Some(b'-') => fixed(-1, &text[1..]).map(TimeZone::fixed),
            _ if text == "UTC" => Some(TimeZone::UTC),
            _ => TimeZone::get(text).ok(),
        };
        match tz {
            Some(tz) => Ok(Zone { name: text.to_string(), tz }),
            None => Err(format!(
                "{text:?} is neither a time zone the database knows (as Europe/Berlin) nor an offset as +09:00 or -05:30"
            )),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the zone is UTC all year (what leasing's local periods assume).
    pub fn is_utc(&self) -> bool {
        self.tz.to_fixed_offset().is_ok_and(|o| o == Offset::UTC)
    }

    /// Its offset from UTC at `unix_ms`, in minutes (east positive).
    pub fn offset_minutes_at(&self, unix_ms: u64) -> i32 {
        let at = i64::try_from(unix_ms).ok().and_then(|ms| Timestamp::from_millisecond(ms).ok());
        at.map_or(0, |t| self.tz.to_offset(t).seconds() / 60)
    }

    /// A budget's wait to its period's turn, as a script counted it with the zone's offset at
    /// `now_ms` (`offset_now`), moved by the daylight-saving change between now and then: a local
    /// midnight after the clocks went forward comes an hour sooner.
    pub fn wait_to_turn(&self, offset_now: i32, now_ms: u64, wait_ms: u64) -> u64 {
        let offset_then = self.offset_minutes_at(now_ms.saturating_add(wait_ms));
        let moved = i64::from(offset_now).saturating_sub(i64::from(offset_then)).saturating_mul(60_000);
        u64::try_from(i64::try_from(wait_ms).unwrap_or(i64::MAX).saturating_add(moved)).unwrap_or(0).max(1)
    }
}

impl PartialEq for Zone {
    fn eq(&self, other: &Zone) -> bool {
        self.name == other.name
    }
}

impl Default for Zone {
    fn default() -> Zone {
        Zone::utc()
    }
}

#[cfg(test)]
mod tests {
    use super::Zone;

    #[test]
    fn zones_by_name_and_by_offset() {
        // 2026-07-01T00:00:00Z and 2026-12-01T00:00:00Z.
        let (july, december) = (1_782_864_000_000, 1_796_083_200_000);
        let berlin = Zone::parse("Europe/Berlin").unwrap();
        assert_eq!((berlin.offset_minutes_at(july), berlin.offset_minutes_at(december)), (120, 60));
        let new_york = Zone::parse("America/New_York").unwrap();
        assert_eq!((new_york.offset_minutes_at(july), new_york.offset_minutes_at(december)), (-240, -300));
        assert_eq!(Zone::parse("+09:00").unwrap().offset_minutes_at(july), 540);
        assert_eq!(Zone::parse("-05:30").unwrap().offset_minutes_at(july), -330);
        assert!(Zone::parse("UTC").unwrap().is_utc() && Zone::parse("+00:00").unwrap().is_utc());
        assert!(!berlin.is_utc());
    }

    #[test]
    fn a_turn_after_the_clocks_change_moves_with_them() {
        const HOUR: u64 = 3_600_000;
        let new_york = Zone::parse("America/New_York").unwrap();
        // 2026-03-08 01:00 EST (06:00 UTC); the clocks go forward at 02:00. Counted at -05:00,
        // local midnight is 23 hours away; it comes at 04:00 UTC, 22 hours on.
        let now = 1_772_949_600_000;
        assert_eq!(new_york.offset_minutes_at(now), -300);
        assert_eq!(new_york.wait_to_turn(-300, now, 23 * HOUR), 22 * HOUR);
        // With no change between (an hour later, on EDT), the wait stands.
        assert_eq!(new_york.wait_to_turn(-240, now + 2 * HOUR, 20 * HOUR), 20 * HOUR);
        assert_eq!(Zone::utc().wait_to_turn(0, now, 5), 5);
        for bad in ["Mars/Olympus", "+9", "+15:00", "+09:60", "09:00", ""] {
            assert!(Zone::parse(bad).is_err(), "{bad}");
        }
    }
}
