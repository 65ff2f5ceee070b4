// Shared test set-up: a real server per store for each suite, a fresh
// namespace per test, and polling with a deadline instead of fixed sleeps.
import { after, before, describe } from "node:test";
import { randomBytes } from "node:crypto";
import { IdempotencyClient } from "../src";
import {
  createPostgresDatabase,
  dropPostgresDatabase,
  startServer,
  type RunningServer,
} from "../src/testing";

export type Store = "sqlite" | "postgres";

export interface Suite {
  /** The client under test. */
  readonly client: IdempotencyClient;
  /** A second caller, as another replica or service would be. */
  readonly other: IdempotencyClient;
  readonly server: RunningServer;
  /** A namespace no other test uses. */
  namespace(): string;
}

/** Run `body` against a real server on each of `stores` (the embedded store by default). */
export function withServer(name: string, stores: Store[], body: (suite: Suite) => void): void {
  for (const store of stores) {
    describe(`${name} [${store}]`, () => {
      let server: RunningServer | undefined;
      let client: IdempotencyClient | undefined;
      let other: IdempotencyClient | undefined;
      let databaseUrl: string | undefined;
      before(async () => {
        if (store === "postgres") databaseUrl = createPostgresDatabase();
        server = await startServer({ databaseUrl });
        client = new IdempotencyClient(server.target);
        other = new IdempotencyClient(server.target);
      });
      after(async () => {
        client?.close();
        other?.close();
        await server?.stop();
        if (databaseUrl) dropPostgresDatabase(databaseUrl);
      });
      body({
        get client() {
          return client!;
        },
        get other() {
          return other!;
        },
        get server() {
          return server!;
        },
        namespace: () => `node-${name.replace(/\W+/g, "-").slice(0, 40)}-${randomBytes(4).toString("hex")}`,
      });
    });
  }
}

export async function until<T>(condition: () => Promise<T> | T, what: string, timeoutMs = 10_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await condition();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));
