// Command conformance is a Go controller that drives one real rollout-checkpoint
// participant (the counter example) through the contract: GetParticipant, a seeded
// session, Prepare (reading the stream to its final message), Commit, Resume,
// refusals decoded to typed reasons with checkpointv1.ReasonOf, and grpc.health.v1
// without a token.
//
//	CONFORMANCE_GRPC_ADDRESS=127.0.0.1:9001 CONFORMANCE_HTTP_ADDRESS=127.0.0.1:8001 \
//	CONFORMANCE_TOKEN=change-me go run .
//
// With CONFORMANCE_COORDINATOR_ADDRESS set (a `rollout-checkpoint coordinator` whose fleet
// is that one participant, with a checkpoint_root) it then drives CoordinatorService too:
// ListParticipants, a whole Checkpoint stream, and a refusal with PARTICIPANT_FAILED. With
// CONFORMANCE_REPLACEMENT_GRPC_ADDRESS and _HTTP_ADDRESS set (a counter started with
// --start-closed) it restores the commit there: FRESH_PROCESS_REQUIRED from the participant
// that served, a health Watch of the replacement's readiness, Restore, Resume, and the
// restored session over HTTP.
//
// It prints one line per step and exits 1 at the first failed one.
// tests/test_conformance.py starts the participant and runs it. Everything it imports of the
// contract comes from the Go module gen/go (package checkpointv1): the generated messages and
// clients and the helper layer (BearerToken, ReasonOf, the constants' WireValue); it writes no
// codegen and no helper of its own.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/rollout-checkpoint/rollout-checkpoint/gen/go/rollout_checkpoint/v1"
)

// participantHealth are the grpc.health.v1 names a participant answers (constants.proto).
var participantHealth = []string{
	pb.HealthServiceName_HEALTH_SERVICE_NAME_SERVER.WireValue(),
	pb.HealthServiceName_HEALTH_SERVICE_NAME_PARTICIPANT_SERVICE.WireValue(),
	pb.HealthServiceName_HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS.WireValue(),
	pb.HealthServiceName_HEALTH_SERVICE_NAME_PARTICIPANT_READINESS.WireValue(),
}

// dial opens a client connection; an empty token sends no authorization (health).
func dial(address, token string) (*grpc.ClientConn, error) {
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(pb.BearerToken(token)))
	}
	return grpc.NewClient(address, opts...)
}

// withDeadline returns an absolute request deadline `d` from now and a context whose gRPC
// deadline is a little later, so the participant (not the transport) reports a miss.
func withDeadline(d time.Duration) (context.Context, context.CancelFunc, *timestamppb.Timestamp) {
	deadline := time.Now().Add(d)
	ctx, cancel := context.WithDeadline(context.Background(), deadline.Add(5*time.Second))
	return ctx, cancel, timestamppb.New(deadline)
}

// refused checks that a call failed with this code and typed ErrorInfo reason; it returns
// the ErrorInfo metadata. A status without an ErrorInfo came from the transport, not from
// the participant.
func refused(err error, code codes.Code, reason pb.ErrorReason) (map[string]string, error) {
	if err == nil {
		return nil, fmt.Errorf("expected %s, the call succeeded", reason.Reason())
	}
	got, metadata, ok := pb.ReasonOf(err)
	if !ok {
		return nil, fmt.Errorf("%s %q carries no ErrorInfo of %s", status.Code(err), err, pb.Domain())
	}
	if mismatch := errors.Join(expect("code", status.Code(err), code), expect("reason", got, reason)); mismatch != nil {
		return metadata, fmt.Errorf("%w\n%s %v", mismatch, status.Convert(err).Message(), metadata)
	}
	return metadata, nil
}

