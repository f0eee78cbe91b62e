package dev.rolloutcheckpoint.conformance;

import static dev.rolloutcheckpoint.RolloutCheckpoint.bearerToken;
import static dev.rolloutcheckpoint.RolloutCheckpoint.formatDeadline;
import static dev.rolloutcheckpoint.RolloutCheckpoint.parseDeadline;
import static dev.rolloutcheckpoint.RolloutCheckpoint.reasonOf;
import static dev.rolloutcheckpoint.RolloutCheckpoint.wireValue;

import com.google.protobuf.Struct;
import com.google.protobuf.Timestamp;
import com.google.protobuf.Value;
import com.google.protobuf.util.JsonFormat;
import dev.rolloutcheckpoint.RolloutCheckpoint;
import dev.rolloutcheckpoint.RolloutCheckpoint.Refusal;
import dev.rolloutcheckpoint.v1.CheckpointPhase;
import dev.rolloutcheckpoint.v1.CheckpointRequest;
import dev.rolloutcheckpoint.v1.CheckpointResponse;
import dev.rolloutcheckpoint.v1.CheckpointResult;
import dev.rolloutcheckpoint.v1.CommitRequest;
import dev.rolloutcheckpoint.v1.CommitResponse;
import dev.rolloutcheckpoint.v1.CoordinatorServiceGrpc;
import dev.rolloutcheckpoint.v1.CoordinatorServiceGrpc.CoordinatorServiceBlockingStub;
import dev.rolloutcheckpoint.v1.CoordinatorServicePrepareRequest;
import dev.rolloutcheckpoint.v1.EpisodeId;
import dev.rolloutcheckpoint.v1.EpisodeScope;
import dev.rolloutcheckpoint.v1.ErrorReason;
import dev.rolloutcheckpoint.v1.FleetPrepareOutcome;
import dev.rolloutcheckpoint.v1.GetParticipantRequest;
import dev.rolloutcheckpoint.v1.GetParticipantResponse;
import dev.rolloutcheckpoint.v1.HealthServiceName;
import dev.rolloutcheckpoint.v1.ListParticipantsRequest;
import dev.rolloutcheckpoint.v1.ListParticipantsResponse;
import dev.rolloutcheckpoint.v1.Manifest;
import dev.rolloutcheckpoint.v1.Member;
import dev.rolloutcheckpoint.v1.MetadataKey;
import dev.rolloutcheckpoint.v1.ParticipantKind;
import dev.rolloutcheckpoint.v1.ParticipantServiceGrpc;
import dev.rolloutcheckpoint.v1.ParticipantServiceGrpc.ParticipantServiceBlockingStub;
import dev.rolloutcheckpoint.v1.ParticipantState;
import dev.rolloutcheckpoint.v1.PrepareRequest;
import dev.rolloutcheckpoint.v1.PrepareResponse;
import dev.rolloutcheckpoint.v1.PrepareUpdateKind;
import dev.rolloutcheckpoint.v1.RenewRequest;
import dev.rolloutcheckpoint.v1.RestoreRequest;
import dev.rolloutcheckpoint.v1.RestoreResponse;
import dev.rolloutcheckpoint.v1.ResumeRequest;
import dev.rolloutcheckpoint.v1.ResumeResponse;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Status;
import io.grpc.health.v1.HealthCheckRequest;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.health.v1.HealthCheckResponse.ServingStatus;
import io.grpc.health.v1.HealthGrpc;
import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.HexFormat;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;

/**
 * A Java controller that drives one real rollout-checkpoint participant (the counter example)
 * through the contract, then a coordinator whose fleet it is, then a Restore into a start-closed
 * replacement: the same steps as tests/conformance/rust/src/main.rs, printed one line each,
 * exiting 1 at the first failed one. tests/test_conformance.py starts the servers and passes their
 * addresses in CONFORMANCE_* variables.
 *
 * <p>Everything it uses of the contract comes from the package gen/java
 * (dev.rolloutcheckpoint:rollout-checkpoint): the generated messages and stubs, grpc-java's health
 * client as it brings it, and the helper layer (bearerToken, reasonOf, wireValue, parseDeadline);
 * it writes no codegen and no helper of its own. HTTP (the data plane) is the JDK's client.
 */
public final class Controller {
  private interface Step {
    void run() throws Exception;
  }

  private static final class Failure extends Exception {
    Failure(String message) {
      super(message);
    }
  }

