// A Node.js controller that drives one real rollout-checkpoint participant (the counter
// example) through the contract: GetParticipant, a seeded session, Prepare (reading the
// stream to its final message), Commit, Resume, refusals decoded to typed reasons, and
// grpc.health.v1 without a token.
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
  ErrorReason,
  HealthServiceName,
  MetadataKey,
  ParticipantKind,
  ParticipantServiceClient,
  ParticipantState,
  PrepareUpdateKind,
  bearerToken,
  deadlineIn,
  grpc,
  health,
  healthServiceName,
  metadataKey,
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

function participantClient(token) {
  return new ParticipantServiceClient(GRPC_ADDRESS, grpc.credentials.createInsecure(), {
    interceptors: [bearerToken(token)],
  });
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

// The data plane: a session of rollout `r1` (capture key `r1`) behind a cookie.
async function post(route, body, cookie) {
  const response = await fetch(`http://${HTTP_ADDRESS}/ng-rollout/r1/${route}`, {
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
const checkpointId = `node-${process.pid}`;
let checkpointDir;

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
});

step('Prepare: read the stream to its final message, PREPARED', async () => {
  const deadline = deadlineIn(30000);
  const call = client.prepare({ checkpointId, deadline }, callOptions(deadline));
  const messages = [];
  for await (const message of call) messages.push(message);
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
  client.close();
  if (checkpointDir) fs.rmSync(checkpointDir, { recursive: true, force: true });
  console.log(failed ? 'node controller: FAILED' : `node controller: all ${steps.length} steps passed`);
  process.exitCode = failed ? 1 : 0;
}

main();
