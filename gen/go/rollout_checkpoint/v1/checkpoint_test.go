package checkpointv1

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func refusal(t *testing.T, domain, reason string) error {
	t.Helper()
	info := &errdetails.ErrorInfo{Domain: domain, Reason: reason, Metadata: map[string]string{"checkpointId": "c1"}}
	st, err := status.New(codes.Aborted, "refused").WithDetails(info)
	if err != nil {
		t.Fatal(err)
	}
	return st.Err()
}

func TestConstantsComeFromTheProto(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{Domain(), "rollout-checkpoint.dev"},
		{APIVersion(), "v1"},
		{APIPackage(), "rollout_checkpoint.v1"},
		{HealthServiceName_HEALTH_SERVICE_NAME_SERVER.WireValue(), ""},
		{HealthServiceName_HEALTH_SERVICE_NAME_PARTICIPANT_READINESS.WireValue(), "participant-readiness"},
		{MetadataKey_METADATA_KEY_AUTHORIZATION.WireValue(), "authorization"},
		{MetadataKey_METADATA_KEY_FAILED_MEMBERS.WireValue(), "failedMembers"},
		{ErrorReason_ERROR_REASON_STALE_CHECKPOINT.Reason(), "STALE_CHECKPOINT"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}

func TestReasonOf(t *testing.T) {
	reason, metadata, ok := ReasonOf(refusal(t, "rollout-checkpoint.dev", "STALE_CHECKPOINT"))
	if !ok || reason != ErrorReason_ERROR_REASON_STALE_CHECKPOINT || metadata["checkpointId"] != "c1" {
		t.Errorf("a refusal: got %v %v %v", reason, metadata, ok)
	}
	// A newer server's reason: the server decided (ok), the reason is unknown here.
	reason, _, ok = ReasonOf(refusal(t, "rollout-checkpoint.dev", "SOMETHING_NEW"))
	if !ok || reason != ErrorReason_ERROR_REASON_UNSPECIFIED {
		t.Errorf("an unknown reason: got %v %v", reason, ok)
	}
	for name, err := range map[string]error{
		"another domain": refusal(t, "example.com", "STALE_CHECKPOINT"),
		"no details":     status.Error(codes.Unavailable, "connection refused"),
		"not a status":   errors.New("plain"),
		"nil":            nil,
	} {
		if _, _, ok := ReasonOf(err); ok {
			t.Errorf("%s: ReasonOf says the server decided", name)
		}
	}
}

func TestParseReason(t *testing.T) {
	if r, ok := ParseReason("TOKEN_INVALID"); !ok || r != ErrorReason_ERROR_REASON_TOKEN_INVALID {
		t.Errorf("TOKEN_INVALID: %v %v", r, ok)
	}
	for _, s := range []string{"UNSPECIFIED", "ERROR_REASON_TOKEN_INVALID", "token_invalid", ""} {
		if _, ok := ParseReason(s); ok {
			t.Errorf("%q parsed", s)
		}
	}
}

func TestDeadlineFormat(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 250_000_000, time.UTC)
	if got := FormatDeadline(at); got != "1767225600.250000" {
		t.Errorf("FormatDeadline: %q", got)
	}
	if got, err := ParseDeadline("1767225600.250000"); err != nil || !got.Equal(at) {
		t.Errorf("ParseDeadline: %v %v", got, err)
	}
	for _, bad := range []string{"1767225600.25", "1767225600", "-1.000000", "+1.000000", "1e9.000000", "1.-00000", ""} {
		if _, err := ParseDeadline(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func TestBearerToken(t *testing.T) {
	creds := BearerToken("s3cret")
	metadata, err := creds.GetRequestMetadata(context.Background())
	if err != nil || metadata["authorization"] != "Bearer s3cret" || creds.RequireTransportSecurity() {
		t.Errorf("got %v %v", metadata, err)
	}
}
