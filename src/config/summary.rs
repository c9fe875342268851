//! What a policy enforces, in a few lines: `tollgate check-config`'s answer.

use super::budget::Measure;
use super::{Limits, Money, Policy, StoreChoice};

impl Policy {
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
        let store = match &self.store.choice {
            StoreChoice::Embedded => {
                format!("embedded (single replica), capped at {} MB", self.store.max_memory_bytes >> 20)
            }
            StoreChoice::Redis { url } => format!("redis {url}{guarded}"),
            StoreChoice::Cluster { nodes } => format!("redis cluster {}{guarded}", nodes.join(",")),
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
        if let Some(l) = &self.leasing {
            out.push_str(&format!(
                "  leasing: window {} ms, slices up to {:.0}% of a scope\n",
                l.window_ms,
                l.max_share * 100.0
            ));
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
