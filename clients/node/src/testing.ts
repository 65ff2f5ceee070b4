// Start a real idempotency-service for tests: a process on a free loopback
// port, ready once its health check says SERVING.
//
//   const server = await startServer();          // the embedded store in a temp dir
//   const client = new IdempotencyClient(server.target);
//   ...
//   await server.stop();                         // SIGTERM, as in production
//   const again = await server.restart();        // SIGTERM, then a new process on the same port
//
// Replicas: several servers on one PostgreSQL database (startReplicas()).
//
// With TLS on the main port (IDEMPOTENCY_TLS_CERT_FILE in `env`), the helper
// also opens the plaintext health listener (IDEMPOTENCY_HEALTH_LISTEN_ADDR) on
// another free port, unless `env` sets it, and waits on that one.
import { spawn, execFileSync, type ChildProcess } from "node:child_process";
import { mkdtempSync, openSync, readFileSync, closeSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve, isAbsolute } from "node:path";
import { randomBytes } from "node:crypto";
import * as grpc from "@grpc/grpc-js";

/** The service whose health says the store is ready. */
export const HEALTH_SERVICE = "idempotency.v1.IdempotencyService";
const DEFAULT_POSTGRES = "postgres://postgres@127.0.0.1:5432";

export interface ServerOptions {
  /** Default: $IDEMPOTENCY_BIN, else target/release/idempotency-service of the repository. */
  binary?: string;
  /** The embedded store's directory; a new temporary one when omitted. */
  dataDir?: string;
  /** Run on PostgreSQL instead of the embedded store. */
  databaseUrl?: string;
  env?: Record<string, string>;
  readyTimeoutMs?: number;
  /**
   * The address to listen on, "127.0.0.1:PORT"; default: a free loopback
   * port. A stopped server's target restarts it on its port.
   */
  target?: string;
}

export interface RunningServer {
  target: string;
  /** Where the health check answers without credentials: the extra plaintext listener if any, else target. */
  healthTarget: string;
  process: ChildProcess;
  logPath: string;
  log(): string;
  stop(): Promise<number | null>;
  /** Stop (SIGTERM) and start a new process with the same settings on the same port. */
  restart(): Promise<RunningServer>;
}

export function serverBinary(): string {
  const configured = process.env.IDEMPOTENCY_BIN;
  // dist/src/testing.js -> the repository root is four levels up.
  const path = configured
    ? (isAbsolute(configured) ? configured : resolve(configured))
    : resolve(__dirname, "..", "..", "..", "..", "target", "release", "idempotency-service");
  return path;
}

export function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      server.close(() => resolvePort(typeof address === "object" && address ? address.port : 0));
    });
  });
}

// grpc.health.v1 has two tiny messages; encoding them here spares a dependency
// (and a second proto) for one call: HealthCheckRequest{service = 1: string},
// HealthCheckResponse{status = 1: enum}, SERVING = 1.
function encodeHealthRequest(service: string): Buffer {
  const name = Buffer.from(service, "utf8");
  return Buffer.concat([Buffer.from([0x0a, name.length]), name]);
}

function decodeHealthStatus(reply: Buffer): number {
  return reply.length >= 2 && reply[0] === 0x08 ? reply[1] : 0; // an absent field is UNKNOWN (0)
}

export async function healthStatus(target: string, timeoutMs = 1000): Promise<number> {
  const client = new grpc.Client(target, grpc.credentials.createInsecure());
  try {
    return await new Promise<number>((resolveStatus, reject) => {
      client.makeUnaryRequest(
        "/grpc.health.v1.Health/Check",
        (request: Buffer) => request,
        (reply: Buffer) => decodeHealthStatus(reply),
        encodeHealthRequest(HEALTH_SERVICE),
        { deadline: new Date(Date.now() + timeoutMs) },
        (error, value) => (error ? reject(error) : resolveStatus(value as number)),
      );
    });
  } finally {
    client.close();
  }
}

export async function waitUntilServing(target: string, timeoutMs: number, child?: ChildProcess): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  let last = "no answer yet";
  while (Date.now() < deadline) {
    if (child && child.exitCode !== null) {
      throw new Error(`idempotency-service exited with status ${child.exitCode}`);
    }
    try {
      const status = await healthStatus(target);
      if (status === 1) return;
      last = `status ${status}`;
    } catch (error) {
      last = (error as Error).message;
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`idempotency-service at ${target} not SERVING after ${timeoutMs} ms (${last})`);
}

