#!/usr/bin/env node
// @ts-check
/**
 * cli.js: a tiny command-line tool over ringq.js (used by tests/test_interop_node.py).
 *
 *   node cli.js publish --address A[,B,...] --queue Q --count N [--publisher P] [--declare] [--durable]
 *       publishes bodies "<P>:<seq>" for seq 1..N with confirms, waits for every
 *       confirm, prints one JSON line {"confirmed":N,"duplicates":D,"rejected":R,"resends":S,"publisher":P};
 *       exit status 0 if all N were confirmed (a DUPLICATE counts: the broker had it).
 *   node cli.js consume --address A[,B,...] --queue Q --count N [--prefetch K] [--timeout-ms T]
 *       consumes N deliveries, acks each on the Consume stream, closes the stream,
 *       prints one JSON line {"consumed":N,"redelivered":R,"bodies":[...in delivery order]};
 *       exit status 0 if N arrived within T ms (default 30000).
 *   node cli.js stream-publish --address A[,B,...] --stream S --count N [--prefix P] [--declare] [--groups G] [--durable]
 *       the stream's producer (waits for the lease): publishes bodies "<P>:<n>" for n 1..N with confirms,
 *       prints one JSON line {"confirmed":N,"resends":S,"token":T,"seqs":[...],"groups":[...]} (seqs are
 *       decimal strings, in publish order; groups: the send groups that confirmed, in order);
 *       with --declare, declares the stream first (G groups, default 3).
 *   node cli.js stream-consume --address A[,B,...] --stream S --count N [--prefetch K] [--timeout-ms T]
 *       the stream's consumer (waits for the lease): takes N messages in stream order, acks each,
 *       prints one JSON line {"consumed":N,"bodies":[...],"seqs":[...],"duplicatesDropped":D,"redelivered":R}.
 *
 * Both take --tls-ca PEM (TLS to the nodes, trusting that CA) and either --user U --password P or
 * --tls-cert PEM --tls-key PEM (a user certificate, at the nodes' certificate ports).
 *
 * Errors go to stderr as one JSON line {"error":..., "code":...} with exit status 1
 * (2 for bad usage). --address may be repeated or comma-separated.
 */
'use strict';

const { parseArgs } = require('node:util');
const ringq = require('./ringq');

const USAGE = `usage:
  node cli.js publish --address A[,B] --queue Q --count N [--publisher P] [--declare] [--durable] [TLS]
  node cli.js consume --address A[,B] --queue Q --count N [--prefetch K] [--timeout-ms T] [TLS]
  node cli.js stream-publish --address A[,B] --stream S --count N [--prefix P] [--declare] [--groups G] [--durable] [TLS]
  node cli.js stream-consume --address A[,B] --stream S --count N [--prefetch K] [--timeout-ms T] [TLS]
  TLS: [--tls-ca PEM] [--user U --password P | --tls-cert PEM --tls-key PEM]`;

/** @param {unknown} value */
function print(value) {
  process.stdout.write(`${JSON.stringify(value)}\n`);
}

/**
 * @param {string | undefined} text
 * @param {string} name
 */
function positive(text, name) {
  const value = Number(text);
  if (!Number.isInteger(value) || value < 0) throw new UsageError(`--${name} must be a whole number, got ${text}`);
  return value;
}

class UsageError extends Error {}

