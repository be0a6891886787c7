// @ts-check
/**
 * ringq.js: a small Node.js client of ringq.v1.QueueService (mirrored queues)
 * and ringq.v1.StreamService (ordered streams).
 *
 * The service definitions are loaded at run time from the repository's protos/
 * directory (include path `protos/`, files `ringq/v1/queue.proto` and
 * `ringq/v1/stream.proto`; override with the `protosDir` option or the
 * RINGQ_PROTOS environment variable), so there is no generated code to keep in step.
 *
 * Conventions (proto-loader options, the same everywhere in this module):
 *   - keepCase: false: fields are camelCase (deliveryTag, consumerTag, ...);
 *   - longs: String: every uint64 read from the broker (delivery tags, seqs,
 *     message ids, depths) is a decimal string, so nothing is rounded; a
 *     uint64 sent may be a number or a string. Publisher seqs are handed to
 *     the caller as numbers (they count from 1 and stay far below 2^53);
 *   - enums: String: outcomes and settle kinds are their names
 *     ("PUBLISH_OUTCOME_CONFIRMED", "SETTLE_KIND_ACK", ...);
 *   - bytes are Buffers; defaults: true (absent fields read as their default).
 *
 * Guarantees:
 *   - any address of the cluster will do: a call that gets UNAVAILABLE
 *     (or DEADLINE_EXCEEDED / ABORTED) is retried on the next address;
 *   - a Publisher numbers its messages 1, 2, 3, ... under one publisher id and
 *     resolves each message's promise once the broker confirms it (every
 *     synchronised mirror holds it). When its stream breaks it opens a new one
 *     (on the next address) and resends every unconfirmed message in seq
 *     order; the broker drops the ones it already has (dedup by publisher id
 *     + seq), so nothing is lost and nothing is duplicated;
 *   - a Consumer settles deliveries on its Consume stream (acks ride the
 *     stream in order, batched per tick: no call each). If the stream breaks
 *     with a retryable status it reattaches (on the next address); deliveries
 *     of the old stream can no longer be settled (ack() returns false) and
 *     come back flagged redelivered: at-least-once delivery. An error the
 *     broker reports on the stream (e.g. FAILED_PRECONDITION for an unknown
 *     delivery tag) ends the consumer and rejects `consumer.done`.
 *   - ordered streams: a StreamProducer holds the stream's producer lease
 *     (waiting while another holds it, renewing it every ttl/3), numbers its
 *     messages stream_seq = token * 2^32 + n (decimal strings: they pass 2^53),
 *     resolves each message's promise once a confirm's confirmedThrough covers
 *     it, and resends every unconfirmed message with the same stream_seq on a
 *     new stream after UNAVAILABLE; a StreamConsumer holds the consumer lease,
 *     delivers in stream order and drops (and acks) every delivery whose
 *     stream_seq is not above the last one delivered (a copy left by a resend).
 *
 *     const ringq = require('./ringq');
 *     const client = await ringq.connect(['127.0.0.1:7101', '127.0.0.1:7102'],
 *       { tls: { ca: 'ca.pem' }, credentials: { user: 'alice', password: 'secret' } });
 *     await client.declareQueue('orders', { durable: true });
 *     const publisher = client.publisher('orders');
 *     await publisher.publish('hello');            // resolves on the confirm
 *     const consumer = client.consume('orders', { prefetch: 100 }, (d) => {
 *       console.log(d.body.toString());
 *       consumer.ack(d);
 *     });
 *     ...
 *     await consumer.close();
 *     await publisher.close();
 *
 *     await client.declareStream('events', { groups: 3, durable: true });
 *     const producer = await client.streamProducer('events');   // once it holds the lease
 *     const { streamSeq } = await producer.publish('e1');       // on the confirm
 *     await producer.close();
 *     const streamConsumer = await client.streamConsumer('events', { prefetch: 100 }, (m, self) => {
 *       console.log(m.streamSeq, m.body.toString());
 *       self.ack(m);
 *     });
 *     ...
 *     await streamConsumer.close();
 *     client.close();
 */
'use strict';

const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

/** Where protos/ is in this repository (clients/node/../../protos). */
const DEFAULT_PROTOS_DIR = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_FILE = 'ringq/v1/queue.proto';
const STREAM_PROTO_FILE = 'ringq/v1/stream.proto';
/** stream_seq = fencing token * 2^32 + n. */
const TOKEN_SHIFT = 32n;

/** The proto-loader options used for every message of this module. */
const LOADER_OPTIONS = Object.freeze({
  keepCase: false,
  longs: String,
  enums: String,
  bytes: Buffer,
  defaults: true,
  oneofs: true,
});

const CHANNEL_OPTIONS = Object.freeze({
  'grpc.max_send_message_length': 64 * 1024 * 1024,
  'grpc.max_receive_message_length': 64 * 1024 * 1024,
  'grpc.initial_reconnect_backoff_ms': 50,
  'grpc.max_reconnect_backoff_ms': 1000,
  // HTTP/2 keepalive: a node cut off by a network partition fails the calls waiting on it within
  // seconds (as the Python SDK's ringq.keepalive), so the client moves to another node.
  'grpc.keepalive_time_ms': 2000,
  'grpc.keepalive_timeout_ms': 2000,
  'grpc.keepalive_permit_without_calls': 1,
});

/** Statuses after which a call is retried on the next address. */
const RETRYABLE = new Set([grpc.status.UNAVAILABLE, grpc.status.DEADLINE_EXCEEDED, grpc.status.ABORTED]);
/** Streams also retry INTERNAL: a stream the broker ended while we were writing may report it. */
const STREAM_RETRYABLE = new Set([...RETRYABLE, grpc.status.INTERNAL]);

/**
 * @typedef {{ vhost: string, queue: string }} QueueRef
 * @typedef {{
 *   queue: QueueRef, masterNode: string, masterAddress: string, mirrors: string[],
 *   synchronisedMirrors: string[], depth: string, ready: string, unacked: string,
 *   consumers: number, policy: string, syncing: string[], status: string
 * }} QueueInfo
 * @typedef {{
 *   consumerTag: string, deliveryTag: string, body: Buffer, redelivered: boolean,
 *   deliveryCount: number, headers: Record<string, string>, publisher: string,
 *   seq: string, messageId: string
 * }} Delivery
 * @typedef {{ deliveries: Delivery[] }} ConsumeResponse
 * @typedef {'PUBLISH_OUTCOME_CONFIRMED' | 'PUBLISH_OUTCOME_DUPLICATE' | 'PUBLISH_OUTCOME_REJECTED'} PublishOutcome
 * @typedef {'SETTLE_KIND_ACK' | 'SETTLE_KIND_REQUEUE' | 'SETTLE_KIND_REJECT'} SettleKind
 * @typedef {{ seq: number, outcome: PublishOutcome }} Confirm
 * @typedef {{
 *   headers?: Record<string, string>, priority?: number, expirationMs?: number, persistent?: boolean
 * }} MessageOptions
 * @typedef {Error & { code?: number, details?: string }} ServiceErrorLike
 */

/** @type {Map<string, { QueueService: any, StreamService: any }>} */
const loaded = new Map();

/**
 * The QueueService and StreamService client constructors, loaded from `protosDir` (cached).
 * @param {string} protosDir
 * @returns {{ QueueService: any, StreamService: any }}
 */
