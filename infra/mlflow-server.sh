#!/usr/bin/env bash
# Start an MLflow tracking server for LCCN runs, wait until it answers /health, and print
# the MLFLOW_TRACKING_URI to export. Jobs read that variable (pipeline.track.tracking).
#
#   infra/mlflow-server.sh                       # sqlite + proxied artifacts under ~/.lccn/mlflow-server
#   eval "$(infra/mlflow-server.sh)"             # ... and export MLFLOW_TRACKING_URI here
#   infra/mlflow-server.sh --backend-store-uri postgresql://mlflow:PW@db:5432/mlflow \
#                          --artifacts s3://my-bucket/mlflow --host 0.0.0.0
#   infra/mlflow-server.sh --foreground          # run in this shell (containers, systemd)
#   infra/mlflow-server.sh --stop                # stop the server started from this home
#
# Options (each also settable by the environment variable in brackets):
#   --backend-store-uri URI  [MLFLOW_BACKEND_STORE_URI]  sqlite:///ABS/path.db or
#                            postgresql://user:pw@host:5432/db (needs psycopg2 installed);
#                            default sqlite:///$MLFLOW_HOME/mlflow.db
#   --artifacts DIR_OR_URI   [MLFLOW_ARTIFACTS]  where artifact files go (local dir, s3://, gs://);
#                            default $MLFLOW_HOME/artifacts
#   --serve-artifacts        (default) the server proxies artifact uploads/downloads to
#                            --artifacts, so clients need no storage credentials
#   --no-serve-artifacts     clients write --artifacts themselves (it must be reachable and
#                            writable from every node)
#   --host ADDR              [MLFLOW_HOST]  default 127.0.0.1 (local only). For a cluster,
#                            bind 0.0.0.0 (and keep the port behind a firewall: see below)
#   MLFLOW_ALLOWED_HOSTS     Host headers admitted besides MLflow's defaults (loopback and
#                            private addresses, any port: localhost:5000, 172.31.4.5:5000),
#                            e.g. "mlflow.lccn.svc.cluster.local:*" for a Kubernetes Service
#                            name. A DNS-rebinding check of the Host header, not access
#                            control: firewall the port, or use --auth
#   --auth                   [MLFLOW_AUTH=1]  MLflow's basic authentication (mlflow server
#                            --app-name basic-auth): every request needs a user and password.
#                            The admin is MLFLOW_AUTH_ADMIN (default admin) with the password
#                            in the file MLFLOW_AUTH_ADMIN_PASSWORD_FILE, or in
#                            MLFLOW_AUTH_ADMIN_PASSWORD, else one generated on the first start;
#                            kept in $MLFLOW_HOME/auth/admin_password (mode 600), never on a
#                            command line. (MLflow keeps the first start's admin password.) Clients (the jobs, their Ray workers) pass
#                            MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or hold
#                            ~/.mlflow/credentials; other users are made with MLflow's
#                            auth REST API (infra/README.md)
#   --port N                 [MLFLOW_PORT]  default 5000
#   --workers N              [MLFLOW_WORKERS]  uvicorn workers, default 2
#   --home DIR               [MLFLOW_HOME]  default ~/.lccn/mlflow-server (db, artifacts, log,
#                            pid): outside the checkout, which `ray job submit --working-dir .`
#                            uploads
#   --timeout S              [MLFLOW_HEALTH_TIMEOUT]  seconds to wait for /health, default 120
#   MLFLOW_PYTHON            interpreter with mlflow installed; default .venv/bin/python of
#                            this checkout if present, else python3
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOME_DIR="${MLFLOW_HOME:-$HOME/.lccn/mlflow-server}"
HOST="${MLFLOW_HOST:-127.0.0.1}"
PORT="${MLFLOW_PORT:-5000}"
WORKERS="${MLFLOW_WORKERS:-2}"
TIMEOUT="${MLFLOW_HEALTH_TIMEOUT:-120}"
BACKEND="${MLFLOW_BACKEND_STORE_URI:-}"
ARTIFACTS="${MLFLOW_ARTIFACTS:-}"
SERVE=1
FOREGROUND=0
STOP=0
AUTH="${MLFLOW_AUTH:-0}"

