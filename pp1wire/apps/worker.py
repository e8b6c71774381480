"""``pp1-worker``: the proposer daemon (drafter plugin, sessions, the only proposal RNG owner),
serving until SIGTERM or SIGINT, which drain what was received and exit 0; ``--check HOST:PORT``
HELLOs a running worker and prints the limits these settings give."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import ssl
import sys
from collections.abc import Sequence

from pp1wire.aio import admission
from pp1wire.aio.server import FRAMES_PER_TURN, WRITE_BUFFER_CAP, WorkerServer
from pp1wire.apps import keys, metrics, ranks, settings, worker_tp
from pp1wire.q.proposal import DrafterFn
from pp1wire.wire import budgets, draws, framing, principals
from pp1wire.wire.messages import WIRE_VERSION
from pp1wire.wire.principals import PrincipalPolicy
from pp1wire.wire.worker_core import WorkerConfig

log = logging.getLogger("pp1wire.worker")


def limits(cfg: WorkerConfig, *, max_connections: int = 16) -> list[tuple[str, str]]:
    """This worker's limits as (name, what it allows): the most a Spark HELLO may ask for
    (§4.1, else ``LIMIT_EXCEEDED``) and the bounds of every connection (§8)."""
    return [
        ("max_slots", f"{cfg.max_slots} (--max-slots)"),
        ("max_depth", f"{cfg.max_depth} (--max-depth, 1..5)"),
        ("max_support", f"{min(cfg.max_support, cfg.vocab_size)} (--max-support, at most --vocab)"),
        ("row_entries", f"exactly {cfg.entries} (--row-entries, default --vocab)"),
        (
            "max_frame",
            f"{cfg.max_frame:,} bytes (fixed), and at least 4 × row_entries = "  # noqa: RUF001
            f"{4 * cfg.entries:,}",
        ),
        ("max_prefix", f"{cfg.max_prefix:,} tokens (--max-prefix)"),
        ("header", f"{framing.MAX_HEADER:,} bytes per frame header"),
        ("connections", f"{max_connections} (--max-connections)"),
        ("handshake timeout", f"{cfg.handshake_timeout:g} s (--handshake-timeout)"),
        ("idle timeout", f"{cfg.idle_timeout:g} s (--idle-timeout)"),
        (
            "per connection",
            f"{FRAMES_PER_TURN} frames per turn; reading stops while more than "
            f"{WRITE_BUFFER_CAP:,} bytes wait for a peer that does not read",
        ),
    ]


def limits_text(cfg: WorkerConfig, *, max_connections: int = 16, indent: str = "  ") -> str:
    """:func:`limits` as aligned lines."""
    rows = limits(cfg, max_connections=max_connections)
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{indent}{name:<{width}}  {value}" for name, value in rows)


def limits_markdown(cfg: WorkerConfig, *, max_connections: int = 16) -> str:
    """:func:`limits` as the markdown table ``docs/protocol.md`` §8 prints."""
    rows = ["| limit | pp1-worker, default settings |", "|---|---|"]
    for name, value in limits(cfg, max_connections=max_connections):
        shown = f"`{name}`" if name.startswith("max_") or name == "row_entries" else name
        rows.append(f"| {shown} | {value} |")
    return "\n".join(rows)


def default_limits_markdown() -> str:
    """:func:`limits_markdown` for the default settings (what ``--help`` shows)."""
    defaults = build_parser().parse_args([])
    return limits_markdown(config_from(defaults), max_connections=defaults.max_connections)


_HELP: dict[str, str] = {
    "--host": "listen address; without --psk-file, an address other than loopback needs --insecure",
    "--port": "listen port (0: any free)",
    "--seed": "toy model family seed",
    "--drafter": "drafter plugin; factory(vocab_size=, seed=) -> callable prefix -> logits",
    "--draft-identity": "the drafter's identity, declared in HELLO (at most 128 characters)",
    "--max-slots": "most slots (concurrent requests) one connection may open, 1..65535",
    "--max-depth": "most draft tokens per proposal, 1..5",
    "--max-support": "largest sparse support a STEP may ask for, in entries (capped at --vocab)",
    "--max-prefix": "longest prompt an OPEN may carry, in tokens",
    "--max-connections": "most authenticated connections; when full, a newcomer replaces the "
    "oldest peer still in its handshake, or (once it has itself authenticated) a peer that had no "
    "fresh draw for --slot-idle-timeout",
    "--max-per-address": "most connections from one source address (an IPv6 address's "
    "--ipv6-prefix network), admitted as --max-connections (a client with several addresses is not "
    "limited by it; default: unset, no limit)",
    "--slot-idle-timeout": "a connection that had no fresh draw (a STEP drawn) for this long may "
    "be replaced by a newcomer when the worker is full; COMMIT, OPEN, CLOSE and PING do not count "
    "(one new connection per principal and period is protected for its first 1 s)",
    "--max-draw-rate": "fresh draws per second one slot may ask for, kept per principal across "
    "reconnections; a STEP beyond it is refused with DRAW_RATE_LIMITED: size it as the most rounds "
    "per second one request should run (default: unset, no limit)",
    "--principal-rate": "fresh draws per second one principal may ask for over all its slots and "
    "connections (a second of them at once), beyond which its STEPs are refused with "
    "DRAW_RATE_LIMITED: RATE for every principal, ID=RATE for key ID (=RATE the default key), RATE "
    "'off' for none; size the default as a light client's draws per second, and name each key that "
    "needs more (default: unset, no cap)",
    "--ipv6-prefix": "an IPv6 source address counts as its network of this prefix length, one "
    "address for --max-per-address and for the lineages it may start",
    "--lineage-rate": "new draw-budget lineages one source address may start per second without a "
    "key, for 10 s after one of its lineages abandoned a draw (a connection that presents no "
    "lineage it was issued waits its turn for its HELLO, in arrival order)",
    "--lineage-burst": "new lineages one source address may start at once while --lineage-rate "
    "paces it",
    "--draw-burst": "fresh draws one slot may ask for ahead of --max-draw-rate "
    f"(default: {budgets.DRAW_BURST})",
    "--abandon-rate": "fresh draws per second one principal may leave uncommitted (a slot reset or "
    "closed, or its connection lost, before a COMMIT), over all its connections; beyond them and "
    "--abandon-burst its fresh STEPs are refused with DRAW_RATE_LIMITED until it has paid them "
    "back",
    "--abandon-burst": "uncommitted draws one principal may leave at once (default: 2 x "
    "--max-slots)",
    "--busy-poll": "spin the event loop while connections are open (lower latency, one busy core)",
    "--draw-threads": "threads that run the drafter and q construction (default: one per core), "
    "shared fairly between connections; the drafter must be thread-safe; 0 draws on the event loop",
    "--max-draw-batch": "most STEPs drafted together on one draw thread: one drafter call per "
    "position over all of them, their q rows built in one pass (1: each STEP alone); a "
    "vocabulary-sharded group draws each STEP alone",
    "--prepare": "next blocks each slot drafts while the Spark side verifies, one per guess of "
    "the round's outcome, served only to the STEP that asks for exactly one (docs/adaptive.md "
    "§8; 0: none; needs draw threads, not --vocab-shards)",
    "--tp": "worker ranks of a vocabulary-sharded group (with --vocab-shards, needs torch): "
    "started with torch's elastic launcher; rank r listens on --port + r",
    "--group-timeout": "how long any collective of the worker group may wait before the group "
    "fails",
    "--match-timeout": "how long a rank of a sharded group holds a STEP that the group's other "
    "links have not sent (then it answers GROUP_UNMATCHED)",
    "--handshake-timeout": "a connection must complete HELLO (and AUTH) within this, from accept",
    "--idle-timeout": "a connection with no message but PING or PONG for this long is closed",
    "--tls-cert": "PEM certificate (default: none, no TLS)",
    "--tls-key": "PEM private key for --tls-cert (default: in the certificate file)",
    "--check": "health check: HELLO a running worker, exit 0 if it answers (default: serve)",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-worker`` argument parser (every flag also reads ``PP1_<FLAG>``)."""
    p = settings.parser(
        "pp1-worker", f"PP1 wire v{WIRE_VERSION} proposer server (the draft worker)."
    )
    add = settings.adder(p, _HELP)
    add("--host", settings.listen_host, "127.0.0.1", "HOST")
    add("--port", settings.port, 7070, "PORT")
    add("--seed", settings.count, 0, "N")
    add("--drafter", None, "pp1wire.apps.models:drafter_factory", "MODULE:FACTORY")
    add("--draft-identity", settings.name, "pp1-toy-drafter", "NAME")
    add("--max-slots", settings.u16, 4, "N")
    add("--max-depth", settings.depth, 5, "N")
    add("--max-support", settings.support, 256, "ENTRIES")
    add("--max-prefix", settings.prefix_tokens, 1 << 20, "TOKENS")
    add("--max-connections", settings.connections, 16, "N")
    add("--max-per-address", settings.connections, None, "N")
    add("--slot-idle-timeout", settings.seconds, admission.SLOT_IDLE_S, "SECONDS")
    add("--max-draw-rate", settings.rate, None, "DRAWS/S")
    add("--principal-rate", settings.principal_rate, None, "[ID=]RATE", nargs="+")
    add("--ipv6-prefix", settings.ipv6_prefix, principals.IPV6_PREFIX, "BITS")
    add("--lineage-rate", settings.rate, principals.LINEAGE_RATE, "LINEAGES/S")
    add("--lineage-burst", settings.u16, principals.LINEAGE_BURST, "LINEAGES")
    add("--draw-burst", settings.u16, None, "DRAWS")
    add("--abandon-rate", settings.rate, 1.0, "DRAWS/S")
    add("--abandon-burst", settings.u16, None, "DRAWS")
    add("--busy-poll", action="store_true")
    add("--draw-threads", settings.threads, os.cpu_count() or 1, "N")
    add("--max-draw-batch", settings.draw_batch, draws.MAX_DRAW_BATCH, "STEPS")
    add("--prepare", settings.prepare, 0, "BLOCKS")
    add("--tp", settings.ranks, 1, "N")
    add("--group-timeout", settings.seconds, 30.0, "SECONDS")
    add("--match-timeout", settings.seconds, 5.0, "SECONDS")
    add("--handshake-timeout", settings.seconds, 5.0, "SECONDS")
    add("--idle-timeout", settings.seconds, 300.0, "SECONDS")
    add("--tls-cert", None, None, "FILE")
    add("--tls-key", None, None, "FILE")
    add("--check", None, None, "HOST:PORT")
    settings.add_common_flags(p, log_level="info")
    defaults = p.parse_args([])
    p.epilog = (
        f"limits with the default settings (--vocab {defaults.vocab}); a Spark side's HELLO\n"
        "above any is refused with LIMIT_EXCEEDED (docs/protocol.md sections 4.1 and 8):\n"
        + limits_text(config_from(defaults), max_connections=defaults.max_connections)
    )
    return p


