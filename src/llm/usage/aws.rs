//! Amazon's event stream (`application/vnd.amazon.eventstream`), the framing of Bedrock's
//! ConverseStream and InvokeModelWithResponseStream: each message is a 12-byte prelude (total
//! length, headers length, the prelude's CRC, all big-endian), typed headers, a payload, and the
//! message's CRC. tollgate only reads: the CRCs are the client's to check.
//!
//! The payload is JSON: a ConverseStream event itself, or (`:event-type` `chunk`) a model's own
//! stream event, base64-encoded in `bytes`.

use base64::Engine;
use serde_json::Value;

/// The shortest message: a prelude and a message CRC, no headers, no payload.
const MIN_MESSAGE: usize = 16;

/// One message of an event stream, or why the bytes are not one.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// More bytes are needed.
    Incomplete,
    /// The bytes are not an event stream (a length out of bounds): stop reading it.
    Broken,
    /// A message `len` bytes long; its JSON event, if it is an event carrying one.
    Message { len: usize, event: Option<Value> },
}

/// Reads the message at the start of `bytes`, at most `max` bytes long.
pub fn next(bytes: &[u8], max: usize) -> Frame {
    let (Some(total), Some(headers_len)) = (be32(bytes, 0), be32(bytes, 4)) else { return Frame::Incomplete };
    let headers_end = headers_len.saturating_add(12);
    if total < MIN_MESSAGE || total > max || headers_end > total - 4 {
        return Frame::Broken;
    }
    if bytes.len() < total {
        return Frame::Incomplete;
    }
    let headers = read_headers(&bytes[12..headers_end]);
    let payload = &bytes[headers_end..total - 4];
    let event = match (headers.message_type.as_deref(), headers.event_type.as_deref()) {
        (Some("event") | None, Some("chunk")) => serde_json::from_slice::<Value>(payload)
            .ok()
            .and_then(|v| v["bytes"].as_str().and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok()))
            .and_then(|inner| serde_json::from_slice(&inner).ok()),
        (Some("event") | None, _) => serde_json::from_slice(payload).ok(),
        // An exception: an error message, not output.
        _ => None,
    };
    Frame::Message { len: total, event }
}

#[derive(Debug, Default)]
struct Headers {
    message_type: Option<String>,
    event_type: Option<String>,
}

/// The two string headers read; a header of a type that is not understood ends the reading.
fn read_headers(mut b: &[u8]) -> Headers {
    let mut out = Headers::default();
    while let Some((&name_len, rest)) = b.split_first() {
        let name_len = usize::from(name_len);
        let Some((name, rest)) = rest.split_at_checked(name_len) else { break };
        let Some((&kind, rest)) = rest.split_first() else { break };
        // Value sizes by type: bool true/false 0, byte 1, short 2, int 4, long 8, bytes and
        // string 2 + length, timestamp 8, uuid 16.
        let size = match kind {
            0 | 1 => Some(0),
            2 => Some(1),
            3 => Some(2),
            4 => Some(4),
            5 | 8 => Some(8),
            9 => Some(16),
            6 | 7 => rest.get(..2).map(|l| 2 + usize::from(u16::from_be_bytes([l[0], l[1]]))),
            _ => None,
        };
        let Some(value) = size.and_then(|n| rest.get(..n)) else { break };
        if kind == 7 {
            let text = String::from_utf8_lossy(&value[2..]).into_owned();
            match name {
                b":message-type" => out.message_type = Some(text),
                b":event-type" => out.event_type = Some(text),
                _ => {}
            }
        }
        b = &rest[value.len()..];
    }
    out
}

fn be32(b: &[u8], at: usize) -> Option<usize> {
    let four: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    usize::try_from(u32::from_be_bytes(four)).ok()
}

/// Writes one event message, CRCs and all, as Bedrock sends it: for the stand-in backend and the
/// tests.
pub fn encode(event_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut headers = Vec::new();
    for (name, value) in
        [(":event-type", event_type), (":content-type", "application/json"), (":message-type", "event")]
    {
        headers.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        headers.extend_from_slice(name.as_bytes());
        headers.push(7);
        headers.extend_from_slice(&u16::try_from(value.len()).unwrap_or(u16::MAX).to_be_bytes());
        headers.extend_from_slice(value.as_bytes());
    }
    let total = 12 + headers.len() + payload.len() + 4;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&u32::try_from(total).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&u32::try_from(headers.len()).unwrap_or(u32::MAX).to_be_bytes());
    let prelude_crc = crc32(&out);
    out.extend_from_slice(&prelude_crc.to_be_bytes());
    out.extend_from_slice(&headers);
    out.extend_from_slice(payload);
    let message_crc = crc32(&out);
    out.extend_from_slice(&message_crc.to_be_bytes());
    out
}

/// CRC-32 (IEEE 802.3, reflected, as zlib computes it), bit by bit: encoding is for tests and
/// the stand-in backend, never on the request path.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_zlibs() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn reads_what_it_writes_across_any_split() {
        let message = encode("contentBlockDelta", br#"{"contentBlockIndex":0,"delta":{"text":"Hi"}}"#);
        assert_eq!(
            next(&message, 1 << 20),
            Frame::Message {
                len: message.len(),
                event: Some(serde_json::json!({"contentBlockIndex":0,"delta":{"text":"Hi"}}))
            }
        );
        for cut in 0..message.len() {
            assert_eq!(next(&message[..cut], 1 << 20), Frame::Incomplete, "cut at {cut}");
        }
    }

    #[test]
    fn a_chunk_carries_its_model_event_in_base64() {
        let inner = br#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"Hi"}}"#;
        let payload = serde_json::json!({"bytes": base64::engine::general_purpose::STANDARD.encode(inner)}).to_string();
        let message = encode("chunk", payload.as_bytes());
        let Frame::Message { event: Some(v), .. } = next(&message, 1 << 20) else { panic!("not read") };
        assert_eq!(v["delta"]["text"], "Hi");
    }

    #[test]
    fn lengths_out_of_bounds_are_broken_not_waited_for() {
        assert_eq!(next(&[0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0], 1 << 20), Frame::Broken);
        assert_eq!(next(&[0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 1 << 20), Frame::Broken, "over the maximum");
        assert_eq!(next(&[0, 0, 0, 20, 0, 0, 0, 9, 0, 0, 0, 0], 1 << 20), Frame::Broken, "headers past the payload");
    }
}