/** @param {string[]} argv */
async function main(argv) {
  const [command, ...rest] = argv;
  const { values } = parseArgs({
    args: rest,
    options: {
      address: { type: 'string', multiple: true },
      queue: { type: 'string' },
      stream: { type: 'string' },
      prefix: { type: 'string', default: 'node' },
      groups: { type: 'string', default: '3' },
      count: { type: 'string' },
      publisher: { type: 'string' },
      declare: { type: 'boolean', default: false },
      durable: { type: 'boolean', default: false },
      prefetch: { type: 'string', default: '100' },
      'timeout-ms': { type: 'string', default: '30000' },
      'tls-ca': { type: 'string' },
      'tls-cert': { type: 'string' },
      'tls-key': { type: 'string' },
      user: { type: 'string' },
      password: { type: 'string' },
    },
  });
  const addresses = (values.address ?? []).flatMap((a) => a.split(','));
  const streams = command === 'stream-publish' || command === 'stream-consume';
  if (addresses.length === 0 || !(streams ? values.stream : values.queue) || values.count === undefined) throw new UsageError(USAGE);
  const count = positive(values.count, 'count');
  if ((values.user === undefined) !== (values.password === undefined)) throw new UsageError('--user and --password go together');
  const client = await ringq.connect(addresses, {
    tls: values['tls-ca']
      ? { ca: values['tls-ca'], certificate: values['tls-cert'], key: values['tls-key'] }
      : undefined,
    credentials: values.user !== undefined ? { user: values.user, password: values.password ?? '' } : undefined,
  });
  try {
    const timeoutMs = positive(values['timeout-ms'], 'timeout-ms');
    const prefetch = positive(values.prefetch, 'prefetch');
    if (command === 'publish') return await publish(client, values.queue ?? '', count, values);
    if (command === 'consume') return await consume(client, values.queue ?? '', count, prefetch, timeoutMs);
    if (command === 'stream-publish') {
      return await streamPublish(client, values.stream ?? '', count, { ...values, groups: positive(values.groups, 'groups') });
    }
    if (command === 'stream-consume') return await streamConsume(client, values.stream ?? '', count, prefetch, timeoutMs);
    throw new UsageError(USAGE);
  } finally {
    client.close();
  }
}

/**
 * @param {import('./ringq').Client} client
 * @param {string} queue
 * @param {number} count
 * @param {{ publisher?: string, declare?: boolean, durable?: boolean }} options
 */
async function publish(client, queue, count, options) {
  if (options.declare) await client.declareQueue(queue, { durable: options.durable ?? false });
  const publisher = client.publisher(queue, { publisherId: options.publisher, persistent: options.durable ?? false });
  const results = await Promise.allSettled(
    Array.from({ length: count }, (_, i) => publisher.publish(`${publisher.publisherId}:${i + 1}`)),
  );
  await publisher.close();
  const summary = { confirmed: 0, duplicates: 0, rejected: 0, resends: publisher.resends, publisher: publisher.publisherId };
  /** @type {unknown} */
  let failure = null;
  for (const result of results) {
    if (result.status === 'fulfilled') {
      summary.confirmed++;
      if (result.value.outcome === 'PUBLISH_OUTCOME_DUPLICATE') summary.duplicates++;
    } else if (result.reason instanceof ringq.RejectedError) summary.rejected++;
    else failure ??= result.reason;
  }
  print(summary);
  if (failure !== null) throw failure;
  return summary.confirmed === count ? 0 : 1;
}

/**
 * @param {import('./ringq').Client} client
 * @param {string} queue
 * @param {number} count
 * @param {number} prefetch
 * @param {number} timeoutMs
 */
async function consume(client, queue, count, prefetch, timeoutMs) {
  /** @type {string[]} */
  const bodies = [];
  let redelivered = 0;
  /** @type {() => void} */
  let enough = () => {};
  const all = new Promise((resolve) => {
    enough = () => resolve(undefined);
  });
  if (count === 0) enough();
  const consumer = client.consume(queue, { prefetch }, (delivery, self) => {
    if (bodies.length >= count) {
      self.nack(delivery, true); // more than asked for: back to the queue
      return;
    }
    bodies.push(delivery.body.toString('utf8'));
    if (delivery.redelivered) redelivered++;
    self.ack(delivery);
    if (bodies.length === count) enough();
  });
  /** @type {NodeJS.Timeout | undefined} */
  let timer;
  const timedOut = new Promise((resolve) => {
    timer = setTimeout(() => resolve('timeout'), timeoutMs);
  });
  const outcome = await Promise.race([all, consumer.done, timedOut]);
  clearTimeout(timer);
  await consumer.close();
  await consumer.done; // rethrows the error that ended the consumer, if any
  print({ consumed: bodies.length, redelivered, bodies });
  if (outcome === 'timeout') {
    process.stderr.write(`${JSON.stringify({ error: `only ${bodies.length} of ${count} deliveries in ${timeoutMs} ms` })}\n`);
    return 1;
  }
  return 0;
}