func expect[T any](what string, got, want T) error {
	if !reflect.DeepEqual(got, want) {
		return fmt.Errorf("%s: got %v, want %v", what, got, want)
	}
	return nil
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// controller holds what the steps share.
type controller struct {
	grpcAddress, httpAddress, token string
	client                          pb.ParticipantServiceClient
	http                            *http.Client // keeps the session cookie
	checkpointID, checkpointDir     string
	bootID                          string
	coordinator                     pb.CoordinatorServiceClient // nil without a coordinator
	// A start-closed replacement of the counter (nil without one): the restore target.
	replacement     pb.ParticipantServiceClient
	replacementHTTP string
	readinessWatch  healthpb.Health_WatchClient
	cancelWatch     context.CancelFunc
}

// post calls a data-plane route of rollout `r1` (capture key `r1`) on the participant.
func (c *controller) post(route string, body any) (map[string]any, error) {
	return c.postTo(c.httpAddress, "r1", route, body)
}

// postTo calls a data-plane route of the episode with that capture key on the HTTP server at
// address, with the session cookie (one jar for both servers: cookies are per host, not per
// port).
func (c *controller) postTo(address, captureKey, route string, body any) (map[string]any, error) {
	payload, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	url := fmt.Sprintf("http://%s/ng-rollout/%s/%s", address, captureKey, route)
	resp, err := c.http.Post(url, "application/json", strings.NewReader(string(payload)))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	text, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: HTTP %d %s", route, resp.StatusCode, text)
	}
	var reply map[string]any
	if len(text) > 0 {
		err = json.Unmarshal(text, &reply)
	}
	return reply, err
}

func (c *controller) getParticipant() error {
	ctx, cancel, _ := withDeadline(10 * time.Second)
	defer cancel()
	reply, err := c.client.GetParticipant(ctx, &pb.GetParticipantRequest{})
	if err != nil {
		return err
	}
	c.bootID = reply.GetBootId()
	return errors.Join(
		expect("kind", reply.GetKind(), pb.ParticipantKind_PARTICIPANT_KIND_RESOURCES),
		expect("instance", reply.GetInstance(), "counter"),
		expect("api_version", reply.GetApiVersion(), pb.APIPackage()),
		expect("facts.mode", reply.GetFacts()["mode"], "exported"),
	)
}

func (c *controller) seedSession() error {
	if _, err := c.post("seed_session", map[string]any{"initial_count": 3}); err != nil {
		return err
	}
	if _, err := c.post("increment_counter", map[string]any{"count": 2}); err != nil {
		return err
	}
	reply, err := c.post("get_counter_value", map[string]any{})
	if err != nil {
		return err
	}
	return expect("count", reply["count"], any(float64(5)))
}

func (c *controller) prepare() error {
	ctx, cancel, deadline := withDeadline(30 * time.Second)
	defer cancel()
	stream, err := c.client.Prepare(ctx, &pb.PrepareRequest{CheckpointId: c.checkpointID, Deadline: deadline})
	if err != nil {
		return err
	}
	var messages []*pb.PrepareResponse
	for {
		msg, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		messages = append(messages, msg)
	}
	if len(messages) == 0 {
		return errors.New("the stream ended without a message")
	}
	final := messages[len(messages)-1]
	fmt.Printf("   %d message(s), PREPARED after %s\n", len(messages), final.GetElapsed().AsDuration())
	return errors.Join(
		expect("first update_kind", messages[0].GetUpdateKind(), pb.PrepareUpdateKind_PREPARE_UPDATE_KIND_INITIAL),
		expect("last sequence", final.GetSequence(), uint64(len(messages))),
		expect("final", final.GetFinal(), true),
		expect("final update_kind", final.GetUpdateKind(), pb.PrepareUpdateKind_PREPARE_UPDATE_KIND_FINAL),
		expect("final state", final.GetState(), pb.ParticipantState_PARTICIPANT_STATE_PREPARED),
		expect("ready", final.GetReadiness().GetReady(), true),
		expect("admission_open", final.GetAdmissionOpen(), false),
	)
}