function loadServices(protosDir) {
  let services = loaded.get(protosDir);
  if (services === undefined) {
    const definition = protoLoader.loadSync([PROTO_FILE, STREAM_PROTO_FILE], { ...LOADER_OPTIONS, includeDirs: [protosDir] });
    const descriptor = /** @type {any} */ (grpc.loadPackageDefinition(definition));
    services = { QueueService: descriptor.ringq.v1.QueueService, StreamService: descriptor.ringq.v1.StreamService };
    loaded.set(protosDir, services);
  }
  return services;
}

/** @param {number} ms */
function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * @param {unknown} error
 * @returns {number | undefined} the gRPC status code of `error`, if it has one
 */
function codeOf(error) {
  const code = /** @type {{ code?: unknown }} */ (error ?? {}).code;
  return typeof code === 'number' ? code : undefined;
}

/**
 * @param {number} code a gRPC status code
 * @returns {string | undefined} its name, e.g. "FAILED_PRECONDITION"
 */
function statusName(code) {
  return Object.entries(grpc.status).find(([, value]) => value === code)?.[0];
}

/** A message the broker refused (overflow reject-publish): the promise of its publish rejects with this. */
class RejectedError extends Error {
  /** @param {number} seq */
  constructor(seq) {
    super(`message seq ${seq} was rejected by the queue (it is full: overflow reject-publish)`);
    this.name = 'RejectedError';
    this.seq = seq;
  }
}

/**
 * Connect to a ringq cluster: resolves once one of `addresses` is reachable
 * (tried in order, round and round, until `connectTimeoutMs`).
 * @param {string[] | string} addresses "host:port" of any nodes (a string may list them comma-separated)
 * @param {ConnectOptions & { connectTimeoutMs?: number }} [options]
 * @returns {Promise<Client>}
 */
async function connect(addresses, options = {}) {
  const client = new Client(addresses, options);
  try {
    await client.ready(options.connectTimeoutMs ?? 10_000);
  } catch (error) {
    client.close();
    throw error;
  }
  return client;
}

/**
 * @typedef {object} ConnectOptions
 * @property {string} [vhost] the vhost of the queues named (default "/")
 * @property {string} [protosDir] where protos/ is (default: the repository's)
 * @property {{ ca?: string | Buffer, serverName?: string, certificate?: string | Buffer, key?: string | Buffer }} [tls]
 *   reach the nodes over TLS, trusting the CA certificate `ca` (a PEM path or bytes; absent: the system's roots);
 *   `serverName` overrides the name checked; `certificate` and `key` (PEM paths or bytes): a user certificate to
 *   authenticate with instead of credentials, at the nodes' certificate ports (--certificate-listen)
 * @property {{ user: string, password: string }} [credentials] the user to act as, sent with every call
 *   (`authorization: Basic ...`); only over TLS, so a password never crosses the network in clear
 */

/**
 * The channel credentials `options` ask for: plaintext, or TLS with the user's credentials on every call.
 * @param {ConnectOptions} options
 */
function channelCredentials(options) {
  if (!options.tls) {
    if (options.credentials) throw new Error('connect: credentials are sent only over TLS: give options.tls too');
    return grpc.credentials.createInsecure();
  }
  const { ca, certificate, key } = options.tls;
  if (!certificate !== !key) throw new Error('connect: tls.certificate and tls.key go together');
  const ssl = grpc.credentials.createSsl(pem(ca), pem(key), pem(certificate));
  if (!options.credentials) return ssl;
  const { user, password } = options.credentials;
  const authorization = `Basic ${Buffer.from(`${user}:${password}`).toString('base64')}`;
  const perCall = grpc.credentials.createFromMetadataGenerator((_params, callback) => {
    const metadata = new grpc.Metadata();
    metadata.set('authorization', authorization);
    callback(null, metadata);
  });
  return grpc.credentials.combineChannelCredentials(ssl, perCall);
}

/**
 * PEM bytes from a path or bytes (null if absent).
 * @param {string | Buffer | undefined} value
 */
function pem(value) {
  return typeof value === 'string' ? fs.readFileSync(value) : (value ?? null);
}

/** A connection to a ringq cluster (one channel per address; failover to the next on UNAVAILABLE). */
class Client {
  /**
   * @param {string[] | string} addresses
   * @param {ConnectOptions} [options]
   */
  constructor(addresses, options = {}) {
    const list = (typeof addresses === 'string' ? addresses.split(',') : addresses).map((a) => a.trim()).filter(Boolean);
    if (list.length === 0) throw new Error('connect: at least one address is needed');
    /** @type {string[]} */
    this.addresses = list;
    this.vhost = options.vhost ?? '/';
    const { QueueService, StreamService } = loadServices(options.protosDir ?? process.env.RINGQ_PROTOS ?? DEFAULT_PROTOS_DIR);
    const credentials = channelCredentials(options);
    const serverName = options.tls?.serverName;
    const channelOptions = serverName ? { ...CHANNEL_OPTIONS, 'grpc.ssl_target_name_override': serverName } : CHANNEL_OPTIONS;
    this.stubs = list.map((a) => new QueueService(a, credentials, channelOptions));
    /** StreamService stubs on the same channels (one connection per address). */
    this.streamStubs = list.map((a, i) => new StreamService(a, credentials, { channelOverride: this.stubs[i].getChannel() }));
    this.current = 0;
  }

  /**
   * Wait until one address is ready, preferring the current one.
   * @param {number} timeoutMs
   */
  async ready(timeoutMs) {
    const deadline = Date.now() + timeoutMs;
    /** @type {unknown} */
    let last;
    while (Date.now() < deadline) {
      const index = this.current;
      const stub = this.stubs[index];
      const wait = Math.min(1000, Math.max(1, deadline - Date.now()));
      try {
        await new Promise((resolve, reject) =>
          stub.waitForReady(Date.now() + wait, (/** @type {Error | undefined} */ e) => (e ? reject(e) : resolve(undefined))),
        );
        return;
      } catch (error) {
        last = error;
        this.failed(index);
      }
    }
    throw new Error(`none of ${this.addresses.join(', ')} could be reached: ${String(last)}`);
  }

  /**
   * @param {'queue' | 'stream'} [service] which service's stub (QueueService unless told)
   * @returns {{ stub: any, index: number }} the stub to use now
   */
  stub(service = 'queue') {
    const stubs = service === 'stream' ? this.streamStubs : this.stubs;
    return { stub: stubs[this.current], index: this.current };
  }

  /**
   * The address at `index` failed: use the next one (unless someone already moved on).
   * @param {number} index
   */
  failed(index) {
    if (this.current === index) this.current = (index + 1) % this.addresses.length;
  }

  /** @param {string} queue @returns {QueueRef} */
  ref(queue) {
    return { vhost: this.vhost, queue };
  }

