//! The loop as users run it: a tollgate process, a real Envoy with the shipped config in front of
//! it, and a backend behind Envoy that commits nothing itself (the simulated backend) or steers
//! each answer by its headers (`support::upstream`). With the Admission client to look at holds.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, CommitResponse, RenewRequest};
use tollgate::tools::sim::formats::Text;
use tonic::transport::Channel;

use super::procs::{Envoy, Tollgate};
use super::upstream::Upstream;

pub struct Stack {
    pub tollgate: Tollgate,
    pub envoy: Envoy,
    /// One connection, shared by every client this hands out (a poll does not pay for a connect).
    admission: AdmissionClient<Channel>,
    /// Stops the simulated backend; `None` in front of the test upstream (which stops on drop).
    shutdown: Option<CancellationToken>,
    upstream: Option<Upstream>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(shutdown) = &self.shutdown {
            shutdown.cancel();
        }
    }
}

impl Stack {
    /// In front of the simulated backend, generating its 40 tokens of `text` at
    /// `decode_tokens_per_second`, with the shipped Envoy config as `edit` leaves it.
    pub async fn sim(
        policy: &str,
        decode_tokens_per_second: f64,
        text: Text,
        edit: impl FnOnce(String) -> String,
    ) -> Stack {
        let tollgate = Tollgate::start(policy);
        let (port, shutdown) = super::sim_backend(decode_tokens_per_second, text).await;
        let envoy = Envoy::start_edited(tollgate.addr, port, edit);
        let admission = admission_of(&tollgate);
        Stack { tollgate, envoy, admission, shutdown: Some(shutdown), upstream: None }
    }

    /// In front of the simulated backend as `config` sets it (its slots, speeds and lengths), with
    /// the shipped Envoy config.
    pub async fn sim_with(policy: &str, config: tollgate::tools::sim::backend::SimConfig) -> Stack {
        let tollgate = Tollgate::start(policy);
        let (port, shutdown, _) = super::sim_backend_with(config).await;
        let envoy = Envoy::start_edited(tollgate.addr, port, |c| c);
        let admission = admission_of(&tollgate);
        Stack { tollgate, envoy, admission, shutdown: Some(shutdown), upstream: None }
    }

    /// In front of the test upstream of `support::upstream`, whose headers steer each answer.
    pub async fn test_upstream(policy: &str) -> Stack {
        let tollgate = Tollgate::start(policy);
        let upstream = Upstream::start(tollgate.endpoint()).await;
        Stack::around(tollgate, upstream)
    }

    /// In front of the test upstream playing a provider account of `per_minute` output tokens.
    pub async fn provider_upstream(policy: &str, per_minute: u64) -> Stack {
        let tollgate = Tollgate::start(policy);
        let upstream = Upstream::with_output_quota(tollgate.endpoint(), per_minute).await;
        Stack::around(tollgate, upstream)
    }

    fn around(tollgate: Tollgate, upstream: Upstream) -> Stack {
        let envoy = Envoy::start(tollgate.addr, upstream.port);
        let admission = admission_of(&tollgate);
        Stack { tollgate, envoy, admission, shutdown: None, upstream: Some(upstream) }
    }

    /// The requests the test upstream's provider account refused (429).
    pub fn upstream_refusals(&self) -> u64 {
        self.upstream.as_ref().map_or(0, Upstream::refused)
    }

    pub async fn client(&self) -> AdmissionClient<Channel> {
        self.admission.clone()
    }

    /// The hold's state once it is no longer `reserved`, polled every `every` (a renewal changes
    /// nothing of it); `None` if it still was after `within`.
    pub async fn settled_within(&self, id: &str, every: Duration, within: Duration) -> Option<String> {
        let mut client = self.client().await;
        let start = Instant::now();
        loop {
            let renew = RenewRequest { reservation_id: id.into(), lease_ms: 0 };
            let state = client
                .renew(renew)
                .await
                .unwrap_or_else(|e| panic!("renew {id}: {e}\n{}", self.diagnostics()))
                .into_inner()
                .state;
            if state != "reserved" {
                return Some(state);
            }
            if start.elapsed() > within {
                return None;
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Waits until the hold is settled by someone, and returns its state.
    pub async fn settled(&self, id: &str) -> String {
        let state = self.settled_within(id, Duration::from_millis(20), Duration::from_secs(10)).await;
        state.unwrap_or_else(|| panic!("{id} never settled\n{}", self.diagnostics()))
    }

    /// What the commit from the response charged: a second commit answers with it.
    pub async fn charged(&self, id: &str) -> CommitResponse {
        assert_eq!(self.settled(id).await, "committed", "{id}\n{}", self.diagnostics());
        let repeat = CommitRequest {
            reservation_id: id.into(),
            prompt_tokens: 999,
            completion_tokens: 999,
            ..Default::default()
        };
        let c = self.client().await.commit(repeat).await.unwrap().into_inner();
        assert!(c.duplicate, "the response's commit came first: {c:?}");
        c
    }

    pub fn diagnostics(&self) -> String {
        format!("--- tollgate log ---\n{}\n--- envoy log ---\n{}", self.tollgate.log(), self.envoy.log())
    }
}

fn admission_of(tollgate: &Tollgate) -> AdmissionClient<Channel> {
    AdmissionClient::new(Channel::from_shared(tollgate.endpoint()).unwrap().connect_lazy())
}
