// Generate the TypeScript types of idempotency.v1 from the repository's proto/,
// and copy the proto beside the package (the client loads it at run time with
// @grpc/proto-loader). Both outputs are build products, never committed: the
// proto is the contract, and types generated from it cannot drift from it.
//
// The google.rpc protos the error details are decoded with (status.proto and
// error_details.proto, from the google-proto-files package, a build-time
// dependency) are copied beside it too, and their types generated: the
// client decodes the `grpc-status-details-bin` trailer with protobufjs.
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

// google.rpc.Status and the error details (ErrorInfo, RetryInfo, BadRequest).
const rpcProtos = [join("google", "rpc", "status.proto"), join("google", "rpc", "error_details.proto")];
const googleProtos = join(here, "node_modules", "google-proto-files");
mkdirSync(join(copied, "google", "rpc"), { recursive: true });
for (const file of rpcProtos) {
  if (!existsSync(join(googleProtos, file))) {
    console.error(`generate: ${join(googleProtos, file)} not found (npm ci installs google-proto-files)`);
    process.exit(1);
  }
  cpSync(join(googleProtos, file), join(copied, file));
}

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
    ...rpcProtos,
  ],
  { stdio: "inherit" },
);
// The google.rpc files' root types (a ProtoGrpcType for each) are not used:
// the client decodes the messages with protobufjs and imports only their
// message types, and the roots would fail noUnusedLocals.
for (const file of rpcProtos) {
  rmSync(join(generated, file.replace(/^.*[\\/]/, "").replace(/\.proto$/, ".ts")), { force: true });
}
console.error("generate: wrote proto/ and src/generated/");