  /**
   * A unary call, retried on the next address while the cluster is in transition.
   * @param {string} method e.g. "declareQueue" ("declareStream" with `service: 'stream'`)
   * @param {object} request
   * @param {{ attempts?: number, timeoutMs?: number, service?: 'queue' | 'stream' }} [options]
   * @returns {Promise<any>}
   */
  async call(method, request, options = {}) {
    const attempts = options.attempts ?? 60;
    const timeoutMs = options.timeoutMs ?? 10_000;
    for (let attempt = 1; ; attempt++) {
      const { stub, index } = this.stub(options.service);
      try {
        return await new Promise((resolve, reject) => {
          stub[method](request, { deadline: Date.now() + timeoutMs }, (/** @type {Error | null} */ e, /** @type {any} */ r) =>
            e ? reject(e) : resolve(r),
          );
        });
      } catch (error) {
        if (!RETRYABLE.has(/** @type {number} */ (codeOf(error))) || attempt >= attempts) throw error;
        this.failed(index);
        await sleep(Math.min(50 * attempt, 500));
      }
    }
  }

  /**
   * Declare a queue (or find it); FAILED_PRECONDITION if it exists with other properties.
   * @param {string} queue
   * @param {{ durable?: boolean, autoDelete?: boolean, exclusiveOwner?: string, arguments?: Record<string, string> }} [options]
   *   `arguments` values are JSON texts, e.g. { 'x-single-active-consumer': 'true' }
   * @returns {Promise<QueueInfo>}
   */
  async declareQueue(queue, options = {}) {
    const response = await this.call('declareQueue', {
      queue: this.ref(queue),
      durable: options.durable ?? false,
      autoDelete: options.autoDelete ?? false,
      exclusiveOwner: options.exclusiveOwner ?? '',
      arguments: options.arguments ?? {},
    });
    return response.queue;
  }

  /** @param {string} queue @returns {Promise<QueueInfo>} depth, consumers, master, mirrors */
  async status(queue) {
    const response = await this.call('queueStatus', { queue: this.ref(queue) });
    return response.queue;
  }

  /**
   * Take one message, if there is one (null if the queue has none ready).
   * Unless `noAck`, settle it with `settle(queue, delivery, kind)`.
   * @param {string} queue
   * @param {{ noAck?: boolean }} [options]
   * @returns {Promise<Delivery | null>}
   */
  async get(queue, options = {}) {
    const response = await this.call('get', { queue: this.ref(queue), noAck: options.noAck ?? false });
    return response.found ? response.delivery : null;
  }

  /**
   * Settle with a unary call (for deliveries of `get`; a Consumer settles on its stream).
   * @param {string} queue
   * @param {{ consumerTag?: string, deliveryTag: string | number }} delivery
   * @param {SettleKind} [kind]
   * @param {{ multiple?: boolean }} [options]
   */
  async settle(queue, delivery, kind = 'SETTLE_KIND_ACK', options = {}) {
    await this.call(
      'settle',
      {
        queue: this.ref(queue),
        consumerTag: delivery.consumerTag ?? '',
        deliveryTag: delivery.deliveryTag,
        multiple: options.multiple ?? false,
        kind,
      },
      { attempts: 3 },
    );
  }

  /**
   * A publisher to `queue`.
   * @param {string} queue
   * @param {PublisherOptions} [options]
   */
  publisher(queue, options = {}) {
    return new Publisher(this, queue, options);
  }

  /**
   * Consume `queue`: `onDelivery(delivery, consumer)` is called for each delivery;
   * settle it with `consumer.ack(delivery)` / `consumer.nack(delivery, requeue)`.
   * @param {string} queue
   * @param {ConsumerOptions} options
   * @param {(delivery: Delivery, consumer: Consumer) => unknown} onDelivery
   */
  consume(queue, options, onDelivery) {
    return new Consumer(this, queue, options ?? {}, onDelivery);
  }

  /** @param {string} stream @returns {StreamRef} */
  streamRef(stream) {
    return { vhost: this.vhost, stream };
  }

  /**
   * Declare an ordered stream of `groups` broker groups (placed on distinct nodes), or find it;
   * FAILED_PRECONDITION if it exists with other properties, INVALID_ARGUMENT with fewer than two groups
   * (or fewer than two live nodes).
   * @param {string} stream
   * @param {{ groups?: number, durable?: boolean }} [options] groups: 3; durable: true (survives restarts)
   * @returns {Promise<StreamInfo>}
   */
  async declareStream(stream, options = {}) {
    const request = { stream: this.streamRef(stream), groups: options.groups ?? 3, durable: options.durable ?? true };
    const response = await this.call('declareStream', request, { service: 'stream' });
    return response.stream;
  }

  /**
   * A stream's lists, groups, lease holders, and why consumption waits if it does (NOT_FOUND if there is none).
   * @param {string} stream
   * @returns {Promise<StreamInfo>}
   */
  async streamStatus(stream) {
    const response = await this.call('streamStatus', { stream: this.streamRef(stream) }, { service: 'stream' });
    return response.stream;
  }

  /**
   * Every stream of a vhost (this client's unless told; '' for every vhost), sorted by vhost and name.
   * @param {string} [vhost]
   * @returns {Promise<StreamInfo[]>}
   */
  async listStreams(vhost) {
    const response = await this.call('listStreams', { vhost: vhost ?? this.vhost }, { service: 'stream' });
    return response.streams;
  }

  /**
   * Delete a stream, its groups and their messages.
   * @param {string} stream
   */
  async deleteStream(stream) {
    await this.call('deleteStream', { stream: this.streamRef(stream) }, { service: 'stream' });
  }

  /**
   * The stream's active producer: resolves once it holds the producer lease (a standby waits while
   * another instance holds it).
   * @param {string} stream
   * @param {StreamProducerOptions} [options]
   * @returns {Promise<StreamProducer>}
   */
  async streamProducer(stream, options = {}) {
    const producer = new StreamProducer(this, stream, options);
    await producer.start();
    return producer;
  }

  /**
   * The stream's active consumer: resolves once it holds the consumer lease (a standby waits while
   * another instance holds it) and has attached; `onMessage(message, consumer)` is then called for
   * each message in stream order; acknowledge it with `consumer.ack(message)`.
   * @param {string} stream
   * @param {StreamConsumerOptions} options
   * @param {(message: StreamMessage, consumer: StreamConsumer) => unknown} onMessage
   * @returns {Promise<StreamConsumer>}
   */
  async streamConsumer(stream, options, onMessage) {
    const consumer = new StreamConsumer(this, stream, options ?? {}, onMessage);
    await consumer.start();
    return consumer;
  }

  /** Close every channel (close publishers, consumers and stream producers and consumers first). */
  close() {
    for (const stub of this.stubs) stub.close(); // the stream stubs share these channels
  }
}

/**
 * @typedef {{
 *   publisherId?: string, batchSize?: number, window?: number, persistent?: boolean, retryTimeoutMs?: number
 * }} PublisherOptions
 *   publisherId: dedup identity (default: random); batchSize: messages per PublishRequest (100);
 *   window: most unconfirmed messages on the wire (1000); persistent: default for messages (false);
 *   retryTimeoutMs: give up (reject every pending message) after this long without a confirm while
 *   the stream keeps failing (30 s)
 */

/**
 * @typedef {{ seq: number, message: object, resolve: (c: Confirm) => void, reject: (e: Error) => void }} Pending
 */