func (c *controller) commit() error {
	dir, err := os.MkdirTemp("", "conformance-go-")
	if err != nil {
		return err
	}
	// The participant wants an absolute, normalized path (no symlinked /tmp).
	if c.checkpointDir, err = filepath.EvalSymlinks(dir); err != nil {
		return err
	}
	ctx, cancel, deadline := withDeadline(30 * time.Second)
	defer cancel()
	reply, err := c.client.Commit(ctx, &pb.CommitRequest{
		CheckpointId:  c.checkpointID,
		Deadline:      deadline,
		CheckpointDir: c.checkpointDir,
		// Scope unset: every live episode (a resources participant allows that).
	})
	if err != nil {
		return err
	}
	m := reply.GetManifest()
	part := filepath.Join(c.checkpointDir, "participants", "resources", "counter")
	manifestBytes, err := os.ReadFile(filepath.Join(part, "manifest.json"))
	if err != nil {
		return err
	}
	records, err := os.ReadFile(filepath.Join(part, m.GetRecordsFile()))
	if err != nil {
		return err
	}
	var record struct {
		EpisodeID struct {
			RolloutID string `json:"rollout_id"`
			Attempt   int    `json:"attempt"`
		} `json:"episode_id"`
		State map[string]any `json:"state"`
	}
	lines := strings.Split(strings.TrimSpace(string(records)), "\n")
	if err := json.Unmarshal([]byte(lines[0]), &record); err != nil {
		return err
	}
	return errors.Join(
		expect("state", reply.GetState(), pb.ParticipantState_PARTICIPANT_STATE_COMMITTED),
		expect("exported", reply.GetExported(), []string{"r1"}),
		expect("manifest.kind", m.GetKind(), pb.ParticipantKind_PARTICIPANT_KIND_RESOURCES),
		expect("manifest.instance", m.GetInstance(), "counter"),
		expect("manifest.checkpoint_id", m.GetCheckpointId(), c.checkpointID),
		expect("manifest.record_count", m.GetRecordCount(), uint64(1)),
		expect("manifest_sha256", sha256Hex(manifestBytes), reply.GetManifestSha256()),
		expect("records_sha256", sha256Hex(records), m.GetRecordsSha256()),
		expect("records lines", len(lines), 1),
		expect("record rollout", record.EpisodeID.RolloutID, "r1"),
		expect("record state", record.State, map[string]any{"count": float64(5)}),
	)
}

func (c *controller) resume() error {
	ctx, cancel, deadline := withDeadline(30 * time.Second)
	defer cancel()
	reply, err := c.client.Resume(ctx, &pb.ResumeRequest{CheckpointId: c.checkpointID, Deadline: deadline})
	if err != nil {
		return err
	}
	return errors.Join(
		expect("state", reply.GetState(), pb.ParticipantState_PARTICIPANT_STATE_IDLE),
		expect("idempotent", reply.GetIdempotent(), false),
	)
}

func (c *controller) staleCommit() error {
	ctx, cancel, deadline := withDeadline(30 * time.Second)
	defer cancel()
	_, err := c.client.Commit(ctx, &pb.CommitRequest{
		CheckpointId: c.checkpointID, Deadline: deadline, CheckpointDir: c.checkpointDir,
	})
	metadata, err := refused(err, codes.Aborted, pb.ErrorReason_ERROR_REASON_STALE_CHECKPOINT)
	if err != nil {
		return err
	}
	key := pb.MetadataKey_METADATA_KEY_CHECKPOINT_ID.WireValue()
	return expect("metadata "+key, metadata[key], c.checkpointID)
}

