// The helper layer of @rollout-checkpoint/client on its built dist/ (`npm test`, and
// tests/test_packages.py): what a refusal's trailer decodes to, and the formats.
'use strict';

const assert = require('node:assert/strict');
const test = require('node:test');

const client = require('..');

const { ErrorReason, HealthServiceName, MetadataKey, Status, grpc, rpc } = client;

// A ServiceError as grpc-js hands it over: the google.rpc.Status in `grpc-status-details-bin`.
function serviceError(code, infos) {
  const details = infos.map((info) => ({
    typeUrl: 'type.googleapis.com/google.rpc.ErrorInfo',
    value: rpc.ErrorInfo.encode(rpc.ErrorInfo.fromPartial(info)).finish(),
  }));
  const metadata = new grpc.Metadata();
  metadata.set('grpc-status-details-bin', Buffer.from(Status.encode({ code, message: 'refused', details }).finish()));
  return Object.assign(new Error('refused'), { code, details: 'refused', metadata });
}

test('the constants come from the proto', () => {
  assert.equal(client.ERROR_DOMAIN, 'rollout-checkpoint.dev');
  assert.equal(client.API_VERSION, 'v1');
  assert.equal(client.API_PACKAGE, 'rollout_checkpoint.v1');
  assert.equal(client.VERSION, require('../package.json').version);
  assert.equal(client.healthServiceName(HealthServiceName.HEALTH_SERVICE_NAME_SERVER), '');
  assert.equal(
    client.healthServiceName(HealthServiceName.HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS),
    'participant-liveness',
  );
  assert.equal(client.metadataKey(MetadataKey.METADATA_KEY_ACTIVE_CHECKPOINT_ID), 'activeCheckpointId');
  assert.equal(client.reasonString(ErrorReason.ERROR_REASON_BOOT_ID_MISMATCH), 'BOOT_ID_MISMATCH');
  assert.throws(() => client.healthServiceName(HealthServiceName.HEALTH_SERVICE_NAME_UNSPECIFIED));
});

test('reasonOf decodes the ErrorInfo of this domain', () => {
  const domain = client.ERROR_DOMAIN;
  const refusal = client.reasonOf(
    serviceError(grpc.status.ABORTED, [
      { domain: 'example.com', reason: 'OTHER' },
      { domain, reason: 'CHECKPOINT_CONFLICT', metadata: { activeCheckpointId: 'c0' } },
    ]),
  );
  assert.equal(refusal.code, grpc.status.ABORTED);
  assert.equal(refusal.reason, ErrorReason.ERROR_REASON_CHECKPOINT_CONFLICT);
  assert.deepEqual(refusal.metadata, { activeCheckpointId: 'c0' });
  // A newer server's reason: the server decided, the reason is unknown to this version.
  const newer = client.reasonOf(serviceError(grpc.status.ABORTED, [{ domain, reason: 'SOMETHING_NEW' }]));
  assert.equal(newer.reason, ErrorReason.UNRECOGNIZED);
  assert.equal(newer.info.reason, 'SOMETHING_NEW');
});

test('reasonOf is undefined for what the transport decided', () => {
  assert.equal(client.reasonOf(serviceError(grpc.status.ABORTED, [{ domain: 'example.com', reason: 'X' }])), undefined);
  assert.equal(client.reasonOf(serviceError(grpc.status.UNAVAILABLE, [])), undefined);
  assert.equal(client.reasonOf(Object.assign(new Error('x'), { code: 14, metadata: new grpc.Metadata() })), undefined);
  assert.equal(client.reasonOf(new Error('plain')), undefined);
  assert.equal(client.reasonOf(undefined), undefined);
});

test('parseReason knows the wire strings only', () => {
  assert.equal(client.parseReason('TOKEN_INVALID'), ErrorReason.ERROR_REASON_TOKEN_INVALID);
  for (const text of ['UNSPECIFIED', 'ERROR_REASON_TOKEN_INVALID', 'token_invalid', '']) {
    assert.equal(client.parseReason(text), ErrorReason.UNRECOGNIZED, text);
  }
});

test('the deadline metadata format', () => {
  assert.deepEqual(client.parseDeadline('1767225600.250000'), { seconds: '1767225600', nanos: 250000000 });
  assert.equal(client.formatDeadline({ seconds: '1767225600', nanos: 250000000 }), '1767225600.250000');
  assert.equal(client.formatDeadline({ seconds: '5', nanos: 999999999 }), '6.000000');
  for (const bad of ['1767225600.25', '1767225600', '-1.000000', '1e9.000000', '']) {
    assert.throws(() => client.parseDeadline(bad), undefined, bad);
  }
});

test('bearerToken sets the authorization metadata', async () => {
  const interceptor = client.bearerToken('s3cret');
  const sent = await new Promise((resolve) => {
    const nextCall = () => ({
      start: (metadata) => resolve(metadata),
      sendMessageWithContext() {},
      sendMessage() {},
      startRead() {},
      halfClose() {},
      cancelWithStatus() {},
      getPeer: () => '',
      setCredentials() {},
      getAuthContext: () => undefined,
    });
    interceptor({}, nextCall).start(new grpc.Metadata(), {});
  });
  assert.deepEqual(sent.get('authorization'), ['Bearer s3cret']);
});