/**
 * @param {import('./ringq').Client} client
 * @param {string} stream
 * @param {number} count
 * @param {{ prefix?: string, declare?: boolean, durable?: boolean, groups: number }} options
 */
async function streamPublish(client, stream, count, options) {
  const durable = options.durable ?? false;
  if (options.declare) await client.declareStream(stream, { groups: options.groups, durable });
  const producer = await client.streamProducer(stream, { persistent: durable });
  const prefix = options.prefix ?? 'node';
  try {
    const confirms = await Promise.all(Array.from({ length: count }, (_, i) => producer.publish(`${prefix}:${i + 1}`)));
    print({
      confirmed: confirms.length,
      resends: producer.resends,
      token: producer.fencingToken,
      seqs: confirms.map((c) => c.streamSeq),
      groups: producer.groupsUsed,
    });
  } finally {
    await producer.close();
  }
  return 0;
}

/**
 * @param {import('./ringq').Client} client
 * @param {string} stream
 * @param {number} count
 * @param {number} prefetch
 * @param {number} timeoutMs
 */
async function streamConsume(client, stream, count, prefetch, timeoutMs) {
  /** @type {string[]} */
  const bodies = [];
  /** @type {string[]} */
  const seqs = [];
  let redelivered = 0;
  /** @type {() => void} */
  let enough = () => {};
  const all = new Promise((resolve) => {
    enough = () => resolve(undefined);
  });
  if (count === 0) enough();
  /** @type {NodeJS.Timeout | undefined} */
  let timer;
  const timedOut = new Promise((resolve) => {
    timer = setTimeout(() => resolve('timeout'), timeoutMs);
  });
  const consumer = await client.streamConsumer(stream, { prefetch }, (message, self) => {
    if (bodies.length >= count) return; // more than asked for: left unacknowledged, it comes to the next consumer
    bodies.push(message.body.toString('utf8'));
    seqs.push(message.streamSeq);
    if (message.redelivered) redelivered++;
    self.ack(message);
    if (bodies.length === count) enough();
  });
  const outcome = await Promise.race([all, consumer.done, timedOut]);
  clearTimeout(timer);
  await consumer.close();
  await consumer.done; // rethrows the error that ended the consumer, if any
  print({ consumed: bodies.length, bodies, seqs, duplicatesDropped: consumer.duplicatesDropped, redelivered });
  if (outcome === 'timeout') {
    const waiting = consumer.waiting ? ` (the broker: ${consumer.waiting})` : '';
    process.stderr.write(`${JSON.stringify({ error: `only ${bodies.length} of ${count} messages in ${timeoutMs} ms${waiting}` })}\n`);
    return 1;
  }
  return 0;
}

/**
 * Exit once stdout and stderr are flushed (process.exit alone can cut a long line written to a pipe).
 * @param {number} code
 */
function exit(code) {
  process.stdout.write('', () => process.stderr.write('', () => process.exit(code)));
}

main(process.argv.slice(2)).then(exit, (error) => {
  const usage = error instanceof UsageError || error?.code === 'ERR_PARSE_ARGS_UNKNOWN_OPTION';
  const code = typeof error?.code === 'number' ? (ringq.statusName(error.code) ?? error.code) : error?.code;
  process.stderr.write(`${JSON.stringify({ error: error?.details || error?.message || String(error), code })}\n`);
  exit(usage ? 2 : 1);
});