// lateRenew renews with a deadline already past: DEADLINE_EXCEEDED, CHECKPOINT_DEADLINE_EXCEEDED,
// and the `deadline` metadata reads back (ParseDeadline) as the deadline sent, to the
// microsecond (a quarter second past a whole one is exact in the format's binary double).
func (c *controller) lateRenew() error {
	late := time.Unix(time.Now().Add(-10*time.Second).Unix(), 250*int64(time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := c.client.Renew(ctx, &pb.RenewRequest{CheckpointId: c.checkpointID, Deadline: timestamppb.New(late)})
	metadata, err := refused(err, codes.DeadlineExceeded, pb.ErrorReason_ERROR_REASON_CHECKPOINT_DEADLINE_EXCEEDED)
	if err != nil {
		return err
	}
	text := metadata[pb.MetadataKey_METADATA_KEY_DEADLINE.WireValue()]
	deadline, err := pb.ParseDeadline(text)
	if err != nil {
		return err
	}
	return errors.Join(
		expect("deadline", deadline, late.UTC()),
		expect("FormatDeadline", pb.FormatDeadline(late), text),
	)
}

func (c *controller) wrongToken() error {
	conn, err := dial(c.grpcAddress, c.token+"-wrong")
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel, _ := withDeadline(10 * time.Second)
	defer cancel()
	_, err = pb.NewParticipantServiceClient(conn).GetParticipant(ctx, &pb.GetParticipantRequest{})
	_, err = refused(err, codes.Unauthenticated, pb.ErrorReason_ERROR_REASON_TOKEN_INVALID)
	return err
}

func (c *controller) health() error {
	conn, err := dial(c.grpcAddress, "") // health needs no token
	if err != nil {
		return err
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	var errs []error
	for _, service := range participantHealth {
		ctx, cancel, _ := withDeadline(10 * time.Second)
		reply, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		cancel()
		if err != nil {
			return fmt.Errorf("health of %q: %w", service, err)
		}
		errs = append(errs, expect(fmt.Sprintf("health of %q", service), reply.GetStatus(), healthpb.HealthCheckResponse_SERVING))
	}
	return errors.Join(errs...)
}

// -- CoordinatorService: the same fleet rules for a whole fleet, behind a few RPCs --------

func (c *controller) listParticipants() error {
	ctx, cancel, _ := withDeadline(10 * time.Second)
	defer cancel()
	reply, err := c.coordinator.ListParticipants(ctx, &pb.ListParticipantsRequest{})
	if err != nil {
		return err
	}
	members := reply.GetMembers()
	if len(members) != 1 {
		return fmt.Errorf("members: got %d, want 1", len(members))
	}
	return errors.Join(
		expect("name", members[0].GetName(), "counter"),
		expect("kind", members[0].GetKind(), pb.ParticipantKind_PARTICIPANT_KIND_RESOURCES),
		expect("boot_id (same process as GetParticipant)", members[0].GetBootId(), c.bootID),
	)
}

func (c *controller) fleetCheckpoint() error {
	ctx, cancel, deadline := withDeadline(60 * time.Second)
	defer cancel()
	stream, err := c.coordinator.Checkpoint(ctx, &pb.CheckpointRequest{
		CheckpointId: c.checkpointID + "-fleet",
		Deadline:     deadline,
		DeriveScope:  true, // continue every live episode
	})
	if err != nil {
		return err
	}
	var phases []pb.CheckpointPhase
	var final *pb.CheckpointResponse
	for {
		msg, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		phases = append(phases, msg.GetPhase())
		if msg.GetFinal() {
			final = msg
		}
	}
	if final == nil {
		return fmt.Errorf("no final message (phases %v)", phases)
	}
	result := final.GetResult()
	manifest, err := os.ReadFile(filepath.Join(result.GetDirectory(), "checkpoint.json"))
	if err != nil {
		return err
	}
	var continued []string
	for _, e := range result.GetContinued() {
		continued = append(continued, fmt.Sprintf("%s/%d", e.GetRolloutId(), e.GetAttempt()))
	}
	fmt.Printf("   %d message(s), published %s\n", len(phases), result.GetDirectory())
	return errors.Join(
		expect("first phase", phases[0], pb.CheckpointPhase_CHECKPOINT_PHASE_PREPARE),
		expect("last phase", phases[len(phases)-1], pb.CheckpointPhase_CHECKPOINT_PHASE_DONE),
		expect("published", result.GetPublished(), true),
		expect("prepare_outcome", result.GetPrepareOutcome(), pb.FleetPrepareOutcome_FLEET_PREPARE_OUTCOME_PREPARED),
		expect("continued", continued, []string{"r1/0"}),
		expect("record_count", result.GetRecordCount(), uint64(1)),
		expect("fleet_manifest_sha256", sha256Hex(manifest), result.GetFleetManifestSha256()),
	)
}

func (c *controller) fleetRefusal() error {
	// Prepare the fleet again under the id the participant already resumed: the member
	// refuses with STALE_CHECKPOINT, and the coordinator reports PARTICIPANT_FAILED with
	// the member's status code and `failedMembers` = "counter=STALE_CHECKPOINT".
	ctx, cancel, deadline := withDeadline(10 * time.Second)
	defer cancel()
	stream, err := c.coordinator.Prepare(ctx, &pb.CoordinatorServicePrepareRequest{
		CheckpointId: c.checkpointID, Deadline: deadline,
	})
	if err == nil {
		for err == nil {
			_, err = stream.Recv()
		}
		if err == io.EOF {
			err = nil
		}
	}
	metadata, err := refused(err, codes.Aborted, pb.ErrorReason_ERROR_REASON_PARTICIPANT_FAILED)
	if err != nil {
		return err
	}
	key := pb.MetadataKey_METADATA_KEY_FAILED_MEMBERS.WireValue()
	want := "counter=" + pb.ErrorReason_ERROR_REASON_STALE_CHECKPOINT.Reason()
	return expect("metadata "+key, metadata[key], want)
}

// -- Restore into a start-closed replacement ------------------------------------------------

// restoreRequest continues episode r1 (attempt 0, as committed) from the participant's commit.
func (c *controller) restoreRequest(deadline *timestamppb.Timestamp) *pb.RestoreRequest {
	return &pb.RestoreRequest{
		CheckpointId:  c.checkpointID + "-restore",
		Deadline:      deadline,
		CheckpointDir: c.checkpointDir,
		Scope:         &pb.EpisodeScope{Episodes: []*pb.EpisodeId{{RolloutId: "r1", Attempt: 0}}},
	}
}

// freshProcessRequired restores the commit into the participant that took it: it has served
// a session, so it refuses (FAILED_PRECONDITION, FRESH_PROCESS_REQUIRED) and keeps its state.
func (c *controller) freshProcessRequired() error {
	ctx, cancel, deadline := withDeadline(30 * time.Second)
	defer cancel()
	_, err := c.client.Restore(ctx, c.restoreRequest(deadline))
	_, err = refused(err, codes.FailedPrecondition, pb.ErrorReason_ERROR_REASON_FRESH_PROCESS_REQUIRED)
	return err
}

// watchReadiness opens a grpc.health.v1 Watch of the replacement's readiness (no token) and
// reads its first message: a start-closed process is not ready until it is resumed.
func (c *controller) watchReadiness(address string) error {
	conn, err := dial(address, "")
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	c.cancelWatch = func() { cancel(); conn.Close() }
	name := pb.HealthServiceName_HEALTH_SERVICE_NAME_PARTICIPANT_READINESS.WireValue()
	c.readinessWatch, err = healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{Service: name})
	if err != nil {
		return err
	}
	first, err := c.readinessWatch.Recv()
	if err != nil {
		return err
	}
	return expect("first readiness", first.GetStatus(), healthpb.HealthCheckResponse_NOT_SERVING)
}

func (c *controller) restoreReplacement() error {
	ctx, cancel, deadline := withDeadline(30 * time.Second)
	defer cancel()
	reply, err := c.replacement.Restore(ctx, c.restoreRequest(deadline))
	if err != nil {
		return err
	}
	return errors.Join(
		expect("state", reply.GetState(), pb.ParticipantState_PARTICIPANT_STATE_RESTORED),
		expect("source_checkpoint_id", reply.GetSourceCheckpointId(), c.checkpointID),
		expect("restored", reply.GetRestored(), []string{"r1-a1"}),
	)
}

// resumeReplacement reopens the replacement; the readiness Watch then streams SERVING (Watch
// promises the eventual status, so intermediate NOT_SERVINGs are skipped).
func (c *controller) resumeReplacement() error {
	ctx, cancel, deadline := withDeadline(30 * time.Second)
	defer cancel()
	reply, err := c.replacement.Resume(ctx, &pb.ResumeRequest{CheckpointId: c.checkpointID + "-restore", Deadline: deadline})
	if err != nil {
		return err
	}
	if err := expect("state", reply.GetState(), pb.ParticipantState_PARTICIPANT_STATE_IDLE); err != nil {
		return err
	}
	for {
		update, err := c.readinessWatch.Recv()
		if err != nil {
			return fmt.Errorf("readiness Watch: %w", err)
		}
		if update.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
	}
}

// restoredSession reads the session on the replacement, as attempt 1 (capture key `r1-a1`)
// with the old cookie: the count the commit captured.
func (c *controller) restoredSession() error {
	reply, err := c.postTo(c.replacementHTTP, "r1-a1", "get_counter_value", map[string]any{})
	if err != nil {
		return err
	}
	return expect("count", reply["count"], any(float64(5)))
}

func env(name string) string {
	value := os.Getenv(name)
	if value == "" {
		fmt.Fprintf(os.Stderr, "set %s\n", name)
		os.Exit(2)
	}
	return value
}

// mustDial is dial for main: a client that cannot even be created ends the run.
func mustDial(address, token string) *grpc.ClientConn {
	conn, err := dial(address, token)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	return conn
}

type step struct {
	name string
	run  func() error
}

func main() {
	jar, _ := cookiejar.New(nil)
	c := &controller{
		grpcAddress:  env("CONFORMANCE_GRPC_ADDRESS"),
		httpAddress:  env("CONFORMANCE_HTTP_ADDRESS"),
		token:        env("CONFORMANCE_TOKEN"),
		http:         &http.Client{Jar: jar, Timeout: 10 * time.Second},
		checkpointID: fmt.Sprintf("go-%d", os.Getpid()),
	}
	conn := mustDial(c.grpcAddress, c.token)
	defer conn.Close()
	c.client = pb.NewParticipantServiceClient(conn)

	steps := []step{
		{"GetParticipant: kind RESOURCES, instance counter", c.getParticipant},
		{"seed a session over HTTP (count 3) and increment it (+2)", c.seedSession},
		{"Prepare: read the stream to its final message, PREPARED", c.prepare},
		{"Commit into a temporary directory: manifest, exported r1, records on disk", c.commit},
		{"Resume: IDLE, not idempotent the first time", c.resume},
		{"Commit after Resume: ABORTED, ErrorInfo STALE_CHECKPOINT", c.staleCommit},
		{"Renew with a deadline already past: CHECKPOINT_DEADLINE_EXCEEDED, its deadline metadata", c.lateRenew},
		{"a wrong token: UNAUTHENTICATED, ErrorInfo TOKEN_INVALID", c.wrongToken},
		{"grpc.health.v1.Health/Check without a token: SERVING", c.health},
	}
	if address := os.Getenv("CONFORMANCE_COORDINATOR_ADDRESS"); address != "" {
		conn := mustDial(address, c.token)
		defer conn.Close()
		c.coordinator = pb.NewCoordinatorServiceClient(conn)
		steps = append(steps, []step{
			{"CoordinatorService/ListParticipants: the counter, same boot_id", c.listParticipants},
			{"CoordinatorService/Checkpoint: stream to DONE, published, continued r1", c.fleetCheckpoint},
			{"CoordinatorService/Prepare of a resumed id: PARTICIPANT_FAILED (counter=STALE_CHECKPOINT)", c.fleetRefusal},
		}...)
	}
	if address := os.Getenv("CONFORMANCE_REPLACEMENT_GRPC_ADDRESS"); address != "" {
		conn := mustDial(address, c.token)
		defer conn.Close()
		c.replacement = pb.NewParticipantServiceClient(conn)
		c.replacementHTTP = env("CONFORMANCE_REPLACEMENT_HTTP_ADDRESS")
		steps = append(steps, []step{
			{"Restore into the participant that served: FAILED_PRECONDITION, FRESH_PROCESS_REQUIRED", c.freshProcessRequired},
			{"grpc.health.v1.Health/Watch of the start-closed replacement's readiness: NOT_SERVING", func() error { return c.watchReadiness(address) }},
			{"Restore into the start-closed replacement: RESTORED, r1 as attempt 1 (r1-a1)", c.restoreReplacement},
			{"Resume the replacement: IDLE, and the readiness Watch streams SERVING", c.resumeReplacement},
			{"the restored session on the replacement over HTTP: count 5", c.restoredSession},
		}...)
	}
	failed := false
	for i, s := range steps {
		if failed {
			fmt.Printf("skip %d - %s\n", i+1, s.name)
			continue
		}
		if err := s.run(); err != nil {
			failed = true
			fmt.Printf("not ok %d - %s\n   %v\n", i+1, s.name, err)
			continue
		}
		fmt.Printf("ok %d - %s\n", i+1, s.name)
	}
	if c.cancelWatch != nil {
		c.cancelWatch()
	}
	if c.checkpointDir != "" {
		os.RemoveAll(c.checkpointDir)
	}
	if failed {
		fmt.Println("go controller: FAILED")
		os.Exit(1)
	}
	fmt.Printf("go controller: all %d steps passed\n", len(steps))
}
