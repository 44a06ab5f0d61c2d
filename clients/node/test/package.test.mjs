// The package itself: its version follows the gateway's, and the proto it loads is the
// gateway's one proto.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { protoDirectory } from '@outbox-gateway/client';

const packageRoot = join(import.meta.dirname, '..');
const repository = join(packageRoot, '..', '..');

test('the package version is the gateway workspace version', () => {
  const cargo = readFileSync(join(repository, 'Cargo.toml'), 'utf8');
  const workspace = /\[workspace\.package\][^[]*?\nversion\s*=\s*"([^"]+)"/.exec(cargo);
  assert.ok(workspace, 'Cargo.toml has a [workspace.package] version');
  const { version } = JSON.parse(readFileSync(join(packageRoot, 'package.json'), 'utf8'));
  assert.equal(version, workspace[1], 'package.json version; set it to the gateway version');
});

test('the proto the package loads is the one proto of the repository', () => {
  const relative = join('outbox', 'v1', 'outbox.proto');
  const shipped = readFileSync(join(protoDirectory(), relative), 'utf8');
  const theOne = readFileSync(join(repository, 'proto', relative), 'utf8');
  // Not assert.equal: a diff of two 50 KB files says nothing more than this.
  assert.ok(shipped === theOne, 'dist/proto differs from proto/: rebuild with `npm run build`');
});

