//! How a response ended decides how its hold is settled: the rules ext_proc follows once the
//! response is over (or cut short), in one place, with no I/O.
//!
//! | the response | settled as |
//! |---|---|
//! | 2xx | committed: its reported usage, else metered |
//! | 429 or 5xx before any output | released: nothing was generated (a 429 also throttles the pool) |
//! | 429 or 5xx after output | committed: what was generated |
//! | other 4xx | committed with the usage it reports, else released |
//! | cut short mid-stream (the client went away, Envoy reset the stream) | committed: what was generated so far |
//! | cut short before any response | committed: the prompt held, no output (the backend read the prompt) |

use super::usage::{Measured, Meter};

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The response's last byte (or its trailers) arrived.
    Complete,
    /// The stream stopped first: the client went away, or Envoy reset it.
    CutShort,
}

/// What becomes of a hold whose response has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Charge it with these counts.
    Commit(Measured),
    /// Give it back: the backend generated nothing.
    Release,
}

/// The verdict on a hold whose response came back with `status` (none: no response headers came)
/// and was read by `meter` (none: no response at all).
pub fn verdict(status: Option<u16>, meter: Option<&mut Meter>) -> Verdict {
    let Some(meter) = meter else {
        // Cut short before any response: the request reached the backend, which read its
        // prompt and generated nothing the client saw; the prompt held is charged.
        return Verdict::Commit(Measured::Metered { output: 0 });
    };
    let saw_output = meter.saw_output();
    let measured = meter.measured();
    let charge = match (status.unwrap_or(0), measured) {
        (200..=299, _) => true,
        (429 | 500..=599, _) => saw_output,
        (_, Measured::Exact { .. }) => true,
        _ => false,
    };
    if charge { Verdict::Commit(measured) } else { Verdict::Release }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meter(content_type: &str, body: &str) -> Meter {
        let mut m = Meter::new(Some(content_type), None, 4.0);
        m.feed(body.as_bytes());
        m
    }

    const USAGE: &str = r#"{"usage":{"prompt_tokens":12,"completion_tokens":7}}"#;
    const STREAMED: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"tok tok tok tok \"}}]}\n\n";

    #[test]
    fn each_row_of_the_table() {
        let exact = Verdict::Commit(Measured::exact(12, 7));
        assert_eq!(verdict(Some(200), Some(&mut meter("application/json", USAGE))), exact, "2xx, reported");
        assert!(
            matches!(verdict(Some(200), Some(&mut meter("text/event-stream", STREAMED))), Verdict::Commit(Measured::Metered { output }) if output > 0),
            "2xx without usage: metered"
        );
        for status in [429, 500, 503] {
            assert_eq!(
                verdict(Some(status), Some(&mut meter("application/json", ""))),
                Verdict::Release,
                "{status}, nothing"
            );
            assert!(
                matches!(verdict(Some(status), Some(&mut meter("text/event-stream", STREAMED))), Verdict::Commit(_)),
                "{status} after output"
            );
        }
        assert_eq!(verdict(Some(400), Some(&mut meter("application/json", USAGE))), exact, "4xx that reports usage");
        assert_eq!(verdict(Some(404), Some(&mut meter("application/json", "{}"))), Verdict::Release, "4xx without");
        assert_eq!(verdict(None, None), Verdict::Commit(Measured::Metered { output: 0 }), "no response: the prompt");
    }
}
