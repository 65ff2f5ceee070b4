#!/usr/bin/env bash
# Build the Java client with Debian's jars: generate the stubs with Debian's
# protoc and grpc-java plugin (the versions that match Debian's
# libprotobuf-java and libgrpc-java), then javac the client, its tests and the
# cross-language test's Java side. Installs the Debian packages when missing.
#
#   clients/java/build.sh OUTDIR
#
# Leaves OUTDIR/classes (everything compiled), OUTDIR/gen (generated sources)
# and OUTDIR/classpath (the jars and OUTDIR/classes, ':'-separated, for
# `java -cp "$(cat OUTDIR/classpath)" ...`). Run from anywhere.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
here="$repo/clients/java"
out=${1:?usage: build.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)

# grpc-java 1.41 and protobuf 3.21 from Debian 12, and what grpc-core and
# grpc-netty need at run time (guava, netty, perfmark, gson, ...).
debs=(openjdk-17-jdk-headless protobuf-compiler libprotobuf-dev protobuf-compiler-grpc-java-plugin
  libgrpc-java libprotobuf-java libguava-java libnetty-java libperfmark-java libgoogle-gson-java
  libjsr305-java liberror-prone-java libgoogle-common-protos-java libnetty-tcnative-java libnetty-tcnative-jni
  libgeronimo-annotation-1.3-spec-java)
missing=()
for deb in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "java client: installing ${missing[*]} from Debian" >&2
  apt-get update -qq -o DPkg::Lock::Timeout=300
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
    --no-install-recommends "${missing[@]}" >/dev/null
fi

jars=(grpc-api grpc-context grpc-core grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub
  protobuf guava error_prone_annotations jsr305 perfmark-api gson proto-google-common-protos
  netty-buffer netty-codec netty-codec-http netty-codec-http2 netty-codec-socks netty-common
  netty-handler netty-handler-proxy netty-resolver netty-transport netty-tcnative)
classpath=""
for jar in "${jars[@]}"; do
  path="/usr/share/java/$jar.jar"
  [ -f "$path" ] || { echo "java client: $path is missing" >&2; exit 1; }
  classpath="$classpath${classpath:+:}$path"
done

# Compile time only: grpc_java_plugin 1.41 marks the stubs @javax.annotation.Generated
# (gone from the JDK since Java 11; source retention, so not needed at run time).
compile_only=/usr/share/java/geronimo-annotation-1.3-spec.jar
[ -f "$compile_only" ] || { echo "java client: $compile_only is missing" >&2; exit 1; }

rm -rf "$out/gen" "$out/classes"
mkdir -p "$out/gen" "$out/classes"
# google/rpc/error_details.proto (this folder's proto/, from googleapis) too:
# Debian's proto-google-common-protos is 1.16, whose com.google.rpc lacks
# ErrorInfo (added in 1.18). The classes generated here (ErrorInfo,
# RetryInfo, BadRequest, ... and ErrorDetailsProto) come first on the class
# path and stand in for the jar's; com.google.rpc.Status stays the jar's.
protoc -I "$repo/proto" -I "$here/proto" -I /usr/include \
  --plugin=protoc-gen-grpc-java=/usr/bin/grpc_java_plugin \
  --java_out="$out/gen" --grpc-java_out="$out/gen" \
  idempotency/v1/idempotency.proto grpc/health/v1/health.proto google/rpc/error_details.proto

find "$out/gen" "$here/src/main/java" "$here/src/test/java" "$repo/clients/cross-language/java_side" \
  -name '*.java' >"$out/sources.txt"
javac -nowarn -encoding UTF-8 --release 17 -cp "$classpath:$compile_only" -d "$out/classes" @"$out/sources.txt"

# TLS: gRPC needs ALPN, which Debian's netty 4.1.48 supports only through
# OpenSSL (its JdkSslContext has the JDK ALPN code removed: "JDK provider does
# not support ALPN protocol"), i.e. netty-tcnative. Debian installs the JNI
# library as libnetty-tcnative.so, while netty looks for libnetty_tcnative.so
# (and tcnative refuses to run under another file name, so a symlink does
# not do). netty also loads it from META-INF/native/ on the class path: put a
# copy there, under the name it wants, so no -Djava.library.path is needed.
tcnative=$(dpkg -L libnetty-tcnative-jni | grep '/libnetty-tcnative\.so$' | head -n 1)
[ -f "$tcnative" ] || { echo "java client: libnetty-tcnative.so not found" >&2; exit 1; }
mkdir -p "$out/classes/META-INF/native"
cp "$tcnative" "$out/classes/META-INF/native/libnetty_tcnative.so"

echo "$out/classes:$classpath" >"$out/classpath"
