//! The meter provider behind [`Metrics`](super::Metrics), and the Prometheus text exposition of
//! what it has collected (format 0.0.4, what every Prometheus scrapes).
//!
//! OpenTelemetry names become Prometheus names the usual way: dots to underscores, the unit as a
//! suffix (`s` → `_seconds`, `1` → `_ratio`; `{…}` annotations add none), `_total` on counters.
//! Attribute keys become label names the same way (`gen_ai.request.model` → `gen_ai_request_model`).

use std::fmt::Write as _;
use std::sync::{Arc, Weak};
use std::time::Duration;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::{KeyValue, Value};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    InstrumentKind, ManualReader, PeriodicReader, Pipeline, SdkMeterProvider, Temporality,
};

use super::{Metrics, TenantLabels};
use crate::config::Policy;

/// The process's meter provider: read on demand for Prometheus, and pushed over OTLP when an
/// endpoint is configured. Flushes OTLP when dropped.
pub struct Registry {
    provider: SdkMeterProvider,
    reader: Arc<ManualReader>,
    /// Whether anything pushes what is recorded (OTLP).
    pushed: bool,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// The reader Prometheus scrapes, shared between the provider (which registers it) and the
/// registry (which collects through it).
#[derive(Debug, Clone)]
struct Shared(Arc<ManualReader>);

impl MetricReader for Shared {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline);
    }

    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("OTLP metrics exporter for {endpoint}: {source}")]
pub struct ExporterError {
    endpoint: String,
    #[source]
    source: opentelemetry_otlp::ExporterBuildError,
}

impl Registry {
    /// A provider with the Prometheus reader, and an OTLP exporter when `otlp_endpoint` is given
    /// (pushing every `OTEL_METRIC_EXPORT_INTERVAL`, 60 s by default).
    pub fn new(otlp_endpoint: Option<&str>) -> Result<Registry, ExporterError> {
        let reader = Arc::new(ManualReader::builder().with_temporality(Temporality::Cumulative).build());
        let resource = opentelemetry_sdk::Resource::builder().with_service_name("tollgate").build();
        let mut builder = SdkMeterProvider::builder().with_resource(resource).with_reader(Shared(Arc::clone(&reader)));
        if let Some(endpoint) = otlp_endpoint {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .map_err(|source| ExporterError { endpoint: endpoint.to_string(), source })?;
            builder = builder.with_reader(PeriodicReader::builder(exporter).build());
        }
        Ok(Registry { provider: builder.build(), reader, pushed: otlp_endpoint.is_some() })
    }

    /// The meter tollgate's instruments come from.
    pub fn meter(&self) -> opentelemetry::metrics::Meter {
        self.provider.meter("tollgate")
    }

    /// The instruments, labelling tenants as the policy says; ones that record nothing when
    /// nothing would read them (no admin port to scrape, no OTLP endpoint).
    pub fn metrics(&self, policy: &Policy) -> Metrics {
        if policy.server.admin_listen.is_none() && !self.pushed {
            return Metrics::disabled();
        }
        let metrics = Metrics::new(&self.meter(), TenantLabels::of(policy));
        metrics.policy_loaded(policy);
        metrics
    }

    /// Everything collected so far, as Prometheus text.
    pub fn render(&self) -> String {
        let mut collected = ResourceMetrics::default();
        if let Err(e) = self.reader.collect(&mut collected) {
            tracing::warn!(error = %e, "collecting metrics failed");
        }
        let mut out = String::with_capacity(16 * 1024);
        for scope in collected.scope_metrics() {
            for metric in scope.metrics() {
                render_metric(&mut out, metric);
            }
        }
        out
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::debug!(error = %e, "metrics provider shutdown");
        }
    }
}

/// A Prometheus metric or label name for an OpenTelemetry one.
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == ':' { c } else { '_' }).collect()
}

fn unit_suffix(unit: &str) -> &'static str {
    match unit {
        "s" => "_seconds",
        "ms" => "_milliseconds",
        "By" => "_bytes",
        "1" => "_ratio",
        _ => "",
    }
}

fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn labels<'a>(attributes: impl Iterator<Item = &'a KeyValue>, extra: Option<(&str, String)>) -> String {
    let mut pairs: Vec<(String, String)> = attributes
        .map(|kv| {
            let value = match &kv.value {
                Value::String(s) => s.as_str().to_string(),
                other => other.to_string(),
            };
            (sanitize(kv.key.as_str()), value)
        })
        .collect();
    pairs.sort();
    if let Some((k, v)) = extra {
        pairs.push((k.to_string(), v));
    }
    if pairs.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    format!("{{{}}}", inner.join(","))
}