export async function startServer(options: ServerOptions = {}): Promise<RunningServer> {
  const binary = options.binary ?? serverBinary();
  const dataDir = options.dataDir ?? mkdtempSync(join(tmpdir(), "idempotency-node-test-"));
  const target = options.target ?? `127.0.0.1:${await freePort()}`;
  const env: Record<string, string> = { ...(process.env as Record<string, string>) };
  delete env.DATABASE_URL;
  // Metrics off: the default port (8464) is one for every server on the machine.
  Object.assign(env, { IDEMPOTENCY_LISTEN_ADDR: target, IDEMPOTENCY_DATA_DIR: dataDir, IDEMPOTENCY_METRICS_ADDR: "" });
  if (options.databaseUrl) env.DATABASE_URL = options.databaseUrl;
  const extra = { ...(options.env ?? {}) };
  if (extra.IDEMPOTENCY_TLS_CERT_FILE && extra.IDEMPOTENCY_HEALTH_LISTEN_ADDR === undefined) {
    // The main port speaks TLS only; wait on a plaintext health listener.
    extra.IDEMPOTENCY_HEALTH_LISTEN_ADDR = `127.0.0.1:${await freePort()}`;
  }
  Object.assign(env, extra);
  const healthTarget = env.IDEMPOTENCY_HEALTH_LISTEN_ADDR || target;
  const logPath = join(dataDir, "server.log");
  const logFd = openSync(logPath, "w");
  const child = spawn(binary, [], { env, stdio: ["ignore", logFd, logFd] });
  closeSync(logFd);
  const exited = new Promise<number | null>((r) => child.once("exit", (code) => r(code)));
  child.once("error", () => undefined); // a missing binary shows as the exit below

  const server: RunningServer = {
    target,
    healthTarget,
    process: child,
    logPath,
    log: () => {
      try {
        return readFileSync(logPath, "utf8").slice(-4000);
      } catch {
        return "";
      }
    },
    stop: async () => {
      if (child.exitCode === null && child.signalCode === null) {
        child.kill("SIGTERM");
        const timer = setTimeout(() => child.kill("SIGKILL"), 10_000);
        await exited;
        clearTimeout(timer);
      }
      return child.exitCode;
    },
    restart: async () => {
      await server.stop();
      return startServer({ ...options, dataDir, target, env: extra });
    },
  };
  try {
    await waitUntilServing(healthTarget, options.readyTimeoutMs ?? 60_000, child);
  } catch (error) {
    await server.stop();
    throw new Error(`${(error as Error).message}\n--- server log ---\n${server.log()}`);
  }
  return server;
}

/**
 * `count` servers on one PostgreSQL database (a new one unless `databaseUrl`
 * is given), as replicas behind one name would be. `stop()` stops them all
 * and drops a database it created.
 */
export async function startReplicas(
  count: number,
  options: Omit<ServerOptions, "target" | "dataDir"> = {},
): Promise<{ servers: RunningServer[]; databaseUrl: string; stop(): Promise<void> }> {
  const created = options.databaseUrl === undefined;
  const databaseUrl = options.databaseUrl ?? createPostgresDatabase();
  const servers: RunningServer[] = [];
  const stop = async () => {
    await Promise.all(servers.map((server) => server.stop()));
    if (created) dropPostgresDatabase(databaseUrl);
  };
  try {
    // One after the other: the first applies the schema's migrations.
    for (let i = 0; i < count; i++) servers.push(await startServer({ ...options, databaseUrl }));
  } catch (error) {
    await stop();
    throw error;
  }
  return { servers, databaseUrl, stop };
}

function psql(baseUrl: string, sql: string): void {
  execFileSync("psql", [`${baseUrl}/postgres`, "-v", "ON_ERROR_STOP=1", "-q", "-c", sql], { stdio: "pipe", timeout: 30_000 });
}

/** Create a fresh PostgreSQL database (via psql) and return its URL. */
export function createPostgresDatabase(baseUrl = process.env.IDEMPOTENCY_TEST_POSTGRES ?? DEFAULT_POSTGRES): string {
  const base = baseUrl.replace(/\/+$/, "");
  const name = `idempotency_node_${randomBytes(8).toString("hex")}`;
  psql(base, `CREATE DATABASE ${name}`);
  return `${base}/${name}`;
}

export function dropPostgresDatabase(url: string): void {
  const cut = url.lastIndexOf("/");
  psql(url.slice(0, cut), `DROP DATABASE IF EXISTS ${url.slice(cut + 1)} WITH (FORCE)`);
}
