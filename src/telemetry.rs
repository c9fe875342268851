//! Logs through `tracing`, as text or JSON lines on stderr; spans exported over OTLP only when an
//! endpoint is configured, so the default run needs no collector and makes no connection attempts.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::io::IsTerminal;
use tracing_subscriber::{EnvFilter, fmt, layer::SubscriberExt, util::SubscriberInitExt};

use crate::config::LogFormat;

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
            tracing::warn!(error = %e, "flushing traces failed");
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

/// Installs the global subscriber. `log_filter` is an `EnvFilter` directive (`RUST_LOG` wins);
/// `format` says how lines are written, always to stderr: text coloured only when stderr is a
/// terminal and `NO_COLOR` is unset (a container runtime's log file, `kubectl logs`, Loki would
/// show escape codes), or one JSON object a line with each event's fields at its top level.
pub fn init(log_filter: &str, format: LogFormat, otlp_endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if !env.is_empty() => EnvFilter::try_new(env)?,
        _ => EnvFilter::try_new(log_filter)?,
    };
    let (text, json) = match format {
        LogFormat::Text => {
            let colour = wants_colour(std::io::stderr().is_terminal(), std::env::var_os("NO_COLOR").as_deref());
            (Some(fmt::layer().with_writer(std::io::stderr).with_target(false).with_ansi(colour)), None)
        }
        LogFormat::Json => {
            // A panic is a log line too, so the log stays JSON to its last line.
            std::panic::set_hook(Box::new(|panic| tracing::error!(panic = %panic, "panicked")));
            let json = fmt::layer()
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .with_writer(std::io::stderr);
            (None, Some(json))
        }
    };
    let provider = match otlp_endpoint {
        None => None,
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.to_string(), source })?;
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(opentelemetry_sdk::Resource::builder().with_service_name("tollgate").build())
                    .build(),
            )
        }
    };
    let otel = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("tollgate")));
    tracing_subscriber::registry().with(filter).with(text).with(json).with(otel).init();
    Ok(Telemetry { provider })
}

/// Colour codes only for a terminal, and never when `NO_COLOR` is set to anything but the empty
/// string (no-color.org).
fn wants_colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::wants_colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(wants_colour(true, None));
        assert!(wants_colour(true, Some(OsStr::new(""))));
        assert!(!wants_colour(true, Some(OsStr::new("1"))));
        assert!(!wants_colour(false, None));
        assert!(!wants_colour(false, Some(OsStr::new(""))));
    }
}
