//! The policy's sections other than its tenants, each validated on its own: TLS, the ledger,
//! metrics, leasing, backend pools, the store's breaker, adaptive output, prices.

use super::*;

/// `server.tls`: a certificate and its key, and for mutual TLS a client CA with the identities it
/// may vouch for. The files are read when tollgate starts (their contents are checked there).
pub(in crate::config) fn tls(raw: RawTls) -> Result<TlsSettings, Problem> {
    let path = |field: &str, value: Option<String>| match value {
        Some(p) if !p.trim().is_empty() => Ok(PathBuf::from(p)),
        Some(_) => Err(problem(field, "is empty")),
        None => Err(problem(field, "is required with server.tls (a PEM file)")),
    };
    let cert = path("server.tls.cert", raw.cert)?;
    let key = path("server.tls.key", raw.key)?;
    let client_ca = raw.client_ca.map(|ca| path("server.tls.client_ca", Some(ca))).transpose()?;
    for (i, id) in raw.allowed_clients.iter().enumerate() {
        let field = format!("server.tls.allowed_clients[{i}]");
        if id.is_empty() || id.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(problem(field, format!("{id:?} is not a DNS name, a URI or *")));
        }
    }
    match (&client_ca, raw.allowed_clients.is_empty()) {
        (Some(_), true) => Err(problem(
            "server.tls.allowed_clients",
            "name the client identities (DNS or URI SANs) the CA may vouch for, or * for any it signed",
        )),
        (None, false) => Err(problem("server.tls.allowed_clients", "needs server.tls.client_ca to check them against")),
        _ => {
            let reload = match raw.reload_ms.unwrap_or(10_000) {
                0 => None,
                ms @ 100..=86_400_000 => Some(Duration::from_millis(ms)),
                ms => {
                    return Err(problem(
                        "server.tls.reload_ms",
                        format!("{ms} is outside 100..=86400000 (or 0: never)"),
                    ));
                }
            };
            Ok(TlsSettings { cert, key, client_ca, allowed_clients: raw.allowed_clients, reload })
        }
    }
}

/// The `serve` flag that sets a `server.tls` field.
pub(in crate::config) fn tls_flag(field: &str) -> &str {
    match field.split('[').next().unwrap_or(field) {
        "server.tls.cert" => "--tls-cert",
        "server.tls.key" => "--tls-key",
        "server.tls.client_ca" => "--tls-client-ca",
        "server.tls.allowed_clients" => "--tls-allow-client",
        other => other,
    }
}

/// `ledger`: how much each tenant's stream keeps, and on the embedded store the file it is
/// written to. (Leased holds are entered too, by their replica's next lease call.)
pub(super) fn ledger(l: crate::config::raw::RawLedger, store: &StoreChoice) -> Result<LedgerSettings, Problem> {
    let max_len = l.max_len.unwrap_or(1_000_000);
    if !(1..=MAX_LEDGER_LEN).contains(&max_len) {
        return Err(problem("ledger.max_len", format!("{max_len} is outside 1..={MAX_LEDGER_LEN}")));
    }
    let retention_ms = l.retention_ms.unwrap_or(7 * DAY_MS);
    if !(1_000..=366 * DAY_MS).contains(&retention_ms) {
        return Err(problem("ledger.retention_ms", format!("{retention_ms} is outside 1000..={}", 366 * DAY_MS)));
    }
    let file = match (l.file, store) {
        (Some(f), StoreChoice::Embedded) if f.trim().is_empty() => return Err(problem("ledger.file", "is empty")),
        (Some(f), StoreChoice::Embedded) => Some(PathBuf::from(f)),
        (None, StoreChoice::Embedded) => {
            return Err(problem(
                "ledger.file",
                "is required with the embedded store: its ledger is a file of JSON lines, so that a single \
                 replica loses none of it",
            ));
        }
        (Some(_), _) => {
            return Err(problem(
                "ledger.file",
                "is for the embedded store only: on Redis the ledger is a stream per tenant, read with \
                 `tollgate ledger`",
            ));
        }
        (None, _) => None,
    };
    Ok(LedgerSettings { terms: LedgerTerms { max_len, retention_ms }, file })
}