def config_from(args: argparse.Namespace) -> WorkerConfig:
    """The :class:`WorkerConfig` the parsed settings describe.

    Raises:
        settings.SettingsError: for limits outside their ranges or settings that
            contradict each other.
    """
    if args.vocab_shards > args.vocab:
        raise settings.SettingsError("--vocab-shards must not exceed --vocab")
    if args.tp > 1 and args.port + args.tp - 1 > 65535:
        raise settings.SettingsError(
            f"--port {args.port} with --tp {args.tp}: rank {args.tp - 1} would listen on port "
            f"{args.port + args.tp - 1}, above 65535"
        )
    if args.tls_key and not args.tls_cert:
        raise settings.SettingsError("--tls-key needs --tls-cert")
    if args.draw_burst is not None and args.max_draw_rate is None:
        raise settings.SettingsError("--draw-burst needs --max-draw-rate")
    if args.prepare and (args.vocab_shards > 1 or args.draw_threads == 0):
        raise settings.SettingsError(
            "--prepare needs draw threads and the local chain: not --vocab-shards or "
            "--draw-threads 0"
        )
    return WorkerConfig(
        **keys.link_fields(args, worker=True),
        draft_identity=args.draft_identity,
        max_slots=args.max_slots,
        max_depth=args.max_depth,
        max_support=min(args.max_support, args.vocab),
        max_prefix=args.max_prefix,
        handshake_timeout=args.handshake_timeout,
        idle_timeout=args.idle_timeout,
        max_draw_rate=args.max_draw_rate,
        draw_burst=budgets.DRAW_BURST if args.draw_burst is None else args.draw_burst,
        abandon_rate=args.abandon_rate,
        abandon_burst=2 * args.max_slots if args.abandon_burst is None else args.abandon_burst,
    )


