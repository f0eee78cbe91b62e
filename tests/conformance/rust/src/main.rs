//! A Rust controller that drives one real rollout-checkpoint participant (the counter example)
//! through the contract, then a coordinator whose fleet it is, then a Restore into a
//! start-closed replacement: the same steps as tests/conformance/go/main.go, printed one line
//! each, exiting 1 at the first failed one. tests/test_conformance.py starts the servers and
//! passes their addresses in CONFORMANCE_* variables.
//!
//! Everything it uses of the contract comes from the crate gen/rust (`rollout_checkpoint`):
//! the generated messages and clients, tonic and tonic-health as it re-exports them, and the
//! helper layer (bearer_token, reason_of, wire_value, parse_deadline); it writes no codegen
//! and no helper of its own. HTTP (the data plane) is a few lines of HTTP/1.0 over a socket.

use std::collections::HashMap;
use std::error::Error;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rollout_checkpoint::prost_types::Timestamp;
use rollout_checkpoint::tonic::service::interceptor::InterceptedService;
use rollout_checkpoint::tonic::transport::Channel;
use rollout_checkpoint::tonic::{Code, Status, Streaming};
use rollout_checkpoint::tonic_health::pb::health_check_response::ServingStatus;
use rollout_checkpoint::tonic_health::pb::health_client::HealthClient;
use rollout_checkpoint::tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use rollout_checkpoint::v1::coordinator_service_client::CoordinatorServiceClient;
use rollout_checkpoint::v1::participant_service_client::ParticipantServiceClient;
use rollout_checkpoint::v1::*;
use rollout_checkpoint::{bearer_token, format_deadline, parse_deadline, reason_of, BearerToken};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Result<T = ()> = std::result::Result<T, Box<dyn Error>>;
type Participant = ParticipantServiceClient<InterceptedService<Channel, BearerToken>>;
type Coordinator = CoordinatorServiceClient<InterceptedService<Channel, BearerToken>>;

fn check<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}").into())
    }
}

/// An absolute request deadline `seconds` from now; the gRPC timeout is a little later, so
/// the participant (not the transport) reports a miss.
fn request<T>(message: T, seconds: u64) -> rollout_checkpoint::tonic::Request<T> {
    let mut request = rollout_checkpoint::tonic::Request::new(message);
    request.set_timeout(Duration::from_secs(seconds + 5));
    request
}

fn deadline_in(seconds: u64) -> Option<Timestamp> {
    Some(Timestamp::from(
        SystemTime::now() + Duration::from_secs(seconds),
    ))
}

