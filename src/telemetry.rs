//! Logs through `tracing`; spans exported over OTLP only when an endpoint is configured, so the
//! default run needs no collector and makes no connection attempts.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::{EnvFilter, layer::SubscriberExt, util::SubscriberInitExt};

/// Flushes exported spans when dropped.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("tollgate: flushing traces failed: {e}");
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("log filter: {0}")]
    Filter(#[from] tracing_subscriber::filter::ParseError),
}

/// Installs the global subscriber. `log_filter` is an `EnvFilter` directive (`RUST_LOG` wins).
pub fn init(log_filter: &str, otlp_endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if !env.is_empty() => EnvFilter::try_new(env)?,
        _ => EnvFilter::try_new(log_filter)?,
    };
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false);
    let Some(endpoint) = otlp_endpoint else {
        tracing_subscriber::registry().with(filter).with(fmt).init();
        return Ok(Telemetry { provider: None });
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.to_string(), source })?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(opentelemetry_sdk::Resource::builder().with_service_name("tollgate").build())
        .build();
    let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer("tollgate"));
    tracing_subscriber::registry().with(filter).with(fmt).with(otel).init();
    Ok(Telemetry { provider: Some(provider) })
}