/** Publishes to one queue with confirms, an idempotent publisher id, batches and a bounded window. */
class Publisher {
  /**
   * @param {Client} client
   * @param {string} queue
   * @param {PublisherOptions} [options]
   */
  constructor(client, queue, options = {}) {
    this.client = client;
    this.queue = queue;
    this.publisherId = options.publisherId ?? crypto.randomUUID().replaceAll('-', '');
    this.batchSize = Math.max(1, options.batchSize ?? 100);
    this.window = Math.max(1, options.window ?? 1000);
    this.persistent = options.persistent ?? false;
    this.retryTimeoutMs = options.retryTimeoutMs ?? 30_000;
    /** The seq the next message gets. */
    this.nextSeq = 1;
    /** How many times a broken stream was replaced (every unconfirmed message resent). */
    this.resends = 0;
    /** @type {Map<number, Pending>} unconfirmed messages, in seq order */
    this.pending = new Map();
    /** @type {number[]} seqs not yet written on the current stream, in order */
    this.unsent = [];
    /** @type {any} the current Publish stream */
    this.call = null;
    this.scheduled = false;
    this.reopening = false;
    this.closed = false;
    /** @type {number | null} when the stream started failing with no confirm since */
    this.failingSince = null;
    this.failures = 0;
    /** @type {(() => void)[]} */
    this.idleWaiters = [];
  }

  /**
   * Publish one message; resolves with its seq and outcome once the broker
   * confirmed it (CONFIRMED, or DUPLICATE if the broker already had it);
   * rejects with RejectedError if the queue refused it, or with the stream's
   * error if that is not retryable (or retrying took longer than retryTimeoutMs).
   * @param {Buffer | string} body
   * @param {MessageOptions} [options]
   * @returns {Promise<Confirm>}
   */
  publish(body, options = {}) {
    if (this.closed) return Promise.reject(new Error('publisher is closed'));
    const seq = this.nextSeq++;
    const message = {
      body: Buffer.isBuffer(body) ? body : Buffer.from(body),
      seq,
      persistent: options.persistent ?? this.persistent,
      headers: options.headers ?? {},
      priority: options.priority ?? 0,
      expirationMs: options.expirationMs ?? 0,
    };
    return new Promise((resolve, reject) => {
      this.pending.set(seq, { seq, message, resolve, reject });
      this.unsent.push(seq);
      this.schedule();
    });
  }

  /**
   * Publish many; resolves when every one is settled (rejects on the first refusal).
   * @param {(Buffer | string)[]} bodies
   * @param {MessageOptions} [options]
   */
  publishMany(bodies, options = {}) {
    return Promise.all(bodies.map((b) => this.publish(b, options)));
  }

  /** Resolves once every message published so far is confirmed or refused. */
  flush() {
    if (this.pending.size === 0) return Promise.resolve();
    return new Promise((resolve) => this.idleWaiters.push(() => resolve(undefined)));
  }

  /** Wait for every confirm, then end the stream. */
  async close() {
    await this.flush();
    this.closed = true;
    const call = this.call;
    this.call = null;
    if (call !== null) call.end();
  }

  /** Write what the window allows on the next tick, so messages published together share a batch. */
  schedule() {
    if (this.scheduled) return;
    this.scheduled = true;
    setImmediate(() => {
      this.scheduled = false;
      this.pump();
    });
  }

  pump() {
    if (this.reopening || this.unsent.length === 0) return;
    if (this.call === null) this.open();
    const ref = this.client.ref(this.queue);
    while (this.unsent.length > 0) {
      const inFlight = this.pending.size - this.unsent.length;
      const room = Math.min(this.batchSize, this.window - inFlight);
      if (room <= 0) return;
      const seqs = this.unsent.splice(0, room);
      const messages = [];
      for (const seq of seqs) {
        const entry = this.pending.get(seq);
        if (entry !== undefined) messages.push(entry.message);
      }
      if (messages.length > 0) this.call.write({ queue: ref, publisher: this.publisherId, messages });
    }
  }

  open() {
    const { stub, index } = this.client.stub();
    const call = stub.publish();
    this.call = call;
    call.on('data', (/** @type {{ seqs: string[], outcomes: PublishOutcome[] }} */ response) => {
      if (call !== this.call) return;
      this.confirmed(response);
    });
    call.on('error', (/** @type {ServiceErrorLike} */ error) => {
      if (call !== this.call) return;
      this.broken(error, index);
    });
    call.on('end', () => {
      if (call !== this.call) return;
      const error = Object.assign(new Error('the broker ended the publish stream'), { code: grpc.status.UNAVAILABLE });
      this.broken(error, index);
    });
  }

  /** @param {{ seqs: string[], outcomes: PublishOutcome[] }} response */
  confirmed(response) {
    this.failingSince = null;
    this.failures = 0;
    response.seqs.forEach((text, i) => {
      const seq = Number(text);
      const entry = this.pending.get(seq);
      if (entry === undefined) return;
      this.pending.delete(seq);
      const outcome = response.outcomes[i];
      if (outcome === 'PUBLISH_OUTCOME_REJECTED') entry.reject(new RejectedError(seq));
      else entry.resolve({ seq, outcome });
    });
    this.idleCheck();
    this.pump();
  }

  /**
   * The stream failed: reopen (resending every unconfirmed message) or give up.
   * @param {ServiceErrorLike} error
   * @param {number} index
   */
  broken(error, index) {
    const call = this.call;
    this.call = null;
    if (call !== null) call.cancel();
    const retryable = STREAM_RETRYABLE.has(/** @type {number} */ (codeOf(error)));
    if (this.failingSince === null) this.failingSince = Date.now();
    if (!retryable || Date.now() - this.failingSince > this.retryTimeoutMs) {
      this.failingSince = null;
      const entries = [...this.pending.values()];
      this.pending.clear();
      this.unsent = [];
      for (const entry of entries) entry.reject(error);
      this.idleCheck();
      return;
    }
    this.client.failed(index);
    this.resends++;
    this.failures++;
    this.reopening = true;
    setTimeout(() => {
      this.reopening = false;
      this.unsent = [...this.pending.keys()]; // seq order: resend every unconfirmed message
      this.pump();
    }, Math.min(50 * this.failures, 1000));
  }

  idleCheck() {
    if (this.pending.size > 0) return;
    const waiters = this.idleWaiters;
    this.idleWaiters = [];
    for (const wake of waiters) wake();
  }
}

/**
 * @typedef {{ prefetch?: number, consumerTag?: string, priority?: number, resume?: boolean, closeTimeoutMs?: number }} ConsumerOptions
 *   prefetch: most unsettled deliveries (100; 0: unlimited); consumerTag: empty lets the broker name it;
 *   resume: reattach after a retryable stream failure (true); closeTimeoutMs: how long close() waits
 *   for the broker to end the stream after our half-close before cancelling it (5 s)
 */