  private final List<ManagedChannel> channels = new ArrayList<>();
  private final HttpClient http = HttpClient.newHttpClient();
  private final String token;
  private final String grpcAddress;
  private final String httpAddress;
  private final String checkpointId = "java-" + ProcessHandle.current().pid();
  private final ParticipantServiceBlockingStub participant;
  private CoordinatorServiceBlockingStub coordinator;
  private ParticipantServiceBlockingStub replacement;
  private String replacementGrpc;
  private String replacementHttp;
  private Iterator<HealthCheckResponse> readiness;
  private String cookie;
  private Path checkpointDir;
  private String bootId;

  private Controller(String grpcAddress, String httpAddress, String token) {
    this.grpcAddress = grpcAddress;
    this.httpAddress = httpAddress;
    this.token = token;
    this.participant = participantAt(grpcAddress, token);
  }

  private static void check(String what, Object got, Object want) throws Failure {
    if (!Objects.equals(got, want)) {
      throw new Failure(what + ": got " + got + ", want " + want);
    }
  }

  private ManagedChannel connect(String address) {
    ManagedChannel channel = ManagedChannelBuilder.forTarget(address).usePlaintext().build();
    channels.add(channel);
    return channel;
  }

  private ParticipantServiceBlockingStub participantAt(String address, String bearer) {
    return ParticipantServiceGrpc.newBlockingStub(connect(address))
        .withCallCredentials(bearerToken(bearer));
  }

  /** An absolute request deadline {@code seconds} from now. */
  private static Timestamp deadlineIn(long seconds) {
    return timestamp(Instant.now().plusSeconds(seconds));
  }

  private static Timestamp timestamp(Instant time) {
    return Timestamp.newBuilder()
        .setSeconds(time.getEpochSecond())
        .setNanos(time.getNano())
        .build();
  }

  /** The gRPC timeout of a request whose deadline is {@code seconds} away: a little later, so
   * the participant (not the transport) reports a miss. */
  private static <S extends io.grpc.stub.AbstractStub<S>> S within(S stub, long seconds) {
    return stub.withDeadlineAfter(seconds + 5, TimeUnit.SECONDS);
  }

  /** A call failed with this code and typed reason: the refusal's metadata. */
  private static Refusal refused(Step call, Status.Code code, ErrorReason reason)
      throws Exception {
    try {
      call.run();
    } catch (io.grpc.StatusRuntimeException error) {
      Refusal refusal =
          reasonOf(error)
              .orElseThrow(
                  () ->
                      new Failure(
                          error.getStatus() + " carries no ErrorInfo of "
                              + RolloutCheckpoint.DOMAIN));
      check("code", refusal.code(), code);
      check("reason", refusal.reason(), reason);
      return refusal;
    }
    throw new Failure("expected " + RolloutCheckpoint.reason(reason) + ", the call succeeded");
  }

