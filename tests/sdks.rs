//! Each provider's own Python SDK (installed from PyPI into the test venv, as Envoy is) through
//! the shipped `envoy/envoy.yaml`, in front of a stand-in backend that answers in that provider's
//! format and commits nothing: Gemini and Vertex AI (`google-genai`), Bedrock (`boto3`), Ollama
//! (`ollama`), OpenAI, Azure OpenAI and embeddings (`openai`), Anthropic (`anthropic`). Each is
//! admitted with a hold as tight as an OpenAI request's, is charged what the backend reported, and
//! is refused for a spent budget in words its SDK shows; OpenAI's and Anthropic's are refused for
//! a rate with the retry hints and rate-limit headers their SDKs read. The clients:
//! `tests/sdks/clients.py`.

mod support;

use std::process::Command;

use serde_json::Value;
use support::stack::Stack;
use tollgate::proto::{CommitRequest, ReserveRequest};
use tollgate::tools::sim::formats::Text;

/// Every model a client names, each by the name its API uses; Azure's deployment is an alias.
const POLICY: &str = "models:\n  gemini-2.0-flash: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
                      \x20 amazon.nova-lite-v1:0: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
                      \x20 llama3.2: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
                      \x20 meta.llama3-8b-instruct-v1:0: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
                      \x20 gpt-4o: { max_output_tokens: 4096, bytes_per_token: 4, aliases: [my-gpt4o] }\n\
                      \x20 claude-sonnet-4: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
                      \x20 text-embedding-3-small: { max_output_tokens: 1, bytes_per_token: 4 }\n\
                      tenants:\n  acme:\n    lease_ttl_ms: 60000\n    limits: { max_concurrency: 100 }\n\
                      \x20 broke:\n    limits: { tokens_per_day: 1000 }\n\
                      \x20 rated:\n    limits: { tokens_per_minute: 600000, requests_per_minute: 1 }\n\
                      \x20 thrifty:\n    soft_limits: { tokens_per_day: 50 }\n    limits: { tokens_per_day: 1000000 }\n";

/// The output each request asks for (and the stand-in generates: its fixed 40).
const MAX_TOKENS: i64 = 40;

/// The shipped Envoy and tollgate in front of the simulated backend.
async fn start() -> Stack {
    Stack::sim(POLICY, 10_000.0, Text::Tok, |c| c).await
}

/// Runs `family`'s SDK as `tenant` through `stack`: one JSON line per call.
fn run(stack: &Stack, family: &str, tenant: &str) -> Vec<Value> {
    let python = std::env::var("TOLLGATE_TEST_PYTHON")
        .expect("TOLLGATE_TEST_PYTHON is not set: run the suite with `bash scripts/test`, which installs the SDKs");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdks/clients.py");
    let base = format!("http://127.0.0.1:{}", stack.envoy.port);
    // Each SDK as it comes: no retry settings or AWS profile from the machine's environment.
    let out = Command::new("timeout")
        .args(["60", &python, script, family, &base, tenant])
        .env_remove("AWS_RETRY_MODE")
        .env_remove("AWS_MAX_ATTEMPTS")
        .env_remove("AWS_PROFILE")
        .env("AWS_CONFIG_FILE", "/dev/null")
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{family}: {}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr),
        stack.diagnostics()
    );
    stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"))).collect()
}