def policy_from(args: argparse.Namespace) -> PrincipalPolicy:
    """The principals' settings (``--principal-rate``, ``--ipv6-prefix``, the lineages).

    Raises:
        settings.SettingsError: for a key ID or the default given twice in
            ``--principal-rate``.
    """
    default: float | None = None
    named: dict[str, float | None] = {}
    seen: set[str | None] = set()
    for ident, rate in args.principal_rate or ():
        if ident in seen:
            shown = "the default" if ident is None else f"key ID {ident or '-'!r}"
            raise settings.SettingsError(f"--principal-rate gives {shown} twice")
        seen.add(ident)
        if ident is None:
            default = rate
        else:
            named[ident] = rate
    return PrincipalPolicy(
        rate=default,
        rates=named,
        ipv6_prefix=args.ipv6_prefix,
        lineage_rate=args.lineage_rate,
        lineage_burst=args.lineage_burst,
    )


def check_exposure(args: argparse.Namespace, config: WorkerConfig) -> None:
    """Refuse to listen beyond loopback without its credential (the protocol listener a key,
    the metrics endpoint a token) unless told ``--insecure``.

    Raises:
        settings.SettingsError: for an address other than loopback without its
            credential (``--psk-file``, ``--metrics-token-file``) nor ``--insecure``;
            ``--key-id`` without ``--check``.
    """
    if args.key_id and not args.check:
        raise settings.SettingsError("--key-id is a Spark side's setting (here: with --check)")
    listeners = [("--host", args.host, "--psk-file", config.keyed)]
    if getattr(args, "metrics_port", None) is not None:
        token = bool(args.metrics_token_file)
        listeners.append(("--metrics-host", args.metrics_host, "--metrics-token-file", token))
    settings.check_listeners(listeners, insecure=args.insecure)


