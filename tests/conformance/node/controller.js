// A Node.js controller that drives one real rollout-checkpoint participant (the counter
// example) through the contract: GetParticipant, a seeded session, Prepare (reading the
// stream to its final message), Commit, Resume, refusals decoded to typed reasons, and
// grpc.health.v1 without a token. With CONFORMANCE_COORDINATOR_ADDRESS (a coordinator over
// that counter): CoordinatorService Checkpoint and a PARTICIPANT_FAILED refusal. With
// CONFORMANCE_REPLACEMENT_GRPC_ADDRESS and _HTTP_ADDRESS (a counter started with
// --start-closed): FRESH_PROCESS_REQUIRED from the counter that served, a health Watch of the
// replacement's readiness, Restore there, Resume, and the restored session over HTTP.
//
//   CONFORMANCE_GRPC_ADDRESS=127.0.0.1:9001 CONFORMANCE_HTTP_ADDRESS=127.0.0.1:8001 \
//   CONFORMANCE_TOKEN=change-me node controller.js
//
// Everything it knows of the contract comes from the npm package @rollout-checkpoint/client
// (gen/ts, a file: dependency): the generated messages and clients and the helper layer
// (bearerToken, reasonOf, healthServiceName, metadataKey); no codegen, no helper of its own.
// Prints one line per step and exits non-zero at the first failed check.
// tests/test_conformance.py starts the participant and runs this script.
'use strict';

const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const {
  API_PACKAGE,
  CheckpointPhase,
  CoordinatorServiceClient,
  ErrorReason,
  HealthServiceName,
  MetadataKey,
  ParticipantKind,
  ParticipantServiceClient,
  ParticipantState,
  PrepareUpdateKind,
  bearerToken,
  deadlineIn,
  formatDeadline,
  grpc,
  health,
  healthServiceName,
  metadataKey,
  parseDeadline,
  reasonOf,
  reasonString,
} = require('@rollout-checkpoint/client');

function env(name) {
  const value = process.env[name];
  if (!value) throw new Error(`set ${name}`);
  return value;
}
const GRPC_ADDRESS = env('CONFORMANCE_GRPC_ADDRESS');
const HTTP_ADDRESS = env('CONFORMANCE_HTTP_ADDRESS');
const TOKEN = env('CONFORMANCE_TOKEN');
// Optional: a `rollout-checkpoint coordinator` over that one counter, and a start-closed
// replacement of the counter to restore the commit into.
const COORDINATOR_ADDRESS = process.env.CONFORMANCE_COORDINATOR_ADDRESS;
const REPLACEMENT_GRPC_ADDRESS = process.env.CONFORMANCE_REPLACEMENT_GRPC_ADDRESS;
const REPLACEMENT_HTTP_ADDRESS = process.env.CONFORMANCE_REPLACEMENT_HTTP_ADDRESS;

function participantClient(token, address = GRPC_ADDRESS) {
  return new ParticipantServiceClient(address, grpc.credentials.createInsecure(), {
    interceptors: [bearerToken(token)],
  });
}

// Every message of a server stream, in order (the last is the final one).
async function drain(call) {
  const messages = [];
  for await (const message of call) messages.push(message);
  return messages;
}

