// A Node.js controller that drives one real rollout-checkpoint participant (the counter
// example) through the contract: GetParticipant, a seeded session, Prepare (reading the
// stream to its final message), Commit, Resume, typed refusals read from the
// `grpc-status-details-bin` trailer, and grpc.health.v1 without a token.
//
//   CONFORMANCE_GRPC_ADDRESS=127.0.0.1:9001 CONFORMANCE_HTTP_ADDRESS=127.0.0.1:8001 \
//   CONFORMANCE_TOKEN=change-me node controller.js
//
// Prints one line per step and exits non-zero at the first failed check.
// tests/test_conformance.py starts the participant and runs this script.
'use strict';

const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const REPO = path.resolve(__dirname, '..', '..', '..');
const DOMAIN = 'rollout-checkpoint.dev';

function env(name) {
  const value = process.env[name];
  if (!value) throw new Error(`set ${name}`);
  return value;
}
const GRPC_ADDRESS = env('CONFORMANCE_GRPC_ADDRESS');
const HTTP_ADDRESS = env('CONFORMANCE_HTTP_ADDRESS');
const TOKEN = env('CONFORMANCE_TOKEN');

// One loader call for everything: our contract, google.rpc (for the error details) and
// grpc.health.v1. proto-loader resolves google/protobuf/*.proto itself.
const definitions = protoLoader.loadSync(
  [
    'rollout_checkpoint/v1/participant_service.proto',
    'google/rpc/status.proto',
    'google/rpc/error_details.proto',
    'grpc/health/v1/health.proto',
  ],
  {
    keepCase: true, // checkpoint_id, not checkpointId
    longs: String, // int64/uint64 arrive as decimal strings
    enums: String, // 'PARTICIPANT_STATE_PREPARED', not 3
    defaults: true,
    oneofs: true,
    includeDirs: [
      path.join(REPO, 'protos'),
      path.join(REPO, 'third_party', 'googleapis'),
      path.join(__dirname, 'protos'),
    ],
  },
);
const proto = grpc.loadPackageDefinition(definitions);
const Status = definitions['google.rpc.Status'];
const ErrorInfo = definitions['google.rpc.ErrorInfo'];

// Every ParticipantService call needs `authorization: Bearer <token>`. grpc-js will not
// compose call credentials with insecure channel credentials, so an interceptor adds the
// header (on a plaintext channel it travels as ordinary metadata).
function bearer(token) {
  return (options, nextCall) =>
    new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        metadata.set('authorization', `Bearer ${token}`);
        next(metadata, listener);
      },
    });
}

function participantClient(token) {
  return new proto.rollout_checkpoint.v1.ParticipantService(
    GRPC_ADDRESS,
    grpc.credentials.createInsecure(),
    { interceptors: [bearer(token)] },
  );
}

// An absolute request deadline as a google.protobuf.Timestamp, `seconds` from now.
function timestamp(seconds) {
  const ms = Date.now() + seconds * 1000;
  return { seconds: Math.floor(ms / 1000), nanos: (ms % 1000) * 1e6 };
}