/// Spends all but 9 of tenant `broke`'s daily budget.
async fn spend(stack: &Stack, model: &str) {
    let mut client = stack.client().await;
    let r = client
        .reserve(ReserveRequest {
            tenant: "broke".into(),
            model: model.into(),
            prompt_tokens: 990,
            max_tokens: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.admitted, "{r:?}");
    let c = CommitRequest {
        reservation_id: r.reservation_id,
        prompt_tokens: 990,
        completion_tokens: 1,
        ..Default::default()
    };
    client.commit(c).await.unwrap();
}

/// Every call (`expected`, streamed and not) admitted with a hold of the prompt's estimate and the
/// 40 asked (never the model's 4,096), and charged exactly what the backend reported: the prompt
/// it counted and the 40 (Bedrock's InvokeModel: in its headers, or its stream's last chunk).
async fn admitted_tightly_and_charged_exactly(family: &str, expected: &[&str]) {
    let stack = start().await;
    let calls = run(&stack, family, "acme");
    assert_eq!(calls.iter().map(|c| c["call"].as_str().unwrap()).collect::<Vec<_>>(), expected, "{calls:?}");
    for call in &calls {
        let reserved = call["reserved_tokens"].as_i64().unwrap();
        // The body is under 600 bytes at 4 a token.
        assert!((MAX_TOKENS + 1..MAX_TOKENS + 150).contains(&reserved), "{family} {call}: a hold of {reserved}");
        assert_eq!(call["text_bytes"], 4 * MAX_TOKENS.min(64), "{family} {call}: the SDK read the answer");
        let c = stack.charged(call["reservation"].as_str().unwrap()).await;
        assert!(!c.metered, "{family} {call}: exact, from the usage the response reported: {c:?}");
        // The stand-in counts the prompt's text alone (156 bytes, 39 tokens), below the estimate.
        assert_eq!(c.used_tokens, 39 + 40, "{family} {call}: {c:?}");
    }
}

/// Refused for a spent budget, as its SDK shows its provider's own refusal.
async fn refused_for_budget(family: &str, model: &str) -> Value {
    // Within about two minutes of midnight a spent day's wait is one an SDK may sleep through
    // (tollgate says `x-should-retry: false` only past two minutes), and the stack, the spending
    // and the SDK's run take a while: within five, the new day comes first, so the wait is a
    // whole day's.
    if to_midnight() <= 300 {
        tokio::time::sleep(std::time::Duration::from_secs(to_midnight() + 1)).await;
    }
    let stack = start().await;
    spend(&stack, model).await;
    let calls = run(&stack, family, "broke");
    assert_eq!(calls.len(), 1, "{calls:?}");
    let call = calls.into_iter().next().unwrap();
    assert!(call["shown"].as_str().unwrap().contains("is spent"), "{family}: the SDK shows the reason: {call}");
    call
}

/// Seconds until midnight UTC, when the tenants' days turn.
fn to_midnight() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    86_400 - now % 86_400
}