// The gRPC call deadline sits a little after the request's own deadline, so the
// participant (not the transport) reports a missed deadline.
const CALL_SLACK_MS = 5000;
function callOptions(requestDeadline) {
  const ms = requestDeadline
    ? Number(requestDeadline.seconds) * 1000 + requestDeadline.nanos / 1e6
    : Date.now() + 30000;
  return { deadline: new Date(ms + CALL_SLACK_MS) };
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, callOptions(request.deadline), (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

async function refused(promise, code, reason) {
  let err;
  try {
    await promise;
  } catch (caught) {
    err = caught;
  }
  assert.ok(err, `expected ${reasonString(reason)}, the call succeeded`);
  const refusal = reasonOf(err);
  assert.ok(refusal, `no ErrorInfo on ${err.code} ${err.details}`);
  assert.equal(refusal.code, code, `status code (${err.code} ${err.details})`);
  assert.equal(reasonString(refusal.reason), reasonString(reason));
  return refusal;
}

// The data plane: a session of rollout `r1` (capture key `r1`; `r1-a1` once restored as
// attempt 1) behind a cookie.
async function post(route, body, cookie, address = HTTP_ADDRESS, captureKey = 'r1') {
  const response = await fetch(`http://${address}/ng-rollout/${captureKey}/${route}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...(cookie ? { cookie } : {}) },
    body: JSON.stringify(body),
  });
  const text = await response.text();
  assert.equal(response.status, 200, `${route}: ${response.status} ${text}`);
  const setCookie = response.headers.getSetCookie().map((c) => c.split(';')[0]);
  return { json: text ? JSON.parse(text) : null, cookie: setCookie.join('; ') || cookie };
}

const sha256 = (bytes) => crypto.createHash('sha256').update(bytes).digest('hex');

const steps = [];
const step = (name, fn) => steps.push({ name, fn });

const client = participantClient(TOKEN);
const closers = [() => client.close()];
const checkpointId = `node-${process.pid}`;
let checkpointDir;
let sessionCookie;

step('GetParticipant: kind RESOURCES, instance counter', async () => {
  const reply = await unary(client, 'getParticipant', {});
  assert.equal(reply.kind, ParticipantKind.PARTICIPANT_KIND_RESOURCES);
  assert.equal(reply.instance, 'counter');
  assert.equal(reply.apiVersion, API_PACKAGE);
  assert.ok(reply.bootId);
  assert.equal(reply.facts.mode, 'exported');
});

step('seed a session over HTTP (count 3) and increment it (+2)', async () => {
  const seeded = await post('seed_session', { initial_count: 3 });
  assert.ok(seeded.cookie, 'seed_session set a session cookie');
  await post('increment_counter', { count: 2 }, seeded.cookie);
  const { json } = await post('get_counter_value', {}, seeded.cookie);
  assert.deepEqual(json, { count: 5 });
  sessionCookie = seeded.cookie;
});

step('Prepare: read the stream to its final message, PREPARED', async () => {
  const deadline = deadlineIn(30000);
  const call = client.prepare({ checkpointId, deadline }, callOptions(deadline));
  const messages = await drain(call);
  assert.ok(messages.length >= 1);
  assert.equal(messages[0].updateKind, PrepareUpdateKind.PREPARE_UPDATE_KIND_INITIAL);
  assert.deepEqual(
    messages.map((m) => m.sequence),
    messages.map((_, i) => String(i + 1)),
    'sequence counts 1, 2, ...',
  );
  const final = messages[messages.length - 1];
  assert.equal(final.final, true);
  assert.equal(final.updateKind, PrepareUpdateKind.PREPARE_UPDATE_KIND_FINAL);
  assert.equal(final.state, ParticipantState.PARTICIPANT_STATE_PREPARED);
  assert.equal(final.checkpointId, checkpointId);
  assert.equal(final.readiness.ready, true);
  assert.equal(final.admissionOpen, false);
  const ms = Number(final.elapsed.seconds) * 1000 + final.elapsed.nanos / 1e6;
  console.log(`   ${messages.length} message(s), PREPARED after ${ms.toFixed(1)} ms`);
});

step('Commit into a temporary directory: manifest, exported r1, records on disk', async () => {
  checkpointDir = fs.realpathSync(fs.mkdtempSync(path.join(os.tmpdir(), 'conformance-node-')));
  const reply = await unary(client, 'commit', {
    checkpointId,
    deadline: deadlineIn(30000),
    checkpointDir,
  });
  assert.equal(reply.state, ParticipantState.PARTICIPANT_STATE_COMMITTED);
  assert.deepEqual(reply.exported, ['r1']);
  const manifest = reply.manifest;
  assert.equal(manifest.kind, ParticipantKind.PARTICIPANT_KIND_RESOURCES);
  assert.equal(manifest.instance, 'counter');
  assert.equal(manifest.checkpointId, checkpointId);
  assert.equal(manifest.schemaVersion, 1);
  assert.equal(manifest.recordCount, '1');
  const part = path.join(checkpointDir, 'participants', 'resources', 'counter');
  assert.equal(sha256(fs.readFileSync(path.join(part, 'manifest.json'))), reply.manifestSha256);
  const records = fs.readFileSync(path.join(part, manifest.recordsFile));
  assert.equal(manifest.recordsFile, `records-${manifest.recordsSha256}.jsonl`);
  assert.equal(sha256(records), manifest.recordsSha256);
  assert.equal(String(records.length), manifest.bytes);
  const lines = records.toString('utf8').trim().split('\n').map(JSON.parse);
  assert.equal(lines.length, 1);
  assert.deepEqual(lines[0].episode_id, { rollout_id: 'r1', attempt: 0 });
  assert.deepEqual(lines[0].state, { count: 5 });
});

step('Resume: IDLE, not idempotent the first time', async () => {
  const reply = await unary(client, 'resume', { checkpointId, deadline: deadlineIn(30000) });
  assert.equal(reply.state, ParticipantState.PARTICIPANT_STATE_IDLE);
  assert.equal(reply.idempotent, false);
});

step('Commit after Resume: ABORTED, ErrorInfo STALE_CHECKPOINT', async () => {
  const refusal = await refused(
    unary(client, 'commit', { checkpointId, deadline: deadlineIn(30000), checkpointDir }),
    grpc.status.ABORTED,
    ErrorReason.ERROR_REASON_STALE_CHECKPOINT,
  );
  assert.equal(refusal.metadata[metadataKey(MetadataKey.METADATA_KEY_CHECKPOINT_ID)], checkpointId);
});

// The `deadline` metadata reads back (parseDeadline) as the deadline sent, to the microsecond
// (a quarter second past a whole one is exact in the format's binary double).
step('Renew with a deadline already past: CHECKPOINT_DEADLINE_EXCEEDED, its deadline metadata', async () => {
  const late = { seconds: String(Math.floor(Date.now() / 1000) - 10), nanos: 250_000_000 };
  const refusal = await refused(
    new Promise((resolve, reject) => {
      const options = { deadline: new Date(Date.now() + 10000) };
      client.renew({ checkpointId, deadline: late }, options, (err, reply) =>
        err ? reject(err) : resolve(reply),
      );
    }),
    grpc.status.DEADLINE_EXCEEDED,
    ErrorReason.ERROR_REASON_CHECKPOINT_DEADLINE_EXCEEDED,
  );
  const text = refusal.metadata[metadataKey(MetadataKey.METADATA_KEY_DEADLINE)];
  assert.deepEqual(parseDeadline(text), late);
  assert.equal(formatDeadline(late), text);
});

step('a wrong token: UNAUTHENTICATED, ErrorInfo TOKEN_INVALID', async () => {
  const intruder = participantClient(`${TOKEN}-wrong`);
  try {
    await refused(
      unary(intruder, 'getParticipant', {}),
      grpc.status.UNAUTHENTICATED,
      ErrorReason.ERROR_REASON_TOKEN_INVALID,
    );
  } finally {
    intruder.close();
  }
});

step('grpc.health.v1.Health/Check without a token: SERVING', async () => {
  const checker = new health.HealthClient(GRPC_ADDRESS, grpc.credentials.createInsecure());
  const names = [
    HealthServiceName.HEALTH_SERVICE_NAME_SERVER,
    HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_SERVICE,
    HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS,
    HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS,
  ];
  try {
    for (const service of names.map(healthServiceName)) {
      const reply = await unary(checker, 'check', { service });
      assert.equal(
        reply.status,
        health.HealthCheckResponse_ServingStatus.SERVING,
        `health of "${service}"`,
      );
    }
  } finally {
    checker.close();
  }
});

if (COORDINATOR_ADDRESS) {
  const coordinator = new CoordinatorServiceClient(
    COORDINATOR_ADDRESS,
    grpc.credentials.createInsecure(),
    { interceptors: [bearerToken(TOKEN)] },
  );
  closers.push(() => coordinator.close());

  step('CoordinatorService/Checkpoint: stream to DONE, published, continued r1', async () => {
    const deadline = deadlineIn(60000);
    const messages = await drain(
      coordinator.checkpoint(
        { checkpointId: `${checkpointId}-fleet`, deadline, deriveScope: true },
        callOptions(deadline),
      ),
    );
    const phases = messages.map((m) => m.phase);
    assert.equal(phases[0], CheckpointPhase.CHECKPOINT_PHASE_PREPARE);
    assert.equal(phases[phases.length - 1], CheckpointPhase.CHECKPOINT_PHASE_DONE);
    const { result } = messages.find((m) => m.final);
    assert.equal(result.published, true);
    assert.deepEqual(result.continued, [{ rolloutId: 'r1', attempt: 0 }]);
    const manifest = fs.readFileSync(path.join(result.directory, 'checkpoint.json'));
    assert.equal(sha256(manifest), result.fleetManifestSha256);
    console.log(`   ${messages.length} message(s), published ${result.directory}`);
  });

  step('CoordinatorService/Prepare of a resumed id: PARTICIPANT_FAILED (counter=STALE_CHECKPOINT)', async () => {
    const deadline = deadlineIn(10000);
    const refusal = await refused(
      drain(coordinator.prepare({ checkpointId, deadline }, callOptions(deadline))),
      grpc.status.ABORTED,
      ErrorReason.ERROR_REASON_PARTICIPANT_FAILED,
    );
    const key = metadataKey(MetadataKey.METADATA_KEY_FAILED_MEMBERS);
    const stale = reasonString(ErrorReason.ERROR_REASON_STALE_CHECKPOINT);
    assert.equal(refusal.metadata[key], `counter=${stale}`);
  });
}

if (REPLACEMENT_GRPC_ADDRESS) {
  const replacement = participantClient(TOKEN, REPLACEMENT_GRPC_ADDRESS);
  const watcher = new health.HealthClient(REPLACEMENT_GRPC_ADDRESS, grpc.credentials.createInsecure());
  closers.push(() => replacement.close(), () => watcher.close());
  const restoreId = `${checkpointId}-restore`;
  const restoreRequest = () => ({
    checkpointId: restoreId,
    deadline: deadlineIn(30000),
    checkpointDir,
    scope: { episodes: [{ rolloutId: 'r1', attempt: 0 }] },
  });
  let readiness; // the Watch stream's messages, read one at a time
  let watch;

  step('Restore into the participant that served: FAILED_PRECONDITION, FRESH_PROCESS_REQUIRED', async () => {
    await refused(
      unary(client, 'restore', restoreRequest()),
      grpc.status.FAILED_PRECONDITION,
      ErrorReason.ERROR_REASON_FRESH_PROCESS_REQUIRED,
    );
  });

  step("grpc.health.v1.Health/Watch of the start-closed replacement's readiness: NOT_SERVING", async () => {
    const service = healthServiceName(HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS);
    watch = watcher.watch({ service }, { deadline: new Date(Date.now() + 120000) });
    readiness = watch[Symbol.asyncIterator]();
    const first = await readiness.next();
    assert.equal(first.value.status, health.HealthCheckResponse_ServingStatus.NOT_SERVING);
  });

  step('Restore into the start-closed replacement: RESTORED, r1 as attempt 1 (r1-a1)', async () => {
    const reply = await unary(replacement, 'restore', restoreRequest());
    assert.equal(reply.state, ParticipantState.PARTICIPANT_STATE_RESTORED);
    assert.equal(reply.sourceCheckpointId, checkpointId);
    assert.deepEqual(reply.restored, ['r1-a1']);
  });

  step('Resume the replacement: IDLE, and the readiness Watch streams SERVING', async () => {
    const reply = await unary(replacement, 'resume', { checkpointId: restoreId, deadline: deadlineIn(30000) });
    assert.equal(reply.state, ParticipantState.PARTICIPANT_STATE_IDLE);
    // Watch promises the eventual status: intermediate NOT_SERVINGs may come first.
    for (;;) {
      const update = await readiness.next();
      assert.ok(!update.done, 'the Watch ended before SERVING');
      if (update.value.status === health.HealthCheckResponse_ServingStatus.SERVING) break;
    }
    watch.cancel();
  });

  step('the restored session on the replacement over HTTP: count 5', async () => {
    const { json } = await post('get_counter_value', {}, sessionCookie, REPLACEMENT_HTTP_ADDRESS, 'r1-a1');
    assert.deepEqual(json, { count: 5 });
  });
}

async function main() {
  let failed = false;
  for (const [index, { name, fn }] of steps.entries()) {
    if (failed) {
      console.log(`skip ${index + 1} - ${name}`);
      continue;
    }
    try {
      await fn();
      console.log(`ok ${index + 1} - ${name}`);
    } catch (err) {
      failed = true;
      console.log(`not ok ${index + 1} - ${name}`);
      console.log(err && err.stack ? err.stack : err);
    }
  }
  for (const close of closers) close();
  if (checkpointDir) fs.rmSync(checkpointDir, { recursive: true, force: true });
  console.log(failed ? 'node controller: FAILED' : `node controller: all ${steps.length} steps passed`);
  process.exitCode = failed ? 1 : 0;
}

main();
