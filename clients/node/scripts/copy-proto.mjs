// Copies the gateway's one proto, proto/outbox/v1/outbox.proto at the top of the
// repository, into dist/proto so that the published package carries it. The copy is a
// build output, never edited: test/package.test.mjs fails when it differs.
import { copyFileSync, mkdirSync } from 'node:fs';
import { dirname, join } from 'node:path';

const root = join(import.meta.dirname, '..');
const relative = join('outbox', 'v1', 'outbox.proto');
const source = join(root, '..', '..', 'proto', relative);
const target = join(root, 'dist', 'proto', relative);
mkdirSync(dirname(target), { recursive: true });
copyFileSync(source, target);