/// A call failed with this code and typed reason: the refusal's metadata.
fn refused<T>(
    result: std::result::Result<T, Status>,
    code: Code,
    reason: ErrorReason,
) -> Result<HashMap<String, String>> {
    let status = match result {
        Ok(_) => return Err(format!("expected {}, the call succeeded", reason.reason()).into()),
        Err(status) => status,
    };
    let refusal = reason_of(&status).ok_or_else(|| {
        format!(
            "{:?} {:?} carries no ErrorInfo of {}",
            status.code(),
            status.message(),
            rollout_checkpoint::domain()
        )
    })?;
    check("code", status.code(), code)?;
    check("reason", refusal.reason, reason)?;
    Ok(refusal.info.metadata)
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn connect(address: &str) -> Result<Channel> {
    Ok(Channel::from_shared(format!("http://{address}"))?
        .connect()
        .await?)
}

/// Reads a server stream to its end.
async fn drain<T>(mut stream: Streaming<T>) -> std::result::Result<Vec<T>, Status> {
    let mut messages = Vec::new();
    while let Some(message) = stream.message().await? {
        messages.push(message);
    }
    Ok(messages)
}

struct Controller {
    http_address: String,
    token: String,
    grpc_address: String,
    client: Participant,
    cookie: Option<String>,
    checkpoint_id: String,
    checkpoint_dir: PathBuf,
    boot_id: String,
    coordinator: Option<Coordinator>,
    replacement: Option<(Participant, String, String)>,
    readiness: Option<Streaming<HealthCheckResponse>>,
}

impl Controller {
    /// POSTs a data-plane route of the episode with that capture key, with the session cookie.
    async fn post(
        &mut self,
        address: &str,
        capture_key: &str,
        route: &str,
        body: Value,
    ) -> Result<Value> {
        let payload = body.to_string();
        let cookie = self
            .cookie
            .as_ref()
            .map(|c| format!("Cookie: {c}\r\n"))
            .unwrap_or_default();
        let head = format!(
            "POST /ng-rollout/{capture_key}/{route} HTTP/1.0\r\nHost: {address}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n{cookie}\r\n",
            payload.len()
        );
        let mut socket = tokio::net::TcpStream::connect(address).await?;
        socket
            .write_all(format!("{head}{payload}").as_bytes())
            .await?;
        let mut reply = Vec::new();
        socket.read_to_end(&mut reply).await?;
        let text = String::from_utf8(reply)?;
        let (headers, body) = text.split_once("\r\n\r\n").ok_or("no HTTP header end")?;
        if !headers.starts_with("HTTP/1.1 200") && !headers.starts_with("HTTP/1.0 200") {
            return Err(format!("{route}: {headers} {body}").into());
        }
        for line in headers.lines() {
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("set-cookie") {
                    self.cookie = value.trim().split(';').next().map(str::to_owned);
                }
            }
        }
        Ok(if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(body)?
        })
    }

    async fn get_participant(&mut self) -> Result {
        let reply = self
            .client
            .get_participant(request(GetParticipantRequest::default(), 10))
            .await?
            .into_inner();
        self.boot_id = reply.boot_id.clone();
        check("kind", reply.kind(), ParticipantKind::Resources)?;
        check("instance", reply.instance.as_str(), "counter")?;
        check("api_version", reply.api_version.as_str(), API_PACKAGE)?;
        check(
            "facts.mode",
            reply.facts.get("mode").map(String::as_str),
            Some("exported"),
        )
    }

    async fn seed_session(&mut self) -> Result {
        let address = self.http_address.clone();
        self.post(&address, "r1", "seed_session", json!({"initial_count": 3}))
            .await?;
        self.post(&address, "r1", "increment_counter", json!({"count": 2}))
            .await?;
        let reply = self
            .post(&address, "r1", "get_counter_value", json!({}))
            .await?;
        check("count", &reply["count"], &json!(5))
    }

    async fn prepare(&mut self) -> Result {
        let message = PrepareRequest {
            checkpoint_id: self.checkpoint_id.clone(),
            deadline: deadline_in(30),
            ..Default::default()
        };
        let messages = drain(
            self.client
                .prepare(request(message, 30))
                .await?
                .into_inner(),
        )
        .await?;
        let (first, last) = (
            messages.first().ok_or("an empty stream")?,
            messages.last().unwrap(),
        );
        println!("   {} message(s), PREPARED", messages.len());
        check(
            "first update_kind",
            first.update_kind(),
            PrepareUpdateKind::Initial,
        )?;
        check("last sequence", last.sequence, messages.len() as u64)?;
        check("final", last.r#final, true)?;
        check(
            "final update_kind",
            last.update_kind(),
            PrepareUpdateKind::Final,
        )?;
        check("final state", last.state(), ParticipantState::Prepared)?;
        check(
            "ready",
            last.readiness.as_ref().map(|r| r.ready),
            Some(true),
        )?;
        check("admission_open", last.admission_open, false)
    }

    fn commit_request(&self) -> CommitRequest {
        CommitRequest {
            checkpoint_id: self.checkpoint_id.clone(),
            deadline: deadline_in(30),
            checkpoint_dir: self.checkpoint_dir.to_string_lossy().into_owned(),
            ..Default::default() // scope unset: every live episode
        }
    }

    async fn commit(&mut self) -> Result {
        let dir = std::env::temp_dir().join(format!("conformance-rust-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        self.checkpoint_dir = dir.canonicalize()?; // absolute, normalized (no symlinked /tmp)
        let reply = self
            .client
            .commit(request(self.commit_request(), 30))
            .await?
            .into_inner();
        let manifest = reply.manifest.clone().ok_or("no manifest")?;
        let part = self.checkpoint_dir.join("participants/resources/counter");
        let manifest_bytes = std::fs::read(part.join("manifest.json"))?;
        let records = std::fs::read_to_string(part.join(&manifest.records_file))?;
        let lines: Vec<&str> = records.trim().lines().collect();
        let record: Value = serde_json::from_str(lines[0])?;
        check("state", reply.state(), ParticipantState::Committed)?;
        check("exported", reply.exported, vec!["r1".to_owned()])?;
        check("manifest.kind", manifest.kind(), ParticipantKind::Resources)?;
        check(
            "manifest.checkpoint_id",
            &manifest.checkpoint_id,
            &self.checkpoint_id,
        )?;
        check("manifest.record_count", manifest.record_count, 1)?;
        check(
            "manifest_sha256",
            sha256_hex(&manifest_bytes),
            reply.manifest_sha256,
        )?;
        check(
            "records_sha256",
            sha256_hex(records.as_bytes()),
            manifest.records_sha256,
        )?;
        check("records lines", lines.len(), 1)?;
        check(
            "record rollout",
            &record["episode_id"]["rollout_id"],
            &json!("r1"),
        )?;
        check("record state", &record["state"], &json!({"count": 5}))
    }

    async fn resume(&mut self) -> Result {
        let message = ResumeRequest {
            checkpoint_id: self.checkpoint_id.clone(),
            deadline: deadline_in(30),
        };
        let reply = self.client.resume(request(message, 30)).await?.into_inner();
        check("state", reply.state(), ParticipantState::Idle)?;
        check("idempotent", reply.idempotent, false)
    }

    async fn stale_commit(&mut self) -> Result {
        let result = self.client.commit(request(self.commit_request(), 30)).await;
        let metadata = refused(result, Code::Aborted, ErrorReason::StaleCheckpoint)?;
        let key = MetadataKey::CheckpointId.wire_value();
        check(key, metadata.get(key), Some(&self.checkpoint_id))
    }

    /// A deadline already past: CHECKPOINT_DEADLINE_EXCEEDED, and its `deadline` metadata reads
    /// back as the deadline sent, to the microsecond (a quarter second past a whole one is
    /// exact in the format's binary double).
    async fn late_renew(&mut self) -> Result {
        let seconds = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() - 10;
        let late = UNIX_EPOCH + Duration::from_millis(seconds * 1000 + 250);
        let message = RenewRequest {
            checkpoint_id: self.checkpoint_id.clone(),
            deadline: Some(Timestamp::from(late)),
        };
        let result = self.client.renew(request(message, 5)).await;
        let metadata = refused(
            result,
            Code::DeadlineExceeded,
            ErrorReason::CheckpointDeadlineExceeded,
        )?;
        let text = metadata
            .get(MetadataKey::Deadline.wire_value())
            .ok_or("no deadline metadata")?;
        check("deadline", parse_deadline(text)?, late)?;
        check("format_deadline", &format_deadline(late), text)
    }

    async fn wrong_token(&mut self) -> Result {
        let channel = connect(&self.grpc_address).await?;
        let mut client = ParticipantServiceClient::with_interceptor(
            channel,
            bearer_token(&format!("{}-wrong", self.token))?,
        );
        let result = client
            .get_participant(request(GetParticipantRequest::default(), 10))
            .await;
        refused(result, Code::Unauthenticated, ErrorReason::TokenInvalid).map(drop)
    }

    async fn health(&mut self) -> Result {
        let mut health = HealthClient::new(connect(&self.grpc_address).await?); // no token
        for name in [
            HealthServiceName::Server,
            HealthServiceName::ParticipantService,
            HealthServiceName::ParticipantLiveness,
            HealthServiceName::ParticipantReadiness,
        ] {
            let service = name.wire_value().to_owned();
            let reply = health
                .check(request(HealthCheckRequest { service }, 10))
                .await?
                .into_inner();
            check(
                &format!("health of {:?}", name.wire_value()),
                reply.status(),
                ServingStatus::Serving,
            )?;
        }
        Ok(())
    }

    fn coordinator(&mut self) -> Result<&mut Coordinator> {
        Ok(self.coordinator.as_mut().ok_or("no coordinator")?)
    }

    async fn list_participants(&mut self) -> Result {
        let reply = self
            .coordinator()?
            .list_participants(request(ListParticipantsRequest::default(), 10))
            .await?
            .into_inner();
        check("members", reply.members.len(), 1)?;
        let member = &reply.members[0];
        check("name", member.name.as_str(), "counter")?;
        check("kind", member.kind(), ParticipantKind::Resources)?;
        check(
            "boot_id (same process as GetParticipant)",
            &member.boot_id,
            &self.boot_id,
        )
    }

    async fn fleet_checkpoint(&mut self) -> Result {
        let message = CheckpointRequest {
            checkpoint_id: format!("{}-fleet", self.checkpoint_id),
            deadline: deadline_in(60),
            derive_scope: true, // continue every live episode
            ..Default::default()
        };
        let stream = self
            .coordinator()?
            .checkpoint(request(message, 60))
            .await?
            .into_inner();
        let messages = drain(stream).await?;
        let phases: Vec<CheckpointPhase> = messages.iter().map(|m| m.phase()).collect();
        let last = messages
            .iter()
            .rfind(|m| m.r#final)
            .ok_or_else(|| format!("no final message ({phases:?})"))?;
        let result = last.result.as_ref().ok_or("no result")?;
        let manifest = std::fs::read(PathBuf::from(&result.directory).join("checkpoint.json"))?;
        let continued: Vec<String> = result
            .continued
            .iter()
            .map(|e| format!("{}/{}", e.rollout_id, e.attempt))
            .collect();
        println!(
            "   {} message(s), published {}",
            messages.len(),
            result.directory
        );
        check(
            "first phase",
            phases.first(),
            Some(&CheckpointPhase::Prepare),
        )?;
        check("last phase", phases.last(), Some(&CheckpointPhase::Done))?;
        check("published", result.published, true)?;
        check(
            "prepare_outcome",
            result.prepare_outcome(),
            FleetPrepareOutcome::Prepared,
        )?;
        check("continued", continued, vec!["r1/0".to_owned()])?;
        check("record_count", result.record_count, 1)?;
        check(
            "fleet_manifest_sha256",
            sha256_hex(&manifest),
            result.fleet_manifest_sha256.clone(),
        )
    }

    /// Prepares the fleet again under the id the participant already resumed: the member
    /// refuses with STALE_CHECKPOINT, the coordinator with PARTICIPANT_FAILED naming it.
    async fn fleet_refusal(&mut self) -> Result {
        let message = CoordinatorServicePrepareRequest {
            checkpoint_id: self.checkpoint_id.clone(),
            deadline: deadline_in(10),
            ..Default::default()
        };
        let result = match self.coordinator()?.prepare(request(message, 10)).await {
            Ok(stream) => drain(stream.into_inner()).await,
            Err(status) => Err(status),
        };
        let metadata = refused(result, Code::Aborted, ErrorReason::ParticipantFailed)?;
        let key = MetadataKey::FailedMembers.wire_value();
        let want = format!("counter={}", ErrorReason::StaleCheckpoint.reason());
        check(key, metadata.get(key), Some(&want))
    }

    /// Continues episode r1 (attempt 0, as committed) from the participant's commit.
    fn restore_request(&self) -> RestoreRequest {
        RestoreRequest {
            checkpoint_id: format!("{}-restore", self.checkpoint_id),
            deadline: deadline_in(30),
            checkpoint_dir: self.checkpoint_dir.to_string_lossy().into_owned(),
            scope: Some(EpisodeScope {
                episodes: vec![EpisodeId {
                    rollout_id: "r1".into(),
                    attempt: 0,
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn replacement(&mut self) -> Result<&mut Participant> {
        Ok(&mut self.replacement.as_mut().ok_or("no replacement")?.0)
    }

    async fn fresh_process_required(&mut self) -> Result {
        let result = self
            .client
            .restore(request(self.restore_request(), 30))
            .await;
        refused(
            result,
            Code::FailedPrecondition,
            ErrorReason::FreshProcessRequired,
        )
        .map(drop)
    }

    /// A start-closed process is not ready until it is resumed: the Watch's first message.
    async fn watch_readiness(&mut self) -> Result {
        let address = self.replacement.as_ref().ok_or("no replacement")?.1.clone();
        let mut health = HealthClient::new(connect(&address).await?);
        let service = HealthServiceName::ParticipantReadiness
            .wire_value()
            .to_owned();
        let mut watch = rollout_checkpoint::tonic::Request::new(HealthCheckRequest { service });
        watch.set_timeout(Duration::from_secs(120));
        let mut stream = health.watch(watch).await?.into_inner();
        let first = stream.message().await?.ok_or("the Watch ended")?;
        self.readiness = Some(stream);
        check("first readiness", first.status(), ServingStatus::NotServing)
    }

    async fn restore_replacement(&mut self) -> Result {
        let message = self.restore_request();
        let reply = self
            .replacement()?
            .restore(request(message, 30))
            .await?
            .into_inner();
        check("state", reply.state(), ParticipantState::Restored)?;
        check(
            "source_checkpoint_id",
            &reply.source_checkpoint_id,
            &self.checkpoint_id,
        )?;
        check("restored", reply.restored, vec!["r1-a1".to_owned()])
    }

    /// Watch promises the eventual status, so NOT_SERVINGs before SERVING are skipped.
    async fn resume_replacement(&mut self) -> Result {
        let message = ResumeRequest {
            checkpoint_id: format!("{}-restore", self.checkpoint_id),
            deadline: deadline_in(30),
        };
        let reply = self
            .replacement()?
            .resume(request(message, 30))
            .await?
            .into_inner();
        check("state", reply.state(), ParticipantState::Idle)?;
        let stream = self.readiness.as_mut().ok_or("no Watch")?;
        while let Some(update) = stream.message().await? {
            if update.status() == ServingStatus::Serving {
                return Ok(());
            }
        }
        Err("the readiness Watch ended before SERVING".into())
    }

    /// The session on the replacement as attempt 1 (capture key r1-a1), with the old cookie.
    async fn restored_session(&mut self) -> Result {
        let address = self.replacement.as_ref().ok_or("no replacement")?.2.clone();
        let reply = self
            .post(&address, "r1-a1", "get_counter_value", json!({}))
            .await?;
        check("count", &reply["count"], &json!(5))
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        eprintln!("set {name}");
        std::process::exit(2)
    })
}

async fn participant(address: &str, token: &str) -> Result<Participant> {
    Ok(ParticipantServiceClient::with_interceptor(
        connect(address).await?,
        bearer_token(token)?,
    ))
}

const STEPS: &[&str] = &[
    "GetParticipant: kind RESOURCES, instance counter",
    "seed a session over HTTP (count 3) and increment it (+2)",
    "Prepare: read the stream to its final message, PREPARED",
    "Commit into a temporary directory: manifest, exported r1, records on disk",
    "Resume: IDLE, not idempotent the first time",
    "Commit after Resume: ABORTED, ErrorInfo STALE_CHECKPOINT",
    "Renew with a deadline already past: CHECKPOINT_DEADLINE_EXCEEDED, its deadline metadata",
    "a wrong token: UNAUTHENTICATED, ErrorInfo TOKEN_INVALID",
    "grpc.health.v1.Health/Check without a token: SERVING",
    "CoordinatorService/ListParticipants: the counter, same boot_id",
    "CoordinatorService/Checkpoint: stream to DONE, published, continued r1",
    "CoordinatorService/Prepare of a resumed id: PARTICIPANT_FAILED (counter=STALE_CHECKPOINT)",
    "Restore into the participant that served: FAILED_PRECONDITION, FRESH_PROCESS_REQUIRED",
    "grpc.health.v1.Health/Watch of the start-closed replacement's readiness: NOT_SERVING",
    "Restore into the start-closed replacement: RESTORED, r1 as attempt 1 (r1-a1)",
    "Resume the replacement: IDLE, and the readiness Watch streams SERVING",
    "the restored session on the replacement over HTTP: count 5",
];

async fn run_step(c: &mut Controller, index: usize) -> Result {
    match index {
        0 => c.get_participant().await,
        1 => c.seed_session().await,
        2 => c.prepare().await,
        3 => c.commit().await,
        4 => c.resume().await,
        5 => c.stale_commit().await,
        6 => c.late_renew().await,
        7 => c.wrong_token().await,
        8 => c.health().await,
        9 => c.list_participants().await,
        10 => c.fleet_checkpoint().await,
        11 => c.fleet_refusal().await,
        12 => c.fresh_process_required().await,
        13 => c.watch_readiness().await,
        14 => c.restore_replacement().await,
        15 => c.resume_replacement().await,
        _ => c.restored_session().await,
    }
}

#[tokio::main]
async fn main() -> Result {
    let (grpc_address, token) = (env("CONFORMANCE_GRPC_ADDRESS"), env("CONFORMANCE_TOKEN"));
    let mut c = Controller {
        http_address: env("CONFORMANCE_HTTP_ADDRESS"),
        client: participant(&grpc_address, &token).await?,
        coordinator: None,
        replacement: None,
        grpc_address,
        token,
        cookie: None,
        checkpoint_id: format!("rust-{}", std::process::id()),
        checkpoint_dir: PathBuf::new(),
        boot_id: String::new(),
        readiness: None,
    };
    // Steps 10-12 need a coordinator, 13-17 a replacement: without them the run is shorter.
    let mut count = 9;
    if let Ok(address) = std::env::var("CONFORMANCE_COORDINATOR_ADDRESS") {
        let channel = connect(&address).await?;
        c.coordinator = Some(CoordinatorServiceClient::with_interceptor(
            channel,
            bearer_token(&c.token)?,
        ));
        count = 12;
    }
    if let Ok(address) = std::env::var("CONFORMANCE_REPLACEMENT_GRPC_ADDRESS") {
        let http = env("CONFORMANCE_REPLACEMENT_HTTP_ADDRESS");
        c.replacement = Some((participant(&address, &c.token).await?, address, http));
        count = STEPS.len();
    }
    let mut failed = false;
    for (index, name) in STEPS.iter().enumerate().take(count) {
        if failed {
            println!("skip {} - {name}", index + 1);
        } else if let Err(error) = run_step(&mut c, index).await {
            failed = true;
            println!("not ok {} - {name}\n   {error}", index + 1);
        } else {
            println!("ok {} - {name}", index + 1);
        }
    }
    if c.checkpoint_dir.is_dir() {
        std::fs::remove_dir_all(&c.checkpoint_dir)?;
    }
    if failed {
        println!("rust controller: FAILED");
        std::process::exit(1);
    }
    println!("rust controller: all {count} steps passed");
    Ok(())
}