/** A consumer on a Consume stream; settlements ride the same stream. */
class Consumer {
  /**
   * @param {Client} client
   * @param {string} queue
   * @param {ConsumerOptions} options
   * @param {(delivery: Delivery, consumer: Consumer) => unknown} onDelivery
   */
  constructor(client, queue, options, onDelivery) {
    this.client = client;
    this.queue = queue;
    this.prefetch = options.prefetch ?? 100;
    this.consumerTag = options.consumerTag ?? '';
    this.priority = options.priority ?? 0;
    this.resume = options.resume ?? true;
    this.closeTimeoutMs = options.closeTimeoutMs ?? 5_000;
    this.onDelivery = onDelivery;
    /** @type {any} the current Consume stream */
    this.call = null;
    /** Which stream is current: deliveries of an earlier one can no longer be settled. */
    this.generation = 0;
    /** @type {WeakMap<object, number>} delivery -> generation of the stream that brought it */
    this.origins = new WeakMap();
    /** @type {{ deliveryTag: string | number, multiple: boolean, kind: SettleKind }[]} */
    this.settlements = [];
    this.flushScheduled = false;
    this.closing = false;
    this.failures = 0;
    /** How many times the consumer reattached after a broken stream. */
    this.reattached = 0;
    /** @type {(value: void) => void} */
    let resolveDone = () => {};
    /** @type {(error: Error) => void} */
    let rejectDone = () => {};
    /** Settles when the consumer ends: resolves after close(), rejects with the error that ended it. */
    this.done = new Promise((resolve, reject) => {
      resolveDone = resolve;
      rejectDone = reject;
    });
    this.done.catch(() => {}); // a caller that never looks at `done` gets no unhandled rejection
    this.resolveDone = resolveDone;
    this.rejectDone = rejectDone;
    this.ended = false;
    this.attach();
  }

  attach() {
    const { stub, index } = this.client.stub();
    const call = stub.consume();
    const generation = ++this.generation;
    this.call = call;
    this.settlements = [];
    call.write({
      queue: this.client.ref(this.queue),
      consumerTag: this.consumerTag,
      prefetch: this.prefetch,
      priority: this.priority,
    });
    call.on('data', (/** @type {ConsumeResponse} */ response) => {
      for (const delivery of response.deliveries) {
        // After close() (or an onDelivery that failed the consumer, even mid-response): the broker requeues it.
        if (call !== this.call || this.closing) return;
        this.failures = 0;
        this.origins.set(delivery, generation);
        try {
          const result = this.onDelivery(delivery, this);
          if (result instanceof Promise) result.catch((error) => this.fail(error));
        } catch (error) {
          this.fail(/** @type {Error} */ (error));
        }
      }
    });
    call.on('error', (/** @type {ServiceErrorLike} */ error) => {
      if (call !== this.call) return;
      this.call = null;
      if (this.closing) return this.finish();
      if (this.resume && STREAM_RETRYABLE.has(/** @type {number} */ (codeOf(error)))) {
        this.client.failed(index);
        this.failures++;
        this.reattached++;
        setTimeout(() => {
          if (!this.closing && !this.ended) this.attach();
        }, Math.min(100 * this.failures, 1000));
        return;
      }
      this.fail(error);
    });
    call.on('end', () => {
      if (call !== this.call) return;
      this.call = null;
      if (this.closing) return this.finish();
      this.fail(Object.assign(new Error('the broker ended the consume stream'), { code: grpc.status.UNAVAILABLE }));
    });
  }

  /**
   * Acknowledge a delivery (with `multiple`, also every earlier one of this consumer).
   * @param {Delivery | { deliveryTag: string | number }} delivery
   * @param {{ multiple?: boolean }} [options]
   * @returns {boolean} false if the delivery came on a stream that is gone (it will be redelivered)
   */
  ack(delivery, options = {}) {
    return this.settle(delivery, 'SETTLE_KIND_ACK', options.multiple ?? false);
  }

  /**
   * Refuse a delivery: requeue it (the default) or reject it (dead-lettered if the queue says so).
   * @param {Delivery | { deliveryTag: string | number }} delivery
   * @param {boolean} [requeue]
   * @param {{ multiple?: boolean }} [options]
   * @returns {boolean} false if the delivery came on a stream that is gone
   */
  nack(delivery, requeue = true, options = {}) {
    return this.settle(delivery, requeue ? 'SETTLE_KIND_REQUEUE' : 'SETTLE_KIND_REJECT', options.multiple ?? false);
  }

  /**
   * Queue a settlement for the current stream (sent with the others of this tick).
   * A delivery tag this consumer never received is sent as it is: the broker
   * then ends the stream with FAILED_PRECONDITION (see `done`).
   * @param {Delivery | { deliveryTag: string | number }} delivery
   * @param {SettleKind} kind
   * @param {boolean} multiple
   * @returns {boolean}
   */
  settle(delivery, kind, multiple) {
    if (this.call === null || this.ended) return false;
    const origin = this.origins.get(delivery);
    if (origin !== undefined && origin !== this.generation) return false;
    this.settlements.push({ deliveryTag: delivery.deliveryTag, multiple, kind });
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      setImmediate(() => this.flush());
    }
    return true;
  }

  flush() {
    this.flushScheduled = false;
    if (this.settlements.length === 0 || this.call === null) return;
    const settlements = this.settlements;
    this.settlements = [];
    this.call.write({ settlements });
  }

  /**
   * Stop consuming: send pending settlements, half-close the stream and wait
   * (up to closeTimeoutMs) for the broker to end it, then cancel it. The broker
   * requeues whatever was delivered and not settled.
   */
  async close() {
    if (this.closing || this.ended) return this.done.catch(() => {});
    this.closing = true;
    const call = this.call;
    if (call === null) {
      this.finish();
      return;
    }
    this.flush();
    call.end();
    const timer = setTimeout(() => {
      if (this.call === call) {
        this.call = null;
        call.cancel();
        this.finish();
      }
    }, this.closeTimeoutMs);
    await this.done.catch(() => {});
    clearTimeout(timer);
  }

  finish() {
    if (this.ended) return;
    this.ended = true;
    this.resolveDone();
  }

  /** @param {Error} error */
  fail(error) {
    if (this.ended) return;
    this.ended = true;
    const call = this.call;
    this.call = null;
    if (call !== null) call.cancel();
    this.rejectDone(error);
  }
}

// ---------------------------------------------------------------------- ordered streams

/**
 * @typedef {{ vhost: string, stream: string }} StreamRef
 * @typedef {'STREAM_ROLE_PRODUCER' | 'STREAM_ROLE_CONSUMER'} StreamRole
 * @typedef {{ role: StreamRole, holder: string, fencingToken: string, expiresInMs: string }} StreamLeaseInfo
 * @typedef {{
 *   group: string, masterNode: string, mirrors: string[], synchronisedMirrors: string[], depth: string,
 *   whole: boolean, state: string, generation: string
 * }} StreamGroupInfo
 * @typedef {{
 *   stream: StreamRef, durable: boolean, sendList: string[], consumeList: string[], groups: StreamGroupInfo[],
 *   leases: StreamLeaseInfo[], consumeState: string
 * }} StreamInfo
 * @typedef {{
 *   streamSeq: string, producerToken: string, body: Buffer, headers: Record<string, string>, group: string,
 *   deliveryTag: string, redelivered: boolean
 * }} StreamMessage
 *   streamSeq: decimal string (token * 2^32 + n); producerToken: the token of the producer that published it
 * @typedef {{ streamSeq: string, group: string }} StreamConfirm
 *   streamSeq of the message confirmed, group that took it (both replicas hold it)
 * @typedef {{
 *   streamSeq: { toString(): string }, deliveryTag: string, group: string, body: Buffer,
 *   headers: Record<string, string>, redelivered: boolean
 * }} StreamDelivery
 */