  private static String sha256Hex(byte[] bytes) throws NoSuchAlgorithmException {
    return HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(bytes));
  }

  private static Struct parseJson(String text) throws IOException {
    Struct.Builder struct = Struct.newBuilder();
    JsonFormat.parser().merge(text, struct);
    return struct.build();
  }

  private static Value number(double value) {
    return Value.newBuilder().setNumberValue(value).build();
  }

  /** POSTs a data-plane route of the episode with that capture key, with the session cookie. */
  private Struct post(String address, String captureKey, String route, String body)
      throws Exception {
    HttpRequest.Builder request =
        HttpRequest.newBuilder(URI.create("http://" + address + "/ng-rollout/" + captureKey + "/" + route))
            .header("Content-Type", "application/json")
            .timeout(Duration.ofSeconds(30))
            .POST(HttpRequest.BodyPublishers.ofString(body));
    if (cookie != null) {
      request.header("Cookie", cookie);
    }
    HttpResponse<String> reply = http.send(request.build(), HttpResponse.BodyHandlers.ofString());
    if (reply.statusCode() != 200) {
      throw new Failure(route + ": HTTP " + reply.statusCode() + " " + reply.body());
    }
    reply.headers().firstValue("set-cookie").ifPresent(value -> cookie = value.split(";", 2)[0]);
    return reply.body().isEmpty() ? Struct.getDefaultInstance() : parseJson(reply.body());
  }

  private void getParticipant() throws Exception {
    GetParticipantResponse reply =
        within(participant, 10).getParticipant(GetParticipantRequest.getDefaultInstance());
    bootId = reply.getBootId();
    check("kind", reply.getKind(), ParticipantKind.PARTICIPANT_KIND_RESOURCES);
    check("instance", reply.getInstance(), "counter");
    check("api_version", reply.getApiVersion(), RolloutCheckpoint.API_PACKAGE);
    check("facts.mode", reply.getFactsMap().get("mode"), "exported");
  }

  private void seedSession() throws Exception {
    post(httpAddress, "r1", "seed_session", "{\"initial_count\": 3}");
    post(httpAddress, "r1", "increment_counter", "{\"count\": 2}");
    Struct reply = post(httpAddress, "r1", "get_counter_value", "{}");
    check("count", reply.getFieldsMap().get("count"), number(5));
  }

  private void prepare() throws Exception {
    PrepareRequest request =
        PrepareRequest.newBuilder().setCheckpointId(checkpointId).setDeadline(deadlineIn(30)).build();
    List<PrepareResponse> messages = new ArrayList<>();
    within(participant, 30).prepare(request).forEachRemaining(messages::add);
    if (messages.isEmpty()) {
      throw new Failure("an empty stream");
    }
    PrepareResponse first = messages.get(0);
    PrepareResponse last = messages.get(messages.size() - 1);
    System.out.println("   " + messages.size() + " message(s), PREPARED");
    check("first update_kind", first.getUpdateKind(), PrepareUpdateKind.PREPARE_UPDATE_KIND_INITIAL);
    check("last sequence", last.getSequence(), (long) messages.size());
    check("final", last.getFinal(), true);
    check("final update_kind", last.getUpdateKind(), PrepareUpdateKind.PREPARE_UPDATE_KIND_FINAL);
    check("final state", last.getState(), ParticipantState.PARTICIPANT_STATE_PREPARED);
    check("ready", last.getReadiness().getReady(), true);
    check("admission_open", last.getAdmissionOpen(), false);
  }

  private CommitRequest commitRequest() {
    return CommitRequest.newBuilder()
        .setCheckpointId(checkpointId)
        .setDeadline(deadlineIn(30))
        .setCheckpointDir(checkpointDir.toString())
        .build(); // scope unset: every live episode
  }

  private void commit() throws Exception {
    // Absolute and normalized (no symlinked /tmp), as the participant writes it.
    checkpointDir = Files.createTempDirectory("conformance-java-").toRealPath();
    CommitResponse reply = within(participant, 30).commit(commitRequest());
    Manifest manifest = reply.getManifest();
    Path part = checkpointDir.resolve("participants/resources/counter");
    byte[] manifestBytes = Files.readAllBytes(part.resolve("manifest.json"));
    String records = Files.readString(part.resolve(manifest.getRecordsFile()));
    List<String> lines = records.strip().lines().toList();
    Struct record = parseJson(lines.get(0));
    check("state", reply.getState(), ParticipantState.PARTICIPANT_STATE_COMMITTED);
    check("exported", reply.getExportedList(), List.of("r1"));
    check("manifest.kind", manifest.getKind(), ParticipantKind.PARTICIPANT_KIND_RESOURCES);
    check("manifest.checkpoint_id", manifest.getCheckpointId(), checkpointId);
    check("manifest.record_count", manifest.getRecordCount(), 1L);
    check("manifest_sha256", sha256Hex(manifestBytes), reply.getManifestSha256());
    check(
        "records_sha256",
        sha256Hex(records.getBytes(StandardCharsets.UTF_8)),
        manifest.getRecordsSha256());
    check("records lines", lines.size(), 1);
    Struct episode = record.getFieldsMap().get("episode_id").getStructValue();
    check("record rollout", episode.getFieldsMap().get("rollout_id").getStringValue(), "r1");
    Struct state = record.getFieldsMap().get("state").getStructValue();
    check("record state", state.getFieldsMap(), Map.of("count", number(5)));
  }

  private void resume() throws Exception {
    ResumeRequest request =
        ResumeRequest.newBuilder().setCheckpointId(checkpointId).setDeadline(deadlineIn(30)).build();
    ResumeResponse reply = within(participant, 30).resume(request);
    check("state", reply.getState(), ParticipantState.PARTICIPANT_STATE_IDLE);
    check("idempotent", reply.getIdempotent(), false);
  }

  private void staleCommit() throws Exception {
    Refusal refusal =
        refused(
            () -> within(participant, 30).commit(commitRequest()),
            Status.Code.ABORTED,
            ErrorReason.ERROR_REASON_STALE_CHECKPOINT);
    check(
        wireValue(MetadataKey.METADATA_KEY_CHECKPOINT_ID),
        refusal.metadata(MetadataKey.METADATA_KEY_CHECKPOINT_ID).orElse(null),
        checkpointId);
  }

  /**
   * A deadline already past: CHECKPOINT_DEADLINE_EXCEEDED, and its {@code deadline} metadata
   * reads back as the deadline sent, to the microsecond (a quarter second past a whole one is
   * exact in the format's binary double).
   */
  private void lateRenew() throws Exception {
    Instant late = Instant.ofEpochSecond(Instant.now().getEpochSecond() - 10, 250_000_000);
    RenewRequest request =
        RenewRequest.newBuilder().setCheckpointId(checkpointId).setDeadline(timestamp(late)).build();
    Refusal refusal =
        refused(
            () -> within(participant, 5).renew(request),
            Status.Code.DEADLINE_EXCEEDED,
            ErrorReason.ERROR_REASON_CHECKPOINT_DEADLINE_EXCEEDED);
    String text =
        refusal
            .metadata(MetadataKey.METADATA_KEY_DEADLINE)
            .orElseThrow(() -> new Failure("no deadline metadata"));
    check("deadline", parseDeadline(text), late);
    check("formatDeadline", formatDeadline(late), text);
  }

  private void wrongToken() throws Exception {
    ParticipantServiceBlockingStub wrong = participantAt(grpcAddress, token + "-wrong");
    refused(
        () -> within(wrong, 10).getParticipant(GetParticipantRequest.getDefaultInstance()),
        Status.Code.UNAUTHENTICATED,
        ErrorReason.ERROR_REASON_TOKEN_INVALID);
  }

  private void health() throws Exception {
    HealthGrpc.HealthBlockingStub health = HealthGrpc.newBlockingStub(connect(grpcAddress));
    for (HealthServiceName name :
        List.of(
            HealthServiceName.HEALTH_SERVICE_NAME_SERVER,
            HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_SERVICE,
            HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS,
            HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS)) {
      HealthCheckRequest request =
          HealthCheckRequest.newBuilder().setService(wireValue(name)).build(); // no token
      HealthCheckResponse reply = within(health, 10).check(request);
      check("health of \"" + wireValue(name) + "\"", reply.getStatus(), ServingStatus.SERVING);
    }
  }

  private void listParticipants() throws Exception {
    ListParticipantsResponse reply =
        within(coordinator, 10).listParticipants(ListParticipantsRequest.getDefaultInstance());
    check("members", reply.getMembersCount(), 1);
    Member member = reply.getMembers(0);
    check("name", member.getName(), "counter");
    check("kind", member.getKind(), ParticipantKind.PARTICIPANT_KIND_RESOURCES);
    check("boot_id (same process as GetParticipant)", member.getBootId(), bootId);
  }

  private void fleetCheckpoint() throws Exception {
    CheckpointRequest request =
        CheckpointRequest.newBuilder()
            .setCheckpointId(checkpointId + "-fleet")
            .setDeadline(deadlineIn(60))
            .setDeriveScope(true) // continue every live episode
            .build();
    List<CheckpointResponse> messages = new ArrayList<>();
    within(coordinator, 60).checkpoint(request).forEachRemaining(messages::add);
    List<CheckpointPhase> phases = messages.stream().map(CheckpointResponse::getPhase).toList();
    CheckpointResponse last =
        messages.stream()
            .filter(CheckpointResponse::getFinal)
            .reduce((a, b) -> b)
            .orElseThrow(() -> new Failure("no final message (" + phases + ")"));
    CheckpointResult result = last.getResult();
    byte[] manifest = Files.readAllBytes(Path.of(result.getDirectory(), "checkpoint.json"));
    List<String> continued =
        result.getContinuedList().stream()
            .map(e -> e.getRolloutId() + "/" + e.getAttempt())
            .toList();
    System.out.println(
        "   " + messages.size() + " message(s), published " + result.getDirectory());
    check("first phase", phases.get(0), CheckpointPhase.CHECKPOINT_PHASE_PREPARE);
    check("last phase", phases.get(phases.size() - 1), CheckpointPhase.CHECKPOINT_PHASE_DONE);
    check("published", result.getPublished(), true);
    check(
        "prepare_outcome",
        result.getPrepareOutcome(),
        FleetPrepareOutcome.FLEET_PREPARE_OUTCOME_PREPARED);
    check("continued", continued, List.of("r1/0"));
    check("record_count", result.getRecordCount(), 1L);
    check("fleet_manifest_sha256", sha256Hex(manifest), result.getFleetManifestSha256());
  }

  /**
   * Prepares the fleet again under the id the participant already resumed: the member refuses
   * with STALE_CHECKPOINT, the coordinator with PARTICIPANT_FAILED naming it.
   */
  private void fleetRefusal() throws Exception {
    CoordinatorServicePrepareRequest request =
        CoordinatorServicePrepareRequest.newBuilder()
            .setCheckpointId(checkpointId)
            .setDeadline(deadlineIn(10))
            .build();
    Refusal refusal =
        refused(
            () -> within(coordinator, 10).prepare(request).forEachRemaining(update -> {}),
            Status.Code.ABORTED,
            ErrorReason.ERROR_REASON_PARTICIPANT_FAILED);
    check(
        wireValue(MetadataKey.METADATA_KEY_FAILED_MEMBERS),
        refusal.metadata(MetadataKey.METADATA_KEY_FAILED_MEMBERS).orElse(null),
        "counter=" + RolloutCheckpoint.reason(ErrorReason.ERROR_REASON_STALE_CHECKPOINT));
  }

  /** Continues episode r1 (attempt 0, as committed) from the participant's commit. */
  private RestoreRequest restoreRequest() {
    EpisodeId episode = EpisodeId.newBuilder().setRolloutId("r1").setAttempt(0).build();
    return RestoreRequest.newBuilder()
        .setCheckpointId(checkpointId + "-restore")
        .setDeadline(deadlineIn(30))
        .setCheckpointDir(checkpointDir.toString())
        .setScope(EpisodeScope.newBuilder().addEpisodes(episode))
        .build();
  }

  private void freshProcessRequired() throws Exception {
    refused(
        () -> within(participant, 30).restore(restoreRequest()),
        Status.Code.FAILED_PRECONDITION,
        ErrorReason.ERROR_REASON_FRESH_PROCESS_REQUIRED);
  }

  /** A start-closed process is not ready until it is resumed: the Watch's first message. */
  private void watchReadiness() throws Exception {
    HealthCheckRequest request =
        HealthCheckRequest.newBuilder()
            .setService(wireValue(HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS))
            .build();
    readiness =
        HealthGrpc.newBlockingStub(connect(replacementGrpc))
            .withDeadlineAfter(120, TimeUnit.SECONDS)
            .watch(request);
    if (!readiness.hasNext()) {
      throw new Failure("the Watch ended");
    }
    check("first readiness", readiness.next().getStatus(), ServingStatus.NOT_SERVING);
  }

  private void restoreReplacement() throws Exception {
    RestoreResponse reply = within(replacement, 30).restore(restoreRequest());
    check("state", reply.getState(), ParticipantState.PARTICIPANT_STATE_RESTORED);
    check("source_checkpoint_id", reply.getSourceCheckpointId(), checkpointId);
    check("restored", reply.getRestoredList(), List.of("r1-a1"));
  }

  /** Watch promises the eventual status, so NOT_SERVINGs before SERVING are skipped. */
  private void resumeReplacement() throws Exception {
    ResumeRequest request =
        ResumeRequest.newBuilder()
            .setCheckpointId(checkpointId + "-restore")
            .setDeadline(deadlineIn(30))
            .build();
    ResumeResponse reply = within(replacement, 30).resume(request);
    check("state", reply.getState(), ParticipantState.PARTICIPANT_STATE_IDLE);
    while (readiness.hasNext()) {
      if (readiness.next().getStatus() == ServingStatus.SERVING) {
        return;
      }
    }
    throw new Failure("the readiness Watch ended before SERVING");
  }

  /** The session on the replacement as attempt 1 (capture key r1-a1), with the old cookie. */
  private void restoredSession() throws Exception {
    Struct reply = post(replacementHttp, "r1-a1", "get_counter_value", "{}");
    check("count", reply.getFieldsMap().get("count"), number(5));
  }

  private static String env(String name) {
    String value = System.getenv(name);
    if (value == null) {
      System.err.println("set " + name);
      System.exit(2);
    }
    return value;
  }

  private record Named(String name, Step step) {}

  private List<Named> steps() {
    List<Named> steps =
        new ArrayList<>(
            List.of(
                new Named("GetParticipant: kind RESOURCES, instance counter", this::getParticipant),
                new Named(
                    "seed a session over HTTP (count 3) and increment it (+2)", this::seedSession),
                new Named("Prepare: read the stream to its final message, PREPARED", this::prepare),
                new Named(
                    "Commit into a temporary directory: manifest, exported r1, records on disk",
                    this::commit),
                new Named("Resume: IDLE, not idempotent the first time", this::resume),
                new Named(
                    "Commit after Resume: ABORTED, ErrorInfo STALE_CHECKPOINT", this::staleCommit),
                new Named(
                    "Renew with a deadline already past: CHECKPOINT_DEADLINE_EXCEEDED, its"
                        + " deadline metadata",
                    this::lateRenew),
                new Named("a wrong token: UNAUTHENTICATED, ErrorInfo TOKEN_INVALID", this::wrongToken),
                new Named("grpc.health.v1.Health/Check without a token: SERVING", this::health)));
    // Steps 10-12 need a coordinator, 13-17 a replacement: without them the run is shorter.
    if (coordinator != null) {
      steps.add(
          new Named(
              "CoordinatorService/ListParticipants: the counter, same boot_id",
              this::listParticipants));
      steps.add(
          new Named(
              "CoordinatorService/Checkpoint: stream to DONE, published, continued r1",
              this::fleetCheckpoint));
      steps.add(
          new Named(
              "CoordinatorService/Prepare of a resumed id: PARTICIPANT_FAILED"
                  + " (counter=STALE_CHECKPOINT)",
              this::fleetRefusal));
    }
    if (coordinator != null && replacement != null) {
      steps.add(
          new Named(
              "Restore into the participant that served: FAILED_PRECONDITION,"
                  + " FRESH_PROCESS_REQUIRED",
              this::freshProcessRequired));
      steps.add(
          new Named(
              "grpc.health.v1.Health/Watch of the start-closed replacement's readiness:"
                  + " NOT_SERVING",
              this::watchReadiness));
      steps.add(
          new Named(
              "Restore into the start-closed replacement: RESTORED, r1 as attempt 1 (r1-a1)",
              this::restoreReplacement));
      steps.add(
          new Named(
              "Resume the replacement: IDLE, and the readiness Watch streams SERVING",
              this::resumeReplacement));
      steps.add(
          new Named(
              "the restored session on the replacement over HTTP: count 5",
              this::restoredSession));
    }
    return steps;
  }

  /** Runs the steps in order; the first failure skips the rest. True when all passed. */
  private boolean runSteps(List<Named> steps) {
    boolean failed = false;
    for (int index = 0; index < steps.size(); index++) {
      Named named = steps.get(index);
      if (failed) {
        System.out.println("skip " + (index + 1) + " - " + named.name());
        continue;
      }
      try {
        named.step().run();
        System.out.println("ok " + (index + 1) + " - " + named.name());
      } catch (Exception error) {
        failed = true;
        System.out.println("not ok " + (index + 1) + " - " + named.name() + "\n   " + error);
      }
    }
    return !failed;
  }

  private void close() throws IOException {
    for (ManagedChannel channel : channels) {
      channel.shutdownNow();
    }
    if (checkpointDir != null && Files.isDirectory(checkpointDir)) {
      try (Stream<Path> paths = Files.walk(checkpointDir)) {
        for (Path path : paths.sorted(Comparator.reverseOrder()).toList()) {
          Files.delete(path);
        }
      }
    }
  }

  public static void main(String[] args) throws IOException {
    Controller c =
        new Controller(
            env("CONFORMANCE_GRPC_ADDRESS"),
            env("CONFORMANCE_HTTP_ADDRESS"),
            env("CONFORMANCE_TOKEN"));
    String coordinatorAddress = System.getenv("CONFORMANCE_COORDINATOR_ADDRESS");
    if (coordinatorAddress != null) {
      c.coordinator =
          CoordinatorServiceGrpc.newBlockingStub(c.connect(coordinatorAddress))
              .withCallCredentials(bearerToken(c.token));
    }
    String replacementAddress = System.getenv("CONFORMANCE_REPLACEMENT_GRPC_ADDRESS");
    if (replacementAddress != null) {
      c.replacementGrpc = replacementAddress;
      c.replacementHttp = env("CONFORMANCE_REPLACEMENT_HTTP_ADDRESS");
      c.replacement = c.participantAt(replacementAddress, c.token);
    }
    List<Named> steps = c.steps();
    boolean passed = c.runSteps(steps);
    c.close();
    if (!passed) {
      System.out.println("java controller: FAILED");
      System.exit(1);
    }
    System.out.println("java controller: all " + steps.size() + " steps passed");
  }
}