async def check(args: argparse.Namespace, target: str) -> int:
    """Health check: HELLO against ``target`` with this worker's settings; 0 if answered."""
    from pp1wire.aio.client import (  # noqa: PLC0415
        AsyncClient,
        ConnectionLostError,
        RefusedError,
    )
    from pp1wire.wire.spark_core import SparkConfig  # noqa: PLC0415

    host, port = settings.host_port(target)
    cfg = config_from(args)
    spark_cfg = SparkConfig(
        **keys.link_fields(args),
        max_slots=1,
        max_depth=1,
        max_support=0,
        max_prefix=0,
    )
    ctx = None
    if args.tls_cert:
        ctx = ssl.create_default_context(cafile=args.tls_cert)
    try:
        client = await AsyncClient.connect(host, port, spark_cfg, ssl=ctx, timeout=5.0)
    except (OSError, RefusedError, ConnectionLostError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    rtt = await client.ping()
    await client.close()
    print(f"healthy: session {client.session}, ping {rtt * 1e3:.3f} ms")
    print("limits of these settings (a Spark HELLO above any is refused with LIMIT_EXCEEDED):")
    print(limits_text(cfg, max_connections=args.max_connections))
    return 0


async def serve(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the worker until SIGTERM/SIGINT; returns the exit code (``argv``: the command
    line ``--tp N`` hands to the ranks it starts)."""
    config = config_from(args)
    check_exposure(args, config)
    policy = policy_from(args)
    token = keys.read_token(args.metrics_token_file) if args.metrics_token_file else None
    world = worker_tp.world_size(args)
    if world > 1 and not ranks.in_launched_rank():
        return worker_tp.launch(world, list(argv))
    drafter: DrafterFn = settings.make_plugin(args.drafter, vocab_size=args.vocab, seed=args.seed)
    group = worker_tp.join(args, drafter) if world > 1 else None
    rank, port_wanted = 0, args.port
    if group is not None:
        layout, rank, _ = group
        config = dataclasses.replace(config, layout=layout, shard=rank)
        port_wanted += rank
    ctx = None
    if args.tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(args.tls_cert, args.tls_key)
        except OSError as exc:  # ssl.SSLError included
            raise settings.SettingsError(
                f"--tls-cert/--tls-key {args.tls_cert}: {exc.strerror or exc}"
            ) from None
    # Handlers first: a SIGTERM that follows the "listening" line must drain, not kill.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = WorkerServer(
        config,
        drafter,
        max_connections=args.max_connections,
        max_per_address=args.max_per_address,
        slot_idle_timeout=args.slot_idle_timeout,
        ssl_context=ctx,
        busy_poll=args.busy_poll,
        draw_threads=args.draw_threads,
        group=group[2] if group is not None else None,
        max_draw_batch=None if group is not None else args.max_draw_batch,
        policy=policy,
        prepare=args.prepare,
    )
    port = await server.start(args.host, port_wanted)
    out = sys.stdout if rank == 0 else sys.stderr  # stdout's lines are rank 0's
    if group is not None:
        group[2].start()
    metrics_server = None
    if args.metrics_port is not None:
        metrics_server = await metrics.serve(
            server.metrics.registry, args.metrics_host, args.metrics_port, token=token
        )
        bound = metrics_server.sockets[0].getsockname()[1]
        shown = f"pp1-worker metrics on {settings.address_text(args.metrics_host, bound)}"
        print(shown if rank == 0 else f"{shown} (rank {rank})", file=out, flush=True)
    log.info(
        "listening",
        extra={
            "host": args.host,
            "port": port,
            "vocab": args.vocab,
            "tls": bool(ctx),
            "auth": config.keyed,
            "keys": len(config.key_table),
            "metrics_port": args.metrics_port,
        },
    )
    line = f"pp1-worker listening on {settings.address_text(args.host, port)}"
    print(line if rank == 0 else f"{line} (rank {rank})", file=out, flush=True)
    await stop.wait()
    log.info("draining", extra={"connections": len(server.conns)})
    await server.stop()
    if group is not None:
        worker_tp.leave(group[2])
    if metrics_server is not None:
        metrics_server.close()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``pp1-worker`` entry point."""
    line = list(sys.argv[1:] if argv is None else argv)

    async def body(args: argparse.Namespace) -> int:
        return await (check(args, args.check) if args.check else serve(args, line))

    code = settings.run_daemon("pp1-worker", build_parser(), line, body)
    return ranks.end_process(code)  # a rank process ends here


if __name__ == "__main__":
    sys.exit(main())