/// `metrics.tenants`: the tenants with series of their own (any valid tenant id, so one under
/// `default_tenant` can be watched too).
pub(super) fn metrics(m: crate::config::raw::RawMetrics) -> Result<MetricsSettings, Problem> {
    if let Some(tenants) = &m.tenants {
        if tenants.len() > MAX_LABELLED_TENANTS {
            return Err(problem(
                "metrics.tenants",
                format!("{} tenants; at most {MAX_LABELLED_TENANTS} may have series of their own", tenants.len()),
            ));
        }
        for (i, t) in tenants.iter().enumerate() {
            ids::check_tenant(t).map_err(|e| problem(format!("metrics.tenants[{i}]"), format!("tenant id {e}")))?;
        }
    }
    let unlisted_tenants = match m.unlisted_tenants {
        None => 0,
        Some(n) if n <= MAX_LABELLED_TENANTS as u64 => usize::try_from(n).unwrap_or(MAX_LABELLED_TENANTS),
        Some(n) => {
            return Err(problem(
                "metrics.unlisted_tenants",
                format!("{n}; at most {MAX_LABELLED_TENANTS} tenants may have series of their own"),
            ));
        }
    };
    let budget_poll = match m.budget_poll_ms.unwrap_or(30_000) {
        0 => None,
        ms @ 100..=3_600_000 => Some(std::time::Duration::from_millis(ms)),
        ms => return Err(problem("metrics.budget_poll_ms", format!("{ms} is outside 100..=3600000 (0: off)"))),
    };
    Ok(MetricsSettings { tenants: m.tenants, unlisted_tenants, budget_poll })
}

pub(super) fn leasing(l: crate::config::raw::RawLeasing) -> Result<Leasing, Problem> {
    let window_ms = l.window_ms.unwrap_or(250);
    if !(10..=60_000).contains(&window_ms) {
        return Err(problem("leasing.window_ms", format!("{window_ms} is outside 10..=60000")));
    }
    let max_share = l.max_share.unwrap_or(0.1);
    if !(max_share.is_finite() && max_share > 0.0 && max_share <= 1.0) {
        return Err(problem("leasing.max_share", format!("{max_share} is not a share in (0, 1]")));
    }
    Ok(Leasing { window_ms, max_share })
}

pub(super) fn pool_policy(field: &str, p: &RawPool) -> Result<PoolPolicy, Problem> {
    if p.max_sequences == 0 {
        return Err(problem(format!("{field}.max_sequences"), "must be at least 1"));
    }
    for (name, speed) in [
        ("prefill_tokens_per_second", p.prefill_tokens_per_second),
        ("decode_tokens_per_second", p.decode_tokens_per_second),
    ] {
        if !(speed.is_finite() && speed > 0.0) {
            return Err(problem(format!("{field}.{name}"), "must be a positive number"));
        }
    }
    if p.max_queue_delay_ms == 0 {
        return Err(problem(format!("{field}.max_queue_delay_ms"), "must be at least 1"));
    }
    if p.kv_cache_tokens == Some(0) {
        return Err(problem(format!("{field}.kv_cache_tokens"), "must be at least 1 (leave it out for no limit)"));
    }
    let standard = p.tier_shares.standard.unwrap_or(0.8);
    let sheddable = p.tier_shares.sheddable.unwrap_or(0.5);
    for (name, share) in [("standard", standard), ("sheddable", sheddable)] {
        if !(share > 0.0 && share <= 1.0) {
            return Err(problem(format!("{field}.tier_shares.{name}"), format!("{share} is outside (0, 1]")));
        }
    }
    if sheddable > standard {
        return Err(problem(
            format!("{field}.tier_shares.sheddable"),
            format!("{sheddable} is above standard's {standard}: a lower tier may not get more of the pool"),
        ));
    }
    let t = &p.upstream_throttle;
    let upstream_throttle = if t.enabled {
        let decrease = t.decrease.unwrap_or(0.5);
        let min_share = t.min_share.unwrap_or(0.1);
        let recover = t.recover_per_second.unwrap_or(0.05);
        for (name, value) in [("decrease", decrease), ("min_share", min_share)] {
            if !(value > 0.0 && value <= 1.0) {
                return Err(problem(format!("{field}.upstream_throttle.{name}"), format!("{value} is outside (0, 1]")));
            }
        }
        if !(recover.is_finite() && recover > 0.0) {
            return Err(problem(format!("{field}.upstream_throttle.recover_per_second"), "must be a positive number"));
        }
        Some(crate::config::UpstreamThrottle {
            decrease,
            min_share,
            recover_per_ms: recover / 1000.0,
            cooldown_ms: t.cooldown_ms.unwrap_or(1_000),
            max_retry_after_ms: t.max_retry_after_ms.unwrap_or(60_000),
        })
    } else {
        None
    };
    let provider = p.provider_limits.as_ref().map(|l| provider_limits(field, l, sheddable)).transpose()?;
    Ok(PoolPolicy {
        max_sequences: p.max_sequences,
        prefill_tokens_per_ms: p.prefill_tokens_per_second / 1000.0,
        decode_tokens_per_ms: p.decode_tokens_per_second / 1000.0,
        max_queue_delay_ms: p.max_queue_delay_ms,
        kv_cache_tokens: p.kv_cache_tokens,
        standard_share: standard,
        sheddable_share: sheddable,
        idle_ttl_ms: 0,
        upstream_throttle,
        calibrate: p.calibrate,
        queue: p.queue,
        provider,
    })
}

