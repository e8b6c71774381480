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


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-worker`` argument parser (every flag also reads ``PP1_<FLAG>``)."""
    p = settings.parser(
        "pp1-worker", f"PP1 wire v{WIRE_VERSION} proposer server (the draft worker)."
    )
    p.add_argument(
        "--host",
        type=settings.listen_host,
        default="127.0.0.1",
        metavar="HOST",
        help="listen address; without --psk-file, an address other than loopback needs --insecure",
    )
    p.add_argument(
        "--port", type=settings.port, default=7070, metavar="PORT", help="listen port (0: any free)"
    )
    p.add_argument(
        "--seed", type=settings.count, default=0, metavar="N", help="toy model family seed"
    )
    p.add_argument(
        "--drafter",
        default="pp1wire.apps.models:drafter_factory",
        metavar="MODULE:FACTORY",
        help="drafter plugin; factory(vocab_size=, seed=) -> callable prefix -> logits",
    )
    p.add_argument(
        "--draft-identity",
        type=settings.name,
        default="pp1-toy-drafter",
        metavar="NAME",
        help="the drafter's identity, declared in HELLO (at most 128 characters)",
    )
    p.add_argument(
        "--max-slots",
        type=settings.u16,
        default=4,
        metavar="N",
        help="most slots (concurrent requests) one connection may open, 1..65535",
    )
    p.add_argument(
        "--max-depth",
        type=settings.depth,
        default=5,
        metavar="N",
        help="most draft tokens per proposal, 1..5",
    )
    p.add_argument(
        "--max-support",
        type=settings.support,
        default=256,
        metavar="ENTRIES",
        help="largest sparse support a STEP may ask for, in entries (capped at --vocab)",
    )
    p.add_argument(
        "--max-prefix",
        type=settings.prefix_tokens,
        default=1 << 20,
        metavar="TOKENS",
        help="longest prompt an OPEN may carry, in tokens",
    )
    p.add_argument(
        "--max-connections",
        type=settings.connections,
        default=16,
        metavar="N",
        help="most authenticated connections; when full, a newcomer replaces the oldest "
        "peer still in its handshake, or (once it has itself authenticated) a peer that "
        "had no fresh draw for --slot-idle-timeout",
    )
    p.add_argument(
        "--max-per-address",
        type=settings.connections,
        default=None,
        metavar="N",
        help="most connections from one source address (an IPv6 address's --ipv6-prefix "
        "network), admitted as --max-connections "
        "(a client with several addresses is not limited by it; default: unset, no limit)",
    )
    p.add_argument(
        "--slot-idle-timeout",
        type=settings.seconds,
        default=admission.SLOT_IDLE_S,
        metavar="SECONDS",
        help="a connection that had no fresh draw (a STEP drawn) for this long may be replaced "
        "by a newcomer when the worker is full; COMMIT, OPEN, CLOSE and PING do not count "
        "(one new connection per principal and period is protected for its first 1 s)",
    )
    p.add_argument(
        "--max-draw-rate",
        type=settings.rate,
        default=None,
        metavar="DRAWS/S",
        help="fresh draws per second one slot may ask for, kept per principal across "
        "reconnections; a STEP beyond it is refused with DRAW_RATE_LIMITED: size it as the "
        "most rounds per second one request should run (default: unset, no limit)",
    )
    p.add_argument(
        "--principal-rate",
        type=settings.principal_rate,
        nargs="+",
        default=None,
        metavar="[ID=]RATE",
        help="fresh draws per second one principal may ask for over all its slots and "
        "connections (a second of them at once), beyond which its STEPs are refused with "
        "DRAW_RATE_LIMITED: RATE for every principal, ID=RATE for key ID (=RATE the "
        "default key), RATE 'off' for none; size the default as a light client's draws per "
        "second, and name each key that needs more (default: unset, no cap)",
    )
    p.add_argument(
        "--ipv6-prefix",
        type=settings.ipv6_prefix,
        default=principals.IPV6_PREFIX,
        metavar="BITS",
        help="an IPv6 source address counts as its network of this prefix length, one "
        "address for --max-per-address and for the lineages it may start",
    )
    p.add_argument(
        "--lineage-rate",
        type=settings.rate,
        default=principals.LINEAGE_RATE,
        metavar="LINEAGES/S",
        help="new draw-budget lineages one source address may start per second without a "
        "key, for 10 s after one of its lineages abandoned a draw (a connection that "
        "presents no lineage it was issued waits its turn for its HELLO, in arrival order)",
    )
    p.add_argument(
        "--lineage-burst",
        type=settings.u16,
        default=principals.LINEAGE_BURST,
        metavar="LINEAGES",
        help="new lineages one source address may start at once while --lineage-rate paces it",
    )
    p.add_argument(
        "--draw-burst",
        type=settings.u16,
        default=None,
        metavar="DRAWS",
        help="fresh draws one slot may ask for ahead of --max-draw-rate "
        f"(default: {budgets.DRAW_BURST})",
    )
    p.add_argument(
        "--abandon-rate",
        type=settings.rate,
        default=1.0,
        metavar="DRAWS/S",
        help="fresh draws per second one principal may leave uncommitted (a slot reset or "
        "closed, or its connection lost, before a COMMIT), over all its connections; beyond "
        "them and --abandon-burst its fresh STEPs are refused with DRAW_RATE_LIMITED until "
        "it has paid them back",
    )
    p.add_argument(
        "--abandon-burst",
        type=settings.u16,
        default=None,
        metavar="DRAWS",
        help="uncommitted draws one principal may leave at once (default: 2 x --max-slots)",
    )
    p.add_argument(
        "--busy-poll",
        action="store_true",
        help="spin the event loop while connections are open (lower latency, one busy core)",
    )
    p.add_argument(
        "--draw-threads",
        type=settings.threads,
        default=os.cpu_count() or 1,
        metavar="N",
        help="threads that run the drafter and q construction (default: one per core), "
        "shared fairly between connections; the drafter must be thread-safe; 0 draws on "
        "the event loop",
    )
    p.add_argument(
        "--max-draw-batch",
        type=settings.draw_batch,
        default=draws.MAX_DRAW_BATCH,
        metavar="STEPS",
        help="most STEPs drafted together on one draw thread: one drafter call per position "
        "over all of them, their q rows built in one pass (1: each STEP alone); a vocabulary-"
        "sharded group draws each STEP alone",
    )
    p.add_argument(
        "--tp",
        type=settings.ranks,
        default=1,
        metavar="N",
        help="worker ranks of a vocabulary-sharded group (with --vocab-shards, needs torch): "
        "started with torch's elastic launcher; rank r listens on --port + r",
    )
    p.add_argument(
        "--group-timeout",
        type=settings.seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long any collective of the worker group may wait before the group fails",
    )
    p.add_argument(
        "--match-timeout",
        type=settings.seconds,
        default=5.0,
        metavar="SECONDS",
        help="how long a rank of a sharded group holds a STEP that the group's other links "
        "have not sent (then it answers GROUP_UNMATCHED)",
    )
    p.add_argument(
        "--handshake-timeout",
        type=settings.seconds,
        default=5.0,
        metavar="SECONDS",
        help="a connection must complete HELLO (and AUTH) within this, from accept",
    )
    p.add_argument(
        "--idle-timeout",
        type=settings.seconds,
        default=300.0,
        metavar="SECONDS",
        help="a connection with no message but PING or PONG for this long is closed",
    )
    p.add_argument(
        "--tls-cert", default=None, metavar="FILE", help="PEM certificate (default: none, no TLS)"
    )
    p.add_argument(
        "--tls-key",
        default=None,
        metavar="FILE",
        help="PEM private key for --tls-cert (default: in the certificate file)",
    )
    p.add_argument(
        "--check",
        default=None,
        metavar="HOST:PORT",
        help="health check: HELLO a running worker, exit 0 if it answers (default: serve)",
    )
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
