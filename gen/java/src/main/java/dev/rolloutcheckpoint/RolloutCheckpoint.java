package dev.rolloutcheckpoint;

import com.google.protobuf.Any;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.protobuf.ProtocolMessageEnum;
import com.google.rpc.ErrorInfo;
import dev.rolloutcheckpoint.v1.ConstantsProto;
import dev.rolloutcheckpoint.v1.ErrorDomain;
import dev.rolloutcheckpoint.v1.ErrorReason;
import dev.rolloutcheckpoint.v1.MetadataKey;
import io.grpc.CallCredentials;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.protobuf.StatusProto;
import java.io.IOException;
import java.io.InputStream;
import java.io.UncheckedIOException;
import java.math.BigDecimal;
import java.math.RoundingMode;
import java.time.Instant;
import java.util.Objects;
import java.util.Optional;
import java.util.Properties;
import java.util.concurrent.Executor;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The helper layer over the generated {@code dev.rolloutcheckpoint.v1} messages and stubs: the
 * error domain, every {@code ErrorInfo} reason as a typed {@link ErrorReason}, the health service
 * names and metadata keys ({@link #wireValue}, read from the protos' {@code wire_value} option
 * through the descriptors, so no string of the contract is typed a second time), {@link #reasonOf}
 * from a gRPC error, the {@code deadline} metadata format, and the bearer token.
 */
public final class RolloutCheckpoint {
  /**
   * The semantic version of this package (pom.xml's version). Its major stays 1 while the wire is
   * rollout_checkpoint.v1: a removed or renamed public name is a major bump, an added one a minor
   * bump (gen/public-api.json records the names).
   */
  public static final String VERSION = packageVersion();

  /** The proto package this package speaks, "rollout_checkpoint.v1". */
  public static final String API_PACKAGE = ErrorReason.getDescriptor().getFile().getPackage();

  /** The version part of {@link #API_PACKAGE} ("v1"), what a participant's api_version ends with. */
  public static final String API_VERSION = API_PACKAGE.substring(API_PACKAGE.lastIndexOf('.') + 1);

  /** The {@code ErrorInfo.domain} of every refusal of this API ("rollout-checkpoint.dev"). */
  public static final String DOMAIN = wireValue(ErrorDomain.ERROR_DOMAIN_ROLLOUT_CHECKPOINT);

  /** What the enum value names carry and the wire reason strings do not. */
  private static final String REASON_PREFIX = "ERROR_REASON_";

  /** Seconds since the epoch with exactly six decimals (errors.proto, {@code deadline}). */
  private static final Pattern DEADLINE = Pattern.compile("([0-9]+)\\.([0-9]{6})");

  private static final int DEADLINE_DIGITS = 6;

  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of(
          wireValue(MetadataKey.METADATA_KEY_AUTHORIZATION), Metadata.ASCII_STRING_MARSHALLER);

  private RolloutCheckpoint() {}

  /**
   * The exact string a constants value stands for on the wire: its {@code wire_value} option (a
   * {@code HealthServiceName}, a {@code MetadataKey}, an {@code ErrorDomain}); "" for a value
   * without the option (UNSPECIFIED). {@code wireValue(HealthServiceName.HEALTH_SERVICE_NAME_SERVER)}
   * is "" too: the whole server's health name.
   */
  public static String wireValue(ProtocolMessageEnum value) {
    return value.getValueDescriptor().getOptions().getExtension(ConstantsProto.wireValue);
  }

  /**
   * The {@code ErrorInfo.reason} string of a reason: its proto name without {@code ERROR_REASON_}
   * (for example "STALE_CHECKPOINT").
   */
  public static String reason(ErrorReason reason) {
    String name = reason.getValueDescriptor().getName();
    return name.startsWith(REASON_PREFIX) ? name.substring(REASON_PREFIX.length()) : name;
  }

  /**
   * The reason whose {@link #reason} is {@code text}; empty for a reason this version of the
   * package does not know (the server may be newer: reasons may be added).
   */
  public static Optional<ErrorReason> parseReason(String text) {
    return Optional.ofNullable(
            ErrorReason.getDescriptor().findValueByName(REASON_PREFIX + text))
        .map(ErrorReason::valueOf)
        .filter(reason -> reason != ErrorReason.ERROR_REASON_UNSPECIFIED);
  }

  /**
   * A refusal decoded from a gRPC error: its status code, the typed reason
   * (ERROR_REASON_UNSPECIFIED for a reason this package does not know yet; {@code
   * info().getReason()} has the string) and the whole {@code google.rpc.ErrorInfo}.
   */
  public static final class Refusal {
    private final Status.Code code;
    private final ErrorReason reason;
    private final ErrorInfo info;

    Refusal(Status.Code code, ErrorReason reason, ErrorInfo info) {
      this.code = code;
      this.reason = reason;
      this.info = info;
    }

    public Status.Code code() {
      return code;
    }

    public ErrorReason reason() {
      return reason;
    }

    public ErrorInfo info() {
      return info;
    }

    /** The metadata value under a key this API fixes. */
    public Optional<String> metadata(MetadataKey key) {
      return Optional.ofNullable(info.getMetadataMap().get(wireValue(key)));
    }

    @Override
    public String toString() {
      return code + " " + info.getReason() + " " + info.getMetadataMap();
    }
  }

  /**
   * The refusal a gRPC error carries ({@code StatusRuntimeException} or {@code StatusException},
   * or a throwable caused by one): its one {@code ErrorInfo} in this API's domain. Empty when
   * there is none: the status came from the transport (a timeout, a dropped connection), not from
   * a participant or the coordinator, so there is nothing to switch on but the code.
   */
  public static Optional<Refusal> reasonOf(Throwable error) {
    com.google.rpc.Status status = StatusProto.fromThrowable(error);
    if (status == null) {
      return Optional.empty();
    }
    Status.Code code = Status.fromCodeValue(status.getCode()).getCode();
    return status.getDetailsList().stream()
        .map(RolloutCheckpoint::errorInfo)
        .flatMap(Optional::stream)
        .filter(info -> info.getDomain().equals(DOMAIN))
        .findFirst()
        .map(info -> new Refusal(code, parseReason(info.getReason())
            .orElse(ErrorReason.ERROR_REASON_UNSPECIFIED), info));
  }

  /** A detail that is an ErrorInfo; a malformed one is no refusal to switch on. */
  private static Optional<ErrorInfo> errorInfo(Any detail) {
    if (!detail.is(ErrorInfo.class)) {
      return Optional.empty();
    }
    try {
      return Optional.of(detail.unpack(ErrorInfo.class));
    } catch (InvalidProtocolBufferException malformed) {
      return Optional.empty();
    }
  }

  /**
   * Reads a {@code deadline} or {@code memberDeadline} metadata value: seconds since the Unix
   * epoch (UTC) with exactly six digits after the point (errors.proto,
   * CHECKPOINT_DEADLINE_EXCEEDED), for example "1767225600.250000".
   *
   * @throws IllegalArgumentException for any other text
   */
  public static Instant parseDeadline(String value) {
    Matcher match = DEADLINE.matcher(value);
    if (!match.matches()) {
      throw new IllegalArgumentException(
          "deadline \"" + value + "\": want seconds since the epoch with "
              + DEADLINE_DIGITS + " decimals");
    }
    long micros = Long.parseLong(match.group(2));
    return Instant.ofEpochSecond(Long.parseLong(match.group(1)), micros * 1_000);
  }

  /**
   * Writes a time in the {@code deadline} metadata format (to compare with a refusal's). The
   * server formats a double of seconds ({@code %.6f}): this rounds the same binary double the
   * same way, from its exact decimal value, so both sides agree to the last digit.
   */
  public static String formatDeadline(Instant time) {
    double seconds = time.getEpochSecond() + time.getNano() / 1e9;
    return new BigDecimal(seconds).setScale(DEADLINE_DIGITS, RoundingMode.HALF_EVEN).toPlainString();
  }

  /**
   * The call credentials that send {@code authorization: Bearer <token>} with every call: every
   * RPC but grpc.health.v1 needs it ({@code stub.withCallCredentials(bearerToken(token))}).
   * grpc-java applies them on plaintext channels too (it leaves the security level to the
   * credentials, and these accept any): a participant's sidecar may serve plaintext next to its
   * app, and there the token is ordinary metadata.
   *
   * @throws IllegalArgumentException when the token is not printable ASCII (not valid metadata)
   */
  public static CallCredentials bearerToken(String token) {
    Objects.requireNonNull(token, "token");
    if (!token.chars().allMatch(c -> c >= 0x20 && c <= 0x7e)) {
      throw new IllegalArgumentException("a bearer token must be printable ASCII");
    }
    Metadata headers = new Metadata();
    headers.put(AUTHORIZATION, "Bearer " + token);
    return new BearerToken(headers);
  }

  /** The credentials {@link #bearerToken} returns: the same headers for every call. */
  private static final class BearerToken extends CallCredentials {
    private final Metadata headers;

    BearerToken(Metadata headers) {
      this.headers = headers;
    }

    @Override
    public void applyRequestMetadata(
        RequestInfo requestInfo, Executor appExecutor, MetadataApplier applier) {
      applier.apply(headers);
    }
  }

  /** The version Maven wrote into version.properties when it built this package. */
  private static String packageVersion() {
    Properties properties = new Properties();
    try (InputStream in = RolloutCheckpoint.class.getResourceAsStream("version.properties")) {
      properties.load(Objects.requireNonNull(in, "version.properties is not in the package"));
    } catch (IOException unreadable) {
      throw new UncheckedIOException(unreadable);
    }
    return properties.getProperty("version");
  }
}