die() { echo "mlflow-server.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --backend-store-uri) BACKEND="${2:?--backend-store-uri needs a value}"; shift 2 ;;
    --artifacts) ARTIFACTS="${2:?--artifacts needs a value}"; shift 2 ;;
    --serve-artifacts) SERVE=1; shift ;;
    --no-serve-artifacts) SERVE=0; shift ;;
    --host) HOST="${2:?--host needs a value}"; shift 2 ;;
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    --workers) WORKERS="${2:?--workers needs a value}"; shift 2 ;;
    --home) HOME_DIR="${2:?--home needs a value}"; shift 2 ;;
    --timeout) TIMEOUT="${2:?--timeout needs a value}"; shift 2 ;;
    --foreground) FOREGROUND=1; shift ;;
    --auth) AUTH=1; shift ;;
    --stop) STOP=1; shift ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

case "$PORT" in ''|*[!0-9]*) die "port must be a number, got '$PORT'" ;; esac
mkdir -p "$HOME_DIR"
HOME_DIR="$(cd "$HOME_DIR" && pwd)"
PID_FILE="$HOME_DIR/server.pid"
LOG_FILE="$HOME_DIR/server.log"

if [ "$STOP" = 1 ]; then
  [ -f "$PID_FILE" ] || die "no $PID_FILE: nothing started from $HOME_DIR"
  pid="$(cat "$PID_FILE")"
  # the server was started in its own session: its process group id is its pid
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$PID_FILE"
  echo "mlflow-server.sh: stopped server $pid"
  exit 0
fi

if [ -z "${MLFLOW_PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then MLFLOW_PYTHON="$ROOT/.venv/bin/python"; else MLFLOW_PYTHON=python3; fi
fi
"$MLFLOW_PYTHON" -c 'import mlflow' 2>/dev/null || die "$MLFLOW_PYTHON cannot import mlflow (set MLFLOW_PYTHON)"

BACKEND="${BACKEND:-sqlite:///$HOME_DIR/mlflow.db}"
ARTIFACTS="${ARTIFACTS:-$HOME_DIR/artifacts}"
case "$BACKEND" in
  sqlite:///*|postgresql://*|postgresql+*://*|mysql://*|mysql+*://*) ;;
  *) die "backend store URI must be sqlite:///ABS_PATH or postgresql://..., got '$(printf '%s' "$BACKEND" | sed -E 's#:[^@/]*@#:***@#')'" ;;
esac
case "$ARTIFACTS" in *://*) ;; *) mkdir -p "$ARTIFACTS"; ARTIFACTS="$(cd "$ARTIFACTS" && pwd)" ;; esac

if [ -f "$PID_FILE" ] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
  die "a server started from $HOME_DIR is running (pid $(cat "$PID_FILE")); --stop it first"
fi

# the backend store URI (which may carry a password) reaches the server in its environment
# variable, never on a command line that ps shows to every user of the machine
export MLFLOW_BACKEND_STORE_URI="$BACKEND"
args=(server --host "$HOST" --port "$PORT" --workers "$WORKERS")
if [ "$SERVE" = 1 ]; then
  args+=(--serve-artifacts --artifacts-destination "$ARTIFACTS")
else
  args+=(--no-serve-artifacts --default-artifact-root "$ARTIFACTS")
fi
# MLflow's own default Host patterns (loopback and private addresses with any port) plus
# the extra ones: a list given to MLflow replaces its defaults, so they are spelled out
if [ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]; then
  defaults="$("$MLFLOW_PYTHON" -c 'from mlflow.server.security_utils import get_default_allowed_hosts as d; print(",".join(d()))')" \
    || die "cannot read MLflow's default allowed hosts with $MLFLOW_PYTHON"
  export MLFLOW_SERVER_ALLOWED_HOSTS="$defaults,$MLFLOW_ALLOWED_HOSTS"
fi

