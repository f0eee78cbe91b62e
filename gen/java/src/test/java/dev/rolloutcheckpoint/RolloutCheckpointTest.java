package dev.rolloutcheckpoint;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.google.protobuf.Any;
import com.google.rpc.ErrorInfo;
import dev.rolloutcheckpoint.v1.ErrorReason;
import dev.rolloutcheckpoint.v1.HealthServiceName;
import dev.rolloutcheckpoint.v1.MetadataKey;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.protobuf.StatusProto;
import java.time.Instant;
import java.util.Optional;
import org.junit.jupiter.api.Test;

class RolloutCheckpointTest {
  private static StatusRuntimeException refusal(Status.Code code, ErrorInfo info) {
    com.google.rpc.Status status =
        com.google.rpc.Status.newBuilder()
            .setCode(code.value())
            .setMessage("refused")
            .addDetails(Any.pack(info))
            .build();
    return StatusProto.toStatusRuntimeException(status);
  }

  @Test
  void constantsComeFromTheProtos() {
    assertEquals("rollout-checkpoint.dev", RolloutCheckpoint.DOMAIN);
    assertEquals("rollout_checkpoint.v1", RolloutCheckpoint.API_PACKAGE);
    assertEquals("v1", RolloutCheckpoint.API_VERSION);
    assertEquals("1.2.0", RolloutCheckpoint.VERSION);
    assertEquals(
        "participant-readiness",
        RolloutCheckpoint.wireValue(HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS));
    assertEquals("", RolloutCheckpoint.wireValue(HealthServiceName.HEALTH_SERVICE_NAME_SERVER));
    assertEquals(
        "failedMembers", RolloutCheckpoint.wireValue(MetadataKey.METADATA_KEY_FAILED_MEMBERS));
  }

  @Test
  void reasonsRoundTrip() {
    assertEquals(
        "STALE_CHECKPOINT", RolloutCheckpoint.reason(ErrorReason.ERROR_REASON_STALE_CHECKPOINT));
    assertEquals(
        Optional.of(ErrorReason.ERROR_REASON_TOKEN_INVALID),
        RolloutCheckpoint.parseReason("TOKEN_INVALID"));
    assertEquals(Optional.empty(), RolloutCheckpoint.parseReason("UNSPECIFIED"));
    assertEquals(Optional.empty(), RolloutCheckpoint.parseReason("A_REASON_FROM_A_NEWER_SERVER"));
  }

  @Test
  void reasonOfReadsTheErrorInfoOfThisDomainOnly() {
    ErrorInfo stale =
        ErrorInfo.newBuilder()
            .setReason("STALE_CHECKPOINT")
            .setDomain(RolloutCheckpoint.DOMAIN)
            .putMetadata("checkpointId", "c1")
            .build();
    RolloutCheckpoint.Refusal refusal =
        RolloutCheckpoint.reasonOf(refusal(Status.Code.ABORTED, stale)).orElseThrow();
    assertEquals(Status.Code.ABORTED, refusal.code());
    assertEquals(ErrorReason.ERROR_REASON_STALE_CHECKPOINT, refusal.reason());
    assertEquals(Optional.of("c1"), refusal.metadata(MetadataKey.METADATA_KEY_CHECKPOINT_ID));

    ErrorInfo newer = stale.toBuilder().setReason("A_REASON_FROM_A_NEWER_SERVER").build();
    RolloutCheckpoint.Refusal unknown =
        RolloutCheckpoint.reasonOf(refusal(Status.Code.ABORTED, newer)).orElseThrow();
    assertEquals(ErrorReason.ERROR_REASON_UNSPECIFIED, unknown.reason());
    assertEquals("A_REASON_FROM_A_NEWER_SERVER", unknown.info().getReason());

    ErrorInfo foreign = stale.toBuilder().setDomain("example.com").build();
    assertTrue(RolloutCheckpoint.reasonOf(refusal(Status.Code.ABORTED, foreign)).isEmpty());
    assertTrue(
        RolloutCheckpoint.reasonOf(Status.UNAVAILABLE.withDescription("down").asRuntimeException())
            .isEmpty());
  }

  @Test
  void deadlinesRoundTripAndRejectOtherFormats() {
    Instant time = Instant.ofEpochMilli(1_767_225_600_250L);
    assertEquals("1767225600.250000", RolloutCheckpoint.formatDeadline(time));
    assertEquals(time, RolloutCheckpoint.parseDeadline("1767225600.250000"));
    for (String bad : new String[] {"1767225600", "1767225600.25", "-1.000000", "1.+00000", "a.000000"}) {
      assertThrows(IllegalArgumentException.class, () -> RolloutCheckpoint.parseDeadline(bad), bad);
    }
  }

  @Test
  void aBearerTokenMustBeValidMetadata() {
    RolloutCheckpoint.bearerToken("change-me");
    assertThrows(IllegalArgumentException.class, () -> RolloutCheckpoint.bearerToken("line\nbreak"));
  }
}
