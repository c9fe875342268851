//! Two tollgate processes sharing one Redis (then one Redis Cluster) never over-admit: with a
//! budget that admits exactly K holds and hundreds of concurrent reserves from both, exactly K are
//! admitted. This is the property one-script-per-phase exists for. The tenant fails closed, so a
//! call the store did not answer in time (a loaded machine) is refused, never admitted by a
//! replica's local share: what is admitted is what the store admitted.

mod support;

use futures_util::future::join_all;
use support::Backend;
use support::procs::Tollgate;
use tollgate::proto::ReserveRequest;
use tollgate::proto::admission_client::AdmissionClient;

const K: usize = 7;
const PER_REPLICA: usize = 150;

async fn exactly_k_admitted(backend: Backend) {
    let tenant = support::unique_tenant("shared");
    let policy = format!(
        "{}\nmodels:\n  m:\n    max_output_tokens: 512\ntenants:\n  {tenant}:\n    on_store_error: fail_closed\n    limits: {{ tokens_per_minute: 1, burst_tokens: {} }}\n",
        backend.store_yaml(),
        K * 100
    );
    let replicas = [Tollgate::start(&policy), Tollgate::start(&policy)];
    let mut calls = Vec::new();
    for replica in &replicas {
        let client = AdmissionClient::connect(replica.endpoint()).await.unwrap();
        for _ in 0..PER_REPLICA {
            let mut client = client.clone();
            let tenant = tenant.clone();
            calls.push(async move {
                let request = ReserveRequest {
                    tenant,
                    model: "m".into(),
                    prompt_tokens: 50,
                    max_tokens: 50,
                    ..Default::default()
                };
                client.reserve(request).await.map(|r| r.into_inner())
            });
        }
    }
    let replies = join_all(calls).await;
    let (mut admitted, mut unanswered) = (0, 0);
    for reply in replies {
        let reply = reply.unwrap_or_else(|e| panic!("reserve failed: {e}\n{}", replicas[0].log()));
        match (reply.admitted, reply.reason.as_str()) {
            (true, _) => admitted += 1,
            (false, "store_unavailable") => unanswered += 1,
            (false, reason) => assert_eq!(reason, "token_rate", "{reply:?}"),
        }
    }
    assert!(admitted <= K, "two replicas, {} concurrent reserves: {admitted} admitted", 2 * PER_REPLICA);
    // Every K-th hold is admitted unless the store did not answer a reserve that would have been.
    assert!(admitted + unanswered >= K, "{admitted} admitted, {unanswered} unanswered");
    if unanswered == 0 {
        assert_eq!(admitted, K, "two replicas, {} concurrent reserves", 2 * PER_REPLICA);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_redis_admit_exactly_k() {
    exactly_k_admitted(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_a_redis_cluster_admit_exactly_k() {
    exactly_k_admitted(Backend::Cluster).await;
}
