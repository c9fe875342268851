//! Envoy's gRPC access log = how tollgate learns of a request that ended before any response.
//!
//! The commit from the response ([`super::ext_proc`]) is sent responses only: Envoy opens its
//! stream at the response headers, so a client that leaves while the backend still reads its prompt
//! never opens one. `envoy/envoy.yaml` logs exactly those requests (status 0: no response at all)
//! to this service, with the request's dynamic metadata, where `Check` left the reservation; the
//! hold is charged the prompt held and no output, as if ext_proc had seen the stream cut short.
//! Envoy batches entries (every `buffer_flush_interval`) on one long-lived stream per worker, and
//! sends nothing for the requests that were answered: the common path costs nothing.
//!
//! Envoy's access log is best effort by design (no acknowledgement): an entry lost with a broken
//! stream leaves its hold to expiry, as a lost ext_proc stream does.

use std::sync::Arc;

use envoy_types::pb::envoy::data::accesslog::v3::HttpAccessLogEntry;
use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_server::AccessLogService;
use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::LogEntries;
use envoy_types::pb::envoy::service::accesslog::v3::{StreamAccessLogsMessage, StreamAccessLogsResponse};
use tonic::{Request, Response, Status, Streaming};

use super::ext_proc::{charge_unanswered, forwarded};
use crate::admission::Admission;
use crate::store::Store;

/// The `envoy.service.accesslog.v3.AccessLogService` service.
#[derive(Debug)]
pub struct AccessLogSink<S> {
    admission: Arc<Admission<S>>,
}

impl<S> AccessLogSink<S> {
    pub fn new(admission: Arc<Admission<S>>) -> Self {
        AccessLogSink { admission }
    }
}

#[tonic::async_trait]
impl<S: Store> AccessLogService for AccessLogSink<S> {
    /// Runs as long as Envoy keeps the stream open (Envoy never expects the reply).
    async fn stream_access_logs(
        &self,
        request: Request<Streaming<StreamAccessLogsMessage>>,
    ) -> Result<Response<StreamAccessLogsResponse>, Status> {
        let mut inbound = request.into_inner();
        while let Some(message) = inbound.message().await? {
            let Some(LogEntries::HttpLogs(batch)) = message.log_entries else { continue };
            for entry in &batch.log_entry {
                if let Some(id) = unanswered_reservation(entry) {
                    charge_unanswered(&self.admission, id).await;
                }
            }
        }
        Ok(Response::new(StreamAccessLogsResponse {}))
    }
}

/// The reservation of a request that got no response at all. An answered request is ext_proc's to
/// settle, so it is skipped here even if a configuration logs it.
fn unanswered_reservation(entry: &HttpAccessLogEntry) -> Option<&str> {
    let answered = entry.response.as_ref().and_then(|r| r.response_code).is_some_and(|code| code.value != 0);
    if answered {
        return None;
    }
    forwarded(entry.common_properties.as_ref()?.metadata.as_ref()?).0
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::envoy::data::accesslog::v3::{AccessLogCommon, HttpResponseProperties};
    use envoy_types::pb::google::protobuf::{Struct, UInt32Value, Value, value::Kind};

    use super::*;
    use crate::grpc::response::{AUTHZ_NAMESPACE, RESERVATION_FIELD};

    fn entry(code: Option<u32>, reservation: Option<&str>) -> HttpAccessLogEntry {
        let fields = reservation
            .map(|id| (RESERVATION_FIELD.to_string(), Value { kind: Some(Kind::StringValue(id.to_string())) }))
            .into_iter()
            .collect();
        let metadata = Metadata {
            filter_metadata: [(AUTHZ_NAMESPACE.to_string(), Struct { fields })].into_iter().collect(),
            ..Default::default()
        };
        HttpAccessLogEntry {
            common_properties: Some(AccessLogCommon { metadata: Some(metadata), ..Default::default() }),
            response: Some(HttpResponseProperties {
                response_code: code.map(|value| UInt32Value { value }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_request_with_no_response_and_a_reservation_is_charged_here() {
        assert_eq!(unanswered_reservation(&entry(Some(0), Some("acme:r1"))), Some("acme:r1"));
        assert_eq!(unanswered_reservation(&entry(None, Some("acme:r1"))), Some("acme:r1"));
        for code in [200, 429, 503] {
            assert_eq!(unanswered_reservation(&entry(Some(code), Some("acme:r1"))), None, "{code} is ext_proc's");
        }
        assert_eq!(unanswered_reservation(&entry(Some(0), None)), None, "denied or unmetered: no hold");
        assert_eq!(unanswered_reservation(&HttpAccessLogEntry::default()), None);
    }
}
