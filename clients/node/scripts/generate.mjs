// Generate the TypeScript types of idempotency.v1 from the repository's proto/,
// and copy the proto beside the package (the client loads it at run time with
// @grpc/proto-loader). Both outputs are build products, never committed: the
// proto is the contract, and types generated from it cannot drift from it.
import { cpSync, mkdirSync, rmSync, existsSync } from "node:fs";
import { execFileSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(dirname(fileURLToPath(import.meta.url)));
const source = join(here, "..", "..", "proto");
const protoFile = join("idempotency", "v1", "idempotency.proto");
if (!existsSync(join(source, protoFile))) {
  console.error(`generate: ${join(source, protoFile)} not found`);
  process.exit(1);
}

const copied = join(here, "proto");
rmSync(copied, { recursive: true, force: true });
mkdirSync(copied, { recursive: true });
cpSync(join(source, "idempotency"), join(copied, "idempotency"), { recursive: true });

const generated = join(here, "src", "generated");
rmSync(generated, { recursive: true, force: true });
// These options must match the ones loadPackageDefinition() uses in src/client.ts.
execFileSync(
  process.execPath,
  [
    join(here, "node_modules", "@grpc", "proto-loader", "build", "bin", "proto-loader-gen-types.js"),
    "--longs=String",
    "--enums=String",
    "--defaults",
    "--oneofs",
    "--grpcLib=@grpc/grpc-js",
    `--includeDirs=${copied}`,
    `--outDir=${generated}`,
    protoFile,
  ],
  { stdio: "inherit" },
);
console.error("generate: wrote proto/ and src/generated/");
