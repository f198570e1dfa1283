#!/usr/bin/env node
/*
 * TEST-ONLY S3 stand-in for edl-argo's test suite. Never use it to hold real data.
 *
 * s3rver 3.7.1 serves the S3 API from a folder, but it does NOT check AWS Signature V4: it only looks
 * up the access key id, so a wrong secret key is accepted, and unsigned requests are accepted too.
 * This wrapper puts a front door in front of s3rver that
 *
 *   * rejects unsigned requests (AccessDenied), unknown access keys (InvalidAccessKeyId) and wrong
 *     Signature V4 header signatures (SignatureDoesNotMatch), as real S3 and MinIO do. The payload hash
 *     (x-amz-content-sha256) is part of the signed request but the body is not re-hashed; presigned
 *     URLs are not supported;
 *   * serves a control endpoint, POST /_standin/inject?count=N&status=503&code=SlowDown, that makes the
 *     next N S3 requests fail with that status and error code (to test retries); each call replaces the
 *     previous injection, so count=0 clears it. "_standin" is not a valid bucket name, so it cannot
 *     collide with S3 traffic;
 *   * serves POST /_standin/slow-disk?ms=N, which delays every write to the object folder by N ms;
 *   * stores objects and upload parts atomically, answering a PUT only once its data is on disk
 *     (s3rver answers earlier; see storeAtomically).
 *
 * Usage: node server.js --directory DIR [--address 127.0.0.1] [--port 0] [--parent-pid PID]
 * With --parent-pid it exits when that process is gone, so a killed test run leaves no server behind.
 * Credentials come from S3_STANDIN_ACCESS_KEY / S3_STANDIN_SECRET_KEY (not argv, so `ps` cannot show
 * them). When listening, it prints one line: "S3_STANDIN_LISTENING <address>:<port>".
 */
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const http = require('http');
const path = require('path');
const { Readable, Transform } = require('stream');
const { pipeline } = require('stream/promises');
const S3rver = require('s3rver');
const AWSAccount = require('s3rver/lib/models/account');
const FilesystemStore = require('s3rver/lib/stores/filesystem');

function parseArgs(argv) {
  const args = { address: '127.0.0.1', port: '0', directory: undefined, 'parent-pid': undefined };
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, '');
    if (!(name in args) || i + 1 >= argv.length) {
      throw new Error(`usage: server.js --directory DIR [--address A] [--port P] [--parent-pid PID]; bad argument ${argv[i]}`);
    }
    args[name] = argv[i + 1];
  }
  if (!args.directory) throw new Error('--directory is required');
  return args;
}