// The gRPC call deadline sits a little after the request's own deadline, so the
// participant (not the transport) reports a missed deadline.
const CALL_SLACK_S = 5;
function callOptions(requestDeadline) {
  const seconds = requestDeadline ? Number(requestDeadline.seconds) : Date.now() / 1000 + 30;
  return { deadline: new Date((seconds + CALL_SLACK_S) * 1000) };
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, callOptions(request.deadline), (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

// The one google.rpc.ErrorInfo of a refusal, from the `grpc-status-details-bin` trailer.
function errorInfo(err) {
  const [bytes] = err.metadata ? err.metadata.get('grpc-status-details-bin') : [];
  assert.ok(bytes, `no grpc-status-details-bin on ${err.code} ${err.details}`);
  const status = Status.deserialize(bytes);
  assert.equal(status.code, err.code, 'Status.code matches the gRPC status');
  const infos = status.details.filter((any) => any.type_url.endsWith('/google.rpc.ErrorInfo'));
  assert.equal(infos.length, 1, 'exactly one ErrorInfo');
  return ErrorInfo.deserialize(infos[0].value);
}

async function refused(promise, code, reason) {
  let err;
  try {
    await promise;
  } catch (caught) {
    err = caught;
  }
  assert.ok(err, `expected ${reason}, the call succeeded`);
  assert.equal(err.code, code, `status code (${err.code} ${err.details})`);
  const info = errorInfo(err);
  assert.equal(info.reason, reason);
  assert.equal(info.domain, DOMAIN);
  return info;
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
  const reply = await unary(client, 'GetParticipant', {});
  assert.equal(reply.kind, 'PARTICIPANT_KIND_RESOURCES');
  assert.equal(reply.instance, 'counter');
  assert.equal(reply.api_version, 'rollout_checkpoint.v1');
  assert.ok(reply.boot_id);
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
  const call = client.Prepare(
    { checkpoint_id: checkpointId, deadline: timestamp(30) },
    callOptions(timestamp(30)),
  );
  const messages = [];
  for await (const message of call) messages.push(message);
  assert.ok(messages.length >= 1);
  assert.equal(messages[0].update_kind, 'PREPARE_UPDATE_KIND_INITIAL');
  assert.deepEqual(
    messages.map((m) => m.sequence),
    messages.map((_, i) => String(i + 1)),
    'sequence counts 1, 2, ...',
  );
  const final = messages[messages.length - 1];
  assert.equal(final.final, true);
  assert.equal(final.update_kind, 'PREPARE_UPDATE_KIND_FINAL');
  assert.equal(final.state, 'PARTICIPANT_STATE_PREPARED');
  assert.equal(final.checkpoint_id, checkpointId);
  assert.equal(final.readiness.ready, true);
  assert.equal(final.admission_open, false);
  const ms = Number(final.elapsed.seconds) * 1000 + final.elapsed.nanos / 1e6;
  console.log(`   ${messages.length} message(s), PREPARED after ${ms.toFixed(1)} ms`);
});

step('Commit into a temporary directory: manifest, exported r1, records on disk', async () => {
  checkpointDir = fs.realpathSync(fs.mkdtempSync(path.join(os.tmpdir(), 'conformance-node-')));
  const reply = await unary(client, 'Commit', {
    checkpoint_id: checkpointId,
    deadline: timestamp(30),
    checkpoint_dir: checkpointDir,
  });
  assert.equal(reply.state, 'PARTICIPANT_STATE_COMMITTED');
  assert.deepEqual(reply.exported, ['r1']);
  const manifest = reply.manifest;
  assert.equal(manifest.kind, 'PARTICIPANT_KIND_RESOURCES');
  assert.equal(manifest.instance, 'counter');
  assert.equal(manifest.checkpoint_id, checkpointId);
  assert.equal(manifest.schema_version, 1);
  assert.equal(manifest.record_count, '1');
  const part = path.join(checkpointDir, 'participants', 'resources', 'counter');
  assert.equal(sha256(fs.readFileSync(path.join(part, 'manifest.json'))), reply.manifest_sha256);
  const records = fs.readFileSync(path.join(part, manifest.records_file));
  assert.equal(manifest.records_file, `records-${manifest.records_sha256}.jsonl`);
  assert.equal(sha256(records), manifest.records_sha256);
  assert.equal(String(records.length), manifest.bytes);
  const lines = records.toString('utf8').trim().split('\n').map(JSON.parse);
  assert.equal(lines.length, 1);
  assert.deepEqual(lines[0].episode_id, { rollout_id: 'r1', attempt: 0 });
  assert.deepEqual(lines[0].state, { count: 5 });
});

step('Resume: IDLE, not idempotent the first time', async () => {
  const reply = await unary(client, 'Resume', {
    checkpoint_id: checkpointId,
    deadline: timestamp(30),
  });
  assert.equal(reply.state, 'PARTICIPANT_STATE_IDLE');
  assert.equal(reply.idempotent, false);
});

step('Commit after Resume: ABORTED, ErrorInfo STALE_CHECKPOINT', async () => {
  const info = await refused(
    unary(client, 'Commit', {
      checkpoint_id: checkpointId,
      deadline: timestamp(30),
      checkpoint_dir: checkpointDir,
    }),
    grpc.status.ABORTED,
    'STALE_CHECKPOINT',
  );
  assert.equal(info.metadata.checkpointId, checkpointId);
});

step('a wrong token: UNAUTHENTICATED, ErrorInfo TOKEN_INVALID', async () => {
  const intruder = participantClient(`${TOKEN}-wrong`);
  try {
    await refused(
      unary(intruder, 'GetParticipant', {}),
      grpc.status.UNAUTHENTICATED,
      'TOKEN_INVALID',
    );
  } finally {
    intruder.close();
  }
});

step('grpc.health.v1.Health/Check without a token: SERVING', async () => {
  const health = new proto.grpc.health.v1.Health(GRPC_ADDRESS, grpc.credentials.createInsecure());
  try {
    for (const service of ['', 'participant-liveness', 'participant-readiness']) {
      const reply = await unary(health, 'Check', { service });
      assert.equal(reply.status, 'SERVING', `health of "${service}"`);
    }
  } finally {
    health.close();
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