/**
 * @typedef {{
 *   holder?: string, leaseTtlMs?: number, batchSize?: number, window?: number, persistent?: boolean,
 *   retryTimeoutMs?: number
 * }} StreamProducerOptions
 *   holder: this instance's lease identity (default: host.pid.random); leaseTtlMs: the lease's time to
 *   live (3000; renewed every third of it); batchSize: messages per PublishStreamRequest (100, at most
 *   1000); window: most unconfirmed messages on the wire (1000); persistent: default for messages (true:
 *   on disk in both replicas before the confirm, on a durable stream); retryTimeoutMs: give up (reject
 *   every pending message) after this long without a confirm while the stream keeps failing (30 s)
 * @typedef {{ holder?: string, leaseTtlMs?: number, prefetch?: number, closeTimeoutMs?: number }} StreamConsumerOptions
 *   prefetch: most unacknowledged deliveries (100); closeTimeoutMs: how long close() waits for the broker
 *   to end the stream after our half-close before cancelling it (1 s)
 */

/** @param {Client} client @returns {string} a lease holder id unique to this process and instance */
function holderId(client) {
  return `node.${os.hostname()}.${process.pid}.${crypto.randomUUID().slice(0, 8)}@${client.addresses[0]}`;
}

/**
 * A stream lease held by this process: acquired (waiting while another holds it), then renewed every
 * ttl/3 until released. A renewal refused with FAILED_PRECONDITION means the lease was lost (it expired
 * and another instance took it): `lost` is set and the `onLost` callbacks run.
 */
class StreamLease {
  /**
   * @param {Client} client
   * @param {string} stream
   * @param {StreamRole} role
   * @param {string} holder
   * @param {number} ttlMs
   */
  constructor(client, stream, role, holder, ttlMs) {
    this.client = client;
    this.stream = stream;
    this.role = role;
    this.holder = holder;
    this.ttlMs = ttlMs;
    /** The fencing token granted, a decimal string ('0' until acquired). */
    this.token = '0';
    /** @type {ServiceErrorLike | null} why the lease was lost, if it was */
    this.lost = null;
    /** @type {((error: ServiceErrorLike) => void)[]} */
    this.onLost = [];
    /** @type {NodeJS.Timeout | null} */
    this.timer = null;
    this.released = false;
  }

  /** Acquire the lease, waiting while another holder has it; resolves with the fencing token. */
  async acquire() {
    const request = { stream: this.client.streamRef(this.stream), role: this.role, holder: this.holder, ttlMs: this.ttlMs };
    for (;;) {
      if (this.released) throw new Error(`stream ${this.stream}: closed while waiting for the ${this.role} lease`);
      try {
        const response = await this.client.call('acquireStreamLease', request, { service: 'stream' });
        this.token = response.lease.fencingToken;
        this.schedule(this.ttlMs / 3);
        return this.token;
      } catch (error) {
        const { code, details } = /** @type {ServiceErrorLike} */ (error);
        if (code !== grpc.status.FAILED_PRECONDITION || !String(details).includes('held by')) throw error;
        await sleep(Math.min(this.ttlMs / 4, 250)); // a standby: wait for the lease
      }
    }
  }

  /** @param {number} ms */
  schedule(ms) {
    if (this.released || this.lost !== null) return;
    this.timer = setTimeout(() => this.renew(), ms);
  }

  renew() {
    this.timer = null;
    const request = {
      stream: this.client.streamRef(this.stream),
      role: this.role,
      holder: this.holder,
      fencingToken: this.token,
      ttlMs: this.ttlMs,
    };
    const { stub, index } = this.client.stub('stream');
    stub.renewStreamLease(request, { deadline: Date.now() + this.ttlMs / 6 }, (/** @type {ServiceErrorLike | null} */ error) => {
      if (this.released) return;
      if (error === null) return this.schedule(this.ttlMs / 3);
      if (error.code === grpc.status.FAILED_PRECONDITION) {
        this.lost = error;
        for (const callback of this.onLost) callback(error);
        return;
      }
      this.client.failed(index); // at once on another node; the broker fences us if we are late
      this.schedule(50);
    });
  }

  /** Stop renewing and give the lease up (a standby takes over at once); idempotent. */
  async release() {
    if (this.released) return;
    this.released = true;
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
    if (this.token === '0' || this.lost !== null) return;
    const request = { stream: this.client.streamRef(this.stream), role: this.role, holder: this.holder, fencingToken: this.token };
    try {
      await this.client.call('releaseStreamLease', request, { service: 'stream', attempts: 3, timeoutMs: 5_000 });
    } catch {
      // it expires on its own
    }
  }
}

/**
 * @typedef {{
 *   seq: bigint, message: { streamSeq: string, body: Buffer, headers: Record<string, string>, persistent: boolean },
 *   resolve: (c: StreamConfirm) => void, reject: (e: Error) => void
 * }} StreamPending
 */

/**
 * The single active producer of a stream (made by `client.streamProducer`). Messages are numbered
 * stream_seq = token * 2^32 + n (n = 1, 2, 3, ...), sent in batches on a PublishStream call with the
 * fencing token, and each one's promise resolves once a confirm's confirmedThrough reaches its
 * stream_seq. When the call breaks (UNAVAILABLE: the send group failed or is changing) a new one is
 * opened on the next address and every unconfirmed message is resent with the same stream_seq (the
 * stream may then hold it twice; consumers drop the copy). A lost lease or a stale token
 * (FAILED_PRECONDITION) rejects every pending message and every later publish.
 */
class StreamProducer {
  /**
   * @param {Client} client
   * @param {string} stream
   * @param {StreamProducerOptions} [options]
   */
  constructor(client, stream, options = {}) {
    this.client = client;
    this.stream = stream;
    this.lease = new StreamLease(client, stream, 'STREAM_ROLE_PRODUCER', options.holder ?? holderId(client), options.leaseTtlMs ?? 3000);
    this.batchSize = Math.min(1000, Math.max(1, options.batchSize ?? 100));
    this.window = Math.max(1, options.window ?? 1000);
    this.persistent = options.persistent ?? true;
    this.retryTimeoutMs = options.retryTimeoutMs ?? 30_000;
    /** token * 2^32, once the lease is held. */
    this.base = 0n;
    /** How many messages were published (the n of the last one). */
    this.count = 0;
    /** How many times a broken stream was replaced (every unconfirmed message resent). */
    this.resends = 0;
    /** @type {string[]} send groups in the order they confirmed messages */
    this.groupsUsed = [];
    /** @type {Map<number, StreamPending>} unconfirmed messages by n, in order */
    this.pending = new Map();
    /** @type {number[]} n of the messages not yet written on the current call, in order */
    this.unsent = [];
    /** @type {any} the current PublishStream call */
    this.call = null;
    this.scheduled = false;
    this.reopening = false;
    this.closed = false;
    /** @type {ServiceErrorLike | null} what ended this producer (a lost lease, a stale token) */
    this.error = null;
    /** @type {number | null} */
    this.failingSince = null;
    this.failures = 0;
    /** @type {(() => void)[]} */
    this.idleWaiters = [];
  }

  /** The fencing token of the producer lease, a decimal string. */
  get fencingToken() {
    return this.lease.token;
  }

  async start() {
    const token = await this.lease.acquire();
    this.base = BigInt(token) << TOKEN_SHIFT;
    this.lease.onLost.push((error) => this.fail(error));
    return this;
  }