function rfc3986(text) {
  return encodeURIComponent(text).replace(
    /[!'()*]/g,
    c => '%' + c.charCodeAt(0).toString(16).toUpperCase(),
  );
}

const sha256Hex = data => crypto.createHash('sha256').update(data).digest('hex');
const hmac = (key, data) => crypto.createHmac('sha256', key).update(data).digest();

function canonicalQuery(query) {
  return query
    .split('&')
    .filter(Boolean)
    .map(pair => {
      const eq = pair.indexOf('=');
      const [k, v] = eq < 0 ? [pair, ''] : [pair.slice(0, eq), pair.slice(eq + 1)];
      return [rfc3986(decodeURIComponent(k)), rfc3986(decodeURIComponent(v))];
    })
    .sort((a, b) => (a[0] === b[0] ? (a[1] < b[1] ? -1 : 1) : a[0] < b[0] ? -1 : 1))
    .map(([k, v]) => `${k}=${v}`)
    .join('&');
}

/** Returns null when the request carries a valid SigV4 header signature, else an S3 error. */
function checkSignature(req, accessKey, secretKey) {
  const auth = req.headers.authorization;
  if (!auth) {
    return { status: 403, code: 'AccessDenied', message: 'Anonymous access is not allowed' };
  }
  const match = /^AWS4-HMAC-SHA256 Credential=([^,]+),\s*SignedHeaders=([^,]+),\s*Signature=([0-9a-f]+)$/.exec(
    auth.trim(),
  );
  if (!match) {
    return { status: 400, code: 'AuthorizationHeaderMalformed', message: 'Only AWS Signature V4 headers are supported' };
  }
  const [, credential, signedHeaders, signature] = match;
  const [keyId, date, region, service, terminator] = credential.split('/');
  if (keyId !== accessKey) {
    return { status: 403, code: 'InvalidAccessKeyId', message: 'The AWS Access Key Id you provided does not exist in our records.' };
  }
  const qmark = req.url.indexOf('?');
  const path = qmark < 0 ? req.url : req.url.slice(0, qmark);
  const query = qmark < 0 ? '' : req.url.slice(qmark + 1);
  const canonicalUri = path.split('/').map(s => rfc3986(decodeURIComponent(s))).join('/');
  const canonicalHeaders = signedHeaders
    .split(';')
    .map(h => `${h}:${String(req.headers[h] ?? '').trim().replace(/\s+/g, ' ')}\n`)
    .join('');
  const canonicalRequest = [
    req.method,
    canonicalUri,
    canonicalQuery(query),
    canonicalHeaders,
    signedHeaders,
    req.headers['x-amz-content-sha256'] || 'UNSIGNED-PAYLOAD',
  ].join('\n');
  const scope = [date, region, service, terminator].join('/');
  const stringToSign = ['AWS4-HMAC-SHA256', req.headers['x-amz-date'] || '', scope, sha256Hex(canonicalRequest)].join('\n');
  let key = hmac('AWS4' + secretKey, date);
  for (const part of [region, service, terminator]) key = hmac(key, part);
  const expected = hmac(key, stringToSign).toString('hex');
  if (expected.length !== signature.length || !crypto.timingSafeEqual(Buffer.from(expected), Buffer.from(signature))) {
    return {
      status: 403,
      code: 'SignatureDoesNotMatch',
      message: 'The request signature we calculated does not match the signature you provided.',
    };
  }
  return null;
}

function sendError(req, res, { status, code, message }) {
  const xml = '<?xml version="1.0" encoding="UTF-8"?>\n'
    + `<Error><Code>${code}</Code><Message>${message}</Message><RequestId>standin</RequestId></Error>`;
  // Drain the request body first: answering early would reset the connection mid-upload, which a
  // client rightly treats as a network failure rather than as this error.
  req.resume();
  req.on('end', () => {
    res.writeHead(status, { 'Content-Type': 'application/xml', 'Content-Length': Buffer.byteLength(xml) });
    res.end(req.method === 'HEAD' ? undefined : xml);
  });
}

/*
 * POST /_standin/slow-disk?ms=N makes every write of a file stream (s3rver writes object data with
 * them) wait N ms first, as a loaded disk would; ms=0 restores it.
 */
let slowDiskMs = 0;
for (const method of ['_write', '_writev']) {
  const original = fs.WriteStream.prototype[method];
  fs.WriteStream.prototype[method] = function delayedWrite(...args) {
    if (slowDiskMs > 0) setTimeout(() => original.apply(this, args), slowDiskMs);
    else original.apply(this, args);
  };
}

/*
 * s3rver 3.7.1 answers a PUT (and an UploadPart) as soon as the body has passed its MD5 transform,
 * while the last chunks may still be on their way to the file, which the PUT opened with truncation.
 * A read right after the PUT could then see an empty or short object: S3 and MinIO never do that.
 * The store's two writers are replaced by ones that write a temporary file beside the object, wait
 * until it is complete and closed, and rename it over the object, so a PUT is answered once its data
 * is stored and a reader sees the old object or the new one, never a part of it.
 */
let temporaries = 0;

async function storeAtomically(content, destination) {
  await fs.promises.mkdir(path.dirname(destination), { recursive: true });
  const temporary = `${destination}.standin-partial-${process.pid}-${temporaries++}`;
  const md5 = crypto.createHash('md5');
  let size = 0;
  const measure = new Transform({
    transform(chunk, encoding, callback) {
      md5.update(chunk);
      size += chunk.length;
      callback(null, chunk);
    },
  });
  const source = Buffer.isBuffer(content) ? Readable.from([content]) : content;
  try {
    await pipeline(source, measure, fs.createWriteStream(temporary));
    await fs.promises.rename(temporary, destination);
  } catch (err) {
    await fs.promises.rm(temporary, { force: true });
    throw err;
  }
  return { size, md5: md5.digest('hex') };
}

FilesystemStore.prototype.putObject = async function putObject(object) {
  const stored = await storeAtomically(
    object.content,
    this.getResourcePath(object.bucket, object.key, 'object'),
  );
  await this.putMetadata(object.bucket, object.key, object.metadata, stored.md5);
  return stored;
};

FilesystemStore.prototype.putPart = async function putPart(bucket, uploadId, partNumber, content) {
  const partPath = path.join(
    this.getResourcePath(bucket, undefined, 'uploads'),
    uploadId,
    partNumber.toString(),
  );
  const stored = await storeAtomically(content, partPath);
  await fs.promises.writeFile(`${partPath}.md5`, stored.md5);
  return stored;
};

function main() {
  const args = parseArgs(process.argv.slice(2));
  const accessKey = process.env.S3_STANDIN_ACCESS_KEY;
  const secretKey = process.env.S3_STANDIN_SECRET_KEY;
  if (!accessKey || !secretKey) throw new Error('set S3_STANDIN_ACCESS_KEY and S3_STANDIN_SECRET_KEY');
  // s3rver resolves the key id to its dummy account itself; register ours there too.
  AWSAccount.DUMMY_ACCOUNT.createKeyPair(accessKey, secretKey);

  const s3rver = new S3rver({ directory: args.directory, silent: true, vhostBuckets: false });
  const s3Handler = s3rver.callback();
  const injected = [];

  const server = http.createServer((req, res) => {
    if (req.url.startsWith('/_standin/slow-disk')) {
      const params = new URLSearchParams(req.url.split('?')[1] || '');
      slowDiskMs = Number(params.get('ms') || '0');
      req.resume();
      res.writeHead(204);
      res.end();
      return;
    }
    if (req.url.startsWith('/_standin/inject')) {
      const params = new URLSearchParams(req.url.split('?')[1] || '');
      const count = Number(params.get('count') || '1');
      const failure = {
        status: Number(params.get('status') || '503'),
        code: params.get('code') || 'SlowDown',
        message: 'Injected failure (test stand-in)',
      };
      injected.length = 0; // replace, so that count=0 clears earlier injections
      for (let i = 0; i < count; i++) injected.push(failure);
      req.resume();
      res.writeHead(204);
      res.end();
      return;
    }
    let failure;
    try {
      failure = injected.shift() || checkSignature(req, accessKey, secretKey);
    } catch (err) {
      failure = { status: 400, code: 'InvalidRequest', message: `Malformed request: ${err.message}` };
    }
    if (failure) {
      sendError(req, res, failure);
      return;
    }
    s3Handler(req, res);
  });
  server.listen(Number(args.port), args.address, () => {
    const { address, port } = server.address();
    process.stdout.write(`S3_STANDIN_LISTENING ${address}:${port}\n`);
  });
  for (const signal of ['SIGTERM', 'SIGINT']) process.on(signal, () => process.exit(0));
  if (args['parent-pid']) {
    const parent = Number(args['parent-pid']);
    setInterval(() => {
      try {
        process.kill(parent, 0);
      } catch {
        process.exit(0);
      }
    }, 1000).unref();
  }
}

main();