fn number(v: f64) -> String {
    if v.is_infinite() { if v > 0.0 { "+Inf".into() } else { "-Inf".into() } } else { format!("{v}") }
}

fn render_metric(out: &mut String, metric: &Metric) {
    let name = sanitize(metric.name());
    // The unit as a suffix, unless the name already ends with it.
    let suffix = unit_suffix(metric.unit());
    let base = if name.ends_with(suffix) { name } else { format!("{name}{suffix}") };
    match metric.data() {
        AggregatedMetrics::U64(data) => render_data(out, &base, metric.description(), data, |v| number(v as f64)),
        AggregatedMetrics::I64(data) => render_data(out, &base, metric.description(), data, |v| number(v as f64)),
        AggregatedMetrics::F64(data) => render_data(out, &base, metric.description(), data, number),
    }
}

fn render_data<T: Copy>(out: &mut String, base: &str, help: &str, data: &MetricData<T>, num: impl Fn(T) -> String) {
    let help = help.replace('\\', "\\\\").replace('\n', "\\n");
    match data {
        MetricData::Sum(sum) => {
            let name = if sum.is_monotonic() { format!("{base}_total") } else { base.to_string() };
            let kind = if sum.is_monotonic() { "counter" } else { "gauge" };
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for p in sum.data_points() {
                let _ = writeln!(out, "{name}{} {}", labels(p.attributes(), None), num(p.value()));
            }
        }
        MetricData::Gauge(gauge) => {
            let _ = writeln!(out, "# HELP {base} {help}\n# TYPE {base} gauge");
            for p in gauge.data_points() {
                let _ = writeln!(out, "{base}{} {}", labels(p.attributes(), None), num(p.value()));
            }
        }
        MetricData::Histogram(h) => {
            let _ = writeln!(out, "# HELP {base} {help}\n# TYPE {base} histogram");
            for p in h.data_points() {
                let mut cumulative = 0u64;
                let bounds: Vec<f64> = p.bounds().collect();
                for (i, count) in p.bucket_counts().enumerate() {
                    cumulative = cumulative.saturating_add(count);
                    let le = bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| number(*b));
                    let _ = writeln!(out, "{base}_bucket{} {cumulative}", labels(p.attributes(), Some(("le", le))));
                }
                let _ = writeln!(out, "{base}_sum{} {}", labels(p.attributes(), None), num(p.sum()));
                let _ = writeln!(out, "{base}_count{} {}", labels(p.attributes(), None), p.count());
            }
        }
        // tollgate makes no exponential histograms.
        MetricData::ExponentialHistogram(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_histograms_render_as_prometheus_text() {
        let registry = Registry::new(None).unwrap();
        let meter = registry.provider.meter("t");
        let c = meter.u64_counter("tollgate.decisions").with_unit("{decision}").with_description("d").build();
        c.add(2, &[KeyValue::new("outcome", "admitted"), KeyValue::new("gen_ai.request.model", "m \"x\"")]);
        let h =
            meter.f64_histogram("tollgate.decision.duration").with_unit("s").with_boundaries(vec![0.001, 0.01]).build();
        h.record(0.0005, &[]);
        h.record(0.005, &[]);
        h.record(5.0, &[]);
        let text = registry.render();
        assert!(text.contains("# TYPE tollgate_decisions_total counter"), "{text}");
        assert!(
            text.contains(r#"tollgate_decisions_total{gen_ai_request_model="m \"x\"",outcome="admitted"} 2"#),
            "{text}"
        );
        assert!(text.contains("# TYPE tollgate_decision_duration_seconds histogram"), "{text}");
        assert!(text.contains(r#"tollgate_decision_duration_seconds_bucket{le="0.001"} 1"#), "{text}");
        assert!(text.contains(r#"tollgate_decision_duration_seconds_bucket{le="0.01"} 2"#), "{text}");
        assert!(text.contains(r#"tollgate_decision_duration_seconds_bucket{le="+Inf"} 3"#), "{text}");
        assert!(text.contains("tollgate_decision_duration_seconds_count 3"), "{text}");
        assert!(text.contains("tollgate_decision_duration_seconds_sum 5.0055"), "{text}");
    }
}
