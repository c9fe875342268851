//! `tollgate bench burst`: the reserve/commit/expire design's burst experiment on the real gateway. A burst of requests arrives
//! at once against one budget; how many does it admit when each holds the caller's worst case
//! (`max_tokens`), and how many when each holds a learned quantile of past outputs, and what does
//! the learned hold cost in overrun (tokens used beyond their hold)?
//!
//! Two tenants of the running tollgate take part, identical but for `adaptive_output`. For each:
//! first a learning phase (reserve + commit, as user `learner`, outputs drawn from the stated
//! distribution), then the burst (as user `burst`, whose own bucket is the budget and is untouched
//! by learning), then a commit of every admitted request with a drawn output.
//!
//! The ratio depends on the output-length distribution as much as on the mechanism, so the report
//! states the distribution beside every figure.

use std::time::Duration;

use futures_util::future::join_all;
use tonic::transport::{Channel, Endpoint};

use crate::proto::admission_client::AdmissionClient;
use crate::proto::{CommitRequest, ReserveRequest};
use crate::tools::sim::lengths::{OutputLengths, Sampler};

/// What to run.
#[derive(Debug, Clone)]
pub struct BurstOptions {
    pub target: String,
    pub worst_tenant: String,
    pub adaptive_tenant: String,
    pub model: String,
    pub requests: usize,
    pub learn: usize,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    pub median: f64,
    pub sigma: f64,
    pub seed: u64,
}

/// One tenant's burst.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BurstResult {
    pub admitted: usize,
    pub requests: usize,
    /// Average hold of an admitted request.
    pub mean_hold: f64,
    pub used_tokens: u64,
    pub overrun_tokens: u64,
}

impl BurstResult {
    pub fn admitted_share(&self) -> f64 {
        self.admitted as f64 / self.requests.max(1) as f64
    }

    pub fn overrun_share(&self) -> f64 {
        self.overrun_tokens as f64 / self.used_tokens.max(1) as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BurstReport {
    pub worst: BurstResult,
    pub adaptive: BurstResult,
}

#[derive(Debug, thiserror::Error)]
pub enum BurstError {
    #[error("cannot reach {0}: {1}")]
    Connect(String, String),
    #[error("{0} failed: {1}")]
    Call(&'static str, tonic::Status),
}

pub async fn run(o: &BurstOptions) -> Result<BurstReport, BurstError> {
    let channel = Endpoint::from_shared(o.target.clone())
        .map_err(|e| BurstError::Connect(o.target.clone(), e.to_string()))?
        .connect()
        .await
        .map_err(|e| BurstError::Connect(o.target.clone(), e.to_string()))?;
    let lengths = OutputLengths::LogNormal { median: o.median, sigma: o.sigma };
    let worst = one_tenant(&channel, o, &o.worst_tenant, Sampler::new(lengths, o.seed)).await?;
    let adaptive = one_tenant(&channel, o, &o.adaptive_tenant, Sampler::new(lengths, o.seed)).await?;
    Ok(BurstReport { worst, adaptive })
}

fn reserve(o: &BurstOptions, tenant: &str, user: &str) -> ReserveRequest {
    ReserveRequest {
        tenant: tenant.into(),
        user: user.into(),
        model: o.model.clone(),
        prompt_tokens: o.prompt_tokens,
        max_tokens: o.max_tokens,
        ..Default::default()
    }
}

async fn one_tenant(
    channel: &Channel,
    o: &BurstOptions,
    tenant: &str,
    sampler: Sampler,
) -> Result<BurstResult, BurstError> {
    let client = AdmissionClient::new(channel.clone());
    // Learning, 32 at a time.
    for chunk in (0..o.learn).collect::<Vec<_>>().chunks(32) {
        let calls = chunk.iter().map(|_| {
            let mut client = client.clone();
            let output = sampler.sample(o.max_tokens);
            let request = reserve(o, tenant, "learner");
            async move {
                let r = client.reserve(request).await.map_err(|e| BurstError::Call("reserve", e))?.into_inner();
                if r.admitted {
                    let commit = CommitRequest {
                        reservation_id: r.reservation_id,
                        prompt_tokens: o.prompt_tokens,
                        completion_tokens: output,
                        ..Default::default()
                    };
                    client.commit(commit).await.map_err(|e| BurstError::Call("commit", e))?;
                }
                Ok::<_, BurstError>(())
            }
        });
        for r in join_all(calls).await {
            r?;
        }
    }
    // The burst: every request at once.
    let calls = (0..o.requests).map(|_| {
        let mut client = client.clone();
        let request = reserve(o, tenant, "burst");
        async move { client.reserve(request).await.map(|r| r.into_inner()) }
    });
    let replies = join_all(calls).await;
    let mut result = BurstResult { requests: o.requests, ..Default::default() };
    let mut held = 0u64;
    let mut commits = Vec::new();
    for reply in replies {
        let reply = reply.map_err(|e| BurstError::Call("reserve", e))?;
        if reply.admitted {
            result.admitted += 1;
            held += reply.reserved_tokens;
            let output = sampler.sample(o.max_tokens);
            let mut client = client.clone();
            let commit = CommitRequest {
                reservation_id: reply.reservation_id,
                prompt_tokens: o.prompt_tokens,
                completion_tokens: output,
                ..Default::default()
            };
            commits.push(async move { client.commit(commit).await.map(|r| r.into_inner()) });
        }
    }
    for c in join_all(commits).await {
        let c = c.map_err(|e| BurstError::Call("commit", e))?;
        result.used_tokens += c.used_tokens;
        result.overrun_tokens += c.overrun_tokens;
    }
    result.mean_hold = held as f64 / result.admitted.max(1) as f64;
    // Let the burst user's bucket refill before anything else runs against it.
    tokio::time::sleep(Duration::from_millis(10)).await;
    Ok(result)
}

impl std::fmt::Display for BurstReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = |name: &str, r: &BurstResult| {
            format!(
                "| {name} | {}/{} | {:.1}% | {:.0} | {:.2}% |\n",
                r.admitted,
                r.requests,
                100.0 * r.admitted_share(),
                r.mean_hold,
                100.0 * r.overrun_share()
            )
        };
        write!(
            f,
            "| reservation | admitted | share of burst | mean hold (tokens) | overrun / used |\n|---|---|---|---|---|\n{}{}\nadaptive admits {:.2}x the worst case, at {:.2}% overrun\n",
            row("worst case (max_tokens)", &self.worst),
            row("adaptive (learned quantile)", &self.adaptive),
            self.adaptive.admitted_share() / self.worst.admitted_share().max(f64::EPSILON),
            100.0 * self.adaptive.overrun_share()
        )
    }
}