/// A spent budget's retry hints, as OpenAI's and Anthropic's SDKs read them: `x-should-retry:
/// false` (their SDKs do not retry it: the Anthropic client here has its retries on, and would
/// otherwise sleep until midnight) and a `retry-after` at the day's end (the policy's days are
/// UTC's).
fn hints_the_days_end(refused: &Value) {
    let rate = &refused["rate"];
    assert_eq!(rate["x-should-retry"], "false", "{refused}");
    let wait: u64 =
        rate["retry-after"].as_str().unwrap_or_else(|| panic!("no retry-after: {refused}")).parse().unwrap();
    let to_midnight = to_midnight();
    assert!(wait.abs_diff(to_midnight) <= 5, "retry-after {wait} s, midnight UTC in {to_midnight} s: {refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_through_google_genai() {
    admitted_tightly_and_charged_exactly("gemini", &["generate", "stream"]).await;
    let r = refused_for_budget("gemini", "gemini-2.0-flash").await;
    assert_eq!(
        (&r["error"], &r["code"], &r["status"]),
        (&"ClientError".into(), &429.into(), &"RESOURCE_EXHAUSTED".into()),
        "{r}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vertex_ai_gemini_through_google_genai() {
    admitted_tightly_and_charged_exactly("vertex", &["generate", "stream"]).await;
    let r = refused_for_budget("vertex", "gemini-2.0-flash").await;
    assert_eq!((&r["code"], &r["status"]), (&429.into(), &"RESOURCE_EXHAUSTED".into()), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bedrock_through_boto3() {
    admitted_tightly_and_charged_exactly("bedrock", &["generate", "stream", "invoke", "invoke-stream"]).await;
    let r = refused_for_budget("bedrock", "amazon.nova-lite-v1:0").await;
    // botocore reads the code from x-amzn-errortype; a spent budget is a quota it does not retry.
    assert_eq!(
        (&r["code"], &r["status"], &r["attempts"]),
        (&"ServiceQuotaExceededException".into(), &400.into(), &0.into()),
        "{r}"
    );
}

/// A rate's refusal is Bedrock's `ThrottlingException`, which botocore (1.44 on: standard mode by
/// default, three attempts; `scripts/tools.sh` installs it) retries twice, each retry refused again
/// within the minute, before it raises it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn botocore_retries_a_throttled_bedrock_call() {
    let (_, refused) = refused_for_rate("bedrock").await;
    assert_eq!(
        (&refused["error"], &refused["code"], &refused["attempts"]),
        (&"ThrottlingException".into(), &"ThrottlingException".into(), &2.into()),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_through_its_client() {
    admitted_tightly_and_charged_exactly("ollama", &["generate", "stream"]).await;
    let r = refused_for_budget("ollama", "llama3.2").await;
    assert_eq!((&r["error"], &r["status"]), (&"ResponseError".into(), &429.into()), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_openai_through_the_openai_sdk() {
    admitted_tightly_and_charged_exactly("azure", &["generate", "stream"]).await;
    let r = refused_for_budget("azure", "gpt-4o").await;
    assert_eq!((&r["error"], &r["status"]), (&"RateLimitError".into(), &429.into()), "{r}");
}

/// A tenant allowed one request a minute: the first call admitted, telling how many are left; the
/// second refused `request_rate`, with the wait and the headers the SDK's family reads.
async fn refused_for_rate(family: &str) -> (Value, Value) {
    let stack = start().await;
    let calls = run(&stack, family, "rated");
    assert_eq!(calls.len(), 2, "{calls:?}");
    let (admitted, refused) = (calls[0].clone(), calls[1].clone());
    assert_eq!(admitted["call"], "generate", "{admitted}");
    assert_eq!((&refused["call"], &refused["status"]), (&"stream".into(), &429.into()), "{refused}");
    let wait: u64 = refused["rate"]["retry-after"].as_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "a minute's permit: {refused}");
    (admitted, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_through_the_openai_sdk() {
    admitted_tightly_and_charged_exactly("openai", &["generate", "stream"]).await;
    // A spent budget is OpenAI's quota error; a rate keeps its rate_limit_error.
    let r = refused_for_budget("openai", "gpt-4o").await;
    assert_eq!(
        (&r["error"], &r["status"], &r["type"], &r["code"]),
        (&"RateLimitError".into(), &429.into(), &"insufficient_quota".into(), &"budget".into()),
        "{r}"
    );
    hints_the_days_end(&r);
    let (admitted, refused) = refused_for_rate("openai").await;
    assert_eq!(admitted["rate"]["x-ratelimit-remaining-requests"], "0", "{admitted}");
    assert_eq!((&refused["type"], &refused["code"]), (&"rate_limit_error".into(), &"request_rate".into()), "{refused}");
    assert!(refused["rate"].get("anthropic-ratelimit-requests-remaining").is_none(), "OpenAI's route: {refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_through_the_anthropic_sdk() {
    admitted_tightly_and_charged_exactly("anthropic", &["generate", "stream"]).await;
    let r = refused_for_budget("anthropic", "claude-sonnet-4").await;
    assert_eq!(
        (&r["error"], &r["status"], &r["type"]),
        (&"RateLimitError".into(), &429.into(), &"rate_limit_error".into()),
        "{r}"
    );
    hints_the_days_end(&r);
    // Anthropic's own rate-limit headers, beside OpenAI's: the admitted call's requests and
    // tokens windows; the refusal's tokens window (a refusal tells the tightest token window).
    let (admitted, refused) = refused_for_rate("anthropic").await;
    assert_eq!(admitted["rate"]["anthropic-ratelimit-requests-remaining"], "0", "{admitted}");
    let reset = admitted["rate"]["anthropic-ratelimit-requests-reset"].as_str().unwrap();
    assert!(reset.len() == 20 && reset.ends_with('Z'), "an RFC 3339 time: {admitted}");
    for call in [&admitted, &refused] {
        assert!(call["rate"].get("anthropic-ratelimit-tokens-remaining").is_some(), "{call}");
    }
    assert_eq!(
        (&refused["error"], &refused["type"]),
        (&"RateLimitError".into(), &"rate_limit_error".into()),
        "{refused}"
    );
}

/// Past its tenant's soft budget an SDK's call is answered all the same, marked
/// `x-tollgate-soft-limit`, and the shipped Envoy sends it to the economy cluster; a tenant under
/// its soft budget goes to the main backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_a_soft_budget_sdk_calls_go_to_the_economy_backend() {
    for family in ["openai", "anthropic"] {
        let (port, stop, economy) = support::sim_backend_counted(10_000.0, Text::Tok).await;
        let stack = Stack::sim(POLICY, 10_000.0, Text::Tok, |c| to_economy(&c, port)).await;
        let answered = || economy.completed.load(std::sync::atomic::Ordering::SeqCst);
        // A soft 50 tokens: the first call's hold (the 40 asked and its prompt) is past it.
        let calls = run(&stack, family, "thrifty");
        assert_eq!(calls.len(), 2, "{calls:?}");
        for call in &calls {
            assert_eq!(call["soft_limit"], "tokens_per_day", "{family}: {call}");
            assert_eq!(call["text_bytes"], 4 * MAX_TOKENS, "{family}: answered in full: {call}");
            let c = stack.charged(call["reservation"].as_str().unwrap()).await;
            assert_eq!(c.used_tokens, 39 + 40, "{family}: charged as any: {c:?}");
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while answered() < 2 && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(answered(), 2, "{family}: both went to the economy backend");
        for call in run(&stack, family, "acme") {
            assert!(call["soft_limit"].is_null(), "{family}: {call}");
        }
        assert_eq!(answered(), 2, "{family}: a tenant under its soft budget goes to the main backend");
        stop.cancel();
    }
}

/// The shipped bootstrap with its economy cluster moved to `port`.
fn to_economy(config: &str, port: u16) -> String {
    let at = config.find("- name: inference-economy").expect("envoy.yaml has an economy cluster");
    let (head, tail) = config.split_at(at);
    let from = tail.find("port_value: ").expect("the economy cluster's port") + "port_value: ".len();
    let to = from + tail[from..].find(' ').unwrap();
    format!("{head}{}{port}{}", &tail[..from], &tail[to..])
}

/// An embedding holds its input alone: a 5-token input is not held at the output ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_hold_the_input_alone() {
    let stack = start().await;
    let calls = run(&stack, "embeddings", "acme");
    let reserved = calls[0]["reserved_tokens"].as_i64().unwrap();
    // {"input":"five tokens of input","model":"text-embedding-3-small","encoding_format":"base64"}
    assert!((10..40).contains(&reserved), "{calls:?}");
    let c = stack.charged(calls[0]["reservation"].as_str().unwrap()).await;
    assert_eq!((c.used_tokens, c.metered), (5, false), "{c:?}");
}

/// A pool of two slots, its speeds the backend's own (40 tokens a second, prompts at once), and
/// its tenant's requests critical.
const FLOOD_POLICY: &str = "pools:\n  two:\n    max_sequences: 2\n    prefill_tokens_per_second: 1000000\n\
                            \x20   decode_tokens_per_second: 36\n    max_queue_delay_ms: 1500\n\
                            models:\n  gpt-4o-mini: { max_output_tokens: 4096, bytes_per_token: 4, pool: two }\n\
                            tenants:\n  acme:\n    default_priority: critical\n    max_priority: critical\n    limits: { max_concurrency: 100 }\n";

/// The flood: eight callers at once at a backend running two sequences (each a second of
/// generation, which the pool predicts a tenth slower), a 4x flood, through the shipped Envoy, each
/// with the OpenAI SDK's own retries (two, waiting the `retry-after-ms` it is sent). Three are
/// admitted at once (two run, one queues behind them at the backend, within the 1.5 s the pool
/// allows); the rest are refused `queue_full`, told when the holds end as predicted. Waiting
/// exactly that, the first retries find the two slots the first holds gave back (two retries
/// take them, the others are told of the next ends), and the second retries the next two: seven
/// of eight callers answered, all the room the pool had in that time. (The issue measured hints
/// from the pool "draining" by time, which admission never counts: every retry refused again, 5
/// of 8 callers failed.) Every refusal is the pool's, and none is the back-off of a hint nobody
/// could predict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_past_a_pool_is_let_in_by_the_sdks_own_retries() {
    use tollgate::tools::sim::{backend::SimConfig, lengths::OutputLengths};
    let config = SimConfig {
        slots: 2,
        prefill_tokens_per_second: 1_000_000.0,
        decode_tokens_per_second: 40.0,
        lengths: OutputLengths::Fixed(40),
        tollgate: None,
        text: Text::Tok,
        ..SimConfig::default()
    };
    let stack = Stack::sim_with(FLOOD_POLICY, config).await;
    let callers = run(&stack, "flood", "acme");
    assert_eq!(callers.len(), 8, "{callers:?}");
    let tries = |c: &Value| c["answers"].as_array().unwrap().len();
    let at_once = callers.iter().filter(|c| tries(c) == 1 && c["admitted"] == true).count();
    let at_first_retry = callers.iter().filter(|c| tries(c) == 2 && c["admitted"] == true).count();
    let summary: Vec<String> = callers.iter().map(|c| c["answers"].to_string()).collect();
    eprintln!("admitted at once {at_once}, at the first retry {at_first_retry}:\n{}", summary.join("\n"));
    for c in &callers {
        for refusal in c["answers"].as_array().unwrap().iter().filter(|a| a["status"] != 200) {
            assert_eq!((&refusal["status"], &refusal["reason"]), (&503.into(), &"queue_full".into()), "{c}");
            assert!(refusal["retry_after_ms"].as_str().is_some_and(|ms| ms.parse::<u64>().unwrap() > 1_000), "{c}");
        }
    }
    assert_eq!(at_once, 3, "two start, one queues behind them: {summary:?}");
    assert_eq!(at_first_retry, 2, "the room the first two holds give back, when told: {summary:?}");
    let admitted = callers.iter().filter(|c| c["admitted"] == true).count();
    assert_eq!(admitted, 7, "the SDK's retries at the hints: {summary:?}");
}
