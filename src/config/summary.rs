//! What a policy enforces, in a few lines: `tollgate check-config`'s answer.

use super::budget::Measure;
use super::{Limits, Money, Policy, StoreChoice};

impl Policy {
    /// The store, as a log line or `check-config` may show it: a password in a Redis URL is
    /// replaced by `***`.
    pub fn store_address(&self) -> String {
        match &self.store.choice {
            StoreChoice::Embedded => "embedded".to_string(),
            StoreChoice::Redis { url } => format!("redis {}", without_password(url)),
            StoreChoice::Cluster { nodes } => {
                let nodes: Vec<_> = nodes.iter().map(|n| without_password(n)).collect();
                format!("redis cluster {}", nodes.join(","))
            }
        }
    }

    /// What every tenant, plan and the default tenant do when the store cannot be reached, each
    /// mode once, comma-separated (`none` for a policy with no tenant at all).
    pub fn store_down_modes(&self) -> String {
        let mut modes: Vec<_> = self
            .tenants
            .values()
            .chain(self.plans.values())
            .chain(self.default_tenant.iter())
            .map(|t| t.on_store_error.as_str())
            .collect();
        modes.sort_unstable();
        modes.dedup();
        if modes.is_empty() { "none".to_string() } else { modes.join(",") }
    }

    /// Leasing as one phrase: `off`, or its window and share.
    pub fn leasing_terms(&self) -> String {
        match &self.leasing {
            None => "off".to_string(),
            Some(l) => format!("window {} ms, slices up to {:.0}% of a scope", l.window_ms, l.max_share * 100.0),
        }
    }

    /// A few lines saying what the policy enforces, for `check-config`.
    pub fn summary(&self) -> String {
        let b = &self.store.breaker;
        let guarded = format!(
            "; calls time out after {} ms; {} failures in a row stop them for {}-{} ms",
            self.store.command_timeout.as_millis(),
            b.failures,
            b.open.as_millis(),
            b.max_open.as_millis()
        );
        let batched = match self.commit_window() {
            None => String::new(),
            Some(w) => format!(
                "; commits from responses batched by tenant over {} ms ({} ms where they free what the tenant is short of)",
                w.as_millis(),
                w.min(super::SHORT_COMMIT_WINDOW).as_millis()
            ),
        };
        let store = match &self.store.choice {
            StoreChoice::Embedded => {
                format!("embedded (single replica), capped at {} MB{batched}", self.store.max_memory_bytes >> 20)
            }
            _ => format!("{}{guarded}{batched}", self.store_address()),
        };
        let mut names: Vec<_> = self.tenants.keys().cloned().collect();
        names.sort();
        let mut models: Vec<_> = self.models.keys().cloned().collect();
        models.sort();
        let mut out = format!(
            "policy OK (version {})\n  listen: {}{}\n  store: {store}\n  models: {} ({})\n  tenants: {} ({})\n  default tenant: {}\n",
            self.version,
            self.server.listen,
            self.server.tls.as_ref().map_or_else(|| " (plaintext)".to_string(), |t| format!(", {}", t.describe())),
            models.len(),
            models.join(", "),
            names.len(),
            names.join(", "),
            if self.default_tenant.is_some() { "yes" } else { "no (unknown tenants are refused)" },
        );
        if !self.plans.is_empty() {
            let mut plans: Vec<_> = self.plans.keys().cloned().collect();
            plans.sort();
            let chosen = match &self.server.plan_header {
                Some(h) => format!("; an unlisted tenant takes the one {h} names"),
                None => String::new(),
            };
            out.push_str(&format!(
                "  plans: {} ({}){chosen}
",
                plans.len(),
                plans.join(", ")
            ));
        }
        if let Some(admin) = self.server.admin_listen {
            let labelled = match &self.metrics.tenants {
                Some(t) => format!("{} listed tenant(s)", t.len()),
                None => "every tenant named here".to_string(),
            };
            out.push_str(&format!(
                "  metrics: http://{admin}/metrics; series of their own for {labelled}, the rest as other\n"
            ));
        }
        if self.leasing.is_some() {
            out.push_str(&format!("  leasing: {}\n", self.leasing_terms()));
        }
        if let Some(l) = &self.ledger {
            let kept = match &l.file {
                Some(file) => format!("also appended to {}", file.display()),
                None => "read with `tollgate ledger`".to_string(),
            };
            out.push_str(&format!(
                "  ledger: every settled hold, per tenant up to ~{} entries for {} ms; {kept}\n",
                l.terms.max_len, l.terms.retention_ms
            ));
        }
        for name in &names {
            let t = &self.tenants[name];
            out.push_str(&format!(
                "  tenant {name}: {}{}{}; lease {} ms; expired usage {:?}; store down: {}; {} user(s), {} model override(s)\n",
                t.limits.describe(),
                if t.zone.is_utc() { String::new() } else { format!(" (periods in {})", t.zone.name()) },
                if t.shadow { " (shadow: measured, not enforced)" } else { "" },
                t.lease_ttl_ms,
                t.expired_usage,
                t.on_store_error.as_str(),
                t.users.len(),
                t.models.len()
            ));
        }
        out
    }
}

impl Limits {
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.tokens_per_minute {
            parts.push(format!("{n} tokens/min (burst {})", self.burst_tokens.unwrap_or(n)));
        }
        if let Some(n) = self.requests_per_minute {
            parts.push(format!("{n} requests/min"));
        }
        if let Some(n) = self.max_concurrency {
            parts.push(format!("{n} concurrent"));
        }
        if let Some(n) = self.input_tokens_per_minute {
            parts.push(format!("{n} input tokens/min"));
        }
        if let Some(n) = self.output_tokens_per_minute {
            parts.push(format!("{n} output tokens/min"));
        }
        for (key, limit) in self.budgets() {
            let period = key.period.as_str();
            parts.push(match key.measure {
                Measure::Cost => format!("{} a {period}", Money(limit)),
                Measure::Tokens => format!("{limit} tokens/{period}"),
                Measure::Input => format!("{limit} input tokens/{period}"),
                Measure::Output => format!("{limit} output tokens/{period}"),
            });
        }
        if parts.is_empty() { "no limits".into() } else { parts.join(", ") }
    }
}

/// A Redis URL (or `host:port`) with the password in its user info, if any, replaced by `***`:
/// what a log line, an error or `check-config` may show of it.
pub fn without_password(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").map_or(("", url), |(s, r)| (s, r));
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    let hidden = match rest[..at].split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_string(),
    };
    let scheme = if scheme.is_empty() { String::new() } else { format!("{scheme}://") };
    format!("{scheme}{hidden}@{}", &rest[at + 1..])
}

#[cfg(test)]
mod tests {
    use super::without_password;

    #[test]
    fn a_password_never_reaches_the_log() {
        assert_eq!(without_password("redis://127.0.0.1:6379/0"), "redis://127.0.0.1:6379/0");
        assert_eq!(without_password("redis://:s3cret@redis:6379"), "redis://:***@redis:6379");
        assert_eq!(without_password("rediss://app:s3cret@redis:6380/1"), "rediss://app:***@redis:6380/1");
        assert_eq!(without_password("redis://s3cret@redis"), "redis://***@redis");
        assert_eq!(without_password("10.0.0.1:7000"), "10.0.0.1:7000");
    }
}
