#!/usr/bin/env bash
# Starts the local PostgreSQL and RabbitMQ, and with `--nats` NATS (with JetStream), if they
# are installed but down, and waits until they accept connections. No Docker: the services are
# the machine's own packages.
set -euo pipefail
with_nats=0
[ "${1:-}" = "--nats" ] && with_nats=1

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432; }
rabbit_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }
nats_up() { (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; }

if ! pg_up; then
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    echo "services: starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  else
    echo "services: PostgreSQL is down and not installed here (install postgresql)" >&2
    exit 1
  fi
fi

if ! rabbit_up; then
  if command -v rabbitmq-server >/dev/null; then
    echo "services: starting RabbitMQ"
    rabbitmq-server -detached || true
  else
    echo "services: RabbitMQ is down and not installed here (install rabbitmq-server)" >&2
    exit 1
  fi
fi

if [ "$with_nats" = 1 ] && ! nats_up; then
  if [ -x /usr/sbin/nats-server ] || command -v nats-server >/dev/null; then
    echo "services: starting nats-server with JetStream"
    mkdir -p /var/lib/nats-server
    start-stop-daemon --start --oknodo --background \
      --exec "$(command -v nats-server || echo /usr/sbin/nats-server)" -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server || true
  else
    echo "services: NATS is down and not installed here (install nats-server)" >&2
    exit 1
  fi
fi

nats_ready() { [ "$with_nats" = 0 ] || nats_up; }

for _ in $(seq 1 120); do
  if pg_up && rabbit_up && nats_ready; then
    if [ "$with_nats" = 1 ]; then
      echo "services: PostgreSQL, RabbitMQ and NATS are up"
    else
      echo "services: PostgreSQL and RabbitMQ are up"
    fi
    exit 0
  fi
  sleep 1
done
pg_up || echo "services: PostgreSQL still down after 120 s" >&2
rabbit_up || echo "services: RabbitMQ still down after 120 s" >&2
nats_ready || echo "services: NATS still down after 120 s" >&2
exit 1