  /**
   * Publish one message; resolves with its stream_seq and the group that took it once both replicas
   * of that group hold it; rejects if the lease is lost, the token is stale, or retrying took longer
   * than retryTimeoutMs.
   * @param {Buffer | string} body
   * @param {{ headers?: Record<string, string>, persistent?: boolean }} [options] header names starting
   *   "x-stream-" are reserved
   * @returns {Promise<StreamConfirm>}
   */
  publish(body, options = {}) {
    if (this.closed) return Promise.reject(new Error('the stream producer is closed'));
    if (this.error !== null) return Promise.reject(this.error);
    if (this.base === 0n) return Promise.reject(new Error('the stream producer is not started (use client.streamProducer)'));
    if (this.count >= 0xffffffff) return Promise.reject(new Error('this producer numbered 2^32 - 1 messages: take a new lease'));
    const n = ++this.count;
    const seq = this.base + BigInt(n);
    const message = {
      streamSeq: seq.toString(),
      body: Buffer.isBuffer(body) ? body : Buffer.from(body),
      headers: options.headers ?? {},
      persistent: options.persistent ?? this.persistent,
    };
    return new Promise((resolve, reject) => {
      this.pending.set(n, { seq, message, resolve, reject });
      this.unsent.push(n);
      this.schedule();
    });
  }

  /**
   * Publish many; resolves when every one is confirmed (rejects on the first failure).
   * @param {(Buffer | string)[]} bodies
   * @param {{ headers?: Record<string, string>, persistent?: boolean }} [options]
   */
  publishMany(bodies, options = {}) {
    return Promise.all(bodies.map((b) => this.publish(b, options)));
  }

  /** Resolves once every message published so far is confirmed or failed. */
  flush() {
    if (this.pending.size === 0) return Promise.resolve();
    return new Promise((resolve) => this.idleWaiters.push(() => resolve(undefined)));
  }

  /** Wait for every confirm, end the call and give the lease up (a standby takes over at once); idempotent. */
  async close() {
    if (this.closed) return;
    await this.flush();
    this.closed = true;
    const call = this.call;
    this.call = null;
    if (call !== null) call.end();
    await this.lease.release();
  }

  /** Write what the window allows on the next tick, so messages published together share a batch. */
  schedule() {
    if (this.scheduled) return;
    this.scheduled = true;
    setImmediate(() => {
      this.scheduled = false;
      this.pump();
    });
  }

  pump() {
    if (this.reopening || this.unsent.length === 0 || this.error !== null) return;
    if (this.call === null) this.open();
    const ref = this.client.streamRef(this.stream);
    while (this.unsent.length > 0) {
      const inFlight = this.pending.size - this.unsent.length;
      const room = Math.min(this.batchSize, this.window - inFlight);
      if (room <= 0) return;
      const messages = [];
      for (const n of this.unsent.splice(0, room)) {
        const entry = this.pending.get(n);
        if (entry !== undefined) messages.push(entry.message);
      }
      if (messages.length > 0) this.call.write({ stream: ref, fencingToken: this.lease.token, messages });
    }
  }

  open() {
    const { stub, index } = this.client.stub('stream');
    const call = stub.publishStream();
    this.call = call;
    call.on('data', (/** @type {{ confirmedThrough: string, group: string }} */ response) => {
      if (call !== this.call) return;
      this.confirmed(response);
    });
    call.on('error', (/** @type {ServiceErrorLike} */ error) => {
      if (call !== this.call) return;
      this.broken(error, index);
    });
    call.on('end', () => {
      if (call !== this.call) return;
      this.broken(Object.assign(new Error('the broker ended the publish stream'), { code: grpc.status.UNAVAILABLE }), index);
    });
  }

  /** @param {{ confirmedThrough: string, group: string }} response */
  confirmed(response) {
    this.failingSince = null;
    this.failures = 0;
    const through = BigInt(response.confirmedThrough);
    if (this.groupsUsed.at(-1) !== response.group) this.groupsUsed.push(response.group);
    for (const [n, entry] of this.pending) {
      if (entry.seq > through) break; // the map is in stream_seq order
      this.pending.delete(n);
      entry.resolve({ streamSeq: entry.message.streamSeq, group: response.group });
    }
    this.idleCheck();
    this.pump();
  }

  /**
   * The call failed: reopen it (resending every unconfirmed message with its stream_seq) or give up.
   * @param {ServiceErrorLike} error
   * @param {number} index
   */
  broken(error, index) {
    const call = this.call;
    this.call = null;
    if (call !== null) call.cancel();
    if (this.error !== null) return;
    const code = codeOf(error);
    if (code === grpc.status.FAILED_PRECONDITION) return this.fail(error); // a stale token: another producer took over
    if (this.failingSince === null) this.failingSince = Date.now();
    if (!STREAM_RETRYABLE.has(/** @type {number} */ (code)) || Date.now() - this.failingSince > this.retryTimeoutMs) {
      this.failingSince = null;
      this.rejectAll(error);
      return;
    }
    this.client.failed(index);
    this.resends++;
    this.failures++;
    this.reopening = true;
    setTimeout(() => {
      this.reopening = false;
      this.unsent = [...this.pending.keys()]; // in order: resend every unconfirmed message
      this.pump();
    }, Math.min(50 * this.failures, 1000));
  }

  /**
   * The producer cannot go on (lease lost, stale token): fail what is pending and what comes.
   * @param {ServiceErrorLike} error
   */
  fail(error) {
    if (this.error !== null) return;
    this.error = error;
    const call = this.call;
    this.call = null;
    if (call !== null) call.cancel();
    this.rejectAll(error);
  }

  /** @param {Error} error */
  rejectAll(error) {
    const entries = [...this.pending.values()];
    this.pending.clear();
    this.unsent = [];
    for (const entry of entries) entry.reject(error);
    this.idleCheck();
  }

  idleCheck() {
    if (this.pending.size > 0) return;
    const waiters = this.idleWaiters;
    this.idleWaiters = [];
    for (const wake of waiters) wake();
  }
}

/**
 * The single active consumer of a stream (made by `client.streamConsumer`): a ConsumeStream call
 * attached with the consumer lease's fencing token and `prefetch`; acks ride the same call, those of
 * one event-loop tick in one request. Messages reach `onMessage` in stream order: a delivery whose
 * stream_seq is not above the last one delivered is a copy (a producer resent it after a lost confirm
 * or a failover) and is acknowledged and dropped (`duplicatesDropped`), unless this consumer delivered
 * it and the application has not acknowledged it yet (then it comes again, flagged redelivered). A call
 * broken with a retryable status is reattached on the next address; deliveries of the old call can no
 * longer be acknowledged (`ack` returns false) and come again. A lost lease or a stale token ends the
 * consumer and rejects `done`.
 */
