//! The typed client of the rollout-checkpoint v1 contract: the messages, clients and servers
//! generated at build time from this repository's protos (module [`v1`]), and a thin helper
//! layer over them: the error domain, every `ErrorInfo` reason as a typed [`v1::ErrorReason`],
//! the health service names and metadata keys (`wire_value()`, read from the protos' option),
//! [`reason_of`] from a `tonic::Status`, the `deadline` metadata format, and the bearer token.
//!
//! ```no_run
//! use rollout_checkpoint::v1::{participant_service_client::ParticipantServiceClient, GetParticipantRequest};
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let channel = tonic::transport::Channel::from_static("http://127.0.0.1:9001").connect().await?;
//! let mut client = ParticipantServiceClient::with_interceptor(channel, rollout_checkpoint::bearer_token("change-me")?);
//! let participant = client.get_participant(GetParticipantRequest::default()).await?.into_inner();
//! # Ok(()) }
//! ```

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tonic::metadata::{errors::InvalidMetadataValue, AsciiMetadataValue};
use tonic::service::Interceptor;
use tonic_types::{ErrorDetail, ErrorInfo, StatusExt};

/// Everything generated from `rollout_checkpoint.v1`, plus `wire_value()` on the constants
/// enums (HealthServiceName, MetadataKey, ErrorDomain) and [`API_PACKAGE`](v1::API_PACKAGE).
pub mod v1 {
    tonic::include_proto!("rollout_checkpoint.v1");
    include!(concat!(env!("OUT_DIR"), "/wire_values.rs"));
}

// The crates whose types this one's API carries, so a controller depends on one crate only.
pub use {prost_types, tonic, tonic_health, tonic_types};

use v1::{ErrorDomain, ErrorReason, MetadataKey};

/// The semantic version of this crate. Its major stays 1 while the wire is
/// rollout_checkpoint.v1: a removed or renamed public name is a major bump, an added one a
/// minor bump (gen/public-api.json records the names).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version part of [`v1::API_PACKAGE`] ("v1"), what a participant's api_version ends with.
pub fn api_version() -> &'static str {
    v1::API_PACKAGE
        .rsplit('.')
        .next()
        .unwrap_or(v1::API_PACKAGE)
}

/// The `ErrorInfo.domain` of every refusal of this API ("rollout-checkpoint.dev").
pub fn domain() -> &'static str {
    ErrorDomain::RolloutCheckpoint.wire_value()
}

/// What the enum value names carry and the wire reason strings do not.
const REASON_PREFIX: &str = "ERROR_REASON_";

impl ErrorReason {
    /// The `ErrorInfo.reason` string of this value: its proto name without `ERROR_REASON_`
    /// (for example "STALE_CHECKPOINT").
    pub fn reason(self) -> &'static str {
        let name = self.as_str_name();
        name.strip_prefix(REASON_PREFIX).unwrap_or(name)
    }

    /// The reason whose [`reason`](Self::reason) is `text`; None for a reason this version of
    /// the crate does not know (the server may be newer: reasons may be added).
    pub fn from_reason(text: &str) -> Option<Self> {
        Self::from_str_name(&format!("{REASON_PREFIX}{text}")).filter(|r| *r != Self::Unspecified)
    }
}

/// A refusal decoded from a status: the typed reason (Unspecified for a reason this crate
/// does not know yet; `info.reason` has the string) and the whole `ErrorInfo`.
#[derive(Clone, Debug)]
pub struct Refusal {
    pub reason: ErrorReason,
    pub info: ErrorInfo,
}

impl Refusal {
    /// The metadata value under a key this API fixes.
    pub fn metadata(&self, key: MetadataKey) -> Option<&str> {
        self.info.metadata.get(key.wire_value()).map(String::as_str)
    }
}

/// The refusal a status carries: its one `ErrorInfo` in this API's domain. None when there is
/// none: the status came from the transport (a timeout, a dropped connection), not from a
/// participant or the coordinator, so there is nothing to switch on but the code.
pub fn reason_of(status: &tonic::Status) -> Option<Refusal> {
    let info = error_info_of(status)?;
    let reason = ErrorReason::from_reason(&info.reason).unwrap_or(ErrorReason::Unspecified);
    Some(Refusal { reason, info })
}

/// The `google.rpc.ErrorInfo` of a status in this API's domain, if it has one.
pub fn error_info_of(status: &tonic::Status) -> Option<ErrorInfo> {
    status
        .get_error_details_vec()
        .into_iter()
        .find_map(|detail| match detail {
            ErrorDetail::ErrorInfo(info) if info.domain == domain() => Some(info),
            _ => None,
        })
}

/// The fixed number of fraction digits of a `deadline` metadata value.
const DEADLINE_DIGITS: usize = 6;

