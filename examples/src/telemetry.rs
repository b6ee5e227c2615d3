//! `GET /metrics`: the library's metrics (through the `metrics` facade) in Prometheus's text
//! format, from the recorder the binaries install.

use axum::{Router, extract::State, response::IntoResponse, routing::get};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Installs the Prometheus recorder for the whole process; returns what renders it.
///
/// # Errors
///
/// When a recorder is installed already.
pub fn install() -> Result<PrometheusHandle, Box<dyn std::error::Error + Send + Sync>> {
    // Durations as histograms (buckets from 0.5 ms to 2.5 s), which add up across instances;
    // a summary's quantiles do not.
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".to_owned()),
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ],
        )
        .map_err(|e| format!("cannot set the metrics buckets: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    Ok(handle)
}

/// `GET /metrics` rendering `handle`.
pub fn router(handle: PrometheusHandle) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(handle)
}

/// `GET /metrics`.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    summary = "The idempotency layer's metrics",
    responses((status = 200, description = "Counters and histograms, in Prometheus's text format.",
        body = String, content_type = "text/plain; version=0.0.4")))]
pub async fn metrics(State(handle): State<PrometheusHandle>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
}