# basic authentication: the admin's password in a file of this home only (mode 600), the
# server's auth config (which must hold it) likewise; nothing secret on a command line
if [ "$AUTH" = 1 ]; then
  AUTH_DIR="$HOME_DIR/auth"
  (umask 077; mkdir -p "$AUTH_DIR")
  ADMIN="${MLFLOW_AUTH_ADMIN:-admin}"
  if [ -n "${MLFLOW_AUTH_ADMIN_PASSWORD_FILE:-}" ]; then
    [ -s "$MLFLOW_AUTH_ADMIN_PASSWORD_FILE" ] || die "MLFLOW_AUTH_ADMIN_PASSWORD_FILE=$MLFLOW_AUTH_ADMIN_PASSWORD_FILE: no such file, or empty"
    (umask 077; head -n 1 "$MLFLOW_AUTH_ADMIN_PASSWORD_FILE" > "$AUTH_DIR/admin_password")
  elif [ -n "${MLFLOW_AUTH_ADMIN_PASSWORD:-}" ]; then
    (umask 077; printf '%s\n' "$MLFLOW_AUTH_ADMIN_PASSWORD" > "$AUTH_DIR/admin_password")
  elif [ ! -s "$AUTH_DIR/admin_password" ]; then
    (umask 077; "$MLFLOW_PYTHON" -c 'import secrets; print(secrets.token_urlsafe(18))' > "$AUTH_DIR/admin_password") \
      || die "cannot generate the admin password with $MLFLOW_PYTHON"
  fi
  (umask 077; "$MLFLOW_PYTHON" - "$AUTH_DIR" "$ADMIN" > "$AUTH_DIR/basic_auth.ini" <<'PY'
import sys
d, admin = sys.argv[1], sys.argv[2]
password = open(f"{d}/admin_password").read().strip()
print("[mlflow]\ndefault_permission = READ\n"
      f"database_uri = sqlite:///{d}/basic_auth.db\n"
      f"admin_username = {admin}\nadmin_password = {password}\n"
      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth")
PY
  ) || die "cannot write $AUTH_DIR/basic_auth.ini"
  export MLFLOW_AUTH_CONFIG_PATH="$AUTH_DIR/basic_auth.ini"
  # the key of the server's CSRF tokens (MLflow requires a fixed one), kept beside them
  if [ -z "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ]; then
    [ -s "$AUTH_DIR/secret_key" ] || (umask 077; "$MLFLOW_PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$AUTH_DIR/secret_key")
    MLFLOW_FLASK_SERVER_SECRET_KEY="$(cat "$AUTH_DIR/secret_key")"
    export MLFLOW_FLASK_SERVER_SECRET_KEY
  fi
  args+=(--app-name basic-auth)
fi

# MLflow's background job runner (GenAI evaluation jobs) is not used by these pipelines; it
# adds ~7 processes and ~15 s to the start-up. Export it as true to keep it.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"

CLIENT_HOST="$HOST"
[ "$HOST" = "0.0.0.0" ] && CLIENT_HOST="$(hostname -I 2>/dev/null | awk '{print $1}')"
URI="http://${CLIENT_HOST:-127.0.0.1}:$PORT"

if [ "$FOREGROUND" = 1 ]; then
  echo "mlflow-server.sh: export MLFLOW_TRACKING_URI=$URI" >&2
  exec "$MLFLOW_PYTHON" -m mlflow "${args[@]}"
fi

setsid "$MLFLOW_PYTHON" -m mlflow "${args[@]}" >"$LOG_FILE" 2>&1 < /dev/null &
echo $! > "$PID_FILE"

health="http://127.0.0.1:$PORT/health"
[ "$HOST" != "0.0.0.0" ] && health="http://$HOST:$PORT/health"
deadline=$(( $(date +%s) + TIMEOUT ))
until "$MLFLOW_PYTHON" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$health', timeout=2).status != 200)" 2>/dev/null; do
  if ! kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
    tail -n 30 "$LOG_FILE" >&2
    rm -f "$PID_FILE"
    die "the server exited during start-up (log: $LOG_FILE)"
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    tail -n 30 "$LOG_FILE" >&2
    die "no answer from $health after ${TIMEOUT}s (log: $LOG_FILE; stop with --stop)"
  fi
  sleep 0.5
done

# what is printed shows user:***@ in place of a password
SHOWN_BACKEND="$(printf '%s' "$BACKEND" | sed -E 's#^([a-z0-9+]+://[^:/@]*):[^@/]*@#\1:***@#')"
cat >&2 <<EOF
mlflow-server.sh: serving at $URI (pid $(cat "$PID_FILE"), log $LOG_FILE)
  backend store: $SHOWN_BACKEND
  artifacts:     $ARTIFACTS ($( [ "$SERVE" = 1 ] && echo proxied by the server || echo written by clients ))
  stop with:     $0 --home $HOME_DIR --stop
EOF
if [ "$AUTH" = 1 ]; then
  cat >&2 <<EOF
  basic auth:    on; admin user '$ADMIN', password in $AUTH_DIR/admin_password. Clients:
                 export MLFLOW_TRACKING_USERNAME=$ADMIN MLFLOW_TRACKING_PASSWORD="\$(cat $AUTH_DIR/admin_password)"
EOF
fi
# the only line on stdout, so that  eval "$(infra/mlflow-server.sh)"  sets it
echo "export MLFLOW_TRACKING_URI=$URI"
