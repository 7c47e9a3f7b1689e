"""``gangd``: the node daemon's command line."""

from __future__ import annotations

import logging
import sys

import click
import trio

from .config import ConfigError, load

EPILOG = """\b
Examples:
  gangd --config /etc/gangd/gangd.toml
  gangd --config cluster/n2/gangd.toml --log-level debug

\b
Exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 1 configuration or
start-up error (the message says which), 2 bad command line.
"""


@click.command(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file of this node.")
@click.option("--name", help="This node's name (one of the config's [[nodes]]).")
@click.option("--state-dir", type=click.Path(file_okay=False), help="Node-local state directory.")
@click.option("--socket", type=click.Path(dir_okay=False), help="Unix socket for local clients.")
@click.option("--secret-file", type=click.Path(dir_okay=False), help="File holding the cluster secret.")
@click.option("--master", help="Coordinator node (default: lowest-named live node).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="Logging verbosity.")
@click.option("--heartbeat-interval", type=float, help="Seconds between heartbeats to each peer.")
@click.option("--heartbeat-timeout", type=float, help="Seconds without a heartbeat before a node is down.")
@click.option("--time-slice", type=float, help="Gang scheduling: seconds each slot runs (default 0.3).")
@click.option("--max-slots", type=int, help="Gang scheduling: multiprogramming degree (default 4).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Node-local disk for checkpoints (default: STATE_DIR/checkpoints).")
@click.option("--checkpoint-keep", type=click.IntRange(min=1), help="Complete checkpoint generations kept per job (default 2).")
def main(config_path: str | None, name: str | None, state_dir: str | None, socket: str | None, secret_file: str | None, master: str | None,
         log_level: str | None, heartbeat_interval: float | None, heartbeat_timeout: float | None, time_slice: float | None, max_slots: int | None,
         checkpoint_dir: str | None, checkpoint_keep: int | None) -> None:
    """Run the gangd node daemon: one per node, started by systemd (see systemd/gangd.service)."""
    from .server import Daemon, StartupError

    try:
        config = load(
            config_path,
            node_name=name,
            state_dir=state_dir,
            socket=socket,
            secret_file=secret_file,
            master=master,
            log_level=log_level,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            time_slice=time_slice,
            max_slots=max_slots,
            checkpoint_dir=checkpoint_dir,
            checkpoint_keep=checkpoint_keep,
        )
        logging.basicConfig(
            level=config.log_level.upper(),
            format=f"%(asctime)s {config.node_name} %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        # httpx logs every etcd request at INFO: thousands a minute.
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
        logging.getLogger("httpcore").setLevel(max(logging.WARNING, logging.getLogger().level))
        daemon = Daemon(config)
        trio.run(daemon.run)
    except (ConfigError, StartupError) as exc:
        click.echo(f"gangd: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
