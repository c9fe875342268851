//! `tollgate bench decision`: the decision itself, in process. Check requests of the benchmark's
//! mix go straight to tollgate's `Authorization` service (attribute extraction, body parsing, the
//! decision, the response), with no network and no load generator beside it; each admitted hold
//! is committed at once, untimed, as ext_proc commits (in batches where the policy has a commit
//! window). On a leasing policy, after the first calls every decision is a
//! lease hit: this times what a hit costs, from the request handed to the service to the answer
//! it returns.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::auth::v3::authorization_server::Authorization;

use super::{RequestMix, check_request, reservation_of};
use crate::admission::Admission;
use crate::grpc::authz::AuthzService;
use crate::hold::{Counted, Ending};
use crate::store::Store;

/// Percentiles of the timed decisions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecisionTimes {
    pub calls: usize,
    pub admitted: usize,
    pub p50: Duration,
    pub p99: Duration,
    pub p999: Duration,
    pub max: Duration,
    pub mean: Duration,
}

impl std::fmt::Display for DecisionTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        write!(
            f,
            "{} decisions ({} admitted): p50 {:.1} µs, p99 {:.1} µs, p99.9 {:.1} µs, max {:.1} µs, mean {:.1} µs",
            self.calls,
            self.admitted,
            us(self.p50),
            us(self.p99),
            us(self.p999),
            us(self.max),
            us(self.mean)
        )
    }
}

/// Times `calls` decisions after `warmup` untimed ones, spread over `tenants`.
pub async fn run<S: Store>(
    admission: Arc<Admission<S>>,
    tenants: &[String],
    model: &str,
    warmup: usize,
    calls: usize,
) -> DecisionTimes {
    let service = AuthzService::new(Arc::clone(&admission));
    let mix = RequestMix::new(model, 1, None);
    let mut times = Vec::with_capacity(calls);
    let mut admitted = 0;
    for i in 0..warmup.saturating_add(calls) {
        let mixed = mix.get(i as u64);
        let tenant = tenants[i % tenants.len().max(1)].clone();
        let request = tonic::Request::new(check_request(tenant, mixed));
        let started = Instant::now();
        let response = service.check(request).await.map(tonic::Response::into_inner);
        let took = started.elapsed();
        let id = response.ok().as_ref().and_then(reservation_of);
        if let Some(id) = &id {
            let used = Counted::exact(mixed.prompt_tokens, mixed.output_tokens);
            admission.commit_from_response(id, used, Ending::of(used)).await;
        }
        if i >= warmup {
            times.push(took);
            admitted += usize::from(id.is_some());
        }
    }
    // (Commits the policy batches land now.)
    admission.finish_tasks().await;
    times.sort_unstable();
    let pct = |per_mille: usize| {
        let rank = (per_mille * times.len()).div_ceil(1000);
        times.get(rank.clamp(1, times.len().max(1)) - 1).copied().unwrap_or_default()
    };
    let total: Duration = times.iter().sum();
    DecisionTimes {
        calls: times.len(),
        admitted,
        p50: pct(500),
        p99: pct(990),
        p999: pct(999),
        max: times.last().copied().unwrap_or_default(),
        mean: total / u32::try_from(times.len().max(1)).unwrap_or(u32::MAX),
    }
}