class StreamConsumer {
  /**
   * @param {Client} client
   * @param {string} stream
   * @param {StreamConsumerOptions} options
   * @param {(message: StreamMessage, consumer: StreamConsumer) => unknown} onMessage
   */
  constructor(client, stream, options, onMessage) {
    this.client = client;
    this.stream = stream;
    this.lease = new StreamLease(client, stream, 'STREAM_ROLE_CONSUMER', options.holder ?? holderId(client), options.leaseTtlMs ?? 3000);
    this.prefetch = options.prefetch ?? 100;
    this.closeTimeoutMs = options.closeTimeoutMs ?? 1000;
    this.onMessage = onMessage;
    /** The stream_seq of the last message handed to onMessage. */
    this.lastSeq = 0n;
    /** @type {Set<string>} stream_seqs handed to onMessage and not yet acknowledged */
    this.unacked = new Set();
    /** Copies dropped (and acknowledged): deliveries whose stream_seq was not above the last one delivered. */
    this.duplicatesDropped = 0;
    /** Messages handed to onMessage flagged redelivered. */
    this.redeliveries = 0;
    /** How many times the consumer reattached after a broken call. */
    this.reattached = 0;
    /** Why nothing is delivered now, as the broker said last ('' while deliveries flow). */
    this.waiting = '';
    /** @type {string[]} groups read to their end, in order */
    this.groupsDrained = [];
    /** @type {any} the current ConsumeStream call */
    this.call = null;
    /** Which call is current: deliveries of an earlier one can no longer be acknowledged. */
    this.generation = 0;
    /** @type {WeakMap<object, number>} message -> generation of the call that brought it */
    this.origins = new WeakMap();
    /** @type {{ group: string, deliveryTag: string }[]} */
    this.acks = [];
    this.flushScheduled = false;
    this.closing = false;
    this.ended = false;
    this.failures = 0;
    /** @type {(value: void) => void} */
    let resolveDone = () => {};
    /** @type {(error: Error) => void} */
    let rejectDone = () => {};
    /** Settles when the consumer ends: resolves after close(), rejects with the error that ended it. */
    this.done = new Promise((resolve, reject) => {
      resolveDone = resolve;
      rejectDone = reject;
    });
    this.done.catch(() => {});
    this.resolveDone = resolveDone;
    this.rejectDone = rejectDone;
  }

  /** The fencing token of the consumer lease, a decimal string. */
  get fencingToken() {
    return this.lease.token;
  }

  async start() {
    await this.lease.acquire();
    this.lease.onLost.push((error) => this.fail(error));
    this.attach();
    return this;
  }

  attach() {
    const { stub, index } = this.client.stub('stream');
    const call = stub.consumeStream();
    const generation = ++this.generation;
    this.call = call;
    this.acks = [];
    call.write({ stream: this.client.streamRef(this.stream), fencingToken: this.lease.token, prefetch: this.prefetch });
    call.on('data', (/** @type {{ deliveries: StreamDelivery[], groupDrained: string, waiting: string }} */ response) => {
      if (call !== this.call || this.closing) return;
      this.waiting = response.waiting;
      this.duplicatesDropped += Number(response.copies_dropped || 0); // copies the broker dropped for us
      if (response.deliveries.length > 0) this.failures = 0;
      for (const delivery of response.deliveries) {
        if (call !== this.call || this.closing) return; // closed, or failed by onMessage mid-response
        this.receive(delivery, generation);
      }
      if (response.groupDrained) this.groupsDrained.push(response.groupDrained);
    });
    call.on('error', (/** @type {ServiceErrorLike} */ error) => {
      if (call !== this.call) return;
      this.call = null;
      if (this.closing) return this.finish();
      if (STREAM_RETRYABLE.has(/** @type {number} */ (codeOf(error)))) return this.reattach(index);
      this.fail(error);
    });
    call.on('end', () => {
      if (call !== this.call) return;
      this.call = null;
      if (this.closing) return this.finish();
      this.reattach(index); // the broker ended the call: attach again (the lease is still ours)
    });
  }

  /** @param {number} index the address whose call broke */
  reattach(index) {
    this.client.failed(index);
    this.failures++;
    this.reattached++;
    setTimeout(() => {
      if (!this.closing && !this.ended) this.attach();
    }, Math.min(100 * this.failures, 1000));
  }

  /**
   * @param {StreamDelivery} d
   * @param {number} generation
   */
  receive(d, generation) {
    const text = d.streamSeq.toString();
    const seq = BigInt(text);
    /** @type {StreamMessage} */
    const message = {
      streamSeq: text,
      producerToken: (seq >> TOKEN_SHIFT).toString(),
      body: d.body,
      headers: d.headers,
      group: d.group,
      deliveryTag: d.deliveryTag,
      redelivered: d.redelivered,
    };
    if (seq <= this.lastSeq) {
      if (!this.unacked.has(text)) {
        this.duplicatesDropped++; // a copy (a resend after a lost confirm): acknowledge it and drop it
        this.queueAck(d.group, d.deliveryTag);
        return;
      }
      message.redelivered = true; // the application has it, unacknowledged: it comes again
    } else {
      this.lastSeq = seq;
      this.unacked.add(text);
    }
    if (message.redelivered) this.redeliveries++;
    this.origins.set(message, generation);
    try {
      const result = this.onMessage(message, this);
      if (result instanceof Promise) result.catch((error) => this.fail(error));
    } catch (error) {
      this.fail(/** @type {Error} */ (error));
    }
  }

  /**
   * Acknowledge a message (sent with the others of this tick as StreamAck{group, deliveryTag}).
   * @param {StreamMessage} message
   * @returns {boolean} false if it came on a call that is gone (it will come again)
   */
  ack(message) {
    this.unacked.delete(message.streamSeq);
    if (this.call === null || this.ended) return false;
    const origin = this.origins.get(message);
    if (origin !== undefined && origin !== this.generation) return false;
    this.queueAck(message.group, message.deliveryTag);
    return true;
  }

  /**
   * @param {string} group
   * @param {string} deliveryTag
   */
  queueAck(group, deliveryTag) {
    this.acks.push({ group, deliveryTag });
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      setImmediate(() => this.flush());
    }
  }

  flush() {
    this.flushScheduled = false;
    if (this.acks.length === 0 || this.call === null) return;
    const acks = this.acks;
    this.acks = [];
    this.call.write({ acks });
  }

  /**
   * Stop consuming: send pending acks, half-close the call, wait (up to closeTimeoutMs) for the broker
   * to end it, cancel it, and give the lease up (a standby takes over at once). What was delivered and
   * not acknowledged comes again to the next consumer, flagged redelivered.
   */
  async close() {
    if (this.closing || this.ended) {
      await this.done.catch(() => {});
      return;
    }
    this.closing = true;
    const call = this.call;
    if (call === null) {
      this.finish();
    } else {
      this.flush();
      call.end();
      const timer = setTimeout(() => {
        if (this.call === call) {
          this.call = null;
          call.cancel();
          this.finish();
        }
      }, this.closeTimeoutMs);
      await this.done.catch(() => {});
      clearTimeout(timer);
    }
    await this.lease.release();
  }

  finish() {
    if (this.ended) return;
    this.ended = true;
    this.resolveDone();
  }

  /** @param {Error} error */
  fail(error) {
    if (this.ended) return;
    this.ended = true;
    const call = this.call;
    this.call = null;
    if (call !== null) call.cancel();
    this.lease.release().catch(() => {});
    this.rejectDone(error);
  }
}

module.exports = {
  connect,
  Client,
  Publisher,
  Consumer,
  StreamProducer,
  StreamConsumer,
  RejectedError,
  LOADER_OPTIONS,
  DEFAULT_PROTOS_DIR,
  PROTO_FILE,
  STREAM_PROTO_FILE,
  status: grpc.status,
  statusName,
};
