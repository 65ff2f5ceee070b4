// What the example's tests share: the services, a deadline loop, and the
// example's programs run as a user runs them.
import assert from "node:assert/strict";
import { execFile, spawn, type ChildProcess } from "node:child_process";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { promisify } from "node:util";
import { Client as PgClient } from "pg";
import type { Report } from "../src/consumer";

export const NATS_URL = process.env.NATS_URL ?? "nats://127.0.0.1:4222";
export const POSTGRES = (process.env.LEDGER_POSTGRES ?? "postgres://postgres@127.0.0.1:5432").replace(/\/+$/, "");

/** Run SQL on the admin database (postgres). */
export async function adminQuery(sql: string): Promise<void> {
  const admin = new PgClient({ connectionString: `${POSTGRES}/postgres` });
  await admin.connect();
  try {
    await admin.query(sql);
  } finally {
    await admin.end();
  }
}

/** Poll `condition` every 50 ms until it holds; fail after `timeoutMs`. */
export async function waitFor(what: string, condition: () => boolean | Promise<boolean>, timeoutMs: number, details = () => ""): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await condition())) {
    if (Date.now() > deadline) assert.fail(`timed out after ${timeoutMs} ms waiting for ${what}\n${details()}`);
    await sleep(50);
  }
}

/** Run one of the example's programs (dist/src/NAME.js) to its end; its stdout. */
export async function program(name: string, args: string[], env: Record<string, string> = {}): Promise<string> {
  const { stdout } = await promisify(execFile)(process.execPath, [join(__dirname, "..", "src", `${name}.js`), ...args], {
    env: { ...process.env, NATS_URL, ...env },
    timeout: 30_000,
  });
  return stdout;
}

/** A consumer process (dist/src/main.js) with its JSON-lines log parsed as it comes. */
export class ConsumerProcess {
  readonly reports: Report[] = [];
  private readonly child: ChildProcess;
  private stderr = "";
  private ready = false;
  private readonly exited: Promise<number | null>;

  constructor(readonly worker: string, env: Record<string, string>) {
    this.child = spawn(process.execPath, [join(__dirname, "..", "src", "main.js")], {
      env: { ...process.env, ...env, WORKER: worker },
      stdio: ["ignore", "pipe", "pipe"],
    });
    this.exited = new Promise((resolve) => this.child.once("exit", (code) => resolve(code)));
    let pending = "";
    this.child.stdout!.on("data", (chunk: Buffer) => {
      pending += chunk.toString("utf8");
      let newline: number;
      while ((newline = pending.indexOf("\n")) >= 0) {
        const line = JSON.parse(pending.slice(0, newline));
        pending = pending.slice(newline + 1);
        if (line.ready) this.ready = true;
        else this.reports.push(line as Report);
      }
    });
    this.child.stderr!.on("data", (chunk: Buffer) => (this.stderr += chunk.toString("utf8")));
  }

  async waitReady(): Promise<void> {
    await waitFor(`${this.worker} ready`, () => this.ready || this.child.exitCode !== null, 30_000);
    assert.ok(this.ready, `${this.worker} exited before it was ready:\n${this.stderr}`);
  }

  /** Null while it runs. */
  exitCode(): number | null {
    return this.child.exitCode;
  }

  log(): string {
    return `--- ${this.worker} stderr ---\n${this.stderr}`;
  }

  async stop(): Promise<number | null> {
    if (this.child.exitCode === null) this.child.kill("SIGTERM");
    return this.exited;
  }

  kill(): void {
    if (this.child.exitCode === null) this.child.kill("SIGKILL");
  }
}

