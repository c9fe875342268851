//! How a response ended decides how its hold is settled, and how the hold says its request
//! ended: the rules ext_proc follows once the response is over (or cut short), in one place, with
//! no I/O.
//!
//! | the response | settled as | ending |
//! |---|---|---|
//! | 2xx, complete | committed: its reported usage, else metered | `completed`, `metered`, `metered_capped` or `as_held` |
//! | 2xx, cut short mid-stream (the client went away, Envoy reset the stream) | committed: what was generated so far | `client_left`, or `metered_capped` when held to the request's ceiling |
//! | cut short before any response | committed: the prompt held, no output (the backend read the prompt) | `client_left` |
//! | 429 or 5xx before any output | released: nothing was generated (a 429 also throttles the pool) | `upstream_refused` (429), `upstream_error` (5xx) |
//! | 429 or 5xx after output | committed: what was generated | the same |
//! | other 4xx (or 3xx) | committed with the usage it reports, else released | `upstream_refused` |

use super::usage::{Measured, Meter};
use crate::hold::Ending;

/// How a response's stream stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The response's last byte (or its trailers) arrived.
    Complete,
    /// The stream stopped first: the client went away, or Envoy reset it.
    CutShort,
}

/// What becomes of a hold whose response has ended, and how its request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Charge it with these counts.
    Commit(Measured, Ending),
    /// Give it back: the backend generated nothing.
    Release(Ending),
}

/// The verdict on a hold whose response came back with `status` (none: no response headers came),
/// was read by `meter` (none: no response at all) and stopped as `stop` says.
pub fn verdict(status: Option<u16>, meter: Option<&mut Meter>, stop: Stop) -> Verdict {
    let Some(meter) = meter else {
        // Cut short before any response: the request reached the backend, which read its
        // prompt and generated nothing the client saw; the prompt held is charged.
        return Verdict::Commit(Measured::Metered { output: 0 }, Ending::ClientLeft);
    };
    let saw_output = meter.saw_output();
    let measured = meter.measured();
    let status = status.unwrap_or(0);
    let ending = match status {
        500..=599 => Ending::UpstreamError,
        // Held to the request's own ceiling: what the record must say, whether the client stayed
        // to the end or not (the charge is the ceiling, not what passed).
        200..=299 if meter.capped() => Ending::MeteredCapped,
        200..=299 if stop == Stop::CutShort => Ending::ClientLeft,
        200..=299 => Ending::of(measured),
        // Any other answer (a 4xx, a redirect) is the backend's refusal.
        _ => Ending::UpstreamRefused,
    };
    let charge = match (status, measured) {
        (200..=299, _) => true,
        (429 | 500..=599, _) => saw_output,
        (_, Measured::Exact { .. }) => true,
        _ => false,
    };
    if charge { Verdict::Commit(measured, ending) } else { Verdict::Release(ending) }
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
        use Stop::{Complete, CutShort};
        let exact = Measured::exact(12, 7);
        let json = |body| meter("application/json", body);
        assert_eq!(verdict(Some(200), Some(&mut json(USAGE)), Complete), Verdict::Commit(exact, Ending::Completed));
        assert!(
            matches!(verdict(Some(200), Some(&mut meter("text/event-stream", STREAMED)), Complete), Verdict::Commit(Measured::Metered { output }, Ending::Metered) if output > 0),
            "2xx without usage: metered"
        );
        assert!(
            matches!(
                verdict(Some(200), Some(&mut meter("text/event-stream", STREAMED)), CutShort),
                Verdict::Commit(Measured::Metered { .. }, Ending::ClientLeft)
            ),
            "2xx cut short: what passed"
        );
        // Metered past the request's ceiling: held to it, and the ending says so.
        let mut capped = meter("text/event-stream", STREAMED);
        capped.cap_output(1);
        assert_eq!(
            verdict(Some(200), Some(&mut capped), Complete),
            Verdict::Commit(Measured::Metered { output: 1 }, Ending::MeteredCapped)
        );
        // Cut short past it too: charged the ceiling, and the ending says that rather than that
        // the client left.
        let mut cut = meter("text/event-stream", STREAMED);
        cut.cap_output(1);
        assert_eq!(
            verdict(Some(200), Some(&mut cut), CutShort),
            Verdict::Commit(Measured::Metered { output: 1 }, Ending::MeteredCapped)
        );
        let gzip = &mut Meter::new(Some("application/json"), Some("gzip"), 4.0);
        assert_eq!(verdict(Some(200), Some(gzip), Complete), Verdict::Commit(Measured::AsHeld, Ending::AsHeld));
        for (status, ending) in
            [(429, Ending::UpstreamRefused), (500, Ending::UpstreamError), (503, Ending::UpstreamError)]
        {
            assert_eq!(
                verdict(Some(status), Some(&mut json("")), Complete),
                Verdict::Release(ending),
                "{status}, nothing"
            );
            assert!(
                matches!(verdict(Some(status), Some(&mut meter("text/event-stream", STREAMED)), CutShort), Verdict::Commit(_, e) if e == ending),
                "{status} after output"
            );
        }
        assert_eq!(
            verdict(Some(400), Some(&mut json(USAGE)), Complete),
            Verdict::Commit(exact, Ending::UpstreamRefused),
            "4xx that reports usage"
        );
        assert_eq!(
            verdict(Some(404), Some(&mut json("{}")), Complete),
            Verdict::Release(Ending::UpstreamRefused),
            "4xx without"
        );
        assert_eq!(verdict(Some(302), Some(&mut json("{}")), Complete), Verdict::Release(Ending::UpstreamRefused));
        assert_eq!(
            verdict(None, None, CutShort),
            Verdict::Commit(Measured::Metered { output: 0 }, Ending::ClientLeft),
            "no response: the prompt"
        );
    }
}