/// A pool's provider limits: a scope's, in range, without concurrency (the pool's slots are
/// `max_sequences`), and with room for one request at the lowest tier's share of each rate.
#[allow(clippy::cast_precision_loss)]
fn provider_limits(field: &str, l: &Limits, sheddable: f64) -> Result<crate::config::ProviderLimits, Problem> {
    let field = format!("{field}.provider_limits");
    check_limits(&field, l)?;
    if l.max_concurrency.is_some() {
        return Err(problem(
            format!("{field}.max_concurrency"),
            "a pool's concurrency is its max_sequences (provider limits are rates and budgets)",
        ));
    }
    if let Some(rpm) = l.requests_per_minute
        && rpm as f64 * sheddable < 1.0
    {
        return Err(problem(
            format!("{field}.requests_per_minute"),
            format!("{rpm} at the sheddable tier's share {sheddable} leaves it less than one request"),
        ));
    }
    Ok(crate::config::ProviderLimits { limits: l.clone(), remembered_ms: remembered_for(l) })
}

pub(super) fn breaker(b: crate::config::raw::RawBreaker) -> Result<crate::config::BreakerPolicy, Problem> {
    let failures = positive_u32("store.breaker.failures", b.failures, 3)?;
    let open_ms = positive("store.breaker.open_ms", b.open_ms, 250)?;
    let max_open_ms = positive("store.breaker.max_open_ms", b.max_open_ms, 500)?;
    // Unset, it follows a longer open_ms; set below it, it is a mistake.
    let max_open_ms = if b.max_open_ms.is_none() { max_open_ms.max(open_ms) } else { max_open_ms };
    if max_open_ms < open_ms {
        return Err(problem("store.breaker.max_open_ms", format!("{max_open_ms} is below open_ms {open_ms}")));
    }
    Ok(crate::config::BreakerPolicy {
        failures,
        open: Duration::from_millis(open_ms),
        max_open: Duration::from_millis(max_open_ms),
    })
}

pub(super) fn adaptive(field: &str, a: RawAdaptive) -> Result<AdaptiveOutput, Problem> {
    if !(a.quantile > 0.0 && a.quantile < 1.0) {
        return Err(problem(format!("{field}.quantile"), format!("{} is outside (0, 1)", a.quantile)));
    }
    if a.min_samples == 0 {
        return Err(problem(format!("{field}.min_samples"), "must be at least 1"));
    }
    if a.window < a.min_samples {
        return Err(problem(format!("{field}.window"), format!("{} is below min_samples {}", a.window, a.min_samples)));
    }
    Ok(AdaptiveOutput { quantile: a.quantile, min_samples: a.min_samples, window: a.window })
}

/// A model's price per million tokens, as nanos per token.
pub(super) fn price(field: &str, p: &crate::config::raw::RawPrice) -> Result<Price, Problem> {
    // A price per million tokens in units is a price per token in thousandths of a micro-unit:
    // nanos per token = price x 1,000.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let per_token = |name: &str, per_million: f64| {
        let thousandths = per_million * 1000.0;
        let nanos = thousandths.round();
        let exact = per_million.is_finite() && (0.0..=MAX_PRICE_NANOS as f64).contains(&nanos);
        (exact && (thousandths - nanos).abs() < 1e-6).then_some(nanos as u64).ok_or_else(|| {
            problem(
                format!("{field}.{name}"),
                format!("{per_million} is not a price per million tokens: 0 to 1000, at most three decimals"),
            )
        })
    };
    let input_nanos = per_token("input_per_million", p.input_per_million)?;
    let output_nanos = per_token("output_per_million", p.output_per_million)?;
    let or = |name: &str, per_million: Option<f64>, base: u64| per_million.map_or(Ok(base), |v| per_token(name, v));
    Ok(Price {
        input_nanos,
        output_nanos,
        cache_read_nanos: or("cache_read_per_million", p.cache_read_per_million, input_nanos)?,
        cache_write_nanos: or("cache_write_per_million", p.cache_write_per_million, input_nanos)?,
        reasoning_nanos: or("reasoning_per_million", p.reasoning_per_million, output_nanos)?,
    })
}

/// A weighted token's weight (a cached prompt token, a reasoning token), as thousandths of a
/// whole one.
pub(super) fn token_weight(field: &str, weight: f64) -> Result<u64, Problem> {
    let thousandths = weight * 1000.0;
    let milli = thousandths.round();
    let exact = weight.is_finite() && (0.0..=f64::from(MAX_CACHE_WEIGHT_MILLI)).contains(&milli);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    (exact && (thousandths - milli).abs() < 1e-6)
        .then_some(milli as u64)
        .ok_or_else(|| problem(field, format!("{weight} is not a token's weight: 0 to 10, at most three decimals")))
}
