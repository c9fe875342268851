//! The embedded store's ledger file: every ledger entry the scripts append is also written to a
//! file as a JSON line, in one write, as the script that settles the hold runs.

use std::borrow::Cow;
use std::io::Write;
use std::path::Path;

use super::LedgerSink;
use crate::hold::ledger::entry_json;

/// Every entry appended to `path` as a JSON line, in one write, as the
/// script that settles the hold runs. A write that fails is logged; the entry stays in the store's
/// stream (and its counters are charged all the same).
pub fn file_sink(path: &Path) -> std::io::Result<LedgerSink> {
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    let shown = path.display().to_string();
    Ok(Box::new(move |_key, id, fields| {
        let fields: Vec<(Cow<'_, str>, Cow<'_, str>)> =
            fields.iter().map(|(f, v)| (String::from_utf8_lossy(f), String::from_utf8_lossy(v))).collect();
        let mut line = entry_json(id, fields.iter().map(|(f, v)| (f.as_ref(), v.as_ref())));
        line.push('\n');
        if let Err(e) = file.write_all(line.as_bytes()) {
            tracing::error!(file = %shown, error = %e, entry = %line.trim_end(), "cannot append to the ledger file");
        }
    }))
}