/// A `deadline` metadata value that is not seconds with six decimals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadlineFormatError(pub String);

impl std::fmt::Display for DeadlineFormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "deadline {:?}: want seconds since the epoch with {DEADLINE_DIGITS} decimals",
            self.0
        )
    }
}

impl std::error::Error for DeadlineFormatError {}

/// Reads a `deadline` or `memberDeadline` metadata value: seconds since the Unix epoch (UTC)
/// with exactly six digits after the point (errors.proto, CHECKPOINT_DEADLINE_EXCEEDED), for
/// example "1767225600.250000".
pub fn parse_deadline(value: &str) -> Result<SystemTime, DeadlineFormatError> {
    let invalid = || DeadlineFormatError(value.to_owned());
    let (whole, fraction) = value.split_once('.').ok_or_else(invalid)?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !digits(fraction) || fraction.len() != DEADLINE_DIGITS {
        return Err(invalid());
    }
    let seconds: u64 = whole.parse().map_err(|_| invalid())?;
    let micros: u64 = fraction.parse().map_err(|_| invalid())?;
    Ok(UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_micros(micros))
}

/// Writes a time in the `deadline` metadata format (to compare with a refusal's). The server
/// formats a float of seconds; this rounds the same binary double the same way.
pub fn format_deadline(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    format!("{:.*}", DEADLINE_DIGITS, since.as_secs_f64())
}

/// The interceptor that sends `authorization: Bearer <token>` with every call: every RPC but
/// grpc.health.v1 needs it (`ParticipantServiceClient::with_interceptor(channel,
/// bearer_token(token)?)`). It works on plaintext channels too: a participant's sidecar may
/// serve plaintext next to its app, and there the token is ordinary metadata.
#[derive(Clone, Debug)]
pub struct BearerToken(AsciiMetadataValue);

/// The [`BearerToken`] interceptor of a token; an error when the token is not valid metadata.
pub fn bearer_token(token: &str) -> Result<BearerToken, InvalidMetadataValue> {
    Ok(BearerToken(format!("Bearer {token}").parse()?))
}

impl Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert(MetadataKey::Authorization.wire_value(), self.0.clone());
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use v1::HealthServiceName;

    #[test]
    fn constants_come_from_the_protos() {
        assert_eq!(domain(), "rollout-checkpoint.dev");
        assert_eq!(api_version(), "v1");
        assert_eq!(
            HealthServiceName::ParticipantReadiness.wire_value(),
            "participant-readiness"
        );
        assert_eq!(HealthServiceName::Server.wire_value(), "");
        assert_eq!(MetadataKey::FailedMembers.wire_value(), "failedMembers");
    }

    #[test]
    fn reasons_round_trip() {
        assert_eq!(ErrorReason::StaleCheckpoint.reason(), "STALE_CHECKPOINT");
        assert_eq!(
            ErrorReason::from_reason("TOKEN_INVALID"),
            Some(ErrorReason::TokenInvalid)
        );
        assert_eq!(ErrorReason::from_reason("UNSPECIFIED"), None);
        assert_eq!(
            ErrorReason::from_reason("A_REASON_FROM_A_NEWER_SERVER"),
            None
        );
    }

    #[test]
    fn reason_of_reads_the_error_info_of_this_domain_only() {
        let details = tonic_types::ErrorDetails::with_error_info(
            "STALE_CHECKPOINT",
            domain(),
            [("checkpointId".to_owned(), "c1".to_owned())],
        );
        let status = tonic::Status::with_error_details(tonic::Code::Aborted, "stale", details);
        let refusal = reason_of(&status).expect("an ErrorInfo");
        assert_eq!(refusal.reason, ErrorReason::StaleCheckpoint);
        assert_eq!(refusal.metadata(MetadataKey::CheckpointId), Some("c1"));
        let other = tonic_types::ErrorDetails::with_error_info("X", "example.com", HashMap::new());
        let foreign = tonic::Status::with_error_details(tonic::Code::Aborted, "x", other);
        assert!(reason_of(&foreign).is_none());
        assert!(reason_of(&tonic::Status::unavailable("down")).is_none());
    }

    #[test]
    fn deadlines_round_trip_and_reject_other_formats() {
        let time = UNIX_EPOCH + Duration::from_millis(1_767_225_600_250);
        assert_eq!(format_deadline(time), "1767225600.250000");
        assert_eq!(parse_deadline("1767225600.250000"), Ok(time));
        for bad in [
            "1767225600",
            "1767225600.25",
            "-1.000000",
            "1.+00000",
            "a.000000",
        ] {
            assert!(parse_deadline(bad).is_err(), "{bad}");
        }
    }
}
